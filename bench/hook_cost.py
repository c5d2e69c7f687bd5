"""Hook cost: what inert PyTorch forward hooks cost plain vLLM's forward pass (a diagnostic).

Plain vLLM (no interlace), engine core in this process, the runner benchmark's model and workload.
Runs alternate between no hooks and hooks that do nothing, installed on the modules interlace
hooks for the 4-layer save case; prints the model forward's ms per step and each run's seconds.

Usage: python bench/hook_cost.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

FORWARD_MS: list[float] = []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.model_executor.models.llama import LlamaForCausalLM

    import shapes
    from runner_bench import prompts

    forward = LlamaForCausalLM.forward

    @functools.wraps(forward)
    def timed_forward(*a, **k):
        started = time.perf_counter()
        try:
            return forward(*a, **k)
        finally:
            FORWARD_MS.append(1000 * (time.perf_counter() - started))

    LlamaForCausalLM.forward = timed_forward
    llm = LLM(model=shapes.make_model_dir("1b"), dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              load_format="dummy", gpu_memory_utilization=shapes.GPU_MEMORY_UTILIZATION)
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
    handles = []

    def install(model, where: str):
        layers = model.model.layers
        targets = [layers[i] for i in (3, 7, 11, 15)] + ([model.model] if where == "layers+model" else [])
        for module in targets:
            handles.append(module.register_forward_hook(lambda _m, _a, out: out))
        return len(targets)

    def remove(_model):
        while handles:
            handles.pop().remove()

    seeds = iter(range(1, 1000))
    variants = ["none", "layers", "layers+model"]
    results = {v: [] for v in variants}
    for round_ in range(args.rounds + 1):
        for variant in variants:
            if variant != "none":
                llm.apply_model(functools.partial(install, where=variant))
            FORWARD_MS.clear()
            data = prompts(256, 128, 1000, seed=next(seeds))
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in data], params, use_tqdm=False)
            seconds = time.perf_counter() - started
            llm.apply_model(remove)
            decode = sorted(FORWARD_MS)[: len(FORWARD_MS) - 2]  # the prefill steps are the slowest
            if round_:  # round 0 warms up
                results[variant].append((seconds, statistics.median(decode)))
                print(f"{variant:14} {seconds:6.3f} s   forward median {statistics.median(decode):6.3f} ms", flush=True)
    print()
    for variant, rows in results.items():
        print(f"{variant:14} median {statistics.median(r[0] for r in rows):6.3f} s   "
              f"forward {statistics.median(r[1] for r in rows):6.3f} ms/step")


if __name__ == "__main__":
    main()
