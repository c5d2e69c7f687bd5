"""Report sinks: where a rank sends finished invokes' saves, shared values and errors.

Reports bypass vLLM's engine-core process, so large tensors never travel through it. For a single
local engine the sink is a folder (``dir:/path``): per trace, one data file per rank holding the
saved rows, reserved ahead while the trace runs (in ``.data/``, reused by later traces once their
readers have dropped the rows), and one header file per batch of invokes a rank reported together
(a trace's invokes usually finish in the same step) in the trace's folder, written under a
``.partial-*`` name and renamed into place once complete; the driver reads them as they appear
(:mod:`report_file`). A batch of at most ``report_file.ROWS_IN_HEADER`` of rows (a server's
one-invoke trace) carries them in its header, and its trace needs no data file.

Used on each rank from its reporter thread only (a sink keeps the trace's open data files).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from interlace.core.janitor import remove_on_exit
from interlace.workers.report_file import DataFile, ReportFileWriter, read_report_file

SUFFIX = ".reports"
DATA = ".data"  # the sink's data files, and readers' claims on them
# Data files kept after their trace, for later traces to reuse: their pages stay allocated (and,
# on a GPU, pinned) while kept. A file still held by its readers counts too; past either limit
# the oldest is closed (its readers' views stay valid).
KEEP_FILES = 8
KEEP_BYTES = 4 << 30
_numbers = itertools.count()  # data file names: unique in the process, whichever sink makes them


class DirSink:
    def __init__(self, root: str):
        self.root = Path(root)
        self._data: dict[tuple[str, int], DataFile] = {}  # (trace, stage) -> its open data file
        self._kept: list[DataFile] = []  # data files of finished traces, oldest first

    def reserve(self, trace: str, stage: int, nbytes: int) -> None:
        """Have the trace's data file hold ``nbytes`` (all its batches' rows) allocated and mapped."""
        self._data_file(trace, stage).reserve(nbytes)

    def close(self, trace: str, stage: int) -> None:
        """The trace's last batch on this rank is written: keep its data file for a later trace."""
        data = self._data.pop((trace, stage), None)
        if data is None:
            return
        self._kept.append(data)
        while len(self._kept) > KEEP_FILES or sum(d.reserved for d in self._kept) > KEEP_BYTES:
            self._kept.pop(0).close()

    def close_all(self) -> None:
        """Let go of every data file (the engine is gone): readers' views stay valid."""
        for data in [*self._data.values(), *self._kept]:
            data.close()
        self._data, self._kept = {}, []

    @contextlib.contextmanager
    def batch(self, trace: str, stage: int) -> Iterator[ReportFileWriter]:
        """A batch being written: gather saves into ``batch.allocate(...)``'s tensors, then
        ``batch.finish(reports)``. It appears as ``<trace>/<stage>-<first invoke>.reports`` (unique:
        a stage reports each invoke once) when the block ends; a failure leaves no header behind
        (its region of the data file stays unused)."""
        folder = self.root / trace
        folder.mkdir(parents=True, exist_ok=True)  # (the data file that made it is made only for many rows)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".partial-")
        try:
            batch = ReportFileWriter(fd, functools.partial(self._data_file, trace, stage), folder)
            yield batch
            if batch.reports is None:
                raise RuntimeError("a report batch ended without finish(reports)")
            os.replace(tmp, folder / f"{stage}-{min(r['invoke'] for r in batch.reports)}{SUFFIX}")
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # saves already gathered stay readable: their mapping outlives the name
            raise
        if batch.has_region:
            batch.data.watch(fd)  # kept open: its link count says when the region is nobody's any more
        else:
            os.close(fd)

    def write(self, trace: str, stage: int, reports: list[dict]) -> None:
        """A batch whose tensors are all pickled in its header (none gathered into the data file)."""
        with self.batch(trace, stage) as batch:
            batch.finish(reports)

    def _data_file(self, trace: str, stage: int) -> DataFile:
        """The trace's data file: a kept one no reader holds any more, or a new one."""
        if (trace, stage) not in self._data:
            (self.root / trace).mkdir(parents=True, exist_ok=True)
            data = next((d for d in self._kept if d.free()), None)
            if data is not None:
                self._kept.remove(data)
                data.restart()
            else:
                folder = self.root / DATA
                folder.mkdir(parents=True, exist_ok=True)
                data = DataFile(folder / f"{stage}-{os.getpid()}-{next(_numbers)}.data")
            self._data[(trace, stage)] = data
        return self._data[(trace, stage)]


