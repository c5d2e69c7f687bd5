"""Step scheduling: which invokes a step runs, in which rows, in which calls, with which ops.

Each step, :class:`StepScheduler` turns vLLM's batch layout into one ``Scheduled`` record of
arrays (the step's live invokes in batch order: states.py), groups the invokes whose program runs
into calls, and collects the step's ops by hook. Steps of one epoch (a decoding batch: the same
invokes in the same rows) share that work through the epoch's memo, so a decoding step is a few
array operations. (vLLM's own scheduler, which decides which requests a step runs, is
scheduler.py's business; this one only reads its decision.)
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Iterable

import numpy as np

from interlace.workers.calls import error_record
from interlace.workers.layout import BatchLayout
from interlace.workers.ops import EPOCHS_KEPT, OpOrder, StepOp
from interlace.workers.points import Point
from interlace.workers.slots import SlotTable
from interlace.workers.states import InvokeState, Scheduled


class StepScheduler:
    """Maps each step's rows to invokes, program groups and ops (the interleaver's begin_step)."""

    def __init__(self, invokes: dict[str, InvokeState], slots: SlotTable, op_plans: OpOrder):
        """``invokes``, ``slots``, ``op_plans``: the interleaver's own (live invokes by request id,
        their slot table, their ops as plans), read here, never replaced."""
        self.invokes = invokes
        self.slots = slots
        self.op_plans = op_plans
        self.replays = 0  # chunks that recomputed rows after a preemption, ops replayed on them
        self._group_numbers: dict[str, int] = {}  # live program group key -> its number in slots.group
        self._group_counter = itertools.count()
        # Decoding batches whose epoch may go on: each one's last layout and invokes, and
        # InvokeState.failures then. Several under pipeline parallelism, where vLLM keeps
        # pp_size + 1 batches in flight and their steps take turns (see ops.EPOCHS_KEPT).
        self._decoding: list[tuple[BatchLayout, Scheduled, int]] = []
        self._epochs = itertools.count(1)
        self._memos: dict[int, dict] = {}  # epoch -> the work its steps share (memo), the last few epochs'

    def group_number(self, group_key: str) -> int:
        """The number of a live program group in slots.group (given when its first invoke comes)."""
        if group_key not in self._group_numbers:
            self._group_numbers[group_key] = next(self._group_counter)
        return self._group_numbers[group_key]

    def keep_groups(self, live: Iterable[InvokeState]) -> None:
        """Forget the numbers of groups none of the ``live`` invokes is in."""
        if self._group_numbers:
            keys = {state.group_key for state in live}
            self._group_numbers = {key: n for key, n in self._group_numbers.items() if key in keys}

    def end_epochs(self) -> None:
        """An invoke came or went: no batch goes on in its epoch. Forget their work, and with it
        the invokes it refers to (a finished invoke's state is not kept alive by a cache)."""
        self._decoding.clear()
        self._memos.clear()

    def memo(self, epoch: int) -> dict:
        """The work the steps of ``epoch`` share (device row indices, ops, program groups, tapped
        saves, the taps' staged control rows), kept for the last few epochs: under pipeline parallelism the batches in flight
        take turns, and each keeps its own epoch."""
        memo = self._memos.get(epoch)
        if memo is None:
            memo = self._memos[epoch] = {}
            if len(self._memos) > EPOCHS_KEPT:  # epochs only grow: the first key is the oldest
                del self._memos[next(iter(self._memos))]
        return memo

    def step_ops(self, scheduled: Scheduled, memo: dict, reuse: bool) -> dict[tuple[str, str], list[tuple[Point, StepOp]]]:
        """This step's ops by hook, as (point, StepOp) lists in each hook's order. The same dict
        for every step of an epoch while each plan keeps its StepOp for the epoch (ops on all or
        last tokens at every step: OpPlan.for_step), so a decoding step rebuilds nothing."""
        if reuse and "ops" in memo:
            return memo["ops"]
        ops: dict[tuple[str, str], list[tuple[Point, StepOp]]] = defaultdict(list)
        applied = self.slots.ops_applied
        kept = True
        for hook, plans in self.op_plans.by_hook.items():  # array arithmetic per op, nothing per invoke
            for plan in plans:  # in an order that keeps every invoke's own (see OpOrder)
                step_op = plan.for_step(scheduled)
                kept = kept and plan.kept_for(scheduled.epoch)
                if step_op is not None:
                    ops[hook].append((plan.point, step_op))
                    if not step_op.recorded:
                        applied[step_op.slots] |= step_op.bits
                        step_op.recorded = True
        if reuse and kept:
            memo["ops"] = ops
        else:
            memo.pop("ops", None)
        return ops

    def saves_in(self, ops: dict, memo: dict) -> list[tuple[Point, StepOp]]:
        """The saves among a step's ops (the same list while the ops are: see step_ops)."""
        last = memo.get("saves")
        if last is None or last[0] is not ops:
            last = memo["saves"] = (ops, [entry for at_hook in ops.values() for entry in at_hook
                                          if entry[1].op["op"] == "save"])
        return last[1]

    def schedule(self, layout: BatchLayout) -> Scheduled:
        """This step's live invokes as arrays: the previous step's advanced by a token when the
        batch is the same decoding batch and no invoke failed since (most steps), else built
        afresh. Runs every step, so the usual case is a few array operations."""
        decoding = self._decoding
        for i, (last_layout, last, failures) in enumerate(decoding):
            if failures == InvokeState.failures and _continues(last_layout, layout):
                scheduled = last.advanced()
                self.slots.next_position[scheduled.slots] = scheduled.firsts + (scheduled.stops - scheduled.starts)
                decoding[i] = (layout, scheduled, failures)  # still decoding, past any replay (positions only grow)
                return scheduled
        # A request is in one batch at a time: a batch that shares one with this step's has ended.
        here = set(layout.req_ids)
        decoding[:] = [entry for entry in decoding if here.isdisjoint(entry[0].req_ids)]
        scheduled = self._schedule_afresh(layout)
        scheduled.epoch = next(self._epochs)
        if scheduled.final.all() and (scheduled.firsts >= scheduled.replay_until).all():
            # decoding, nothing replayed: the next step of this batch may continue the epoch
            decoding.append((layout, scheduled, InvokeState.failures))
            del decoding[:-EPOCHS_KEPT]
        return scheduled

    def _schedule_afresh(self, layout: BatchLayout) -> Scheduled:
        """This step's live invokes as arrays, from the layout.

        A chunk that starts before the invoke's next position recomputes rows vLLM computed
        before it preempted the request (KV cache pressure). Declarative ops are replayed
        exactly (edits applied again, saves not repeated: see OpPlan.for_step); a program's
        writes are put back from its write log (write_log.py) and the program runs only on the
        rows after them (program_groups). An invoke whose program kept no log fails.
        """
        states = list(map(self.invokes.get, layout.req_ids))
        picked = [i for i, state in enumerate(states) if state is not None and state.error is None]
        index = np.array(picked, dtype=np.int64)
        slots = np.fromiter((states[i].slot for i in picked), np.int64, len(picked))
        starts, stops = layout.row_starts[index], layout.row_starts[index + 1]
        firsts = layout.first_positions[index]
        ends = firsts + (stops - starts)
        table = self.slots
        recomputed = firsts < table.next_position[slots]
        table.replay_until[slots] = np.where(recomputed, table.next_position[slots], table.replay_until[slots])
        table.next_position[slots] = np.maximum(ends, table.next_position[slots])
        prompt_len = table.prompt_len[slots]
        scheduled = Scheduled([states[i] for i in picked], slots, index, starts, stops, firsts,
                              ends >= prompt_len, np.maximum(0, ends - prompt_len), prompt_len,
                              table.replay_until[slots])
        failed = [j for j in np.flatnonzero(recomputed).tolist() if not _replayable(scheduled.states[j])]
        self.replays += int(recomputed.sum()) - len(failed)
        for j in failed:
            log = scheduled.states[j].writes
            why = log.overflow if log is not None else f"it keeps no write log ({scheduled.states[j].unlogged})"
            scheduled.states[j].fail(error_record(RuntimeError(
                f"vLLM preempted this request and recomputed it from position {firsts[j]} (KV cache "
                f"pressure), and its program's writes cannot be replayed: {why}. Raise "
                "INTERLACE_REPLAY_LOG_MIB (host memory per invoke), give the engine more KV cache, or "
                "run fewer requests at once"), where=f"position {firsts[j]}"))
        if not failed:
            return scheduled
        keep = np.ones(len(picked), dtype=bool)
        keep[failed] = False
        return scheduled.pick(np.flatnonzero(keep))

    def program_groups(self, scheduled: Scheduled, memo: dict) -> tuple[dict[str, Scheduled], bool]:
        """The invokes whose program runs this step, by group (one call each), in invoke order,
        and whether any failed (a prompt split by chunked prefill).

        One call per group for the whole scheduler step: a batched sweep's invokes run together
        even when vLLM admitted their prompts in different steps (so their generation steps differ).
        """
        if not self._group_numbers:  # no live invoke has a program
            return {}, False
        if "groups" in memo:  # the same groups as this epoch's last step, one step on: their arrays
            # are views of one set (see below), advanced in place, so a step with a program per
            # invoke makes no object per group here
            combined, lengths = memo["group arrays"]
            combined.firsts += lengths
            combined.steps += lengths
            return memo["groups"], False
        group = self.slots.group[scheduled.slots]
        # a chunk that only recomputes rows after a preemption runs no program (its writes are replayed)
        runs = (group >= 0) & (scheduled.firsts + (scheduled.stops - scheduled.starts) > scheduled.replay_until)
        some_steps = runs & self.slots.some_steps[scheduled.slots]
        for j in np.flatnonzero(some_steps).tolist():
            runs[j] = int(scheduled.steps[j]) in scheduled.states[j].steps
        chunked = ~scheduled.final | ((scheduled.steps == 0) & (scheduled.firsts > 0))
        for j in np.flatnonzero(runs & chunked).tolist():
            state = scheduled.states[j]
            state.fail(error_record(RuntimeError(
                f"the prompt ({state.prompt_len} tokens) was split across scheduler steps by "
                "chunked prefill (it is longer than the engine's max_num_batched_tokens), so a "
                "program cannot see it whole at step 0; start the engine with a larger "
                "max_num_batched_tokens or enable_chunked_prefill=False, or use declarative ops, "
                "which handle chunks exactly"), where="step 0"))
        index = np.flatnonzero(runs & ~chunked)
        index = index[np.lexsort((self.slots.invoke[scheduled.slots[index]], group[index]))]  # by group, then invoke
        bounds = [0, *(np.flatnonzero(np.diff(group[index])) + 1).tolist(), len(index)] if len(index) else [0]
        combined = scheduled.pick(index).live()  # every group's invokes, group after group
        picked = {combined.states[a].group_key: combined.part(a, b) for a, b in zip(bounds, bounds[1:])}
        failed = bool((runs & chunked).any())
        replaying = bool((scheduled.firsts < scheduled.replay_until).any())
        if not failed and not some_steps.any() and not replaying:  # the groups stay as they are for the epoch
            memo["groups"] = picked
            memo["group arrays"] = (combined, combined.stops - combined.starts)
        return picked, failed


def _replayable(state: InvokeState) -> bool:
    """Whether a recomputed invoke comes through exactly: ops are replayed, and a program's
    writes are while its write log holds them all."""
    return state.program is None or (state.writes is not None and state.writes.replayable)


def _continues(last: BatchLayout, layout: BatchLayout) -> bool:
    """Whether ``layout`` is ``last`` one step on: the same requests in the same rows, each
    starting where it stopped (a decoding batch; a preempted and resumed request does not)."""
    starts = last.row_starts  # compared as bytes: a tenth of the time of array comparisons (both int64)
    return (layout.req_ids == last.req_ids and layout.row_starts.tobytes() == starts.tobytes()
            and layout.first_positions.tobytes() == (last.first_positions + (starts[1:] - starts[:-1])).tobytes())
