"""Sum py-spy's raw stacks (``py-spy record -f raw``) by frame: where a process's time went,
restricted to stacks through a given frame (e.g. the runner's steps) and optionally to frames of
one package. A diagnostic for the GPU machines' profiles, whose flamegraph tools are not there.

    python bench/spy_frames.py spy.txt --through execute_model --only workers/ --top 80
"""

from __future__ import annotations

import argparse
import collections
import re


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:12)`` with the path from its package on."""
    return re.sub(r"\s*\(.*?/(site-packages|dist-packages|main)/", " (", frame)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw")
    parser.add_argument("--through", default="", help="only stacks with a frame containing this (comma: any of)")
    parser.add_argument("--only", default="", help="only print frames containing this")
    parser.add_argument("--top", type=int, default=60)
    args = parser.parse_args()
    through = [t for t in args.through.split(",") if t]
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for line in open(args.raw):
        stack, _, count = line.rstrip().rpartition(" ")
        if not count.isdigit() or (through and not any(t in stack for t in through)):
            continue
        n, frames = int(count), [frame_name(f) for f in stack.split(";")]
        total += n
        for name in set(frames):
            inclusive[name] += n
        own[frames[-1]] += n
    print(f"samples {total}")
    for title, counts in (("inclusive", inclusive), ("own", own)):
        print(f"--- {title}")
        shown = [(name, n) for name, n in counts.most_common() if args.only in name][: args.top]
        for name, n in shown:
            print(f"{n:8d} {name[:160]}")


if __name__ == "__main__":
    main()
