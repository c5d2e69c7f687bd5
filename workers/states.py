"""Per-invoke and per-step state of the interleaver (interleaver.py): records, with only the
small helpers that read them (the phases that act on them live in their own modules).

    InvokeState   one intervened request on this rank, from admission to its report
    Scheduled     this step's live invokes, in batch order, as arrays (step_schedule.py builds it)
    CallContext   one program call's slice of the step: its invokes and rows (read by view.py)
    Step          everything the current step needs: its calls, ops by hook, mailbox, carry
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from interlace.workers.calls import ProgramCall
from interlace.workers.holds import Holdings
from interlace.workers.layout import BatchLayout
from interlace.workers.ops import StepOp
from interlace.workers.pipeline import Carried
from interlace.workers.points import ModuleTree, Point, Rows, device_index
from interlace.workers.printed import Printed
from interlace.workers.slots import SlotTable
from interlace.workers.write_log import WriteLog

if TYPE_CHECKING:
    from interlace.workers.interleaver import Interleaver


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
    save_steps: dict[str, list[int]] = field(default_factory=dict)  # the step of each of those values
    shared: list[tuple[str, str, Any]] = field(default_factory=list)
    shared_steps: list[int] = field(default_factory=list)  # the step of each shared contribution
    error: dict | None = None
    tapped: list[dict] | None = None  # ops that run through graph taps (taps.py): they all do; None: hooks
    ops_at_taps: bool = False  # every op's point is served between graph pieces (Interleaver.at_taps)
    off_taps: bool = False  # its program waited at a point not served there: its steps run eager
    slots: SlotTable | None = None  # the rank's slot table (where its step is), if it has one
    error_step: int = 0  # the generation step it failed at (see keep_steps_to)
    writes: WriteLog | None = None  # its program's writes, replayed if vLLM recomputes it (write_log.py)
    unlogged: str = "INTERLACE_REPLAY_LOG_MIB is 0"  # why a program keeps no write log (with writes None)
    flight: Any = None  # its program's flight recorder entry (flight.py), None if unrecorded
    printed: Printed | None = None  # what its program printed, by step
    keys: list[str] = field(default_factory=list)  # its ops', program's and batched group's keys (program_copies.Loaded.let_go)

    # Invokes failed so far, in this process: a step tells whether any failed since the last one
    # by comparing one number, not by looking at every invoke of the batch.
    failures: ClassVar[int] = 0

    def fail(self, record: dict) -> None:
        if self.error is None:
            self.error = record
            InvokeState.failures += 1
            if self.slots is not None:  # the step scheduled last (its program's, while one runs)
                self.error_step = max(0, int(self.slots.next_position[self.slot]) - self.prompt_len)

    def keep_steps_to(self, last: int) -> None:
        """Drop the values saved and shared after step ``last``, and an error met there (steps
        whose tokens vLLM did not return: see Interleaver.finish). Rows in the ledger are cut
        when taken (slots.last_step)."""
        if self.error is not None and self.error_step > last:
            self.error = None
        for name, steps in list(self.save_steps.items()):
            kept = [value for value, step in zip(self.saves[name], steps) if step <= last]
            if kept:
                self.saves[name], self.save_steps[name] = kept, steps[: len(kept)]
            else:
                del self.saves[name], self.save_steps[name]
        self.shared = [entry for entry, step in zip(self.shared, self.shared_steps) if step <= last]
        self.shared_steps = self.shared_steps[: len(self.shared)]
        if self.printed is not None:
            self.printed.keep_steps_to(last)

    def keep_printed(self, step: int, call_printed: Printed) -> None:
        """A call's printed text (printed.Printed) of step ``step``, kept with this invoke."""
        if self.printed is None:
            self.printed = Printed()
        self.printed.add(step, "".join(text for _step, text in call_printed.pieces), call_printed.dropped)


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

    def live(self) -> "Scheduled":
        """The rows a program runs on: a chunk that recomputes rows after a preemption starts, for
        the program, at the first position it has not run (the rows before get its logged writes)."""
        shift = np.maximum(0, self.replay_until - self.firsts)
        if not shift.any():
            return self
        return Scheduled(self.states, self.slots, self.req_rows, self.starts + shift, self.stops, self.firsts + shift,
                         self.final, self.steps, self.prompt_lens, self.replay_until, self.epoch)

    def part(self, start: int, stop: int) -> "Scheduled":
        """Invokes ``start:stop`` of these, their arrays views of these (see StepScheduler.program_groups)."""
        return Scheduled(self.states[start:stop], self.slots[start:stop], self.req_rows[start:stop],
                         self.starts[start:stop], self.stops[start:stop], self.firsts[start:stop],
                         self.final[start:stop], self.steps[start:stop], self.prompt_lens[start:stop],
                         self.replay_until[start:stop], self.epoch)

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
    wanted: ClassVar[Point | None] = None  # the point its program waited at last, hooked for its invokes (dispatch.after_resume)

    def __post_init__(self):
        self.invokes = self.members.states
        members = self.members
        if len(self.invokes) == 1:  # a program per invoke: 256 calls a step, where each array
            one = members.__dict__.get("one_range")  # operation costs a microsecond: kept for the epoch
            if one is None:
                start = int(members.starts[0])
                one = members.one_range = (int(members.stops[0]) - start, Rows(slice(start, int(members.stops[0]))))
            self.num_rows, self.token_rows = one  # what Rows.of makes of one range
        else:
            self.num_rows = int((members.stops - members.starts).sum())
        self.holds = Holdings()  # what the program read this step, and whether it may still write it
        # Saves held until the step ends (ProgramServices.flush_saves): (name, snapshot, starts,
        # stops), their bytes, and the smallest room left to one of the invokes (None: not looked up)
        self.held_saves: list = []
        self.held_bytes = 0
        self.save_room: int | None = None

    def again(self, timeout_s: float) -> None:
        """The same invokes in the same rows one step on (an epoch's next step, whose members
        advanced in place: see StepScheduler.program_groups): per-step state starts afresh, and
        what depends on the step is computed again when asked for."""
        self.timeout_s = timeout_s
        self.holds.reset()
        if self.held_saves:  # flush_saves takes them (a step that failed may have left some)
            self.held_saves = []
        self.held_bytes, self.save_room = 0, None
        cached = self.__dict__
        for name in _PER_STEP:
            cached.pop(name, None)

    # Built only when asked for (a sweep's call would otherwise build 256 of each per step, and a
    # program per invoke reads none of them on its usual path)

    @functools.cached_property
    def op_saves(self) -> dict[str, str]:
        """The save names of its invokes' declarative ops, with the point each saves: a program's
        save under one of them would be joined with the op's rows (ProgramServices.save)."""
        return {op.get("name") or op["point"]: op["point"] for state in self.invokes for op in state.ops if op["op"] == "save"}

    @functools.cached_property
    def logs(self) -> bool:
        """Whether any of its invokes keeps a write log (write_log.py): a batched call's may
        differ (one past its limit, one that started where vLLM can never preempt it), and those
        that keep one need every write."""
        return any(s.writes is not None and s.writes.replayable for s in self.invokes)

    @functools.cached_property
    def lengths(self) -> np.ndarray:
        return self.members.stops - self.members.starts

    @functools.cached_property
    def local_stops(self) -> np.ndarray:
        """Where invoke j's rows of the values this call reads end (stacked in invoke order)."""
        return np.cumsum(self.lengths)

    @functools.cached_property
    def local_starts(self) -> np.ndarray:
        return self.local_stops - self.lengths

    @functools.cached_property
    def row_per_invoke(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, stops)`` of a value with one row per invoke."""
        n = len(self.invokes)
        return np.arange(n, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64)

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


_PER_STEP = ("logs", "steps", "positions")  # CallContext's cached values that change from step to step


@dataclass
class Step:
    """Per-step state, rebuilt every step."""

    layout: BatchLayout
    calls: list[tuple[ProgramCall, CallContext]]
    ops: dict[tuple[str, str], list[tuple[Point, StepOp]]]  # by hook (see hooks.hook_of): ops to apply there, in order
    mailbox: dict[tuple[str, str], Any] = field(default_factory=dict)
    # who sent each name on this stage (values carried from an earlier stage are not counted:
    # the programs that sent them run here too, and send them again)
    senders: dict[tuple[str, str], int] = field(default_factory=dict)
    # Values sent so far in the step, and as many as the last pump saw: a receiver waits only for a
    # value not yet sent (recv returns one already there), so only a send gives a pump work.
    sent: int = 0
    pumped: int = -1
    carry: dict[str, Carried] = field(default_factory=dict)  # for the next pipeline stage
    tapped: list[tuple[Point, StepOp]] = field(default_factory=list)  # saves that ran in graph taps
    # by hook: logged program writes to put back on rows recomputed after a preemption (write_log.py)
    replays: dict[tuple[str, str], list[tuple[Point, Rows, Any, list[InvokeState]]]] = field(default_factory=dict)
    memo: dict = field(default_factory=dict)  # work shared by the steps of an epoch (StepScheduler.memo)
    times_agreed: bool = False  # under TP: the last path round saw every call done, so its times are final

    def rows_at(self, rows: np.ndarray, device) -> Rows:
        """``Rows.at``, once per epoch for each distinct selection: a sweep saving 4 layers sends
        one index to the GPU when its batch changes, not 4 at every step."""
        known = self.memo.setdefault("rows", {})
        key = rows.tobytes()
        if key not in known:
            known[key] = Rows.at(rows, device)
        return known[key]
