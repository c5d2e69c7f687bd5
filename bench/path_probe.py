"""Path probe: where a one-invoke trace's time goes on its way through a one-replica Cluster (a
diagnostic, not a figure).

C closed-loop clients (threads of this process) each send T one-invoke traces through
``interlace.Cluster``, one after the other: the endpoint's workload without HTTP. Every trace is
timed at each hop, by wrappers installed from outside the code under test (here in the driver,
and in the replica actor through Ray's ``worker_process_setup_hook``):

    dispatch      the client's call until the replica starts the shard (the driver's event loop,
                  the collector's ``expect``, Ray's actor call)
    generate      the replica's requests on its engine (vLLM's AsyncLLM: queueing and generation)
    reports       from the last output until the shard's reports are read from the sink folder
    to collector  handing them to the collector
    answer        from the replica's return until the driver has the completions
    take          the collector's ``take`` and the saves' fetch
    assemble      the rest until the client has its result

Cases: ``none`` (plain requests), ``serve`` (serve_bench's ops: a steering add at the middle
layer and the last token's residual saved at the last layer, every step).

Usage: python bench/path_probe.py [--shape tiny] [--clients 64] [--traces 4] [--in 128] [--out 128]
       [--cases none,serve] [--repeats 2]
GPU machines: bash bench/gpu_session.sh python3 bench/path_probe.py --shape 1b
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time

import shapes  # bench/, this script's folder
from runner_bench import prompts

_RECORDS = os.path.join(tempfile.gettempdir(), "interlace-path-probe")


def _timed(record, name: str, fn):
    """``fn`` (a coroutine function of a shard task, self first) recording its start and end."""
    @functools.wraps(fn)
    async def wrapper(self, *args, **kwargs):
        started = time.time()
        try:
            return await fn(self, *args, **kwargs)
        finally:
            task = next((a for a in args if hasattr(a, "trace")), None)
            record(name, getattr(task, "trace", None), started, time.time())
    return wrapper


def install_replica_timers() -> None:
    """Ray's worker_process_setup_hook: time the Replica's hops in every worker of this job."""
    from interlace.cluster import replica

    out = open(os.path.join(_RECORDS, f"{os.getpid()}.jsonl"), "a", buffering=1)

    def record(name, trace, start, end):
        out.write(json.dumps([name, trace, start, end]) + "\n")

    for name in ("_run", "_generate", "_reports"):
        setattr(replica.Replica, name, _timed(record, name, getattr(replica.Replica, name)))

    from interlace.cluster import assembly
    read = assembly.read_new_reports

    def read_new_reports(folder, seen):  # when each report file was written, and when it was read
        reports = read(folder, seen)
        if reports:
            written = max(path.stat().st_mtime for path in folder.glob("*.reports"))
            record("report file", folder.name.split(".")[0], written, time.time())
        return reports

    assembly.read_new_reports = read_new_reports


def time_reporter_on_import() -> None:
    """Once this process imports interlace's reporter, time each report job: when it was handed
    over, started and ended (records keyed by the trace)."""
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "interlace.workers.reporter":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _time_reporter(module.Reporter)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _time_reporter(reporter_class) -> None:
    out = open(os.path.join(_RECORDS, f"{os.getpid()}.jsonl"), "a", buffering=1)
    submit = reporter_class.submit

    last = [0.0]  # when the thread's last job ended

    def timed_submit(self, job):
        func = getattr(job, "func", None)
        name = getattr(func, "__name__", "")
        batches = [job.args[0]] if name == "_write_reports" else job.args[0] if name == "_write_together" else []
        traces = [args[1] if isinstance(args[0], str) else args[0].trace  # (sink, trace, ...) before 2026-12-05
                  for args in ([job.args] if name == "_write_reports" else [(b,) for b in batches])]
        handed = time.time()

        def timed_job():
            started = time.time()
            free = max(handed, last[0])  # from when the thread could have started it
            try:
                job()
            finally:
                last[0] = time.time()
                for trace in traces:
                    out.write(json.dumps(["report job", trace.split(".")[0], handed, started, last[0], free]) + "\n")
        return submit(self, timed_job)

    reporter_class.submit = timed_submit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    shapes.add_argument(parser)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--traces", type=int, default=4)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--cases", default="none,serve")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="every process's sys.setswitchinterval (Python's default: 5 ms), through a sitecustomize")
    args = parser.parse_args()

    os.makedirs(_RECORDS, exist_ok=True)
    for name in os.listdir(_RECORDS):
        os.remove(os.path.join(_RECORDS, name))
    here = [os.path.dirname(os.path.abspath(__file__))]
    # Every process of the job (the engine's too, which Ray does not start) imports this
    # sitecustomize: it times the reporter's jobs where the engine runs them.
    site = tempfile.mkdtemp(prefix="interlace-path-probe-site-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        if args.switch_interval_ms is not None:  # an A/B of how long a thread waits for the GIL
            f.write(f"import sys\nsys.setswitchinterval({args.switch_interval_ms / 1000!r})\n")
            sys.setswitchinterval(args.switch_interval_ms / 1000)
        f.write("import path_probe\npath_probe.time_reporter_on_import()\n")
    here.append(site)
    os.environ["PYTHONPATH"] = os.pathsep.join(here + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])

    import ray
    import torch
    from transformers import AutoConfig

    import interlace
    from interlace import ops
    from interlace.cluster.config import ClusterConfig, ResourcesConfig
    from interlace import cluster_client

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"worker_process_setup_hook": "path_probe.install_replica_timers"})
    gpus = torch.cuda.is_available()
    model = shapes.model_config(args)
    hf = AutoConfig.from_pretrained(model.checkpoint_path())
    layers = hf.num_hidden_layers
    dtype = torch.bfloat16 if gpus else torch.float32
    vectors = [(torch.randn(hf.hidden_size) * 0.01).to(dtype) for _ in range(args.clients)]

    driver: list = []  # (name, trace, start, end) in this process
    lock = threading.Lock()

    def record(name, trace, start, end):
        with lock:
            driver.append((name, trace, start, end))

    client_class = cluster_client.Cluster
    original_take = client_class._take

    async def take(self, trace_id):
        started = time.time()
        try:
            return await original_take(self, trace_id)
        finally:
            record("take", trace_id, started, time.time())

    client_class._take = take
    original_run_shard = client_class._run_shard
    client_class._run_shard = _timed(record, "shard", original_run_shard)

    resources = ResourcesConfig(num_cpus=1, num_gpus=1) if gpus else ResourcesConfig(num_cpus=1)
    cluster = interlace.Cluster(ClusterConfig(model=model, replicas=1, resources=resources, max_in_flight=args.clients))
    seeds = itertools.count(1)

    def case_ops(case: str, client: int) -> list[dict]:
        if case == "none":
            return []
        return [ops.add(f"layers.{layers // 2}.resid", vectors[client]),
                ops.save(f"layers.{layers - 1}.resid", tokens="last")]

    def one_round(case: str) -> tuple[float, list[tuple[float, float, str]]]:
        data = [prompts(args.traces, args.inp, min(1000, hf.vocab_size), seed=next(seeds)) for _ in range(args.clients)]
        done: list[tuple[float, float, str]] = []  # (start, end, trace) per trace

        def client(c: int) -> None:
            for t in range(args.traces):
                started = time.time()
                with cluster.trace(max_tokens=args.out, ignore_eos=True) as tr:
                    tr.invoke(data[c][t], ops=case_ops(case, c))
                with lock:
                    done.append((started, time.time(), tr.result))

        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return time.perf_counter() - started, done

    for case in args.cases.split(","):  # warm-up
        one_round(case)
    print(f"{args.clients} clients x {args.traces} one-invoke traces, {args.inp} in / {args.out} out; {args.shape}")
    for case in args.cases.split(",") * args.repeats:
        driver.clear()
        for name in os.listdir(_RECORDS):
            open(os.path.join(_RECORDS, name), "w").close()
        seconds, done = one_round(case)
        time.sleep(0.5)  # the replica's last records
        replica = []
        for name in os.listdir(_RECORDS):
            with open(os.path.join(_RECORDS, name)) as f:
                replica += [json.loads(line) for line in f if line.strip()]
        by_trace: dict = collections.defaultdict(dict)
        for name, trace, *times in driver + [tuple(r) for r in replica]:
            by_trace[trace][name] = times
        hops = collections.defaultdict(list)
        shards = [t for t in by_trace.values() if {"shard", "take", "_run", "_generate"} <= t.keys()]
        for t in shards:
            shard, take, run, gen = t["shard"], t["take"], t["_run"], t["_generate"]
            hops["dispatch (shard call to replica start)"].append(run[0] - shard[0])
            hops["generate"].append(gen[1] - gen[0])
            if "_reports" in t:
                hops["reports (wait and read)"].append(t["_reports"][1] - t["_reports"][0])
            if "report job" in t:  # handed to the engine's reporter thread, started, ended
                handed, started, ended, free = t["report job"]
                hops["  report job handed over"].append(handed - gen[1])
                hops["  report job waited"].append(started - handed)
                hops["    for jobs before it"].append(free - handed)
                hops["    for the thread to run"].append(started - free)
                hops["  report job ran"].append(ended - started)
            if "report file" in t:  # written (its mtime) after the last output came, then read
                hops["  report file written"].append(t["report file"][0] - gen[1])
                hops["  report file read"].append(t["report file"][1] - t["report file"][0])
                hops["to collector"].append(run[1] - t["_reports"][1])
            else:
                hops["to collector"].append(run[1] - gen[1])
            hops["answer (replica return to driver)"].append(shard[1] - run[1])
            hops["take"].append(take[1] - take[0])
            hops["shard call, whole"].append(shard[1] - shard[0])
        latency = sorted(end - start for start, end, _r in done)
        print(f"{case:6} {len(done) / seconds:7.1f} traces/s, result p50 {statistics.median(latency) * 1e3:7.1f} ms "
              f"({len(shards)} of {len(done)} traces timed at every hop); per trace, ms p50 / p90:")
        for name, values in hops.items():
            values.sort()
            print(f"    {name:40} {statistics.median(values) * 1e3:8.2f} / {values[int(0.9 * (len(values) - 1))] * 1e3:8.2f}")
    cluster.close()
    ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
