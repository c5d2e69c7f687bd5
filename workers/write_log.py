"""Write logs: what a program wrote into the forward pass, kept so a preempted request can be
recomputed without running its program again.

When the KV cache runs short, vLLM preempts a request and later recomputes it from its tokens
(the positions it still holds in the prefix cache excepted). Declarative ops are replayed on the
recomputed rows (ops.py). A program is not run again for the steps it already ran: its reads were
used then, its saves, shared values and messages were made once, and running it twice would make
them twice. What the recomputed rows need of it is its effect on the forward pass, which is
exactly the writes it made: at which point, at which positions, which values. So whenever a hook
returns after programs changed the rows they were handed there (an assignment, or an in-place
edit), the rows' final values are copied to host memory, and the rank's :class:`WriteBook` keeps
them as one entry: the point, the host copy, and for each invoke its log's number, its rows of the
copy and their first position. A recomputed chunk gets those rows written back at the same points
(:meth:`WriteBook.replay`), after the point's ops as the first time; the program then runs live
from the first step it had not run.

One entry per point and step for a whole call (or for the one-invoke calls of a program per
invoke, joined), as arrays, not one per invoke: a batched call over 1,024 invokes logging every
invoke's rows cost about 2 ms a step on one H200 host, and a recomputed request's replay walked
its log row by row. The replay of a step is array arithmetic per entry, and one write per point
for every recomputed request.

Only token points are logged (``output``, ``input``, ``resid``, ``final``): a write to ``logits``
or ``samples`` changed a token that is now part of the request's sequence, which vLLM recomputes
from.

Only invokes that vLLM may preempt keep a log: the scheduler names those it never can (room in
the cache for them and the program requests ahead of them; scheduler.py), and they open none.

Cost: a copy to host memory of the rows programs wrote, per written point and step (from a GPU
asynchronous, into reused pinned slabs: pinned.py); while a log is kept, a program's reads of
module outputs and inputs are copies (so an in-place edit shows in their version counters) where
they would be views of vLLM's tensors. Memory: host memory, at most ``INTERLACE_REPLAY_LOG_MIB``
per invoke (64 by default), counted by the whole (unsplit) values the program wrote, so every TP
rank decides alike (a SlotTable column). Past it the invoke's log is dropped; the invoke goes on,
and fails with a message naming the limit only if it is preempted. An entry is let go once none
of its invokes is live.

    book = WriteBook(slot_table, limit_bytes=64 << 20)
    log = book.open(slot)                                   # an invoke with a program: its WriteLog
    book.record(point, Written(value, num_rows, ready), slots, firsts, starts, stops, sizes, steps)
    book.replay(log_ids, firsts, stops, start_rows)         # -> [(point, batch rows, value, requests)]
    #                                                          value on the book's device
    book.close([log])                                       # it finished
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from interlace.workers.points import Point, expand_ranges
from interlace.workers.slots import SlotTable

_SCRATCHES = 2  # host buffers replays gather into, used in turn (WriteBook.replay)


class Written:
    """The rows of one point one or more calls wrote in one step, on the host, for all their
    invokes (each invoke's entry refers to its own rows of it: a batched call copies once)."""

    __slots__ = ("value", "num_rows", "ready", "hold", "_arrays")

    def __init__(self, value: Any, num_rows: int, ready: Any, hold: Any = None):
        self.value = value  # a tensor, or a module's tuple output (None for what is not per token)
        self.num_rows = num_rows  # the calls' token rows
        self.ready = ready  # the CUDA event its copy from the GPU waits on (None on a CPU)
        self.hold = hold  # shared by the Written of one host copy: its pinned slabs go back with the last
        self._arrays = None

    def arrays(self) -> Any:
        """``value`` as numpy arrays sharing its memory (integers of the element's size: numpy has
        no bfloat16), made once: a replay slices them where torch's per-call cost would add up."""
        if self._arrays is None:
            self._arrays = _as_arrays(self.value)
        return self._arrays


class WriteLog:
    """One invoke's log: its number in the rank's book, and why it was dropped if it was."""

    __slots__ = ("id", "limit", "overflow")

    def __init__(self, log_id: int, limit_bytes: int):
        self.id = log_id
        self.limit = limit_bytes
        self.overflow: str | None = None  # why the log was dropped (then nothing of it is replayed)

    @property
    def replayable(self) -> bool:
        return self.overflow is None

    def drop(self, point: Point, step: int) -> None:
        """Past the limit: keep nothing from now on, and say where it was passed."""
        self.overflow = (f"its write log passed INTERLACE_REPLAY_LOG_MIB ({self.limit / 2**20:g} MiB) "
                         f"at {point}, step {step}")


class _Entry:
    """What the calls of one hook wrote at ``point`` in one step: invoke ``ids[i]``'s rows are
    ``starts[i]:stops[i]`` of ``written``, at positions from ``firsts[i]``."""

    __slots__ = ("point", "written", "ids", "firsts", "starts", "stops")

    def __init__(self, point: Point, written: Written, ids: np.ndarray, firsts: np.ndarray, starts: np.ndarray,
                 stops: np.ndarray):
        self.point, self.written = point, written
        self.ids, self.firsts, self.starts, self.stops = ids, firsts, starts, stops


class WriteBook:
    """Every program invoke's logged writes on this rank (see the module's docstring)."""

    def __init__(self, slots: SlotTable, limit_bytes: int, device: torch.device | None = None):
        self.slots = slots
        self.limit = limit_bytes
        self.device = device if device is not None and device.type != "cpu" else None  # None: values stay on the host
        self.entries: list[_Entry] = []  # in the order written
        self.logs: dict[int, WriteLog] = {}  # by number: the live invokes' logs that were not dropped
        self._next_id = 0
        self._kept = 0  # entries after the last pass that let go of dead ones
        # Host memory replays gather into, reused: fresh memory for a step recomputing 16k rows
        # (61 MiB at the 1B shape) made the gather 7x slower, faulting its pages in (2-core CPU).
        # Pinned when a GPU reads it: from pageable memory the copy of a 16k-row step waited for
        # the stream and ran at a fraction of the bus's speed. A replay's values are written (on
        # a CPU) or copied to the device before a replay reuses it. Two scratch buffers in turn:
        # waiting for the last replay's copies would wait for the GPU to reach the step that made
        # them, and recomputed chunks often come in consecutive steps, where the engine runs a
        # step ahead of the GPU (asynchronous scheduling); the replay two steps back has landed. Cost:
        # twice the pinned memory, each buffer as large as the largest replay it served.
        self._scratches = [torch.empty(0, dtype=torch.uint8) for _ in range(_SCRATCHES)]
        self._turn = 0  # the scratch this replay cuts from
        self._carved = 0
        self._sent: list[torch.cuda.Event | None] = [None] * _SCRATCHES  # each scratch's last copies to the device
        self._cols = np.empty((6, 0), np.int64)  # see _columns
        self._points: dict[Point, int] = {}  # the points entries wrote, numbered
        self._point_list: list[Point] = []
        self._filled = 0  # columns in use
        self._indexed = 0  # entries in them

    def open(self, slot: int) -> WriteLog:
        """A log for the invoke at ``slot`` (numbers are never reused: an entry of a finished
        invoke can never be read as a later invoke's)."""
        log = WriteLog(self._next_id, self.limit)
        self._next_id += 1
        self.logs[log.id] = log
        self.slots.log_id[slot] = log.id
        self.slots.log_bytes[slot] = 0
        return log

    def close(self, logs: list[WriteLog]) -> None:
        """These invokes finished. Entries none of whose invokes is live are let go in a pass over
        the book once it has doubled since the last (so each entry is looked at a bounded number
        of times, however many invokes finish one by one)."""
        for log in logs:
            self.logs.pop(log.id, None)
        if len(self.entries) >= 2 * self._kept + 64 or not self.logs:
            live = np.fromiter(self.logs, np.int64, len(self.logs))
            live.sort()
            self.entries = [e for e in self.entries if len(live) and _hits(live, e.ids).any()]
            self._kept = len(self.entries)
            self._filled = self._indexed = 0

    def record(self, point: Point, written: Written, slots: np.ndarray, firsts: np.ndarray, starts: np.ndarray,
               stops: np.ndarray, sizes: np.ndarray, steps: np.ndarray) -> None:
        """Log rows ``starts[j]:stops[j]`` of ``written`` as what ``point`` held at positions from
        ``firsts[j]`` once the program of the invoke at ``slots[j]`` was done (at its generation
        ``steps[j]``); ``sizes[j]``: their bytes as the program saw them (whole under TP), for
        its limit. Invokes that keep no log are skipped; one past its limit is dropped, alone."""
        if len(starts) > 1 and (np.diff(starts) < 0).any():  # replay reads an entry's rows as one run where it can
            raise ValueError("a call's logged rows must come in invoke order (ascending starts)")
        table = self.slots
        ids = table.log_id[slots]
        used = table.log_bytes[slots] + sizes
        kept = ids >= 0
        over = kept & (used > self.limit)
        if over.any():
            for j in np.flatnonzero(over).tolist():
                log = self.logs.pop(int(ids[j]), None)
                if log is not None:
                    log.drop(point, int(steps[j]))
                table.log_id[slots[j]] = -1
            kept &= ~over
        if not kept.any():
            return
        if not kept.all():
            slots, ids, used, firsts, starts, stops = (a[kept] for a in (slots, ids, used, firsts, starts, stops))
        table.log_bytes[slots] = used
        # copies: a call's arrays are advanced in place for its next step (StepScheduler.program_groups)
        self.entries.append(_Entry(point, written, ids.copy(), np.array(firsts, np.int64), np.array(starts, np.int64),
                                   np.array(stops, np.int64)))

    def replay(self, ids: np.ndarray, firsts: np.ndarray, stops: np.ndarray,
               start_rows: np.ndarray) -> list[tuple[Point, np.ndarray, Any, np.ndarray]]:
        """The logged writes to put back on the chunks of a step that recompute rows: request k
        (log ``ids[k]``) recomputes positions ``firsts[k]:stops[k]``, from row ``start_rows[k]``
        of the flat batch. Returns ``(point, batch rows, value, requests)`` per point written, in
        the order first written: ``value`` holds the rows' values on the book's device (a
        tensor, or a tuple with None where not per token), ``requests`` which of the k have rows
        in it."""
        self._turn = (self._turn + 1) % _SCRATCHES
        sent = self._sent[self._turn]
        if sent is not None:  # this scratch is about to be cut again
            sent.synchronize()
            self._sent[self._turn] = None
        self._carved = 0
        if not self.entries or not len(ids):
            return []
        # Every entry's invokes at once: a request recomputed after 500 decode steps meets 500
        # entries of up to a thousand invokes each (array operations per entry cost tens of us)
        cols = self._columns()
        every = cols[0]
        lo, hi = int(ids.min()), int(ids.max()) + 1
        which = np.full(hi - lo, -1, np.int64)  # log id - lo -> k (ids span the live invokes: small)
        which[ids - lo] = np.arange(len(ids))
        inside = np.flatnonzero((every >= lo) & (every < hi))
        found = which[every[inside] - lo]
        hit = inside[found >= 0]
        if not len(hit):
            return []
        k = found[found >= 0]
        at_first, at_start, at_stop, entry_of, point_of = (cols[row, hit] for row in range(1, 6))
        lo_pos = np.maximum(at_first, firsts[k])
        hi_pos = np.minimum(at_first + at_stop - at_start, stops[k])
        ok = np.flatnonzero(lo_pos < hi_pos)
        if not len(ok):
            return []
        k, entry_of, point_of = k[ok], entry_of[ok], point_of[ok]
        counts = hi_pos[ok] - lo_pos[ok]
        sources = at_start[ok] + lo_pos[ok] - at_first[ok]
        targets = start_rows[k] + lo_pos[ok] - firsts[k]
        for e in np.unique(entry_of).tolist():  # copies from the GPU, each waited for once
            written = self.entries[e].written
            if written.ready is not None:
                written.ready.synchronize()
                written.ready = None
        numbers, first_hit = np.unique(point_of, return_index=True)
        out = []
        for number in numbers[np.argsort(first_hit)].tolist():  # points in the order first written
            sel = slice(None) if len(numbers) == 1 else np.flatnonzero(point_of == number)
            value = _gather(self.entries, entry_of[sel], sources[sel], counts[sel], self._carve)
            out.append((self._point_list[number], expand_ranges(targets[sel], counts[sel]), self._send(value),
                        np.unique(k[sel])))
        if self.device is not None:
            self._sent[self._turn] = torch.cuda.Event()
            self._sent[self._turn].record()
        return out

    def _columns(self) -> np.ndarray:
        """Every entry's invokes end to end, as rows: ids, firsts, starts, stops, entry number,
        point number (grown by the entries logged since the last replay; rebuilt after a pass
        lets go of some)."""
        new = self.entries[self._indexed:]
        if new:
            sizes = np.fromiter((len(e.ids) for e in new), np.int64, len(new))
            block = np.empty((6, int(sizes.sum())), np.int64)
            for row, name in enumerate(("ids", "firsts", "starts", "stops")):
                np.concatenate([getattr(e, name) for e in new], out=block[row])
            block[4] = np.repeat(np.arange(self._indexed, len(self.entries)), sizes)
            block[5] = np.repeat(np.fromiter((self._point_number(e.point) for e in new), np.int64, len(new)), sizes)
            filled = self._filled + block.shape[1]
            if filled > self._cols.shape[1]:
                grown = np.empty((6, max(2 * self._cols.shape[1], filled)), np.int64)
                grown[:, : self._filled] = self._cols[:, : self._filled]
                self._cols = grown
            self._cols[:, self._filled : filled] = block
            self._filled, self._indexed = filled, len(self.entries)
        return self._cols[:, : self._filled]

    def _point_number(self, point: Point) -> int:
        number = self._points.get(point)
        if number is None:
            number = self._points[point] = len(self._point_list)
            self._point_list.append(point)
        return number

    def _send(self, value: Any) -> Any:
        """A gathered value on the book's device (copied from pinned scratch: asynchronous)."""
        if self.device is None or value is None:
            return value
        if isinstance(value, tuple):
            return tuple(self._send(v) for v in value)
        return value.to(self.device, non_blocking=True)

    def _carve(self, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor cut from the scratch memory (grown, never shrunk)."""
        nbytes = -(-math.prod(shape) * dtype.itemsize // 64) * 64
        scratch = self._scratches[self._turn]
        if self._carved + nbytes > len(scratch):  # earlier cuts keep the old memory alive
            scratch = self._scratches[self._turn] = torch.empty(max(2 * len(scratch), nbytes), dtype=torch.uint8,
                                                                pin_memory=self.device is not None)
            self._carved = 0
        piece = scratch[self._carved : self._carved + math.prod(shape) * dtype.itemsize]
        self._carved += nbytes
        return piece.view(dtype).view(shape)


def _hits(known: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Which of ``ids`` are in ``known`` (sorted, not empty)."""
    at = np.minimum(np.searchsorted(known, ids), len(known) - 1)
    return known[at] == ids


def _gather(entries: list[_Entry], entry_of: np.ndarray, sources: np.ndarray, counts: np.ndarray, carve,
            element: int | None = None) -> Any:
    """Rows ``sources[i]:sources[i] + counts[i]`` of entry ``entry_of[i]``'s host copy (of its
    element ``element`` for a module's tuple output), for each i in turn, copied once into one
    value cut by ``carve``: a tensor, or a tuple whose elements that are not per token are None.
    A recomputed step of 16k tokens replays as many rows from hundreds of entries: one numpy
    concatenation of views, where a torch call per entry cost ~15 us each and copied twice."""
    written = entries[int(entry_of[0])].written
    first = written.value if element is None else written.value[element]
    if isinstance(first, tuple):
        return tuple(_gather(entries, entry_of, sources, counts, carve, i) for i in range(len(first)))
    if not isinstance(first, torch.Tensor):
        return None
    dim = _token_dim(first, written.num_rows)
    if dim is None:
        return None
    # one piece per run of rows of one entry (adjacent invokes' rows join)
    joins = (entry_of[1:] == entry_of[:-1]) & (sources[1:] == sources[:-1] + counts[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lengths = np.add.reduceat(counts, starts)
    arrays = [entries[e].written.arrays() for e in entry_of[starts].tolist()]
    if element is not None:
        arrays = [a[element] for a in arrays]
    pieces = [a[s : s + n] for a, s, n in zip(arrays, sources[starts].tolist(), lengths.tolist())] if dim == 0 else \
        [a[:, s : s + n] for a, s, n in zip(arrays, sources[starts].tolist(), lengths.tolist())]
    shape = list(first.shape)
    shape[dim] = int(lengths.sum())
    out = carve(shape, first.dtype)
    np.concatenate(pieces, axis=dim, out=_as_arrays(out))
    return out


def _as_arrays(value: Any) -> Any:
    """A tensor (or a tuple's tensors) as a numpy array of the same bytes, integers of the
    element's size."""
    if isinstance(value, tuple):
        return tuple(_as_arrays(v) for v in value)
    if not isinstance(value, torch.Tensor):
        return None
    return value.view(_SAME_SIZE[value.element_size()]).numpy()


_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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

