"""Report sinks: where a rank sends finished invokes' saves, shared values and errors.

Reports bypass vLLM's engine-core process, so large tensors never travel through it. For a single
local engine the sink is a folder (``dir:/path``): per trace, one data file per rank holding the
saved rows, reserved ahead while the trace runs, and one header file per batch of invokes a rank
reported together (a trace's invokes usually finish in the same step), written under a
``.partial-*`` name and renamed into place once complete; the driver reads them as they appear
(:mod:`report_file`). The cluster's collector actor is another sink kind.

Used on each rank from its reporter thread only (a sink keeps the trace's open data files).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from interlace.workers.report_file import DataFile, ReportFileWriter, read_report_file

SUFFIX = ".reports"


class DirSink:
    def __init__(self, root: str):
        self.root = Path(root)
        self._data: dict[tuple[str, int], DataFile] = {}  # (trace, stage) -> its open data file
        self._numbers = itertools.count()

    def reserve(self, trace: str, stage: int, nbytes: int) -> None:
        """Have the trace's data file hold ``nbytes`` (all its batches' rows) allocated and mapped."""
        self._data_file(trace, stage).reserve(nbytes)

    def close(self, trace: str, stage: int) -> None:
        """The trace's last batch on this rank is written: truncate and close its data file."""
        data = self._data.pop((trace, stage), None)
        if data is not None:
            data.close()

    @contextlib.contextmanager
    def batch(self, trace: str, stage: int) -> Iterator[ReportFileWriter]:
        """A batch being written: gather saves into ``batch.allocate(...)``'s tensors, then
        ``batch.finish(reports)``. It appears as ``<trace>/<stage>-<first invoke>.reports`` (unique:
        a stage reports each invoke once) when the block ends; a failure leaves no header behind
        (its region of the data file stays unused)."""
        data = self._data_file(trace, stage)
        fd, tmp = tempfile.mkstemp(dir=data.path.parent, prefix=".partial-")
        try:
            batch = ReportFileWriter(fd, data)
            yield batch
            if batch.reports is None:
                raise RuntimeError("a report batch ended without finish(reports)")
        except BaseException:
            os.close(fd)
            os.unlink(tmp)  # saves already gathered stay readable: their mapping outlives the name
            raise
        os.close(fd)
        os.replace(tmp, data.path.parent / f"{stage}-{min(r['invoke'] for r in batch.reports)}{SUFFIX}")

    def write(self, trace: str, stage: int, reports: list[dict]) -> None:
        """A batch whose tensors are all pickled in its header (none gathered into the data file)."""
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


def discard(folder: Path) -> None:
    """Remove a trace's folder once its reports are read, without waiting for it. The rank that
    wrote them may still be truncating the trace's data file (giving back the pages it reserved
    ahead and no batch used), and removing the file waits for that: about 35 ms per 128 MiB of
    /dev/shm on a 2-core CPU and an H100 host alike, after the trace's last report, which was the
    caller's time. Saves read from the folder stay valid: their mappings outlive it."""
    hidden = folder.with_name(f".discarded-{folder.name}")
    try:
        os.rename(folder, hidden)  # the name is free at once; the files go in the background
    except FileNotFoundError:
        return
    except OSError:  # e.g. a discarded folder of that name is still being removed
        hidden = folder
    threading.Thread(target=shutil.rmtree, args=(hidden, True), name="interlace-discard", daemon=True).start()


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
