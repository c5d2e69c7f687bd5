"""A report's saved rows, gathered from a rank's save ledger (saves.py) into one tensor per name.

Each name's rows are gathered into one tensor in invoke order, each invoke's result a view of it:
one gather per name, whatever the number of chunks (for a sweep of 256 invokes x 128 steps x 4
names, four row selections, not 131,072 slices). Rows all on the GPU are put in order there and
moved to the host in one copy: on an H200 host, 512 MiB of rows were gathered on the device in
0.3 ms and moved in 37 ms, where gathering them on the host from step-major chunks took 170 ms
after the trace's last step (bench/host_probe.py). Rows on the host are copied into place by a few
threads.

    ledger.take(trace, [slot, ...]).assemble()  ->  [{"l3": tensor}, ...]
    ...assemble(batch.allocate)                  the same, gathered straight into a report file
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from interlace.workers.points import device_index
from interlace.workers.report_file import copy_to_host
from interlace.workers.reporter import one_openmp_thread

if TYPE_CHECKING:
    from interlace.workers.saves import SaveChunk, SaveLedger

Allocate = Callable[[list[tuple[tuple[int, ...], torch.dtype]]], list[torch.Tensor]]


def host_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The default :data:`Allocate`: fresh host tensors."""
    return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


@dataclass
class TakenSaves:
    """Saves handed out by :meth:`SaveLedger.take`."""

    parts: dict[str, list[tuple[SaveChunk, np.ndarray]]]  # by name: chunks and which entries are wanted
    wanted: np.ndarray  # the owners, in the order results come back
    ledger: SaveLedger | None = None
    device_ready: DeviceReady | None = None  # after the rows kept on the device (None: none are)

    def release(self) -> None:
        """Once assembled (results no longer point into the chunks): let their memory be reused."""
        if self.ledger is not None:
            self.ledger.release([chunk for parts in self.parts.values() for chunk, _ in parts])

    @property
    def nbytes(self) -> int:
        """Bytes of the rows wanted."""
        return sum(int((chunk.stops - chunk.starts)[mask].sum()) * (chunk.rows[:1].nbytes if len(chunk.rows) else 0)
                   for parts in self.parts.values() for chunk, mask in parts)

    @classmethod
    def together(cls, takens: list["TakenSaves"]) -> "TakenSaves":
        """Several traces' takes as one, to assemble at once (a server's one-invoke traces that
        finish in the same step; their slots differ): each chunk listed once per name, with the
        owners any of them wants, so rows saved for many traces at once (taps.TappedSaves, runs
        of steps) are gathered once for all of them, not once per trace. Results come back in
        the takes' order; releasing stays each take's own."""
        parts: dict[str, list[tuple[SaveChunk, np.ndarray]]] = {}
        for name in dict.fromkeys(name for taken in takens for name in taken.parts):
            # Each take lists its chunks in save order, and all are in the order of one ledger:
            # a chunk new here goes right after the one before it in its take, which keeps every
            # take's order (what its owners' rows are concatenated in).
            order: list[SaveChunk] = []
            masks: dict[int, np.ndarray] = {}
            for taken in takens:
                at = 0  # where the take's next new chunk goes
                for chunk, mask in taken.parts.get(name, ()):
                    if id(chunk) in masks:
                        masks[id(chunk)] = masks[id(chunk)] | mask
                        at = next(i for i, known in enumerate(order) if known is chunk) + 1
                    else:
                        masks[id(chunk)] = mask
                        order.insert(at, chunk)
                        at += 1
            parts[name] = [(chunk, masks[id(chunk)]) for chunk in order]
        # the last take's events were recorded after every device copy the earlier ones wait for
        ready = next((taken.device_ready for taken in reversed(takens) if taken.device_ready is not None), None)
        return cls(parts, np.concatenate([taken.wanted for taken in takens]), None, ready)

    def assemble(self, allocate: Allocate = host_tensors,
                 meanwhile: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
        """Each owner's saves by name: rows of all its chunks, in save order, concatenated along
        dim 0 (a residual saved every step is the whole sequence's).

        Each name's rows are gathered into one tensor that ``allocate`` gives for its shape and
        dtype (all at once, sizes known before any byte moves: a report file's data region, so
        that gathering is writing); each owner's result is a view of it.

        ``meanwhile(results)`` runs once every copy is under way and before the copies from the GPU
        are waited for: a report's header is written while its rows are still moving (pickling a
        256-invoke header takes about as long as moving 512 MiB of rows on an H100 host).
        """
        with _after_engine(self.device_ready) as stream:  # on a side stream, behind the engine's device copies
            try:
                layouts: dict = {}
                plans = {name: _plan(parts, self.wanted, layouts) for name, parts in self.parts.items()}
                gathers = {name: plan for name, plan in plans.items() if isinstance(plan, _Gather)}
                into = dict(zip(gathers, allocate([(g.shape, g.dtype) for g in gathers.values()])))
                for name, plan in gathers.items():
                    if plan.on_device:
                        _gather_on_device(plan, into[name])
                _copy([(copy.on_host(), into[name]) for name, plan in gathers.items() if not plan.on_device
                       for copy in plan.copies])
                results: list[dict[str, Any]] = [{} for _ in self.wanted]
                for name, plan in plans.items():
                    for i, value in (plan.views(into[name]) if name in into else plan).items():
                        results[i][name] = value
                if meanwhile is not None:
                    meanwhile(results)
            finally:  # also after a failure: the copies read rows that the caller lets go of next
                if stream is not None:
                    stream.synchronize()
        return results


@dataclass
class _Copy:
    """Rows of one chunk into their places in a name's gathered tensor."""

    rows: torch.Tensor  # the chunk's rows
    source: torch.Tensor | None  # which of them, in destination order (None: all, in order)
    dest: slice | torch.Tensor  # where they go
    nbytes: int  # bytes copied

    def on_host(self) -> "_Copy":
        """The same copy from a host copy of the rows (for rows kept on the device whose name
        also has rows on the host: rare, a trace that outgrew the device room)."""
        if not self.rows.is_cuda:
            return self
        return _Copy(self.rows.to("cpu"), self.source, self.dest, self.nbytes)


@dataclass
class _Gather:
    """One name's rows, planned: the tensor they are gathered into, and which rows go where."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    copies: list[_Copy]  # one per chunk
    owners: list[int]  # index into ``wanted`` of each owner with rows, in destination order
    counts: list[int]  # each such owner's number of rows
    chunks: list[SaveChunk]  # the chunks rows come from
    row_chunk: np.ndarray  # [rows] each destination row's chunk (index into ``chunks``)
    row_source: np.ndarray  # [rows] and its row there

    def views(self, out: torch.Tensor) -> dict[int, torch.Tensor]:
        """Each owner's rows of ``out``, once the copies have filled it."""
        return dict(zip(self.owners, out.split(self.counts)))

    @property
    def on_device(self) -> bool:
        """Every row is on the GPU: gathered there, then moved to the host in one copy."""
        return bool(self.chunks) and all(chunk.rows.is_cuda for chunk in self.chunks)


@dataclass
class DeviceReady:
    """When rows kept on a GPU may be read from another thread: events recorded on the engine
    thread after every device copy queued so far, on each stream saves were made on."""

    device: torch.device
    events: list[torch.cuda.Event]

    @classmethod
    def now(cls, chunks: list[SaveChunk], streams) -> "DeviceReady | None":
        devices = {chunk.rows.device for chunk in chunks if chunk.device_holds}
        if not devices:
            return None
        events = []
        for stream in streams:
            events.append(torch.cuda.Event())
            events[-1].record(stream)
        return cls(devices.pop(), events)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextlib.contextmanager
def _after_engine(ready: DeviceReady | None):
    """The device work of a report: on a stream of the reporter's own (on the rows' device, which
    need not be this thread's current one), after the engine's copies."""
    if ready is None:
        yield None
        return
    stream = _side_streams.setdefault(ready.device, torch.cuda.Stream(ready.device))
    with torch.cuda.device(ready.device), torch.cuda.stream(stream):
        for event in ready.events:
            stream.wait_event(event)
        yield stream


def _gather_on_device(plan: "_Gather", out: torch.Tensor) -> None:
    """One name's rows, all on the GPU: the chunks concatenated and put in order there (two
    kernels and one index upload, whatever the number of chunks), then moved into ``out`` on the
    host (one copy, or one per pinned slice of a report file), which waits for them.

    Of each chunk only the span that holds rows wanted here is concatenated: a chunk saved for a
    server's many one-invoke traces at once (taps.TappedSaves) holds every trace's rows, and each
    trace's report takes its own (at 64 clients, 1/64 of every chunk)."""
    lo, hi = _spans(plan.row_chunk, plan.row_source, len(plan.chunks))
    rows = torch.cat([_plain(chunk.rows[a:b]) for chunk, a, b in zip(plan.chunks, lo.tolist(), hi.tolist())])
    sizes = hi - lo
    order = (np.cumsum(sizes) - sizes - lo)[plan.row_chunk] + plan.row_source  # each destination row's source
    copy_to_host(_plain(out), rows.index_select(0, device_index(torch.from_numpy(order), rows.device)), wait=False)


def _spans(row_chunk: np.ndarray, row_source: np.ndarray, chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """Each chunk's first and past-the-last row that some destination row comes from (0, 0 for a
    chunk none comes from)."""
    lo = np.full(chunks, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.zeros(chunks, dtype=np.int64)
    np.minimum.at(lo, row_chunk, row_source)
    np.maximum.at(hi, row_chunk, row_source + 1)
    return np.minimum(lo, hi), hi


_COPY_THREADS = max(1, min(4, len(os.sched_getaffinity(0)) // 2))  # of the cores this process may use
_PARALLEL_BYTES = 16 << 20  # below this, one thread: handing work over would cost more
_copy_pool: ThreadPoolExecutor | None = None


def _copy(copies: list[tuple[_Copy, torch.Tensor]]) -> None:
    """Each chunk's rows into their places in its name's tensor. A large report is shared among a
    few threads, in runs of about equal bytes (torch's copies release the GIL, and vLLM runs torch
    with one thread per worker, so they would otherwise use one core)."""
    global _copy_pool
    ends = np.cumsum([copy.nbytes for copy, _ in copies], dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    if total < _PARALLEL_BYTES or _COPY_THREADS == 1:
        _copy_run(copies)
        return
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="interlace-gather",
                                        initializer=one_openmp_thread)
    cuts = np.searchsorted(ends, np.arange(1, _COPY_THREADS) * total / _COPY_THREADS).tolist()
    runs = [copies[a:b] for a, b in zip([0, *cuts], [*cuts, len(copies)]) if b > a]
    for done in [_copy_pool.submit(_copy_run, run) for run in runs]:
        done.result()


def _copy_run(copies: list[tuple[_Copy, torch.Tensor]]) -> None:
    scratch = torch.empty(0, dtype=torch.uint8)  # rows picked out of a chunk, reused: fresh memory
    for copy, out in copies:  # for each chunk would fault in its pages every time
        rows, target = _plain(copy.rows), _plain(out)
        if copy.nbytes >= _WIDE_BYTES:
            rows, target = _wide_rows(rows), _wide_rows(out)
            if (rows.dtype, rows.shape[1:]) != (target.dtype, target.shape[1:]):  # one could not be widened: both as they are
                rows, target = _plain(copy.rows), _plain(out)
        if copy.source is not None and isinstance(copy.dest, slice):  # picked straight into their place
            torch.index_select(rows, 0, copy.source, out=target[copy.dest])
            continue
        if copy.source is not None:
            if scratch.numel() < copy.nbytes:
                scratch = torch.empty(copy.nbytes, dtype=torch.uint8)
            picked = scratch[: copy.nbytes].view(rows.dtype).view(-1, *rows.shape[1:])
            rows = torch.index_select(rows, 0, copy.source, out=picked)
        if isinstance(copy.dest, slice):
            target[copy.dest].copy_(rows)  # one run (e.g. a single invoke)
        else:
            target.index_copy_(0, copy.dest, rows)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dtype torch's indexed copies have kernels for: the same bytes as integers of its
    element's size for dtypes that have none (uint16, uint32, uint64, float8, float4: a program may
    save them, and their gather failed with "index_copy_cpu not implemented for 'UInt16'")."""
    if t.dtype in _INDEXABLE:
        return t
    return t.view(_SAME_SIZE[t.element_size()])


_INDEXABLE = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                        torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})
_SAME_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.complex128}


# Copies smaller than this copy their rows as they are: widening takes four views of each side,
# about 20 us of Python, which a server's one-invoke reports (a few rows per chunk) paid per chunk.
_WIDE_BYTES = 1 << 20


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


def _plan(parts: list[tuple[SaveChunk, np.ndarray]], wanted: np.ndarray,
          layouts: dict | None = None) -> _Gather | dict[int, object]:
    """Where one name's rows go for each wanted owner (by index into ``wanted``): one indexed
    copy per chunk into one tensor, each result a view of it, so a report file stores it once
    and the driver maps it without copying. Rows of different shapes are assembled at once.

    ``layouts``: destination orders already worked out for other names of the report, by the
    arrays their chunks share. Saves made together share their owners' arrays (taps.TappedSaves:
    4 layers saved per step), so their names have one order, worked out once: it takes about
    2 ms per name on a 256-invoke trace, after its last step."""
    for chunk, _ in parts:
        if chunk.ready is not None:
            chunk.ready.synchronize()
    if len({(c.rows.shape[1:], c.rows.dtype) for c, _ in parts}) != 1:
        return _assemble_unlike(parts, _invokes(parts, wanted))
    key = tuple((id(c.owners), id(c.starts), id(c.stops), m.tobytes()) for c, m in parts)
    layout = layouts.get(key) if layouts is not None else None
    if layout is None:
        layout = _layout(parts, wanted)
        if layouts is not None:
            layouts[key] = layout
    row_chunk, row_source, owners, counts = layout
    first = parts[0][0].rows
    copies = [] if all(c.rows.is_cuda for c, _ in parts) else _host_copies(parts, row_chunk, row_source)
    return _Gather((len(row_chunk), *first.shape[1:]), first.dtype, copies, owners, counts,
                   [c for c, _ in parts], row_chunk, row_source)


def _invokes(parts: list[tuple[SaveChunk, np.ndarray]], wanted: np.ndarray) -> np.ndarray:
    """Each wanted range's owner, as its index into ``wanted``, in chunk order."""
    index_of = np.zeros(int(wanted.max()) + 1, dtype=np.int64)  # slot -> its index in wanted
    index_of[wanted] = np.arange(len(wanted))
    return index_of[np.concatenate([c.owners[m] for c, m in parts])]


def _layout(parts: list[tuple[SaveChunk, np.ndarray]], wanted: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """The destination order of one name's rows: each row's chunk and its row there, and the
    owners with rows (indices into ``wanted``) with their row counts."""
    invoke = _invokes(parts, wanted)
    chunk = np.repeat(np.arange(len(parts)), [np.count_nonzero(m) for _, m in parts])
    start = np.concatenate([c.starts[m] for c, m in parts])
    length = np.concatenate([(c.stops - c.starts)[m] for c, m in parts])
    # owner-major, save order within an owner: a stable sort, by radix when the keys fit 16 bits
    order = np.argsort(invoke.astype(np.int16) if len(wanted) <= np.iinfo(np.int16).max else invoke, kind="stable")
    chunk, start, length, invoke = chunk[order], start[order], length[order], invoke[order]
    # one entry per row, in destination order: its chunk and its row there
    row_chunk = np.repeat(chunk, length)
    row_source = np.repeat(start - np.cumsum(length) + length, length) + np.arange(length.sum())
    present = np.unique(invoke)
    counts = np.bincount(invoke, weights=length, minlength=len(wanted)).astype(np.int64)[present]
    return row_chunk, row_source, present.tolist(), counts.tolist()


def _host_copies(parts: list[tuple[SaveChunk, np.ndarray]], row_chunk: np.ndarray, row_source: np.ndarray
                 ) -> list[_Copy]:
    """One copy per chunk, for rows gathered on the host (rows all on the GPU are gathered there
    from ``row_chunk`` and ``row_source`` alone)."""
    by_chunk = np.argsort(row_chunk, kind="stable")  # destination rows grouped by source chunk
    bounds = np.cumsum([0] + np.bincount(row_chunk, minlength=len(parts)).tolist())
    row_bytes = parts[0][0].rows[:1].nbytes
    copies = []
    for i, (c, _) in enumerate(parts):
        dest = by_chunk[bounds[i] : bounds[i + 1]]
        source = row_source[dest]
        if len(dest) == c.rows.shape[0]:  # every row of the chunk (a permutation of them): scatter it whole
            in_order = np.empty_like(dest)
            in_order[source] = dest
            copies.append(_Copy(c.rows, None, _destination(in_order), row_bytes * len(dest)))
        elif len(dest):
            copies.append(_Copy(c.rows, torch.from_numpy(source), _destination(dest), row_bytes * len(dest)))
    return copies


def _destination(rows: np.ndarray) -> slice | torch.Tensor:
    """Destination rows for a chunk's copy: a slice when they are one ascending run."""
    if len(rows) and np.all(np.diff(rows) == 1):
        return slice(int(rows[0]), int(rows[-1]) + 1)
    return torch.from_numpy(rows)


def _assemble_unlike(parts: list[tuple[SaveChunk, np.ndarray]], invoke: np.ndarray) -> dict[int, object]:
    """Rows of different shapes under one name: a list per owner, in save order (rare: one
    Python step per saved range)."""
    out: dict[int, list] = defaultdict(list)
    ranges = ((c.rows, a, b) for c, m in parts for a, b in zip(c.starts[m], c.stops[m]))
    for i, (rows, a, b) in zip(invoke.tolist(), ranges):
        out[i].append(rows[a:b].to("cpu", copy=True))  # own storage: a view would pickle the whole chunk
    return {i: values[0] if len(values) == 1 else values for i, values in out.items()}
