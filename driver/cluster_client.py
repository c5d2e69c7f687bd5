"""A model served by engine replicas on a Ray cluster, with the trace API of ``interlace.Model``.

    >>> import interlace
    >>> cluster = interlace.Cluster("tiny-llama-2")        # a local Ray, two CPU replicas
    >>> with cluster.trace(max_tokens=4) as tr:            # exactly as with interlace.Model
    ...     tr.invoke("Hello", program=lambda m: m.save("h", m.layers[1].resid))
    >>> tr.result[0].saves["h"].shape

Many traces in flight: ``submit`` returns a ``concurrent.futures.Future`` at once::

    >>> futures = []
    >>> for prompt in prompts:
    ...     tr = cluster.trace(max_tokens=8)
    ...     tr.invoke(prompt, ops=[interlace.ops.save("layers.2.resid")])
    ...     futures.append(cluster.submit(tr))
    >>> results = [f.result() for f in futures]
    >>> cluster.status()                                    # replicas, in flight, restarts, queue
    >>> cluster.close()                                     # no actors or placement groups left

``interlace.connect("auto")`` joins a running Ray cluster instead (``"ray://host:10001"``, or no
address for a local one).

How a trace runs: the driver validates and encodes it (programs by value), splits a large trace's
independent invokes into shards (:func:`interlace.cluster.shards.plan_shards`), announces the trace's expected reports to
the collector actor, and sends each shard to the replica with the least outstanding work that has
room (at most ``max_in_flight`` shards per replica; ``submit`` waits once ``max_queued`` traces
are held). Replicas return the tokens; reports go from replicas straight to the collector, which
hands them over once complete, shared values merged. A shard whose replica died is re-run on a
live one as a new attempt (the collector counts each report once, newest attempt only); a trace
the collector lost (restarted) is re-run whole. Each future resolves once.

A trace whose own program ended an engine (it would not stop at its time limit, or it ended the
process: the replica says so, :class:`~interlace.core.wire.EngineDeath`) fails at once with
:class:`~interlace.core.trace.ProgramEndedEngine` and never runs again; the other shards lost
with that engine run again without spending their ``max_retries`` (a death nothing pins on a
program spends them, as does a replica that vanished without a word).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import itertools
import logging
import threading
import uuid
from pathlib import Path
from typing import Any, Iterable

from interlace.cluster.assembly import assemble
from interlace.cluster.collector import start_collector
from interlace.cluster.config import ClusterConfig
from interlace.cluster.engine import refuse_graph_settings
from interlace.cluster.placement import check_fits_the_cluster, check_replicas_fit, is_spread, replica_bundles
from interlace.cluster.ray_init import init_ray
from interlace.cluster.replica import replica_actor
from interlace.cluster.shards import joined_invokes, plan_shards
from interlace.core import sigterm
from interlace.core.trace import ProgramEndedEngine, TraceResult, WorkerDied, check_trace, encode_payloads, new_trace_id
from interlace.core.wire import Completion, EngineDeath, InvokePayload, SavesOnNode, SavesRef, ShardTask
from interlace.model import Model, Trace, submitted
from interlace.remote import Remote
from interlace.workers.points import ModuleTree
from interlace.workers.sink import discard, read_new_reports

_TAKE_TIMEOUT_S = 120.0  # a trace whose shards all returned yet reports stay missing this long fails
_COLLECTOR_RESTART_S = 120.0  # how long a call waits for a restarting collector
_PENDING_REPORT_S = 30.0  # how often a replica waiting for its placement group says so
logger = logging.getLogger("interlace")


@dataclasses.dataclass
class _ReplicaSlot:
    """The driver's view of one replica."""

    index: int
    actor: Any
    placement_group: Any
    state: str = "starting"  # starting | alive | restarting | dead
    in_flight: int = 0  # shards running on it now
    work: int = 0  # invokes of those shards
    restarts: int = 0
    shards: int = 0  # shards it returned
    node: str | None = None
    pid: int | None = None


