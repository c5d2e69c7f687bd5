"""Report sinks: where a rank sends finished invokes' saves, shared values and errors.

Reports bypass vLLM's engine-core process, so large tensors never travel through it. For a single
local engine the sink is a folder (``dir:/path``): per trace, one data file per rank holding the
saved rows, laid out in runs as they arrive while the trace runs (saves.py), and one header file
per batch of invokes a rank reported together (a trace's invokes usually finish in the same step),
written under a ``.partial-*`` name and renamed into place once complete; the driver reads them as
they appear (:mod:`report_file`). The cluster's collector actor is another sink kind.

Used on each rank from its reporter thread only (a sink keeps the trace's open data files).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import tempfile
from pathlib import Path
from typing import Iterator

from interlace.workers.report_file import DataFile, ReportFileWriter, read_report_file
from interlace.workers.saves import SaveChunk, SavedRows

SUFFIX = ".reports"
_SPARE_BYTES = 64 << 20  # room a folder must keep beyond a chunk's rows for them to be written


class DirSink:
    def __init__(self, root: str):
        self.root = Path(root)
        self._data: dict[tuple[str, int], DataFile] = {}  # (trace, stage) -> its open data file
        self._rows: dict[tuple[str, int], SavedRows] = {}  # (trace, stage) -> its saved rows, in that file
        self._lost: dict[tuple[str, int], Exception] = {}  # (trace, stage) -> why its saves are lost
        self._numbers = itertools.count()

    def take_in(self, stage: int, chunk: SaveChunk) -> None:
        """Lay out a chunk of saved rows in its trace's data file (see saves.py). If that fails,
        the trace's saves on this rank are lost, and :meth:`take` says why.

        Memory of the data file is taken as rows are written: a folder without room for them
        fails here with ENOSPC rather than the worker with SIGBUS at the write.
        """
        key = (chunk.trace, stage)
        if key in self._lost:
            return
        try:
            data = self._data_file(*key)
            folder = os.statvfs(data.path.parent)
            if folder.f_bavail * folder.f_frsize < chunk.rows.nbytes + _SPARE_BYTES:
                raise OSError(errno.ENOSPC, f"no room for saves under {data.path.parent} "
                              f"({folder.f_bavail * folder.f_frsize >> 20} MiB free)")
            if key not in self._rows:
                self._rows[key] = SavedRows(data.region)
            self._rows[key].take_in(chunk)
        except Exception as exc:  # noqa: BLE001 - reported with the trace's invokes
            self._lost[key] = exc
            self._rows.pop(key, None)

    def take(self, trace: str, stage: int, owners: list[int]) -> list[dict]:
        """The owners' saved rows by name (views of the data file); forgets them."""
        lost = self._lost.get((trace, stage))
        if lost is not None:
            raise RuntimeError(f"saved rows could not be stored: {lost}") from lost
        rows = self._rows.get((trace, stage))
        return rows.take(owners) if rows is not None else [{} for _ in owners]

    def close(self, trace: str, stage: int) -> None:
        """The trace's last batch on this rank is written: truncate and close its data file."""
        self._rows.pop((trace, stage), None)
        self._lost.pop((trace, stage), None)
        data = self._data.pop((trace, stage), None)
        if data is not None:
            data.close()

    @contextlib.contextmanager
    def batch(self, trace: str, stage: int) -> Iterator[ReportFileWriter]:
        """A batch being written: ``batch.finish(reports)``, with saves taken from :meth:`take`.
        It appears as ``<trace>/<stage>-<first invoke>.reports`` (unique: a stage reports each
        invoke once) when the block ends; a failure leaves no header behind."""
        data = self._data_file(trace, stage)
        fd, tmp = tempfile.mkstemp(dir=data.path.parent, prefix=".partial-")
        try:
            batch = ReportFileWriter(fd, data)
            yield batch
            if batch.reports is None:
                raise RuntimeError("a report batch ended without finish(reports)")
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, data.path.parent / f"{stage}-{min(r['invoke'] for r in batch.reports)}{SUFFIX}")

    def write(self, trace: str, stage: int, reports: list[dict]) -> None:
        """A batch written at once."""
        with self.batch(trace, stage) as batch:
            batch.finish(reports)

    def _data_file(self, trace: str, stage: int) -> DataFile:
        if (trace, stage) not in self._data:
            folder = self.root / trace
            folder.mkdir(parents=True, exist_ok=True)
            name = f"{stage}-{os.getpid()}-{next(self._numbers)}.data"
            self._data[(trace, stage)] = DataFile(folder / name)
        return self._data[(trace, stage)]


def read_new_reports(folder: Path, seen: set[str]) -> list[dict]:
    """Reports in batch files of ``folder`` not read before (their names are added to ``seen``).
    Saved rows are views of the file, mapped copy-on-write: not copied, and removing the folder
    afterwards is safe."""
    reports: list[dict] = []
    for path in sorted(folder.glob(f"*{SUFFIX}")) if folder.exists() else ():
        if path.name not in seen:
            seen.add(path.name)
            reports += read_report_file(path)
    return reports


def writing_reports(root: Path) -> bool:
    """Whether some rank is writing a report under ``root`` right now (its workers are alive)."""
    return any(root.glob("*/.partial-*"))


_SINKS: dict[str, DirSink] = {}


def open_sink(spec: str) -> DirSink:
    """The sink for ``spec``, one per process (it keeps the traces' open data files)."""
    kind, _, where = spec.partition(":")
    if kind == "dir":
        return _SINKS.setdefault(spec, DirSink(where))
    raise ValueError(f"unknown report sink {spec!r}; expected 'dir:/path'")
