"""Replay probe: what programs' write logs cost, and what a squeezed KV cache costs with them.

Three interlace engines side by side in one process, the same model and settings:

    log        the default: every program invoke logs its writes (workers/write_log.py)
    no-log     INTERLACE_REPLAY_LOG_MIB=0: no log (reads of module outputs are views again)
    squeezed   the log, and a KV cache of --kv-mib per rank: vLLM preempts and recomputes, and
               interlace replays the programs' logged writes on the recomputed rows

Each runs the same trace, round by round in alternating order (the machine's drift falls on all
alike): N invokes of a program that steers (``resid +=``, an in-place edit of an MLP output) and
saves a residual at every step, unbatched or batched (--batched). Prints one JSON line per run
(seconds, tokens, chunks replayed) and each engine's median tok/s against ``no-log``.

Usage: python bench/replay_probe.py [--shape tiny] [--n 32] [--in 100] [--out 64] [--repeats 3]
       [--kv-mib 1.25] [--batched]
(--shape tiny --kv-mib 1.25: five 128-token blocks of the tiny Llama, as tests/test_preemption.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import runner_bench as rb
import shapes


def program(hidden: int, batched: bool):
    import torch

    import interlace

    vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0)) * 0.1

    def steer(m):
        m.layers[1].resid += vector
        m.layers[2].mlp.output.mul_(1.01)
        m.save("h", m.last(m.layers[3].resid))

    return interlace.batched(steer) if batched else steer


def engine(cfg, log_mib: str | None):
    import interlace

    before = os.environ.get("INTERLACE_REPLAY_LOG_MIB")
    if log_mib is not None:
        os.environ["INTERLACE_REPLAY_LOG_MIB"] = log_mib  # read by the workers as they start
    try:
        model = interlace.Model(cfg)
        model.engine
    finally:
        os.environ.pop("INTERLACE_REPLAY_LOG_MIB", None)
        if before is not None:
            os.environ["INTERLACE_REPLAY_LOG_MIB"] = before
    return model


def run(model, data, out: int, prog) -> tuple[float, int, int]:
    before = sum(rank["replays"] for rank in model.step_counts())
    started = time.perf_counter()
    with model.trace(max_tokens=out, ignore_eos=True, timeout_s=3600) as tr:
        for p in data:
            tr.invoke(p, program=prog)
    seconds = time.perf_counter() - started
    return seconds, sum(len(r.token_ids) for r in tr.result), sum(rank["replays"] for rank in model.step_counts()) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--in", dest="inp", type=int, default=100)
    parser.add_argument("--out", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-mib", type=float, default=1.25, help="the squeezed engine's KV cache per rank")
    parser.add_argument("--batched", action="store_true", help="one batched program call per step")
    shapes.add_argument(parser)
    args = parser.parse_args()
    args.tp = args.pp = 1
    print(rb.host_line(), flush=True)
    cfg = rb.config(args)
    engines = {"log": engine(cfg, None), "no-log": engine(cfg, "0"),
               "squeezed": engine(cfg.model_copy(update={"kv_cache_bytes": int(args.kv_mib * 2**20)}), None)}
    model_config = engines["log"].engine.llm_engine.model_config
    hidden, vocab = model_config.get_hidden_size(), min(1000, model_config.get_vocab_size())
    prog = program(hidden, args.batched)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    names = list(engines)
    for round_ in range(args.repeats + 1):  # round 0 warms up
        data = rb.prompts(args.n, args.inp, vocab, seed=round_)
        for name in names if round_ % 2 == 0 else names[::-1]:
            seconds, tokens, replays = run(engines[name], data, args.out, prog)
            if round_:
                rates[name].append(tokens / seconds)
            print(json.dumps({"round": round_, "engine": name, "s": round(seconds, 3), "tokens": tokens,
                              "replays": replays}), flush=True)
    base = statistics.median(rates["no-log"])
    print(f"\n{args.n} invokes x {args.inp} in / {args.out} out, {cfg.name}, "
          f"{'batched' if args.batched else 'unbatched'} program; {args.repeats} runs each")
    for name in names:
        rate = statistics.median(rates[name])
        print(f"{name:9} {rate:9.0f} tok/s  x no-log {rate / base:.2f}")
    for model in engines.values():
        model.close()


if __name__ == "__main__":
    main()
