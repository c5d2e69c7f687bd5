"""Saved values on their way from a worker rank to an invoke's report.

A save of rows (a tensor whose dim 0 runs over a group's tokens or invokes) is recorded once for
its whole group: one :class:`SaveChunk` per save call, holding a copy of the rows and, as arrays,
which invoke owns which of them. Where the copy lives:

- On a GPU, while the rank's :class:`DeviceRoom` has room, it stays on the device (a device-side
  copy costs one kernel and nothing on the host). Reporting gathers each name's rows on the device
  into invoke order and moves them to the host in one copy: on an H200 host, 512 MiB of rows were
  gathered on the device in 0.3 ms and moved in 37 ms, where gathering them on the host from
  step-major chunks took 170 ms after the trace's last step (bench/host_probe.py).
- Past that room (and for shared contributions), asynchronously into pinned host memory on the
  engine's stream, so no step waits for it; reporting gathers those on the host.
- On a CPU, a plain copy.

Either way reporting is one gather per name: for a sweep of 256 invokes x 128 steps x 4 names,
four row selections, not 131,072 slices.

A group of saves made at every step of a decode with the same owners and rows (graph taps saving a
trace's last token at 4 layers) is instead gathered, step after step, into one device buffer of
:data:`RUN_STEPS` steps: a *run*, entered in the ledger as one chunk per name when it is full, when
its trace is reported, or when another save of one of its names for one of its traces comes.

    ledger.add(trace, [("l3", rows)], owners=slots, starts=starts, stops=stops)     (numpy arrays)
    ledger.run_rows(group, trace, ["l3"], slots, starts, stops, steps, ...)  -> where this step's rows go
    ledger.take(trace, [slot, ...]).assemble()  ->  [{"l3": tensor}, ...]   (take forgets them)
    ...assemble(batch.allocate)                  the same, gathered straight into a report file
"""

from __future__ import annotations

from collections import defaultdict
import contextlib
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from interlace.core import settings
from interlace.workers.pinned import PinnedSlabs, Slab
from interlace.workers.points import device_index
from interlace.workers.slots import ALL_STEPS
from interlace.workers.report_file import copy_to_host


@dataclass
class SaveChunk:
    """One save call's rows, for every invoke of its group."""

    name: str
    rows: torch.Tensor  # kept on the GPU, or a host copy (pinned, possibly still in flight)
    ready: torch.cuda.Event | None  # recorded after the copy; None for host values
    owners: np.ndarray  # invoke slot of each range
    starts: np.ndarray  # each owner's rows of ``rows``: starts[i]:stops[i]
    stops: np.ndarray
    pending: int  # owners not yet reported
    slab: Slab | None = None  # where ``rows`` live (pinned slabs): released when no report needs them
    taken: np.ndarray | None = None  # which owners' rows were handed out (their slot may be reused)
    device_holds: int = 0  # holders of rows kept on the device (the ledger, reports): room given back at 0
    steps: np.ndarray | None = None  # each owner's generation step when saved (None: kept whatever the cut)
    traces: TraceOwners | None = None  # owners of several traces (None: all of the trace it is listed under)


@dataclass
class TraceOwners:
    """Which trace each owner of a save is in, for rows saved for several traces' invokes at once
    (taps.TappedSaves: a server's one-invoke traces saving at the same tap, one gather per step)."""

    codes: np.ndarray  # each owner's trace, as its number
    numbers: dict[str, int]  # trace -> its number
    firsts: list[int]  # each trace's first owner (index into the owners), by number

    @classmethod
    def of(cls, traces: list[str]) -> "TraceOwners | None":
        """The owners' traces (None: all of one trace, the usual case)."""
        numbers: dict[str, int] = {}
        codes = np.fromiter((numbers.setdefault(trace, len(numbers)) for trace in traces), np.int64, len(traces))
        if len(numbers) == 1:
            return None
        firsts = np.full(len(numbers), len(traces), dtype=np.int64)
        np.minimum.at(firsts, codes, np.arange(len(traces)))
        return cls(codes, numbers, firsts.tolist())

    def mask(self, trace: str) -> np.ndarray:
        """Which owners are in ``trace``."""
        return self.codes == self.numbers[trace]


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


