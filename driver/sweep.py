"""Reading a sweep's output (a local folder, or an object-store URL): a lazy view.

    >>> import interlace
    >>> sweep = interlace.open_sweep("out/my-sweep")
    >>> len(sweep), sweep.save_names                 # prompts, and the names saved
    >>> sweep[17].saves["layers.2.resid"]            # prompt 17's rows, read from the mapped file
    >>> sweep[17].text, sweep[17].error
    >>> df = sweep.to_pandas()                       # the index: one row per prompt
    >>> sweep.shared["mean_resid"]                   # trace-shared values merged over the sweep

The files need nothing of interlace: each ``shard-*.parquet`` is a plain Parquet table (one row
per prompt; ``<name>.offset`` and ``<name>.length`` locate its rows of each save) and each
``shard-*.safetensors`` holds every save name's rows concatenated::

    >>> import pyarrow.parquet as pq
    >>> from safetensors import safe_open
    >>> row = pq.read_table("out/my-sweep/shard-00000.parquet").to_pylist()[3]
    >>> with safe_open("out/my-sweep/shard-00000.safetensors", "pt") as f:
    ...     rows = f.get_slice("layers.2.resid")[row["layers.2.resid.offset"]:][:row["layers.2.resid.length"]]

On an object store the shards' file names carry an attempt tag (``shard-00000.1a2b3c4d.parquet``):
take them from each shard's record, ``shard-00000.json`` (``files.index.name``,
``files.tensors.name``), and never from a listing, which may hold a killed attempt's leftovers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

from interlace.cluster.sweep.shard_writer import INDEX_COLUMNS
from interlace.cluster.sweep.store import SweepStore, shard_tensors, without_secret


@dataclass
class SweepPrompt:
    """One prompt of a sweep: its index row, and its saves read on access."""

    row: dict[str, Any]
    _sweep: "Sweep"

    def __getattr__(self, name: str) -> Any:
        if name in INDEX_COLUMNS:
            return self.row[name]
        raise AttributeError(name)

    @property
    def saves(self) -> dict[str, Any]:
        """{name: tensor} of this prompt's rows (empty for a failed prompt)."""
        return {name: self._sweep._rows(self.row, name) for name in self._sweep.save_names
                if self.row.get(f"{name}.offset") is not None}


class Sweep:
    """A finished (or partial) sweep; see the module docstring."""

    def __init__(self, path: str | Path):
        if not isinstance(path, (str, Path)):
            raise TypeError(f"open_sweep takes a folder or a URL (str or Path), not {type(path).__name__}")
        self.store = SweepStore(path)
        self.path = self.store.local if self.store.local is not None else self.store.output
        manifest = self.store.read_bytes("manifest.json")
        if manifest is None:
            raise FileNotFoundError(f"{self.path} has no manifest.json; is it a sweep's output folder?")
        try:
            self.manifest: dict = json.loads(manifest)
            self.records = {int(k): r for k, r in self.manifest["shards"].items()}
            self.shard_size: int = self.manifest["config"]["shard_size"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # (JSONDecodeError is a ValueError)
            raise ValueError(f"{self.path}/manifest.json is not a sweep's manifest ({type(exc).__name__}: {exc}); "
                             "interlace sweep writes it as the sweep runs") from None
        self._files: dict[int, Any] = {}  # shard -> its open safetensors file (memory-mapped)
        self._indexes: dict[int, Any] = {}  # shard -> its index table

    @property
    def status(self) -> str:
        return self.manifest["status"]

    def __len__(self) -> int:
        return sum(r["prompts"] for r in self.records.values())

    @cached_property
    def save_names(self) -> list[str]:
        return sorted({n for r in self.records.values() for n in r["saves"]})

    @cached_property
    def index(self):
        """Every shard's index as one ``pyarrow.Table``, in prompt id order."""
        import pyarrow as pa

        tables = [self.store.read_table(self._checked(k, "index")) for k in sorted(self.records)]
        if not tables:
            return pa.table({c: [] for c in INDEX_COLUMNS})
        return pa.concat_tables(tables, promote_options="default")

    def to_pandas(self):
        """The index as a ``pandas.DataFrame`` (one row per prompt)."""
        return self.index.to_pandas()

    def __getitem__(self, prompt_id: int) -> SweepPrompt:
        shard = prompt_id // self.shard_size
        if shard not in self.records or not 0 <= prompt_id - shard * self.shard_size < self.records[shard]["prompts"]:
            raise KeyError(f"prompt {prompt_id} is not in this sweep (prompts 0-{self.manifest['counts']['prompts'] - 1}; "
                           f"shards written: {len(self.records)} of {self.manifest['counts']['shards']})")
        if shard not in self._indexes:
            self._indexes[shard] = self.store.read_table(self._checked(shard, "index"))
        return SweepPrompt(self._indexes[shard].slice(prompt_id - shard * self.shard_size, 1).to_pylist()[0], self)

    def __iter__(self) -> Iterator[SweepPrompt]:
        for row in self.index.to_pylist():
            yield SweepPrompt(row, self)

    @cached_property
    def shared(self) -> dict[str, Any]:
        """Trace-shared values merged over the whole sweep."""
        from safetensors.torch import load

        data = self.store.read_bytes("shared.safetensors")
        return load(data) if data is not None else {}

    def _rows(self, row: dict, name: str):
        handle = self._open(row["shard"])
        offset, length = row[f"{name}.offset"], row[f"{name}.length"]
        return handle.get_slice(name)[offset:offset + length]

    def _open(self, shard: int):
        if shard not in self._files:
            self._files[shard] = shard_tensors(self.store, self._checked(shard, "tensors"))
        return self._files[shard]

    def _checked(self, shard: int, kind: str) -> str:
        """The name of shard ``shard``'s ``kind`` file ("tensors", "index"), once it is the size its
        record says: a file cut short or changed after the sweep (a partial copy, a full disk) failed
        in safetensors or pyarrow with "incomplete metadata, file not fully covered"."""
        file = self.records[shard]["files"][kind]
        size = self.store.size(file["name"])
        if size != file["bytes"]:
            found = "is missing" if size is None else f"is {size} bytes, not the {file['bytes']} its record says"
            raise OSError(f"shard {shard}'s {kind} file {file['name']} in {without_secret(str(self.path))} {found}: "
                          "it was removed or changed after the sweep wrote it. Rerun the sweep's command "
                          "(`interlace sweep CONFIG`), which writes such a shard again")
        return file["name"]


def open_sweep(path: str | Path) -> Sweep:
    """A lazy view of the sweep written to ``path``: a local folder, or a URL ``pyarrow.fs`` opens
    (``s3://bucket/prefix?endpoint_override=...``, ``gs://...``, ``file:///abs/path``; see
    :mod:`interlace.cluster.sweep.store` for credentials). Local tensors are memory-mapped; memory
    mapping is for local files only, so on an object store each access reads the rows it needs by
    byte range (the header once per shard) and each shard's index once."""
    return Sweep(path)


__all__ = ["open_sweep", "Sweep", "SweepPrompt"]
