"""Declarative operations: interventions as data, applied without running user code.

An op is a plain dict made by :mod:`interlace.ops` on the driver::

    {"op": "add", "point": "layers.3.resid", "value": tensor[hidden], "tokens": "all", "steps": None}

Ops run inline in the module's hook (no program thread), and every invoke of a step that carries
the same op (same ``key``) is handled by one indexed tensor operation: a sweep of 256 invokes
steering one layer costs one ``index_add`` per step, not 256 Python calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

OP_KINDS = ("save", "add", "scale", "replace", "zero")


@dataclass
class OpSite:
    """One op for one invoke at one step: which of the point's rows it touches."""

    invoke: Any  # the interleaver's InvokeState
    op: dict
    rows: list[int]  # absolute rows in the point's tensor (token rows, or the request's logits row)


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
