"""Pool runner_bench's paired ratios across processes, with a bootstrap interval for each median.

On the lent GPU hosts a single trace's time moves by up to a third at random, so the median of
10 pairs moves by about 0.05 from one process to the next (steering, unchanged, gave 0.77-1.04
across four processes of one host on 2026-11-27). Pooling the pairs of every process of one
revision on one host, and saying how wide the median's 95% interval is, tells whether a run can
tell a ratio from its target at all.

Reads runner_bench's JSON lines (one per pair) from logs as ``bench/ab_revisions.sh runner``
writes them: a ``=== <path>/ab-runner-<revision>.log`` line starts each process's output, and
pairs before any such line count as one revision named after the file. Each log is pooled on its
own (one host; "tree" means another tree in each).

Usage: python bench/pool_pairs.py LOG [LOG...]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np


def median_interval(ratios: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """The median of ``ratios`` and a 95% bootstrap interval for it (percentiles of the medians of
    ``resamples`` resamples with replacement)."""
    values = np.asarray(ratios, dtype=float)
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(values, (resamples, len(values))), axis=1)
    return float(np.median(values)), float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def pooled(paths: list[Path]) -> dict[tuple[str, str, int], dict[str, list[float]]]:
    """Ratios by (log, revision, prompts) and case, over every process of each log."""
    pairs: dict[tuple[str, str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for path in paths:
        revision = path.stem
        for line in path.read_text().splitlines():
            started = re.match(r"=== \S*ab-runner-(\S+)\.log", line)
            if started:
                revision = started[1]
            elif line.startswith("{"):
                pair = json.loads(line)
                pairs[path.name, revision, pair["n"]][pair["case"]].append(pair["ratio"])
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args()
    for (log, revision, n), cases in pooled(args.logs).items():
        print(f"{log}: {revision}, {n} prompts")
        print(f"  {'case':18} {'pairs':>5} {'x plain (median)':>17} {'95% interval':>14}")
        for case, ratios in cases.items():
            median, low, high = median_interval(ratios)
            print(f"  {case:18} {len(ratios):5d} {median:17.2f} {low:8.2f}-{high:.2f}")


if __name__ == "__main__":
    main()
