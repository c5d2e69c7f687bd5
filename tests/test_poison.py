"""A poison trace on a cluster: a program that ends its engine fails alone, once.

Two CPU replicas of the tiny Llama (their own local Ray, started and shut down here). One trace's
program ends its engine, by refusing to stop at its time limit (interlace's watchdog then ends the
worker) or by calling ``os._exit``; a dozen innocent traces of declarative ops run beside it, some
on the same engine. The poison trace must fail once, with its cause named, and never run again
(one engine restart); the innocent traces lost with that engine run again, without spending their
``max_retries``, and equal their clean run, each report counted once.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import interlace
from interlace import ops
from test_cluster import two_replicas

INNOCENT = 12
STEER = torch.linspace(-0.5, 0.5, 128)


@pytest.fixture(scope="module")
def cluster():
    # max_retries=0: an innocent shard that spent its budget on another trace's program would fail
    yield from two_replicas(max_in_flight=4, max_retries=0)


def innocent(target, i: int):
    """Innocent trace ``i``: four invokes of declarative ops."""
    tr = target.trace(max_tokens=4)
    for j in range(4):
        tr.invoke(f"Innocent {i}, invoke {j}:", ops=[ops.add("layers.1.resid", STEER * (j + 1)),
                                                      ops.save("layers.2.resid")])
    return tr


def swallow(m):
    """Catches the time limit's interruption, for ever: only ending its process stops it."""
    m.layers[0].resid
    while True:
        try:
            end = time.monotonic() + 0.2
            while time.monotonic() < end:
                pass
        except BaseException:  # noqa: BLE001 - the point of the test
            pass


def exits(m):
    """Holds its engine a moment (so innocent shards are running there), then ends the process."""
    m.layers[0].resid
    time.sleep(1.0)
    os._exit(1)


def same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.saves.keys() == w.saves.keys()
        for name in w.saves:
            torch.testing.assert_close(g.saves[name], w.saves[name], atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def clean(cluster):
    """The innocent traces run alone on the same cluster."""
    return [f.result(timeout=300) for f in [cluster.submit(innocent(cluster, i)) for i in range(INNOCENT)]]


def _whole_again(cluster) -> None:
    """Wait until every replica serves again (the next test starts from a whole cluster)."""
    deadline = time.monotonic() + 240
    while any(r["state"] != "alive" for r in cluster.status()["replicas"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(r["state"] == "alive" for r in cluster.status()["replicas"]), cluster.status()


@pytest.mark.parametrize("program, timeout_s, cause, message", [
    (swallow, 1, "time_limit", r"invoke 0's program ran past the trace's time limit of 1s and did not stop"),
    (exits, 30, "exited", r"invoke 0's program ended the engine's process while it ran"),
], ids=["swallows-its-time-limit", "os-exit"])
def test_a_program_that_ends_its_engine_fails_alone_and_once(cluster, clean, program, timeout_s, cause, message):
    import ray

    _whole_again(cluster)
    before = cluster.status()
    accepted = ray.get(cluster.collector.stats.remote())["accepted"]
    poison = cluster.trace(max_tokens=4, timeout_s=timeout_s)
    poison.invoke("Poison", program=program)
    futures = [cluster.submit(poison)] + [cluster.submit(innocent(cluster, i)) for i in range(INNOCENT)]

    with pytest.raises(interlace.ProgramEndedEngine, match=message) as failed:
        futures[0].result(timeout=120)
    assert isinstance(failed.value, interlace.WorkerDied)  # what a caller of earlier versions catches
    assert (failed.value.invoke, failed.value.cause) == (0, cause)
    assert "not run again" in str(failed.value)
    results = [f.result(timeout=300) for f in futures[1:]]
    for got, want in zip(results, clean):
        same(got, want)
    # Each innocent invoke's report counted once (the lost attempts' never, nor twice)
    assert ray.get(cluster.collector.stats.remote())["accepted"] - accepted == INNOCENT * 4
    assert ray.get(cluster.collector.stats.remote())["pending"] == 0

    after = cluster.status()
    restarts = sum(r["restarts"] for r in after["replicas"]) - sum(r["restarts"] for r in before["replicas"])
    assert restarts == 1, after  # the poison ended one engine and never ran again
    assert after["lost_to_programs"]["culprits"] - before["lost_to_programs"]["culprits"] == 1
    # innocent shards did share the dead engine (the case under test), and ran again free
    assert after["lost_to_programs"]["reruns"] > before["lost_to_programs"]["reruns"], after
    _whole_again(cluster)


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
