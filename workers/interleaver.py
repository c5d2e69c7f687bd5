"""The interleaver: runs every invoke's program and ops alongside vLLM's forward pass.

Lifecycle, one visible place per phase (called by :mod:`interlace.workers.runner_hooks`):

    admit(new requests)        parse each request's payload (first scheduling only)
    begin_step(layout)         map rows to invokes, group invokes into calls, start programs
    on_point(...)              at each hooked module: ops, then programs in invoke order
    end_step()                 close the step's calls; failures become records, never exceptions
    finish(finished ids)       report saves, shared contributions and errors; drop state

Nothing here raises into vLLM: a failing program fails its invokes and the step goes on.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
import logging
from typing import Any, Callable, ClassVar

import cloudpickle
import numpy as np
import torch

from interlace.workers.calls import ProgramCall, RanksDiverged, error_record
from interlace.workers.hooks import HookSet
from interlace.workers.holds import Held, Holdings, versions
from interlace.workers.layout import BatchLayout
from interlace.workers.ops import EPOCHS_KEPT, OpOrder, StepOp, applied_bit, apply as apply_op, selected_nothing
from interlace.workers.pipeline import HERE, LATER, Carried, StageMap
from interlace.workers.points import MAILBOX, ROW_PER_REQUEST_KINDS, ModuleTree, Point, PointAccess, Rows, device_index, short_name
from interlace.workers.reporter import Reporter
from interlace.workers.readonly import ReadOnlyTensor
from interlace.workers.saves import HostRows, SaveLedger, TakenSaves, host_copy
from interlace.workers.sink import open_sink
from interlace.workers.slots import SlotTable
from interlace.workers.tensor_parallel import TensorParallelLayout
from interlace.workers.view import ProgramView

PAYLOAD_KEY = "interlace"
logger = logging.getLogger("interlace")
RESERVE_MIN = 16 << 20  # a trace saving less is reserved when it is reported (see _reserve_ahead)
REPORT_HOLD_S = 0.05  # how long finished invokes' reports wait for the rest of their trace (see _report)


@dataclass
class InvokeState:
    """Long-lived state of one intervened request on this rank."""

    req_id: str
    slot: int  # this rank's number for the invoke: its row in the SlotTable, and saved rows' owner
    trace: str
    invoke: int
    prompt_len: int
    program: Any  # callable or None
    group_key: str | None  # invokes with the same key share one call per step (batched programs)
    ops: list[dict]
    steps: frozenset[int] | None  # program steps; None = every step
    sink: str
    timeout_s: float  # the trace's time limit for programs (the time left is a slot column)
    max_save_bytes: int
    saves: dict[str, list] = field(default_factory=dict)  # values that are not rows (tensors go to the ledger)
    shared: list[tuple[str, str, Any]] = field(default_factory=list)
    error: dict | None = None
    tapped: list[dict] | None = None  # ops that run through graph taps (taps.py): they all do; None: hooks

    # Invokes failed so far, in this process: a step tells whether any failed since the last one
    # by comparing one number, not by looking at every invoke of the batch.
    failures: ClassVar[int] = 0

    def fail(self, record: dict) -> None:
        if self.error is None:
            self.error = record
            InvokeState.failures += 1


@dataclass
class Scheduled:
    """This step's live invokes (scheduled, not failed), in batch order, as arrays."""

    states: list[InvokeState]
    slots: np.ndarray
    req_rows: np.ndarray  # each invoke's request index in the layout (its logits/samples row)
    starts: np.ndarray  # its rows starts[i]:stops[i] of the flat token batch
    stops: np.ndarray
    firsts: np.ndarray  # the position of its first row in its sequence
    final: np.ndarray  # whether this chunk ends its prompt (always, once decoding)
    steps: np.ndarray  # its generation step (its last row's)
    prompt_lens: np.ndarray
    replay_until: np.ndarray  # rows before this position recompute rows of before a preemption
    # Steps of one epoch have the same invokes in the same rows, all decoding, so anything that
    # depends only on rows (an op's selection, device indices) is computed once per epoch.
    epoch: int = 0

    def pick(self, index: np.ndarray) -> "Scheduled":
        return Scheduled([self.states[i] for i in index.tolist()], self.slots[index], self.req_rows[index],
                         self.starts[index], self.stops[index], self.firsts[index], self.final[index],
                         self.steps[index], self.prompt_lens[index], self.replay_until[index], self.epoch)

    def advanced(self) -> "Scheduled":
        """The next step of the same epoch: every invoke one step further, in the same rows."""
        lengths = self.stops - self.starts
        return Scheduled(self.states, self.slots, self.req_rows, self.starts, self.stops, self.firsts + lengths,
                         self.final, self.steps + lengths, self.prompt_lens, self.replay_until, self.epoch)


@dataclass
class CallContext:
    """One call's slice of the step: which invokes, which rows (read by the program's view)."""

    key: str  # the group key: names the call to the next pipeline stage
    tree: ModuleTree
    services: "Interleaver"
    members: Scheduled  # the call's invokes, in invoke order
    timeout_s: float

    def __post_init__(self):
        self.invokes = self.members.states
        self.lengths = self.members.stops - self.members.starts
        self.num_rows = int(self.lengths.sum())
        self.local_stops = np.cumsum(self.lengths)  # invoke j's rows of the values this call reads
        self.local_starts = self.local_stops - self.lengths
        self.holds = Holdings()  # what the program read this step, and whether it may still write it

    # Built only when asked for (a sweep's call would otherwise build 256 of each per step)

    @functools.cached_property
    def steps(self) -> list[int]:
        return self.members.steps.tolist()

    @functools.cached_property
    def local_rows(self) -> list[slice]:
        """Each invoke's rows within the values this call reads (stacked in invoke order)."""
        return [slice(a, b) for a, b in zip(self.local_starts.tolist(), self.local_stops.tolist())]

    @functools.cached_property
    def positions(self) -> list[range]:
        return [range(f, f + n) for f, n in zip(self.members.firsts.tolist(), self.lengths.tolist())]

    @functools.cached_property
    def token_rows(self) -> Rows:
        return Rows.of(self.members.starts, self.members.stops, self.services.device)

    @functools.cached_property
    def request_rows(self) -> Rows:
        return Rows.at(self.members.req_rows, self.services.device)

    @functools.cached_property
    def last_rows(self) -> torch.Tensor:
        """Each invoke's last row within the values this call reads, as a device index."""
        return device_index(torch.from_numpy(self.local_stops - 1), self.services.device)

    def step_words(self) -> str:
        """"step 3", or "steps [2, 3]" for a batched call over invokes at different steps."""
        steps = sorted(set(self.steps))
        return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"


