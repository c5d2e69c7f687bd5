"""Saved rows on their way from a worker rank to an invoke's report.

Engine thread. A save of rows (a tensor whose dim 0 runs over a group's tokens or invokes) is
recorded once for its whole group: one :class:`SaveChunk` per save call, holding a host copy of the
rows and, as arrays, which invoke (slot) owns which of them. On a GPU the copy is made at save
time, asynchronously on the engine's stream into pinned host memory, so no step waits for it.

Reporter thread, while the trace runs. :class:`SavedRows` takes in each chunk as it lands: every
invoke's rows under a name are one run of rows in the trace's report data file, appended to step
after step, so the report at the end copies nothing (each save is a view of its run), and pinned
memory holds only the rows still in flight. A run has room for what its invoke will still save:
its first save gets exactly its rows (a prompt's residual saved once wastes nothing); a second
save moves the run (once) to room for one more save of that size per step the invoke has left,
so a residual saved at every step is moved once, after its first step. Room never written is
never backed by memory (the data file is sparse).

    chunk = SaveChunk.of("t", "l3", rows, owners=slots, starts=starts, stops=stops, steps_left=left)
    saved = SavedRows(); saved.take_in(chunk)                  (reporter thread, as chunks land)
    saved.take([slot, ...])  ->  [{"l3": tensor}, ...]         (forgets them: slots are reused)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from interlace.workers.pinned import PinnedSlabs, Slab
from interlace.workers.points import expand_ranges


@dataclass
class SaveChunk:
    """One save call's rows, for every invoke of its group."""

    trace: str
    name: str
    rows: torch.Tensor  # host copy (pinned and possibly still in flight when it came from a GPU)
    ready: torch.cuda.Event | None  # recorded after the copy; None for host values
    owners: np.ndarray  # invoke slot of each range (distinct)
    starts: np.ndarray  # each owner's rows of ``rows``: starts[i]:stops[i]
    stops: np.ndarray
    steps_left: np.ndarray  # each owner's generation steps after this one (sizes its run)
    slab: Slab | None = None  # where ``rows`` live (pinned slabs): released once taken in

    def wait(self) -> None:
        """Until the rows have landed on the host."""
        if self.ready is not None:
            self.ready.synchronize()

    @classmethod
    def of(cls, trace: str, name: str, value: torch.Tensor, owners: np.ndarray, starts: np.ndarray,
           stops: np.ndarray, steps_left: np.ndarray, pinned: PinnedSlabs | None = None) -> "SaveChunk":
        rows, ready, slab = host_copy(value, pinned)
        return cls(trace, name, rows, ready, owners, starts, stops, steps_left, slab)


def host_copy(value: torch.Tensor, pinned: PinnedSlabs | None = None
              ) -> tuple[torch.Tensor, torch.cuda.Event | None, Slab | None]:
    """A snapshot of ``value`` on the host, cut from ``pinned``'s slabs when given (and holding
    its slab). From a GPU it is asynchronous: the copy is queued on the current stream (so later
    in-place kernels cannot change it) and ``ready`` tells when it has landed."""
    value = value.detach()
    on_gpu = value.device.type == "cuda"
    if pinned is not None:
        host, slab = pinned.empty(tuple(value.shape), value.dtype)
    elif on_gpu:
        host, slab = torch.empty(value.shape, dtype=value.dtype, pin_memory=True), None
    else:
        return value.clone(), None, None
    host.copy_(value, non_blocking=on_gpu)
    if not on_gpu:
        return host, None, slab
    ready = torch.cuda.Event()
    ready.record()
    return host, ready, slab


