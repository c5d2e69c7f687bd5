"""Pipeline parallelism as programs see it: one program, run across the stages.

Each stage owns a contiguous run of the forward pass (embeddings and the first layers on stage 0,
the last layers, the final norm, ``logits`` and ``samples`` on the last). A program is run on every
stage, each step:

- on its stage, an access to a point the stage owns runs live, as on one GPU;
- an access to a point a *later* stage owns suspends the program: the stage's part is done, and
  what the program has read so far is carried to the next stage with the activations;
- the next stage runs the program again from the top, *replaying* the carried values for the
  accesses the earlier stages made (no saves, shares or edits while replaying: they happened
  already), then goes on live from the access where the earlier stage stopped.

So ``layers[20].output = f(layers[2].output)`` works across stages without a round trip through
the driver, every side effect happens exactly once, and a program means the same on PP=1 and
PP=n. Programs must be deterministic given what they read (true of ordinary programs).

The carry travels inside vLLM's ``IntermediateTensors`` under ``interlace.*`` keys: the carried
tensors' bytes in one device buffer, and a small pickled description in a host tensor.
"""

from __future__ import annotations

import pickle
import re
from math import prod
from dataclasses import dataclass, field
from typing import Any

import torch

from interlace.workers.points import ROW_PER_REQUEST_KINDS, Point

CARRY_PREFIX = "interlace."
_ALIGN = 16
EARLIER, HERE, LATER = -1, 0, 1
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class StageMap:
    """Which stage owns a point, seen from this stage: EARLIER, HERE or LATER."""

    def __init__(self, local: set[str], pp_rank: int, pp_size: int, embeddings: str | None):
        self.local = local  # modules this stage runs
        self.first, self.last = pp_rank == 0, pp_rank == pp_size - 1
        self.embeddings = embeddings
        layers = [int(m.group(1)) for name in local if (m := _LAYER.search(name))]
        self.layer_range = (min(layers), max(layers) + 1) if layers else (0, 0)

    def where(self, point: Point) -> int:
        if point.kind in ROW_PER_REQUEST_KINDS:
            return HERE if self.last else LATER
        if point.module in self.local:
            return HERE
        match = _LAYER.search(point.module)
        if match is not None:
            return EARLIER if int(match.group(1)) < self.layer_range[0] else LATER
        return EARLIER if point.module == self.embeddings else LATER


@dataclass
class Carried:
    """One call's outcome on the stages so far, keyed by its group key in the carry."""

    status: str  # "suspended" (goes on on a later stage), "finished" or "failed"
    values: list = field(default_factory=list)  # what each access returned, in order
    error: dict | None = None
    points: list = field(default_factory=list)  # which access each value is (checked on replay)


def pack(carry: dict[str, Carried], tp_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The carry as two ``IntermediateTensors`` entries (vLLM's CPU transport takes at most 8
    tensors in all): every carried tensor's bytes in one device buffer, and a pickled host-side
    description of who carries what."""
    tensors: list[torch.Tensor] = []

    def lift(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().contiguous())
            return _TensorRef(len(tensors) - 1, value.dtype, tuple(value.shape))
        if isinstance(value, tuple):
            return tuple(lift(v) for v in value)
        return value

    described = {key: Carried(c.status, [lift(v) for v in c.values], c.error, c.points) for key, c in carry.items()}
    chunks, offsets, offset = [], [], 0
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8)
        pad = -raw.numel() % _ALIGN  # keep every tensor's start aligned for its dtype
        chunks += [raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)]
        offsets.append(offset)
        offset += raw.numel() + pad
    meta = pickle.dumps((described, offsets))
    # vLLM splits a sent tensor across the TP group when its size divides evenly and gathers it on
    # the far side over the device group; keep the host-side description out of that path.
    pad = (1 - len(meta)) % tp_size if tp_size > 1 else 0
    out = {f"{CARRY_PREFIX}meta": torch.frombuffer(bytearray(meta + b"\0" * pad), dtype=torch.uint8)}
    if chunks:
        out[f"{CARRY_PREFIX}data"] = torch.cat([c.to(device) for c in chunks])
    return out


def unpack(entries: dict[str, torch.Tensor]) -> dict[str, Carried]:
    meta = entries.get(f"{CARRY_PREFIX}meta")
    if meta is None:
        return {}
    described, offsets = pickle.loads(meta.cpu().numpy().tobytes())  # ignores the padding
    data = entries.get(f"{CARRY_PREFIX}data")

    def lower(value: Any) -> Any:
        if isinstance(value, _TensorRef):
            start = offsets[value.index]
            nbytes = value.dtype.itemsize * prod(value.shape)
            with torch.inference_mode(False):  # a normal tensor: its version counter shows late edits (holds.py)
                return data[start : start + nbytes].clone().view(value.dtype).view(value.shape)
        if isinstance(value, tuple):
            return tuple(lower(v) for v in value)
        return value

    return {key: Carried(c.status, [lower(v) for v in c.values], c.error, c.points) for key, c in described.items()}


def take_carry(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove interlace's entries from received intermediate tensors (vLLM must not see them)."""
    return {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(CARRY_PREFIX)]}


@dataclass(frozen=True)
class _TensorRef:
    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]
