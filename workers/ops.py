"""Declarative operations: interventions as data, applied without running user code.

An op is a plain dict made by :mod:`interlace.ops` on the driver::

    {"op": "add", "point": "layers.3.resid", "value": tensor[hidden], "tokens": "all", "steps": None}

Ops run inline in the module's hook (no program to switch to), and every invoke of a step that carries
the same op (same ``key``) is handled by one indexed tensor operation: a sweep of 256 invokes
steering one layer costs one ``index_add`` per step, not 256 Python calls.

Each invoke's ops at one hook apply in the order it listed them, whatever other invokes share
(:class:`OpOrder`): plans at a hook follow one order consistent with every live invoke's list, and an
op that two invokes list in conflicting orders is split into two plans, one in each place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from interlace.workers.hooks import hook_of
from interlace.workers.points import ROW_PER_REQUEST_KINDS, expand_ranges

OP_KINDS = ("save", "add", "scale", "replace", "zero")


@dataclass
class StepOp:
    """One op at one step, for every invoke that carries it: one tensor operation."""

    op: dict
    invokes: list  # the interleaver's InvokeStates, in batch order
    slots: np.ndarray  # their slots (see slots.py)
    rows: np.ndarray  # absolute rows of the point's tensor (token rows, or requests' logits rows)
    starts: np.ndarray  # invoke i owns rows starts[i]:stops[i] of the gathered value (for saves)
    stops: np.ndarray
    bits: np.ndarray  # each invoke's bit for this op in SlotTable.ops_applied (0: not tracked)
    recorded: bool = False  # its bits are set already (a plan keeps its StepOp for an epoch's steps)


# Epochs (see states.Scheduled) whose per-epoch work is kept. Under pipeline parallelism vLLM
# keeps pp_size + 1 batches in flight and their steps take turns on every stage: keeping only the
# last epoch's would redo each batch's work at every step (bench/stage_probe.py, PP=2, 2026-11-27).
# 8 covers the batches of PP up to 4 with room for the prefill steps between (each its own epoch).
EPOCHS_KEPT = 8

TRACKED_OPS = 63  # an invoke's first ops, each with a bit of an int64 slot column (see applied_bit)


def applied_bit(index: int) -> int:
    """The bit that records that the op at ``index`` of an invoke's list selected some row."""
    return 1 << index if index < TRACKED_OPS else 0


