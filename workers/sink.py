"""Report sinks: where a rank sends finished invokes' saves, shared values and errors.

Reports bypass vLLM's engine-core process, so large tensors never travel through it. For a single
local engine the sink is a folder (``dir:/path``): one file per batch of invokes a rank reported
together (a trace's invokes usually finish in the same step), written atomically; the driver
reads them as they appear. The cluster's collector actor is another sink kind.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.utils.serialization


class DirSink:
    def __init__(self, root: str):
        self.root = Path(root)

    def write(self, trace: str, stage: int, reports: list[dict]) -> None:
        """One file per batch: ``<trace>/<stage>-<first invoke>.pt`` is unique because a stage
        reports each invoke once."""
        folder = self.root / trace
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as f, _without_checksum():
                torch.save(reports, f)
        except BaseException:
            os.unlink(tmp)
            raise
        os.replace(tmp, folder / f"{stage}-{min(r['invoke'] for r in reports)}.pt")


@contextlib.contextmanager
def _without_checksum():
    """torch.save's CRC-32 of every byte takes ten times as long as writing them (1.4 s of 1.56 s
    for 512 MiB on 2 cores); a report lives on this machine for seconds and is renamed into place
    only once complete, so the checksum guards nothing here."""
    config = torch.utils.serialization.config.save
    before = config.compute_crc32
    config.compute_crc32 = False
    try:
        yield
    finally:
        config.compute_crc32 = before


def read_new_reports(folder: Path, seen: set[str]) -> list[dict]:
    """Reports in batch files of ``folder`` not read before (their names are added to ``seen``)."""
    reports: list[dict] = []
    for path in sorted(folder.glob("*.pt")) if folder.exists() else ():
        if path.name not in seen:
            seen.add(path.name)
            reports += torch.load(path, weights_only=False, mmap=True)  # tensors map the file: no copy
    return reports


def writing_reports(root: Path) -> bool:
    """Whether some rank is writing a report under ``root`` right now (its workers are alive)."""
    return any(root.glob("*/.partial-*"))


def open_sink(spec: str) -> DirSink:
    kind, _, where = spec.partition(":")
    if kind == "dir":
        return DirSink(where)
    raise ValueError(f"unknown report sink {spec!r}; expected 'dir:/path'")
