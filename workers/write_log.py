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


class WriteLog:
    """One invoke's writes to token points, by point, each as (first position, rows start:stop
    of a :class:`Written`)."""

    __slots__ = ("limit", "bytes", "entries", "overflow")

    def __init__(self, limit_bytes: int):
        self.limit = limit_bytes
        self.bytes = 0
        self.entries: dict[Point, list[tuple[int, Written, int, int]]] = {}
        self.overflow: str | None = None  # why the log was dropped (then it holds nothing)

    @property
    def replayable(self) -> bool:
        return self.overflow is None

    def record(self, point: Point, first: int, written: Written, start: int, stop: int, full_bytes: int,
               step: int) -> None:
        """Keep rows ``start:stop`` of ``written`` as what ``point`` held at positions from
        ``first`` once the program was done (at generation ``step``). ``full_bytes``: their size as
        the program saw them (whole under TP), for the limit."""
        if self.overflow is not None:
            return
        if self.bytes + full_bytes > self.limit:
            self.overflow = (f"its write log passed INTERLACE_REPLAY_LOG_MIB ({self.limit / 2**20:g} MiB) "
                             f"at {point}, step {step}")
            self.entries.clear()
            self.bytes = 0
            return
        self.bytes += full_bytes
        entries = self.entries.get(point)
        if entries is None:
            entries = self.entries[point] = []
        entries.append((first, written, start, stop))


def replay_writes(log: WriteLog, first: int, stop: int, start_row: int) -> list[tuple[Point, int, int, Any]]:
    """The logged writes to replay on a recomputed chunk: positions ``first:stop`` (those computed
    before the preemption), whose first row is ``start_row`` of the flat batch. Returns
    ``(point, batch row, rows, value)`` in the order they were made; ``value`` holds ``rows`` rows."""
    out = []
    for point, entries in log.entries.items():
        for at, written, start, stop_row in entries:
            lo, hi = max(first, at), min(stop, at + stop_row - start)
            if lo >= hi:
                continue
            if written.ready is not None:
                written.ready.synchronize()
            rows = token_rows(written.value, written.num_rows, start + lo - at, start + hi - at)
            out.append((point, start_row + lo - first, hi - lo, rows))
    return out


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

