"""The sweep's input: every prompt in prompt id order, read with Ray Data (JSON lines, Parquet,
CSV) or, for a folder written by ``datasets``' ``save_to_disk``, with pyarrow
(:func:`read_hf_dataset`); each row checked, malformed ones keeping their error."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from interlace.cluster.config import SweepInput
from interlace.cluster.sweep.shard_writer import PromptRow


_CAUSE = "\nThe above exception was the direct cause of the following exception:"


def first_line(exc: BaseException) -> str:
    """The error a failed sweep's status names: the innermost cause, not the Ray task or Ray
    Data wrapper around it (whose first line names only the actor that raised)."""
    outer = exc
    while True:
        inner = getattr(exc, "cause", None) or exc.__cause__
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    if type(exc).__name__ == "UserCodeException":
        # Ray Data's "UDF failed to process a data block": the shard runner's own error reaches the
        # driver only as the remote traceback's text, whose first part ends with its line
        remote, marked, _ = str(outer).partition(_CAUSE)
        last = ([line for line in remote.splitlines() if line.strip()] or [" "])[-1]
        if marked and not last.startswith(" "):
            return last
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"



def read_prompts(cfg: SweepInput, output: Path | None = None) -> list[PromptRow]:
    """Every prompt of the sweep in prompt id order, each checked (malformed rows keep their error).
    ``output``: the sweep's local output folder, whose files are never read as prompts (an output
    inside an input folder: a rerun read the first run's files and was refused as changed input)."""
    import pyarrow as pa
    import ray.data

    fmt = cfg.resolved_format()
    if fmt == "hf":
        table = pa.concat_tables([read_hf_dataset(p) for p in cfg.paths], promote_options="permissive")
    else:
        reader = {"json": ray.data.read_json, "parquet": ray.data.read_parquet, "csv": ray.data.read_csv}[fmt]
        context = ray.data.DataContext.get_current()
        before = context.execution_options.preserve_order
        context.execution_options.preserve_order = True  # row order is what fixes prompt ids
        files = _expand(cfg.paths, output)
        if not files:
            raise ValueError(f"the input {cfg.paths} holds no files; list files or folders of prompts")
        try:
            tables = ray.get(reader(files).to_arrow_refs())
            # empty files give no blocks at all (pyarrow: "Must pass at least one table")
            table = pa.concat_tables(tables, promote_options="permissive") if tables else pa.table({})
        except Exception as exc:  # noqa: BLE001 - Ray Data's task error names only its read task
            # e.g. a JSON lines file whose prompts are text in some rows and token ids in others:
            # pyarrow cannot type the column, and Ray's fallback reads the file as one JSON value
            hint = ("; every row's prompt must be of one kind in a file (text, or a list of token ids), and the "
                    "file JSON lines") if fmt == "json" else ""
            raise ValueError(f"the input {cfg.paths} could not be read as {fmt}: {first_line(exc)}{hint}") from None
        finally:
            context.execution_options.preserve_order = before
    if not table.num_rows:  # a sweep of nothing is more likely a wrong path or an unfinished file
        raise ValueError(f"the input {cfg.paths} holds no rows; a sweep needs at least one prompt")
    if cfg.column not in table.column_names:  # every row would fail, after engines started
        raise ValueError(f"the input has no column {cfg.column!r} (its columns: {table.column_names}); "
                         "set input.column to the one holding the prompts")
    values = table.column(cfg.column).to_pylist()
    order = list(range(table.num_rows))
    if cfg.shuffle_seed is not None:
        random.Random(cfg.shuffle_seed).shuffle(order)
    if cfg.limit is not None:
        order = order[:cfg.limit]
    return [PromptRow(i, src, *_checked(values[src], cfg.column)) for i, src in enumerate(order)]


def read_hf_dataset(path: str):
    """A folder written by ``datasets.Dataset.save_to_disk`` (local, or a pyarrow.fs URL), as one
    ``pyarrow.Table``: its Arrow IPC stream files in state.json's order (no ``datasets`` needed)."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.ipc as ipc

    fs, root = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), str(Path(path).resolve()))
    try:
        with fs.open_input_stream(f"{root}/state.json") as f:
            state = json.loads(f.read())
    except FileNotFoundError as exc:
        hint = (" (a DatasetDict: list one split's folder, e.g. {path}/train)"
                if fs.get_file_info(f"{root}/dataset_dict.json").type == pafs.FileType.File else "")
        raise FileNotFoundError(f"input path {path} has no state.json{hint.format(path=path)}; an hf input is a "
                                "folder written by Dataset.save_to_disk") from exc
    if state.get("_indices_data_files"):
        raise ValueError(f"input path {path} keeps an indices mapping (_indices_data_files, which older "
                         "datasets versions wrote); save it again with a current datasets, or flatten_indices() first")
    tables = []
    for data_file in state.get("_data_files") or []:
        with fs.open_input_stream(f"{root}/{data_file['filename']}") as f:
            tables.append(ipc.open_stream(f).read_all())
    if not tables:
        raise ValueError(f"input path {path}: state.json lists no _data_files; is it a saved Dataset?")
    return pa.concat_tables(tables)


def _expand(paths: list[str], output: Path | None = None) -> list[str]:
    """Local folders become their files, sorted (so the row order is the same on every run), but
    those in ``output``."""
    files = []
    skip = output.resolve() if output is not None else None
    for path in paths:
        p = Path(path)
        if "://" not in path and p.is_dir():
            files += sorted(str(f) for f in p.rglob("*") if f.is_file() and not f.name.startswith((".", "_"))
                            and not (skip is not None and f.resolve().is_relative_to(skip)))
        elif "://" not in path and not p.exists():
            raise FileNotFoundError(f"input path {path} does not exist; list files or folders of prompts")
        else:
            files.append(path)
    return files


def _checked(value: Any, column: str) -> tuple[Any, str | None]:
    if value is None:  # a row without the column (another file of the input has it) or a null
        return None, f"row has no prompt in column {column!r}: missing or null"
    if isinstance(value, str):
        return (value, None) if value.strip() else (value, "empty prompt")
    if isinstance(value, list):
        if not value:
            return [], "empty prompt (no token ids)"
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return None, f"prompt token ids must be integers, got {value[:8]}"
        return value, None
    return None, f"prompt must be text or a list of token ids, got {type(value).__name__}: {str(value)[:80]}"
