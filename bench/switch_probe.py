"""Switch probe: what running a program per invoke costs calls.py alone (a diagnostic, no vLLM).

256 program calls that each wait at one point, as a program per invoke does at a decode step:
every call started (run to its wait) and resumed (run to its end), per step, from an "engine"
``--depth`` Python frames deep (``--c-frames``: each of them entered through C, as vLLM's forward
enters its modules), once switching into the programs itself and once through the hub
(greenlets.run_shallow). Prints the best per-invoke time of ``--rounds`` steps for each: on Python
3.12 and later the first grows with the depth (greenlet walks the frame chain it leaves at every
switch), the second does not. The watchdog and (``--flight``) the flight recorder run as in an
engine.

    python bench/switch_probe.py --depth 50,100,200 [--c-frames] [--flight]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from interlace.workers.calls import ProgramCall
from interlace.workers.greenlets import run_shallow
from interlace.workers.points import Point

POINT = Point("model.layers.8", "resid")


class _View:
    """What ProgramCall needs of a view, and the call for the program."""

    call: ProgramCall

    def _bind(self, call: ProgramCall) -> None:
        self.call = call

    def where(self) -> str:
        return "step 1"


def _program(m: _View) -> None:
    m.call.wait_at(POINT)


def _calls(n: int, flight) -> list[ProgramCall]:
    out = []
    for i in range(n):
        view = _View()
        entry = None
        if flight is not None:
            entry = _Entry(flight, f"trace {i}".encode())
        call = ProgramCall(_program, view, budget_s=1e6, limit_s=1e6, flight=entry)
        view.call = call
        out.append(call)
    return out


class _Entry:
    """A flight-recorder entry as flight.entry_for makes one: its recorder and bytes."""

    def __init__(self, recorder, data: bytes):
        self.recorder, self.data = recorder, data


def _step(batch: list[ProgramCall], hub: bool) -> None:
    def start() -> None:
        for call in batch:
            call.start()

    def resume() -> None:
        for call in batch:
            call.resume(None)

    for call in batch:
        call.again(1e6)
    (run_shallow if hub else lambda fn: fn())(start)
    (run_shallow if hub else lambda fn: fn())(resume)


def _at_depth(depth: int, c_frames: bool, fn):
    """``fn()`` called ``depth`` frames below here (each entered from C with ``c_frames``)."""
    if depth <= 0:
        return fn()
    if c_frames:
        return next(map(lambda _: _at_depth(depth - 1, c_frames, fn), (0,)))
    return _at_depth(depth - 1, c_frames, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="program calls per step")
    parser.add_argument("--depth", default="0,50,100,200", help="the engine's extra Python frames, comma-separated")
    parser.add_argument("--c-frames", action="store_true", help="enter each of those frames through C")
    parser.add_argument("--flight", action="store_true", help="with a flight recorder, as engines under a sink have")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 5000))
    flight = None
    if args.flight:
        from interlace.workers.flight import FlightRecorder
        flight = FlightRecorder(Path(tempfile.mkdtemp()))
    batch = _calls(args.n, flight)
    print(f"Python {sys.version.split()[0]}, {args.n} calls a step, best of {args.rounds} steps; "
          f"us per invoke (started and resumed):")
    for depth in (int(d) for d in args.depth.split(",")):
        row = []
        for hub in (False, True):
            def run(hub=hub) -> float:
                best = float("inf")
                for _ in range(args.rounds):
                    started = time.perf_counter()
                    _step(batch, hub)
                    best = min(best, time.perf_counter() - started)
                return best
            row.append(_at_depth(depth, args.c_frames, run) / args.n * 1e6)
        print(f"  engine {depth:4d} frames deeper{' (through C)' if args.c_frames else ''}: "
              f"from the engine {row[0]:6.2f}, through the hub {row[1]:6.2f}")


if __name__ == "__main__":
    main()
