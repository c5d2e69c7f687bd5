"""The interlace configs a Helm values file of the chart (``helm/interlace``) stands for.

The chart holds a ServeConfig under ``interlace.serve`` and a SweepConfig under ``sweep.config`` and
renders them into the RayService and the RayJob; these functions build the same configs from the
same values the way ``interlace serve`` / ``interlace sweep`` would read them, so a values file can
also be run locally, and tests can check the chart renders what the CLI means.

    >>> from interlace.cluster.helm_values import chart_values, serve_config
    >>> values = chart_values("helm/interlace/examples/single-gpu.yaml")
    >>> serve_config(values).cluster.model.tensor_parallel_size
    1

``python -m interlace.cluster.helm_values serve|sweep VALUES.yaml`` prints that config as YAML.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import yaml

from interlace.cluster.config import ClusterConfig, ServeConfig, SweepConfig, _resolve_paths

CHART_DIR = Path(__file__).resolve().parent.parent / "helm" / "interlace"


def chart_values(*files: str | Path, chart_dir: str | Path = CHART_DIR) -> dict:
    """The chart's values.yaml with ``files`` laid over it, in order, as ``helm -f`` merges them."""
    values = yaml.safe_load((Path(chart_dir) / "values.yaml").read_text()) or {}
    for file in files:
        values = _coalesce(yaml.safe_load(Path(file).read_text()) or {}, values)
    return values


def _coalesce(user: dict, defaults: dict) -> dict:
    # Helm's rules: mappings merge key by key, anything else (lists included) replaces, and a user's
    # null removes the default's key.
    merged = dict(defaults)
    for key, value in user.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(defaults.get(key), dict):
            merged[key] = _coalesce(value, defaults[key])
        else:
            merged[key] = value
    return merged


def serve_config(values: dict) -> ServeConfig:
    """The ServeConfig the RayService's application gets: ``interlace.serve``, listening on all
    addresses of the pod at ``serve.port``, reading tokens from the mounted Secret when there is one."""
    raw = dict(values["interlace"]["serve"])
    raw.update(host="0.0.0.0", port=int(values["serve"]["port"]))
    tokens = values["apiTokens"]
    if tokens.get("existingSecret"):
        raw["auth"] = {**(raw.get("auth") or {}), "tokens_file": f"{tokens['mountPath'].rstrip('/')}/{tokens['key']}"}
    return ServeConfig.load(raw)


def sweep_config(values: dict) -> SweepConfig:
    """The SweepConfig the RayJob runs: ``sweep.config`` with relative paths read from the volume."""
    raw = values["sweep"]["config"]
    if not raw:
        raise ValueError("sweep.config is empty; give it a SweepConfig (cluster, input, intervention, output)")
    return SweepConfig.model_validate(_resolve_paths(raw, Path(values["sweep"]["storage"]["mountPath"])))


def worker_pods(cluster: ClusterConfig, gpus_per_worker: float, replicas: int) -> int:
    """GPU worker pods that ``replicas`` engine replicas need: a replica's tensor_parallel_size x
    pipeline_parallel_size ranks share one pod where it holds them (:mod:`interlace.cluster.placement`);
    a replica larger than a pod takes pods of its own, its ranks packed onto as few as hold them."""
    replica = cluster.model.world_size * cluster.resources.num_gpus
    if replica <= 0:
        raise ValueError("every engine rank needs a GPU on the GPU workers; set resources.num_gpus to 1")
    if replica > gpus_per_worker:
        ranks_per_pod = math.floor(gpus_per_worker / cluster.resources.num_gpus)
        if ranks_per_pod < 1:
            raise ValueError(f"one rank needs resources.num_gpus = {cluster.resources.num_gpus:g} GPUs but a worker "
                             f"pod has {gpus_per_worker:g}; raise workers.gpusPerWorker to at least that")
        return replicas * math.ceil(cluster.model.world_size / ranks_per_pod)
    per_pod = math.floor(gpus_per_worker / replica)
    return math.ceil(replicas / per_pod)


def worker_group_size(values: dict, which: str = "serve") -> tuple[int, int]:
    """(minReplicas, maxReplicas) of the GPU worker group of the RayService ("serve") or the
    sweep's RayJob ("sweep")."""
    workers = values["workers"]
    if workers.get("replicas") is not None:
        return int(workers["replicas"]), int(workers["replicas"])
    if which == "serve":
        cfg = serve_config(values)
        low, high = ((cfg.autoscaling.min_replicas, cfg.autoscaling.max_replicas) if cfg.autoscaling
                     else (cfg.cluster.replicas, cfg.cluster.replicas))
    else:
        cfg = sweep_config(values)
        low = high = cfg.cluster.replicas
    gpus = float(workers["gpusPerWorker"])
    return worker_pods(cfg.cluster, gpus, low), worker_pods(cfg.cluster, gpus, high)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("serve", "sweep"):
        raise SystemExit("usage: python -m interlace.cluster.helm_values serve|sweep VALUES.yaml [MORE.yaml...]")
    values = chart_values(*args[1:])
    cfg = serve_config(values) if args[0] == "serve" else sweep_config(values)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")


if __name__ == "__main__":
    main()
