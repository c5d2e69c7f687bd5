"""Dispatch at points: what happens when the forward pass reaches a hooked module.

At each hook, :class:`PointDispatcher` applies the step's ops there (each one indexed tensor
operation for all its invokes), then hands the value to the programs waiting there, in invoke
order, and writes back what they changed (an assignment, or an in-place edit of a copy) before the
hook returns. A program resumed may send a value another is waiting for (``pump``); under TP the
ranks agree on every call's next move before anything is gathered for it (``settle``, with
tp_agreement.py).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np
import torch

from interlace.workers.calls import ProgramCall, error_record, start_at_points
from interlace.workers.greenlets import run_shallow
from interlace.workers.hooks import HookSet
from interlace.workers.holds import Held, live_edit, versions
from interlace.workers.ops import StepOp, apply as apply_op
from interlace.workers.pinned import PinnedSlabs
from interlace.workers.pipeline import HERE, StageMap
from interlace.workers.points import (MAILBOX, ROW_PER_REQUEST_KINDS, TOKEN_KINDS, ModuleTree, Point, PointAccess, Rows,
                                      TapAccess, short_name)
from interlace.workers.readonly import ReadOnlyTensor
from interlace.workers.saves import host_copy
from interlace.workers.slots import SlotTable
from interlace.workers.states import CallContext, Step
from interlace.workers.tensor_parallel import TensorParallelLayout
from interlace.workers.tp_agreement import agree_on_paths
from interlace.workers.write_log import WriteBook, Written, row_bytes


_UNREADABLE = object()  # PointDispatcher._hand: the program could not read its point (and was stopped)


class PointDispatcher:
    """Runs a step's ops and programs at each hooked module (the interleaver's on_point)."""

    def __init__(self, tree: ModuleTree, tp: TensorParallelLayout, stages: StageMap, hooks: HookSet, taps,
                 slots: SlotTable, save_rows: Callable[..., None], save_tapped: Callable[..., None],
                 agree_max: Callable[[np.ndarray], np.ndarray] | None, book: WriteBook,
                 at_taps: Callable[[Point], bool] | None = None):
        """The interleaver's own parts, shared (``taps``: its graph taps, or None). ``save_rows``:
        how an op's saved rows are kept (the interleaver's ``_save_rows``: limits, ledger, report
        file), ``save_tapped`` those of saves made in the graph taps; ``agree_max``: under TP > 1, the max over the group for agreement rounds (None: none);
        ``book``: where programs' writes are logged (write_log.py); ``at_taps``: whether a point is served between graph pieces (None: no taps)."""
        self.tree = tree
        self.tp = tp
        self.stages = stages
        self.hooks = hooks
        self.taps = taps
        self.slots = slots
        self.save_rows = save_rows
        self.save_tapped = save_tapped
        self.agree_max = agree_max
        self.at_taps = at_taps
        self.book = book
        self.pinned = PinnedSlabs()  # programs' logged writes, from a GPU (write_log.py)

    def dispatch(self, step: Step, module: str, family: str, hooked: Any, copies: bool = False) -> Any:
        """Apply the step's ops at this hook, then run the programs waiting here; returns the
        (possibly rewritten) value. ``copies``: hand out copies only (a tap's value, in memory
        the next CUDA-graph replay overwrites)."""
        kinds = ("input",) if family == "input" else (("output", "resid", "final") if module else (family,))
        access = (TapAccess if copies else PointAccess)(hooked, step.layout)
        for point, step_op in step.ops.get((module, family), ()):
            self._apply_op(step, point, access, step_op)
        if step.replays:
            self._replay(step, module, family, access)
        ready = _waiting_at(step, module, kinds)
        if ready:
            run_shallow(self._run_programs, step, module, kinds, access, ready)
        return access.result()

    def _run_programs(self, step: Step, module: str, kinds: tuple[str, ...], access: PointAccess,
                      ready: list[tuple[ProgramCall, CallContext]]) -> None:
        """Hand the hook's value to the ``ready`` programs waiting here, and to those it wakes,
        until none can move (in the hub: greenlets.run_shallow)."""
        delivered: list[tuple[ProgramCall, CallContext]] = []
        # Programs that start here at their first point and whose reads are views of one copy
        # (a tap's resid) are started together, in one worker greenlet (calls.start_at_points),
        # in invoke order with the others: the run is cut before any other delivery.
        together = isinstance(access, TapAccess)  # (a program starts unstarted on one rank and one stage only)
        try:
            while ready:
                starts: list = []
                for call, ctx in ready:
                    point = call.waiting_for
                    if point.module == module and point.kind in kinds:
                        delivered.append((call, ctx))
                        if together and call.unstarted and point.kind == "resid" and not (self.book.logs and ctx.logs):
                            value = self._hand(call, ctx, point, access)
                            if value is not _UNREADABLE:
                                starts.append((call, ctx, point, value))
                            continue
                        if starts:
                            self._start_together(step, starts)
                            starts = []
                        self._deliver(call, ctx, point, access)
                        if step.sent != step.pumped:  # pump's own test, spared a call per program
                            self.pump(step)
                if starts:
                    self._start_together(step, starts)
                self.settle(step)
                ready = _waiting_at(step, module, kinds)
        finally:  # the hook returns: from here on, writes to what it handed out would be lost
            self._log_writes(delivered)
            for call, ctx in delivered:
                done = call.done
                ctx.holds.close(None if done else call.waiting_for, done)

    def _apply_op(self, step: Step, point: Point, access: PointAccess, step_op: StepOp) -> None:
        op = step_op.op
        rows = step.rows_at(step_op.rows, access.device)
        split = self.tp.split(point.module, point.kind)
        try:  # on one tensor: a tuple output's first (vLLM's linear layers return (out, bias))
            value = _gather(split, access.read_tensor(point, rows))
            if op["op"] == "save":
                self.save_rows(step_op.invokes, step_op.slots, [(op.get("name") or op["point"], value)],
                               step_op.starts, step_op.stops, fresh=split is not None or access.is_fresh(point, rows))
            else:
                access.write_tensor(point, rows, _local(split, apply_op(op, value)))
        except Exception as exc:  # noqa: BLE001
            for inv in step_op.invokes:
                inv.fail(error_record(exc, where=f"op {op['op']} at {point}"))

    def _replay(self, step: Step, module: str, family: str, access: PointAccess) -> None:
        """Put back, on rows vLLM recomputed after preempting their request, what the program
        wrote at this hook the first time (after the hook's ops, as then)."""
        for point, rows, value, states in step.replays.get((module, family), ()):
            try:  # every recomputed request's rows at once (a failed one's rows too: never returned)
                access.write(point, rows, value)
            except Exception as exc:  # noqa: BLE001
                for state in states:
                    state.fail(error_record(exc, where=f"replaying the program's writes at {point}"))

    def _log_writes(self, delivered: list[tuple[ProgramCall, CallContext]]) -> None:
        """The hook returns: log the final rows of each point the programs changed here (this
        rank's piece under TP), for a recomputation after a preemption (write_log.py). What many
        calls wrote at one point (a program per invoke) goes to the host as one copy and one
        entry: a copy per call cost a 64-invoke CPU step 3.5 ms, and on a GPU each took a pinned
        piece, an event and a copy launch."""
        if not self.book.logs:  # no live invoke keeps one (an ample cache): 256 calls cost 0.3 ms to look at
            return
        by_point: dict[Point, list[tuple[ProgramCall, CallContext, Held]]] = {}
        for call, ctx in delivered:
            if not ctx.holds.live or not ctx.logs:
                continue
            for held in ctx.holds.live:
                if held.written is not None and held.point.kind in TOKEN_KINDS:
                    by_point.setdefault(held.point, []).append((call, ctx, held))
        for point, writers in by_point.items():
            try:
                slabs: list = []
                num_rows = [ctx.num_rows for _c, ctx, _h in writers]
                joined, copies = _joined_to_host([held.written for _c, _x, held in writers], num_rows, self.pinned, slabs)
                if slabs:  # given back once no entry holds the rows
                    weakref.finalize(copies[0][2], _release_all, self.pinned, slabs)
                if joined:  # one host tensor for every writer: one entry, each invoke at its rows of it
                    value, ready, hold = copies[0]
                    self._log_joined(point, writers, Written(value, sum(num_rows), ready, hold))
                    continue
                for (_call, ctx, held), (value, ready, hold) in zip(writers, copies):
                    held.written = None
                    per_row = row_bytes(held.value, ctx.num_rows)  # whole values: every TP rank counts alike
                    members = ctx.members
                    self.book.record(point, Written(value, ctx.num_rows, ready, hold), members.slots, members.firsts,
                                     ctx.local_starts, ctx.local_stops, per_row * ctx.lengths, members.steps)
            except Exception as exc:  # noqa: BLE001
                for call, _ctx, _held in writers:
                    call.error = call.error or error_record(exc, where=f"logging the program's writes at {call.view.where()}")

    def _log_joined(self, point: Point, writers: list, written: Written) -> None:
        """Log the writers' rows of one joined host copy (``written``) as one entry, each invoke
        at its rows' offset in the copy. With a program per invoke a decode step logs 256
        one-row calls here; a Written and a host view each cost the step 1.5 ms on a 2-core CPU."""
        per_row = row_bytes(writers[0][2].value, writers[0][1].num_rows)  # whole values: every TP rank counts alike
        for _call, _ctx, held in writers:
            held.written = None
        if all(ctx.num_rows == 1 and len(ctx.invokes) == 1 for _c, ctx, _h in writers):  # a decode step
            n = len(writers)
            starts = np.arange(n, dtype=np.int64)
            self.book.record(point, written, np.fromiter((ctx.invokes[0].slot for _c, ctx, _h in writers), np.int64, n),
                             np.fromiter((ctx.members.firsts[0] for _c, ctx, _h in writers), np.int64, n),
                             starts, starts + 1, np.full(n, per_row, np.int64),
                             np.fromiter((ctx.members.steps[0] for _c, ctx, _h in writers), np.int64, n))
            return
        offsets = np.cumsum([0] + [ctx.num_rows for _c, ctx, _h in writers[:-1]])
        members = [ctx.members for _c, ctx, _h in writers]
        self.book.record(point, written, np.concatenate([m.slots for m in members]),
                         np.concatenate([m.firsts for m in members]),
                         np.concatenate([ctx.local_starts + at for (_c, ctx, _h), at in zip(writers, offsets)]),
                         np.concatenate([ctx.local_stops + at for (_c, ctx, _h), at in zip(writers, offsets)]),
                         np.concatenate([per_row * ctx.lengths for _c, ctx, _h in writers]),
                         np.concatenate([m.steps for m in members]))

    def take_tapped(self, tapped: list[tuple[Point, StepOp]], memo: dict) -> None:
        """The saves that ran in taps: their rows, from the taps' buffers (read before the next
        forward). Saves of the same rows (a sweep saving 4 layers' last token) are one gather per
        step, into one run of the ledger while they repeat (saves.py): this runs on the engine
        thread between graph replays of about 3 ms (the 1B shape on an H100), where each save's
        own gather and bookkeeping added up."""
        last = memo.get("tapped groups")
        if last is None or (last[0] is not tapped and (len(last[0]) != len(tapped)
                                                      or not all(a[1] is b[1] for a, b in zip(last[0], tapped)))):
            last = memo["tapped groups"] = (tapped, self.taps.save_groups(tapped))
        for group in last[1]:
            where = f"op save at {group.where}"
            try:
                self.save_tapped(group, self.taps, where)
            except Exception as exc:  # noqa: BLE001
                for inv in group.invokes:
                    inv.fail(error_record(exc, where=where))

    def _deliver(self, call: ProgramCall, ctx: CallContext, point: Point, access: PointAccess) -> None:
        value = self._hand(call, ctx, point, access)
        if value is _UNREADABLE:
            return
        if call.unstarted:  # its first point, known without running it (prologue.py)
            call.start_at(point, value)
        else:
            call.resume(value)
        self.after_resume(call, ctx)

    def _hand(self, call: ProgramCall, ctx: CallContext, point: Point, access: PointAccess) -> Any:
        """The value a program gets at ``point``, held for the write-back (holds.py); a program
        that cannot read it is stopped there (and _UNREADABLE returned)."""
        split = self.tp.split(point.module, point.kind)
        try:
            rows = ctx.request_rows if point.kind in ROW_PER_REQUEST_KINDS else ctx.token_rows
            value = access.read(point, rows)
            if split is not None:
                with torch.inference_mode(False):  # a normal tensor: its version counter shows edits
                    value = _gather(split, value)
        except Exception as exc:  # noqa: BLE001 - e.g. resid on a module that is not a layer
            call.cancel(f"cannot read {point}: {exc}")
            return _UNREADABLE
        copy = split is not None or access.is_copy(point, rows)
        if not copy and point.kind in TOKEN_KINDS and self.book.limit > 0:
            # its version counter shows an in-place edit (write_log.py). Also for an invoke that
            # keeps no log (never preempted): a late edit fails alike whatever the cache holds.
            value, copy = _own_copy(value), True
        ctx.holds.live.append(Held(point, value, versions(value), access, rows, split, copy))
        return value

    def _start_together(self, step: Step, starts: list[tuple[ProgramCall, CallContext, Point, Any]]) -> None:
        """Start programs handed their first points' values (calls.start_at_points), then write
        back what each changed. Their values are views of one copy, which share its version
        counter: the programs' in-place edits are all checked after the last one ran, and are
        charged to the first program checked (holds.live_edit; the copy has every one's rows
        already). A program whose writes are logged for a preemption, whose log must hold its
        own edits, is never started with others."""
        start_at_points([(call, point, value) for call, _ctx, point, value in starts])
        for call, ctx, _point, _value in starts:
            self.after_resume(call, ctx)
        if step.sent != step.pumped:
            self.pump(step)

    def after_resume(self, call: ProgramCall, ctx: CallContext) -> None:
        if ctx.holds.live or call.view._pending_write is not None:
            self._write_back(call, ctx)
        if ctx.holds.late:
            self.refuse_late_edits(call, ctx)
        point = call.waiting_for
        if point is ctx.wanted or call.done:  # hooked for these invokes already, this epoch (a context lives that long)
            return
        if point.module != MAILBOX and not point.kind.startswith("param:") and self.stages.where(point) == HERE:
            self.hooks.want(point, owner=ctx.invokes[0].req_id)
            if self.at_taps is not None and not self.at_taps(point):
                for state in ctx.invokes:  # its steps run eager from now on (Interleaver.runs_between_pieces)
                    state.off_taps = True
        ctx.wanted = point

    def _write_back(self, call: ProgramCall, ctx: CallContext) -> None:
        """After the program ran: write what it changed of the values whose hook runs now, its
        copies edited in place and then its assignment, however many times it waited since it
        read them (e.g. a receiver woken at this hook by the sender's send)."""
        try:
            edited = None  # the value just written back for an in-place edit
            for held in ctx.holds.live:
                if held.copy:
                    now = live_edit(held)
                    if now is not None:  # edited in place by this run (or no counter to tell)
                        held.written = held.value if held.split is None else _local(held.split, held.value)
                        held.access.write(held.point, held.rows, held.written)
                        held.versions = now
                        call.writes += 1
                        edited = held
            write = call.view._take_write()
            if write is not None:
                point, value = write
                # the view refused the write unless its hook runs (``m.x += v``: the last one, just edited)
                last = edited is not None and edited is ctx.holds.live[-1] and edited.point is point
                held = edited if last else ctx.holds.live_at(point)
                local = value if held.split is None else _local(held.split, value)
                if not (held is edited and value is held.value):  # ``m.x += v``: written back just now
                    held.access.write(point, held.rows, local)
                # A tensor of the program's own may change without being written again: logged as
                # it is now. Its copy handed out here (``resid += v``) may not: an edit is refused.
                held.written = local if value is held.value or not ctx.logs else _own_copy(local)
                call.writes += 1
        except Exception as exc:  # noqa: BLE001
            call.error = call.error or error_record(exc, where=f"writing {call.view.where()}")

    def refuse_late_edits(self, call: ProgramCall, ctx: CallContext) -> None:
        """Fail a program that edited a copy whose hook had returned: the edit cannot reach the
        model, and a program that goes on as if it had would be silently wrong."""
        late = ctx.holds.late_edit(call.done)
        if late is not None:
            call.error = call.error or error_record(RuntimeError(late), where=call.view.where())
            call.cancel(late)

    def close_calls(self, calls: list[tuple[ProgramCall, CallContext]]) -> None:
        """The step's calls are over: fail the invokes of those that failed, and take the time
        each program ran from its invokes' budget (one array update for all the calls: with a
        program per invoke, one per call cost a 256-invoke CPU step 1 ms)."""
        if not calls:
            return
        for call, ctx in calls:
            if call.error is not None:
                for inv in ctx.invokes:
                    inv.fail(call.error)
            if call.printed is not None:  # a batched program's, once: with its first invoke
                ctx.invokes[0].keep_printed(int(ctx.steps[0]), call.printed)
        # under TP, the time every rank counts
        used = np.fromiter((call.used_s if call.local_limits else call.agreed_s for call, _ctx in calls), float, len(calls))
        if all(len(ctx.invokes) == 1 for _call, ctx in calls):
            slots = np.fromiter((ctx.invokes[0].slot for _call, ctx in calls), np.int64, len(calls))
        else:
            sizes = [len(ctx.invokes) for _call, ctx in calls]
            slots, used = np.concatenate([ctx.members.slots for _call, ctx in calls]), np.repeat(used, sizes)
        self.slots.time_left[slots] = np.maximum(0.0, self.slots.time_left[slots] - used)

    def pump(self, step: Step) -> None:
        """Resume receivers whose value has been sent, until nothing more can move. Runs after
        every program resumed: with a program per invoke, a pass over every call each time cost
        a 64-invoke CPU step 1.9 ms (calls squared), so it passes only when a value was sent."""
        if step.sent == step.pumped:
            return
        moved = True
        while moved:
            moved = False
            for call, ctx in step.calls:
                waiting = call.waiting_for
                if waiting is None or call.done or waiting.module != MAILBOX:
                    continue
                key = (ctx.invokes[0].trace, waiting.kind)
                if key in step.mailbox:
                    call.resume(step.mailbox[key])
                    self.after_resume(call, ctx)
                    moved = True
        step.pumped = step.sent

    def settle(self, step: Step) -> None:
        """Under TP, after programs ran: agree on where each call goes next, then serve the
        parameter reads every rank agrees on (each a gather), until none is left."""
        if self.agree_max is None or not step.calls:
            return
        while True:
            agree_on_paths(step, self.agree_max)
            reading = [(c, x) for c, x in step.calls if not c.done and c.waiting_for.kind.startswith("param:")
                       and self.tree.modules.get(c.waiting_for.module) is not None]
            if not reading:
                return
            for call, ctx in reading:
                self._deliver_parameter(call, ctx)
                self.pump(step)

    def _deliver_parameter(self, call: ProgramCall, ctx: CallContext) -> None:
        """Hand a program a parameter every TP rank agreed it reads (gathered when split)."""
        point = call.waiting_for
        try:
            value = ReadOnlyTensor.of(self.tp.full_parameter(point.module, point.kind[len("param:"):]))
        except Exception as exc:  # noqa: BLE001
            call.cancel(f"cannot read {short_name(point.module)}.{point.kind[len('param:'):]}: {exc}")
            return
        call.resume(value)
        self.after_resume(call, ctx)