class Cluster:
    """Engine replicas of one model on a Ray cluster; see the module docstring.

    ``config``: a bundled cluster config name (``"tiny-llama-2"``), a YAML path, or a
    :class:`~interlace.cluster.config.ClusterConfig`. ``address``: the Ray cluster to join when
    Ray is not initialized in this process yet (None: start a local one; ``"auto"``;
    ``"ray://host:10001"``). ``ray_init``: further ``ray.init`` arguments for that case. Keyword
    arguments override the config's fields and its model's (``replicas=1``,
    ``pipeline_parallel_size=2``), as ``Model``'s do; the rest go to vLLM's engine arguments.
    """

    trace = Model.trace
    generate = Model.generate

    def __init__(self, config: str | Path | ClusterConfig = "tiny-llama-2", address: str | None = None,
                 ray_init: dict | None = None, **engine_overrides: Any):
        import ray

        self.config, engine_overrides = ClusterConfig.load(config).with_overrides(engine_overrides)
        # As Model does: refused here, before Ray or any replica starts (CPU replicas only).
        if not self.config.resources.num_gpus:
            refuse_graph_settings({**self.config.model.engine_args, **engine_overrides}, device="cpu")
        self._started_ray = not ray.is_initialized()
        # SIGTERM (Kubernetes, Docker, systemd) raises interlace.core.sigterm.Terminated (a
        # SystemExit, status 143) where Ctrl-C raises KeyboardInterrupt, so `with` blocks and
        # close() run while Ray still stands; unless the program installed a handler of its own.
        if self._started_ray:
            init_ray(address or "local", take_sigterm=True, **(ray_init or {}))
        else:
            sigterm.take_over()
        self.name = f"interlace-{uuid.uuid4().hex[:8]}"
        self._queue = threading.BoundedSemaphore(self.config.max_queued)
        self._held = 0  # traces queued or running
        self._reruns = 0  # whole-trace re-runs after the collector lost a trace's reports
        self._culprits = 0  # traces failed because their own program ended an engine
        self._innocent_reruns = 0  # shards re-run, not counted, after another trace's program ended their engine
        self._count_lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="interlace-cluster", daemon=True)
        self._thread.start()
        self._replicas: list[_ReplicaSlot] = []
        try:
            self._call(self._start(engine_overrides))
        except BaseException:
            self.close()
            raise

    # --- start and stop ----------------------------------------------------------------------

    async def _start(self, engine_overrides: dict) -> None:
        import ray
        from ray.util.placement_group import placement_group

        cfg = self.config
        # Before a placement group waits forever for nodes this cluster will never have.
        check_fits_the_cluster(cfg)
        bundles = replica_bundles(cfg)  # one bundle, or one per rank where no node holds the replica
        if not is_spread(bundles):
            check_replicas_fit(cfg)
        self._room = asyncio.Condition()
        self.collector = start_collector(name=f"{self.name}-collector")
        self._node = ray.get_runtime_context().get_node_id()  # replicas here leave saves in files for us
        for index in range(cfg.replicas):
            group = placement_group(bundles, strategy="PACK", name=f"{self.name}-r{index}")
            self._replicas.append(_ReplicaSlot(index, None, group))
        for slot in self._replicas:
            await _placed(slot, bundles)
            cores = cfg.cpu_cores[slot.index % len(cfg.cpu_cores)] if cfg.cpu_cores else None
            slot.actor = replica_actor(slot.placement_group, cfg, cores).remote(
                cfg.model.model_dump(), slot.index, f"{self.name}-collector", f"{self.name}-r{slot.index}", engine_overrides)
        infos = await asyncio.gather(*(slot.actor.ready.remote() for slot in self._replicas))
        for slot, info in zip(self._replicas, infos):
            slot.state, slot.node, slot.pid = "alive", info["node"], info["pid"]
        self.tree = ModuleTree(names=infos[0]["module_names"])

    def close(self) -> None:
        """Stop the replicas and the collector, remove their placement groups (and the local Ray
        this handle started)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):  # traces still running fail with CancelledError
            self._call(_cancel_tasks(), timeout=10)
        for slot in self._replicas:
            if slot.actor is not None:
                with contextlib.suppress(Exception):
                    ray.get(slot.actor.shutdown.remote(), timeout=30)
                ray.kill(slot.actor, no_restart=True)
            with contextlib.suppress(Exception):
                remove_placement_group(slot.placement_group)
        if getattr(self, "collector", None) is not None:
            ray.kill(self.collector, no_restart=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if self._started_ray:
            ray.shutdown()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- traces ------------------------------------------------------------------------------

    def submit(self, trace: Trace) -> concurrent.futures.Future:
        """Run ``trace`` (built with ``cluster.trace()`` and ``tr.invoke(...)``, outside a ``with``
        block) asynchronously: a future of its :class:`TraceResult`, or of its error. Waits while
        ``max_queued`` traces are held."""
        if self._closed:
            raise RuntimeError("this cluster is closed; make a new interlace.Cluster(...)")
        check_trace(submitted(trace).invokes, trace.settings, self.tree)  # the very checks Model makes
        # What runs is the trace as submitted: an invoke added to it afterwards (building the next
        # trace from it) belongs to that one; read while this one ran, it failed it with an IndexError.
        trace = copy.copy(trace)
        trace.invokes = list(trace.invokes)
        trace_id = new_trace_id()
        payloads = encode_payloads(trace.invokes, trace_id, "", trace.timeout_s, trace.max_save_bytes)
        self._queue.acquire()
        with self._count_lock:
            self._held += 1
        future = asyncio.run_coroutine_threadsafe(self._run_trace(trace_id, trace, payloads), self._loop)
        future.add_done_callback(self._release_queue)
        return future

    def _release_queue(self, _future) -> None:
        with self._count_lock:
            self._held -= 1
        self._queue.release()

    def _run(self, trace: Trace) -> TraceResult:
        return self.submit(trace).result()

    async def _run_trace(self, trace_id: str, trace: Trace, payloads: list[InvokePayload | None]) -> TraceResult:
        try:
            return await self._run_trace_once(trace_id, trace, payloads)
        except ProgramEndedEngine:
            self._culprits += 1
            with contextlib.suppress(Exception):
                self.collector.drop.remote(trace_id)
            raise
        except BaseException:
            with contextlib.suppress(Exception):  # its reports, if any came, are freed
                self.collector.drop.remote(trace_id)
            raise

    async def _run_trace_once(self, trace_id: str, trace: Trace, payloads: list[InvokePayload | None]) -> TraceResult:
        attempts = itertools.count()  # unique per dispatch of any of the trace's shards
        stages = self.config.model.pipeline_parallel_size
        shards = plan_shards(len(trace.invokes), joined_invokes(trace.invokes), len(self._replicas),
                             self.config.min_shard_invokes)
        for _rerun in range(self.config.max_retries + 1):
            tasks = [ShardTask(trace_id, n, 0, [trace.invokes[i].prompt for i in indices],
                               [payloads[i] for i in indices], trace.settings, stages, self._node)
                     for n, indices in enumerate(shards)]
            if _rerun:
                self._reruns += 1
            await self._tell_collector("expect", trace_id, [k for t in tasks for k in t.expected()], 0)
            outputs = await asyncio.gather(*(self._run_shard(task, attempts) for task in tasks))
            completions: list[Completion | None] = [None] * len(trace.invokes)
            for indices, shard_out in zip(shards, outputs):
                for i, done in zip(indices, shard_out):
                    completions[i] = done
            delivered = await self._take(trace_id)
            if delivered is not None:
                return assemble(trace.invokes, completions, delivered.reports, delivered.shared, delivered.merge_error)
        raise WorkerDied(f"trace {trace_id}: its reports were lost {self.config.max_retries + 1} times "
                         "(the collector restarted each time); giving up")

    async def _tell_collector(self, method: str, *args: Any) -> None:
        """Call the collector, waiting while Ray restarts it. A call its dying process took is
        lost with its state; the trace's ``take`` then answers None and the trace runs again."""
        import ray

        deadline = asyncio.get_running_loop().time() + _COLLECTOR_RESTART_S
        while True:
            try:
                return await getattr(self.collector, method).remote(*args)
            except ray.exceptions.ActorDiedError:
                raise WorkerDied("the collector actor died for good (past its restarts); make a new Cluster") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _take(self, trace_id: str):
        """The trace's reports with their saves fetched; None: lost (re-run the trace)."""
        import ray

        try:
            delivered = await self.collector.take.remote(trace_id, _TAKE_TIMEOUT_S)
            if delivered is None:
                return None
            reports = [r for rs in delivered.reports.values() for r in rs]
            refs = list(dict.fromkeys(r.saves.ref for r in reports if isinstance(r.saves, SavesRef)))
            values = dict(zip(refs, await asyncio.gather(*refs)))  # one object per shard
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.ActorUnavailableError):
            return None  # the collector died (its objects with it): the trace runs again
        on_node = _saves_on_node(reports)
        if on_node is None:
            return None  # a replica restarted and took its folder with it: the trace runs again
        for report in reports:
            if isinstance(report.saves, SavesRef):
                report.saves = values[report.saves.ref][report.saves.index]
            elif isinstance(report.saves, SavesOnNode):
                report.saves = on_node[report.saves.folder, report.saves.invoke, report.saves.stage]
        return delivered

    async def _run_shard(self, task: ShardTask, attempts: Iterable[int]) -> list[Completion]:
        import ray

        size = len(task.prompts)
        lost = 0  # deaths counted against max_retries: not another trace's program's doing
        why = ""  # the last of those deaths' known cause
        for dispatch in itertools.count():
            attempt = next(attempts)
            task = dataclasses.replace(task, attempt=attempt)
            if dispatch:
                await self._tell_collector("retry", task.trace, task.expected(), attempt)
            slot = await self._acquire(size)
            try:
                out = await _cancelled_with_caller(slot.actor.run.remote(task))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                self._replica_failed(slot)
                lost += 1
            else:
                if not isinstance(out, EngineDeath):
                    slot.shards += 1
                    return out
                self._replica_failed(slot)
                if out.blames(task.trace):  # its own program: running it again would end another engine
                    raise ProgramEndedEngine(f"trace {task.trace}: {out.message}; the trace is not run again",
                                             invoke=out.invoke, cause=out.cause)
                if out.culprit is None:
                    lost += 1
                    why = out.message or why
                else:
                    self._innocent_reruns += 1
            finally:
                await self._release(slot, size)
            if lost > self.config.max_retries:
                raise WorkerDied(f"trace {task.trace}: shard {task.shard} lost its replica {lost} times "
                                 f"(max_retries={self.config.max_retries}); giving up" + (f" (last: {why})" if why else ""))

    # --- routing -----------------------------------------------------------------------------

    async def _acquire(self, size: int) -> _ReplicaSlot:
        """The live replica with the least outstanding work that has room; waits for one."""
        async with self._room:
            while True:
                open_ = [s for s in self._replicas if s.state == "alive" and s.in_flight < self.config.max_in_flight]
                if open_:
                    slot = min(open_, key=lambda s: (s.work, s.in_flight, s.index))
                    slot.in_flight += 1
                    slot.work += size
                    return slot
                if all(s.state == "dead" for s in self._replicas):
                    raise WorkerDied("every replica is dead (each past its restarts); make a new Cluster")
                await self._room.wait()

    async def _release(self, slot: _ReplicaSlot, size: int) -> None:
        async with self._room:
            slot.in_flight -= 1
            slot.work -= size
            self._room.notify_all()

    def _replica_failed(self, slot: _ReplicaSlot) -> None:
        if slot.state == "alive":
            slot.state, slot.restarts = "restarting", slot.restarts + 1
            self._loop.create_task(self._await_restart(slot))

    async def _await_restart(self, slot: _ReplicaSlot) -> None:
        """Ray restarts the actor (``max_restarts``); its engine starts on ``ready()``."""
        import ray

        for _ in range(10):
            try:
                info = await slot.actor.ready.remote()
            except ray.exceptions.ActorDiedError:
                break  # past its restarts
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                await asyncio.sleep(1.0)
                continue
            async with self._room:
                slot.state, slot.node, slot.pid = "alive", info["node"], info["pid"]
                self._room.notify_all()
            return
        async with self._room:
            slot.state = "dead"
            self._room.notify_all()

    # --- status ------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Replicas (state, node, shards in flight, restarts, shards served), queue depth, how
        many traces ran again whole because the collector lost their reports (it restarted), and
        ``lost_to_programs``: traces failed because their own program ended an engine
        (``culprits``) and shards of other traces re-run after such a death (``reruns``, not
        counted against their ``max_retries``)."""
        return {
            "replicas": [{"index": s.index, "state": s.state, "node": s.node, "pid": s.pid,
                          "in_flight": s.in_flight, "restarts": s.restarts, "shards_served": s.shards}
                         for s in self._replicas],
            # a cancelled trace leaves ``held`` at once and its replica's slot when its task unwinds
            "queued": max(0, self._held - sum(s.in_flight for s in self._replicas)),
            "held": self._held,
            "reruns": self._reruns,
            "lost_to_programs": {"culprits": self._culprits, "reruns": self._innocent_reruns},
        }

    def replica_info(self) -> list[dict]:
        """Each replica's own report (pid, engine pids, the most shards it ever ran at once, the
        requests its engine has not finished)."""
        import ray

        return ray.get([s.actor.info.remote() for s in self._replicas])

    def step_counts(self) -> list[list[dict]]:
        """Each replica's ranks' step counters: how many steps replayed CUDA graphs, ran ops in
        graph taps, or ran eager (see the guide's graph taps), and how many recomputed chunks
        (after a preemption) were replayed."""
        import ray

        return ray.get([s.actor.step_counts.remote() for s in self._replicas])

    def _call(self, coroutine, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)


async def _placed(slot: _ReplicaSlot, bundles: list[dict[str, float]]) -> None:
    """Wait for a replica's placement group, saying every ``_PENDING_REPORT_S`` what it waits for
    (on a joined cluster resources may come later, as Ray Serve reports pending replicas)."""
    import ray

    ready = asyncio.ensure_future(slot.placement_group.ready())
    while not (await asyncio.wait({ready}, timeout=_PENDING_REPORT_S))[0]:
        free = ray.available_resources()
        where = "on one node" if len(bundles) == 1 else f"in {len(bundles)} bundles, one per rank"
        logger.warning("interlace: replica %d is pending: its placement group needs %s %s; the cluster "
                       "has %s free now", slot.index, bundles[0], where, {name: free.get(name, 0.0) for name in bundles[0]})
    ready.result()


def _saves_on_node(reports) -> dict | None:
    """The saves of reports whose replica left them in its folder on this node, mapped (not
    copied, as Model reads them), by (folder, invoke, stage); the folders are removed (the mapping
    outlives them). None: a folder is gone (its replica's process ended)."""

    folders = {r.saves.folder for r in reports if isinstance(r.saves, SavesOnNode)}
    found = {}
    for folder in folders:
        if not Path(folder).is_dir():
            return None
        for raw in read_new_reports(Path(folder), set()):
            found[folder, raw["invoke"], raw["stage"]] = raw["saves"]
        discard(Path(folder))
    return found


async def _cancelled_with_caller(ref):
    """``await ref`` (a replica's ``run``), cancelling the actor's task when the awaiting task is
    cancelled (the trace's future cancelled, the cluster closed): the replica then aborts the
    shard's requests. Cancelling the await alone leaves the remote task running, and its engine
    generated the whole shard for nobody while later traces waited for its room."""
    import ray

    try:
        return await ref
    except asyncio.CancelledError:
        ray.cancel(ref)
        raise


async def _cancel_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def connect(address: str | None = None, config: str | Path | ClusterConfig = "tiny-llama-2",
            token: str | None = None, **kwargs: Any):
    """The trace API wherever the model runs: ``"http://host:8000"`` (an interlace endpoint;
    ``token`` or ``INTERLACE_API_TOKEN``) gives an :class:`interlace.remote.Remote`; a Ray address
    ("auto", "ray://host:10001"; None: start a local Ray) a :class:`Cluster` of ``config``."""
    if address is not None and address.startswith(("http://", "https://")):
        return Remote(address, token=token, **kwargs)
    return Cluster(config, address=address, **kwargs)
