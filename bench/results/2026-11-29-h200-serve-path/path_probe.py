"""Where a one-replica Cluster's time goes with C closed-loop clients of one-invoke traces (serve_bench's
workload without HTTP): req/s with and without ops, CPU seconds per process, py-spy of each process."""
import argparse, itertools, os, signal, subprocess, sys, threading, time
sys.path.insert(0, os.path.join(os.getcwd(), "bench"))
import torch, ray, psutil, interlace
from interlace import ops
from interlace.cluster.config import ClusterConfig, ResourcesConfig
from runner_bench import prompts
import shapes
p = argparse.ArgumentParser(); shapes.add_argument(p)
p.add_argument("--clients", type=int, default=64); p.add_argument("--traces", type=int, default=4)
p.add_argument("--out", type=int, default=128); p.add_argument("--inp", type=int, default=128)
p.add_argument("--spy", default=""); p.add_argument("--rounds", default="noops,ops,noops,ops")
a = p.parse_args()
C, T = a.clients, a.traces
gpus = torch.cuda.is_available()
cfg = shapes.model_config(a)
ray.init(address="local", include_dashboard=False, log_to_driver=False)
res = ResourcesConfig(num_cpus=1, num_gpus=1) if gpus else ResourcesConfig(num_cpus=1)
cl = interlace.Cluster(ClusterConfig(model=cfg, replicas=1, resources=res, max_in_flight=C))
from transformers import AutoConfig
hf = AutoConfig.from_pretrained(cfg.checkpoint_path())
dtype = torch.bfloat16 if gpus else torch.float32
vecs = [(torch.randn(hf.hidden_size) * 0.01).to(dtype) for _ in range(C)]
L = hf.num_hidden_layers
def case(c): return [ops.add(f"layers.{L//2}.resid", vecs[c]), ops.save(f"layers.{L-1}.resid", tokens="last")]
seeds = itertools.count(1)
def run_round(use_ops):
    data = [prompts(T, a.inp, min(1000, hf.vocab_size), seed=next(seeds)) for _ in range(C)]
    lat = []
    def client(c):
        for t in range(T):
            s = time.perf_counter()
            with cl.trace(max_tokens=a.out, ignore_eos=True) as tr:
                tr.invoke(data[c][t], ops=case(c) if use_ops else [])
            lat.append(time.perf_counter() - s)
    th = [threading.Thread(target=client, args=(c,)) for c in range(C)]
    s = time.perf_counter(); [t.start() for t in th]; [t.join() for t in th]
    lat.sort()
    return time.perf_counter() - s, lat[len(lat)//2]
run_round(True); run_round(False)
def pid(pattern):
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out if int(x) != os.getpid()]
procs = {"replica": pid("ray::Replica"), "engine": pid("EngineCore"), "collector": pid("ray::Collector"), "driver": [os.getpid()]}
print("pids", procs, flush=True)
procs = {n: [psutil.Process(x) for x in v] for n, v in procs.items() if v}
spy_bin = os.path.join(os.getcwd(), ".gpuwork", "py-spy")
out_dir = os.environ.get("OUT", "/tmp")
for k, r in enumerate(a.rounds.split(",")):
    use_ops = r == "ops"
    before = {n: sum(sum(p.cpu_times()[:2]) for p in ps) for n, ps in procs.items()}
    spies = []
    if use_ops and a.spy and k == len(a.rounds.split(",")) - 1:
        for n, ps in procs.items():
            for p in ps:
                spies.append(subprocess.Popen([spy_bin, "record", "-p", str(p.pid), "-r", "200", "-f", "raw", "--nonblocking", "--threads",
                                               "-o", f"{out_dir}/spy-{a.spy}-{n}-{p.pid}.txt"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        time.sleep(1.0)
    s, p50 = run_round(use_ops)
    for sp in spies:
        sp.send_signal(signal.SIGINT)
    for sp in spies:
        try:
            sp.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sp.kill()
        err = sp.stderr.read().decode()[-300:]
        if "Wrote" not in err: print("py-spy:", err, flush=True)
    cpu = {n: round(sum(sum(p.cpu_times()[:2]) for p in ps) - before[n], 2) for n, ps in procs.items()}
    print(f"{r}: {C*T/s:.1f} req/s ({s:.2f} s, latency p50 {p50:.3f} s); CPU s by process {cpu}", flush=True)
print("step counts", cl.step_counts(), flush=True)
cl.close()