class HostRows:
    """Rows ``start:stop`` of a :func:`host_copy` that may still be in flight; :meth:`get` (on the
    reporter thread) waits for it. Shared contributions travel like this, so ``share()`` at every
    step never makes the engine wait for the GPU."""

    __slots__ = ("rows", "ready", "start", "stop")

    def __init__(self, rows: torch.Tensor, ready: torch.cuda.Event | None, start: int, stop: int):
        self.rows, self.ready, self.start, self.stop = rows, ready, start, stop

    def get(self) -> torch.Tensor:
        if self.ready is not None:
            self.ready.synchronize()
        if self.rows.dim() == 0 or (self.start, self.stop) == (0, len(self.rows)):
            return self.rows
        return self.rows[self.start : self.stop].clone()  # own storage: a view would pickle it all


Allocate = Callable[[int], torch.Tensor]  # nbytes -> uninitialised bytes (a region of a data file)


def fresh_bytes(nbytes: int) -> torch.Tensor:
    """The default :data:`Allocate`: ordinary host memory."""
    return torch.empty(nbytes, dtype=torch.uint8)


class SavedRows:
    """One trace's saved rows on one rank, each invoke's rows per name in one run (see the module
    docstring). Used from one thread."""

    def __init__(self, allocate: Allocate = fresh_bytes):
        self._allocate = allocate
        self._runs: dict[str, list[_Runs]] = {}  # name -> its rows by row shape and dtype, in order first saved

    def take_in(self, chunk: SaveChunk) -> None:
        """Append the chunk's rows to their owners' runs (waiting for the copy to land)."""
        chunk.wait()
        shape, dtype = tuple(chunk.rows.shape[1:]), chunk.rows.dtype
        by_shape = self._runs.setdefault(chunk.name, [])
        runs = next((r for r in by_shape if (r.row_shape, r.dtype) == (shape, dtype)), None)
        if runs is None:
            runs = _Runs(shape, dtype, self._allocate)
            by_shape.append(runs)
        runs.append(chunk)

    def take(self, owners: list[int]) -> list[dict[str, Any]]:
        """Each owner's saves by name (its rows in save order; a list, one tensor per row shape,
        when a name was saved with rows of several shapes); the owners are forgotten."""
        results: list[dict[str, Any]] = [{} for _ in owners]
        for name, by_shape in self._runs.items():
            for result, owner in zip(results, owners):
                values = [v for v in (runs.pop(owner) for runs in by_shape) if v is not None]
                if values:
                    result[name] = values[0] if len(values) == 1 else values
        return results


