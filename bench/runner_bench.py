"""Runner benchmark: interlace against plain vLLM, in one process and one run.

Llama-3.2-1B-shaped model with random bf16 weights (no download), N prompts x IN tokens, OUT
generated tokens each, greedy, eager mode (forward hooks need it). Cases:

    plain            vllm.LLM with the same settings, no interlace at all (the baseline)
    none             the interlace engine, requests without interventions
    ops-save4        declarative: save the last token's residual at 4 layers, every step
    ops-steer1       declarative: add a steering vector at 1 layer, every step
    prog-save4       the same as a batched Python program
    prog-steer1      the same as a batched Python program
    prog-steer1-each the steering program unbatched: one program call per invoke per step

Usage (GPU machine): python bench/runner_bench.py [--n 256] [--in 128] [--out 128] [--cases a,b]
Prints one JSON line per case, then a table of output tokens/s and the ratio to plain.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

MODEL_DIR = "/tmp/interlace-bench-llama1b"
SAVE_LAYERS = [3, 7, 11, 15]
STEER_LAYER = 8
REPEATS = 2  # each case timed twice, best kept; both runs are printed


def make_model_dir(path: str) -> None:
    """Llama-3.2-1B shape, small local tokenizer; weights come from load_format='dummy'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16", tie_word_embeddings=True).save_pretrained(path)


ENGINE_ARGS = dict(load_format="dummy", gpu_memory_utilization=0.5)


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]


def bench_plain(args, data) -> dict:
    from vllm import LLM, SamplingParams

    from interlace.cluster.engine import engine_args, prepare_environment

    cfg = config(args)
    prepare_environment(cfg)
    kwargs = engine_args(cfg)
    kwargs.pop("worker_extension_cls")  # plain vLLM: no interlace in the workers or scheduler
    kwargs.pop("scheduler_cls")
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.out, ignore_eos=True, temperature=0)
    llm.generate([{"prompt_token_ids": p} for p in data], params, use_tqdm=False)  # warm-up, full size:
    runs = []  # Triton kernels JIT-compile per batch shape on first use
    for _ in range(REPEATS):
        started = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p} for p in data], params, use_tqdm=False)
        runs.append(time.perf_counter() - started)
    print(json.dumps({"case": "plain-runs", "seconds": runs}), flush=True)
    seconds = min(runs)
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return {"case": "plain", "seconds": seconds, "tokens": tokens}


def config(args):
    from interlace.cluster.config import ModelConfig

    return ModelConfig(name="llama-1b-shape", source=MODEL_DIR, dtype="bfloat16", max_model_len=1024,
                       tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp, engine_args=ENGINE_ARGS)


def interlace_cases(hidden: int):
    import torch

    import interlace
    from interlace import ops

    vector = torch.randn(hidden, dtype=torch.bfloat16) * 0.01

    @interlace.batched
    def save4(m):
        for layer in SAVE_LAYERS:
            m.save(f"l{layer}", m.last(m.layers[layer].resid))

    @interlace.batched
    def steer1(m):
        m.layers[STEER_LAYER].resid += vector

    def steer1_each(m):
        m.layers[STEER_LAYER].resid += vector

    return {
        "none": {},
        "ops-save4": {"ops": [ops.save(f"layers.{layer}.resid", tokens="last") for layer in SAVE_LAYERS]},
        "ops-steer1": {"ops": [ops.add(f"layers.{STEER_LAYER}.resid", vector)]},
        "prog-save4": {"program": save4},
        "prog-steer1": {"program": steer1},
        "prog-steer1-each": {"program": steer1_each},
    }


def bench_interlace(args, data, names: list[str], label: str = "", **overrides) -> list[dict]:
    import interlace

    results = []
    with interlace.Model(config(args), **overrides) as model:
        cases = interlace_cases(2048)
        with model.trace(max_tokens=args.out, ignore_eos=True) as tr:  # warm-up, full size
            for p in data:
                tr.invoke(p, **cases["ops-steer1"])
        for name in names:
            runs = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                with model.trace(max_tokens=args.out, ignore_eos=True, timeout_s=3600) as tr:
                    for p in data:
                        tr.invoke(p, **cases[name])
                runs.append(time.perf_counter() - started)
            seconds = min(runs)
            tokens = sum(len(r.token_ids) for r in tr.result)
            saved = sum(v.numel() * v.element_size() for r in tr.result for v in r.saves.values())
            results.append({"case": name + label, "seconds": seconds, "runs": runs, "tokens": tokens, "saved_mib": round(saved / 2**20, 1)})
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--in", dest="inp", type=int, default=128)
    parser.add_argument("--out", type=int, default=128)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cases", default="none,ops-save4,ops-steer1,prog-save4,prog-steer1,prog-steer1-each")
    parser.add_argument("--no-gang-cases", default="", help="cases to repeat on an engine without "
                        "interlace's gang scheduler (vLLM's own), to isolate its cost")
    args = parser.parse_args()

    make_model_dir(MODEL_DIR)
    data = prompts(args.n, args.inp)
    plain = bench_plain(args, data)
    print(json.dumps(plain), flush=True)
    rows = [plain] + bench_interlace(args, data, args.cases.split(","))
    if args.no_gang_cases:
        rows += bench_interlace(args, data, args.no_gang_cases.split(","), label=" (no gang)", scheduler_cls=None)
    base = plain["tokens"] / plain["seconds"]
    print(f"\n{args.n} prompts x {args.inp} in / {args.out} out, TP={args.tp} PP={args.pp}, eager, bf16")
    print(f"{'case':18} {'out tok/s':>10} {'x plain':>8}")
    for row in rows:
        rate = row["tokens"] / row["seconds"]
        print(f"{row['case']:18} {rate:10.0f} {rate / base:8.2f}")


if __name__ == "__main__":
    main()