# A trace's programs and op lists larger than this travel once, as a file in the trace's folder
# (``park``), not in each of its requests: every request's bytes are copied into vLLM's engine core
# and again to every rank, so a batched program holding a 64 MiB tensor cost a 64-invoke trace 4 GiB
# of copies, and a 256-invoke one more memory than the machine had. Smaller ones stay inline (a file
# per trace would cost a per-invoke trace's start more than their copies do).
INLINE_BYTES = 64 << 10


def parked_path(sink: str, trace: str, part: str, key: str) -> Path:
    """Where a ``dir:`` sink's trace keeps a parked program or op list (``part``) of ``key``."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]  # an op list's key is long, and not a file name
    return Path(sink.removeprefix("dir:")) / trace / f"{part}-{digest}.pickle"


def park(sink: str, trace: str, part: str, key: str, data: bytes) -> None:
    """Write ``data`` where the ranks read it (:func:`parked_path`), once per trace and key: a
    complete file or none (written under another name, then renamed)."""
    path = parked_path(sink, trace, part, key)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".park-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


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
    """Remove a trace's folder once its reports are read: headers only (rows read from it are views
    of the data file, which the rank keeps)."""
    shutil.rmtree(folder, ignore_errors=True)


def writing_reports(root: Path) -> bool:
    """Whether some rank is writing a report under ``root`` right now (its workers are alive)."""
    return any(root.glob("*/.partial-*"))


class RaySink(DirSink):
    """The sink of a replica whose ranks are spread over Ray nodes (cluster/placement.py), spec
    ``ray:<node id>:<namespace>:<inbox actor>:/path``. A rank on the replica's node (``node id``)
    writes the replica's folder ``/path``, as :class:`DirSink` does. A rank on another node writes
    each batch into a folder of its own node, then hands the batch's reports to the replica's
    inbox actor on that node (``cluster/replica.py`` ``ReportInbox``), which writes them into the
    folder: nodes share no file system, and Ray carries the saves. The call waits for the answer, on this rank's reporter thread (off
    the step path), so a batch is in the replica's folder before the next one is written.

    The folder of its own goes with the rank however the rank ends (Ray kills it with its replica:
    no code of the rank runs then), and each trace's folder in it once its batches are sent:
    every spread replica left one such folder on each other node, holding an empty folder per
    trace its rank had reported and the data files it kept for reuse (up to ``KEEP_BYTES``)."""

    def __init__(self, node: str, namespace: str, actor: str, folder: str):
        import ray  # only here: a rank of a spread replica is a Ray worker already

        self.local = ray.get_runtime_context().get_node_id() == node
        self._inbox = None if self.local else ray.get_actor(actor, namespace=namespace)
        if not self.local:
            folder = tempfile.mkdtemp(prefix="interlace-remote-reports-")
            remove_on_exit(folder)
        super().__init__(folder)

    @contextlib.contextmanager
    def batch(self, trace: str, stage: int) -> Iterator[ReportFileWriter]:
        with super().batch(trace, stage) as batch:
            yield batch
        if not self.local:
            self._send(trace, stage)

    def _send(self, trace: str, stage: int) -> None:
        import ray

        folder = self.root / trace
        for path in sorted(folder.glob(f"*{SUFFIX}")):
            ray.get(self._inbox.deliver.remote(trace, stage, read_report_file(path)))
            path.unlink()
        with contextlib.suppress(OSError):  # empty now: the trace's next batch here (if any) makes it again
            folder.rmdir()


_SINKS: dict[str, DirSink] = {}


def open_sink(spec: str) -> DirSink:
    """The sink for ``spec``, one per process (it keeps the traces' open data files)."""
    kind, _, where = spec.partition(":")
    if spec not in _SINKS:
        if kind == "dir":
            _SINKS[spec] = DirSink(where)
        elif kind == "ray":
            _SINKS[spec] = RaySink(*where.split(":", 3))
        else:
            raise ValueError(f"unknown report sink {spec!r}; expected 'dir:/path' or 'ray:<node>:<namespace>:<actor>:/path'")
    return _SINKS[spec]


def close_sink(spec: str) -> None:
    """Close this process's sink for ``spec``, if it has one: an engine run in the driver's own
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) was shut down, and its rank's data files would
    otherwise stay mapped (and pinned, on a GPU) until the process ends, up to KEEP_BYTES per
    engine. A rank in a process of its own lets go of them when that process ends."""
    sink = _SINKS.pop(spec, None)
    if sink is not None:
        sink.close_all()
