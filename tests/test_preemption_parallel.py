"""Programs that survive preemption under tensor and pipeline parallelism (CPU, multiprocessing
backend) and on a cluster replica: every rank logs the writes its program made at its own points
(its piece of a value split across TP ranks) and puts them back on the rows vLLM recomputes, so a
trace preempted over and over on a TP=2 or a PP=2 engine, or a replica, with a squeezed KV cache
gives the tokens and saves of the same trace on a one-rank engine with room for all
(tests/test_preemption.py has the checks)."""

from __future__ import annotations

import pytest

import interlace
from conftest import ENGINE_OVERRIDES
from interlace.cluster.config import ClusterConfig, ModelConfig
from test_parallel import EXECUTOR
from test_preemption import _ids, check_messages, check_steering

# (tp, pp) -> KV bytes per rank: 7 blocks of 128 tokens (2 KiB per token per rank at TP=2, whose one
# KV head every rank keeps; 1 KiB at PP=2, two layers a rank). check_messages's four invokes need 8
# blocks by their last steps, so 7 still preempts them; more room means fewer steps, and a TP=2
# step takes about 90 ms on two cores (check_steering at TP=2: 113 s with 5 blocks, 89 s with 7
# and 32 invokes). Half as many invokes still fill the cache several times over (16 x 164 tokens
# against 7 x 128 per rank), so vLLM preempts them as it does 32, in half the steps.
LAYOUTS = {"tp2": ((2, 1), 7 * 256 * 1024), "pp2": ((1, 2), 7 * 128 * 1024)}
PARALLEL_INVOKES = 16


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.ranks(2)) for name in LAYOUTS])
def small_parallel(request):
    (tp, pp), kv_bytes = LAYOUTS[request.param]
    cfg = interlace.Model("tiny-llama").config.model_copy(update={"kv_cache_bytes": kv_bytes})
    model = interlace.Model(cfg, **{**ENGINE_OVERRIDES, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                                    "distributed_executor_backend": EXECUTOR})
    model.engine
    yield model
    model.close()


def test_preempted_programs_replay_their_writes_on_every_rank(small_parallel, llama, oracles):
    check_steering(small_parallel, llama, _ids(oracles), count=PARALLEL_INVOKES)


def test_messages_and_shared_values_are_delivered_once_on_every_rank(small_parallel, llama, oracles):
    check_messages(small_parallel, llama, _ids(oracles))


@pytest.fixture(scope="module")
def small_replica():
    """One CPU replica of the tiny Llama, its KV cache of 5 blocks, on a local Ray started here."""
    import ray

    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=400 << 20)
    model = ModelConfig.load("tiny-llama").model_copy(update={"kv_cache_bytes": 5 * 256 * 1024})
    cluster = interlace.Cluster(ClusterConfig(model=model, replicas=1))
    yield cluster
    cluster.close()
    ray.shutdown()


def test_preempted_programs_replay_their_writes_on_a_cluster_replica(small_replica, llama, oracles):
    ids = _ids(oracles)
    check_steering(small_replica, llama, ids)
    check_messages(small_replica, llama, ids)
