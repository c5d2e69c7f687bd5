"""The Ray Serve application: config in, application out.

Three deployments, bound together by :func:`build_app`:

- ``InterlaceEngine``: engine replicas, the very :class:`~interlace.cluster.replica.Replica` class
  the cluster runs as actors, each on a placement group of one bundle per TP x PP rank;
  replicas and autoscaling from the config;
- ``InterlaceIngress``: the FastAPI app of :mod:`interlace.cluster.ingress` (auth, limits,
  streaming), sharding each trace over the engine replicas through a deployment handle;
- ``InterlaceState``: one replica holding what all ingress replicas share (quotas, asynchronous
  results, the metrics registry).

Three ways to run it, all reading :class:`~interlace.cluster.config.ServeConfig`::

    interlace serve configs/serve/tiny-llama.yaml                     # starts Ray and Serve here
    serve run interlace.cluster.serve_app:build_app config=configs/serve/tiny-llama.yaml
    serve deploy serve.yaml   # applications: [{import_path: interlace.cluster.serve_app:build_app,
                              #                 args: {<the ServeConfig fields>}}]
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.serve import Application

from interlace.cluster.config import ServeConfig
from interlace.cluster.ingress import Ingress, api
from interlace.cluster.replica import Replica
from interlace.cluster.serve_state import ServeState


# Serve logs every call at INFO (the state deployment's metrics calls are several per request):
# warnings only, and no access log; Prometheus metrics say what the traffic was.
_QUIET = {"log_level": "WARNING", "enable_access_log": False}


def build_app(args: dict[str, Any] | ServeConfig | str) -> Application:
    """The application for ``args``: a ServeConfig, its fields (Serve's ``args``), or
    ``{"config": path}`` (``serve run ... config=path``)."""
    if isinstance(args, dict) and set(args) == {"config"}:
        args = args["config"]
    cfg = ServeConfig.load(args)
    _check_tokens(cfg)  # a server nobody may call is refused before anything starts
    cluster = cfg.cluster
    state = serve.deployment(ServeState, name="InterlaceState", num_replicas=1, max_ongoing_requests=100_000,
                             logging_config=_QUIET, ray_actor_options={"num_cpus": 0}).bind(cfg.limits.max_results_kept,
                                                                     cfg.limits.results_ttl_s)
    engine = serve.deployment(Replica, name="InterlaceEngine", **_engine_options(cfg)).bind(
        cluster.model.model_dump(), state=state)
    ingress = serve.deployment(serve.ingress(api)(Ingress), name="InterlaceIngress",
                               num_replicas=cfg.ingress_replicas, max_ongoing_requests=10_000, logging_config=_QUIET,
                               ray_actor_options={"num_cpus": 0,
                                                  "runtime_env": {"env_vars": _auth_env(cfg)}}).bind(
        cfg.model_dump(mode="json"), engine, state)
    return ingress


def _engine_options(cfg: ServeConfig) -> dict[str, Any]:
    """Serve options of the engine deployment: its placement group, replicas, backpressure."""
    cluster = cfg.cluster
    world = cluster.model.world_size
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    options: dict[str, Any] = dict(
        max_ongoing_requests=cluster.max_in_flight,  # Serve queues the rest: backpressure per replica
        # The actor takes a sliver of bundle 0; its engine's ranks use the bundles' compute.
        ray_actor_options={"num_cpus": 0.01, "num_gpus": cluster.resources.num_gpus if world == 1 else 0,
                           "runtime_env": {"env_vars": env}},
        placement_group_bundles=[cluster.resources.bundle()] * world,
        placement_group_strategy=cluster.placement_strategy,
        logging_config=_QUIET,
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
    )
    if cfg.autoscaling is not None:
        options["autoscaling_config"] = cfg.autoscaling.model_dump()
    else:
        options["num_replicas"] = cluster.replicas
    return options


def _auth_env(cfg: ServeConfig) -> dict[str, str]:
    """The tokens document travels to the ingress replicas in their environment when it came from
    this process's environment (a file path is read where the ingress runs)."""
    name = cfg.auth.tokens_env
    return {name: os.environ[name]} if not cfg.auth.tokens_file and os.environ.get(name) else {}


def _check_tokens(cfg: ServeConfig) -> None:
    from interlace.cluster.auth import Tokens

    if cfg.auth.tokens_file is None:  # a file is read on the ingress's node, which may not be this one
        Tokens.load(cfg.auth)


def start(cfg: ServeConfig, address: str | None = None, name: str = "interlace") -> str:
    """Start the application on Ray (joining ``address``, else RAY_ADDRESS, else a local Ray) and
    wait until it answers ``/readyz``; returns its URL."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("RAY_ADDRESS") or "local", include_dashboard=False,
                 log_to_driver=False)
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build_app(cfg), name=name, route_prefix=cfg.route_prefix, blocking=False)
    url = f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '::') else cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}"
    wait_ready(url)
    return url


def wait_ready(url: str, timeout_s: float = 600.0) -> None:
    """Wait until the endpoint's engines answer (``GET /readyz`` is 200)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=10).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was not ready within {timeout_s:.0f}s")
        time.sleep(1.0)


def serve_until_stopped(cfg: ServeConfig, address: str | None = None) -> None:
    """``interlace serve``: start, print where, serve until Ctrl-C, then shut Serve down."""
    import time

    url = start(cfg, address)
    print(f"interlace: serving {cfg.cluster.model.name} at {url} (OpenAPI: {url}/docs); Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
