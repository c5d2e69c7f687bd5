"""The Serve application's shared state: one Ray actor, hosted by a one-replica deployment.

Whatever must be the same for every ingress replica lives in :class:`ServeState`: each token's
traces in flight (its quota), results of asynchronous traces kept for ``GET /v1/traces/{id}`` (each
readable only by the token that made it), cancel requests, and the metrics registry.

Why an actor behind a deployment rather than the deployment itself: every trace makes two calls
to the state (its quota, then its metrics and the quota freed), and a call through a Serve
deployment handle costs the caller about 1.4 ms of CPU against 0.33 ms for a plain Ray actor call
(Ray 2.60, this CPU machine, 16 calls at once). The ingress's CPU is what limits the endpoint at
64 clients. So :class:`StateHost`, the ``InterlaceState`` deployment, only creates the actor
(which lives and dies with the host's process: Serve's restart of the host restarts it) and hands
out its handle; callers reach it through :class:`SharedState`. A restarted state starts from zero:
counters too, which Prometheus expects of a restarted target.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from typing import Any

from interlace.cluster.serve.metrics import ServeMetrics


class ServeState:
    def __init__(self, max_results: int = 1024, results_ttl_s: float = 3600.0):
        self.metrics = ServeMetrics()
        self.max_results, self.results_ttl_s = max_results, results_ttl_s
        self._in_flight: collections.Counter[str] = collections.Counter()
        # trace id -> (owner, finished at, status, body, content type); None body: still running
        self._results: collections.OrderedDict[str, tuple[str, float, int, bytes | None, str]] = collections.OrderedDict()
        self._cancelled: set[str] = set()

    # --- quotas ------------------------------------------------------------------------------

    def acquire(self, caller: str, limit: int) -> bool:
        """Count a new trace of ``caller``; False (and nothing counted) when it has ``limit`` running."""
        if self._in_flight[caller] >= limit:
            return False
        self._in_flight[caller] += 1
        self.metrics.in_flight.set(sum(self._in_flight.values()))
        return True

    def release(self, caller: str) -> None:
        self._in_flight[caller] = max(0, self._in_flight[caller] - 1)
        self.metrics.in_flight.set(sum(self._in_flight.values()))

    def trace_done(self, caller: str, outcome: dict[str, Any], request: tuple[str, int] | None = None) -> None:
        """A trace finished: its metrics, its token's slot freed and, for a trace answered at once,
        its HTTP request (route, status) counted: one call per trace."""
        self.release(caller)
        self.metrics.record_trace(outcome)
        if request is not None:
            self.metrics.record_request(*request)

    # --- asynchronous traces -----------------------------------------------------------------

    def begin(self, trace_id: str, owner: str) -> None:
        self._results[trace_id] = (owner, 0.0, 202, None, "")
        self._expire()

    def finish(self, trace_id: str, status: int, body: bytes, content_type: str) -> None:
        entry = self._results.get(trace_id)
        if entry is not None:
            self._results[trace_id] = (entry[0], time.monotonic(), status, body, content_type)
        self._cancelled.discard(trace_id)
        self._expire()

    def result(self, trace_id: str, owner: str) -> tuple[int, bytes | None, str] | None:
        """(status, body, content type) of the owner's trace (body None: still running); None: unknown."""
        entry = self._results.get(trace_id)
        if entry is None or entry[0] != owner:
            return None
        return entry[2], entry[3], entry[4]

    def cancel(self, trace_id: str, owner: str) -> str | None:
        """Ask the ingress running the owner's trace to cancel it: "cancelling", "finished" (too
        late), or None (no such trace of this owner)."""
        entry = self._results.get(trace_id)
        if entry is None or entry[0] != owner:
            return None
        if entry[3] is not None:
            return "finished"
        self._cancelled.add(trace_id)
        return "cancelling"

    def cancelled(self, trace_ids: list[str]) -> list[str]:
        return [t for t in trace_ids if t in self._cancelled]

    def _expire(self) -> None:
        now = time.monotonic()
        done = [t for t, e in self._results.items() if e[3] is not None]
        for trace_id in done:
            if now - self._results[trace_id][1] > self.results_ttl_s:
                del self._results[trace_id]
        while len(self._results) > self.max_results:
            oldest = next((t for t, e in self._results.items() if e[3] is not None), None)
            if oldest is None:
                break
            del self._results[oldest]

    # --- metrics -----------------------------------------------------------------------------

    def record_request(self, route: str, status: int) -> None:
        self.metrics.record_request(route, status)

    def record_replica(self, replica: str, in_flight: int, waiting: int | None, kv_cache_usage: float | None) -> None:
        self.metrics.record_replica(replica, in_flight, waiting, kv_cache_usage)

    def exposition(self) -> bytes:
        return self.metrics.exposition()

    def calls(self, calls: list[tuple[str, tuple]]) -> list[tuple[bool, Any]]:
        """Several calls in order, each answered ``(True, value)`` or ``(False, exception)`` on its own."""
        answers = []
        for method, args in calls:
            if method.startswith("_") or method == "calls":
                answers.append((False, AttributeError(f"no state method {method!r}")))
                continue
            try:
                answers.append((True, getattr(self, method)(*args)))
            except Exception as exc:  # noqa: BLE001 - the caller's error, not the batch's
                answers.append((False, exc))
        return answers

    def ping(self) -> int:
        """This actor's process id (it answers: it is alive)."""
        return os.getpid()


