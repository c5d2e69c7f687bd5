"""Every ``INTERLACE_*`` environment setting, read in one place.

    INTERLACE_CACHE      where embedded models are built (default ~/.cache/interlace)
    INTERLACE_DEVICE     "cpu" or "cuda"; default: cuda when torch sees a GPU, else cpu
    INTERLACE_TRACE_TIMEOUT  seconds one trace's programs may run in total before they are cut off
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("INTERLACE_CACHE", Path.home() / ".cache" / "interlace"))


def device() -> str:
    forced = os.environ.get("INTERLACE_DEVICE")
    if forced:
        return forced
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def trace_timeout_s() -> float:
    return float(os.environ.get("INTERLACE_TRACE_TIMEOUT", "60"))
