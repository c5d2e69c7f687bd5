"""Report-path benchmark: what it costs to hand a sweep's saves from a worker to the driver.

The runner benchmark's save cases save, at every step, one row per invoke at each of 4 layers.
The reporter thread takes each step's rows into the trace's report data file while the trace runs
(each invoke's rows per name one run; timed per step, off the path to the result); once the
trace has finished, the report takes each invoke's saves as views, writes the header and renames
it into place, and the driver maps it and rebuilds each invoke's tensors as views. This times
those phases alone, on the host, for the runner benchmark's shape (256 invokes x 128 steps x 4
names x [1, 2048] bf16 = 512 MiB), on a thread as the reporter does.

Usage: python bench/report_bench.py [--invokes 256] [--steps 128] [--names 4] [--hidden 2048] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from interlace.workers.saves import SaveChunk
from interlace.workers.sink import DirSink, read_new_reports


def sweep(invokes: int, steps: int, names: int, hidden: int) -> list[list[SaveChunk]]:
    """The chunks the engine thread hands the reporter, step by step: one per save call (the
    whole sweep's rows at one step), every invoke owning one row of it, in a shuffled batch order."""
    rng = np.random.default_rng(0)
    chunks = []
    for step in range(steps):
        owners = rng.permutation(invokes).astype(np.int64)
        rows = np.arange(invokes, dtype=np.int64)
        left = np.full(invokes, steps - 1 - step, np.int64)
        chunks.append([SaveChunk("t", f"l{n}", torch.randn(invokes, hidden, dtype=torch.bfloat16), None,
                                 owners, rows, rows + 1, left) for n in range(names)])
    return chunks


def report_folder(room: float) -> str | None:
    """Memory-backed /dev/shm when it has ``room`` free, as the driver chooses; else the default."""
    if not Path("/dev/shm").is_dir():
        return None
    stats = os.statvfs("/dev/shm")
    return "/dev/shm" if stats.f_bavail * stats.f_frsize >= room else None


def report_once(steps: list[list[SaveChunk]], root: str) -> dict[str, float]:
    """The trace's chunks taken in, then one batch written and read back, as the worker and the
    driver do; seconds per phase. ``during``: taking in, which happens while the trace runs."""
    times: dict[str, float] = {}
    sink = DirSink(root)
    started = time.perf_counter()
    for chunks in steps:
        for chunk in chunks:
            sink.take_in(0, chunk)
    times["during"] = time.perf_counter() - started
    invokes = len(steps[0][0].owners)
    started = time.perf_counter()
    saves = sink.take("t", 0, list(range(invokes)))
    times["take"] = time.perf_counter() - started
    written = time.perf_counter()
    with sink.batch("t", 0) as batch:
        batch.finish([{"trace": "t", "invoke": i, "stage": 0, "saves": s, "shared": [], "error": None}
                      for i, s in enumerate(saves)])
    sink.close("t", 0)
    times["header"] = time.perf_counter() - written
    read = time.perf_counter()
    back = read_new_reports(Path(root) / "t", set())
    times["read"] = time.perf_counter() - read
    last = steps[-1][0]
    owner, row = int(last.owners[0]), int(last.starts[0])
    assert len(back) == invokes and torch.equal(back[owner]["saves"]["l0"][-1], last.rows[row])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--invokes", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--names", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    steps = sweep(args.invokes, args.steps, args.names, args.hidden)
    mib = args.invokes * args.steps * args.names * args.hidden * 2 / 2**20
    runs: list[dict[str, float]] = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(dir=report_folder(2 * mib * 2**20)) as root:
            worker = threading.Thread(target=lambda: runs.append(report_once(steps, root)))
            worker.start()
            worker.join()
    phases = {k: statistics.median(r[k] for r in runs) for k in ("during", "take", "header", "read")}
    totals = [sum(r.values()) - r["during"] for r in runs]
    total = statistics.median(totals)
    print(f"{mib:.0f} MiB of saves, {args.invokes} invokes, median of {len(runs)}: taken in while the trace "
          f"runs {phases['during']:.3f}s ({1e3 * phases['during'] / args.steps:.2f} ms a step); then take "
          f"{phases['take']:.3f}s, header+rename+close {phases['header']:.3f}s, driver read {phases['read']:.3f}s; "
          f"total after the trace {total:.3f}s (min {min(totals):.3f}s)")


if __name__ == "__main__":
    main()
