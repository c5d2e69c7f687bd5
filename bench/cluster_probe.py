"""Where a one-replica cluster's time goes: the same trace (no interventions) through each layer
between plain vLLM and ``interlace.Cluster``, all up at once on one device, in paired rounds.

    plain         vllm.LLM, no interlace (the reference: each ratio is against it)
    model         interlace.Model (a synchronous vllm.LLM in this process)
    async         vLLM's AsyncLLM in this process as a replica starts it (cluster/engine.py:
                  start_async_engine), the replica's request path (build_requests, one generate
                  per invoke, gathered)
    async-stats   the same keeping scheduler stats, as a Serve replica does (keep_stats)
    async-logged  the same with vLLM's default stat loggers on, as replicas ran before 2026-12-04
                  (an AsyncLLM made from a config logs stats unless told not to)
    cluster       a one-replica interlace.Cluster (the AsyncLLM in a Ray actor)

Each round runs every side once on the same new prompts, in an order that rotates by round, so
the host's drift falls on all sides alike; a figure is the median of the rounds' ratios to plain.

Usage: python bench/cluster_probe.py [--n 256] [--in 128] [--out 128] [--repeats 8] [--shape 1b]
       [--sides plain,model,async,async-logged,cluster]
GPU machines: bash bench/gpu_session.sh python3 bench/cluster_probe.py --shape 1b --graphs
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time

import shapes
from cluster_bench import cluster_config
from runner_bench import config, plain_engine, prompts, run_plain

SIDES = ("plain", "model", "async", "async-stats", "async-logged", "cluster")


def time_model(target, data, out) -> float:
    started = time.perf_counter()
    with target.trace(max_tokens=out, ignore_eos=True, timeout_s=3600) as tr:
        for p in data:
            tr.invoke(p)
    return sum(len(r.token_ids) for r in tr.result) / (time.perf_counter() - started)


def async_side(cfg, loop, stats: str):
    """``stats``: "none" (a replica's), "kept" (a Serve replica's) or "logged" (vLLM's default
    loggers, by starting the engine with from_vllm_config's own default)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from interlace.cluster.assembly import build_requests
    from interlace.cluster.engine import start_async_engine
    from interlace.cluster.replica import _final as final

    made = AsyncLLM.from_vllm_config
    if stats == "logged":
        AsyncLLM.from_vllm_config = lambda *a, **k: made(*a, **{**k, "disable_log_stats": False})
    try:
        engine = loop.run_until_complete(start_async_engine(cfg, keep_stats=stats == "kept"))
    finally:
        AsyncLLM.from_vllm_config = made

    async def go(data, out):
        prompts_, params = build_requests(data, [None] * len(data), {"max_tokens": out, "ignore_eos": True,
                                                                     "temperature": 0.0}, "probe")
        ids = [f"probe-{next(_ids)}" for _ in data]
        outs = await asyncio.gather(*(final(engine.generate(p, s, r)) for p, s, r in zip(prompts_, params, ids)))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def run(data, out):
        started = time.perf_counter()
        tokens = loop.run_until_complete(go(data, out))
        return tokens / (time.perf_counter() - started)

    return run


_ids = itertools.count()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--graphs", action="store_true", help="engines compiled with CUDA graphs (interlace's default on a GPU)")
    shapes.add_argument(parser)
    parser.add_argument("--sides", default="plain,model,async,async-logged,cluster")
    args = parser.parse_args()
    args.tp = args.pp = 1
    sides = args.sides.split(",")
    if sides[0] != "plain" or not set(sides) <= set(SIDES):
        parser.error(f"--sides: plain first, then any of {SIDES[1:]}")

    import psutil
    import ray
    import torch

    import interlace

    gpus = torch.cuda.device_count()
    cfg = config(args)
    if gpus:  # every side's engine on the one GPU
        cfg = cfg.model_copy(update={"engine_args": {**cfg.engine_args, "gpu_memory_utilization": 0.8 / len(sides)}})
    vocab = 200 if args.shape == "tiny" else 1000  # the tiny model's vocabulary is small
    loop = asyncio.new_event_loop()
    runs = {}
    for side in sides:
        if side == "plain":
            llm = plain_engine(cfg)
            runs[side] = lambda d, o, llm=llm: (lambda s, t: t / s)(*run_plain(llm, d, o))
        elif side == "model":
            model = interlace.Model(cfg)
            runs[side] = lambda d, o, model=model: time_model(model, d, o)
        elif side.startswith("async"):
            runs[side] = async_side(cfg, loop, {"async": "none", "async-stats": "kept", "async-logged": "logged"}[side])
        else:
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
            cluster = interlace.Cluster(cluster_config(cfg, 1, gpus))
            runs[side] = lambda d, o, cluster=cluster: time_model(cluster, d, o)
    seeds = itertools.count(1)
    for run in runs.values():  # warm-up
        run(prompts(args.n, args.inp, vocab, seed=next(seeds)), args.out)
    ratios: dict[str, list[float]] = {side: [] for side in sides[1:]}
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.repeats):
        data = prompts(args.n, args.inp, vocab, seed=next(seeds))
        order = sides[round_ % len(sides):] + sides[:round_ % len(sides)]
        this = {side: runs[side](data, args.out) for side in order}
        for side in sides:
            rates[side].append(this[side])
        for side in sides[1:]:
            ratios[side].append(this[side] / this["plain"])
        print(json.dumps({"round": round_, **{side: round(rate) for side, rate in this.items()}}), flush=True)
    print(f"\n{args.n} prompts x {args.inp} in / {args.out} out, {args.shape} shape, "
          f"{'graphs' if args.graphs else 'eager'}, {torch.cuda.get_device_name(0) if gpus else 'CPU'}; "
          f"{args.repeats} rounds, all sides up at once")
    print(f"{'plain':14} {statistics.median(rates['plain']):9.0f} tok/s")
    for side, values in ratios.items():
        print(f"{side:14} {statistics.median(rates[side]):9.0f} tok/s  {statistics.median(values):5.2f} x plain "
              f"(min {min(values):.2f}, max {max(values):.2f})")
    if "cluster" in runs:
        cluster.close()
        ray.shutdown()
    for child in psutil.Process().children(recursive=True):  # the engine cores
        child.kill()
    os._exit(0)  # an AsyncLLM shut down outside its event loop hangs in zmq's context teardown


if __name__ == "__main__":
    main()
