"""Where an engine replica runs: one node, one placement-group bundle holding every rank's share.

A replica's TP x PP ranks are its engine's own worker processes (vLLM's multiprocessing executor),
children of the process that hosts the engine (a cluster replica actor, a Serve replica, a sweep's
shard runner). They run on that process's node and see the devices it holds. Ray gives an actor
the resources of one bundle only, and points it at that bundle's GPUs through
``CUDA_VISIBLE_DEVICES``: so the bundle holds every rank's CPUs and GPUs, and the hosting actor
takes the GPUs whole. On CPU the same code runs with CPUs in the bundle (the ranks bound to cores,
see :func:`interlace.cluster.engine.prepare_environment`), so the CPU tests run the very placement
a GPU cluster runs.

A replica that no node can hold is *spread* (:func:`replica_bundles`): a bundle per rank,
packed onto as few nodes as Ray can (``PACK``), its ranks started by vLLM's Ray executor in those
bundles (the hosting actor sits in bundle 0, so the engine core and rank 0 share its node). Ranks
on other nodes send their reports to the hosting actor through Ray (workers/sink.py, ``ray:``): no
file system is shared between nodes. On a CPU each rank's bundle also takes one unit of the custom
resource ``interlace_cpu_rank``, which vLLM's Ray executor places ranks by
(``ray start --resources '{"interlace_cpu_rank": 1}'``; a GPU rank takes its GPU).
:func:`check_fits_the_cluster` refuses a replica the whole cluster cannot hold, on a local Ray,
before anything waits for resources no node has (a placement group that cannot be placed waits
forever), and warns on a joined cluster, where an autoscaler may add nodes. Serve's engine
replicas and sweeps' shard runners are placed the same way (a sweep checks a one-node replica with
:func:`check_fits_a_node`); :func:`check_replicas_fit` checks all of a cluster's one-node replicas
together.

    >>> from interlace.cluster.config import ClusterConfig
    >>> cfg = ClusterConfig.load("tiny-llama-2")
    >>> replica_bundle(cfg)
    {'CPU': 1.0}
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from interlace.core import settings

if TYPE_CHECKING:
    from interlace.cluster.config import ClusterConfig

# The hosting actor's own CPU: a sliver of the bundle (its ranks use the bundle's compute). Ray
# sets an actor's OMP_NUM_THREADS from its CPUs; the engine's ranks set their own threads.
HOST_CPUS = 0.01
CPU_RANK = "interlace_cpu_rank"  # on a CPU, what vLLM's Ray executor places a spread replica's ranks by


def replica_bundle(cluster: "ClusterConfig") -> dict[str, float]:
    """The one placement-group bundle of a replica: every rank's resources, summed. Refuses ranks
    of one replica sharing a GPU (``ValueError``): vLLM gives each rank a device of its own, and a
    rank past the bundle's devices fails only inside the engine's start."""
    ranks = cluster.model.world_size
    res = cluster.resources
    if res.num_gpus != int(res.num_gpus) and (ranks > 1 or res.num_gpus > 1):
        raise ValueError(
            f"resources.num_gpus={res.num_gpus:g} per rank with {ranks} rank(s) per replica (tensor_parallel_size x "
            "pipeline_parallel_size): vLLM gives every rank a GPU of its own, so the ranks of one replica cannot "
            "share GPUs; use a whole number of GPUs per rank, or a fraction below 1 for one-rank replicas that "
            "share a GPU")
    bundle = {"CPU": res.num_cpus * ranks, "GPU": res.num_gpus * ranks,
              **{name: amount * ranks for name, amount in res.custom.items()}}
    if res.accelerator_type:  # pins the node's kind; one unit of it is enough
        bundle[f"accelerator_type:{res.accelerator_type}"] = 0.001
    return {name: amount for name, amount in bundle.items() if amount}


def rank_bundle(cluster: "ClusterConfig") -> dict[str, float]:
    """One rank's bundle of a spread replica (see :func:`replica_bundles`)."""
    res = cluster.resources
    bundle = {"CPU": res.num_cpus, "GPU": float(res.num_gpus), **res.custom}
    if settings.device() == "cpu":
        bundle[CPU_RANK] = 1.0
    if res.accelerator_type:
        bundle[f"accelerator_type:{res.accelerator_type}"] = 0.001
    return {name: amount for name, amount in bundle.items() if amount}


