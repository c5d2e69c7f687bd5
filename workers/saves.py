"""Saved values on a worker rank, kept until their invokes are reported.

A save of rows (a tensor whose dim 0 runs over a group's tokens or invokes) is recorded once for
its whole group: one :class:`SaveChunk` per save call, holding a copy of the rows and, as arrays,
which invoke owns which of them. Where the copy lives:

- On a GPU, while the rank's :class:`DeviceRoom` has room, it stays on the device (a device-side
  copy costs one kernel and nothing on the host); a report gathers it there
  (save_gather.py).
- Past that room (and for shared contributions), asynchronously into pinned host memory on the
  engine's stream, so no step waits for it; reporting gathers those on the host.
- On a CPU, a plain copy.

A group of saves made at every step of a decode with the same owners and rows (graph taps saving a
trace's last token at 4 layers) is instead gathered, step after step, into one device buffer of
:data:`RUN_STEPS` steps: a *run*, entered in the ledger as one chunk per name when it is full, when
its trace is reported, or when another save of one of its names for one of its traces comes.

    ledger.add(trace, [("l3", rows)], owners=slots, starts=starts, stops=stops)     (numpy arrays)
    ledger.run_rows(group, trace, ["l3"], slots, starts, stops, steps, ...)  -> where this step's rows go
    ledger.take(trace, [slot, ...])  -> TakenSaves (save_gather.py; take forgets them)
"""

from __future__ import annotations

from collections import defaultdict
import math
import threading
from dataclasses import dataclass

import numpy as np
import torch

from interlace.core import settings
from interlace.workers.pinned import PinnedSlabs, Slab
from interlace.workers.save_gather import DeviceReady, TakenSaves
from interlace.workers.slots import ALL_STEPS


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

    def take(self, trace: str, owners: list[int], last_steps: np.ndarray | None = None) -> TakenSaves:
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
