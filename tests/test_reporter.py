"""The reporter thread: its torch work starts no OpenMP team beside the engine's."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a process of its own: a test process has other threads coming and going (its engines',
# Ray's, earlier tests' helpers), which a count of the process's threads would take for OpenMP's.
_PROBE = """
import os, sys, threading, torch
from interlace.workers.reporter import Reporter

def threads():
    return set(os.listdir("/proc/self/task"))

if sys.argv[1] != "unset":  # torch's process-wide count, as an engine may have set it
    torch.set_num_threads(int(sys.argv[1]))
torch.zeros(1 << 22).add_(1)  # this thread's team (the engine's), started now
before = threads()
seen, done = [], threading.Event()

def job():
    torch.zeros(1 << 22).add_(1)  # parallel work, as gathering a large report is
    torch.randn(1 << 21).index_select(0, torch.arange(1 << 20))
    seen.append(threads())
    done.set()

Reporter().submit(job)
assert done.wait(30)
print(len(seen[0] - before))
"""


@pytest.mark.parametrize("torch_threads", ["unset", "1", "2"])
def test_a_large_torch_op_in_a_report_job_starts_no_openmp_threads(torch_threads):
    """A report job's large gather runs on the reporter's thread alone. A second OpenMP team (one
    per thread that starts parallel work) beside the engine's left more OpenMP threads than cores,
    and a CPU engine then ran at 0.57 of its speed for the rest of the process (reporter.py)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, torch_threads], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1"]  # the reporter's own thread, nothing else
