"""The Ray cluster: two CPU replicas of the tiny Llama, a collector, results equal to one engine.

One local Ray (started here, shut down at the end) with 2 logical CPUs: each replica's one rank
takes a bundle of 1 CPU and its engine is bound to its own core (replica 0 to core 0, replica 1
to core 1); the replica actors take 0.01 CPU each and the collector none. The single-engine
reference is the session's ``llama`` Model. The same two replicas also meet a poison trace
(a program that ends its engine) at the end.
"""

from __future__ import annotations

import importlib
import os
import signal
import time

import psutil
import pytest
import torch

import interlace
from interlace import ops
from interlace.cluster.config import ClusterConfig
from interlace.cluster.shards import joined_invokes, plan_shards
from interlace.core.trace import Invoke
from conftest import shared_memory_files

MAX_IN_FLIGHT = 4
ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2  # TF32 matmuls and TP's reduction order on GPUs

STEER = torch.linspace(-0.5, 0.5, 128)


def keep(m):
    m.save("r1", m.layers[1].resid)
    m.save("logits", m.logits)


def steer_and_share(m):
    m.layers[1].resid += 0.25
    m.save("r2", m.layers[2].resid)
    m.share("total", m.layers[2].resid.sum(), merge="sum")


@interlace.batched
def pooled(m):
    last = m.last(m.layers[2].resid)  # [invokes here, hidden]
    m.save("last", last)
    m.share("sum", last, merge="sum")  # one row per invoke: each invoke contributes its own
    m.share("mean", last, merge="mean")
    m.share("rows", last, merge="concat")