def replica_bundles(cluster: "ClusterConfig", nodes: list[dict] | None = None) -> list[dict[str, float]]:
    """A replica's placement-group bundles: the one bundle of :func:`replica_bundle` where an
    alive node holds it (its ranks are the engine's own processes), else one per rank where the
    alive nodes hold those (a spread replica, vLLM's Ray executor). ``nodes``: ``ray.nodes()`` (read when None; with no Ray
    connected, as when an application is built to be deployed later, the one bundle)."""
    import ray

    if nodes is None and not ray.is_initialized():
        return [replica_bundle(cluster)]
    alive = _alive(nodes)
    ranks = cluster.model.world_size
    if _largest_fit(replica_bundle(cluster), alive) or ranks == 1:
        return [replica_bundle(cluster)]
    if sum(_count_fit(rank_bundle(cluster), have) for have in alive) < ranks:
        # Not even spread: the one bundle, which waits for a node that large (an autoscaler adding
        # one) where :func:`check_fits_the_cluster` warns, and is refused where it raises.
        return [replica_bundle(cluster)]
    return [rank_bundle(cluster) for _ in range(ranks)]


def is_spread(bundles: list[dict[str, float]]) -> bool:
    return len(bundles) > 1


def host_actor_options(cluster: "ClusterConfig", spread: bool = False) -> dict[str, Any]:
    """Ray options of the actor hosting a replica's engine inside its bundle: a sliver of CPU and
    every GPU (so that Ray sets ``CUDA_VISIBLE_DEVICES`` to the bundle's GPUs for the engine). A
    spread replica's host takes no GPU: vLLM's Ray workers take their bundles' own."""
    return {"num_cpus": HOST_CPUS, "num_gpus": 0.0 if spread else replica_bundle(cluster).get("GPU", 0.0)}


def check_fits_the_cluster(cluster: "ClusterConfig", nodes: list[dict] | None = None) -> None:
    """Refuse a replica that the alive nodes of the connected Ray cluster cannot hold even spread
    a rank per bundle (``ValueError`` on a local Ray, a warning on a joined one, as
    :func:`check_fits_a_node`): the message says how many GPUs (or rank slots) it needs and how
    many the cluster has."""
    alive = _alive(nodes)
    if _largest_fit(replica_bundle(cluster), alive):
        return
    need = rank_bundle(cluster)
    room = sum(_count_fit(need, have) for have in alive)
    ranks = cluster.model.world_size
    if room >= ranks:
        return
    model = cluster.model
    unit = "GPU" if need.get("GPU") else (CPU_RANK if CPU_RANK in need else "CPU")
    per_rank = need.get(unit, 1.0)
    total = sum(have.get(unit, 0.0) for have in alive)
    message = (
        f"one replica of {model.name!r} needs {ranks * per_rank:g} {unit} ({ranks} ranks: tensor_parallel_size "
        f"{model.tensor_parallel_size} x pipeline_parallel_size {model.pipeline_parallel_size}, each with "
        f"{_show(need)}), but this Ray cluster has {total:g} {unit} on {len(alive)} node(s), room for {room} "
        "such rank(s). Lower the parallel sizes or the resources per rank, or add nodes"
        + (f" (on a CPU, nodes offering the custom resource {CPU_RANK!r})" if unit == CPU_RANK else "")
    )
    if _head_started_here():
        raise ValueError(message)
    warnings.warn(message + " (waiting: nodes may still join this cluster)", stacklevel=2)


