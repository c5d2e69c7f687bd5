"""Declarative operations: interventions as data, applied without running user code.

An op is a plain dict made by :mod:`interlace.ops` on the driver::

    {"op": "add", "point": "layers.3.resid", "value": tensor[hidden], "tokens": "all", "steps": None}

Ops run inline in the module's hook (no program thread), and every invoke of a step that carries
the same op (same ``key``) is handled by one indexed tensor operation: a sweep of 256 invokes
steering one layer costs one ``index_add`` per step, not 256 Python calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from interlace.workers.points import ROW_PER_REQUEST_KINDS

OP_KINDS = ("save", "add", "scale", "replace", "zero")


@dataclass
class StepOp:
    """One op at one step, for every invoke that carries it: one tensor operation."""

    op: dict
    invokes: list  # the interleaver's InvokeStates, in batch order
    rows: list[int]  # absolute rows of the point's tensor (token rows, or requests' logits rows)
    ranges: list[tuple[int, int]]  # each invoke's rows within the gathered value (for saves)


@dataclass
class OpPlan:
    """An op (by content key) and the live invokes carrying it; a sweep shares one plan."""

    op: dict
    members: list = field(default_factory=list)

    @property
    def point(self):
        return self.op["_point"]

    def for_step(self) -> StepOp | None:
        """This step's rows, from each member's ``scheduled`` facts (set by begin_step)."""
        steps = self.op.get("steps")
        members = sorted(
            (m for m in self.members if m.scheduled and m.error is None
             and (steps is None or m.scheduled[5] in steps)),
            key=lambda m: m.scheduled[0],
        )
        tokens = self.op.get("tokens", "all")
        if self.point.kind in ROW_PER_REQUEST_KINDS:  # one row per request, once its prompt is done
            members = [m for m in members if m.scheduled[4]]
            per_invoke = [[m.scheduled[0]] for m in members]
        elif tokens == "last":
            members = [m for m in members if m.scheduled[4]]
            per_invoke = [[m.scheduled[2] - 1] for m in members]
        else:
            per_invoke = [select_rows(self.op, *m.scheduled[1:5]) for m in members]
            members, per_invoke = [m for m, r in zip(members, per_invoke) if r], [r for r in per_invoke if r]
        if not members:
            return None
        rows, ranges = [], []
        for r in per_invoke:
            ranges.append((len(rows), len(rows) + len(r)))
            rows += r
        return StepOp(self.op, members, rows, ranges)


def select_rows(op: dict, start: int, stop: int, first_position: int, final_chunk: bool) -> list[int]:
    """Rows of ``start:stop`` (positions ``first_position``...) that ``op['tokens']`` selects."""
    tokens = op.get("tokens", "all")
    if tokens == "all":
        return list(range(start, stop))
    if tokens == "last":
        return [stop - 1] if final_chunk else []
    wanted = set(tokens)
    return [start + i for i in range(stop - start) if first_position + i in wanted]


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