def two_replicas(**fields):
    """A two-replica CPU cluster of the tiny Llama on a local Ray this generator starts; on exit,
    no replica process may be left (a module fixture's body: ``yield from two_replicas()``)."""
    import ray

    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=400 << 20)
    config = ClusterConfig(model="tiny-llama", replicas=2, cpu_cores=[[0], [1]], **fields)
    handle = interlace.Cluster(config)
    pids = [info["pid"] for info in handle.replica_info()]
    yield handle
    handle.close()
    ray.shutdown()
    deadline = time.monotonic() + 1  # as long as before: gone within a second of Ray's shutdown
    while [pid for pid in pids if psutil.pid_exists(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if psutil.pid_exists(pid)], "replica processes left behind"


@pytest.fixture(scope="module")
def cluster():
    yield from two_replicas(max_in_flight=MAX_IN_FLIGHT)


def build(target, i: int):
    """Trace number ``i`` of a mixed workload: programs, declarative ops, plain invokes."""
    tr = target.trace(max_tokens=3 + i % 3)
    kind = i % 4
    if kind == 0:
        tr.invoke(f"The number {i} is", program=keep)
    elif kind == 1:
        tr.invoke(f"Once upon a time {i}", ops=[ops.add("layers.1.resid", STEER), ops.save("layers.3.resid")])
    elif kind == 2:
        tr.invoke(f"Steer {i}", program=steer_and_share)
        tr.invoke(f"Plain {i}")
        tr.invoke([5, 6, 7, i % 50 + 10], program=steer_and_share)
    else:
        tr.invoke(f"Only plain {i}")
    return tr


def assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.saves.keys() == w.saves.keys()
        for name in w.saves:
            torch.testing.assert_close(g.saves[name], w.saves[name], atol=ATOL, rtol=ATOL)
    assert got.shared.keys() == want.shared.keys()
    for name in want.shared:
        # sums over invokes, added in another order than the reference's
        torch.testing.assert_close(got.shared[name], want.shared[name], atol=max(ATOL, 1e-3), rtol=max(ATOL, 1e-4))


_REFERENCES: dict[tuple[str, int], object] = {}


def reference(llama, count: int) -> list:
    """The first ``count`` traces of :func:`build`, each run alone on the single engine. Each is
    run once per session and kept: the same trace on the same engine gives the same result, and
    several tests (here and in the modules importing this) compare with the same ones."""
    for i in range(count):
        key = (llama.config.name, i)
        if key not in _REFERENCES:
            _REFERENCES[key] = build(llama, i).run()
    return [_REFERENCES[(llama.config.name, i)] for i in range(count)]


def test_two_replicas_serve_a_mixed_workload_equal_to_one_engine(cluster, llama):
    count = 208
    futures = [cluster.submit(build(cluster, i)) for i in range(count)]
    results = [f.result(timeout=300) for f in futures]
    for got, want in zip(results, reference(llama, count)):
        assert_same(got, want)
    served = [r["shards_served"] for r in cluster.status()["replicas"]]
    assert all(n > count // 8 for n in served), served  # both replicas did real work


def test_a_large_trace_is_split_across_replicas_and_its_shared_values_merge(cluster, llama):
    prompts = [f"Sample {i} of the sweep" for i in range(64)]
    invokes = [Invoke(p, pooled) for p in prompts]
    assert joined_invokes(invokes) == []  # a batched program without send/recv: independent
    assert [len(s) for s in plan_shards(64, [], 2, cluster.config.min_shard_invokes)] == [32, 32]
    before = [r["shards_served"] for r in cluster.replica_info()]
    results = []
    for target in (cluster, llama):
        with target.trace(max_tokens=2) as tr:
            for p in prompts:
                tr.invoke(p, program=pooled)
        results.append(tr.result)
    after = [r["shards_served"] for r in cluster.replica_info()]
    assert all(a == b + 1 for a, b in zip(after, before)), (before, after)  # one shard on each
    got, want = results
    assert_same(got, want)
    assert got.shared["rows"].numel() == 64 * 2 * 128  # every invoke's last row, at both steps


def test_shared_values_of_every_dtype_come_back_through_the_collector(cluster, llama):
    """Shared contributions cross Ray twice (replica to collector, collector to driver), where
    torch's own pickling cannot read back uint16, float8 or complex32 tensors: such a trace
    failed with "UntypedStorage has no attribute 'dtype'". They come back as on one engine."""

    def program(m):
        h = m.layers[0].resid.float()[-1:]
        m.share("u16", (h * 1000).to(torch.int64).to(torch.uint16), merge="append")
        m.share("f8", h.to(torch.float8_e4m3fn), merge="concat")
        m.share("c32", h.to(torch.complex32), merge="append")

    results = []
    for target in (cluster, llama):
        with target.trace(max_tokens=2) as tr:
            tr.invoke("The capital of France is", program=program)
            tr.invoke("Once upon a time", program=program)
        results.append(tr.result.shared)
    got, want = results
    assert [v.dtype for v in got["u16"]] == [torch.uint16] * 4 and got["f8"].dtype == torch.float8_e4m3fn
    for name in ("u16", "c32"):
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got[name], want[name]))
    assert torch.equal(got["f8"].view(torch.uint8), want["f8"].view(torch.uint8))


def test_the_collector_counts_a_duplicated_or_stale_report_once(cluster):
    import ray

    from interlace.cluster.collector import start_collector
    from interlace.core.wire import Report

    collector = start_collector()
    try:
        ray.get(collector.expect.remote("t1", [(0, 0), (1, 0)]))
        first = Report("t1", 0, 0, 0, {}, [("n", "sum", 1.0)])
        assert ray.get(collector.report.remote([first])) == 1
        assert ray.get(collector.report.remote([first])) == 0  # replayed: dropped
        ray.get(collector.report.remote([Report("t1", 1, 0, 0, {}, [("n", "sum", 100.0)])]))
        ray.get(collector.retry.remote("t1", [(1, 0)], 1))  # invoke 1 re-run: its attempt 0 no longer counts
        ray.get(collector.report.remote([Report("t1", 1, 0, 0, {}, [("n", "sum", 100.0)])]))  # stale
        ray.get(collector.report.remote([Report("t1", 1, 0, 1, {}, [("n", "sum", 2.0)])]))
        ray.get(collector.report.remote([Report("t1", 1, 0, 1, {}, [("n", "sum", 2.0)])]))  # duplicate
        delivered = ray.get(collector.take.remote("t1", 10))
        assert delivered.shared == {"n": 3.0}
        assert ray.get(collector.take.remote("t1", 10)) is None  # delivered once, then freed
        assert ray.get(collector.stats.remote()) == {"pending": 0, "accepted": 3, "dropped": 3}
    finally:
        ray.kill(collector)


