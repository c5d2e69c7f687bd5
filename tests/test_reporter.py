"""The reporter thread: its torch work starts no OpenMP team beside the engine's."""

from __future__ import annotations

import os
import threading

import torch

from interlace.workers.reporter import Reporter


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_a_large_torch_op_in_a_report_job_starts_no_openmp_threads():
    """A report job's large gather runs on the reporter's thread alone. A second OpenMP team (one
    per thread that starts parallel work) beside the engine's left more OpenMP threads than cores,
    and a CPU engine then ran at 0.57 of its speed for the rest of the process (reporter.py)."""
    torch.zeros(1 << 22).add_(1)  # this thread's team (the engine's), started now if not before
    before = _threads()
    done = threading.Event()
    threads_in_job: list[set[str]] = []

    def job():
        torch.zeros(1 << 22).add_(1)  # parallel work, as gathering a large report is
        torch.randn(1 << 21).index_select(0, torch.arange(1 << 20))
        threads_in_job.append(_threads())
        done.set()

    Reporter().submit(job)
    assert done.wait(30)
    assert len(threads_in_job[0] - before) == 1  # the reporter's own thread, nothing else
