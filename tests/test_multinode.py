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

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import interlace
from interlace.cluster.config import ClusterConfig, ModelConfig, ResourcesConfig
from test_cluster import assert_same, build, reference
from test_cluster_parallel import two_stages
from test_sweep import free_ports, stop_private_ray


def _start_node(temp: Path, env: dict, ip: str, head_port: int, *extra: str) -> None:
    bin_dir = Path(sys.executable).parent
    command = [str(bin_dir / "ray"), "start", "--node-ip-address", ip, "--num-cpus", "1", "--temp-dir", str(temp),
               "--resources", '{"interlace_cpu_rank": 1}', "--object-store-memory", str(200 << 20),
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


@pytest.fixture(scope="module")
def two_nodes():
    """Two Ray nodes on this host; the driver (this process) joins them. Token-authenticated, as
    Ray 2.60 is by default, with this user's token file, which a driver of this process that
    started a local Ray before has loaded already (and keeps: a cluster without tokens then
    cannot call back into it)."""
    import ray

    assert not ray.is_initialized()
    temps = [Path(tempfile.mkdtemp(prefix=f"irn{i}", dir="/tmp")) for i in range(2)]
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RAY_AUTH_MODE="token")
    subprocess.run([str(bin_dir / "ray"), "get-auth-token", "--generate"], env=env, check=True, capture_output=True)
    (port,) = free_ports(1)
    mode = os.environ.get("RAY_AUTH_MODE")
    try:
        _start_node(temps[0], env, "127.0.0.1", port)
        _start_node(temps[1], env, "127.0.0.2", port, "--address", f"127.0.0.1:{port}")
        os.environ["RAY_AUTH_MODE"] = "token"
        ray.init(address=f"127.0.0.1:{port}")
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        yield temps
    finally:
        ray.shutdown()
        os.environ.pop("RAY_AUTH_MODE") if mode is None else os.environ.__setitem__("RAY_AUTH_MODE", mode)
        for temp in temps:
            stop_private_ray(temp)


@pytest.fixture(scope="module")
def spread_pp2(two_nodes):
    model = ModelConfig.load("tiny-llama").model_copy(update={"pipeline_parallel_size": 2})
    handle = interlace.Cluster(ClusterConfig(model=model, replicas=1, max_in_flight=4,
                                             resources=ResourcesConfig(num_cpus=1)))
    yield handle
    handle.close()


def test_a_pp2_replica_over_two_nodes_equals_one_engine_and_reports_through_ray(spread_pp2, llama):
    import ray
    from ray.util import placement_group_table

    (slot,) = spread_pp2._replicas
    table = placement_group_table(slot.placement_group)
    assert list(table["bundles"].values()) == [{"CPU": 1.0, "interlace_cpu_rank": 1.0}] * 2
    assert len(set(table["bundles_to_node_id"].values())) == 2  # one rank on each node

    count = 8
    traces = [build(spread_pp2, i) for i in range(count)]
    results = [f.result(timeout=300) for f in [spread_pp2.submit(tr) for tr in traces]]
    for got, want in zip(results, reference(llama, count)):
        assert_same(got, want)  # saves of stage 0 (this node) and stage 1 (the other node)

    with spread_pp2.trace(max_tokens=2) as tr:  # shared values from both stages, merged once
        for i in range(6):
            tr.invoke(f"Sample {i} of the sweep", program=two_stages)
    with llama.trace(max_tokens=2) as ref:
        for i in range(6):
            ref.invoke(f"Sample {i} of the sweep", program=two_stages)
    assert_same(tr.result, ref.result)

    # Stage 1's reports came through Ray: one per intervened invoke of every trace above.
    intervened = sum(inv.intervened for t in traces for inv in t.invokes) + 6
    (info,) = spread_pp2.replica_info()
    assert info["reports_delivered"] == intervened
    stats = ray.get(spread_pp2.collector.stats.remote())
    assert stats["dropped"] == 0 and stats["pending"] == 0
