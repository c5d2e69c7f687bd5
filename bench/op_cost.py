"""Op cost: what the torch calls of a steering program per invoke cost on this host (a diagnostic,
no vLLM): a view of one invoke's rows of a live residual, ``+=`` of a vector into it, and both,
as a program's ``m.layers[L].resid += vector`` makes them, on the CPU and (if there is one) the GPU.
Prints the best mean of ``--rounds`` rounds of 256 calls, in microseconds per call: the part of
a program's time per step that is torch's own, whatever interlace does around it.

    python bench/op_cost.py [--hidden 2048] [--rounds 20]
"""

from __future__ import annotations

import argparse
import time

import torch


def per_call_us(fn, calls: int, rounds: int, sync) -> float:
    best = float("inf")
    for _ in range(rounds):
        sync()
        started = time.perf_counter()
        for i in range(calls):
            fn(i)
        sync()
        best = min(best, (time.perf_counter() - started) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    calls = 256
    for device in devices:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        with torch.inference_mode():  # as vLLM's forward runs
            live = torch.randn(calls, args.hidden, dtype=torch.bfloat16, device=device)
            vector = torch.randn(args.hidden, dtype=torch.bfloat16, device=device)
            views = [live[i : i + 1] for i in range(calls)]
            cases = {
                "view live[i:i+1]": lambda i: live[i : i + 1],
                "view += vector": lambda i: views[i].add_(vector),
                "view, then += vector": lambda i: live[i : i + 1].add_(vector),
                "python += on a view": lambda i: views[i].__iadd__(vector),
            }
            for label, fn in cases.items():
                print(f"{device:5s} {label:24s} {per_call_us(fn, calls, args.rounds, sync):6.2f} us")


if __name__ == "__main__":
    main()