@dataclass
class Step:
    """Per-step state, rebuilt every step."""

    layout: BatchLayout
    calls: list[tuple[ProgramCall, CallContext]]
    ops: dict[tuple[str, str], list[tuple[Point, StepOp]]]  # by hook (see hooks.hook_of): ops to apply there, in order
    mailbox: dict[tuple[str, str], Any] = field(default_factory=dict)
    carry: dict[str, Carried] = field(default_factory=dict)  # for the next pipeline stage
    tapped: list[tuple[Point, StepOp]] = field(default_factory=list)  # saves that ran in graph taps
    memo: dict = field(default_factory=dict)  # work shared by the steps of an epoch (Interleaver._memo)
    times_agreed: bool = False  # under TP: the last path round saw every call done, so its times are final

    def rows_at(self, rows: np.ndarray, device) -> Rows:
        """``Rows.at``, once per epoch for each distinct selection: a sweep saving 4 layers sends
        one index to the GPU when its batch changes, not 4 at every step."""
        known = self.memo.setdefault("rows", {})
        key = rows.tobytes()
        if key not in known:
            known[key] = Rows.at(rows, device)
        return known[key]


class Interleaver:
    vocab_size = 1 << 62  # set by the runner adapter: forced samples must lie in [0, vocab_size)
    # Set by the runner adapter under TP > 1: the element-wise max of an array over the TP group.
    # Programs' paths and time-outs are then decided where every rank agrees (see calls.py,
    # _agree_on_paths and _agree_on_time).
    agree_max: Callable[[np.ndarray], np.ndarray] | None = None

    def __init__(self, model: torch.nn.Module, samples_slot, rank_info: dict, all_modules: list[str],
                 hidden_size: int):
        """``all_modules``: module names of the whole model (every pipeline stage's, so programs
        resolve the same paths everywhere); ``rank_info``: tp_rank, tp_size, pp_rank, pp_size."""
        self.tree = ModuleTree(model, all_modules)
        self.rank = rank_info
        self.stages = StageMap(self.tree.local, rank_info["pp_rank"], rank_info["pp_size"], self.tree.embeddings)
        self.tp = TensorParallelLayout(self.tree.modules, rank_info["tp_rank"], rank_info["tp_size"], hidden_size)
        self.invokes: dict[str, InvokeState] = {}
        self.step: Step | None = None
        self.carry_in: dict[str, Carried] = {}  # from the previous pipeline stage, this step
        self.hooks = HookSet(self.tree, samples_slot, self._on_point)
        self.op_plans = OpOrder()  # the live invokes' ops as plans, by hook, each invoke's in its order
        self.ledger = SaveLedger()
        self.device = next(model.parameters()).device
        self.reporter = Reporter(self.device)
        self.slots = SlotTable()
        self.replays = 0  # chunks that recomputed rows after a preemption, ops replayed on them
        self.graph_steps: dict[str, int] | None = None  # a compiled engine's steps by kind (graphs.py)
        self.taps = getattr(model, "_interlace_taps", None)  # graph taps built in at load (taps.py)
        self.tap_step = False  # set before each step: this step's ops run through taps
        self.tap_steps = 0
        self._said_untapped = False
        self._untapped: set[str] = set()  # live invokes whose steps run eager (see runs_on_taps)
        self._reserving: dict[tuple[str, str], tuple[int, int]] = {}  # (sink, trace) -> bytes saved, reserved
        self._held: dict[tuple[str, str], _HeldReports] = {}  # (sink, trace) -> reports waiting for the rest (_report)
        self._programs: dict[str, Any] = {}  # program key -> unpickled program (shared by a sweep)
        self._ops: dict[str, list[dict]] = {}  # ops key -> unpickled ops, points resolved (shared by a sweep)
        self._group_numbers: dict[str, int] = {}  # live program group key -> its number in slots.group
        self._group_counter = itertools.count()
        # Decoding batches whose epoch may go on: each one's last layout and invokes, and
        # InvokeState.failures then. Several under pipeline parallelism, where vLLM keeps
        # pp_size + 1 batches in flight and their steps take turns (see ops.EPOCHS_KEPT).
        self._decoding: list[tuple[BatchLayout, Scheduled, int]] = []
        self._epochs = itertools.count(1)
        self._memos: dict[int, dict] = {}  # epoch -> the work its steps share (_memo), the last few epochs'

    @property
    def active(self) -> bool:
        return bool(self.invokes)

    # --- per request --------------------------------------------------------------------------

    def admit(self, req_id: str, prompt_len: int, payload_bytes: bytes) -> None:
        payload = cloudpickle.loads(payload_bytes)
        steps = payload.get("steps")
        state = InvokeState(
            req_id=req_id,
            slot=self.slots.add(prompt_len, payload["max_save_bytes"], payload["timeout_s"], payload["invoke"],
                                some_steps=steps is not None),
            trace=payload["trace"],
            invoke=payload["invoke"],
            prompt_len=prompt_len,
            program=None,
            group_key=None,
            ops=[],
            steps=frozenset(steps) if steps is not None else None,
            sink=payload["sink"],
            timeout_s=payload["timeout_s"],
            max_save_bytes=payload["max_save_bytes"],
        )
        self.invokes[req_id] = state
        self._untapped.add(req_id)  # until its ops are known to run in graph taps (runs_on_taps)
        self._end_epochs()  # a new invoke starts a new epoch
        try:
            if payload["ops_key"] not in self._ops:  # unpickled once per distinct list: shared by a sweep
                ops = cloudpickle.loads(payload["ops"])
                for op in ops:
                    op["_point"] = self.tree.op_point(op["point"])
                self._ops[payload["ops_key"]] = ops
            state.ops = self._ops[payload["ops_key"]]
            if payload.get("program") is not None:
                key = payload["program_key"]
                if key not in self._programs:
                    self._programs[key] = _on_device(cloudpickle.loads(payload["program"]), self.device)
                state.program = self._programs[key]
                state.group_key = f"{state.trace}/{key}" if payload.get("batched") else req_id
                if state.group_key not in self._group_numbers:
                    self._group_numbers[state.group_key] = next(self._group_counter)
                self.slots.group[state.slot] = self._group_numbers[state.group_key]
        except Exception as exc:  # noqa: BLE001 - a bad payload fails this invoke only
            state.fail(error_record(exc, where="loading the invoke's program and ops"))
        here = lambda point: self.stages.where(point) == HERE  # noqa: E731 - other stages apply theirs
        for index, op in enumerate(state.ops):
            if "_point" in op and here(op["_point"]):
                self.hooks.want(op["_point"], owner=req_id)
                self.slots.ops_expected[state.slot] |= applied_bit(index)  # checked when it finishes
        # plans in an order that keeps every invoke's own (a plan's saves belong to one trace)
        self.op_plans.add(state, state.ops, prepare=lambda op: _op_on_device(op, self.device), here=here)
        if self.taps is not None and state.error is not None:
            state.tapped = []  # failed alike on every rank: it never holds a step eager
        elif self.taps is not None and state.program is None:
            self._tap(state)
        if state.tapped is not None:
            self._untapped.discard(req_id)

    def _tap(self, state: InvokeState) -> None:
        """Run the invoke's ops through graph taps if it can (taps.Taps.can_run), holding a vector
        row for each of its adds and replaces, every stage's (so every rank decides alike)."""
        if not self.taps.can_run(state.ops):
            if not self._said_untapped:
                self._said_untapped = True
                logger.info("interlace: an invoke's ops cannot all run in this engine's graph taps (an op at a point "
                            "not in graph_taps, two edits at one tap, or a vector not of the hidden size): the steps "
                            "it is in run eager (counted as 'eager' in interlace_step_counts)")
            return
        held = []
        for op in state.ops:
            if "_point" in op:
                if not self.taps.hold(op):
                    for other in held:
                        self.taps.let_go(other)
                    return
                held.append(op)
        state.tapped = held

    def runs_on_taps(self, req_ids) -> bool:
        """Whether a step of these requests runs its ops through taps (every intervened one can).
        Decided from admission alone, never from errors met since (some happen on one rank only),
        so every rank and stage takes the same path."""
        # The live invokes that are not tapped, looked up in the step's requests: not the step's
        # requests one by one (a Python loop over the whole batch, every step).
        return self.taps is not None and not any(r in req_ids for r in self._untapped)

    def finish(self, req_ids) -> None:
        if self._held:
            self._submit_held(time.monotonic() - REPORT_HOLD_S)
        finished = [state for state in map(self.invokes.pop, req_ids, [None] * len(req_ids)) if state]
        if finished:
            self._end_epochs()
        for state in finished:
            self._untapped.discard(state.req_id)
            self.hooks.release(owner=state.req_id)
            for op in state.tapped or ():
                self.taps.let_go(op)
        if finished and self.op_plans:
            self.op_plans.drop({id(state) for state in finished})
            self._fail_unapplied_ops(finished)
        for state in finished:
            if state.steps is not None and state.program is not None and state.error is None:
                self._check_steps_ran(state)
        if finished and self.rank["tp_rank"] == 0:  # one report per TP group; every PP stage reports
            self._report(finished)  # their slots are given back once the ledger lets go of their rows
        else:
            for state in finished:
                self.slots.remove(state.slot)
        if finished and self._group_numbers:
            live = {state.group_key for state in self.invokes.values()}
            self._group_numbers = {key: n for key, n in self._group_numbers.items() if key in live}
        if not self.invokes:
            self._programs.clear()
            self._ops.clear()

    def _fail_unapplied_ops(self, finished: list[InvokeState]) -> None:
        """Fail an invoke one of whose ops (on this stage) selected no row over its whole
        generation, e.g. positions past its end: a silent no-op would pass for an intervention
        that changed nothing. Array arithmetic over the finished slots; Python only for failures."""
        slots = np.fromiter((state.slot for state in finished), np.int64, len(finished))
        table = self.slots
        missing = table.ops_expected[slots] & ~table.ops_applied[slots]
        ran = table.next_position[slots] >= table.prompt_len[slots]  # not aborted before its prompt ran
        for j in np.flatnonzero((missing != 0) & ran).tolist():
            state = finished[j]
            index = (int(missing[j]) & -int(missing[j])).bit_length() - 1  # its first op that never applied
            op = state.ops[index]
            state.fail(error_record(ValueError(selected_nothing(op, state.prompt_len, int(table.next_position[state.slot]))),
                                    where=f"op {op['op']} at {op['point']}"))

    def _check_steps_ran(self, state: InvokeState) -> None:
        """Fail an invoke whose program was given steps that never ran (generation ended before
        them): its results would silently lack what those steps were to do."""
        last = int(self.slots.next_position[state.slot]) - state.prompt_len  # the last step run
        missed = sorted(step for step in state.steps if step > last)
        if missed:
            ran = f"steps 0 to {last} ran" if last >= 0 else "no step ran"
            state.fail(error_record(RuntimeError(
                f"the program was given steps={sorted(state.steps)}, but generation ended before "
                f"steps {missed} ({ran}: max_tokens, EOS or a stop string ended it), so the program "
                "never ran there; ask for steps below max_tokens, or pass ignore_eos=True"), where="end of generation"))

    def _report(self, finished: list[InvokeState]) -> None:
        """Hand the finished invokes' reports to the reporter thread, one batch per (sink, trace).

        A trace's invokes often finish a step or two apart (those admitted a step later). Their
        reports are held until the trace's last invoke on this rank finishes, or for at most
        REPORT_HOLD_S, and written as one batch: one take from the ledger, one plan, one region
        and one header, not one of each per step. (Each invoke keeps its slot meanwhile, so no
        invoke admitted since can be given its number and its rows.) Written at once, the first
        batch's gathering ran on the reporter thread during the trace's last steps, slowing them
        (Python contends for the GIL), and the next waited behind it: 55-70 ms from the last step
        to the results on an H100 host, for 512 MiB saved in three batches (bench/step_probe.py,
        2026-11-26)."""
        live = {(state.sink, state.trace) for state in self.invokes.values()}
        for state in finished:
            key = (state.sink, state.trace)
            self._held.setdefault(key, _HeldReports(time.monotonic())).states.append(state)
        for key in {(state.sink, state.trace) for state in finished} - live:  # this rank's last batch of the trace
            self._reserving.pop(key, None)
            self._submit(key, last=True)

    def _submit_held(self, before: float) -> None:
        """Hand over the held reports that have waited since ``before``."""
        for key in [key for key, held in self._held.items() if held.since <= before]:
            self._submit(key, last=False)

    def _submit(self, key: tuple[str, str], last: bool) -> None:
        states = self._held.pop(key).states
        taken = self.ledger.take(key[1], [state.slot for state in states])
        for state in states:  # the ledger has let go of their rows: the numbers may go to new invokes
            self.slots.remove(state.slot)
        stage = self.rank["pp_rank"]
        reports = [_report_of(state, stage) for state in states]
        self.reporter.submit(functools.partial(_write_reports, *key, stage, reports, taken,
                                               [state.saves for state in states], last))

    def _reserve_ahead(self, state: InvokeState, nbytes: int) -> None:
        """Keep the trace's report data file reserved ahead of its saves (see report_file.py): a
        job for the reporter thread each time the saves grow by a quarter, from RESERVE_MIN on."""
        key = (state.sink, state.trace)
        saved, reserved = self._reserving.get(key, (0, 0))
        saved += nbytes
        if saved >= max(reserved, RESERVE_MIN):
            reserved = saved + saved // 4
            self.reporter.submit(functools.partial(_reserve, state.sink, state.trace, self.rank["pp_rank"], reserved))
        self._reserving[key] = (saved, reserved)

    # --- per step ------------------------------------------------------------------------------

    def begin_step(self, layout: BatchLayout) -> None:
        scheduled = self._schedule(layout)
        memo = self._memo(scheduled.epoch)
        groups, failed = self._program_groups(scheduled, memo)
        if failed:  # prompts a program cannot see whole: no ops for them either
            scheduled = scheduled.pick(np.array([j for j, s in enumerate(scheduled.states) if s.error is None], np.int64))
        ops = self._step_ops(scheduled, memo, reuse=not failed)
        self.step = Step(layout, [], ops, memo=memo)
        if self.tap_step:  # every op runs inside the forward, from the taps' buffers: no hook applies one
            self.taps.fill(ops, memo)
            self.step.ops = {}
            self.step.tapped = self._saves_in(ops, memo)
            self.tap_steps += 1
        carry_in, self.carry_in = self.carry_in, {}
        mail = carry_in.pop(MAILBOX, None)  # sent on earlier stages: a receiver may wait for it here
        if mail is not None:
            self.step.mailbox.update({(trace, name): value for trace, name, value in mail.values})
        for group_key, members in groups.items():
            carried = carry_in.get(group_key)
            if carried is not None and carried.status != "suspended":
                # finished or failed on an earlier stage: nothing left to run here
                self.step.carry[group_key] = carried
                for state in members.states:
                    if carried.error is not None:
                        state.fail(carried.error)
                continue
            ctx = CallContext(key=group_key, tree=self.tree, services=self, members=members,
                              timeout_s=float(self.slots.time_left[members.slots[0]]))
            view = ProgramView(ctx)
            call = ProgramCall(members.states[0].program, view, budget_s=ctx.timeout_s,
                               limit_s=members.states[0].timeout_s, replay=carried.values if carried is not None else None,
                               replay_points=carried.points if carried is not None else None,
                               keep_log=not self.stages.last, local_limits=self.agree_max is None)
            object.__setattr__(view, "_call", call)
            self.step.calls.append((call, ctx))
        self.step.calls.sort(key=lambda c: (c[1].invokes[0].trace, c[1].invokes[0].invoke))
        for call, ctx in self.step.calls:
            call.start()
            self._after_resume(call, ctx)
            self._pump(self.step)
        self._settle(self.step)

    def _end_epochs(self) -> None:
        """An invoke came or went: no batch goes on in its epoch. Forget their work, and with it
        the invokes it refers to (a finished invoke's state is not kept alive by a cache)."""
        self._decoding.clear()
        self._memos.clear()

    def _memo(self, epoch: int) -> dict:
        """The work the steps of ``epoch`` share (device row indices, ops, program groups, tapped
        saves, the taps' staged control rows), kept for the last few epochs: under pipeline parallelism the batches in flight
        take turns, and each keeps its own epoch."""
        memo = self._memos.get(epoch)
        if memo is None:
            memo = self._memos[epoch] = {}
            if len(self._memos) > EPOCHS_KEPT:  # epochs only grow: the first key is the oldest
                del self._memos[next(iter(self._memos))]
        return memo

    def _step_ops(self, scheduled: Scheduled, memo: dict, reuse: bool) -> dict[tuple[str, str], list[tuple[Point, StepOp]]]:
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

    def _saves_in(self, ops: dict, memo: dict) -> list[tuple[Point, StepOp]]:
        """The saves among a step's ops (the same list while the ops are: see _step_ops)."""
        last = memo.get("saves")
        if last is None or last[0] is not ops:
            last = memo["saves"] = (ops, [entry for at_hook in ops.values() for entry in at_hook
                                          if entry[1].op["op"] == "save"])
        return last[1]

    def _schedule(self, layout: BatchLayout) -> Scheduled:
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
        accesses cannot be, so an invoke with a program fails.
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
        failed = [j for j in np.flatnonzero(recomputed).tolist() if scheduled.states[j].program is not None]
        self.replays += int(recomputed.sum()) - len(failed)
        for j in failed:
            scheduled.states[j].fail(error_record(RuntimeError(
                f"vLLM preempted this request and recomputed it from position {firsts[j]} (KV cache "
                "pressure); a program's accesses cannot be replayed exactly (declarative ops are). "
                "Give the engine more KV cache or run fewer requests at once"), where=f"position {firsts[j]}"))
        if not failed:
            return scheduled
        keep = np.ones(len(picked), dtype=bool)
        keep[failed] = False
        return scheduled.pick(np.flatnonzero(keep))

    def _program_groups(self, scheduled: Scheduled, memo: dict) -> tuple[dict[str, Scheduled], bool]:
        """The invokes whose program runs this step, by group (one call each), in invoke order,
        and whether any failed (a prompt split by chunked prefill).

        One call per group for the whole scheduler step: a batched sweep's invokes run together
        even when vLLM admitted their prompts in different steps (so their generation steps differ).
        """
        if not self._group_numbers:  # no live invoke has a program
            return {}, False
        if "groups" in memo:  # the same groups as this epoch's last step, one step on
            groups = memo["groups"] = {key: members.advanced() for key, members in memo["groups"].items()}
            return groups, False
        group = self.slots.group[scheduled.slots]
        runs = group >= 0
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
        groups = np.split(index, np.flatnonzero(np.diff(group[index])) + 1) if len(index) else []
        picked = {scheduled.states[g[0]].group_key: scheduled.pick(g) for g in groups}
        failed = bool((runs & chunked).any())
        if not failed and not some_steps.any():  # the groups stay as they are for the epoch
            memo["groups"] = picked
        return picked, failed

    def end_step(self) -> dict[str, Carried]:
        """Close the step's calls; returns what the next pipeline stage needs to go on."""
        step = self.step
        if step is None:
            return {}
        if step.tapped:
            self._take_tapped(step.tapped, step.memo)
        if self.agree_max is not None and step.calls:
            self._agree_on_time(step)
        for call, ctx in step.calls:
            if ctx.holds.late:  # a program stopped or suspended here may have edited one still
                self._refuse_late_edits(call, ctx)
            if not call.done and self._goes_on_later(call):
                log = call.log
                call.suspend()
                step.carry[ctx.key] = Carried("suspended", log, points=call.log_points)
            else:
                if not call.done and call.waiting_for.module == MAILBOX:
                    call.cancel(self._unsent(ctx, call.waiting_for.kind))
                elif not call.done:
                    call.cancel(self._unreached(call))
                if not self.stages.last:
                    step.carry[ctx.key] = Carried("failed" if call.error else "finished", error=call.error)
            self._close_call(call, ctx)
        if step.mailbox and not self.stages.last:  # for receivers that wait on a later stage
            step.carry[MAILBOX] = Carried("mailbox", [(trace, name, value) for (trace, name), value in step.mailbox.items()])
        self.step = None
        return step.carry

    def _goes_on_later(self, call: ProgramCall) -> bool:
        """Waiting for a point a later pipeline stage owns (or, before the last stage, for a
        value another invoke may still send there)."""
        if self.stages.last:
            return False
        point = call.waiting_for
        return point.module == MAILBOX or self.stages.where(point) == LATER

    # --- at a hooked module (engine thread) ----------------------------------------------------

    def _on_point(self, module: str, family: str, hooked: Any) -> Any:
        """Run ops and programs waiting at ``module``; returns the (possibly rewritten) value."""
        step = self.step
        if step is None:
            return hooked
        try:
            return self._dispatch(step, module, family, hooked)
        except Exception as exc:  # noqa: BLE001 - an internal error fails this step's invokes only
            record = error_record(exc, where=f"interlace internals at {module or family}")
            for call, ctx in step.calls:
                call.error = call.error or record
            for at_hook in step.ops.values():
                for _point, step_op in at_hook:
                    for inv in step_op.invokes:
                        inv.fail(record)
            return hooked

    def _dispatch(self, step: Step, module: str, family: str, hooked: Any) -> Any:
        kinds = ("input",) if family == "input" else (("output", "resid", "final") if module else (family,))
        access = PointAccess(hooked, step.layout)
        for point, step_op in step.ops.get((module, family), ()):
            self._apply_op(step, point, access, step_op)
        delivered: list[tuple[ProgramCall, CallContext]] = []
        try:
            while step.calls:
                ready = [(c, x) for c, x in step.calls if not c.done and c.waiting_for.module == module
                         and c.waiting_for.kind in kinds]
                if not ready:
                    break
                for call, ctx in ready:
                    if call.waiting_for.module == module and call.waiting_for.kind in kinds and not call.done:
                        delivered.append((call, ctx))
                        self._deliver(call, ctx, call.waiting_for, access)
                        self._pump(step)
                self._settle(step)
        finally:  # the hook returns: from here on, writes to what it handed out would be lost
            for call, ctx in delivered:
                ctx.holds.close(None if call.done else call.waiting_for, call.done)
        return access.result()

    def _apply_op(self, step: Step, point: Point, access: PointAccess, step_op: StepOp) -> None:
        op = step_op.op
        rows = step.rows_at(step_op.rows, access.device)
        split = self.tp.split(point.module, point.kind)
        try:  # on one tensor: a tuple output's first (vLLM's linear layers return (out, bias))
            value = _gather(split, access.read_tensor(point, rows))
            if op["op"] == "save":
                self._save_rows(step_op.invokes, step_op.slots, [(op.get("name") or op["point"], value)],
                                step_op.starts, step_op.stops, fresh=split is not None or access.is_copy(point, rows))
            else:
                access.write_tensor(point, rows, _local(split, apply_op(op, value)))
        except Exception as exc:  # noqa: BLE001
            for inv in step_op.invokes:
                inv.fail(error_record(exc, where=f"op {op['op']} at {point}"))

    def _take_tapped(self, tapped: list[tuple[Point, StepOp]], memo: dict) -> None:
        """The saves that ran in taps: their rows, from the taps' buffers (read before the next
        forward). Saves of the same rows (a sweep saving 4 layers' last token) are one gather and
        one ledger entry per step: this runs on the engine thread between graph replays of about
        3 ms (the 1B shape on an H100), where each save's own gather and bookkeeping added up."""
        last = memo.get("tapped groups")
        if last is None or (last[0] is not tapped and (len(last[0]) != len(tapped)
                                                      or not all(a[1] is b[1] for a, b in zip(last[0], tapped)))):
            last = memo["tapped groups"] = (tapped, self.taps.save_groups(tapped))
        for group in last[1]:
            try:
                values = group.gather(self.taps.saved)
                self._save_rows(group.invokes, group.slots, list(zip(group.names, values)), group.starts, group.stops,
                                fresh=True)
            except Exception as exc:  # noqa: BLE001
                for inv in group.invokes:
                    inv.fail(error_record(exc, where=f"op save at {group.where}"))

    def _deliver(self, call: ProgramCall, ctx: CallContext, point: Point, access: PointAccess) -> None:
        split = self.tp.split(point.module, point.kind)
        try:
            rows = self._rows_for(point, ctx)
            value = access.read(point, rows)
            if split is not None:
                with torch.inference_mode(False):  # a normal tensor: its version counter shows edits
                    value = _gather(split, value)
        except Exception as exc:  # noqa: BLE001 - e.g. resid on a module that is not a layer
            call.cancel(f"cannot read {point}: {exc}")
            return
        copy = split is not None or access.is_copy(point, rows)
        ctx.holds.live.append(Held(point, value, versions(value), access, rows, split, copy))
        call.resume(value)
        self._after_resume(call, ctx)

    def _rows_for(self, point: Point, ctx: CallContext) -> Rows:
        return ctx.request_rows if point.kind in ROW_PER_REQUEST_KINDS else ctx.token_rows

    def _after_resume(self, call: ProgramCall, ctx: CallContext) -> None:
        if ctx.holds.live or call.view._pending_write is not None:
            self._write_back(call, ctx)
        if ctx.holds.late:
            self._refuse_late_edits(call, ctx)
        point = call.waiting_for
        if not call.done and point.module != MAILBOX and not point.kind.startswith("param:") \
                and self.stages.where(point) == HERE:
            self.hooks.want(point, owner=ctx.invokes[0].req_id)

    def _write_back(self, call: ProgramCall, ctx: CallContext) -> None:
        """After the program ran: write what it changed of the values whose hook runs now, its
        copies edited in place and then its assignment, however many times it waited since it
        read them (e.g. a receiver woken at this hook by the sender's send)."""
        try:
            for held in ctx.holds.live:
                if held.copy:
                    now = versions(held.value)
                    if now != held.versions or -1 in now:  # edited in place (or no counter to tell)
                        held.access.write(held.point, held.rows, _local(held.split, held.value))
                        held.versions = now
                        call.writes += 1
            write = call.view._take_write()
            if write is not None:
                point, value = write
                held = ctx.holds.live_at(point)  # the view refused the write unless its hook runs
                held.access.write(point, held.rows, _local(held.split, value))
                call.writes += 1
        except Exception as exc:  # noqa: BLE001
            call.error = call.error or error_record(exc, where=f"writing {call.view.where()}")

    def _refuse_late_edits(self, call: ProgramCall, ctx: CallContext) -> None:
        """Fail a program that edited a copy whose hook had returned: the edit cannot reach the
        model, and a program that goes on as if it had would be silently wrong."""
        late = ctx.holds.late_edit(call.done)
        if late is not None:
            call.error = call.error or error_record(RuntimeError(late), where=call.view.where())
            call.cancel(late)

    def _close_call(self, call: ProgramCall, ctx: CallContext) -> None:
        if call.error is not None:
            for inv in ctx.invokes:
                inv.fail(call.error)
        slots = ctx.members.slots
        used = call.used_s if call.local_limits else call.agreed_s  # under TP, the time every rank counts
        self.slots.time_left[slots] = np.maximum(0.0, self.slots.time_left[slots] - used)

    def _settle(self, step: Step) -> None:
        """Under TP, after programs ran: agree on where each call goes next, then serve the
        parameter reads every rank agrees on (each a gather), until none is left."""
        if self.agree_max is None or not step.calls:
            return
        while True:
            self._agree_on_paths(step)
            reading = [(c, x) for c, x in step.calls if not c.done and c.waiting_for.kind.startswith("param:")
                       and self.tree.modules.get(c.waiting_for.module) is not None]
            if not reading:
                return
            for call, ctx in reading:
                self._deliver_parameter(call, ctx)
                self._pump(step)

    def _agree_on_paths(self, step: Step) -> None:
        """Stop, on every rank, each call whose ranks went different ways.

        The TP ranks run each program on the same values, so they make the same accesses, unless
        the program consults something rank-local (the clock, the process id, a file, a device
        error on one GPU). A rank whose program then reads a split value would enter a gather the
        others never join, and the group would hang; one that writes where the others do not
        would leave the ranks computing from different values, silently. So each time programs
        ran, before anything is gathered for them, the ranks compare every call's state (what
        it waits for next, whether it failed, how many writes it made): one all-reduce of a few
        numbers per call over the group's CPU group. The calls are the same, in the same order,
        on every rank, and a rank runs a round exactly where the others do: after starting the
        step's programs, and at each hook where calls that all ranks agreed wait there ran.
        Values a program computes without acting on them differently (e.g. noise added to a
        write) are not compared."""
        calls, n = step.calls, len(step.calls)
        codes = np.fromiter((_path_code(call) for call, _ in calls), np.float64, n)
        used = np.fromiter((call.used_s for call, _ in calls), np.float64, n)
        agreed = self.agree_max(np.concatenate([codes, -codes, used]))  # the times too (see _agree_on_time)
        high, low = agreed[:n], -agreed[n : 2 * n]
        for (call, _ctx), used_s in zip(calls, agreed[2 * n :].tolist()):
            call.agreed_s = used_s
        for (call, _ctx), hi, lo in zip(calls, high.tolist(), low.tolist()):
            if hi != lo:
                message = (
                    f"the program took different paths on the tensor-parallel ranks (on this rank it "
                    f"{_path_words(call)}, on another not). "
                    "Every rank runs the program on the same values and must read, write and fail alike; "
                    "something rank-local (the clock, the process id or rank, a file, randomness seeded "
                    "apart, an error on one GPU only) decided otherwise. It was stopped on every rank"
                )
                call.stop(error_record(RanksDiverged(message), where=call.view.where()))
        step.times_agreed = all(call.done for call, _ in calls)  # no program runs again this step

    def _deliver_parameter(self, call: ProgramCall, ctx: CallContext) -> None:
        """Hand a program a parameter every TP rank agreed it reads (gathered when split)."""
        point = call.waiting_for
        try:
            value = ReadOnlyTensor.of(self.tp.full_parameter(point.module, point.kind[len("param:"):]))
        except Exception as exc:  # noqa: BLE001
            call.cancel(f"cannot read {short_name(point.module)}.{point.kind[len('param:'):]}: {exc}")
            return
        call.resume(value)
        self._after_resume(call, ctx)

    def _agree_on_time(self, step: Step) -> None:
        """Under TP, decide the step's time-outs the same way on every rank: each call's running
        time is the most any rank counted (an all-reduce over the TP group's CPU group, unless the
        step's last path round carried the final times already), and every call past its budget
        by that measure is stopped here, on every rank alike. The calls are the same, in the same
        order, on every rank of the group (built from the same schedule)."""
        calls = step.calls
        if not step.times_agreed:  # programs ran since the last round, or some wait for a point not reached
            agreed = self.agree_max(np.fromiter((call.used_s for call, _ in calls), np.float64, len(calls)))
            for (call, _ctx), used in zip(calls, agreed.tolist()):
                call.agreed_s = used
        for call, _ctx in calls:
            if call.agreed_s >= call.budget_s and call.error is None:
                call.time_out()

    def last_words(self, ctx: CallContext, record: dict) -> None:
        """Report ``record`` as the error of the call's invokes, now, from the watchdog's thread:
        the process is about to end (calls.py's last resort), so nothing else will report them."""
        for state in ctx.invokes:
            state.error = None
            state.fail(record)
        batches: dict[tuple[str, str], list[InvokeState]] = defaultdict(list)
        for state in ctx.invokes:
            batches[(state.sink, state.trace)].append(state)
        stage = self.rank["pp_rank"]
        for (sink, trace), states in batches.items():
            open_sink(sink).write(trace, stage, [{**_report_of(state, stage), "shared": []} for state in states])

    def check_samples(self, sampled: torch.Tensor, drawn: torch.Tensor) -> None:
        """Refuse forced tokens outside the vocabulary once programs are done with this step's
        samples (a write, or an in-place edit of ``m.samples``): the next step's embedding lookup
        would fail on them and take the worker down (or, split across TP ranks, read a zero row).
        The token vLLM drew (``drawn``) stays and the invoke fails. Runs only while a program reads
        samples (the hook is installed on demand); its one host sync is on that path alone, and
        the runner synchronises the sampled ids right after anyway."""
        bad = (sampled < 0) | (sampled >= self.vocab_size)
        if not bool(bad.any()):
            return
        rows = bad.reshape(len(bad), -1).any(dim=1).nonzero().flatten().tolist()
        forced, kept = sampled.reshape(len(bad), -1)[:, 0].tolist(), drawn.reshape(len(bad), -1)[:, 0].tolist()
        sampled.copy_(torch.where(bad, drawn, sampled))
        req_ids = self.step.layout.req_ids if self.step is not None else []
        for row in rows:
            state = self.invokes.get(req_ids[row]) if row < len(req_ids) else None
            if state is not None:
                state.fail(error_record(ValueError(
                    f"m.samples forced token id {forced[row]}, outside the vocabulary: valid ids are 0 to "
                    f"{self.vocab_size - 1}. The sampled token {kept[row]} was kept and this invoke was "
                    "stopped; force an id in range(vocab size)"), where="samples"))

    # --- services for programs (called from a program the engine switched in) -------------------

    def save(self, ctx: CallContext, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            self._save_rows(ctx.invokes, ctx.members.slots, [(name, value)], *_split_rows(ctx, value, "save"))
            return
        if isinstance(value, torch.Tensor):  # a scalar: kept whole (a batched call needs rows)
            _split_rows(ctx, value, "save")
            value = value.detach().to("cpu", copy=True)
        for inv in ctx.invokes:
            inv.saves.setdefault(name, []).append(value)

    def _save_rows(self, invokes: list[InvokeState], slots: np.ndarray, named: list[tuple[str, torch.Tensor]],
                   starts: np.ndarray, stops: np.ndarray, fresh: bool = False) -> None:
        """Record each ``(name, value)`` once for the whole group (invoke i owns rows
        ``starts[i]:stops[i]`` of every value); ``fresh``: copies made for this save (an op's
        gathered rows), kept without another copy.

        The engine never waits here: rows stay on the device or are copied asynchronously (see
        saves.py). Every TP rank checks the limit, so an over-limit save fails the same way
        everywhere; only the rank that reports keeps the rows.
        """
        row_bytes = sum(math.prod(value.shape[1:]) * value.element_size() for _name, value in named)
        used = self.slots.save_used[slots] + (stops - starts) * row_bytes
        over = used > self.slots.save_limit[slots]
        if over.any():
            inv = invokes[int(np.flatnonzero(over)[0])]
            raise MemoryError(
                f"saves of trace {inv.trace} invoke {inv.invoke} exceed the limit of "
                f"{_human_bytes(inv.max_save_bytes)} (raise max_save_bytes, or save less: "
                "e.g. m.last(x) or a reduction)"
            )
        self.slots.save_used[slots] = used
        if self.rank["tp_rank"] == 0:
            self.ledger.add(invokes[0].trace, named, slots, starts, stops, fresh)
            self._reserve_ahead(invokes[0], len(named[0][1]) * row_bytes)

    def share(self, ctx: CallContext, name: str, value: Any, merge: str) -> None:
        if isinstance(value, torch.Tensor):
            starts, stops = _split_rows(ctx, value, "share")
            if self.rank["tp_rank"] != 0:  # only TP rank 0 reports
                return
            rows, ready, _ = host_copy(value)
            parts = [HostRows(rows, ready, a, b) for a, b in zip(starts.tolist(), stops.tolist())]
        elif len(ctx.invokes) == 1:
            parts = [value]
        else:
            raise ValueError(f"share() in a batched call over {len(ctx.invokes)} invokes needs a tensor to split per invoke")
        for inv, part in zip(ctx.invokes, parts):
            inv.shared.append((name, merge, part))

    def send(self, ctx: CallContext, name: str, value: Any) -> None:
        trace = ctx.invokes[0].trace
        self.step.mailbox[(trace, name)] = value

    def recv(self, ctx: CallContext, name: str, call: ProgramCall) -> Any:
        """The value sent as ``name`` in this step (the view makes this one access of the call)."""
        key = (ctx.invokes[0].trace, name)
        if key in self.step.mailbox:
            return self.step.mailbox[key]
        return call.wait_at(Point(MAILBOX, name))  # resumed by _pump once someone sends it

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
                return call.wait_at(Point(module, f"param:{name}"))  # a gather: once the ranks agree (_settle)
            return ReadOnlyTensor.of(self.tp.full_parameter(module, name))
        return call.wait_at(Point(module, f"param:{name}"))  # a later stage reads it

    def _pump(self, step: Step) -> None:
        """Resume receivers whose value has been sent, until nothing more can move."""
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
                    self._after_resume(call, ctx)
                    moved = True

    def _unreached(self, call: ProgramCall) -> str:
        point = call.waiting_for
        after = call.view._current or "the start of the step"
        if point.kind.startswith("param:"):
            return (
                f"{short_name(point.module)}.{point.kind[6:]} belongs to an earlier pipeline stage, and "
                f"this program read it after {after}, which runs on a later stage. Read parameters "
                "before the first access to a later layer's point (they are then carried along)"
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


# --- helpers --------------------------------------------------------------------------------------


def _continues(last: BatchLayout, layout: BatchLayout) -> bool:
    """Whether ``layout`` is ``last`` one step on: the same requests in the same rows, each
    starting where it stopped (a decoding batch; a preempted and resumed request does not)."""
    starts = last.row_starts  # compared as bytes: a tenth of the time of array comparisons (both int64)
    return (layout.req_ids == last.req_ids and layout.row_starts.tobytes() == starts.tobytes()
            and layout.first_positions.tobytes() == (last.first_positions + (starts[1:] - starts[:-1])).tobytes())


def _report_of(state: InvokeState, stage: int) -> dict:
    return {"trace": state.trace, "invoke": state.invoke, "stage": stage, "saves": {},
            "shared": state.shared, "error": state.error}


def _reserve(sink: str, trace: str, stage: int, nbytes: int) -> None:
    """On the reporter thread, while the trace runs: its report data file ``nbytes`` long."""
    try:
        open_sink(sink).reserve(trace, stage, nbytes)
    except OSError:  # e.g. no room now: the report tries again, and fails with the reason if it must
        pass


@dataclass
class _HeldReports:
    """Finished invokes of one trace whose reports wait for the rest of it (Interleaver._report)."""

    since: float  # when the first of them finished
    states: list[InvokeState] = field(default_factory=list)


def _write_reports(sink: str, trace: str, stage: int, reports: list[dict], taken: TakenSaves,
                   objects: list[dict[str, list]], last: bool) -> None:
    """On the reporter thread: write one batch of reports, then let the saves' host memory be
    reused (the reports hold copies of it); after the trace's last batch, close its data file."""
    try:
        _write_batch(sink, trace, stage, reports, taken, objects)
    finally:
        taken.release()
        if last:
            open_sink(sink).close(trace, stage)


def _write_batch(sink: str, trace: str, stage: int, reports: list[dict], taken: TakenSaves,
                 objects: list[dict[str, list]]) -> None:
    """Assemble the saves into one batch file. If the batch cannot be written (e.g. an
    unpicklable save), each report is written alone, and those that still fail carry the error
    instead of their saves."""
    try:
        for report in reports:
            report["shared"] = [(name, how, v.get() if isinstance(v, HostRows) else v)
                                for name, how, v in report["shared"]]
        with open_sink(sink).batch(trace, stage) as batch:  # rows are gathered straight into the file
            def write_header(results: list[dict]) -> None:  # while the rows are still on their way
                for report, rows, values in zip(reports, results, objects):
                    report["saves"] = _with_objects(rows, values)
                batch.finish(reports)

            taken.assemble(batch.allocate, meanwhile=write_header)
        return
    except Exception as exc:  # noqa: BLE001
        batch_error = error_record(exc, where="reporting results")
    for report in reports:
        try:
            open_sink(sink).write(trace, stage, [report])
        except Exception as exc:  # noqa: BLE001
            record = error_record(exc, where="reporting results") if report["saves"] else batch_error
            report.update(saves={}, shared=[], error=report["error"] or record)
            open_sink(sink).write(trace, stage, [report])


def _with_objects(rows: dict[str, Any], objects: dict[str, list]) -> dict[str, Any]:
    """An invoke's saves: its rows by name, plus values that are not rows (one value, or a list
    when saved at several steps)."""
    for name, values in objects.items():
        if name in rows:
            raise TypeError(f"save({name!r}) got both tensors with rows and other values; use two names")
        rows[name] = values[0] if len(values) == 1 else values
    return rows


def _human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it at 1 or more ("64 KiB", "1.5 GiB")."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.4g} {unit}"
        n /= 1024


def _path_code(call: ProgramCall) -> float:
    """A call's state as one number that ranks taking the same path compute alike: what it waits
    for next (or that it is done), whether it failed, how many writes it made (float64 holds it
    exactly: under 2**46)."""
    if call.stopped:  # stopped alike on every rank (its ranks went different ways): no longer compared
        return -1.0
    point = call.waiting_for
    where = 0 if call.done else 1 + zlib.crc32(f"{point.module}\0{point.kind}".encode())  # stable across processes
    return float((((where << 1) | (call.error is not None)) << 12) | (call.writes & 0xFFF))


def _path_words(call: ProgramCall) -> str:
    state = "finished" if call.done else f"waits for {call.waiting_for}"
    failed = " after failing" if call.error is not None else ""
    return f"{state}{failed} with {call.writes} writes"


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


def _split_rows(ctx: CallContext, value: torch.Tensor, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Each invoke's rows ``starts[i]:stops[i]`` of a call's tensor (by token rows, or one row
    per invoke)."""
    n = len(ctx.invokes)
    if n == 1:
        return np.zeros(1, np.int64), np.array([value.shape[0] if value.dim() else 1], np.int64)
    if value.dim() >= 1:
        if value.shape[0] == ctx.num_rows:
            return ctx.local_starts, ctx.local_stops
        if value.shape[0] == n:  # one row per invoke, kept 2-D as a single invoke's call would
            return np.arange(n, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64)
    raise ValueError(
        f"{what}() in a batched call over {n} invokes needs a tensor whose first dim is the "
        f"call's {ctx.num_rows} token rows or its {n} invokes (got shape {tuple(value.shape)})"
    )


def _op_on_device(op: dict, device: torch.device) -> dict:
    """The op with its vector on the model's device, once per plan: a host-to-device copy at
    every step would make the engine wait for the GPU (pageable memory)."""
    if isinstance(op.get("value"), torch.Tensor):
        op = {**op, "value": op["value"].to(device)}
    return op


def _on_device(program: Any, device: torch.device) -> Any:
    """Move tensors a program captured (closure cells, module-level globals shipped with it) to
    the model's device, once per program, so ``resid += vector`` works with a CPU-made vector."""
    if device.type == "cpu":
        return program
    for cell in getattr(program, "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, torch.Tensor):
                cell.cell_contents = cell.cell_contents.to(device)
        except ValueError:  # an empty cell
            pass
    code = getattr(program, "__code__", None)
    globals_ = getattr(program, "__globals__", {})
    for name in code.co_names if code is not None else ():
        if isinstance(globals_.get(name), torch.Tensor):
            globals_[name] = globals_[name].to(device)
    return program
