"""What a program holding a large tensor costs a trace: time from the trace's start to its result,
and the peak memory of this process and its children (the engine core, its ranks) above idle,
against the same trace whose program holds only the 128 values it uses, in the same run.

Every invoke's request used to carry its program's bytes, copied into vLLM's engine core and to
each rank; programs and op lists over 64 KiB now travel once per trace, as a file in its report
folder (workers/sink.py, ``INLINE_BYTES``). Runs on the CPU with the bundled tiny Llama.

Usage: python bench/program_bytes.py [--mib 16] [--n 256] [--per-invoke]
"""

from __future__ import annotations

import argparse
import threading
import time

import psutil
import torch

import interlace


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=16, help="the tensor the program holds")
    parser.add_argument("--n", type=int, default=256, help="invokes in the trace")
    parser.add_argument("--per-invoke", action="store_true", help="a program per invoke, not one batched program")
    args = parser.parse_args()
    model = interlace.Model("tiny-llama")
    model.generate("warm", max_tokens=1)
    peak, me = [0], psutil.Process()

    def watch() -> None:
        while True:
            try:
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]))
            except psutil.Error:
                pass
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()

    def run(held: torch.Tensor) -> tuple[float, int]:
        def steer(m):
            m.layers[1].resid += held[:128]

        program = steer if args.per_invoke else interlace.batched(steer)
        time.sleep(0.3)
        peak[0] = idle = sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])
        start = time.perf_counter()
        with model.trace(max_tokens=2) as tr:
            for i in range(args.n):
                tr.invoke(f"Prompt {i} of the trace", program=program)
        took = time.perf_counter() - start
        time.sleep(0.1)
        return took, (peak[0] - idle) >> 20

    # The layer below, in the same run: the same trace whose program holds only the values it uses.
    small_s, small_mib = run(torch.randn(128))
    large_s, large_mib = run(torch.randn(args.mib << 18))
    kind = "per-invoke programs" if args.per_invoke else "one batched program"
    print(f"{kind}, {args.n} invokes: holding {args.mib} MiB {large_s:.2f} s, peak RSS +{large_mib} MiB; "
          f"holding 512 bytes {small_s:.2f} s, +{small_mib} MiB; time x{large_s / small_s:.2f}")
    model.close()

if __name__ == "__main__":
    main()
