"""The interleaver: runs every invoke's program and ops alongside vLLM's forward pass.

Lifecycle, one visible place per phase (called by :mod:`interlace.workers.runner_hooks`), and the
modules that do each phase's work:

    admit(new requests)        parse each request's payload (first scheduling only); its state:
                               InvokeState (states.py)
    begin_step(layout)         map rows to invokes, group invokes into calls, collect ops
                               (step_schedule.py: StepScheduler), start programs
    on_point(...)              at each hooked module: ops, then programs in invoke order, their
                               writes written back (dispatch.py: PointDispatcher); under TP the
                               ranks agree on each call's next move first (tp_agreement.py)
    end_step()                 close the step's calls; failures become records, never exceptions;
                               under TP the ranks agree on time-outs (tp_agreement.py)
    finish(finished ids)       report saves, shared contributions and errors (reports.py:
                               ReportBatcher, then the reporter thread); drop state

While a program runs it calls back on the interleaver for saves, messages and parameters
(program_services.py: ProgramServices, through its CallContext); per-step state (Scheduled,
CallContext, Step) lives in states.py.

Nothing here raises into vLLM: a failing program fails its invokes and the step goes on.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

import cloudpickle
import numpy as np
import torch

from interlace.core import settings
from interlace.workers.calls import WATCHDOG, ProgramCall, error_record
from interlace.workers.dispatch import PointDispatcher
from interlace.workers.flight import entry_for
from interlace.workers.greenlets import make_room, run_shallow
from interlace.workers.hooks import HookSet, hook_of
from interlace.workers.layout import BatchLayout
from interlace.workers.ops import OpOrder, applied_bit, selected_nothing
from interlace.workers.pipeline import HERE, LATER, Carried, StageMap
from interlace.workers.points import MAILBOX, ModuleTree, Rows
from interlace.workers.printed import capture as capture_printed
from interlace.workers import program_settings
from interlace.workers.program_copies import Loaded
from interlace.workers.program_services import ProgramServices
from interlace.workers.prologue import prologue_of
from interlace.workers.reporter import Reporter
from interlace.workers.reports import ReportBatcher
from interlace.workers.saves import SaveLedger
from interlace.workers.sink import parked_path
from interlace.workers.slots import SlotTable
from interlace.workers.states import CallContext, InvokeState, Step
from interlace.workers.step_schedule import StepScheduler
from interlace.workers.tensor_parallel import TensorParallelLayout
from interlace.workers.tp_agreement import agree_on_time
from interlace.workers.view import ProgramView
from interlace.workers.write_log import WriteBook

PAYLOAD_KEY = "interlace"
logger = logging.getLogger("interlace")
_UNREAD = object()  # Interleaver._start_calls: a prologue not read yet this step


class Interleaver(ProgramServices):
    vocab_size = 1 << 62  # set by the runner adapter: forced samples must lie in [0, vocab_size)

    def __init__(self, model: torch.nn.Module, samples_slot, rank_info: dict, all_modules: list[str],
                 hidden_size: int, agree_max: Callable[[np.ndarray], np.ndarray] | None = None):
        """``all_modules``: module names of the whole model (every pipeline stage's, so programs
        resolve the same paths everywhere); ``rank_info``: tp_rank, tp_size, pp_rank, pp_size;
        ``agree_max``: under TP > 1, the element-wise max of an array over the TP group (from the
        runner adapter). Programs' paths and time-outs are then decided where every rank agrees
        (see calls.py and tp_agreement.py)."""
        self.tree = ModuleTree(model, all_modules)
        self.rank = rank_info
        self.stages = StageMap(self.tree.local, rank_info["pp_rank"], rank_info["pp_size"], self.tree.embeddings)
        self.tp = TensorParallelLayout(self.tree.modules, rank_info["tp_rank"], rank_info["tp_size"], hidden_size)
        self.invokes: dict[str, InvokeState] = {}
        self.output_counts: dict[str, int] = {}  # request id -> tokens it returned, once finished (scheduler.py)
        self.step: Step | None = None
        self.carry_in: dict[str, Carried] = {}  # from the previous pipeline stage, this step
        self.hooks = HookSet(self.tree, samples_slot, self._on_point)
        self.op_plans = OpOrder()  # the live invokes' ops as plans, by hook, each invoke's in its order
        self.ledger = SaveLedger()
        self.device = next(model.parameters()).device
        self.reporter = Reporter(self.device)
        program_settings.install(WATCHDOG)  # once per process: profilers refused, generators kept apart
        make_room()  # once per process: programs recurse as deep as a script
        self.slots = SlotTable()
        self.graph_steps: dict[str, int] | None = None  # a compiled engine's steps by kind (graphs.py)
        self.taps = getattr(model, "_interlace_taps", None)  # graph taps built in at load (taps.py)
        self.tap_step = False  # set before each step: this step's ops run through taps
        # A step whose programs and ops run at the taps, between graph pieces (graphs.py): set
        # before each step where the engine can (``pieces_ok``, set by the runner adapter).
        self.piece_step = False
        self.pieces_ok = False
        self._off_pieces: set[str] = set()  # live invokes that keep a step off the pieces (runs_between_pieces)
        self.tap_steps = 0
        self.piece_steps = 0  # steps whose programs and ops ran at the taps (between graph pieces)
        self._said_untapped = False
        self._untapped: set[str] = set()  # live invokes whose steps run eager (see runs_on_taps)
        self.loaded = Loaded()  # the live invokes' programs and ops, loaded once per key (program_copies.py)
        self.book = WriteBook(self.slots, settings.replay_log_bytes(), self.device)  # programs' writes (write_log.py)
        self.write_logs = {"kept": 0, "skipped": 0}  # program invokes with a write log, and without (never preempted)
        self.save_counts = {"held": 0, "at_once": 0}  # programs' tensor saves held to their step's end, or not
        # The phases' collaborators, sharing the state above (see the module's docstring)
        self.scheduler = StepScheduler(self.invokes, self.slots, self.op_plans)
        self.dispatcher = PointDispatcher(self.tree, self.tp, self.stages, self.hooks, self.taps, self.slots,
                                          self._save_rows, self.save_tapped, agree_max, self.book,
                                          self.at_taps if self.taps is not None else None)
        self.reports = ReportBatcher(self.ledger, self.slots, self.reporter, rank_info["pp_rank"])

    @property
    def active(self) -> bool:
        return bool(self.invokes)

    @property
    def agree_max(self) -> Callable[[np.ndarray], np.ndarray] | None:
        """The TP group's max (None below TP 2), fixed at construction: read-only, so that it
        cannot change here without the dispatcher's agreement rounds seeing it."""
        return self.dispatcher.agree_max

    # --- per request --------------------------------------------------------------------------

    def admit(self, req_id: str, prompt_len: int, payload_bytes: bytes, may_be_preempted: bool = True) -> None:
        """A new intervened request; ``may_be_preempted``: False where the scheduler knows vLLM
        never will (scheduler.py): its program keeps no write log."""
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
            slots=self.slots,
        )
        self.invokes[req_id] = state
        self._untapped.add(req_id)  # until its ops are known to run in graph taps (runs_on_taps)
        self.scheduler.end_epochs()  # a new invoke starts a new epoch
        try:
            state.ops = self.loaded.ops(payload["ops_key"], lambda: self._load_ops(payload), state.keys)
            if payload["program_key"] is not None:
                key = payload["program_key"]
                state.group_key = f"{state.trace}/{key}" if payload.get("batched") else req_id
                # unpickling (and pickling again for copies) runs the program's own code too
                # (__reduce__, module-level statements)
                flight = entry_for(state.sink, state.trace, state.invoke, state.timeout_s)
                if flight is not None:
                    flight.enter()
                try:
                    state.program = self.loaded.program(
                        key, state.trace, bool(payload.get("batched")), state.keys,
                        lambda: _on_device(cloudpickle.loads(_part(payload, "program", key)), self.device))
                finally:
                    if flight is not None:
                        flight.leave()
                state.flight = flight  # (the recorder's one entry for this invoke)
                if self.book.limit > 0 and may_be_preempted:
                    state.writes = self.book.open(state.slot)
                    self.write_logs["kept"] += 1
                elif self.book.limit > 0:
                    self.write_logs["skipped"] += 1
                    state.unlogged = ("it started where KV-cache pressure could never preempt it; vLLM preempted it "
                                      "anyway, e.g. resetting the prefix cache")
                self.slots.group[state.slot] = self.scheduler.group_number(state.group_key)
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
        # Between graph pieces only the taps (and logits and samples, outside the model) are
        # served. A program's points are known only once it ran: its first step runs eager, and
        # its later ones between pieces if that step read and wrote nothing else (end_step).
        state.ops_at_taps = self.taps is not None and all(self.at_taps(op["_point"]) for op in state.ops if "_point" in op)
        if state.error is None and not (state.ops_at_taps and state.program is None):
            self._off_pieces.add(req_id)

    def at_taps(self, point) -> bool:
        """Whether a step between graph pieces serves ``point`` on every stage: a declared tap
        (a layer's output is its resid tap's pair), logits, samples, a message or a parameter."""
        if point.kind in ("logits", "samples") or point.module == MAILBOX or point.kind.startswith("param:"):
            return True
        if point.kind == "output" and self.tree.is_layer(point.module):
            return (point.module, "resid") in self.taps.declared
        return (point.module, point.kind) in self.taps.declared

    def runs_between_pieces(self, req_ids) -> bool:
        """Whether a step of these requests runs its programs and ops at the taps (every
        intervened one can). Decided from what every rank of a stage saw alike: admission, and
        the points programs waited for (agreed under TP)."""
        return self.pieces_ok and not any(r in req_ids for r in self._off_pieces)

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
        if self.reports.held:
            self.reports.submit_held()
        finished = [state for state in map(self.invokes.pop, req_ids, [None] * len(req_ids)) if state]
        if finished:
            self.scheduler.end_epochs()
            self.book.close([state.writes for state in finished if state.writes is not None])
        for state in finished:
            self._untapped.discard(state.req_id)
            self._off_pieces.discard(state.req_id)
            self.hooks.release(owner=state.req_id)
            for op in state.tapped or ():
                self.taps.let_go(op)
        if self.output_counts:
            returned = {req_id: self.output_counts.pop(req_id, None) for req_id in req_ids}
            for state in finished:
                self._keep_returned_steps(state, returned[state.req_id])
        if finished and self.op_plans:
            self.op_plans.drop({id(state) for state in finished})
            self._fail_unapplied_ops(finished)
        for state in finished:
            if state.steps is not None and state.program is not None and state.error is None:
                self._check_steps_ran(state)
        if finished and self.rank["tp_rank"] == 0:  # one report per TP group; every PP stage reports
            # their slots are given back once the ledger lets go of their rows
            self.reports.report(finished, self.invokes.values())
        else:
            for state in finished:
                self.slots.remove(state.slot)
        if finished:
            self.scheduler.keep_groups(self.invokes.values())
        for state in finished:
            self.loaded.let_go(state.keys)
        if not self.invokes:  # (none left: nothing of a failed admission stays either)
            self.loaded.clear()

    def _load_ops(self, payload: dict) -> list[dict]:
        ops = cloudpickle.loads(_part(payload, "ops", payload["ops_key"]))
        for op in ops:
            op["_point"] = self.tree.op_point(op["point"])
        return ops

    def _keep_returned_steps(self, state: InvokeState, returned: int | None) -> None:
        """Keep only what the invoke's program and ops did at the steps whose tokens vLLM returned.

        Under asynchronous scheduling (vLLM's default on GPUs; not on CPUs) the engine plans a
        request's next step before the token of its current one is known, so a request whose
        token k is EOS or a stop token still runs step k (the step fed with that token): its
        saves, shared values, errors and ``steps`` check would count a step the user never sees
        (a fifth logits row for four tokens). vLLM drops that step's token; the scheduler
        (scheduler.py) tells how many tokens the request returned, and its steps 0 .. returned-1
        are kept: saved rows past them are left out of the report (SaveLedger.take), other
        values, shared contributions and an error met past them dropped here. Dropping them after the fact, rather than
        turning asynchronous scheduling off, keeps vLLM's overlap of scheduling and the GPU's
        work for every request, and costs nothing per step. ``returned``: None where vLLM did
        not say (the invoke keeps what it did)."""
        if returned is None:
            return
        last = returned - 1
        if int(self.slots.next_position[state.slot]) - state.prompt_len > last:  # it ran past its last token
            self.slots.last_step[state.slot] = last
            state.keep_steps_to(last)

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
        last = min(int(self.slots.next_position[state.slot]) - state.prompt_len,  # the last step run
                   int(self.slots.last_step[state.slot]))  # and whose token was returned
        missed = sorted(step for step in state.steps if step > last)
        if missed:
            ran = f"steps 0 to {last} ran" if last >= 0 else "no step ran"
            state.fail(error_record(RuntimeError(
                f"the program was given steps={sorted(state.steps)}, but generation ended before "
                f"steps {missed} ({ran}: max_tokens, EOS or a stop string ended it), so the program "
                "never ran there; ask for steps below max_tokens, or pass ignore_eos=True"), where="end of generation"))

    # --- per step ------------------------------------------------------------------------------

    def begin_step(self, layout: BatchLayout) -> None:
        scheduler = self.scheduler
        scheduled = scheduler.schedule(layout)
        memo = scheduler.memo(scheduled.epoch)
        groups, failed = scheduler.program_groups(scheduled, memo)
        if failed:  # prompts a program cannot see whole: no ops for them either
            scheduled = scheduled.pick(np.array([j for j, s in enumerate(scheduled.states) if s.error is None], np.int64))
        ops = scheduler.step_ops(scheduled, memo, reuse=not failed)
        self.step = Step(layout, [], ops, memo=memo)
        self.held_total = 0  # no call holds a save yet (a step that never ended lost its held ones)
        if (scheduled.firsts < scheduled.replay_until).any():  # rows recomputed after a preemption
            self.step.replays = self._replays(scheduled)
        if self.tap_step:  # every op runs inside the forward, from the taps' buffers: no hook applies one
            self.taps.fill(ops, memo)
            self.step.ops = {}
            self.step.tapped = scheduler.saves_in(ops, memo)
            self.tap_steps += 1
        elif self.piece_step:  # the tap ops call back between graph pieces: programs and ops run there
            self.taps.serve, self.taps.served = self._on_tap, 0
            self.piece_steps += 1
        carry_in, self.carry_in = self.carry_in, {}
        mail = carry_in.pop(MAILBOX, None)  # sent on earlier stages: a receiver may wait for it here
        if mail is not None:
            self.step.mailbox.update({(trace, name): value for trace, name, value in mail.values})
        calls = memo.get("calls") if not carry_in and groups is memo.get("groups") else None
        if calls is not None:
            self._again(calls, memo)
        else:
            self._build_calls(groups, carry_in, memo)
        if self.step.calls:
            capture_printed(WATCHDOG)
            run_shallow(self._start_calls, self.step)

    def _start_calls(self, step: Step) -> None:
        """Run each of the step's programs to its first wait (in the hub: greenlets.run_shallow), or
        leave it unstarted where its first point is known without running it (prologue.py): the
        hook there starts it (PointDispatcher._deliver)."""
        # A program per invoke is one function for all its calls: its prologue's values are read
        # once, until a program runs (its code may change them)
        values: dict = {}
        for call, ctx in step.calls:
            prologue = call.prologue
            if prologue is not None:
                inputs = values.get(prologue, _UNREAD)
                if inputs is _UNREAD:
                    inputs = values[prologue] = prologue.values()
                if inputs is not None and inputs == call.last_inputs and call.last_first is not None:
                    call.unstarted, call.waiting_for = True, call.last_first
                    continue
                call.last_inputs = inputs
            values.clear()
            call.start()
            self.dispatcher.after_resume(call, ctx)
            self.dispatcher.pump(step)
        self.dispatcher.settle(step)

    def _build_calls(self, groups: dict, carry_in: dict, memo: dict) -> None:
        """A call per group, in invoke order; kept for the epoch's next steps where they can be
        reused (no carry from an earlier pipeline stage, the same groups: see _again)."""
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
            first = members.states[0]
            call = ProgramCall(first.program, view, budget_s=ctx.timeout_s,
                               limit_s=first.timeout_s, replay=carried.values if carried is not None else None,
                               replay_points=carried.points if carried is not None else None,
                               keep_log=not self.stages.last, local_limits=self.agree_max is None,
                               flight=first.flight)
            if self.agree_max is None and call.log is None and not call.replaying:  # one rank, one stage
                call.prologue = prologue_of(first.program)
            object.__setattr__(view, "_call", call)
            self.step.calls.append((call, ctx))
        self.step.calls.sort(key=lambda c: (c[1].invokes[0].trace, c[1].invokes[0].invoke))
        if not carry_in and groups and groups is memo.get("groups"):
            memo["calls"] = list(self.step.calls)
            memo["call slots"] = np.fromiter((ctx.members.slots[0] for _call, ctx in self.step.calls), np.int64)

    def _again(self, calls: list, memo: dict) -> None:
        """The epoch's calls one step on: the same programs over the same invokes and rows, each
        call, context and view reset rather than built (ProgramCall.again)."""
        budgets = self.slots.time_left[memo["call slots"]].tolist()
        for (call, ctx), budget in zip(calls, budgets):
            ctx.again(budget)
            call.again(budget)
        self.step.calls = list(calls)

    def _replays(self, scheduled) -> dict:
        """The logged program writes to put back on rows this step recomputes after a preemption,
        by hook (write_log.py): one write per point for every recomputed request. Their hooks are
        wanted again (the program may read elsewhere now)."""
        recomputed = [j for j in np.flatnonzero(scheduled.firsts < scheduled.replay_until).tolist()
                      if scheduled.states[j].writes is not None and scheduled.states[j].error is None]
        if not recomputed:
            return {}
        index = np.array(recomputed, np.int64)
        states = [scheduled.states[j] for j in recomputed]
        firsts, starts = scheduled.firsts[index], scheduled.starts[index]
        stops = np.minimum(firsts + scheduled.stops[index] - starts, scheduled.replay_until[index])
        ids = np.fromiter((state.writes.id for state in states), np.int64, len(states))
        by_hook: dict = {}
        for point, rows, value, which in self.book.replay(ids, firsts, stops, starts):
            owners = [states[k] for k in which.tolist()]
            for state in owners:
                self.hooks.want(point, owner=state.req_id)
            by_hook.setdefault(hook_of(point), []).append(
                (point, Rows.at(rows, self.device), value, owners))
        return by_hook

    def end_step(self) -> dict[str, Carried]:
        """Close the step's calls; returns what the next pipeline stage needs to go on."""
        step = self.step
        if step is None:
            return {}
        if self.taps is not None:
            self.taps.serve = None
        if step.tapped:
            self.dispatcher.take_tapped(step.tapped, step.memo)
        if self.agree_max is not None and step.calls:
            agree_on_time(step, self.agree_max)
        if any(not call.done for call, _ctx in step.calls):  # some switch into their programs
            run_shallow(self._stop_calls, step)
        else:
            self._stop_calls(step)
        for call, ctx in step.calls:
            if ctx.held_saves:
                try:
                    self.flush_saves(ctx)
                except Exception as exc:  # noqa: BLE001 - past a limit with the step's other saves
                    call.error = call.error or error_record(exc, where=ctx.step_words())
        self.dispatcher.close_calls(step.calls)
        for call, ctx in step.calls:
            call.release()
            if not self.piece_step and call.error is None:
                self._learned(ctx)
        if step.mailbox and not self.stages.last:  # for receivers that wait on a later stage
            step.carry[MAILBOX] = Carried("mailbox", [(trace, name, value) for (trace, name), value in step.mailbox.items()])
        self.step = None
        return step.carry

    def _stop_calls(self, step: Step) -> None:
        """The step is over for its programs: suspend those whose next access a later pipeline
        stage serves, cancel those waiting for what never came, and note what the next stage
        needs of each (Carried)."""
        for call, ctx in step.calls:
            if ctx.holds.late:  # a program stopped or suspended here may have edited one still
                self.dispatcher.refuse_late_edits(call, ctx)
            if not call.done and self._goes_on_later(call):
                log = call.log
                call.suspend()
                step.carry[ctx.key] = Carried("suspended", log, points=call.log_points)
            else:
                if call.waiting_for is None:  # never started: the step's start failed (runner_hooks._guard)
                    call.cancel("interlace's start of the step failed before this program started")
                elif not call.done and call.waiting_for.module == MAILBOX:
                    call.cancel(self._unsent(ctx, call.waiting_for.kind))
                elif not call.done:
                    call.cancel(self._unreached(call))
                if not self.stages.last:
                    step.carry[ctx.key] = Carried("failed" if call.error else "finished", error=call.error)

    def _learned(self, ctx: CallContext) -> None:
        """A program ran a step eager: if it waited only at points served between graph pieces
        (dispatch marks the others), its invokes' later steps may run there."""
        for state in ctx.invokes:
            if state.req_id in self._off_pieces and state.ops_at_taps and not state.off_taps and state.error is None:
                self._off_pieces.discard(state.req_id)

    def _goes_on_later(self, call: ProgramCall) -> bool:
        """Waiting for a point a later pipeline stage owns (or, before the last stage, for a
        value another invoke may still send there)."""
        point = call.waiting_for
        if self.stages.last or point is None:  # (None: it never started, see _stop_calls)
            return False
        return point.module == MAILBOX or self.stages.where(point) == LATER

    # --- at a hooked module (engine thread) ----------------------------------------------------

    def _on_point(self, module: str, family: str, hooked: Any) -> Any:
        """Run ops and programs waiting at ``module``; returns the (possibly rewritten) value."""
        if self.piece_step and family not in ("logits", "samples"):
            return hooked  # served by the taps (_on_tap) in such a step, as in compiled code
        return self._dispatch(module, family, hooked, copies=False)

    def _on_tap(self, module: str, value: Any) -> None:
        """At a tap, in a step between graph pieces: ``value`` lives in CUDA-graph memory that the
        next replay overwrites, so programs get copies, and writes go back into it in place
        (points.TapAccess)."""
        if (module, "output") in self.hooks.wanted:
            self._dispatch(module, "output", value, copies=True)

    def _dispatch(self, module: str, family: str, hooked: Any, copies: bool) -> Any:
        step = self.step
        if step is None:
            return hooked
        try:
            return self.dispatcher.dispatch(step, module, family, hooked, copies)
        except Exception as exc:  # noqa: BLE001 - an internal error fails this step's invokes only
            record = error_record(exc, where=f"interlace internals at {module or family}")
            for call, ctx in step.calls:
                call.error = call.error or record
            for at_hook in step.ops.values():
                for _point, step_op in at_hook:
                    for inv in step_op.invokes:
                        inv.fail(record)
            return hooked

    # --- after sampling (engine thread) -------------------------------------------------------

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


