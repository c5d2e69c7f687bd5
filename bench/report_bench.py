"""Report-path benchmark: what it costs to hand a sweep's saves from a worker to the driver.

The runner benchmark's save cases end with every invoke finishing in the same step, so the whole
save volume is reported at once: each name's rows gathered from the host chunks made during
generation straight into the trace's report data file (reserved ahead while the trace runs, timed
apart), the header written and renamed into place, then the driver mapping it and rebuilding each
invoke's tensors as views. This times those phases alone, on the host, for the runner benchmark's shape (256
invokes x 128 steps x 4 names x [1, 2048] bf16 = 512 MiB), on a thread as the reporter does.

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

from interlace.workers.save_gather import TakenSaves
from interlace.workers.saves import SaveChunk
from interlace.workers.sink import DirSink, read_new_reports


def sweep(invokes: int, steps: int, names: int, hidden: int) -> TakenSaves:
    """What the ledger hands the reporter for the sweep: one chunk per save call (the whole
    sweep's rows at one step), every invoke owning one row of it."""
    owners = np.arange(invokes, dtype=np.int64)
    everyone = np.ones(invokes, dtype=bool)
    parts = {f"l{n}": [(SaveChunk(f"l{n}", torch.randn(invokes, hidden, dtype=torch.bfloat16), None,
                                  owners, owners, owners + 1, invokes), everyone) for _ in range(steps)]
             for n in range(names)}
    return TakenSaves(parts, owners)


def report_folder(room: float) -> str | None:
    """Memory-backed /dev/shm when it has ``room`` free, as the driver chooses; else the default."""
    if not Path("/dev/shm").is_dir():
        return None
    stats = os.statvfs("/dev/shm")
    return "/dev/shm" if stats.f_bavail * stats.f_frsize >= room else None


def report_once(taken: TakenSaves, root: str) -> dict[str, float]:
    """One batch, written and read back as the worker and the driver do; seconds per phase.
    ``ahead``: reserving the data file, which the reporter does while the trace runs (off the
    path to the result); the other phases happen once the trace has finished."""
    times: dict[str, float] = {}
    sink = DirSink(root)
    reserving = time.perf_counter()
    sink.reserve("t", 0, sum(c.rows.nbytes for parts in taken.parts.values() for c, _ in parts))
    times["ahead"] = time.perf_counter() - reserving
    started = time.perf_counter()
    with sink.batch("t", 0) as batch:

        def allocate(specs):
            mapped = time.perf_counter()
            out = batch.allocate(specs)
            times["map"] = time.perf_counter() - mapped
            return out

        assembled = taken.assemble(allocate)
        times["gather"] = time.perf_counter() - started - times["map"]
        written = time.perf_counter()
        batch.finish([{"trace": "t", "invoke": i, "stage": 0, "saves": s, "shared": [], "error": None}
                      for i, s in enumerate(assembled)])
    sink.close("t", 0)
    times["header"] = time.perf_counter() - written
    read = time.perf_counter()
    back = read_new_reports(Path(root) / "t", set())
    times["read"] = time.perf_counter() - read
    assert len(back) == len(taken.wanted) and torch.equal(back[-1]["saves"]["l0"], assembled[-1]["l0"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--invokes", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--names", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    taken = sweep(args.invokes, args.steps, args.names, args.hidden)
    mib = args.invokes * args.steps * args.names * args.hidden * 2 / 2**20
    runs: list[dict[str, float]] = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(dir=report_folder(2 * mib * 2**20)) as root:
            worker = threading.Thread(target=lambda: runs.append(report_once(taken, root)))
            worker.start()
            worker.join()
    phases = {k: statistics.median(r[k] for r in runs) for k in ("ahead", "map", "gather", "header", "read")}
    totals = [sum(r.values()) - r["ahead"] for r in runs]
    total = statistics.median(totals)
    print(f"{mib:.0f} MiB of saves, {args.invokes} invokes, median of {len(runs)}: "
          f"reserved ahead {phases['ahead']:.3f}s (while the trace runs); then size+map {phases['map']:.3f}s, "
          f"gather into the file {phases['gather']:.3f}s, header+rename+close {phases['header']:.3f}s, "
          f"driver read {phases['read']:.3f}s; total after the trace {total:.3f}s (min {min(totals):.3f}s, "
          f"{mib / total:.0f} MiB/s)")


if __name__ == "__main__":
    main()
