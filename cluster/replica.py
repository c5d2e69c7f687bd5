"""An engine replica: a Ray actor hosting one vLLM ``AsyncLLM`` with interlace installed.

The driver places each replica on a placement group of one bundle holding every TP x PP rank's
resources (its ranks are the engine's own multiprocessing workers, on the actor's node, on the
bundle's GPUs: :mod:`interlace.cluster.placement`) and sends it trace shards
(:class:`interlace.core.wire.ShardTask`). Many shards run at once: every invoke is one request to the
async engine, and a shard's requests are gathered together. The workers write reports to a
``dir:`` sink in a node-local folder chosen here at start-up; the replica reads each shard's
reports as they appear and forwards them to the collector, saved tensors as object refs
(``ray.put``; the collector only passes the refs on, the driver fetches them from this node's
object store): no file system is shared between nodes. The refs are owned by this actor, so a
replica that dies before the driver fetched them loses them: the driver then re-runs the trace.

A dead engine (its engine-core or a worker process killed) ends the actor's process: Ray restarts
the actor (``max_restarts``) and the driver re-runs the shards it held as new attempts on a live
replica. Before it ends, :meth:`Replica.run` answers each shard it held with an
:class:`~interlace.core.wire.EngineDeath` that says whose program, if any, ended the engine (the
dead ranks' flight records, workers/flight.py): the driver fails that trace, never runs it again,
and re-runs the others without spending their retries. (``run_here`` and ``stream``, Serve's and
sweeps' paths, end the process at once, as before: their callers retry on their own terms.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from interlace.cluster.assembly import ReportsMissing, ReportWatcher, build_requests
from interlace.cluster.config import ClusterConfig, ModelConfig
from interlace.cluster.engine import all_module_names, shutdown_engine, start_async_engine
from interlace.cluster.engine_processes import start_fork_server
from interlace.core.janitor import remove_on_exit
from interlace.cluster.placement import host_actor_options
from interlace.cluster.serve.state import SharedState
from interlace.core import settings
from interlace.core.wire import Completion, EngineDeath, Report, SavesOnNode, SavesRef, ShardTask, portable
from interlace.workers.flight import culprit, read_records
from interlace.workers.sink import DirSink, discard

REPORT_GRACE_S = 30.0  # how long to wait for a shard's reports after its generation ended
_POLL_S = 0.005
_DEATH_CHECK_S = 0.5  # how often a shard waiting on its requests looks whether the engine died
_ANSWER_S = 5.0  # after its engine died, how long the replica waits for its shards' calls to answer
_FLUSH_S = 1.0  # then how long it lets Ray send those answers before the process ends


class _EngineGone(Exception):
    """The engine died under a shard that was not waiting on it (it was reading reports), or its
    reports stopped coming."""


class Replica:
    """Use through :func:`replica_actor`; ``ready()`` starts the engine (idempotent)."""

    def __init__(self, config: dict, index: int = 0, collector: str | None = None, name: str = "serve",
                 overrides: dict | None = None, state=None):
        """``collector``: the name of the collector actor its reports go to. A name, not a handle:
        Ray cannot promise to restart an actor whose constructor was given an actor handle (its
        arguments are then held by reference, ray-project/ray#53727)."""
        if settings.device() == "cpu":
            start_fork_server()  # its import of vLLM runs beside this process's, before ready() needs it
        self.config = ModelConfig.model_validate(config)
        self.index = index
        self.collector_name = collector
        self._collector = None  # its handle, looked up at the first report
        self.overrides = overrides or {}
        self.state = None  # a Serve application's shared state: this replica's gauges go there
        if state is not None:
            self.state = SharedState(state)

        # Node-local and chosen here: the workers of this engine run on this node. One folder per
        # actor process, removed when the process ends however it ends (a restart after a dead
        # engine, or Ray killing the actor because its driver disconnected).
        self.sink_root = Path(settings.fast_tmp_dir() or tempfile.gettempdir()) / f"interlace-{name}-{os.getpid()}"
        self.sink_root.mkdir(parents=True)
        remove_on_exit(self.sink_root)
        self.sink = f"dir:{self.sink_root}"  # a spread replica's ranks: "ray:..." (_start_engine)
        self._inbox = None  # a spread replica's ReportInbox, on this node
        self._engine = None
        self._starting: asyncio.Task | None = None  # the engine's start, shared by every caller
        self._module_names: list[str] = []
        self.in_flight = 0
        self.max_in_flight_seen = 0
        self.shards_served = 0
        self._death: EngineDeath | None = None  # the engine died: this process ends soon
        self._reports_stopped: str | None = None  # why, when its reports stopped coming

    # --- lifecycle ---------------------------------------------------------------------------

    async def ready(self) -> dict[str, Any]:
        """Start the engine if it is not up; the replica's facts for the driver."""
        if self._death is not None:  # not ready until restarted: this call fails as the process ends
            await asyncio.Event().wait()
        await self._engine_up()
        return self.info()

    def info(self) -> dict[str, Any]:
        import ray

        return {"index": self.index, "pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "in_flight": self.in_flight, "max_in_flight_seen": self.max_in_flight_seen,
                "shards_served": self.shards_served, "engine_pids": self.engine_pids(),
                "reports_delivered": ray.get(self._inbox.count.remote()) if self._inbox is not None else 0,
                "module_names": self._module_names,
                # requests its engine has not finished (a shard's requests are aborted when the shard is cancelled)
                # (the output processor's count: vLLM 0.32's AsyncLLM asks it too, and 0.26's has no such call)
                "engine_requests": self._engine.output_processor.get_num_unfinished_requests()
                                   if self._engine is not None else 0}

    async def step_counts(self) -> list[dict[str, Any]]:
        """Each rank's step counters, as ``interlace.Model.step_counts`` has them: ``graph_steps``,
        ``taps``, ``replays``, ``write_logs`` and ``saves``."""
        engine = await self._engine_up()
        return await engine.collective_rpc("interlace_step_counts")

    def engine_pids(self) -> list[int]:
        """The engine's processes (its engine core, its workers, multiprocessing helpers): this
        actor's descendants."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=True)]

    def shutdown(self) -> None:
        engine, self._engine, self._starting = self._engine, None, None
        if engine is not None:
            shutdown_engine(engine)
        shutil.rmtree(self.sink_root, ignore_errors=True)

    async def _engine_up(self):
        # One start, shielded: a caller that gives up waiting (a readiness probe's time-out, a
        # cancelled request) must not cancel the start half-way for every caller after it.
        if self._engine is None:
            self._starting = self._starting or asyncio.get_running_loop().create_task(self._start_engine())
            await asyncio.shield(self._starting)
        return self._engine

    async def _start_engine(self) -> None:
        overrides = self.overrides
        if self._spread():  # ranks on several nodes: vLLM's Ray executor starts them in our bundles
            import ray

            context = ray.get_runtime_context()
            os.environ["RAY_ADDRESS"] = context.gcs_address  # the engine core joins this Ray cluster
            overrides = {**overrides, "distributed_executor_backend": "ray"}
            self._inbox, name = ReportInbox.start(self.sink_root)
            self.sink = f"ray:{context.get_node_id()}:{context.namespace}:{name}:{self.sink_root}"
        try:
            engine = await start_async_engine(self.config, keep_stats=self.state is not None, **overrides)
            self._module_names = all_module_names(await engine.collective_rpc("interlace_module_names"))
        except BaseException:
            self._starting = None  # the next caller tries again
            raise
        self._engine = engine
        if self.state is not None:
            self._gauges_task = asyncio.get_running_loop().create_task(self._push_gauges())
        if self._spread():
            self._nodes_task = asyncio.get_running_loop().create_task(self._watch_nodes())

    async def _watch_nodes(self, every_s: float = 1.0) -> None:
        """A spread replica: end this process (Ray restarts it, its shards run again) once a node
        holding one of its ranks is gone. vLLM's Ray executor would wait for the lost rank's
        step until ``RAY_CGRAPH_get_timeout`` (300 s): a PP=2 replica losing a node on the 2-core
        machine stalled its traces 5 minutes (tests/test_multinode_loss.py). The nodes are those
        of its start: Ray moves a lost node's bundles elsewhere, and the engine's ranks do not follow."""
        import ray
        from ray.util import placement_group_table

        group = ray.util.get_current_placement_group()
        nodes = set((await asyncio.to_thread(placement_group_table, group))["bundles_to_node_id"].values())
        while True:
            await asyncio.sleep(every_s)
            alive = {node["NodeID"] for node in await asyncio.to_thread(ray.nodes) if node["Alive"]}
            if not nodes <= alive:
                self._die("a node holding its ranks is gone")

    def _spread(self) -> bool:
        """Whether this replica's ranks have a bundle each (cluster/placement.py)."""
        import ray

        group = ray.util.get_current_placement_group()
        return group is not None and len(group.bundle_specs) > 1

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine died is unhealthy (Serve replaces it)."""
        engine = self._engine
        if engine is not None and getattr(engine, "errored", False):
            raise RuntimeError(f"replica {self.index}: its engine is dead")

    async def _push_gauges(self, every_s: float = 1.0) -> None:
        """Serve only: this replica's shards in flight, scheduler queue and KV-cache use, to the
        metrics registry."""
        replica = f"{os.getpid()}"
        while True:
            try:
                stats = getattr(self._engine, "interlace_latest_stats", {}).get("scheduler")
                await self.state.call("record_replica", replica, self.in_flight,
                                      stats.num_waiting_reqs if stats is not None else None,
                                      float(stats.kv_cache_usage) if stats is not None else None)
            except Exception:  # noqa: BLE001 - the state restarting: the next push lands
                pass
            await asyncio.sleep(every_s)

    # --- shards ------------------------------------------------------------------------------

    async def run(self, task: ShardTask) -> list[Completion]:
        """Run one shard: generate every invoke, forward its reports to the collector, return the
        completions (in the shard's invoke order), or an :class:`EngineDeath` when the engine died
        under it (this process then ends: see :meth:`_engine_died`)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._death is not None:
            return self._death
        engine = await self._engine_up()
        self.in_flight += 1
        self.max_in_flight_seen = max(self.max_in_flight_seen, self.in_flight)
        try:
            return await self._run(engine, task)
        except (EngineDeadError, _EngineGone):
            return self._engine_died(task)
        finally:
            self.in_flight -= 1
            self.shards_served += 1

    async def _generate(self, engine, task: ShardTask) -> list:
        """The shard's requests on the engine, all at once; their final outputs, in order."""

        wire = task.wire_trace
        prompts, params = build_requests(task.prompts, task.payloads, task.settings, wire,
                                         sink=self.sink)
        ids = [f"{wire}-{p.invoke if p is not None else i}" for i, p in enumerate(task.payloads)]
        work = asyncio.gather(*(_final(engine.generate(prompt, param, rid))
                                for prompt, param, rid in zip(prompts, params, ids)))
        try:
            while not (await asyncio.wait({work}, timeout=_DEATH_CHECK_S))[0]:
                if self._engine_gone():
                    raise _EngineGone()
        finally:
            work.cancel()  # a cancelled shard (a client gone) aborts its requests, as awaiting the gather did
            # A gather cancelled this way ends with a CancelledError nobody reads: read it, or asyncio
            # logs "_GatheringFuture exception was never retrieved" with a traceback
            work.add_done_callback(_read_outcome)
        return work.result()

    async def _watch(self, task: ShardTask, expected: set[tuple[int, int]]):
        """Every expected report of the shard from the sink folder (a ReportWatcher, done)."""

        watcher = ReportWatcher(self.sink_root, task.wire_trace, expected, REPORT_GRACE_S)
        try:
            watcher.poll()
            while not watcher.done:
                await asyncio.sleep(_POLL_S)
                if self._engine_gone():
                    raise _EngineGone()
                watcher.poll()
        except ReportsMissing as exc:
            raise self._stopped_reporting(exc) from exc
        return watcher

    def _stopped_reporting(self, exc: ReportsMissing) -> "_EngineGone":
        """An engine that generates but whose reports stopped coming (a worker dead after its
        tokens, files it can no longer open) would fail every later shard alike: it is treated
        as dead, and this replica restarts."""
        print(f"interlace replica {self.index}: {exc}", flush=True)
        self._reports_stopped = str(exc)
        return _EngineGone()

    def _engine_gone(self) -> bool:
        """Whether the engine died, for a shard that may never hear it from a ``generate`` call:
        one waiting on reports after its generation ended (a rank killed while writing a batch
        leaves its ``.partial-`` file, which keeps ReportWatcher's grace open for as long as it
        exists), or on a request added as the engine died (vLLM fails the requests it holds when
        its output handler ends; one registered just after waits for ever). Either way a sweep's
        shard runner once waited in ``run_here`` until it was killed."""
        return self._death is not None or getattr(self._engine, "errored", False)

    def _collector_handle(self):
        import ray

        if self._collector is None:
            self._collector = ray.get_actor(self.collector_name)
        return self._collector

    async def _run(self, engine, task: ShardTask) -> list[Completion]:
        outputs = await self._generate(engine, task)
        expected = set(task.expected())
        if expected:
            reports = await self._reports(task, expected)
            try:
                await self._collector_handle().report.remote(reports)
            except Exception as exc:  # noqa: BLE001 - a restarted collector: the driver re-runs the trace
                print(f"interlace replica {self.index}: the collector did not take {task.wire_trace}'s reports: {exc!r}", flush=True)
        return [Completion.from_vllm(out) for out in outputs]

    async def _reports(self, task: ShardTask, expected: set[tuple[int, int]]) -> list[Report]:
        """The shard's reports from the sink folder, saves in one object of this replica's
        (:class:`SavesRef`; the collector passes the refs on, the driver fetches the object once),
        or left in the folder when the driver is on this node (:class:`SavesOnNode`)."""
        import ray

        watcher = await self._watch(task, expected)
        reports = [Report.from_worker(raw, trace=task.trace, attempt=task.attempt) for raw in watcher.reports]
        for report in reports:  # to the collector, through Ray
            report.shared = _compact(report.shared)
        saving = [r for r in reports if r.saves]
        if saving and task.driver_node == ray.get_runtime_context().get_node_id():
            for report in saving:  # the driver maps the files itself, and removes them
                report.saves = SavesOnNode(str(watcher.folder), report.invoke, report.stage)
            return reports
        if saving:  # compact copies: the saves are views of the mapped report files
            ref = ray.put([_compact(r.saves) for r in saving])
            for index, report in enumerate(saving):
                report.saves = SavesRef(ref, index)
        discard(watcher.folder)
        return reports

    async def run_here(self, task: ShardTask) -> ShardOutcome:
        """Run one shard for a caller without a collector: its completions and its reports, saves
        as tensors that view the mapped report files (valid after the files are removed; a
        caller in another process compacts them first: :func:`compact_outcome`). A sweep's shard
        writer hosts a Replica this way, so saved tensors go from the workers to the shard's files
        on this node with one copy; Serve's engine deployment compacts and sends them on."""
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = await self._engine_up()
        started = time.time()
        self.in_flight += 1
        self.max_in_flight_seen = max(self.max_in_flight_seen, self.in_flight)
        try:
            outputs = await self._generate(engine, task)
            watcher = await self._watch(task, set(task.expected()))
            return ShardOutcome([Completion.from_vllm(out) for out in outputs], self._take_reports(task, watcher),
                                started, _first_token_s(outputs))
        except (EngineDeadError, _EngineGone):
            self._die(f"engine died while running shard {task.wire_trace}")
        finally:
            self.in_flight -= 1
            self.shards_served += 1

    async def stream(self, task: ShardTask):
        """Run one shard, yielding as it goes: ``("tokens", i, new token ids, new text)`` while
        invoke ``i`` (its index in the shard) generates, ``("invoke", i, Completion, reports)`` once
        it finished and every stage reported, and ``("started", time)`` first. Serve's ingress
        streams these to an HTTP client as server-sent events."""
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        engine = await self._engine_up()
        wire = task.wire_trace
        prompts, params = build_requests(task.prompts, task.payloads, {**task.settings, "output_kind": RequestOutputKind.DELTA},
                                         wire, sink=self.sink)
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, prompt, param) -> None:
            rid = f"{wire}-{task.payloads[i].invoke if task.payloads[i] is not None else i}"
            try:
                async for out in engine.generate(prompt, param, rid):
                    await events.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                await events.put((i, exc))
                return
            await events.put((i, None))

        pumps = [asyncio.create_task(pump(i, p, q)) for i, (p, q) in enumerate(zip(prompts, params))]
        # Reports are due once their invoke finished: a stream may generate for longer than the grace.
        watcher = ReportWatcher(self.sink_root, wire, set(task.expected()), REPORT_GRACE_S, due=())
        tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        texts: dict[int, str] = {i: "" for i in range(len(prompts))}
        finished: dict[int, Completion] = {}
        sent: set[int] = set()
        self.in_flight += 1
        self.max_in_flight_seen = max(self.max_in_flight_seen, self.in_flight)
        try:
            yield ("started", time.time())
            while len(sent) < len(prompts):
                if self._engine_gone():
                    raise _EngineGone()
                try:
                    i, out = await asyncio.wait_for(events.get(), _POLL_S * 4)
                except asyncio.TimeoutError:
                    i, out = None, None
                if isinstance(out, BaseException):
                    raise out
                if out is not None:
                    new = out.outputs[0]
                    tokens[i] += new.token_ids
                    texts[i] += new.text
                    yield ("tokens", i, list(new.token_ids), new.text)
                elif i is not None:
                    finished[i] = Completion(tokens[i], texts[i])
                    if task.payloads[i] is not None:
                        watcher.mark_due((task.payloads[i].invoke, s) for s in range(task.stages))
                waiting = finished.keys() - sent
                if not waiting:
                    continue  # reports are read once an invoke finished (a folder listing per event cost the loop)
                try:
                    watcher.poll()
                except ReportsMissing as exc:
                    raise self._stopped_reporting(exc) from exc
                for j in sorted(waiting):
                    payload = task.payloads[j]
                    if payload is not None and any((payload.invoke, s) in watcher.wanted for s in range(task.stages)):
                        continue
                    mine = [r for r in watcher.reports if payload is not None and r["invoke"] == payload.invoke]
                    yield ("invoke", j, finished[j], [Report.from_worker({**raw, "saves": _compact(raw["saves"]), "shared": _compact(raw["shared"])},
                                                                        trace=task.trace, attempt=task.attempt)
                                                      for raw in mine])
                    sent.add(j)
        except (EngineDeadError, _EngineGone):
            self._die(f"engine died while running shard {wire}")
        finally:
            for p in pumps:
                p.cancel()
            discard(watcher.folder)
            self.in_flight -= 1
            self.shards_served += 1

    def _take_reports(self, task: ShardTask, watcher) -> list[Report]:
        # The saves view private mappings of the files removed here, which stay valid.
        reports = [Report.from_worker(raw, trace=task.trace, attempt=task.attempt) for raw in watcher.reports]
        discard(watcher.folder)
        return reports

    def _engine_died(self, task: ShardTask) -> EngineDeath:
        """Why the engine died (found once per engine); this process ends once the shards it held
        have their answer."""
        if self._death is None:
            self._death = self._attribute()
            blamed = f"; trace {self._death.culprit}'s program ended it" if self._death.culprit else ""
            print(f"interlace replica {self.index}: engine died while running shard {task.wire_trace}{blamed}", flush=True)
            asyncio.get_running_loop().create_task(self._die_once_answered())
        return self._death

    def _attribute(self) -> EngineDeath:
        """The trace whose program ended the engine, from the dead ranks' flight records
        (workers/flight.py ``culprit``: the program the watchdog ended, else the one whose code
        was running when its process ended)."""
        record = culprit(read_records(self.sink_root))
        if record is None:
            return EngineDeath(self.index, None, message=self._reports_stopped or "")
        invoke, limit = record["invoke"], record.get("limit_s", 0.0)
        if record["state"] == "overran":
            cause, message = "time_limit", (
                f"invoke {invoke}'s program ran past the trace's time limit of {limit:g}s and did not stop (it "
                "caught the interruption, e.g. with `except BaseException`, or sat in one long call into C), so "
                f"interlace ended the engine's process (replica {self.index}). Let ProgramError propagate "
                "(catch Exception, not BaseException) and keep blocking calls short")
        else:
            cause, message = "exited", (
                f"invoke {invoke}'s program ended the engine's process while it ran (replica {self.index}): it "
                "called os._exit, crashed the interpreter or a C extension, or the process was killed while it ran "
                "(e.g. for memory)")
        return EngineDeath(self.index, ShardTask.trace_of(record["trace"]), invoke, cause, message)

    async def _die_once_answered(self) -> None:
        """End this process once every shard call it held returned (its EngineDeath on the way)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _ANSWER_S
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(_FLUSH_S)  # Ray sends a returned call's answer from its own threads
        self._die("engine died")

    def _die(self, why: str) -> None:
        """End this process (and what is left of the engine's) so Ray restarts the actor."""
        import psutil

        print(f"interlace replica {self.index}: {why}; exiting for a restart", flush=True)
        for child in psutil.Process().children(recursive=True):
            try:
                # A multiprocessing resource tracker stays: once every process it serves is gone it
                # unlinks the shared memory and semaphores they left (vLLM's queues between the
                # engine's processes). Killed with them, those stayed in /dev/shm at every restart.
                if "multiprocessing.resource_tracker" not in " ".join(child.cmdline()):
                    child.send_signal(signal.SIGKILL)
            except psutil.Error:  # gone already, or not ours to read
                pass
        shutil.rmtree(self.sink_root, ignore_errors=True)
        os._exit(1)


@dataclasses.dataclass
class ReportInbox:
    """A spread replica's mailbox, an actor on the replica's node: ranks on other nodes send their
    report batches here (workers/sink.py, ``RaySink``), which it writes into the replica's sink
    folder as those ranks' own batches, where the shard watchers read them. An actor of its own,
    not a method of the replica: Serve's and sweeps' hosts are actors of other classes."""

    def __init__(self, folder: str):
        self.sink = DirSink(folder)
        self.delivered = 0

    @classmethod
    def start(cls, folder: Path):
        """An inbox on this node, named for the ranks to find it, ended with its owner (this
        process): (its handle, its name)."""
        import uuid

        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        name = f"interlace-inbox-{uuid.uuid4().hex[:12]}"
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return ray.remote(cls).options(name=name, num_cpus=0, scheduling_strategy=here).remote(str(folder)), name

    def deliver(self, trace: str, stage: int, reports: list[dict]) -> None:
        self.sink.write(trace, stage, reports)
        self.sink.close(trace, stage)
        self.delivered += len(reports)

    def count(self) -> int:
        return self.delivered


@dataclasses.dataclass
class ShardOutcome:
    """What ``run_here`` returns for one shard."""

    completions: list[Completion]  # in the shard's invoke order
    reports: list[Report]  # saves as tensors
    started_at: float  # wall clock (time.time()) when the replica began the shard
    first_token_s: float | None  # the engine's time to the shard's first token (None: not measured)


def compact_outcome(outcome: ShardOutcome) -> ShardOutcome:
    """``outcome`` with every saved tensor in its own storage, to send to another process (a view
    of a report file's mapping would be pickled with all of the mapping)."""
    for report in outcome.reports:
        report.saves, report.shared = _compact(report.saves), _compact(report.shared)
    return outcome


def _first_token_s(outputs) -> float | None:
    latencies = [out.metrics.first_token_latency for out in outputs
                 if getattr(out, "metrics", None) is not None and getattr(out.metrics, "first_token_latency", 0)]
    return min(latencies) if latencies else None


async def _final(stream):
    out = None
    async for out in stream:
        pass
    return out


def _compact(value: Any) -> Any:
    """``value`` with every tensor copied to its own storage (a view pickles its whole base), in a
    form that unpickles in another process (core.wire.portable)."""
    import torch

    if isinstance(value, torch.Tensor):
        return portable(value.clone())
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_compact(v) for v in value)
    return value


def replica_actor(placement_group, cluster: ClusterConfig, cores: list[int] | None, max_restarts: int = -1):
    """The Replica class as a Ray actor in ``placement_group``'s first bundle: holding its GPUs
    where the placement group is its one bundle (Ray points the engine's ranks at them), or the
    host of a spread replica, whose ranks vLLM's Ray executor places in the bundles, one each
    (see :mod:`interlace.cluster.placement`)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    env = {"VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if cores:
        env["INTERLACE_CPU_CORES"] = ",".join(map(str, cores))
    return ray.remote(Replica).options(
        **host_actor_options(cluster, spread=len(placement_group.bundle_specs) > 1),
        max_restarts=max_restarts,
        max_task_retries=0,  # the driver re-runs a dead replica's shards itself, as new attempts
        max_concurrency=cluster.max_in_flight + 16,  # plus status calls
        runtime_env={"env_vars": env},
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True),
    )


def _read_outcome(future: asyncio.Future) -> None:
    """Mark a finished future's exception read (a cancelled one has none to read)."""
    if not future.cancelled():
        future.exception()