def test_a_thousand_traces_never_exceed_the_in_flight_bound(cluster):
    futures = []
    for i in range(1000):
        tr = cluster.trace(max_tokens=1)
        tr.invoke(f"bound {i}", ops=[ops.save("layers.0.resid")] if i % 2 else ())
        futures.append(cluster.submit(tr))
    assert cluster.status()["held"] > 2 * MAX_IN_FLIGHT  # queued on the driver, not on replicas
    assert all(len(f.result(timeout=300)[0].token_ids) == 1 for f in futures)
    seen = [info["max_in_flight_seen"] for info in cluster.replica_info()]
    assert max(seen) == MAX_IN_FLIGHT and all(n <= MAX_IN_FLIGHT for n in seen), seen
    assert cluster.status()["held"] == 0


def _replicas_running(cluster) -> int:
    return sum(info["in_flight"] for info in cluster.replica_info())


def test_a_cancelled_future_stops_its_shard_and_a_trace_runs_as_submitted(cluster, llama):
    """``future.cancel()`` used to leave the replica generating the whole shard for nobody; an
    invoke added to a submitted trace failed it with an IndexError."""
    def slow(m):
        time.sleep(0.05)  # 400 steps: 20 s unless the replica aborts the shard

    tr = cluster.trace(max_tokens=400, ignore_eos=True)
    tr.invoke("Cancel me", program=slow)
    future = cluster.submit(tr)
    deadline = time.monotonic() + 60
    while not _replicas_running(cluster):
        assert time.monotonic() < deadline, "the shard never started"
        time.sleep(0.05)
    assert future.cancel()
    assert cluster.status()["queued"] >= 0
    stopped = time.monotonic() + 5
    while _replicas_running(cluster):
        assert time.monotonic() < stopped, "the replica still runs the cancelled trace's shard"
        time.sleep(0.1)
    assert cluster.status()["held"] == 0

    first = cluster.trace(max_tokens=3)
    first.invoke("First prompt")
    submitted = cluster.submit(first)
    first.invoke("Second prompt")  # the next trace's, not the one in flight
    assert [r.token_ids for r in submitted.result(timeout=120)] == [llama.generate("First prompt", max_tokens=3).token_ids]
    both = cluster.submit(first).result(timeout=120)
    assert [r.token_ids for r in both] == [llama.generate(p, max_tokens=3).token_ids for p in ("First prompt", "Second prompt")]


def test_the_cluster_refuses_what_a_model_refuses_before_sending(cluster, llama):
    import ray

    accepted = ray.get(cluster.collector.stats.remote())["accepted"]
    for target in (llama, cluster):  # the same check, the same message, nothing sent
        tr = target.trace(max_tokens=2)
        tr.invoke("Hello", ops=[ops.save("layers.1.resid", steps=[0, 2])])
        with pytest.raises(ValueError, match=r"steps \[2\] never run in a trace with max_tokens=2"):
            tr.run()
        with pytest.raises(ValueError, match="no invokes"):
            target._run(target.trace())
    with pytest.raises(TypeError, match=r"submit\(\) takes a trace .* got str 'Hello'"):  # (an AttributeError)
        cluster.submit("Hello")
    assert ray.get(cluster.collector.stats.remote())["accepted"] == accepted
    with pytest.raises(ValueError, match="enforce_eager=False"):  # before any replica starts
        interlace.Cluster(cluster.config, enforce_eager=False)


