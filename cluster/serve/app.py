"""The Ray Serve application: config in, application out.

Three deployments, bound together by :func:`build_app`:

- ``InterlaceEngine``: engine replicas, the very :class:`~interlace.cluster.replica.Replica` class
  the cluster runs as actors (as :class:`ServeEngine`, whose stream sends the events a stream
  gathered meanwhile together), each on one node (a placement group of one bundle holding every
  TP x PP rank's resources);
  replicas and autoscaling from the config;
- ``InterlaceIngress``: the FastAPI app of :mod:`interlace.cluster.serve.ingress` (auth, limits,
  streaming), sharding each trace over the engine replicas through a deployment handle;
- ``InterlaceState``: one replica hosting the actor that holds what all ingress replicas share
  (quotas, asynchronous results, the metrics registry; :mod:`interlace.cluster.serve.state`).

Three ways to run it, all reading :class:`~interlace.cluster.config.ServeConfig`::

    interlace serve configs/serve/tiny-llama.yaml                     # starts Ray and Serve here
    serve run interlace.cluster.serve.app:build_app config=configs/serve/tiny-llama.yaml
    serve deploy serve.yaml   # applications: [{import_path: interlace.cluster.serve.app:build_app,
                              #                 args: {<the ServeConfig fields>}}]
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from ray import serve
from ray.serve import Application

from interlace.cluster.config import ServeConfig
from interlace.cluster.placement import check_fits_the_cluster, host_actor_options, is_spread, replica_bundles
from interlace.cluster.ray_init import init_ray
from interlace.cluster.replica import Replica, compact_outcome
from interlace.cluster.serve.auth import Tokens
from interlace.cluster.serve.ingress import Ingress, api
from interlace.cluster.serve.state import StateHost
from interlace.core import sigterm

# Serve logs every call at INFO: warnings only, and no access log; Prometheus metrics say what the
# traffic was.
_QUIET = {"log_level": "WARNING", "enable_access_log": False}


# How often a stopping replica (Serve deleting the application, shutting down, or scaling down)
# looks whether its requests have finished. It waits this long before its first look even when
# none run, and Serve stops the deployments callers first (ingress, engine, state), so with Serve's
# 2 s an idle application took some 6 s to stop. A look reads a counter.
_STOP_CHECK_S = 0.5


def build_app(args: dict[str, Any] | ServeConfig | str) -> Application:
    """The application for ``args``: a ServeConfig, its fields (Serve's ``args``), or
    ``{"config": path}`` (``serve run ... config=path``)."""
    if isinstance(args, dict) and set(args) == {"config"}:
        args = args["config"]
    cfg = ServeConfig.load(args)
    _check_tokens(cfg)  # a server nobody may call is refused before anything starts
    cluster = cfg.cluster
    state = serve.deployment(StateHost, name="InterlaceState", num_replicas=1, max_ongoing_requests=100_000,
                             graceful_shutdown_wait_loop_s=_STOP_CHECK_S, logging_config=_QUIET,
                             ray_actor_options={"num_cpus": 0}).bind(cfg.limits.max_results_kept,
                                                                     cfg.limits.results_ttl_s)
    engine = serve.deployment(ServeEngine, name="InterlaceEngine", **_engine_options(cfg)).bind(
        cluster.model.model_dump(), state=state)
    ingress = serve.deployment(serve.ingress(api)(Ingress), name="InterlaceIngress",
                               num_replicas=cfg.ingress_replicas, max_ongoing_requests=10_000, logging_config=_QUIET,
                               graceful_shutdown_wait_loop_s=_STOP_CHECK_S,
                               ray_actor_options={"num_cpus": 0,
                                                  "runtime_env": {"env_vars": _auth_env(cfg)}}).bind(
        cfg.model_dump(mode="json"), engine, state)
    return ingress


# A stream's events go to the ingress as Serve messages, each costing the engine replica, the
# ingress and (as server-sent events) the proxy a fixed amount of CPU whatever its size (about 1.5 ms
# in all on the CPU machine). Sent one per token and step they made the processes of Serve the
# bottleneck with many streams at once (64 streams of 128 tokens: 0.23x the requests per second of
# the same traces without streaming). So a stream's events gathered while it waits go together,
# and after its first message a stream waits a window that grows with the streams this replica
# runs: STREAM_WINDOW_PER_STREAM_S each, at most STREAM_WINDOW_MAX_S (one stream: no wait to speak of).
STREAM_WINDOW_PER_STREAM_S = 0.004
STREAM_WINDOW_MAX_S = 0.25


class ServeEngine(Replica):
    """The cluster's :class:`Replica` as Serve's engine deployment: ``run_here`` sends saves as
    compact copies (they go to the ingress's process), and ``stream`` sends what a stream gathered
    meanwhile as one ``("batch", events)`` message (an invoke's token deltas merged into one
    ``tokens`` event)."""

    _streams = 0  # streams this replica runs now

    async def run_here(self, task):
        return compact_outcome(await Replica.run_here(self, task))

    async def stream(self, task):
        import asyncio

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for event in Replica.stream(self, task):
                    queue.put_nowait(event)
            except Exception as exc:  # noqa: BLE001 - raised by the consumer below
                queue.put_nowait(exc)
                return
            except BaseException as exc:  # cancelled: the consumer must not wait for more
                queue.put_nowait(exc)
                raise
            queue.put_nowait(None)

        self._streams += 1
        pumping = loop.create_task(pump())
        try:
            sent_at = None
            while True:
                gathered = [await queue.get()]
                if sent_at is not None and isinstance(gathered[0], tuple) and gathered[0][0] == "tokens":
                    window = min(STREAM_WINDOW_MAX_S, STREAM_WINDOW_PER_STREAM_S * self._streams)
                    await asyncio.sleep(sent_at + window - loop.time())
                while not queue.empty():
                    gathered.append(queue.get_nowait())
                end = gathered[-1] if not isinstance(gathered[-1], tuple) else False
                events = _merge_tokens(gathered[:-1] if end is not False else gathered)
                if events:
                    yield events[0] if len(events) == 1 else ("batch", events)
                    if any(event[0] == "tokens" for event in events):
                        sent_at = loop.time()
                if isinstance(end, BaseException):
                    raise end
                if end is None:
                    return
        finally:
            self._streams -= 1
            pumping.cancel()


def _merge_tokens(events: list[tuple]) -> list[tuple]:
    """``events`` with each invoke's consecutive ``("tokens", i, ids, text)`` merged into one (kept
    ahead of any other event, so an invoke's tokens still come before its ``invoke`` event)."""
    out: list[tuple] = []
    pending: dict[int, tuple[list, list]] = {}  # invoke index -> (token ids, texts)

    def flush() -> None:
        out.extend(("tokens", i, ids, "".join(texts)) for i, (ids, texts) in pending.items())
        pending.clear()

    for event in events:
        if event[0] == "tokens":
            ids, texts = pending.setdefault(event[1], ([], []))
            ids.extend(event[2])
            texts.append(event[3])
            continue
        flush()
        out.append(event)
    flush()
    return out


def _engine_options(cfg: ServeConfig) -> dict[str, Any]:
    """Serve options of the engine deployment: its placement group, replicas, backpressure."""
    cluster = cfg.cluster
    bundles = replica_bundles(cluster)
    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    options: dict[str, Any] = dict(
        max_ongoing_requests=cluster.max_in_flight,  # Serve queues the rest: backpressure per replica
        # As the cluster places a replica: one bundle of every rank's resources, the actor holding
        # its GPUs (the engine's ranks are the actor's child processes), or, where no node holds
        # that, a bundle per rank over several nodes (cluster/placement.py).
        ray_actor_options={**host_actor_options(cluster, spread=is_spread(bundles)), "runtime_env": {"env_vars": env}},
        placement_group_bundles=bundles,
        placement_group_strategy="PACK",
        logging_config=_QUIET,
        # A dead engine replica (its engine died and the actor exited for a restart) is seen at the
        # next check: every 2 s instead of Serve's 10 s, so its traces' retries find a replacement
        # starting sooner. The check reads one attribute (check_health), and only one is out at a
        # time, so a replica busy starting its engine is still given health_check_timeout_s.
        health_check_period_s=2,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
        graceful_shutdown_wait_loop_s=_STOP_CHECK_S,
    )
    if cfg.autoscaling is not None:
        options["autoscaling_config"] = cfg.autoscaling.model_dump()
    else:
        options["num_replicas"] = cluster.replicas
    return options


def _auth_env(cfg: ServeConfig) -> dict[str, str]:
    """The tokens document travels to the ingress replicas in their environment when it came from
    this process's environment (a file path is read where the ingress runs), as digests only: a
    runtime environment is readable by anyone who can read the Ray cluster's state, and a digest
    lets the ingress check a token without being one."""
    name = cfg.auth.tokens_env
    if cfg.auth.tokens_file or not os.environ.get(name):
        return {}

    return {name: Tokens.load(cfg.auth).digests_document()}


def _check_tokens(cfg: ServeConfig) -> None:
    if cfg.auth.tokens_file is None:  # a file is read on the ingress's node, which may not be this one
        Tokens.load(cfg.auth)


def start(cfg: ServeConfig, address: str | None = None, name: str = "interlace") -> str:
    """Start the application on Ray (joining ``address``, else RAY_ADDRESS, else a local Ray) and
    wait until it answers ``/readyz``; returns its URL."""
    import ray

    if not ray.is_initialized():
        # `interlace serve` stops on SIGTERM as on Ctrl-C (init_ray keeps its handler)
        init_ray(address or os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False)
    check_fits_the_cluster(cfg.cluster)  # before Serve waits forever for nodes this Ray will never have
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
    except Exception as exc:  # Ray's task error around the proxy's: a traceback, status 1, from the command
        if "Failed to bind" not in str(exc):
            raise
        with contextlib.suppress(Exception):
            serve.shutdown()  # the controller it started, on a cluster this process may only have joined
        raise ValueError(f"Serve's HTTP proxy cannot listen on {cfg.host}:{cfg.port}: another process holds the "
                         "port (a running interlace serve?); stop it, or set port: in the config") from None
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


def serve_until_stopped(cfg: ServeConfig, address: str | None = None, name: str = "interlace") -> None:
    """``interlace serve``: start, print where, serve until Ctrl-C or SIGTERM (with the CLI's
    :func:`interlace.core.sigterm.stop_on_sigterm`), then stop: the application is deleted first,
    so its route takes no new trace while the traces running finish (each replica waits for its
    requests up to its graceful shutdown time, 30 s for an engine, Serve's 20 s for an ingress),
    then Serve shuts down. A stop during the start shuts down what started."""
    import sys
    import time

    import ray

    try:
        url = start(cfg, address, name)
        print(f"interlace: serving {cfg.cluster.model.name} at {url} (OpenAPI: {url}/docs); Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit) as exc:
        if isinstance(exc, SystemExit) and not sigterm.received():
            raise  # a real exit; a SIGTERM may reach here as Ray's SystemExit(1) from inside a ray.get
        print(f"interlace: {'SIGTERM' if sigterm.received() else 'Ctrl-C'}: shutting Serve down", file=sys.stderr, flush=True)
        if ray.is_initialized():
            with contextlib.suppress(Exception):  # not deployed yet: nothing runs
                serve.delete(name)
            serve.shutdown()
