"""Every ``INTERLACE_*`` environment setting, read in one place.

    INTERLACE_CACHE      where embedded models are built (default ~/.cache/interlace)
    INTERLACE_DEVICE     "cpu" or "cuda"; default: cuda when torch sees a GPU, else cpu
    INTERLACE_TRACE_TIMEOUT  seconds one trace's programs may run in total before they are cut off
    INTERLACE_DEVICE_SAVES_GIB  GPU memory (GiB) a worker rank may keep saved rows in until they
                         are reported (default 2; at most half the memory free at the first save);
                         past it, saves are copied to pinned host memory as they are made
    INTERLACE_REPLAY_LOG_MIB  host memory (MiB) each program invoke's write log may take (default
                         64; 0: keep none): what a preempted request's program wrote, replayed on
                         the recomputed rows (workers/write_log.py)
    INTERLACE_CPU_CORES  CPU engines: the cores an engine's ranks are bound to, round-robin
                         ("0", "2,3"); default: every core the process may use. A cluster sets it
                         per replica through the replica actor's runtime_env.
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


def device_saves_bytes() -> int:
    return int(float(os.environ.get("INTERLACE_DEVICE_SAVES_GIB", "2")) * 2**30)


def replay_log_bytes() -> int:
    return int(float(os.environ.get("INTERLACE_REPLAY_LOG_MIB", "64")) * 2**20)


def cpu_cores() -> list[int] | None:
    cores = os.environ.get("INTERLACE_CPU_CORES")
    return [int(c) for c in cores.split(",")] if cores else None


MIN_SHM_BYTES = 4 << 30  # report folders go to /dev/shm only with at least this much free


def fast_tmp_dir() -> str | None:
    """Memory-backed /dev/shm for reports when it has room (containers often give it 64 MiB),
    else the system's temporary folder."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return None
    stats = os.statvfs(shm)
    return str(shm) if stats.f_bavail * stats.f_frsize >= MIN_SHM_BYTES else None
