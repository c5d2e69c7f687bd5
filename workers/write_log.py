"""Write logs: what a program wrote into the forward pass, kept so a preempted request can be
recomputed without running its program again.

When the KV cache runs short, vLLM preempts a request and later recomputes it from its tokens
(the positions it still holds in the prefix cache excepted). Declarative ops are replayed on the
recomputed rows (ops.py). A program is not run again for the steps it already ran: its reads were
used then, its saves, shared values and messages were made once, and running it twice would make
them twice. What the recomputed rows need of it is its effect on the forward pass, which is
exactly the writes it made: at which point, at which positions, which values. So every program
invoke keeps a :class:`WriteLog`: whenever a hook returns after the program changed the rows it
was handed there (an assignment, or an in-place edit), the rows' final values are copied to host
memory under (point, first position). A recomputed chunk gets those rows written back at the same
points (:func:`replay_writes`), after the point's ops as the first time; the program then runs
live from the first step it had not run.

Only token points are logged (``output``, ``input``, ``resid``, ``final``): a write to ``logits``
or ``samples`` changed a token that is now part of the request's sequence, which vLLM recomputes
from.

Cost: a copy to host memory of the rows a program wrote, per written point and step (from a GPU
asynchronous, into reused pinned slabs: pinned.py); while a log is kept, a program's reads of module outputs and inputs are copies (so an
in-place edit shows in their version counters) where they would be views of vLLM's tensors.
Memory: host memory, at most ``INTERLACE_REPLAY_LOG_MIB`` per invoke (64 by default), counted by
the whole (unsplit) values the program wrote, so every TP rank decides alike. Past it the log is
dropped; the invoke goes on, and fails with a message naming the limit only if it is preempted.

    log = WriteLog(limit_bytes=64 << 20)
    log.record(point, first, Written(value, num_rows, ready), start, stop, full_bytes, step)  # per invoke
    replay_writes(log, first, stop, start_row)          # -> [(point, batch row, rows, value)]
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from interlace.workers.points import Point


class Written:
    """The rows of one point a call wrote in one step, on the host, for all its invokes (each
    invoke's log refers to its own rows of it: a batched call copies once)."""

    __slots__ = ("value", "num_rows", "ready", "hold")

    def __init__(self, value: Any, num_rows: int, ready: Any, hold: Any = None):
        self.value = value  # a tensor, or a module's tuple output (None for what is not per token)
        self.num_rows = num_rows  # the call's token rows
        self.ready = ready  # the CUDA event its copy from the GPU waits on (None on a CPU)
        self.hold = hold  # shared by the Written of one host copy: its pinned slabs go back with the last


class PointLog:
    """One invoke's logged writes at one point, in the order made: entry i is rows
    ``starts[i]:stops[i]`` of ``written[i]``, at positions from ``firsts[i]``. Columns, not a tuple
    per entry: a decode step logs an entry per invoke, and half a million tuples alive in 1,024
    invokes' logs made Python's full collections take 180 ms each, 2.7 s of a 45 s run (1B shape,
    one H200, 2026-11-29)."""

    __slots__ = ("firsts", "written", "starts", "stops")

    def __init__(self):
        self.firsts: list[int] = []
        self.written: list[Written] = []
        self.starts: list[int] = []
        self.stops: list[int] = []

    def __iter__(self):
        return zip(self.firsts, self.written, self.starts, self.stops)


class WriteLog:
    """One invoke's writes to token points, by point (:class:`PointLog`)."""

    __slots__ = ("limit", "bytes", "entries", "overflow")

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.bytes = 0
        self.entries: dict[Point, PointLog] = {}
        self.overflow: str | None = None  # why the log was dropped (then it holds nothing)

    @property
    def replayable(self) -> bool:
        return self.overflow is None

    def record(self, point: Point, first: int, written: Written, start: int, stop: int, full_bytes: int,
               step: int) -> None:
        """Keep rows ``start:stop`` of ``written`` as what ``point`` held at positions from
        ``first`` once the program was done (at generation ``step``). ``full_bytes``: their size as
        the program saw them (whole under TP), for the limit."""
        record_rows([self], point, [first], written, [start], [stop], [full_bytes], [step])

    def drop(self, point: Point, step: int) -> None:
        """Past the limit: keep nothing from now on, and say where it was passed."""
        self.overflow = (f"its write log passed INTERLACE_REPLAY_LOG_MIB ({self.limit / 2**20:g} MiB) "
                         f"at {point}, step {step}")
        self.entries.clear()
        self.bytes = 0


def record_rows(logs: list[WriteLog | None], point: Point, firsts: list[int], written: Written,
                starts: list[int], stops: list[int], sizes: list[int], steps: list[int]) -> None:
    """:meth:`WriteLog.record` for each invoke of one call, in one pass (invoke j: rows
    ``starts[j]:stops[j]`` of ``written`` at positions from ``firsts[j]``, ``sizes[j]`` bytes;
    None: keeps no log). A batched call over 1,024 invokes logs every step, and a method call per
    invoke cost 2 ms a step on a 2-core CPU (half that in this loop)."""
    for log, first, start, stop, size, step in zip(logs, firsts, starts, stops, sizes, steps):
        if log is None or log.overflow is not None:
            continue
        if log.bytes + size > log.limit:
            log.drop(point, step)
            continue
        log.bytes += size
        entries = log.entries.get(point)
        if entries is None:
            entries = log.entries[point] = PointLog()
        entries.firsts.append(first)
        entries.written.append(written)
        entries.starts.append(start)
        entries.stops.append(stop)


def replay_writes(log: WriteLog, first: int, stop: int, start_row: int) -> list[tuple[Point, int, int, Any]]:
    """The logged writes to replay on a recomputed chunk: positions ``first:stop`` (those computed
    before the preemption), whose first row is ``start_row`` of the flat batch. Returns
    ``(point, batch row, rows, value)`` in the order they were made; ``value`` holds ``rows`` rows.

    Writes of one point at consecutive positions come back as one (their rows joined on the host):
    a decode step logs one row per invoke, and writing back a recomputed request of 400 tokens row
    by row took 400 copies to the GPU and 1,200 small kernels; steps recomputing 16k tokens then ran
    460-500 ms against 21 ms (1B shape, one H200, 2026-11-29)."""
    out = []
    for point, entries in log.entries.items():
        ats = np.asarray(entries.firsts)  # which entries overlap first:stop, for all at once
        starts, stops = np.asarray(entries.starts), np.asarray(entries.stops)
        los, his = np.maximum(ats, first), np.minimum(ats + (stops - starts), stop)
        run: list[tuple[Any, int | None]] = []  # consecutive rows not yet emitted: (value, its token dim)
        run_lo = run_hi = 0
        for i in np.flatnonzero(los < his).tolist():
            written, at, start, lo, hi = entries.written[i], entries.firsts[i], entries.starts[i], int(los[i]), int(his[i])
            if written.ready is not None:  # a batched call's invokes share it: waited for once
                written.ready.synchronize()
                written.ready = None
            rows = token_rows(written.value, written.num_rows, start + lo - at, start + hi - at)
            dim = _token_dim(written.value, written.num_rows) if isinstance(written.value, torch.Tensor) else None
            if run and lo == run_hi and dim == 0 and run[-1][1] == 0:
                run.append((rows, dim))
                run_hi = hi
                continue
            if run:
                out.append((point, start_row + run_lo - first, run_hi - run_lo, _joined(run)))
            run, run_lo, run_hi = [(rows, dim)], lo, hi
        if run:
            out.append((point, start_row + run_lo - first, run_hi - run_lo, _joined(run)))
    return out


def _joined(run: list[tuple[Any, int | None]]) -> Any:
    """One value of a run's rows (only tensors whose rows are dim 0 are ever joined)."""
    return run[0][0] if len(run) == 1 else torch.cat([rows for rows, _dim in run])


def token_rows(value: Any, num_rows: int, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of each per-token tensor of a value read for ``num_rows`` token rows
    (a tensor, or a module's tuple output: elements that are not per-token become None)."""
    if isinstance(value, tuple):
        return tuple(token_rows(v, num_rows, start, stop) for v in value)
    if not isinstance(value, torch.Tensor):
        return None
    dim = _token_dim(value, num_rows)
    if dim is None:
        return None
    return value[start:stop] if dim == 0 else value[:, start:stop]


def row_bytes(value: Any, num_rows: int) -> int:
    """Bytes per token row of a value read for ``num_rows`` rows (per-token tensors only)."""
    if isinstance(value, tuple):
        return sum(row_bytes(v, num_rows) for v in value)
    if not isinstance(value, torch.Tensor) or _token_dim(value, num_rows) is None or num_rows == 0:
        return 0
    return value.numel() * value.element_size() // num_rows


def _token_dim(t: torch.Tensor, num_rows: int) -> int | None:
    if t.dim() >= 1 and t.shape[0] == num_rows:
        return 0
    if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] == num_rows:
        return 1
    return None

