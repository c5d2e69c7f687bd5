"""A program that ends its engine's process is named by the flight record it leaves.

The poison trace itself, on a cluster (a program that ends its engine fails alone and once), runs
on tests/test_cluster.py's two replicas: it needs the same cluster, and starting it again here
cost a Ray and two replica starts.
"""

from __future__ import annotations


def test_a_flight_record_outlives_its_process_and_names_the_program(tmp_path):
    """No engine: a process enters a program's record and ends itself; the record says so. A
    record left idle, or one of a live process, names nothing."""
    import subprocess
    import sys

    from interlace.workers.flight import FlightRecorder, culprit, read_records

    script = f"""
import os
from pathlib import Path
from interlace.workers.flight import FlightRecorder
recorder = FlightRecorder(Path({str(tmp_path)!r}))
recorder.entry("t1.0.0", 2, 30.0).enter(); recorder.leave()  # a program that returned
recorder.entry("t2.0.3", 5, 30.0).enter()
os._exit(1)
"""
    assert subprocess.run([sys.executable, "-c", script]).returncode == 1
    live = FlightRecorder(tmp_path)  # this process: its record names nothing while it lives
    live.entry("t3.0.0", 0, 30.0).enter()
    records = read_records(tmp_path)
    assert [(r["trace"], r["invoke"], r["state"]) for r in records] == [("t2.0.3", 5, "running")]
    assert culprit(records)["trace"] == "t2.0.3"
    live.leave()
    # stages that ran different programs when they went down: nobody is blamed
    assert culprit([{**records[0], "invoke": 6}, records[0]]) is None
    assert culprit([{**records[0], "invoke": 6, "state": "overran"}, records[0]])["invoke"] == 6
