"""Declarative operations: interventions as data, applied without running user code.

An op is a plain dict made by :mod:`interlace.ops` on the driver::

    {"op": "add", "point": "layers.3.resid", "value": tensor[hidden], "tokens": "all", "steps": None}

Ops run inline in the module's hook (no program to switch to), and every invoke of a step that carries
the same op (same ``key``) is handled by one indexed tensor operation: a sweep of 256 invokes
steering one layer costs one ``index_add`` per step, not 256 Python calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

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


@dataclass
class OpPlan:
    """An op (by content key) and the live invokes carrying it; a sweep shares one plan."""

    op: dict
    members: list = field(default_factory=list)
    _is_member: np.ndarray | None = field(default=None, init=False, repr=False)  # by slot; rebuilt on change
    _epoch_step: tuple[int, StepOp | None] | None = field(default=None, init=False, repr=False)

    @property
    def point(self):
        return self.op["_point"]

    def add(self, state) -> None:
        self.members.append(state)
        self._is_member, self._epoch_step = None, None

    def drop(self, gone: set[int]) -> None:
        """Forget members whose ``id()`` is in ``gone``."""
        self.members = [m for m in self.members if id(m) not in gone]
        self._is_member, self._epoch_step = None, None

    def for_step(self, scheduled) -> StepOp | None:
        """This step's rows for the members among ``scheduled`` (the interleaver's Scheduled:
        this step's live invokes as arrays, in batch order), by array arithmetic; once per
        epoch (same invokes in the same rows) for an op that applies at every step."""
        if self._epoch_step is not None and self._epoch_step[0] == scheduled.epoch:
            return self._epoch_step[1]
        step_op = self._for_step(scheduled)
        if self.op.get("steps") is None and self.op.get("tokens", "all") in ("all", "last"):  # rows alone decide
            self._epoch_step = (scheduled.epoch, step_op)
        return step_op

    def _for_step(self, scheduled) -> StepOp | None:
        if not len(scheduled.slots):
            return None
        size = int(scheduled.slots.max()) + 1
        if self._is_member is None or len(self._is_member) < size:
            slots = [m.slot for m in self.members]
            self._is_member = np.zeros(max([size - 1, *slots]) + 1, dtype=bool)
            self._is_member[slots] = True
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
        return StepOp(self.op, [scheduled.states[i] for i in index.tolist()], scheduled.slots[index], rows,
                      stops - lengths, stops)


def apply(op: dict, value: torch.Tensor) -> torch.Tensor:
    """The new rows for an editing op, given the point's selected rows ``value`` (dim 0)."""
    kind = op["op"]
    if kind == "add":
        return value + op["value"].to(value.device, value.dtype)
    if kind == "scale":
        return value * op["value"]
    if kind == "replace":
        return op["value"].to(value.device, value.dtype).expand_as(value).clone()
    if kind == "zero":
        return torch.zeros_like(value)
    raise ValueError(f"unknown op {kind!r}; expected one of {OP_KINDS}")
