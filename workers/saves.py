"""Saved values on their way from a worker rank to an invoke's report.

A save keeps one device-side copy for its whole group of invokes (asynchronous: no step waits), each
invoke remembers its rows of it, and the copy crosses to the host once, when the first of those
invokes is reported.
"""

from __future__ import annotations

from typing import Any

import torch


class DeferredCopy:
    """A saved value held where it was made (a device-side copy: asynchronous, and safe from
    later in-place kernels) until the first invoke sharing it is reported; only then does it
    cross to the host, so no step of the forward pass waits on a device-to-host copy."""

    def __init__(self, value: torch.Tensor):
        self.copy = value.detach().clone()

    def get(self) -> torch.Tensor:
        if self.copy.device.type != "cpu":
            self.copy = self.copy.to("cpu")
        return self.copy


class SavedRows:
    """One invoke's rows of a :class:`DeferredCopy`; read only when the report is written."""

    __slots__ = ("copy", "start", "stop")

    def __init__(self, copy: DeferredCopy, start: int, stop: int):
        self.copy, self.start, self.stop = copy, start, stop

    def value(self) -> torch.Tensor:
        host = self.copy.get()
        if host.dim() == 0 or (self.start, self.stop) == (0, host.shape[0]):
            return host
        return host[self.start : self.stop].clone()  # own storage: a view would pickle it all


def combine_steps(values: list) -> Any:
    """One save name saved at several steps: tensors concatenate along dim 0, else a list."""
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[1:] == values[0].shape[1:] for v in values):
        return torch.cat(values, dim=0)
    return values
