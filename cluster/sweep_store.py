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

import os
import uuid
from pathlib import Path
from typing import Any, Callable


def is_url(output: str) -> bool:
    return "://" in output


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
        from interlace.cluster.tensor_file import write_safetensors

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

    def size(self, name: str) -> int:
        if self.local is not None:
            return (self.local / name).stat().st_size
        return self.fs.get_file_info(self._path(name)).size

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