# --- helpers --------------------------------------------------------------------------------------


def _op_on_device(op: dict, device: torch.device) -> dict:
    """The op with its vector on the model's device, once per plan: a host-to-device copy at
    every step would make the engine wait for the GPU (pageable memory)."""
    if isinstance(op.get("value"), torch.Tensor):
        op = {**op, "value": op["value"].to(device)}
    return op


def _on_device(program: Any, device: torch.device) -> Any:
    """Move tensors a program captured (closure cells, module-level globals shipped with it) to
    the model's device, once per program, so ``resid += vector`` works with a CPU-made vector.
    Functions it captured are followed too (``interlace.batched(lambda m: steer(m))`` holds the
    vector in ``steer``'s closure), each once."""
    if device.type == "cpu":
        return program
    seen: set[int] = set()
    stack = [program]
    while stack:
        fn = stack.pop()
        if id(fn) in seen or not callable(fn):
            continue
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.Tensor):
                cell.cell_contents = value.to(device)
            elif inspect.isfunction(value):
                stack.append(value)
        code = getattr(fn, "__code__", None)
        globals_ = getattr(fn, "__globals__", {})
        for name in code.co_names if code is not None else ():
            value = globals_.get(name)
            if isinstance(value, torch.Tensor):
                globals_[name] = value.to(device)
            elif inspect.isfunction(value) and getattr(value, "__module__", None) == getattr(fn, "__module__", None):
                stack.append(value)  # a helper shipped with the program (its own module's)
    return program


def _part(payload: dict, part: str, key: str) -> bytes:
    """A payload's program or ops bytes: in the request, or parked once in its trace's folder
    (cluster/assembly.py; workers/sink.py)."""
    if payload.get(f"{part}_parked"):
        return parked_path(payload["sink"], payload["trace"], part, key).read_bytes()
    return payload[part]
