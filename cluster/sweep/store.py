"""Where a sweep's files go: a local folder, or a file-system URL that ``pyarrow.fs`` opens
(``s3://bucket/prefix``, ``gs://bucket/prefix``, ``file:///abs/path``).

A local folder commits each file by renaming it into place. An object store has no atomic rename,
but an object PUT is atomic (a reader sees the whole object or none), so a URL output writes each
shard attempt's tensors and index under their final names made unique per attempt
(``shard-00003.1a2b3c4d.safetensors``), then PUTs the shard's record (``shard-00003.json``) naming
them: the record is the commit. A shard counts only through its record, so the objects of an
attempt killed before its record are never read or counted; an attempt that races a retry of
the same shard leaves one record (the last PUT) naming one complete pair, and the loser's objects
are unreferenced leftovers.

S3 settings go in the URL's query (``?endpoint_override=host:port&scheme=http&region=...``) or the
usual AWS environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``...),
which every node of the cluster must have.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import struct
import time
import uuid
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Callable

from interlace.cluster.sweep.tensor_file import write_safetensors


LOCK = ".interlace-sweep.lock"  # held by the sweep driver writing the folder (SweepStore.claimed)


def is_url(output: str) -> bool:
    return "://" in output


def without_secret(output: str) -> str:
    """The output URL as the manifest and messages show it: no credentials from its user part or query."""
    if not is_url(output):
        return output
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(output)
    query = [(k, "***" if k in ("secret_key", "session_token") else v) for k, v in parse_qsl(parts.query)]
    netloc = parts.netloc.rpartition("@")[2] if "@" in parts.netloc else parts.netloc
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe=":*/")))


class SweepStore:
    """One sweep's output location; names are relative to it (``shard-00000.json``)."""

    def __init__(self, output: str | Path):
        self.output = str(output)
        if is_url(self.output):
            import pyarrow.fs as pafs

            try:
                self.fs, self.root = pafs.FileSystem.from_uri(self.output)
            except (ValueError, OSError) as exc:
                raise ValueError(f"output {self.output!r}: pyarrow.fs cannot open it ({exc}); write a local folder, "
                                 "s3://bucket/prefix, gs://bucket/prefix or file:///abs/path") from exc
            self.root = self.root.rstrip("/")
            self.local: Path | None = None
        else:
            self.fs, self.root, self.local = None, "", Path(self.output)

    @contextlib.contextmanager
    def claimed(self):
        """This output for one sweep driver while it runs. The same command started again while
        the first still ran ran every shard again, and the two runs' files of a shard could
        interleave (one run's tensors under the other's index). An flock on a file in the folder:
        the kernel lets it go when the process ends, however it ends, and it holds on a shared file
        system that honours locks (NFS does). An object store has none: not checked there."""
        if self.local is None:
            yield
            return
        import fcntl

        fd = os.open(self.local / LOCK, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited (PEP 446)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process"
                raise ValueError(f"{self.output} is being written by another interlace sweep ({holder}); let it end or "
                                 "stop it, then run this command again to resume") from None
            except OSError as exc:  # a file system without locks (NFS mounted nolock): run, unchecked
                if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                warnings.warn(f"{self.output}: its file system takes no locks ({exc}); a second sweep started into "
                              "it while this one runs would not be refused", stacklevel=3)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
                      .encode(), 0)
            yield
        finally:
            os.close(fd)

    @property
    def renames(self) -> bool:
        """True for a local folder: files keep fixed names and are renamed into place."""
        return self.local is not None

    def make(self) -> None:
        if self.local is not None:
            self.local.mkdir(parents=True, exist_ok=True)
        else:
            self.fs.create_dir(self.root, recursive=True)  # S3: fails with a clear message if the bucket is missing

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    # --- writing: each call commits one whole file ----------------------------------------------

    def put_bytes(self, name: str, data: bytes) -> None:
        if self.local is not None:
            _atomic(self.local / name, lambda tmp: Path(tmp).write_bytes(data))
        else:
            with self.fs.open_output_stream(self._path(name)) as out:
                out.write(data)

    def put_table(self, name: str, table: Any) -> None:
        import pyarrow.parquet as pq

        if self.local is not None:
            _atomic(self.local / name, lambda tmp: pq.write_table(table, tmp))
        else:
            pq.write_table(table, self._path(name), filesystem=self.fs)

    def put_tensors(self, name: str, tensors: dict[str, list], metadata: dict[str, str]) -> None:
        """A safetensors file of each name's parts joined (:func:`write_safetensors`)."""

        if self.local is not None:
            def write(tmp: str) -> None:
                with open(tmp, "wb", buffering=0) as out:
                    write_safetensors(out, tensors, metadata)

            _atomic(self.local / name, write)
        else:
            with self.fs.open_output_stream(self._path(name)) as out:  # one PUT (or multipart upload) at close
                write_safetensors(out, tensors, metadata)

    # --- reading --------------------------------------------------------------------------------

    def read_bytes(self, name: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""
        if self.local is not None:
            path = self.local / name
            return path.read_bytes() if path.is_file() else None
        import pyarrow.fs as pafs

        if self.fs.get_file_info(self._path(name)).type != pafs.FileType.File:
            return None
        with self.fs.open_input_stream(self._path(name)) as f:
            return f.read()

    def size(self, name: str) -> int | None:
        """The file's bytes, or None when it does not exist."""
        if self.local is not None:
            try:
                return (self.local / name).stat().st_size
            except FileNotFoundError:
                return None
        return self.fs.get_file_info(self._path(name)).size  # None for a missing object

    def sizes(self) -> dict[str, int]:
        """{name: bytes} of every file directly in the output (one listing on an object store)."""
        if self.local is not None:
            return {p.name: p.stat().st_size for p in self.local.iterdir() if p.is_file()} if self.local.is_dir() else {}
        import pyarrow.fs as pafs

        infos = self.fs.get_file_info(pafs.FileSelector(self.root, allow_not_found=True))
        return {info.base_name: info.size for info in infos if info.type == pafs.FileType.File}

    def read_table(self, name: str):
        import pyarrow.parquet as pq

        if self.local is not None:
            return pq.read_table(self.local / name)
        return pq.read_table(self._path(name), filesystem=self.fs)

    def open_input(self, name: str):
        """A random-access file (``read_at``) on an object store."""
        return self.fs.open_input_file(self._path(name))


def attempt_stem(stem: str, store: SweepStore) -> str:
    """A shard attempt's file stem: fixed for a local folder (renames replace), unique per attempt
    on an object store (nothing is ever overwritten there but the record)."""
    return stem if store.renames else f"{stem}.{uuid.uuid4().hex[:8]}"


def _atomic(path: Path, write: Callable[[str], Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def shard_tensors(store: SweepStore, name: str):
    """A shard's tensors file, opened for ``get_slice(name)[a:b]`` / ``get_tensor(name)``: memory-mapped
    when local, read by byte range (only the rows asked for) on an object store."""
    if store.local is not None:
        from safetensors import safe_open

        return safe_open(store.local / name, framework="pt")
    return _RangeTensors(store.open_input(name))


class _RangeTensors:
    """A ``.safetensors`` object read by byte ranges: its header once, then only the rows sliced."""

    def __init__(self, handle: Any):
        self.handle = handle
        size = struct.unpack("<Q", handle.read_at(8, 0))[0]
        self.header = json.loads(handle.read_at(size, 8))
        self.header.pop("__metadata__", None)
        self.base = 8 + size

    def keys(self) -> list[str]:
        return list(self.header)

    def get_tensor(self, name: str):
        info = self.header[name]
        begin, end = info["data_offsets"]
        return self._read(begin, end - begin, info["dtype"], info["shape"])

    def get_slice(self, name: str) -> "_RangeSlice":
        return _RangeSlice(self, name)

    def _read(self, begin: int, nbytes: int, dtype: str, shape: list[int]):
        import torch

        torch_dtype = _dtypes().get(dtype)
        if torch_dtype is None:
            raise ValueError(f"safetensors dtype {dtype} is not one a sweep writes ({sorted(_dtypes())})")
        if nbytes == 0:
            return torch.empty(shape, dtype=torch_dtype)
        data = bytearray(self.handle.read_at(nbytes, self.base + begin))
        return torch.frombuffer(data, dtype=torch_dtype).reshape(shape)

@dataclass
class _RangeSlice:
    tensors: _RangeTensors
    name: str

    def __getitem__(self, key: slice):
        info = self.tensors.header[self.name]
        shape, (begin, end) = info["shape"], info["data_offsets"]
        if not isinstance(key, slice) or not shape:
            raise TypeError(f"{self.name}: a remote sweep reads rows by a slice of the first dimension, got {key!r}")
        start, stop, step = key.indices(shape[0])
        if step != 1:
            raise TypeError(f"{self.name}: slice rows with step 1, got {key!r}")
        stop = max(stop, start)
        row_bytes = (end - begin) // shape[0] if shape[0] else 0
        return self.tensors._read(begin + start * row_bytes, (stop - start) * row_bytes, info["dtype"],
                                  [stop - start, *shape[1:]])

@cache
def _dtypes() -> dict[str, Any]:
    import torch

    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
