"""The program-facing API: what a program's ``m`` asks of the interleaver while it runs.

ProgramView (view.py) calls these back through its call's ``CallContext.services``: saves, shared
contributions, messages between a trace's invokes, parameters; the watchdog (calls.py) calls
``last_words``. They run on the engine thread, switched in from a program (calls.py).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from interlace.workers.calls import ProgramCall, error_record
from interlace.workers.pipeline import HERE
from interlace.workers.points import MAILBOX, ModuleTree, Point, short_name
from interlace.workers.readonly import ReadOnlyTensor
from interlace.workers.reports import ReportBatcher, write_now
from interlace.workers.saves import HostRows, SaveLedger, TraceOwners, host_copy
from interlace.workers.slots import SlotTable
from interlace.workers.states import CallContext, InvokeState, Step
from interlace.workers.tensor_parallel import TensorParallelLayout

if TYPE_CHECKING:
    from interlace.workers.taps import Taps, TappedSaves


# Snapshots held until their step ends, all calls' together (ProgramServices._hold_save): what the
# ledger would have moved to the host at once past its device room stays bounded; a larger save is
# recorded where it is made, as every save was before.
HELD_BYTES_MAX = 64 << 20


class ProgramServices:
    """The services a program's ``m`` calls: a mixin of :class:`~interlace.workers.interleaver.Interleaver`.

    A mixin, not an object of its own: ``CallContext.services`` is the interleaver (ProgramView
    also reads its ``device`` and ``vocab_size`` there, and the watchdog calls ``last_words`` on
    it), and these methods read its live state, which changes under them: the current step and
    its mailbox, the live invokes, the slot table. An object of their own would need a reference
    back to the interleaver for all of it. The attributes below are the interleaver's that these
    methods read.
    """

    step: Step | None
    invokes: dict[str, InvokeState]
    rank: dict
    tree: ModuleTree
    tp: TensorParallelLayout
    slots: SlotTable
    ledger: SaveLedger
    reports: ReportBatcher
    agree_max: Callable[[np.ndarray], np.ndarray] | None
    held_total = 0  # bytes of snapshots held by the step's calls (an instance attribute once set)
    save_counts: dict[str, int]

    def last_words(self, ctx: CallContext, record: dict) -> None:
        """Report ``record`` as the error of the call's invokes, now, from the watchdog's thread:
        the process is about to end (calls.py's last resort), so nothing else will report them."""
        for state in ctx.invokes:
            state.error = None
            state.fail(record)
        write_now(ctx.invokes, self.rank["pp_rank"])

    def save(self, ctx: CallContext, name: str, value: Any) -> None:
        if ctx.op_saves and name in ctx.op_saves:  # (the driver refuses two ops' saves alike: core.trace.check_ops)
            raise ValueError(f"save({name!r}): an op of this invoke saves {ctx.op_saves[name]} under that name, and "
                             "their rows would be joined under it, indistinguishable; give the program's save another name")
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            starts, stops = _split_rows(ctx, value, "save")
            if self._hold_save(ctx, name, value, starts, stops):
                self.save_counts["held"] += 1
            else:  # large, or it may not fit: recorded now
                self.save_counts["at_once"] += 1
                self.flush_saves(ctx)
                self._save_rows(ctx.invokes, ctx.members.slots, [(name, value)], starts, stops)
            return
        if isinstance(value, torch.Tensor):  # a scalar: kept whole (a batched call needs rows)
            _split_rows(ctx, value, "save")
            value = value.detach().to("cpu", copy=True)
        self._count_value(ctx, value)
        for inv, step in zip(ctx.invokes, ctx.steps):
            inv.saves.setdefault(name, []).append(value)
            inv.save_steps.setdefault(name, []).append(step)

    def _hold_save(self, ctx: CallContext, name: str, value: torch.Tensor, starts: np.ndarray,
                   stops: np.ndarray) -> bool:
        """Keep a snapshot of the save with the call until its step ends (:meth:`flush_saves`),
        if it fits every invoke's room left whatever the rows' split (the call's saves held so
        far, all invokes' together, within the smallest room) and the step's held snapshots stay
        within :data:`HELD_BYTES_MAX`. A step's saves of the same rows
        then go to the ledger as one entry: each ``_save_rows`` costs a few tens of microseconds of
        bookkeeping on the engine thread, four of them a step for a program saving 4 layers,
        which showed at 1 and 8 requests on an H200 host (docs/benchmarks.md). Every TP rank
        decides alike (the same values, the same slot table); only the rank that keeps rows
        copies them."""
        nbytes = value.nelement() * value.element_size()
        room = ctx.save_room
        if room is None:
            slots, table = ctx.members.slots, self.slots
            if len(slots) == 1:  # a program per invoke: scalars, not an array operation
                slot = int(slots[0])
                room = int(table.save_limit[slot]) - int(table.save_used[slot])
            else:
                room = int((table.save_limit[slots] - table.save_used[slots]).min())
            ctx.save_room = room
        if ctx.held_bytes + nbytes > room or self.held_total + nbytes > HELD_BYTES_MAX:
            return False
        ctx.held_bytes += nbytes
        self.held_total += nbytes
        if self.rank["tp_rank"] == 0:  # a snapshot: later in-place kernels and the program's edits cannot change it
            value = value.detach().clone()
        ctx.held_saves.append((name, value, starts, stops))
        return True

    def flush_saves(self, ctx: CallContext) -> None:
        """Record the call's held saves (the interleaver calls this as the step ends, before its
        calls close): runs of saves of the same rows, as one ledger entry each (on one kind of
        device: an entry is kept on the GPU or on the host), in the order they were made (a
        name saved twice in a run is two chunks of the entry, in that order). Raises as
        ``_save_rows`` does."""
        self.held_total -= ctx.held_bytes
        held, ctx.held_saves, ctx.held_bytes, ctx.save_room = ctx.held_saves, [], 0, None  # rooms change now
        group: list[tuple[str, torch.Tensor]] = []
        for name, value, starts, stops in held:
            if group and not (starts is group_starts and stops is group_stops and value.is_cuda == group[0][1].is_cuda):
                self._save_rows(ctx.invokes, ctx.members.slots, group, group_starts, group_stops, fresh=True)
                group = []
            if not group:
                group_starts, group_stops = starts, stops
            group.append((name, value))
        if group:
            self._save_rows(ctx.invokes, ctx.members.slots, group, group_starts, group_stops, fresh=True)

    def _save_rows(self, invokes: list[InvokeState], slots: np.ndarray, named: list[tuple[str, torch.Tensor]],
                   starts: np.ndarray, stops: np.ndarray, fresh: bool = False, traces: TraceOwners | None = None,
                   where: str = "") -> None:
        """Record each ``(name, value)`` once for the whole group (invoke i owns rows
        ``starts[i]:stops[i]`` of every value); ``fresh``: copies made for this save (an op's
        gathered rows), kept without another copy; ``traces``: the invokes are of several traces
        (taps.TappedSaves), else all of ``invokes[0]``'s.

        The engine never waits here: rows stay on the device or are copied asynchronously (see
        saves.py). Every TP rank checks the limit, so an over-limit save fails the same way
        everywhere; only the rank that reports keeps the rows. A save of one trace that goes
        over raises (the caller fails the group); one of several fails the invokes that went
        over (their rows are kept until they are reported, without counting against anything).
        """
        row_bytes = sum(math.prod(value.shape[1:]) * value.element_size() for _name, value in named)
        self._count_saves(invokes, slots, stops - starts, row_bytes, traces, where)
        if self.rank["tp_rank"] == 0:
            self.ledger.add(traces or invokes[0].trace, named, slots, starts, stops, fresh, steps=self._save_steps(slots))
            self._reserve(invokes, stops - starts, row_bytes, len(named[0][1]) * row_bytes, traces)

    def save_tapped(self, group: TappedSaves, taps: Taps, where: str) -> None:
        """The saves a group made in the graph taps this step (dispatch.take_tapped), kept as
        ``_save_rows`` keeps rows (and raising as it does): from the group's second step on,
        gathered straight into a run of the ledger (saves.py), not into a tensor of their own."""
        row_bytes = len(group.names) * group.shape[2] * taps.saved.element_size()
        rows = group.stops - group.starts
        self._count_saves(group.invokes, group.slots, rows, row_bytes, group.traces, where)
        group.steps_saved += 1
        if self.rank["tp_rank"] != 0:  # only TP rank 0 keeps rows
            return
        trace, steps = group.traces or group.invokes[0].trace, self._save_steps(group.slots)
        into = None
        if group.steps_saved > 1 and not taps.wide:  # a group that repeats: a decode
            into = self.ledger.run_rows(group, trace, group.names, group.slots, group.starts, group.stops, steps,
                                        group.shape[1:], taps.saved.dtype, taps.saved.device)
        if into is not None:
            group.gather_into(taps, into)
        else:
            self.ledger.add(trace, list(zip(group.names, group.gather(taps))), group.slots, group.starts, group.stops,
                            fresh=True, steps=steps)
        self._reserve(group.invokes, rows, row_bytes, group.shape[1] * row_bytes, group.traces)

    def _count_saves(self, invokes: list[InvokeState], slots: np.ndarray, rows: np.ndarray, row_bytes: int,
                     traces: TraceOwners | None, where: str) -> None:
        """Count ``rows`` rows of ``row_bytes`` against each owner's save limit (see _save_rows)."""
        used = self.slots.save_used[slots] + rows * row_bytes
        over = used > self.slots.save_limit[slots]
        if over.any():
            for j in np.flatnonzero(over).tolist() if traces is not None else [int(np.flatnonzero(over)[0])]:
                inv = invokes[j]
                error = MemoryError(
                    f"saves of trace {inv.trace} invoke {inv.invoke} exceed the limit of "
                    f"{_human_bytes(inv.max_save_bytes)} (raise max_save_bytes, or save less: "
                    "e.g. m.last(x) or a reduction)"
                )
                if traces is None:
                    raise error
                inv.fail(error_record(error, where=where))
            used = np.where(over, self.slots.save_used[slots], used)
        self.slots.save_used[slots] = used

    def _count_value(self, ctx: CallContext, value: Any) -> None:
        """Count a saved or shared value that is not rows against each of the call's invokes' save
        limit, as rows are (_count_saves): a program saved a 16 MB numpy array, bytes or list at
        every step past a 1 MiB ``max_save_bytes``, and only tensors were counted."""
        slots = ctx.members.slots
        self._count_saves(ctx.invokes, slots, np.ones(len(slots), np.int64), value_bytes(value), None, "")

    def _save_steps(self, slots: np.ndarray) -> np.ndarray:
        """Each owner's generation step (step 0: the prompt, chunks of it included), so that rows
        of steps whose tokens vLLM did not return can be left out (Interleaver.finish)."""
        return np.maximum(self.slots.next_position[slots] - self.slots.prompt_len[slots], 0)

    def _reserve(self, invokes: list[InvokeState], rows: np.ndarray, row_bytes: int, nbytes: int,
                 traces: TraceOwners | None) -> None:
        """Keep the report file reserved ahead of a save of ``nbytes`` (``rows`` rows of
        ``row_bytes`` per owner) for each trace it is of."""
        if traces is None:
            self.reports.reserve_ahead(invokes[0], nbytes)
            return
        per_trace = np.bincount(traces.codes, weights=rows, minlength=len(traces.firsts)) * row_bytes
        for first, each in zip(traces.firsts, per_trace.tolist()):
            self.reports.reserve_ahead(invokes[first], int(each))

    def share(self, ctx: CallContext, name: str, value: Any, merge: str) -> None:
        if isinstance(value, torch.Tensor):
            starts, stops = _split_rows(ctx, value, "share")
            row_bytes = math.prod(value.shape[1:]) * value.element_size() if value.dim() else value.element_size()
            self._count_saves(ctx.invokes, ctx.members.slots, stops - starts, row_bytes, None, "")
            if self.rank["tp_rank"] != 0:  # only TP rank 0 reports
                return
            rows, ready, _ = host_copy(value)
            parts = [HostRows(rows, ready, a, b) for a, b in zip(starts.tolist(), stops.tolist())]
        elif len(ctx.invokes) == 1:
            self._count_value(ctx, value)
            parts = [value]
        else:
            raise ValueError(f"share() in a batched call over {len(ctx.invokes)} invokes needs a tensor to split per invoke")
        for inv, part, step in zip(ctx.invokes, parts, ctx.steps):
            inv.shared.append((name, merge, part))
            inv.shared_steps.append(step)

    def send(self, ctx: CallContext, name: str, value: Any) -> None:
        key = (ctx.invokes[0].trace, name)
        sender = self.step.senders.get(key)
        if sender is not None:
            # A second value would replace the first, and a receiver got one or the other by
            # whether it was already waiting at the first send: refused rather than a race.
            who = "this invoke" if sender == ctx.invokes[0].invoke else f"invoke {sender}"
            raise ValueError(
                f"send({name!r}) at {ctx.step_words()}: {who} sent {name!r} already in this step, and a name "
                f"carries one value a step; send each value under its own name (e.g. f\"{name}{{i}}\")")
        self.step.senders[key] = ctx.invokes[0].invoke
        self.step.mailbox[key] = value
        self.step.sent += 1

    def recv(self, ctx: CallContext, name: str, call: ProgramCall) -> Any:
        """The value sent as ``name`` in this step (the view makes this one access of the call)."""
        key = (ctx.invokes[0].trace, name)
        if key in self.step.mailbox:
            return self.step.mailbox[key]
        return call.wait_at(Point(MAILBOX, name))  # resumed by PointDispatcher.pump once someone sends it

    def is_parameter(self, module: str, name: str) -> bool:
        mod = self.tree.modules.get(module)
        if mod is None:  # runs on another pipeline stage: weight and bias are its parameters
            return module in self.tree.modules and name in ("weight", "bias")
        return name in mod._parameters

    def parameter(self, module: str, name: str, call: ProgramCall) -> torch.Tensor | None:
        """A parameter as the unsharded model has it (gathered across TP ranks when split).
        Under PP it is an access like a point's: read on the stage that owns the module."""
        if self.tree.modules.get(module) is not None:  # read-only: every request shares the weights
            if self.agree_max is not None and self.tp.gathers_parameter(module, name):
                # a gather: once the ranks agree (PointDispatcher.settle)
                return call.wait_at(Point(module, f"param:{name}"))
            return ReadOnlyTensor.of(self.tp.full_parameter(module, name))
        return call.wait_at(Point(module, f"param:{name}"))  # a later stage reads it

    def _unreached(self, call: ProgramCall) -> str:
        point = call.waiting_for
        after = call.view._current or "the start of the step"
        if point.kind.startswith("param:"):
            return (
                f"{short_name(point.module)}.{point.kind[6:]} belongs to an earlier pipeline stage, and "
                f"this program read it after {after}, which runs on a later stage. Read parameters "
                "before the first access to a later layer's point (they are then carried along)"
            )
        if self.piece_step and self.stages.where(point) == HERE and not self.at_taps(point):
            return (
                f"{point} is not a graph tap, and this step ran in CUDA-graph pieces, where only taps are "
                f"served (the program's earlier steps read and wrote taps only). Add it to the engine's "
                f"graph_taps ('all' taps every layer's resid, attention and MLP outputs), or start the "
                f"engine with enforce_eager=True"
            )
        return (
            f"{point} was not reached after {after}: it comes earlier in the forward pass than the "
            "previous access (accesses within a step must follow the forward order), or it does "
            "not run on this model"
        )

    def _unsent(self, ctx: CallContext, name: str) -> str:
        trace = ctx.invokes[0].trace
        present = sorted(inv.invoke for inv in self.invokes.values()
                         if inv.trace == trace and inv.req_id in self.step.layout.req_ids)
        sent = sorted(n for t, n in self.step.mailbox if t == trace)
        return (
            f"recv({name!r}) at {ctx.step_words()}: no invoke of this trace sent {name!r} in this "
            f"step (names sent in this step: {sent}). Invokes of the trace scheduled in this step: "
            f"{present}. The sender must be scheduled in the same step as the receiver (prompts "
            "that fit one step together are) and call send() with the same name in that step."
        )


def value_bytes(value: Any) -> int:
    """About what a value weighs in memory: tensors and arrays their elements, bytes and strings
    their length, containers what they hold (walked without recursion: a list nested thousands
    deep is a value too), each once (a list that holds itself is a value too: the walk never
    ended, and the program ran into its time limit), anything else its own size."""
    total, stack, seen = 0, [value], set()
    while stack:
        item = stack.pop()
        if isinstance(item, (dict, list, tuple, set, frozenset)):
            if id(item) in seen:
                continue
            seen.add(id(item))
        if isinstance(item, torch.Tensor):
            total += item.nelement() * item.element_size()
        elif isinstance(item, np.ndarray):
            total += item.nbytes
        elif isinstance(item, (bytes, bytearray, memoryview, str)):
            total += len(item)
        elif isinstance(item, dict):
            total += 8 * len(item)
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 8 * len(item)
            stack += item
        else:
            total += sys.getsizeof(item)
    return total


def _split_rows(ctx: CallContext, value: torch.Tensor, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Each invoke's rows ``starts[i]:stops[i]`` of a call's tensor (by token rows, or one row
    per invoke)."""
    n = len(ctx.invokes)
    if n == 1:
        return _one_invoke_rows(value.shape[0] if value.dim() else 1)
    if value.dim() >= 1:
        if value.shape[0] == ctx.num_rows:
            return ctx.local_starts, ctx.local_stops
        if value.shape[0] == n:  # one row per invoke, kept 2-D as a single invoke's call would
            return ctx.row_per_invoke
    raise ValueError(
        f"{what}() in a batched call over {n} invokes needs a tensor whose first dim is the "
        f"call's {ctx.num_rows} token rows or its {n} invokes (got shape {tuple(value.shape)})"
    )


@functools.lru_cache(maxsize=1024)
def _one_invoke_rows(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, stops)`` of a one-invoke call's ``rows`` rows, the same arrays for every call
    (read-only: the ledger keeps them), so that a step's saves of the same rows are seen as such
    (ProgramServices.flush_saves) without comparing arrays."""
    starts, stops = np.zeros(1, np.int64), np.array([rows], np.int64)
    starts.flags.writeable = stops.flags.writeable = False
    return starts, stops


def _human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at 1 or more ("64 KiB", "1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.4g} {unit}"
        n /= 1024