def _alive(nodes: list[dict] | None) -> list[dict[str, float]]:
    if nodes is None:
        import ray

        nodes = ray.nodes()
    return [node.get("Resources", {}) for node in nodes if node.get("Alive", node.get("alive"))]


def _largest_fit(need: dict[str, float], alive: list[dict[str, float]]) -> bool:
    return any(all(have.get(name, 0.0) >= amount for name, amount in need.items()) for have in alive)


def _count_fit(need: dict[str, float], have: dict[str, float]) -> int:
    return min(int(have.get(name, 0.0) / amount + 1e-9) for name, amount in need.items())


def check_fits_a_node(cluster: "ClusterConfig", nodes: list[dict] | None = None) -> None:
    """Refuse a replica that no alive node of the connected Ray cluster can hold (``ValueError``).

    Refused where this process started the Ray cluster (``ray.init()`` with no address: no node
    will join it). A cluster that was joined may grow (an autoscaler adding a node of the size asked
    for): there the same finding is a warning and the replica waits. ``nodes``: ``ray.nodes()``
    (read when None). Totals, not what is free now: a replica that fits a busy node waits for it.
    """
    need = replica_bundle(cluster)
    alive = _alive(nodes)
    if _largest_fit(need, alive):
        return
    largest = max(alive, key=lambda have: (have.get("GPU", 0.0), have.get("CPU", 0.0)), default={})
    model = cluster.model
    message = (
        f"one replica of {model.name!r} needs {_show(need)} on one node ({model.world_size} ranks: "
        f"tensor_parallel_size {model.tensor_parallel_size} x pipeline_parallel_size "
        f"{model.pipeline_parallel_size}, each with resources num_cpus={cluster.resources.num_cpus:g}, "
        f"num_gpus={cluster.resources.num_gpus:g}), but the largest node of this Ray cluster has "
        f"{_show({name: largest.get(name, 0.0) for name in need})}. A replica's ranks run on one node: "
        "lower the parallel sizes or the resources per rank, or add a node that large"
    )
    if _head_started_here():
        raise ValueError(message)
    warnings.warn(message + " (waiting: a node may still join this cluster)", stacklevel=2)



def check_replicas_fit(cluster: "ClusterConfig", nodes: list[dict] | None = None) -> None:
    """Refuse ``cluster.replicas`` replicas that the alive nodes cannot hold all at once
    (``ValueError`` with the arithmetic), where this process started the Ray cluster: its
    resources never grow, and a placement group that cannot be placed waits forever, silently.
    On a joined cluster (an autoscaler may add nodes) the same finding is a warning. Each node
    holds as many whole replicas as its scarcest resource allows; a replica never spans nodes.
    ``nodes``: ``ray.nodes()`` (read when None). Totals, not what is free now."""
    need = replica_bundle(cluster)
    alive = _alive(nodes)
    room = sum(_count_fit(need, have) for have in alive)
    if room >= cluster.replicas:
        return
    total = {name: sum(have.get(name, 0.0) for have in alive) for name in need}
    message = (
        f"{cluster.replicas} replicas of {cluster.model.name!r} need {_show(need)} each on one node, "
        f"{_show({name: amount * cluster.replicas for name, amount in need.items()})} in all, but the "
        f"{len(alive)} node(s) of this Ray cluster ({_show(total)} in all) hold {room} such replica(s). "
        "Lower `replicas`, the parallel sizes or the resources per rank, or give Ray more "
        "(ray.init(num_cpus=...), another node)"
    )
    if _head_started_here():
        raise ValueError(message)
    warnings.warn(message + " (the rest wait: nodes may still join this cluster)", stacklevel=2)

def _show(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in resources.items()) + "}"


def _head_started_here() -> bool:
    """Whether this process started its Ray cluster's head (a local cluster no node joins).
    Ray has no public call for it; its node object says so (``head``), and without one: joined."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    return bool(getattr(node, "head", False))