@dataclass
class OpPlan:
    """An op (by content key) and the live invokes carrying it at one place of their lists; a
    sweep shares one plan."""

    op: dict
    key: tuple[str, str] = ("", "")  # (trace, op key); an op listed in conflicting orders has several plans
    members: list = field(default_factory=list)
    _indices: dict[int, int] = field(default_factory=dict, repr=False)  # id(member) -> the op's index in its list
    _is_member: np.ndarray | None = field(default=None, init=False, repr=False)  # by slot; rebuilt on change
    _bits: np.ndarray | None = field(default=None, init=False, repr=False)  # by slot: applied_bit of the member
    # epoch -> its StepOp, for the last few epochs (under PP, vLLM's batches in flight take turns)
    _epoch_steps: dict[int, StepOp | None] = field(default_factory=dict, init=False, repr=False)

    @property
    def point(self):
        return self.op["_point"]

    def add(self, state, index: int = 0) -> None:
        """``index``: where the op stands in the invoke's list (which bit records it)."""
        self.members.append(state)
        self._indices[id(state)] = index
        self._is_member = None
        self._epoch_steps.clear()

    def drop(self, gone: set[int]) -> None:
        """Forget members whose ``id()`` is in ``gone``."""
        self.members = [m for m in self.members if id(m) not in gone]
        self._indices = {id(m): self._indices[id(m)] for m in self.members}
        self._is_member = None
        self._epoch_steps.clear()

    def for_step(self, scheduled) -> StepOp | None:
        """This step's rows for the members among ``scheduled`` (the interleaver's Scheduled:
        this step's live invokes as arrays, in batch order), by array arithmetic; once per
        epoch (same invokes in the same rows) for an op that applies at every step."""
        kept = self._epoch_steps
        if scheduled.epoch in kept:
            return kept[scheduled.epoch]
        step_op = self._for_step(scheduled)
        if self.op.get("steps") is None and self.op.get("tokens", "all") in ("all", "last"):  # rows alone decide
            kept[scheduled.epoch] = step_op
            if len(kept) > EPOCHS_KEPT:  # epochs only grow: the first key is the oldest
                del kept[next(iter(kept))]
        return step_op

    def kept_for(self, epoch: int) -> bool:
        """Whether :meth:`for_step` keeps its StepOp for every step of ``epoch``."""
        return epoch in self._epoch_steps

    def _for_step(self, scheduled) -> StepOp | None:
        if not len(scheduled.slots):
            return None
        size = int(scheduled.slots.max()) + 1
        if self._is_member is None or len(self._is_member) < size:
            slots = [m.slot for m in self.members]
            self._is_member = np.zeros(max([size - 1, *slots]) + 1, dtype=bool)
            self._is_member[slots] = True
            self._bits = np.zeros(len(self._is_member), dtype=np.int64)
            self._bits[slots] = [applied_bit(self._indices[id(m)]) for m in self.members]
        mine = self._is_member[scheduled.slots]
        tokens = self.op.get("tokens", "all")
        per_request = self.point.kind in ROW_PER_REQUEST_KINDS
        replaying = (mine & (scheduled.firsts < scheduled.replay_until)).any()
        if replaying or (not per_request and tokens not in ("all", "last")):  # or given positions
            return self._by_position(scheduled, np.flatnonzero(mine))
        steps = self.op.get("steps")
        if steps is not None:
            mine &= np.isin(scheduled.steps, list(steps))
        if per_request or tokens == "last":  # one row per invoke, once its prompt is done
            mine &= scheduled.final
        index = np.flatnonzero(mine)
        if per_request:
            rows, lengths = scheduled.req_rows[index], np.ones(len(index), np.int64)
        elif tokens == "last":
            rows, lengths = scheduled.stops[index] - 1, np.ones(len(index), np.int64)
        else:
            lengths = scheduled.stops[index] - scheduled.starts[index]
            rows = expand_ranges(scheduled.starts[index], lengths)
        return self._step_op(scheduled, index, rows, lengths)

    def _by_position(self, scheduled, index: np.ndarray) -> StepOp | None:
        """Rows chosen position by position, each by its own generation step (Python per row): for
        ops on given positions, and for a step in which some member recomputes rows computed
        before vLLM preempted it (rare). Those rows get the same edits as the first time; saves
        skip them (already saved)."""
        steps, tokens = self.op.get("steps"), self.op.get("tokens", "all")
        wanted = None if tokens in ("all", "last") else set(tokens)
        per_request = self.point.kind in ROW_PER_REQUEST_KINDS
        saving = self.op["op"] == "save"
        chosen = []
        for i in index.tolist():
            start, stop, first = int(scheduled.starts[i]), int(scheduled.stops[i]), int(scheduled.firsts[i])
            prompt_len, replayed = int(scheduled.prompt_lens[i]), int(scheduled.replay_until[i])
            rows = []
            for row in ([stop - 1] if per_request else range(start, stop)):  # logits/samples: the last row's
                position = first + row - start
                if (per_request or tokens == "last") and position < prompt_len - 1:
                    continue  # only a prompt's last row and generated rows end a step
                if wanted is not None and not per_request and position not in wanted:
                    continue
                if steps is not None and max(0, position - prompt_len + 1) not in steps:
                    continue
                if saving and position < replayed:
                    continue
                rows.append(int(scheduled.req_rows[i]) if per_request else row)
            chosen.append(rows)
        lengths = np.array([len(r) for r in chosen], dtype=np.int64)
        rows = np.array([r for rs in chosen for r in rs], dtype=np.int64)
        return self._step_op(scheduled, index[lengths > 0], rows, lengths[lengths > 0])

    def _step_op(self, scheduled, index: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> StepOp | None:
        if not len(index):
            return None
        stops = np.cumsum(lengths)
        slots = scheduled.slots[index]
        return StepOp(self.op, [scheduled.states[i] for i in index.tolist()], slots, rows, stops - lengths, stops,
                      self._bits[slots])


class OpOrder:
    """The live invokes' ops as plans, per hook, in one order consistent with every invoke's list.

    Built when invokes are admitted (rare); a step walks each hook's plans in order. An invoke's
    ops at a hook are merged into that hook's sequence: each joins the first plan of the same op
    (same trace and key) after the invoke's previous op there, or becomes a new plan right after
    it. Invokes whose lists agree share plans (a sweep: one plan per op, one tensor operation per
    step); where two conflict (A: [x, y], B: [y, x]) x gets a second plan after y, for B. An op
    listed twice by one invoke applies twice, the same way.

        order = OpOrder()
        order.add(state, state.ops, prepare=lambda op: op)   # at admission
        for hook, plans in order.by_hook.items(): ...        # each step, in order
        order.drop({id(state)})                              # when it finishes
    """

    def __init__(self):
        self.by_hook: dict[tuple[str, str], list[OpPlan]] = {}

    def __bool__(self) -> bool:
        return bool(self.by_hook)

    def plans(self):
        """Every plan, hook by hook, each hook's in order."""
        for plans in self.by_hook.values():
            yield from plans

    def add(self, state, ops: list[dict], prepare: Callable[[dict], dict], here: Callable = lambda point: True) -> None:
        """Merge ``state``'s ops (its whole list; those with a resolved ``_point`` that ``here``
        accepts) into the order; ``prepare(op)``: the op as a new plan keeps it (e.g. with its
        vector on the device), once per op key."""
        last_at: dict[tuple[str, str], int] = {}  # hook -> where this invoke's previous op there went
        for index, op in enumerate(ops):
            if "_point" not in op or not here(op["_point"]):
                continue
            hook = hook_of(op["_point"])
            plans = self.by_hook.setdefault(hook, [])
            key = (state.trace, op.get("key", str(id(op))))
            after = last_at.get(hook, -1)
            at = next((i for i in range(after + 1, len(plans)) if plans[i].key == key), None)
            if at is None:
                same = next((plan.op for plan in plans if plan.key == key), None)
                at = after + 1
                plans.insert(at, OpPlan(same if same is not None else prepare(op), key))
            plans[at].add(state, index)
            last_at[hook] = at

    def drop(self, gone: set[int]) -> None:
        """Forget invokes whose ``id()`` is in ``gone``, and plans left without members."""
        for hook, plans in list(self.by_hook.items()):
            for plan in plans:
                if any(id(m) in gone for m in plan.members):
                    plan.drop(gone)
            plans[:] = [plan for plan in plans if plan.members]
            if not plans:
                del self.by_hook[hook]


def selected_nothing(op: dict, prompt_len: int, num_positions: int) -> str:
    """Why an op that never applied to an invoke is an error: what it selected, what existed."""
    steps = op.get("steps")
    return (
        f"op {op['op']} at {op['point']} (tokens {op.get('tokens', 'all')}, steps "
        f"{'all' if steps is None else steps}) selected nothing in this invoke: positions "
        f"0-{num_positions - 1} ran (a prompt of {prompt_len} tokens, then steps 0-{num_positions - prompt_len}; "
        "the last sampled token is never run through the model). Select positions and steps that run "
        "(positions count from the prompt's first token, steps from the prompt at 0), or raise max_tokens"
    )


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, to) == to
    except RuntimeError:
        return False


def apply(op: dict, value: torch.Tensor) -> torch.Tensor:
    """The new rows for an editing op, given the point's selected rows ``value`` (dim 0)."""
    kind = op["op"]
    try:
        if kind == "add":
            return value + op["value"].to(value.device, value.dtype)
        if kind == "scale":
            return value * op["value"]
        if kind == "replace":
            return op["value"].to(value.device, value.dtype).expand_as(value).clone()
    except RuntimeError as exc:  # torch's "the size of tensor a (128) must match ...": say which sizes fit
        given = op["value"]
        if isinstance(given, torch.Tensor) and not _broadcasts(given.shape, value.shape):
            raise ValueError(f"{kind}: a value of shape {tuple(given.shape)} does not broadcast to the point's rows, "
                             f"of shape {tuple(value.shape)}; give {value.shape[-1]} values (one per feature) or one") from exc
        raise  # another failure (out of memory, say): as it is
    if kind == "zero":
        return torch.zeros_like(value)
    raise ValueError(f"unknown op {kind!r}; expected one of {OP_KINDS}")
