"""Pinned host memory for saves, carved out of large slabs that are reused (plain memory on a
machine without a GPU, so the same path runs everywhere).

Saves are copied from the GPU into pinned host memory as they are made (see saves.py), and a
sweep keeps every step's copies until its invokes finish. Allocating each from torch's caching
host allocator took most of a batched save program's own time on an H200 host (about 0.1 ms per
allocation with hundreds alive). Here a slab of 64 MiB is cut by bumping an offset, and reused
once every piece cut from it has been released (after the report that read it is written).

    slabs = PinnedSlabs()
    rows, slab = slabs.empty((256, 2048), torch.bfloat16)   # one hold on the slab
    slabs.retain(slab); slabs.release(slab)                  # more holders, each releases once
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

SLAB_BYTES = 64 << 20
MAX_SPARE_SLABS = 16  # kept for reuse (1 GiB); beyond that, freed slabs go back to torch
_ALIGN = 256  # a multiple of every element size


@dataclass(eq=False)
class Slab:
    data: torch.Tensor  # pinned bytes
    used: int = 0  # bytes cut so far
    holds: int = 0  # holds on pieces cut from it
    full: bool = False  # no more pieces are cut from it


class PinnedSlabs:
    """Thread-safe: pieces are cut on the engine thread and released on the reporter thread."""

    def __init__(self, slab_bytes: int = SLAB_BYTES):
        self.slab_bytes = slab_bytes
        self._lock = threading.Lock()
        self._spare: list[Slab] = []
        self._current: Slab | None = None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Slab | None]:
        """An uninitialised pinned tensor and the slab it was cut from, held once (None: a tensor
        too large to share a slab, allocated on its own)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.slab_bytes // 4:
            return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available()), None
        size = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            slab = self._current
            if slab is None or slab.used + size > self.slab_bytes:
                if slab is not None:
                    slab.full = True
                    self._recycle(slab)
                slab = self._spare.pop() if self._spare else Slab(torch.empty(
                    self.slab_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available()))
                self._current = slab
            offset, slab.used, slab.holds = slab.used, slab.used + size, slab.holds + 1
        return slab.data[offset : offset + nbytes].view(dtype).view(shape), slab

    def retain(self, slab: Slab | None) -> None:
        if slab is not None:
            with self._lock:
                slab.holds += 1

    def release(self, slab: Slab | None) -> None:
        if slab is not None:
            with self._lock:
                slab.holds -= 1
                self._recycle(slab)

    def _recycle(self, slab: Slab) -> None:
        if slab.full and slab.holds == 0 and len(self._spare) < MAX_SPARE_SLABS:
            slab.used, slab.full = 0, False
            self._spare.append(slab)