def _waiting_at(step: Step, module: str, kinds: tuple[str, ...]) -> list[tuple[ProgramCall, CallContext]]:
    """The step's calls waiting at this hook (a finished call's FINISHED matches no module)."""
    return [item for item in step.calls if item[0].waiting_for.module == module and item[0].waiting_for.kind in kinds]


def _gather(split, value: Any) -> Any:
    """The full value under tensor parallelism (a module's tuple output: its first tensor)."""
    if split is None:
        return value
    if isinstance(value, tuple):
        return (split.gather(value[0]), *value[1:])
    return split.gather(value)


def _local(split, value: Any) -> Any:
    """This rank's piece of a full value written by a program or an op."""
    if split is None:
        return value
    if isinstance(value, tuple):
        return (split.local(value[0]), *value[1:])
    return split.local(value)


def _own_copy(value: Any) -> Any:
    """A copy of a view of vLLM's tensors, outside inference mode, so its version counter shows
    an in-place edit (inference tensors have none)."""
    with torch.inference_mode(False):
        if isinstance(value, tuple):
            return tuple(_own_copy(v) for v in value)
        return value.clone() if isinstance(value, torch.Tensor) else value


class _SlabHold:
    """Held by every :class:`Written` cut from one host copy: its pinned slabs go back once the
    last of them is dropped."""

    __slots__ = ("__weakref__",)


