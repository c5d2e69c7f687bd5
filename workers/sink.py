"""Report sinks: where a rank sends finished invokes' saves, shared values and errors.

Reports bypass vLLM's engine-core process, so large tensors never travel through it. For a single
local engine the sink is a folder (``dir:/path``): one report file (:mod:`report_file`) per batch
of invokes a rank reported together (a trace's invokes usually finish in the same step), written
under a ``.partial-*`` name and renamed into place once complete; the driver reads them as they
appear. The cluster's collector actor is another sink kind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

from interlace.workers.report_file import ReportFileWriter, read_report_file

SUFFIX = ".reports"


class DirSink:
    def __init__(self, root: str):
        self.root = Path(root)

    @contextlib.contextmanager
    def batch(self, trace: str, stage: int) -> Iterator[ReportFileWriter]:
        """A batch file being written: gather saves into ``batch.allocate(...)``'s tensors, then
        ``batch.finish(reports)``. It appears as ``<trace>/<stage>-<first invoke>.reports`` (unique:
        a stage reports each invoke once) when the block ends; a failure leaves no file behind."""
        folder = self.root / trace
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".partial-")
        try:
            batch = ReportFileWriter(fd)
            yield batch
            if batch.reports is None:
                raise RuntimeError("a report batch ended without finish(reports)")
        except BaseException:
            os.close(fd)
            os.unlink(tmp)  # saves already gathered into it stay readable: their mapping outlives the name
            raise
        os.close(fd)
        os.replace(tmp, folder / f"{stage}-{min(r['invoke'] for r in batch.reports)}{SUFFIX}")

    def write(self, trace: str, stage: int, reports: list[dict]) -> None:
        """A batch whose tensors are all pickled in its header (none gathered into the file)."""
        with self.batch(trace, stage) as batch:
            batch.finish(reports)


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


def open_sink(spec: str) -> DirSink:
    kind, _, where = spec.partition(":")
    if kind == "dir":
        return DirSink(where)
    raise ValueError(f"unknown report sink {spec!r}; expected 'dir:/path'")