class DeviceRoom:
    """How many bytes of saved rows this rank keeps on its GPU until they are reported.

    vLLM sizes its KV cache to leave the rest of the GPU's memory free; saves may use at most
    ``INTERLACE_DEVICE_SAVES_GIB`` of it, and never more than half of what is free when the
    first save is made. Thread-safe: rows are kept on the engine thread and let go of on the
    reporter thread.
    """

    def __init__(self, limit: int | None = None):
        self.limit = limit  # None: decided at the first save
        self.used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> bool:
        with self._lock:
            if self.limit is None:
                free, _total = torch.cuda.mem_get_info(device)
                self.limit = min(settings.device_saves_bytes(), free // 2)
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


# Steps of one run (SaveLedger.run_rows). Per step a run costs the gather into its buffer, where a
# ledger entry cost a fresh tensor, a chunk per name and the ledger's bookkeeping (about 0.13 ms of
# a 1B decode step of ops-save4 on an H200, 2026-12-04, bench/results/2026-12-04-h200-d441450/);
# after the last step, the report plans over a few chunks per name instead of one per step (5 ms
# for 512 chunks). 32 steps bound what a run holds beyond its filled steps while it is open (at
# most 31 steps' rows: 124 MiB for 4 layers of 256 invokes at the 1B shape); a run entered before
# it is full keeps a copy of its filled steps only, and gives the rest back to the device room.
RUN_STEPS = 32

# The raw handle of the current CUDA stream: a run checks at every step that its gathers are queued
# on a stream the ledger knows (reports wait for those), and torch.cuda.current_stream builds a
# Stream object each time (0.04 ms a step under cProfile). Absent from CPU builds of torch.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class _Run:
    """One group's rows over consecutive steps, in ``buffer`` ([names, RUN_STEPS x rows, *row]):
    step k's rows are ``buffer[:, k * rows : (k + 1) * rows]``, owner i's of them
    ``starts[i]:stops[i]`` within the step's."""

    __slots__ = ("key", "trace", "traces", "names", "owners", "starts", "stops", "rows", "buffer", "steps",
                 "used", "room", "stream", "apart")

    def __init__(self, key: object, trace: str | TraceOwners, names: list[str], owners: np.ndarray,
                 starts: np.ndarray, stops: np.ndarray, buffer: torch.Tensor, room: int):
        self.key, self.names = key, names
        self.trace = trace if isinstance(trace, str) else None
        self.traces = trace if isinstance(trace, TraceOwners) else None
        self.owners, self.starts, self.stops = owners, starts, stops
        self.rows = buffer.shape[1] // RUN_STEPS
        self.buffer = buffer
        self.steps: list[np.ndarray] = []  # each step's owners' generation steps
        self.used = 0  # steps filled
        self.room = room  # bytes taken from the device room (0 on a CPU)
        self.stream = 0  # raw handle of the stream the gathers are queued on (0 on a CPU)
        self.apart: set[int] = set()  # ids of other open runs known to share no owner with this one

    @property
    def trace_names(self) -> list[str]:
        return [self.trace] if self.traces is None else list(self.traces.numbers)


class SaveLedger:
    """Every tensor of rows saved on this rank, by trace, until its invokes are reported."""

    def __init__(self, device_room: DeviceRoom | None = None):
        self._chunks: dict[str, list[SaveChunk]] = defaultdict(list)
        self._pinned = PinnedSlabs()
        self._room = device_room or DeviceRoom()
        self._holds = threading.Lock()  # device_holds change on the engine and reporter threads
        # streams rows were kept on (reports wait for them), by handle: a Stream's own hash builds a
        # torch.device, which this would do at every step
        self._device_streams: dict[int, torch.cuda.Stream] = {}
        self._runs: dict[object, _Run] = {}  # open runs, by their group
        self._open: dict[str, list[_Run]] = {}  # trace -> its open runs

    def add(self, trace: str | TraceOwners, named: list[tuple[str, torch.Tensor]], owners: np.ndarray,
            starts: np.ndarray, stops: np.ndarray, fresh: bool = False, steps: np.ndarray | None = None) -> None:
        """Rows of each ``(name, value)`` for a group: owner ``owners[i]`` (a slot) has rows
        ``starts[i]:stops[i]`` of every value, saved at its generation step ``steps[i]``.
        ``trace``: the owners' trace, or their traces (:class:`TraceOwners`: each chunk is listed
        under each of them). ``fresh``: the values were made for this save and nothing else
        refers to them (no copy needed)."""
        traces = trace if isinstance(trace, TraceOwners) else None
        if self._open:  # an owner's rows of a name stay in save order
            self._close_crossing(list(traces.numbers) if traces is not None else [trace], {n for n, _ in named}, owners)
        chunks: list[SaveChunk] = [] if traces is not None else self._chunks[trace]
        first = named[0][1]
        if first.is_cuda and self._room.take(sum(value.nbytes for _name, value in named), first.device):
            stream = torch.cuda.current_stream(first.device)
            self._device_streams.setdefault(stream.cuda_stream, stream)
            for name, value in named:  # a snapshot unless fresh: later in-place kernels cannot change it
                rows = value.detach() if fresh else value.detach().clone()
                chunks.append(SaveChunk(name, rows, None, owners, starts, stops, len(owners), device_holds=1,
                                        steps=steps, traces=traces))
        else:
            for name, value in named:
                if fresh and not value.is_cuda:  # a CPU copy made for this save: nothing to copy again
                    chunks.append(SaveChunk(name, value.detach(), None, owners, starts, stops, len(owners),
                                            steps=steps, traces=traces))
                    continue
                rows, ready, slab = host_copy(value, self._pinned)  # the ledger's hold on the slab
                chunks.append(SaveChunk(name, rows, ready, owners, starts, stops, len(owners), slab, steps=steps,
                                        traces=traces))
        if traces is not None:
            for each in traces.numbers:
                self._chunks[each].extend(chunks)

    def run_rows(self, key: object, trace: str | TraceOwners, names: list[str], owners: np.ndarray,
                 starts: np.ndarray, stops: np.ndarray, steps: np.ndarray, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Where this step's rows of a group go that saves at every step: a view ``[names, *shape]``
        of its run, for the caller to fill now, on the current stream; None if a run would not fit
        the device room (the caller adds the rows as usual). ``key``: the group, the same object at
        each of its steps, with the same ``owners``, ``starts`` and ``stops``; ``shape``: one
        name's rows of a step, ``[rows, *row]``; ``steps``: each owner's generation step, as for
        :meth:`add`."""
        run = self._runs.get(key)
        if run is not None and run.used == RUN_STEPS:
            self._close(run)
            run = None
        if run is None:
            run = self._open_run(key, trace, names, owners, starts, stops, shape, dtype, device)
            if run is None:
                return None
        elif len(self._runs) > 1:  # another group's run may hold rows of the same invokes and names
            self._close_crossing(run.trace_names, set(names), owners, but=run)
        if run.stream and _raw_stream(run.buffer.device.index) != run.stream:  # a stream reports do not wait for yet
            stream = torch.cuda.current_stream(device)
            self._device_streams.setdefault(stream.cuda_stream, stream)
            run.stream = stream.cuda_stream
        run.steps.append(steps)
        k, run.used = run.used, run.used + 1
        return run.buffer[:, k * run.rows : (k + 1) * run.rows]

    def _open_run(self, key: object, trace: str | TraceOwners, names: list[str], owners: np.ndarray,
                  starts: np.ndarray, stops: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> _Run | None:
        shape = (len(names), RUN_STEPS * shape[0], *shape[1:])
        room = 0
        if device.type == "cuda":
            room = math.prod(shape) * dtype.itemsize
            if not self._room.take(room, device):
                return None
        with torch.inference_mode(False):  # normal tensors, as the hook path's saves are
            buffer = torch.empty(shape, dtype=dtype, device=device)
        run = _Run(key, trace, names, owners, starts, stops, buffer, room)
        if room:
            stream = torch.cuda.current_stream(device)
            self._device_streams.setdefault(stream.cuda_stream, stream)
            run.stream = stream.cuda_stream
        self._close_crossing(run.trace_names, set(names), owners, but=run)
        self._runs[key] = run
        for each in run.trace_names:
            self._open.setdefault(each, []).append(run)
        return run

    def _close_crossing(self, traces: list[str], names: set[str], owners: np.ndarray, but: _Run | None = None) -> None:
        """Enter the open runs of ``traces`` that hold rows of any of ``owners`` under any of
        ``names`` (saved before the save about to be made, which must come after them), all but
        ``but``. Runs of other owners stay open: under pipeline parallelism a trace decodes as two
        batches whose steps take turns, each a group of its own saving the same names."""
        for trace in traces:
            for run in list(self._open.get(trace, ())):
                if run is but or names.isdisjoint(run.names) or id(run) in (but.apart if but else ()):
                    continue
                if not np.isin(owners, run.owners).any():
                    if but is not None:
                        but.apart.add(id(run))
                    continue
                self._close(run)

    def _close(self, run: _Run) -> None:
        """Enter a run's rows in the ledger: one chunk per name, its step-major rows as if each
        step had been added on its own (owners repeated once per step)."""
        del self._runs[run.key]
        for other in self._runs.values():  # its id may be another run's later
            other.apart.discard(id(run))
        for trace in run.trace_names:
            runs = self._open[trace]
            runs.remove(run)
            if not runs:
                del self._open[trace]
        used = run.used
        if run.room:  # the steps it never filled
            self._room.give(run.room * (RUN_STEPS - used) // RUN_STEPS)
        if not used:
            return
        shift = (np.arange(used, dtype=np.int64) * run.rows)[:, None]
        owners = np.tile(run.owners, used)
        starts, stops = (run.starts[None, :] + shift).reshape(-1), (run.stops[None, :] + shift).reshape(-1)
        steps = np.concatenate(run.steps)
        traces = run.traces
        if traces is not None:  # each step's owners in the same order: their traces repeat alike
            traces = TraceOwners(np.tile(traces.codes, used), traces.numbers, traces.firsts)
        rows = run.buffer
        if used < RUN_STEPS:  # its filled steps only: views would keep the whole buffer, uncounted by the room
            with torch.inference_mode(False):  # (a group that lasts two steps, as new arrivals end epochs, used 1/32 of it)
                rows = run.buffer[:, : used * run.rows].clone()
        holds = 1 if run.room else 0
        chunks = [SaveChunk(name, rows[j], None, owners, starts, stops, len(owners), device_holds=holds, steps=steps,
                            traces=traces)
                  for j, name in enumerate(run.names)]
        for trace in run.trace_names:
            self._chunks[trace].extend(chunks)

    def retain(self, chunks: list[SaveChunk]) -> None:
        """One more holder of each chunk's memory (a report that will read it). A list at a
        time: a sweep's report holds a chunk per name per step (520 for 4 names x 130 steps)."""
        with self._holds:
            for chunk in chunks:
                if chunk.device_holds:
                    chunk.device_holds += 1
        for chunk in chunks:
            if not chunk.device_holds:
                self._pinned.retain(chunk.slab)

    def release(self, chunks: list[SaveChunk]) -> None:
        """A holder is done with each chunk's memory: the last one makes it reusable."""
        freed, on_host = 0, []
        with self._holds:
            for chunk in chunks:
                if chunk.device_holds:
                    chunk.device_holds -= 1
                    if chunk.device_holds == 0:
                        freed += chunk.rows.nbytes
                else:
                    on_host.append(chunk)
        if freed:
            self._room.give(freed)
        for chunk in on_host:
            self._pinned.release(chunk.slab)

    def take(self, trace: str, owners: list[int], last_steps: np.ndarray | None = None) -> "TakenSaves":
        """The owners' saves, to assemble later (on any thread). Chunks every owner of which has
        now been taken are dropped from the ledger. ``last_steps``: each owner's last step to
        keep (rows saved at later steps are let go of, not reported: steps whose tokens vLLM did
        not return, see Interleaver.finish); None or ``slots.ALL_STEPS``: all of them."""
        for run in list(self._open.get(trace, ())):
            self._close(run)
        wanted = np.array(owners, dtype=np.int64)
        chunks = self._chunks.pop(trace, [])
        # A lookup table by slot rather than np.isin per chunk (a tenth of the time): a sweep's
        # trace has a chunk per name per step, 520 for 4 names x 130 steps, and this runs on the
        # engine thread. Its last entry stands for every slot past the wanted ones.
        is_wanted = np.zeros(int(wanted.max(initial=-1)) + 2, dtype=bool)
        is_wanted[wanted] = True
        past = len(is_wanted) - 1
        keep_to = None  # slot -> its last step kept, where some owner's saves are cut
        if last_steps is not None and (np.asarray(last_steps) < ALL_STEPS).any():
            keep_to = np.full(len(is_wanted), ALL_STEPS, dtype=np.int64)
            keep_to[wanted] = last_steps
        by_name: dict[str, list[tuple[SaveChunk, np.ndarray]]] = defaultdict(list)
        kept, retained, released = [], [], []
        # Chunks saved together share their owners array, and after a take their taken mask: the
        # arrays are worked out once per (owners, taken) pair, not per chunk.
        # (The entries hold the keys' arrays, so no id is reused while the loop runs.)
        selections: dict[tuple[int, int, int], tuple] = {}
        for chunk in chunks:
            # (steps only matter where some owner's saves are cut: each step's chunk has its own)
            key = (id(chunk.owners), id(chunk.taken), id(chunk.steps) if keep_to is not None else 0)
            selection = selections.get(key)
            if selection is None:
                mine = is_wanted[np.minimum(chunk.owners, past)]
                if chunk.taken is not None:
                    mine &= ~chunk.taken
                reported = mine  # of those, the rows reported: not those of steps past their owner's cut
                if keep_to is not None and chunk.steps is not None:
                    reported = mine & (chunk.steps <= keep_to[np.minimum(chunk.owners, past)])
                taken = mine if chunk.taken is None else chunk.taken | mine
                # a chunk of several traces stays listed under this one while some of its owners
                # of this trace are not taken (the owners array is its TraceOwners')
                ours_left = chunk.traces is not None and bool((chunk.traces.mask(trace) & ~taken).any())
                selection = selections[key] = (mine, np.count_nonzero(mine), taken, reported, bool(reported.any()),
                                               ours_left, chunk.owners, chunk.taken, chunk.steps)
            mine, count, taken, reported, any_reported, ours_left = selection[:6]
            if count:
                if any_reported:
                    by_name[chunk.name].append((chunk, reported))
                    retained.append(chunk)  # the report's hold, released once it is written
                chunk.pending -= count
                chunk.taken = taken
            if chunk.traces is not None:  # listed under each of its traces: the last take lets go of it
                if chunk.pending > 0:
                    if ours_left:
                        kept.append(chunk)
                elif count:
                    released.append(chunk)
            elif chunk.pending > 0:
                kept.append(chunk)
            else:
                released.append(chunk)  # the ledger's hold
        self.retain(retained)  # before the ledger lets go: the last hold must not be given back early
        self.release(released)
        if kept:
            self._chunks[trace] = kept
        chunks = [chunk for parts in by_name.values() for chunk, _ in parts]
        return TakenSaves(dict(by_name), wanted, self, DeviceReady.now(chunks, self._device_streams.values()))


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
    rows = torch.cat([chunk.rows[a:b] for chunk, a, b in zip(plan.chunks, lo.tolist(), hi.tolist())])
    sizes = hi - lo
    order = (np.cumsum(sizes) - sizes - lo)[plan.row_chunk] + plan.row_source  # each destination row's source
    copy_to_host(out, rows.index_select(0, device_index(torch.from_numpy(order), rows.device)), wait=False)


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
        _copy_pool = ThreadPoolExecutor(_COPY_THREADS, thread_name_prefix="interlace-gather")
    cuts = np.searchsorted(ends, np.arange(1, _COPY_THREADS) * total / _COPY_THREADS).tolist()
    runs = [copies[a:b] for a, b in zip([0, *cuts], [*cuts, len(copies)]) if b > a]
    for done in [_copy_pool.submit(_copy_run, run) for run in runs]:
        done.result()


def _copy_run(copies: list[tuple[_Copy, torch.Tensor]]) -> None:
    scratch = torch.empty(0, dtype=torch.uint8)  # rows picked out of a chunk, reused: fresh memory
    for copy, out in copies:  # for each chunk would fault in its pages every time
        rows, target = _wide_rows(copy.rows), _wide_rows(out)
        if (rows.dtype, rows.shape[1:]) != (target.dtype, target.shape[1:]):  # one could not be widened: both as they are
            rows, target = copy.rows, out
        if copy.source is not None:
            if scratch.numel() < copy.nbytes:
                scratch = torch.empty(copy.nbytes, dtype=torch.uint8)
            picked = scratch[: copy.nbytes].view(rows.dtype).view(-1, *rows.shape[1:])
            rows = torch.index_select(rows, 0, copy.source, out=picked)
        if isinstance(copy.dest, slice):
            target[copy.dest].copy_(rows)  # one run (e.g. a single invoke)
        else:
            target.index_copy_(0, copy.dest, rows)


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
