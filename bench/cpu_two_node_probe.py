"""A TP x PP interlace.Cluster replica spread over two Ray nodes on this CPU host, against one engine.

Start two nodes first, each with 2 CPUs and 2 rank slots (a replica of 4 one-CPU ranks fits neither
node, so interlace spreads it, two ranks a node; the head on 127.0.0.1, the other on 127.0.0.2):

    export RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1
    VLLM_HOST_IP=127.0.0.1 .venv/bin/ray start --head --node-ip-address=127.0.0.1 --port=6391 --num-cpus=2 \
        --resources='{"interlace_cpu_rank": 2}' --include-dashboard=false --temp-dir $(mktemp -d)
    VLLM_HOST_IP=127.0.0.2 .venv/bin/ray start --address=127.0.0.1:6391 --node-ip-address=127.0.0.2 --num-cpus=2 \
        --resources='{"interlace_cpu_rank": 2}' --temp-dir $(mktemp -d)
    RAY_AUTH_MODE=disabled .venv/bin/python bench/cpu_two_node_probe.py      # then: ray stop --force

Prints the tokens of both, the reports that came to the replica through Ray, and the saves' largest
difference. tests/test_multinode.py covers PP=2 over two nodes in the suite; this TP=2 x PP=2 run is
too slow for it on a 2-core machine (about 50 s).
"""
import os, sys, time
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
def main():
    import ray
    t0 = time.time()
    ray.init(address="127.0.0.1:6391")
    print("nodes", [(n["NodeManagerAddress"], n["Resources"]) for n in ray.nodes()], time.time()-t0, flush=True)
    import interlace
    from interlace.cluster.config import ClusterConfig, ModelConfig, ResourcesConfig
    model = ModelConfig.load("tiny-llama").model_copy(update={"pipeline_parallel_size": 2, "tensor_parallel_size": 2})
    cfg = ClusterConfig(model=model, replicas=1, resources=ResourcesConfig(num_cpus=1))
    global prog
    @interlace.batched
    def prog(m):
        m.share("s", m.last(m.layers[0].resid), merge="sum")
        m.layers[1].resid *= 1.1
        m.save("h", m.last(m.layers[3].resid))
    with interlace.Cluster(cfg) as cl:
        print("cluster up", time.time()-t0, flush=True)
        tr = cl.trace(max_tokens=4, ignore_eos=True)
        for p in ["The capital of France is", "Hello there"]:
            tr.invoke(p, program=prog)
        got = tr.run()
        print("RESULT", [x.token_ids for x in got], time.time()-t0, cl.replica_info()[0]["reports_delivered"], flush=True)
    ref = interlace.Model("tiny-llama")
    tr2 = ref.trace(max_tokens=4, ignore_eos=True)
    for p in ["The capital of France is", "Hello there"]:
        tr2.invoke(p, program=prog)
    want = tr2.run()
    print("REF", [x.token_ids for x in want], want.shared, flush=True)
    import torch
    print("SAVES", [(g.saves["h"] - w.saves["h"]).abs().max().item() for g, w in zip(got, want)], flush=True)
    ref.close()
    ray.shutdown()

if __name__ == '__main__':
    main()
