"""Saved values on their way from a worker rank to an invoke's report.

A save keeps one device-side copy for its whole group of invokes (asynchronous: no step waits), and
each invoke remembers its rows of it. Invokes reported together (a sweep finishes in one step) are
assembled together on the device: per save name, one concatenation of the copies, one row gather
for all invokes, one device-to-host copy, and each invoke's result is a view of it. Reporting 256
invokes x 128 steps x 4 names is a dozen tensor operations, not 131,072.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class DeferredCopy:
    """A saved value held where it was made (a device-side copy: asynchronous, and safe from
    later in-place kernels) until the first invoke sharing it is reported; only then does it
    cross to the host, so no step of the forward pass waits on a device-to-host copy."""

    __slots__ = ("copy",)

    def __init__(self, value: torch.Tensor):
        self.copy = value.detach().clone()

    def get(self) -> torch.Tensor:
        if self.copy.device.type != "cpu":
            self.copy = self.copy.to("cpu")
        return self.copy


class SavedRows:
    """One invoke's rows ``start:stop`` of a :class:`DeferredCopy`."""

    __slots__ = ("copy", "start", "stop")

    def __init__(self, copy: DeferredCopy, start: int, stop: int):
        self.copy, self.start, self.stop = copy, start, stop


def assemble_saves(saves_of: list[dict[str, list]]) -> list[dict[str, Any]]:
    """Each invoke's saves by name: tensors saved at several steps concatenate along dim 0 (a
    residual saved every step is the whole sequence's), other values become a list."""
    results: list[dict[str, Any]] = [{} for _ in saves_of]
    for name in dict.fromkeys(n for saves in saves_of for n in saves):
        owners = [i for i, saves in enumerate(saves_of) if name in saves]
        rows = [saves_of[i][name] for i in owners]
        gathered = _gather_rows(rows)
        for i, values, value in zip(owners, rows, gathered or [None] * len(owners)):
            results[i][name] = value if gathered is not None else _combine(values)
    return results


def _gather_rows(rows_of: list[list]) -> list[torch.Tensor] | None:
    """The vectorised path, when every value is rows of a copy with one row shape and dtype.

    Gathers on the device where the copies are (one concatenation and one index per name), then
    crosses to the host once; each invoke's result is a view of that one host tensor, so a report
    file stores it once and the driver maps it without copying.
    """
    copies: dict[int, torch.Tensor] = {}
    for values in rows_of:
        for v in values:
            if not isinstance(v, SavedRows) or v.copy.copy.dim() == 0:
                return None
            copies.setdefault(id(v.copy), v.copy.copy)
    tensors = list(copies.values())
    if len({(t.shape[1:], t.dtype, t.device) for t in tensors}) != 1:
        return None
    offsets = dict(zip(copies, np.cumsum([0] + [t.shape[0] for t in tensors[:-1]]).tolist()))
    indexes = []
    for values in rows_of:
        starts = np.fromiter((offsets[id(v.copy)] + v.start for v in values), np.int64, len(values))
        lengths = np.fromiter((v.stop - v.start for v in values), np.int64, len(values))
        if (lengths == 1).all():
            indexes.append(starts)
        else:  # each range start..start+length, concatenated, without a Python loop per row
            indexes.append(np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(lengths.sum()))
    everything = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    index = torch.from_numpy(np.concatenate(indexes)).to(everything.device)
    host = everything.index_select(0, index).to("cpu")
    return list(host.split([len(i) for i in indexes]))


def _combine(values: list) -> Any:
    values = [_host_rows(v) if isinstance(v, SavedRows) else v for v in values]
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[1:] == values[0].shape[1:] for v in values):
        return torch.cat(values, dim=0)
    return values


def _host_rows(rows: SavedRows) -> torch.Tensor:
    host = rows.copy.get()
    if host.dim() == 0 or (rows.start, rows.stop) == (0, host.shape[0]):
        return host
    return host[rows.start : rows.stop].clone()  # own storage: a view would pickle it all
