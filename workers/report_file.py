"""Report files: a rank's saved rows for a trace, and its reports in batches, mapped by the driver.

    <trace>/<stage>-<pid>-<n>.data     the saved rows of every invoke this rank reports for the
                                       trace, laid out in runs while the trace runs (saves.py)
    <trace>/<stage>-<invoke>.reports   one batch: [prefix: data file, its length][header: pickled reports]

The data file is sparse and mapped once: blocks of runs are regions appended to it, and room in
them that no row was written to is never backed by memory. The header holds everything else (the
report dicts, values that are not rows, shared contributions, errors), pickled with each tensor
that views the data file replaced by a reference to it (offset, dtype, shape, strides); any other
tensor is pickled whole. The driver maps the file copy-on-write and rebuilds those tensors as
views of it: nothing is copied on read, and a user editing a result does not change the file.

    data = DataFile(folder / "0-123-0.data")
    rows = data.region(nbytes)            (reporter thread, as saves arrive; write rows into it)
    writer = ReportFileWriter(fd, data); writer.finish(reports)     (reports hold views of rows)
    data.close()                                                    (after the trace's last batch)
    read_report_file(path)  ->  the reports; their rows are views of one copy-on-write mapping
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import torch

_PAGE = mmap.ALLOCATIONGRANULARITY  # regions start on a page
_VIRTUAL_BYTES = 1 << 38  # a data file's address space (sparse: no memory until written)
_PREFIX = struct.Struct("<8sQQH")  # magic, mapped start, mapped length, data file name length
_MAGIC = b"ilreport"


class DataFile:
    """One trace's saved rows on one rank, in regions appended one after another. Used from one
    thread.

    The file is sparse at a large size and mapped once, so a new region never remaps, and pages
    are backed by memory only once written. :meth:`close` truncates it to the regions handed out.
    """

    def __init__(self, path: Path):
        self.path = path  # created with the first region
        self.bytes: torch.Tensor | None = None  # the whole file, as one tensor, once open
        self.used = 0  # bytes handed out to regions

    def region(self, nbytes: int) -> torch.Tensor:
        """The next ``nbytes``, page aligned (so they suit any dtype)."""
        if self.bytes is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(self._fd, _VIRTUAL_BYTES)
            mapping = mmap.mmap(self._fd, _VIRTUAL_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.bytes = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
        start = self.used
        if start + nbytes > _VIRTUAL_BYTES:
            raise MemoryError(f"a trace's saves on one rank are limited to {_VIRTUAL_BYTES >> 30} GiB")
        self.used = _round_up(start + nbytes, _PAGE)
        return self.bytes[start : start + nbytes]

    def close(self) -> None:
        """No more batches: cut the file to the regions handed out. Tensors viewing the file keep
        its mapping until they are dropped."""
        if self.bytes is not None:
            os.ftruncate(self._fd, self.used)
            os.close(self._fd)
            self.bytes = None


class ReportFileWriter:
    """Writes one batch's header file into ``fd`` (an empty file the caller created, names and
    closes); tensors in the reports that view ``data`` are stored by reference."""

    def __init__(self, fd: int, data: DataFile | None):
        self._fd = fd
        self._data = data
        self.reports: list[dict] | None = None  # set by finish()

    def finish(self, reports: list[dict]) -> None:
        """Write the prefix (the data file and how much of it to map) and ``reports`` pickled as
        the header."""
        data = self._data.bytes if self._data is not None else None
        length = self._data.used if data is not None else 0
        name = self._data.path.name.encode() if length else b""
        with io.BufferedWriter(io.FileIO(self._fd, "wb", closefd=False), buffer_size=1 << 20) as out:
            out.write(_PREFIX.pack(_MAGIC, 0, length, len(name)) + name)
            _HeaderPickler(out, data if length else None, length).dump(reports)
        self.reports = reports


def read_report_file(path: Path) -> list[dict]:
    """The reports of a complete batch file; its saved rows are views of one private
    (copy-on-write) mapping of the data file, which stays valid after the files are removed."""
    with open(path, "rb") as f:
        magic, start, length, name_len = _PREFIX.unpack(f.read(_PREFIX.size))
        if magic != _MAGIC:
            raise ValueError(f"{path} is not an interlace report file (prefix {magic!r})")
        name = f.read(name_len).decode()
        return _HeaderUnpickler(f, _map_private(path.parent / name, start, length) if length else None).load()


def _map_private(path: Path, start: int, length: int) -> torch.Tensor:
    fd = os.open(path, os.O_RDONLY)
    try:
        region = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    finally:
        os.close(fd)
    return torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive


class _HeaderPickler(pickle.Pickler):
    """Tensors viewing the first ``length`` bytes of the data file become references; any other
    tensor is pickled whole, and only its own bytes (a view of a large tensor would otherwise carry
    all of it)."""

    def __init__(self, file, data: torch.Tensor | None, length: int):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._data_ptr = data.data_ptr() if data is not None else None
        self._length = length

    def persistent_id(self, obj: Any) -> tuple | None:
        if (type(obj) is not torch.Tensor or self._data_ptr is None or obj.device.type != "cpu"
                or obj.layout is not torch.strided or obj.untyped_storage().data_ptr() != self._data_ptr):
            return None
        offset = obj.storage_offset() * obj.element_size()
        if offset + obj.nbytes > self._length:
            return None
        return ("data", _dtype_name(obj.dtype), offset, tuple(obj.shape), obj.stride())

    def reducer_override(self, obj: Any) -> Any:
        if (isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout is torch.strided
                and obj.untyped_storage().nbytes() > obj.nbytes):
            return obj.clone().__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


class _HeaderUnpickler(pickle.Unpickler):
    def __init__(self, file, data: torch.Tensor | None):
        super().__init__(file)
        self._data = data
        self._typed: dict[str, torch.Tensor] = {}  # the region viewed as each dtype

    def persistent_load(self, pid: tuple) -> torch.Tensor:
        kind, dtype, offset, shape, stride = pid
        if kind != "data" or self._data is None:
            raise pickle.UnpicklingError(f"unknown reference {pid!r} in a report file")
        if dtype not in self._typed:
            self._typed[dtype] = self._data.view(getattr(torch, dtype))
        typed = self._typed[dtype]
        return typed.as_strided(shape, stride, offset // typed.element_size())


def _round_up(nbytes: int, unit: int) -> int:
    return -(-nbytes // unit) * unit


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