class _Runs:
    """Rows of one shape and dtype under one name: each owner's rows are ``used`` rows from
    ``first`` in one of ``blocks`` (each ``[rows, *row_shape]``), with ``room`` rows there."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, allocate: Allocate):
        self.row_shape, self.dtype, self._allocate = row_shape, dtype, allocate
        self.row_bytes = math.prod(row_shape) * dtype.itemsize
        self.blocks: list[torch.Tensor] = []
        # by owner slot (grown as slots appear); block -1: no rows yet
        self.block = np.full(0, -1, np.int64)
        self.first = np.zeros(0, np.int64)
        self.room = np.zeros(0, np.int64)
        self.used = np.zeros(0, np.int64)

    def append(self, chunk: SaveChunk) -> None:
        # Runs on the reporter thread beside the engine's: few numpy and torch calls per chunk,
        # since each hands the GIL back and forth with the engine thread.
        owners, starts = chunk.owners, chunk.starts
        lengths = chunk.stops - starts
        if len(owners) and int(owners.max()) >= len(self.block):
            self._grow(int(owners.max()) + 1)
        block, used = self.block[owners], self.used[owners]
        short = (block < 0) | (used + lengths > self.room[owners])
        if short.any():
            self._move(owners[short], lengths[short], chunk.steps_left[short])
            block = self.block[owners]
        at = self.first[owners] + used
        self.used[owners] = used + lengths
        if not (lengths == 1).all():
            starts, at, block = expand_ranges(starts, lengths), expand_ranges(at, lengths), np.repeat(block, lengths)
        if len(block) and block.min() == block.max():  # usually: a sweep's runs share one block
            _copy_rows(chunk.rows, starts, self.blocks[int(block[0])], at)
            return
        for b in np.unique(block).tolist():
            mine = block == b
            _copy_rows(chunk.rows, starts[mine], self.blocks[b], at[mine])

    def pop(self, owner: int) -> torch.Tensor | None:
        if owner >= len(self.block) or self.block[owner] < 0:
            return None
        first, used = int(self.first[owner]), int(self.used[owner])
        value = self.blocks[int(self.block[owner])][first : first + used]
        self.block[owner], self.used[owner], self.room[owner] = -1, 0, 0
        return value

    def _move(self, owners: np.ndarray, lengths: np.ndarray, steps_left: np.ndarray) -> None:
        """Give ``owners`` runs with room for ``lengths`` more rows (and, for those that already
        have rows, that many per step left), in one new block, moving their rows there."""
        used, had = self.used[owners], self.block[owners] >= 0
        room = np.where(had, np.maximum(used + lengths * (1 + np.maximum(steps_left, 0)), 2 * (used + lengths)),
                        lengths)
        block = len(self.blocks)
        rows = int(room.sum())
        self.blocks.append(self._allocate(max(1, rows * self.row_bytes))[: rows * self.row_bytes]
                           .view(self.dtype).view(rows, *self.row_shape))
        first = np.cumsum(room) - room
        for old in np.unique(self.block[owners][had]).tolist():  # usually one block: a sweep moves together
            moving = had & (self.block[owners] == old)
            _copy_rows(self.blocks[old], expand_ranges(self.first[owners][moving], used[moving]),
                       self.blocks[block], expand_ranges(first[moving], used[moving]))
        self.block[owners], self.first[owners], self.room[owners] = block, first, room

    def _grow(self, size: int) -> None:
        if size > len(self.block):
            grown = max(size, 2 * len(self.block))
            pad = grown - len(self.block)
            self.block = np.concatenate([self.block, np.full(pad, -1, np.int64)])
            self.first, self.room, self.used = (np.concatenate([a, np.zeros(pad, np.int64)])
                                                for a in (self.first, self.room, self.used))


def _copy_rows(source: torch.Tensor, rows: np.ndarray, dest: torch.Tensor, at: np.ndarray) -> None:
    """``dest[at] = source[rows]``, as one slice copy when both are runs."""
    if not len(rows):
        return
    source_run, dest_run = _run(rows), _run(at)
    if source_run is not None and dest_run is not None:
        dest[dest_run].copy_(source[source_run])
        return
    src, out = _wide_rows(source), _wide_rows(dest)
    if (src.dtype, src.shape[1:]) != (out.dtype, out.shape[1:]):  # one could not be widened: both as they are
        src, out = source, dest
    picked = src[source_run] if source_run is not None else src.index_select(0, torch.from_numpy(rows))
    if dest_run is not None:
        out[dest_run].copy_(picked)
    else:
        out.index_copy_(0, torch.from_numpy(at), picked)


def _run(rows: np.ndarray) -> slice | None:
    """``rows`` as a slice when they are one ascending run."""
    if len(rows) == 1 or (len(rows) and rows[-1] - rows[0] == len(rows) - 1 and np.all(np.diff(rows) == 1)):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return None


def _wide_rows(t: torch.Tensor) -> torch.Tensor:
    """Contiguous rows as ``[n, k]`` of the widest element that divides a row: torch's indexed
    copies on the CPU go element by element, and 16-byte elements copy about twice as fast as
    bfloat16's (measured on 128 MiB). Other tensors are returned as they are."""
    n = t.shape[0] if t.dim() else 0
    if n == 0 or not t.is_contiguous():
        return t
    row_bytes = t.nbytes // n
    for wide in (torch.complex128, torch.int64, torch.int32):
        if row_bytes % wide.itemsize == 0 and t.data_ptr() % wide.itemsize == 0:
            return t.view(n, -1).view(torch.uint8).view(wide)
    return t