class StateHost:
    """The ``InterlaceState`` deployment: creates the state actor and hands out its handle (a new
    actor if the last one died)."""

    def __init__(self, max_results: int = 1024, results_ttl_s: float = 3600.0):
        self._args = (max_results, results_ttl_s)
        self._actor = self._start()
        self._answered = None  # the last actor that answered a ping

    def _start(self):
        import ray

        # No max_restarts: a restart would come back empty while callers hold the same handle, and
        # answer as if nothing had been counted; a dead actor is an error they can act on.
        return ray.remote(ServeState).options(num_cpus=0).remote(*self._args)

    async def actor(self):
        import ray

        actor = self._actor
        try:
            # A new actor's first answer waits for its worker process to start: longer under load.
            await asyncio.wait_for(actor.ping.remote(), 10.0 if actor is self._answered else 60.0)
            self._answered = actor
        except (ray.exceptions.RayActorError, asyncio.TimeoutError):
            # Callers asking at once (the ingress and the engine replicas after a state died) all
            # find the dead actor: the first replaces it and the others take the replacement, which
            # they must not kill in turn.
            if self._actor is actor:
                ray.kill(actor)  # if only unreachable for now: callers must not find two states
                self._actor = self._start()
        return self._actor


class SharedState:
    """The state as its callers (ingress and engine replicas) reach it: ``await state.call(method,
    *args)``.

    Calls made while one is on its way go together as the next, in order (:meth:`ServeState.calls`):
    with 64 traces arriving at once an ingress makes a handful of state calls, not 64, and at low
    load a call goes at once. Each Ray call costs the caller's process the same CPU whatever it
    carries, and that CPU is what limits the endpoint. If the actor died, the host is asked once
    for a live one and the calls go again (a new actor starts empty)."""

    def __init__(self, host):
        self.host = host  # a deployment handle to StateHost
        self._actor = None
        self._waiting: list[tuple[str, tuple, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None

    async def call(self, method: str, *args: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((method, args, future))
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send())
        return await future

    async def _send(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                try:
                    answers = await self._call_actor([(method, args) for method, args, _ in batch])
                except Exception as exc:  # noqa: BLE001 - each caller gets the error
                    answers = [(False, exc)] * len(batch)
                for (_, _, future), (ok, value) in zip(batch, answers):
                    if not future.done():  # its caller may have been cancelled
                        future.set_result(value) if ok else future.set_exception(value)
        finally:
            self._sender = None

    async def _call_actor(self, calls: list[tuple[str, tuple]]) -> list[tuple[bool, Any]]:
        import ray

        for attempt in (0, 1):
            if self._actor is None:
                self._actor = await self.host.actor.remote()
            actor = self._actor
            try:
                return await actor.calls.remote(calls)
            except ray.exceptions.RayActorError:
                if attempt:
                    raise
                if self._actor is actor:
                    self._actor = None
        raise AssertionError("unreachable")
