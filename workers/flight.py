"""The flight recorder: which program a rank is running right now, in a file that outlives the rank.

A program can end the process it runs in: ``os._exit``, a crash of the interpreter or of a C
extension, a signal, or a refusal to stop that interlace's watchdog ends (calls.py). Whoever
hosts the engine then sees only a dead engine. So each rank keeps one small record in a file of
the report sink's folder (``<sink>/.flight/<pid>``, node-local, mapped shared): before control
passes into a program's code (each greenlet switch into it, and unpickling it at admission) the
rank marks the record RUNNING with that program's trace and invoke, and marks it IDLE when control
comes back to interlace. The watchdog marks it OVERRAN just before it ends the process. Writes
to a shared mapping land in the page cache at once, so the record survives however the process
ends. After a death the host reads the dead ranks' records (:func:`read_records`): one left
RUNNING or OVERRAN names the program that was running when the process ended (:func:`culprit`);
none means the death happened in the engine's own code (not attributable to a program).

Cost: a switch into a program marks the record twice (one byte each; the entry's bytes only when
the program differs from the last one recorded). Measured on the project's 2-core CPU machine:
0.12 us per switch in and out (``python -m interlace.workers.flight``), against a program access
of tens of microseconds (its tensor work alone).
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

IDLE, RUNNING, OVERRAN = 0, 1, 2  # the record's first byte
FOLDER = ".flight"
SIZE = 1024  # bytes per record: state, entry length (2 bytes), the entry (JSON)
_MAX_ENTRY = SIZE - 3


class Entry:
    """One program's record, encoded once: what :meth:`FlightRecorder.enter` writes."""

    __slots__ = ("recorder", "data")

    def __init__(self, recorder: "FlightRecorder", data: bytes):
        self.recorder, self.data = recorder, data

    def enter(self) -> None:
        self.recorder.enter(self)

    def leave(self) -> None:
        self.recorder.leave()


class FlightRecorder:
    """One rank's record under one sink folder (see the module docstring)."""

    def __init__(self, root: Path):
        folder = Path(root) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / str(os.getpid())
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)  # MAP_SHARED: the page cache holds what it says
        finally:
            os.close(fd)
        self._written: Entry | None = None  # whose entry the record holds
        self._entries: dict[tuple[str, int], Entry] = {}

    def entry(self, trace: str, invoke: int, limit_s: float) -> Entry:
        """The entry of invoke ``invoke`` of ``trace`` (the id its workers know it by)."""
        key = (trace, invoke)
        found = self._entries.get(key)
        if found is None:
            if len(self._entries) > 4096:  # finished invokes' entries: a dict, not a leak
                self._entries.clear()
            data = json.dumps({"trace": trace, "invoke": invoke, "limit_s": limit_s}).encode()[:_MAX_ENTRY]
            found = self._entries[key] = Entry(self, len(data).to_bytes(2, "little") + data)
        return found

    def enter(self, entry: Entry) -> None:
        """Control goes into ``entry``'s program."""
        mapped = self._map
        if entry is not self._written:
            mapped[0] = IDLE  # never RUNNING with half an entry
            mapped[1:1 + len(entry.data)] = entry.data
            self._written = entry
        mapped[0] = RUNNING

    def leave(self) -> None:
        """Control is back in interlace's code."""
        self._map[0] = IDLE

    def close(self) -> None:
        """Unmap the record and remove its file (its rank was shut down cleanly)."""
        self._map.close()
        self.path.unlink(missing_ok=True)

    def overran(self, entry: Entry) -> None:
        """The watchdog ends the process now: ``entry``'s program did not stop at its limit."""
        if entry is not self._written:
            self.enter(entry)
        self._map[0] = OVERRAN


_RECORDERS: dict[str, FlightRecorder | None] = {}


def recorder_for(sink: str) -> FlightRecorder | None:
    """This process's recorder for the sink ``sink`` ("dir:/path"); None where it cannot keep one
    (another kind of sink, or no room: programs run unrecorded, deaths stay unattributed)."""
    if sink not in _RECORDERS:
        kind, _, where = sink.partition(":")
        try:
            _RECORDERS[sink] = FlightRecorder(Path(where)) if kind == "dir" else None
        except OSError:
            _RECORDERS[sink] = None
    return _RECORDERS[sink]


def close_recorder(sink: str) -> None:
    """Let go of this process's recorder for ``sink``, if it has one: an engine run in the driver's
    own process was shut down (see sink.close_sink), and its record would otherwise stay mapped
    until the process ends."""
    recorder = _RECORDERS.pop(sink, None)
    if recorder is not None:
        recorder.close()


def entry_for(sink: str, trace: str, invoke: int, limit_s: float) -> Entry | None:
    recorder = recorder_for(sink)
    return recorder.entry(trace, invoke, limit_s) if recorder is not None else None


def read_records(root: Path, dead_only: bool = True) -> list[dict]:
    """The records under the sink folder ``root`` left RUNNING or OVERRAN, each ``{"pid", "state":
    "running" | "overran", "trace", "invoke", "limit_s"}``; ``dead_only``: of processes that
    ended (a live rank's record explains no death)."""
    import psutil

    found = []
    for path in sorted((Path(root) / FOLDER).glob("*")):
        try:
            raw = path.read_bytes()
            pid = int(path.name)
        except (OSError, ValueError):
            continue
        if len(raw) < 3 or raw[0] not in (RUNNING, OVERRAN):
            continue
        if dead_only and _alive(pid, psutil):
            continue
        length = int.from_bytes(raw[1:3], "little")
        try:
            entry = json.loads(raw[3:3 + length])
        except ValueError:
            continue
        found.append({"pid": pid, "state": "overran" if raw[0] == OVERRAN else "running", **entry})
    return found


def culprit(records: list[dict]) -> dict | None:
    """The record that names the program which ended the process, or None when the records do
    not agree on one: an OVERRAN record wins (the watchdog acted on that program); else every
    RUNNING one must name the same invoke (a TP group's ranks run one program alike; pipeline
    stages that ran different programs when the engine went down leave the death unattributed)."""
    for state in ("overran", "running"):
        named = [r for r in records if r["state"] == state]
        if named and len({(r["trace"], r["invoke"]) for r in named}) == 1:
            return named[0]
        if named:
            return None
    return None


def _alive(pid: int, psutil) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _benchmark(rounds: int = 1_000_000) -> float:
    """Microseconds per switch in and out of a program (enter, then leave)."""
    import tempfile
    import time

    with tempfile.TemporaryDirectory() as root:
        entry = FlightRecorder(Path(root)).entry("trace.0.0", 0, 30.0)
        start = time.perf_counter()
        for _ in range(rounds):
            entry.enter()
            entry.leave()
        return (time.perf_counter() - start) / rounds * 1e6


if __name__ == "__main__":
    print(f"{_benchmark():.3f} us per switch in and out")
