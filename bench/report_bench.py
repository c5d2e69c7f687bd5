"""Report-path benchmark: what it costs to hand a sweep's saves from a worker to the driver.

The runner benchmark's save cases end with every invoke finishing in the same step, so the whole
save volume is reported at once: the ledger's gather per name (the host copies were made during
generation), one report file written by the worker and mapped by the driver. This times those
phases alone, on the host, for the runner benchmark's shape (256 invokes x 128 steps x 4 names x
[1, 2048] bf16 = 512 MiB).

Usage: python bench/report_bench.py [--invokes 256] [--steps 128] [--names 4] [--hidden 2048]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from interlace.workers.saves import SaveLedger
from interlace.workers.sink import DirSink, read_new_reports


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--invokes", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--names", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()

    ledger = SaveLedger()
    owners = list(range(args.invokes))
    rows = [(i, i + 1) for i in owners]
    for _ in range(args.steps):
        for name in range(args.names):  # one chunk per save: the whole sweep's rows at one step
            ledger.add("t", f"l{name}", torch.randn(args.invokes, args.hidden, dtype=torch.bfloat16), owners, rows)
    mib = args.invokes * args.steps * args.names * args.hidden * 2 / 2**20

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as root:
        started = time.perf_counter()
        assembled = ledger.take("t", owners).assemble()
        t_assemble = time.perf_counter() - started
        reports = [{"trace": "t", "invoke": i, "stage": 0, "saves": s, "shared": [], "error": None}
                   for i, s in enumerate(assembled)]
        started = time.perf_counter()
        DirSink(root).write("t", 0, reports)
        t_write = time.perf_counter() - started
        started = time.perf_counter()
        back = read_new_reports(Path(root) / "t", set())
        t_read = time.perf_counter() - started
    assert len(back) == args.invokes and back[0]["saves"]["l0"].shape == (args.steps, args.hidden)
    total = t_assemble + t_write + t_read
    print(f"{mib:.0f} MiB of saves, {args.invokes} invokes: assemble {t_assemble:.3f}s, "
          f"worker write {t_write:.3f}s, driver read {t_read:.3f}s, total {total:.3f}s "
          f"({mib / total:.0f} MiB/s)")


if __name__ == "__main__":
    main()