def test_restarting_the_collector_mid_run_reruns_its_traces_exactly_once(cluster, llama):
    import ray

    count = 40
    want = reference(llama, count)
    victim = ray.get(cluster.collector.pid.remote())
    futures = [cluster.submit(build(cluster, i)) for i in range(count)]
    while sum(f.done() for f in futures) < 4:
        time.sleep(0.01)
    os.kill(victim, signal.SIGKILL)
    results = [f.result(timeout=300) for f in futures]  # each future resolves once
    for got, ref in zip(results, want):
        assert_same(got, ref)
    assert ray.get(cluster.collector.pid.remote()) != victim  # Ray restarted it
    assert cluster.status()["reruns"] > 0  # traces in flight lost their reports and ran again
    assert ray.get(cluster.collector.stats.remote())["pending"] == 0  # nothing held after delivery
    again = [cluster.submit(build(cluster, i)) for i in range(4)]
    for got, ref in zip([f.result(timeout=120) for f in again], want):
        assert_same(got, ref)


def _engine_core(replica_pid: int) -> int:
    # Among all descendants: on a CPU the replica's fork server forks it (cluster/engine_processes.py).
    children = psutil.Process(replica_pid).children(recursive=True)
    named = [c for c in children if "EngineCore" in c.name() + " ".join(c.cmdline())]
    return (named or psutil.Process(replica_pid).children())[0].pid


