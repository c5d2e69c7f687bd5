"""The report batch file: one batch of a rank's reports, written in one pass, mapped by the driver.

    [data region: saved rows, each tensor 64-byte aligned][header: the reports, pickled][trailer]

The saves' rows are gathered straight into the data region (the file is sized up front and mapped
shared while it is written), so gathering them is writing them: one copy of the bytes, where
gathering into memory and then ``torch.save`` made three. The header holds everything else (the
report dicts, values that are not rows, shared contributions, errors), pickled with each tensor of
the data region replaced by a reference to it (offset, dtype, shape, strides); any other tensor is
pickled whole. The trailer says where the header is. The driver maps the data region
copy-on-write and rebuilds those tensors as views of it: nothing is copied on read, and a user
editing a result does not change the file.

    writer = ReportFileWriter(fd)
    l3, l4 = writer.allocate([((n, 2048), torch.bfloat16), ((n, 2048), torch.bfloat16)])
    ...gather rows into l3 and l4; put views of them in the reports...
    writer.finish(reports)
    read_report_file(path)  ->  the reports; their rows are views of one copy-on-write mapping
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import struct
from pathlib import Path
from typing import Any, Sequence

import torch

_ALIGN = 64  # every tensor starts on a cache line, and at a multiple of any element size
_TRAILER = struct.Struct("<8sQQ")  # magic, header offset, header length
_MAGIC = b"ilreport"

TensorSpec = tuple[Sequence[int], torch.dtype]


class ReportFileWriter:
    """Writes one batch file into ``fd`` (an empty file the caller created, names and closes)."""

    def __init__(self, fd: int):
        self._fd = fd
        self._data: torch.Tensor | None = None  # the data region, as bytes; None while unmapped
        self._data_bytes = 0
        self.reports: list[dict] | None = None  # set by finish()

    def allocate(self, specs: list[TensorSpec]) -> list[torch.Tensor]:
        """Uninitialised tensors in the data region, one per ``(shape, dtype)``; call at most
        once, before :meth:`finish`. Tensors saved in the reports that are views of these are
        stored by reference."""
        if self._data is not None or self.reports is not None:
            raise RuntimeError("a report file's data region is allocated once, before finish()")
        offsets, end = [], 0
        for shape, dtype in specs:
            offsets.append(end)
            end += _aligned(math.prod(shape) * dtype.itemsize)
        if end == 0:
            return [torch.empty(tuple(shape), dtype=dtype) for shape, dtype in specs]
        # Reserve the space now: a full disk or /dev/shm fails here (ENOSPC, a failed report)
        # rather than killing the worker with SIGBUS when the gather first writes a missing page.
        os.posix_fallocate(self._fd, 0, end)
        # Not MAP_POPULATE: mapping every page up front cost more than the gather's own page faults
        # (512 MiB on a 16-core GPU host: 0.17-0.24 s against about 0.02 s; even on 2 cores).
        region = mmap.mmap(self._fd, end, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # The tensors keep the mapping alive; it is unmapped when the last of them is dropped.
        self._data, self._data_bytes = torch.frombuffer(region, dtype=torch.uint8), end
        return [self._data[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(tuple(shape))
                for offset, (shape, dtype) in zip(offsets, specs)]

    def finish(self, reports: list[dict]) -> None:
        """Pickle ``reports`` as the header after the data region, then the trailer."""
        with io.BufferedWriter(io.FileIO(self._fd, "wb", closefd=False), buffer_size=1 << 20) as out:
            out.seek(self._data_bytes)
            _HeaderPickler(out, self._data).dump(reports)
            header_bytes = out.tell() - self._data_bytes
            out.write(_TRAILER.pack(_MAGIC, self._data_bytes, header_bytes))
        self.reports = reports


def read_report_file(path: Path) -> list[dict]:
    """The reports of a complete batch file; tensors of its data region are views of one private
    (copy-on-write) mapping of it, which stays valid after the file is removed."""
    with open(path, "rb") as f:
        f.seek(-_TRAILER.size, os.SEEK_END)
        magic, data_bytes, header_bytes = _TRAILER.unpack(f.read(_TRAILER.size))
        if magic != _MAGIC:
            raise ValueError(f"{path} is not an interlace report file (trailer {magic!r})")
        f.seek(data_bytes)
        header = f.read(header_bytes)
    data = torch.from_file(str(path), shared=False, size=data_bytes, dtype=torch.uint8) if data_bytes else None
    return _HeaderUnpickler(io.BytesIO(header), data).load()


class _HeaderPickler(pickle.Pickler):
    """Tensors that are views of the data region become references; any other tensor is pickled
    whole, and only its own bytes (a view of a large tensor would otherwise carry all of it)."""

    def __init__(self, file, data: torch.Tensor | None):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._data_ptr = data.data_ptr() if data is not None else None

    def persistent_id(self, obj: Any) -> tuple | None:
        if (type(obj) is not torch.Tensor or self._data_ptr is None or obj.device.type != "cpu"
                or obj.layout is not torch.strided):
            return None
        if obj.untyped_storage().data_ptr() != self._data_ptr:
            return None
        return ("data", _dtype_name(obj.dtype), obj.storage_offset() * obj.element_size(),
                tuple(obj.shape), obj.stride())

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout is torch.strided
                and obj.untyped_storage().nbytes() > obj.nbytes):
            return obj.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


class _HeaderUnpickler(pickle.Unpickler):
    def __init__(self, file, data: torch.Tensor | None):
        super().__init__(file)
        self._data = data
        self._typed: dict[str, torch.Tensor] = {}  # the data region viewed as each dtype

    def persistent_load(self, pid: tuple) -> torch.Tensor:
        kind, dtype, offset, shape, stride = pid
        if kind != "data" or self._data is None:
            raise pickle.UnpicklingError(f"unknown reference {pid!r} in a report file")
        if dtype not in self._typed:
            self._typed[dtype] = self._data.view(getattr(torch, dtype))
        typed = self._typed[dtype]
        return typed.as_strided(shape, stride, offset // typed.element_size())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
