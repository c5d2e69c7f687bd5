"""None probe: what an interlace engine costs requests without interventions (a diagnostic).

Issue 22 asks that requests with no intervention run at plain vLLM's compiled speed. This runs the
``none`` case of ``runner_bench.py --graphs`` against plain vLLM, paired and alternating as that
script does, on several engines side by side in one process, each taking away one part of
interlace, so a gap can be put down to its part:

    taps        interlace.Model with graph taps declared (runner_bench's ops cases' points)
    no-taps     interlace.Model without graph taps
    no-taps@llm the no-taps engine driven by ``vllm.LLM.generate`` directly (no interlace driver)
    sched       a ``vllm.LLM`` with interlace's scheduler class and worker extension but nothing
                installed in its runner (what vLLM's config alone costs)

Usage: python bench/none_probe.py [--n 256,1024] [--in 128] [--out 128] [--repeats 3]
       [--variants taps,no-taps,no-taps@llm,sched] [--shape 1b]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import runner_bench as rb
import shapes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", default="256,1024", help="prompts per trace; several sizes run on the same engines")
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="taps,no-taps,no-taps@llm,sched")
    shapes.add_argument(parser)
    args = parser.parse_args()
    args.tp = args.pp = 1
    args.graphs = args.shape != "tiny"
    names = args.variants.split(",")

    import interlace
    from vllm import LLM

    from interlace.cluster.engine import engine_args

    cfg = rb.config(args)
    if "gpu_memory_utilization" in cfg.engine_args:  # up to 4 engines share the GPU
        cfg = cfg.model_copy(update={"engine_args": {**cfg.engine_args, "gpu_memory_utilization": 0.18}})
    plain = rb.plain_engine(cfg)
    hf = plain.llm_engine.model_config.hf_config
    engines: dict = {}
    for name in names:
        if name == "taps":
            engines[name] = interlace.Model(cfg.model_copy(update={"graph_taps": rb.graph_taps(hf.num_hidden_layers)}))
        elif name == "no-taps":
            engines[name] = interlace.Model(cfg)
        elif name == "sched":
            engines[name] = LLM(**engine_args(cfg))
    if "no-taps@llm" in names:
        engines["no-taps@llm"] = (engines.get("no-taps") or interlace.Model(cfg)).engine

    def run(name: str, data) -> tuple[float, int]:
        engine = engines[name]
        if isinstance(engine, LLM):
            return rb.run_plain(engine, data, args.out)
        seconds, tokens, _ = rb.run_interlace(engine, data, args.out, {})
        return seconds, tokens

    vocab = min(1000, hf.vocab_size)
    sizes = [int(n) for n in args.n.split(",")]
    seeds = itertools.count(1)
    for n in sizes:
        warm = rb.prompts(n, args.inp, vocab)  # kernels compile per batch shape
        rb.run_plain(plain, warm, args.out)
        for name in names:
            run(name, warm)
        ratios: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.repeats):
            for name in names:
                fresh = rb.prompts(n, args.inp, vocab, seed=next(seeds))
                (p_seconds, p_tokens), [(seconds, tokens)] = rb.paired(
                    round_, lambda: rb.run_plain(plain, fresh, args.out), [lambda: run(name, fresh)])
                ratios[name].append((tokens / seconds) / (p_tokens / p_seconds))
                print(json.dumps({"n": n, "variant": name, "round": round_, "plain_s": round(p_seconds, 3),
                                  "variant_s": round(seconds, 3), "ratio": round(ratios[name][-1], 3)}), flush=True)
        print(f"\nnone case, {n} prompts x {args.inp} in / {args.out} out, {cfg.name}, "
              f"{'CUDA graphs' if args.graphs else 'eager'}; {args.repeats} pairs per variant")
        print(f"{'variant':14} {'x plain (median)':>17} {'min':>6} {'max':>6}")
        for name in names:
            print(f"{name:14} {statistics.median(ratios[name]):17.2f} {min(ratios[name]):6.2f} {max(ratios[name]):6.2f}")
        if "taps" in engines:
            print(f"taps engine steps (rank 0): {engines['taps'].step_counts()[0]}", flush=True)


if __name__ == "__main__":
    main()
