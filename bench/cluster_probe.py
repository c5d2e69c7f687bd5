"""Where a one-replica cluster's time goes: the same trace (no interventions) through each layer
between the bare ``interlace.Model`` and ``interlace.Cluster``, one engine at a time, in one run.

    model        interlace.Model (a synchronous vllm.LLM in this process)
    async        vLLM's AsyncLLM in this process, the replica's request path (build_requests,
                 one generate per invoke, gathered), engine arguments as the replica's
    async-quiet  the same with log stats off (vllm.LLM's default)
    cluster      a one-replica interlace.Cluster (the AsyncLLM in a Ray actor)
    cluster-quiet  the same with log stats off

Usage: python bench/cluster_probe.py [--n 256] [--in 128] [--out 128] [--repeats 3] [--shape 1b]
       [--sides model,async,...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

import shapes
from runner_bench import config, prompts


def time_model(target, data, out):
    started = time.perf_counter()
    with target.trace(max_tokens=out, ignore_eos=True, timeout_s=3600) as tr:
        for p in data:
            tr.invoke(p)
    return sum(len(r.token_ids) for r in tr.result) / (time.perf_counter() - started)


def async_side(cfg, quiet: bool):
    from interlace.cluster.assembly import build_requests
    from interlace.cluster.engine import start_async_engine

    loop = asyncio.new_event_loop()
    overrides = {"disable_log_stats": True} if quiet else {}
    engine = loop.run_until_complete(start_async_engine(cfg, **overrides))

    async def go(data, out):
        from interlace.cluster.replica import _final as final
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


def _kill_children() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        child.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    shapes.add_argument(parser)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--sides", default="model,async,async-quiet,cluster,cluster-quiet")
    args = parser.parse_args()
    args.tp = args.pp = 1

    import torch

    gpus = torch.cuda.device_count()
    if args.one:
        rates, close = one_side(args, args.one, gpus)
        print("RATES " + json.dumps(rates), flush=True)
        close()
        os._exit(0)  # an AsyncLLM shut down outside its event loop hangs in zmq's context teardown
    # Each side in its own process: nothing of one engine (GPU memory, sockets) outlives it.
    summary = {}
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, "--one", side, "--n", str(args.n), "--in", str(args.inp),
               "--out", str(args.out), "--repeats", str(args.repeats)] + ["--shape", args.shape]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RATES ")), None)
        if line is None:
            print(f"{side}: failed\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}", flush=True)
            continue
        rates = json.loads(line[6:])
        summary[side] = statistics.median(rates)
        print(json.dumps({"side": side, "tok_s": [round(r) for r in rates]}), flush=True)
    base = summary.get("model") or next(iter(summary.values()))
    print(f"\n{args.n} prompts x {args.inp} in / {args.out} out, "
          f"{torch.cuda.get_device_name(0) if gpus else 'CPU'}; median of {args.repeats}, one process per side")
    for side, rate in summary.items():
        print(f"{side:14} {rate:9.0f} tok/s  {rate / base:5.2f} x model")


def one_side(args, side: str, gpus: int) -> list[float]:
    import ray

    import interlace
    from interlace.cluster.config import ClusterConfig, ResourcesConfig

    cfg = config(args)
    vocab = 200 if args.shape == "tiny" else 1000  # the tiny model's vocabulary is small
    seeds = itertools.count(1)
    if side == "model":
        model = interlace.Model(cfg)
        run = lambda d, o: time_model(model, d, o)  # noqa: E731
        close = model.close
    elif side.startswith("async"):
        run = async_side(cfg, quiet=side.endswith("quiet"))
        close = _kill_children  # its engine core outlives this process otherwise
    else:
        ray.init(address="local", include_dashboard=False, log_to_driver=False)
        overrides = {"disable_log_stats": True} if side.endswith("quiet") else {}
        resources = ResourcesConfig(num_gpus=1.0) if gpus else ResourcesConfig()
        cluster = interlace.Cluster(ClusterConfig(model=cfg, replicas=1, resources=resources, max_in_flight=4),
                                    **overrides)
        run = lambda d, o: time_model(cluster, d, o)  # noqa: E731

        def close():
            cluster.close()
            ray.shutdown()
    run(prompts(args.n, args.inp, vocab, seed=next(seeds)), args.out)  # warm-up
    rates = [run(prompts(args.n, args.inp, vocab, seed=next(seeds)), args.out) for _ in range(args.repeats)]
    return rates, close


if __name__ == "__main__":
    main()
