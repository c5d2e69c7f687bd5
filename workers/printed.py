"""What programs print comes back with their invokes' results, not in the engine's output.

A program runs in the engine's process. What it printed went to that process's stdout: the
user's terminal for a local engine, but a Ray actor's log on a cluster (often on another node),
the server's log behind the endpoint, once per rank under tensor parallelism and once more per
stage under pipeline parallelism (each stage replays the code before its accesses).

So while a program's code runs, writes to ``sys.stdout`` and ``sys.stderr`` (``print``,
``warnings``) go to its call instead (:class:`ProgramStream` asks the watchdog, which knows which
call's code each thread runs, so a switch into a program pays nothing more). Code a later pipeline stage replays
prints nothing there, since the stage that ran it live kept it. At the step's end the call's text
goes to its first invoke (dispatch.close_calls: a batched program prints once for all of them),
tagged with the invoke's step; reports carry it once per TP group, and the driver prints it where
the user is and keeps it as ``InvokeResult.printed``. Writes made outside ``sys.stdout`` (a C
library's, ``os.write(1, ...)``, a subprocess's) still reach the process's output.

An invoke keeps :data:`LIMIT` characters: a program that prints in a loop fills its invoke's
result up to there, and the rest is counted and said in one last line.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from interlace.workers.watchdog import Watchdog

LIMIT = 64 * 1024  # characters kept per invoke and trace


class ProgramStream:
    """``sys.stdout`` or ``sys.stderr``: a running program's writes to its call, the rest through."""

    def __init__(self, real: TextIO, watchdog: Watchdog):
        self._real = real
        self._watchdog = watchdog

    def write(self, text: str) -> int:
        call = self._watchdog.running()
        if call is None:
            return self._real.write(text)
        if not call.replaying:  # (a later pipeline stage replaying what an earlier stage ran live)
            call.print(text)
        return len(text)

    def flush(self) -> None:
        if self._watchdog.running() is None:
            self._real.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno, buffer...
        return getattr(self._real, name)


def capture(watchdog: Watchdog) -> None:
    """Route programs' writes through :class:`ProgramStream` (called as a step with programs
    begins: something may have put its own stream in since, e.g. pytest for an engine run in
    its process). ``watchdog``: the one watching the programs (calls.WATCHDOG)."""
    if type(sys.stdout) is not ProgramStream:
        sys.stdout = ProgramStream(sys.stdout, watchdog)
    if type(sys.stderr) is not ProgramStream:
        sys.stderr = ProgramStream(sys.stderr, watchdog)


class Printed:
    """One invoke's printed text on this rank: (step, text) pieces, within :data:`LIMIT`."""

    __slots__ = ("pieces", "kept", "dropped")

    def __init__(self):
        self.pieces: list[tuple[int, str]] = []
        self.kept = 0
        self.dropped = 0  # characters past the limit

    def add(self, step: int, text: str, dropped: int = 0) -> None:
        room = LIMIT - self.kept
        if len(text) > room:
            text, dropped = text[:room], dropped + len(text) - room
        if text:
            self.pieces.append((step, text))
            self.kept += len(text)
        self.dropped += dropped

    def keep_steps_to(self, last: int) -> None:
        self.pieces = [(step, text) for step, text in self.pieces if step <= last]

    def report(self) -> list[tuple[int, str]]:
        """The pieces, with a last line saying what was not kept."""
        if not self.dropped:
            return self.pieces
        step = self.pieces[-1][0] if self.pieces else 0
        return self.pieces + [(step, f"\n[interlace: {self.dropped} more characters printed by this invoke's "
                                     f"program were not kept; an invoke keeps {LIMIT}]\n")]
