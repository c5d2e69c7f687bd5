"""Sweep benchmark: extract one layer's all-token residual to disk, against plain vLLM prefill.

Llama-3 shape with random bf16 weights (``--shape 1b|8b|70b``, bench/shapes.py), N prompts of
IN random tokens, prefill only (``max_tokens=1``). In one run: plain vLLM (no interlace) prefills
the prompts, then shuts down; then ``interlace sweep`` runs the same prompts on one replica with
``{op: save, point: layers.<L>.resid}`` (every prompt token) and writes the shards. The sweep's
rate is taken between its first and last committed shard (the engine's start-up and the first
shard are left out, as plain vLLM's start-up is), from the shard records' times.

Targets (issue 19): at least 0.8 x plain vLLM's prefill tokens/s, and at least 1 GB/s of
activations written per GPU.

Usage: python bench/sweep_bench.py [--n 1024] [--in 512] [--layer 8] [--shard 64] [--in-flight 2,4] [--shape 1b]
       (--shape tiny: the bundled tiny Llama on CPU, a smoke run of the script)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import shapes  # noqa: E402
from runner_bench import plain_engine, prompts  # noqa: E402


def model_config(args):
    if args.shape == "tiny":
        return shapes.model_config(args)
    return shapes.model_config(args, gpu_memory_utilization=0.8)  # one engine at a time here


def run_plain(cfg, data: list[list[int]]) -> float:
    """Prefill tokens/s of plain vLLM on ``data`` (after a warm-up on other prompts)."""
    from vllm import SamplingParams

    from interlace.cluster.engine import shutdown_engine

    llm = plain_engine(cfg)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([{"prompt_token_ids": p} for p in data[: max(1, len(data) // 8)]], params, use_tqdm=False)
    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p[::-1]} for p in data], params, use_tqdm=False)  # new prompts: no prefix cache
    seconds = time.perf_counter() - started
    shutdown_engine(llm)
    return sum(len(p) for p in data) / seconds


def run_sweep_bench(cfg, data: list[list[int]], layer: int, shard: int, in_flight: int, folder: Path) -> dict:
    from interlace.cluster.config import ClusterConfig, SweepConfig
    from interlace.cluster.sweep.runner import run_sweep

    inputs = folder / "prompts.jsonl"
    inputs.write_text("".join(json.dumps({"prompt": p[::-1]}) + "\n" for p in data))
    gpus = 0.0 if cfg.name == "tiny-llama" else 1.0
    sweep = SweepConfig(
        cluster=ClusterConfig(model=cfg, replicas=1, resources={"num_cpus": 1, "num_gpus": gpus}),
        input={"paths": [str(inputs)]}, output=str(folder / "out"), shard_size=shard, shards_in_flight=in_flight,
        intervention={"ops": [{"op": "save", "point": f"layers.{layer}.resid", "name": "resid"}]},
        generation={"max_tokens": 1})
    manifest = run_sweep(sweep)
    records = sorted(manifest["shards"].values(), key=lambda r: (folder / "out" / f"shard-{r['shard']:05d}.json").stat().st_mtime)
    times = [(folder / "out" / f"shard-{r['shard']:05d}.json").stat().st_mtime for r in records]
    later = records[1:]
    seconds = times[-1] - times[0]
    return {"prompt_tokens_per_s": sum(r["prompt_tokens"] for r in later) / seconds,
            "saved_bytes_per_s": sum(r["files"]["tensors"]["bytes"] for r in later) / seconds,
            "seconds_timed": round(seconds, 3), "shards": len(records), "summary": manifest["summary"],
            # per shard: its run on the engine (with reading its reports), then writing its files
            "run_s_median": statistics.median(r["run_s"] for r in later),
            "write_s_median": statistics.median(r["write_s"] for r in later)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--in", dest="inp", type=int, default=512)
    parser.add_argument("--layer", type=int, default=8)
    parser.add_argument("--shard", type=int, default=64)
    parser.add_argument("--in-flight", default="4", help="shards_in_flight values, comma-separated: one sweep each")
    shapes.add_argument(parser)
    args = parser.parse_args()
    cfg = model_config(args)
    vocab = 500 if args.shape == "tiny" else 1000
    data = prompts(args.n, min(args.inp, cfg.max_model_len - 1), vocab)
    plain = run_plain(cfg, data)
    for in_flight in [int(v) for v in args.in_flight.split(",")]:
        folder = Path(tempfile.mkdtemp(prefix="interlace-sweep-bench-"))
        try:
            got = run_sweep_bench(cfg, data, args.layer, args.shard, in_flight, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(json.dumps({"n": args.n, "in": args.inp, "layer": args.layer, "shard": args.shard, "in_flight": in_flight,
                          "plain_prefill_tokens_per_s": round(plain, 1),
                          "sweep_prefill_tokens_per_s": round(got["prompt_tokens_per_s"], 1),
                          "ratio": round(got["prompt_tokens_per_s"] / plain, 3),
                          "saved_GB_per_s": round(got["saved_bytes_per_s"] / 1e9, 3),
                          "seconds_timed": got["seconds_timed"], "shards": got["shards"],
                          "run_s_median": got["run_s_median"], "write_s_median": got["write_s_median"]}), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
