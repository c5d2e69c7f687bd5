"""Report sinks: where a rank sends each finished invoke's saves, shared values and errors.

Reports bypass vLLM's engine-core process, so large tensors never travel through it. For a single
local engine the sink is a folder (``dir:/path``): one file per (trace, invoke, stage), written
atomically; the driver collects them. The cluster's collector actor is another sink kind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


class DirSink:
    def __init__(self, root: str):
        self.root = Path(root)

    def write(self, trace: str, invoke: int, stage: int, report: dict) -> None:
        folder = self.root / trace
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".partial-")
        with os.fdopen(fd, "wb") as f:
            torch.save(report, f)
        os.replace(tmp, folder / report_name(invoke, stage))


def report_name(invoke: int, stage: int) -> str:
    return f"{invoke}.{stage}.pt"


def open_sink(spec: str) -> DirSink:
    kind, _, where = spec.partition(":")
    if kind == "dir":
        return DirSink(where)
    raise ValueError(f"unknown report sink {spec!r}; expected 'dir:/path'")