def _release_all(pinned: PinnedSlabs, slabs: list) -> None:
    for slab in slabs:
        pinned.release(slab)


def _joined_to_host(values: list, num_rows: list[int], pinned: PinnedSlabs,
                    slabs: list) -> tuple[bool, list[tuple[Any, Any, Any]]]:
    """Host copies of several calls' written values (each ``num_rows[i]`` token rows), as
    ``(joined, [(value, ready, hold), ...])``: tensors of one shape past their rows go as one
    copy (a concatenation; ``joined``, and the one entry is its host copy, the calls' rows in
    order); others (tuples, per-request values) each alone, an entry per call."""
    hold = _SlabHold()
    first = values[0]
    if len(values) > 1 and isinstance(first, torch.Tensor) and first.dim() >= 1:
        tail, dtype, device = first.shape[1:], first.dtype, first.device
        if all(type(v) is type(first) and v.shape[0] == n and v.shape[1:] == tail and v.dtype == dtype
               and v.device == device for v, n in zip(values, num_rows)):
            joined = torch.cat(values)  # a new tensor: on a CPU it is the host copy already
            host, ready = _to_host(joined, pinned, slabs) if joined.device.type == "cuda" else (joined, None)
            return True, [(host, ready, hold)]
    out = []
    for value in values:
        host, ready = _to_host(value, pinned, slabs)
        out.append((host, ready, hold))
    return False, out


def _to_host(value: Any, pinned: PinnedSlabs, slabs: list) -> tuple[Any, Any]:
    """A host copy of a value (a tensor or a tuple of them), and the CUDA event the last copy
    waits on (None on a CPU). From a GPU the copies are cut from ``pinned``'s slabs (a fresh
    pinned allocation per write cost ~0.1 ms), each slab held added to ``slabs``."""
    if isinstance(value, tuple):
        parts = [_to_host(v, pinned, slabs) for v in value]
        ready = next((r for _v, r in reversed(parts) if r is not None), None)
        return tuple(v for v, _r in parts), ready
    if not isinstance(value, torch.Tensor):
        return None, None
    host, ready, slab = host_copy(value, pinned if value.device.type == "cuda" else None)
    if slab is not None:
        slabs.append(slab)
    return host, ready