@pytest.mark.parametrize("victim", [0, 1])  # a second kill, of the other replica, after the first healed
def test_killing_a_replicas_engine_mid_run_reruns_its_traces_exactly_once(cluster, llama, victim):
    count = 60
    want = reference(llama, count)
    replica = cluster.status()["replicas"][victim]
    assert replica["state"] == "alive" and replica["restarts"] == 0
    futures = [cluster.submit(build(cluster, i)) for i in range(count)]
    while sum(f.done() for f in futures) < 6:
        time.sleep(0.01)
    root = psutil.Process(replica["pid"])
    segments = shared_memory_files([root, *root.children(recursive=True)])  # vLLM's queues between the engine's processes
    assert segments
    os.kill(_engine_core(replica["pid"]), signal.SIGKILL)
    results = [f.result(timeout=300) for f in futures]  # each future resolves once
    for got, ref in zip(results, want):
        assert_same(got, ref)
    assert cluster.status()["replicas"][victim]["restarts"] == 1
    deadline = time.monotonic() + 240  # leave the cluster whole for whoever runs next
    while cluster.status()["replicas"][victim]["state"] != "alive" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.status()["replicas"][victim]["state"] == "alive"
    # The dead engine's segments went with it: the replica's process ended for its restart, and
    # its janitor unlinked them (driver/core/janitor.py). Before, only the multiprocessing resource
    # tracker did, once the last process it served was gone, which on a loaded 2-core machine came
    # more than 30 s after the new replica was up (2026-12-04, 2026-12-06).
    deadline = time.monotonic() + 30
    while [path for path in segments if path.exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [path for path in segments if path.exists()]
    before = cluster.status()["replicas"][victim]["shards_served"]
    again = [cluster.submit(build(cluster, i)) for i in range(8)]
    for got, ref in zip([f.result(timeout=120) for f in again], want):
        assert_same(got, ref)
    assert cluster.status()["replicas"][victim]["shards_served"] > before  # the restarted replica serves


# --- a poison trace: a program that ends its engine fails alone, once -----------------------------
#
# (tests/test_poison.py before: the same two replicas, started again in a Ray of their own.) One
# trace's program ends its engine, by refusing to stop at its time limit (interlace's watchdog then
# ends the worker) or by calling ``os._exit``; a dozen innocent traces of declarative ops run beside
# it, some on the same engine. The poison trace must fail once, with its cause named, and never run
# again (one engine restart); the innocent traces lost with that engine run again, without spending
# their ``max_retries``, and equal their clean run, each report counted once.


@pytest.fixture
def no_retries(cluster):
    """The cluster's driver with ``max_retries=0`` for one test (a driver's setting: replicas never
    read it): an innocent shard that spent its budget on another trace's program would fail."""
    kept = cluster.config
    cluster.config = kept.model_copy(update={"max_retries": 0})
    assert cluster.config.max_retries == 0
    yield cluster
    cluster.config = kept


INNOCENT = 12


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
def test_a_program_that_ends_its_engine_fails_alone_and_once(no_retries, clean, program, timeout_s, cause, message):
    import ray

    cluster = no_retries

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
        assert_same(got, want)
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


def breaks_reporting(m):
    """Leaves its worker generating but unable to write any report (as an exhausted open-file
    limit did; programs may no longer change the limits)."""
    from interlace.workers import reports

    def no_files(*_args, **_kwargs):
        raise OSError(24, "Too many open files")

    reports.open_sink = no_files
    m.save("h", m.layers[0].resid)


def test_a_replica_whose_reports_stop_restarts_and_serves_again(no_retries, clean):
    """An engine that generates but whose reports stopped coming would fail every later shard
    after the report grace: the replica restarts as for a dead engine, the trace fails with the
    reason, and the cluster serves every later trace."""
    import ray

    cluster = no_retries
    _whole_again(cluster)
    # the grace (30 s), 2 s in these replicas' processes for this test (test_errors shortens a
    # Model's alike); a restarted replica has its own again
    shorter = lambda _replica: setattr(importlib.import_module("interlace.cluster.replica"), "REPORT_GRACE_S", 2.0)  # noqa: E731 - by value
    ray.get([slot.actor.__ray_call__.remote(shorter) for slot in cluster._replicas])
    before = cluster.status()
    broken = cluster.trace(max_tokens=2)
    broken.invoke("Broken", program=breaks_reporting)
    with pytest.raises(interlace.WorkerDied, match=r"lost its replica 1 times .*no report from .* can no longer "
                                                   r"write reports"):
        cluster.submit(broken).result(timeout=180)
    _whole_again(cluster)
    after = cluster.status()
    assert sum(r["restarts"] for r in after["replicas"]) - sum(r["restarts"] for r in before["replicas"]) == 1
    for i in (0, 1):  # both replicas (the restarted one among them) serve, exact
        assert_same(cluster.submit(innocent(cluster, i)).result(timeout=120), clean[i])


def shares_its_prompt(m):
    m.share("by_length", torch.ones(m.layers[0].resid.shape[0]), merge="sum")  # rows: this invoke's prompt length


def test_shared_values_that_cannot_merge_fail_the_trace_alike_with_every_result_kept(cluster, llama):
    """Contributions one merge cannot combine (a sum over prompts of different lengths) fail the
    trace with the name, the merge and each invoke's contribution, on a model and a cluster (merged by
    the collector) alike; every invoke's tokens come back in the error's partial result."""
    prompts = [f"Sample {i} of the sweep" + " long" * (i % 2) for i in range(6)]
    errors = []
    for target in (cluster, llama):
        with pytest.raises(interlace.InterventionError, match=r"shared value 'by_length' \(merge 'sum'\) could not be "
                           r"merged: RuntimeError: .*; contributed invoke 0: \(\d+,\) float32, invoke 0: \(1,\) float32, "
                           r"invoke 1: .*\(12 in all\)") as err:  # a contribution per step
            with target.trace(max_tokens=2) as tr:
                for p in prompts:
                    tr.invoke(p, program=shares_its_prompt)
        errors.append(err.value)
    assert [e.invoke for e in errors] == [0, 0]
    assert [r.token_ids for r in errors[0].partial] == [r.token_ids for r in errors[1].partial]
    assert all(len(r.token_ids) == 2 for r in errors[0].partial)
