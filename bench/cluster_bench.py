"""Cluster benchmark: what the Ray cluster costs, and what a second replica gives, in one run.

Workload: one trace of N prompts x IN tokens, OUT generated tokens each, greedy, in two cases:
``none`` (no intervention: the request path alone) and ``ops-save4`` (every invoke saves the last
token's residual at 4 layers every step: reports, saves and the collector carry work). A Llama-3 shape with random bf16 weights (``--shape 1b|8b|70b``), or ``--shape tiny``: the
bundled tiny Llama (CPU). Two phases, each paired like bench/runner_bench.py (new prompts per
pair, the same for both sides; which side runs first alternates by round; a figure is the median
of the pairs' ratios):

    overhead   a one-replica interlace.Cluster against the bare interlace.Model, both up side by
               side on the same device (GPU: the same GPU; CPU: the same core): cluster tok/s /
               Model tok/s, per case. Target on a GPU: >= 0.95.
    plain      the same one-replica cluster against plain vLLM (no interlace, vllm.LLM with the
               same settings) on the same device: cluster tok/s / plain tok/s, per case (plain
               vLLM runs each case's prompts with no intervention: the cost of the whole path).
    scaling    a two-replica cluster: the trace split across both replicas against the same trace
               kept whole on one of them (min_shard_invokes past N). Target: >= 1.9x with one GPU
               per replica; on a machine with one GPU the two replicas share it (half a GPU each),
               and on CPU each replica has one core: reported as such. Case ops-save4.
    throughput the same two-replica cluster, two traces of N prompts each (each kept whole, as a
               sweep's or a server's traces are): submitted together, so each replica runs one
               at full batch, against one after the other, so one replica runs at a time. What a
               second replica adds when the batch per replica stays the same (``scaling`` also
               halves it), with both replicas' saves still going to the one driver.

Every cluster trace also prints where its time went on the driver (``driver_phases``: seconds
from its start for building the invokes, submit, each shard's round trip to its replica, the
collector's take and the assembly), to find what does not shrink with a second replica.

Engines run as interlace starts them by default: compiled with CUDA graphs and the default graph
taps on a GPU (plain vLLM with its own graphs), eager on a CPU.

Usage: python bench/cluster_bench.py [--n 256] [--in 128] [--out 128] [--repeats 3] [--shape 1b]
       [--phases overhead,plain,scaling,throughput]
GPU machines: bash bench/gpu_session.sh python3 bench/cluster_bench.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import shapes
from runner_bench import config, interlace_cases, plain_engine, prompts, run_plain


class DriverPhases:
    """Where a cluster trace's time goes, seen from the driver: submit (checks and payloads), each
    shard's ``Replica.run`` round trip, the collector's ``take`` (with the saves mapped) and the
    assembly of results. Wraps the Cluster's own methods, as bench/step_probe.py wraps the
    runner's; the replica's side of a shard is one interval here."""

    def __init__(self):
        from interlace import cluster_client

        self.spans: list[tuple[str, float, float]] = []
        cls = self.cluster_type = cluster_client.Cluster
        for name in ("_run_shard", "_take"):
            setattr(cls, name, self._timed_async(getattr(cls, name), name.strip("_")))
        cls.submit = self._timed(cls.submit, "submit")
        cluster_client.assemble = self._timed(cluster_client.assemble, "assemble")

    def _timed(self, fn, name):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((name, started, time.perf_counter()))
        return wrapper

    def _timed_async(self, fn, name):
        async def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                self.spans.append((name, started, time.perf_counter()))
        return wrapper

    def summary(self, started: float, built: float, ended: float) -> dict:
        """Seconds from the trace's start: building its invokes, each phase's span, the end."""
        spans, self.spans = self.spans, []
        out = {"build_s": round(built - started, 3)}
        for name in ("submit", "run_shard", "take", "assemble"):
            mine = [(a - started, b - started) for n, a, b in spans if n == name]
            if mine:
                out[name] = [f"{a:.3f}-{b:.3f}" for a, b in mine]
        out["total_s"] = round(ended - started, 3)
        return out


PHASES: DriverPhases | None = None  # set in main for the cluster phases


def run_trace(target, data, out: int, case: dict) -> tuple[float, int]:
    started = time.perf_counter()
    with target.trace(max_tokens=out, ignore_eos=True, timeout_s=3600) as tr:
        for p in data:
            tr.invoke(p, **case)
        built = time.perf_counter()
    ended = time.perf_counter()
    if PHASES is not None and isinstance(target, PHASES.cluster_type):
        print(json.dumps({"driver_phases": PHASES.summary(started, built, ended)}), flush=True)
    return ended - started, sum(len(r.token_ids) for r in tr.result)


def run_traces(cluster, batches: list, out: int, case: dict, together: bool) -> tuple[float, int]:
    """Several traces on a cluster: each submitted as soon as it is built (``together``), or each
    run to its end before the next is built."""
    started = time.perf_counter()
    futures, results = [], []
    for data in batches:
        tr = cluster.trace(max_tokens=out, ignore_eos=True, timeout_s=3600)
        for p in data:
            tr.invoke(p, **case)
        futures.append(cluster.submit(tr))
        if not together:
            results.append(futures.pop().result())
    results += [future.result() for future in futures]
    seconds = time.perf_counter() - started
    if PHASES is not None:  # the shards' round trips overlap when submitted together
        print(json.dumps({"driver_phases": PHASES.summary(started, started, started + seconds),
                          "traces": len(batches), "together": together}), flush=True)
    return seconds, sum(len(r.token_ids) for result in results for r in result.invokes)


def paired(name: str, sides: dict, data_for, repeats: int) -> dict:
    """Alternate the two sides over ``repeats`` rounds on fresh prompts; ratios second / first."""
    (base_name, base), (other_name, other) = sides.items()
    rates: dict[str, list[float]] = {base_name: [], other_name: []}
    ratios = []
    for round_ in range(repeats):
        data = data_for()
        order = [(base_name, base), (other_name, other)][:: 1 if round_ % 2 == 0 else -1]
        timed = {}
        for side, run in order:
            seconds, tokens = run(data)
            timed[side] = tokens / seconds
            rates[side].append(timed[side])
        ratios.append(timed[other_name] / timed[base_name])
        print(json.dumps({"phase": name, "round": round_, **{f"{k}_tok_s": round(v) for k, v in timed.items()},
                          "ratio": round(ratios[-1], 3)}), flush=True)
    return {"phase": name, "base": base_name, "other": other_name, "base_tok_s": statistics.median(rates[base_name]),
            "other_tok_s": statistics.median(rates[other_name]), "ratio": statistics.median(ratios),
            "min": min(ratios), "max": max(ratios)}


def cluster_config(cfg, replicas: int, gpus: int):
    from interlace.cluster.config import ClusterConfig, ResourcesConfig

    if gpus:  # one GPU per replica where there are enough, else the replicas share GPU 0
        per_rank = 1.0 if gpus >= replicas else 1.0 / replicas
        return ClusterConfig(model=cfg, replicas=replicas, resources=ResourcesConfig(num_gpus=per_rank),
                             max_in_flight=4)
    return ClusterConfig(model=cfg, replicas=replicas, max_in_flight=4, cpu_cores=[[i] for i in range(replicas)])


def placement(gpus: int, replicas: int) -> str:
    if not gpus:
        return f"CPU, one core per replica ({os.cpu_count()} cores)"
    return f"one GPU per replica ({gpus} GPUs)" if gpus >= replicas else f"{replicas} replicas sharing one GPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs per phase")
    shapes.add_argument(parser)
    parser.add_argument("--phases", default="overhead,plain,scaling,throughput")
    args = parser.parse_args()
    args.tp = args.pp = 1

    import ray
    import torch

    import interlace

    gpus = torch.cuda.device_count()
    if not gpus:
        os.environ["INTERLACE_CPU_CORES"] = "0"  # the bare Model on the core the one-replica cluster gets
    args.graphs = gpus > 0  # interlace's default: compiled with graph taps on a GPU, eager on a CPU
    cfg = config(args)
    phases = args.phases.split(",")
    if gpus and "plain" in phases and "overhead" in phases:  # three engines share the GPU for a while
        cfg = cfg.model_copy(update={"engine_args": {**cfg.engine_args, "gpu_memory_utilization": 0.28}})
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    global PHASES
    PHASES = DriverPhases()
    seeds = itertools.count(1)
    results = []

    model = interlace.Model(cfg)
    hf = model.engine.llm_engine.model_config.hf_config
    vocab = min(1000, hf.vocab_size)
    cases = interlace_cases(hf.hidden_size, hf.num_hidden_layers)
    case = cases["ops-save4"]
    fresh = lambda: prompts(args.n, args.inp, vocab, seed=next(seeds))  # noqa: E731

    if "overhead" in phases or "plain" in phases:
        one = interlace.Cluster(cluster_config(cfg, 1, gpus))
        run_trace(model, fresh(), args.out, case)  # warm-ups at full size
        run_trace(one, fresh(), args.out, case)
        for name in ("none", "ops-save4") if "overhead" in phases else ():
            results.append(paired(f"overhead {name}", {
                "model": lambda d, c=cases[name]: run_trace(model, d, args.out, c),
                "cluster-1": lambda d, c=cases[name]: run_trace(one, d, args.out, c)},
                fresh, args.repeats) | {"where": placement(gpus, 1)})
        if "plain" in phases:
            model.close()  # on a CPU, plain vLLM takes the bare Model's core
            plain = plain_engine(cfg)
            run_plain(plain, fresh(), args.out)
            for name in ("none", "ops-save4"):
                results.append(paired(f"plain {name}", {
                    "vllm": lambda d: run_plain(plain, d, args.out),
                    "cluster-1": lambda d, c=cases[name]: run_trace(one, d, args.out, c)},
                    fresh, args.repeats) | {"where": placement(gpus, 1)})
            plain.llm_engine.engine_core.shutdown()
        one.close()
    model.close()

    if "scaling" in phases or "throughput" in phases:
        two = interlace.Cluster(cluster_config(cfg, 2, gpus))
        split = two.config
        whole = split.model_copy(update={"min_shard_invokes": args.n + 1})  # one shard: one replica

        def on(config):
            def run(data):
                two.config = config  # read per trace by the shard planner
                return run_trace(two, data, args.out, case)
            return run

        on(split)(fresh())  # warm-up: both replicas at full size
        if "scaling" in phases:
            results.append(paired("scaling ops-save4", {"1-replica": on(whole), "2-replicas": on(split)},
                                  fresh, args.repeats) | {"where": placement(gpus, 2)})
        if "throughput" in phases:
            two.config = whole
            run_traces(two, [fresh(), fresh()], args.out, case, together=True)  # warm-up: N per replica
            results.append(paired("throughput ops-save4", {
                "one-by-one": lambda batches: run_traces(two, batches, args.out, case, together=False),
                "together": lambda batches: run_traces(two, batches, args.out, case, together=True)},
                lambda: [fresh(), fresh()], args.repeats) | {"where": placement(gpus, 2)})
        two.close()
    ray.shutdown()

    device = torch.cuda.get_device_name(0) if gpus else "CPU"
    print(f"\n{args.n} prompts x {args.inp} in / {args.out} out, {cfg.name} ({cfg.dtype}), {device}; "
          f"{args.repeats} pairs per phase")
    print(f"{'phase, case':22} {'base':>10} {'tok/s':>9} {'other':>11} {'tok/s':>9} {'ratio':>6} {'min':>6} {'max':>6}  placement")
    for r in results:
        print(f"{r['phase']:22} {r['base']:>10} {r['base_tok_s']:9.0f} {r['other']:>11} {r['other_tok_s']:9.0f} "
              f"{r['ratio']:6.2f} {r['min']:6.2f} {r['max']:6.2f}  {r['where']}")


if __name__ == "__main__":
    main()
