"""Engine cores of in-process models fork from one server that imported vLLM once
(cluster/engine_processes.py), and run with the environment their caller had when it started them."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

import psutil

import interlace
from conftest import shared_memory_files, socket_files


def _engine_core(model: interlace.Model) -> psutil.Process:
    (process,) = model.engine.llm_engine.engine_core.resources.engine_manager.processes
    return psutil.Process(process.pid)


def _set_at_start(m):
    """A program: what the rank's environment says of the variable the test set."""
    import os

    m.save("env", os.environ.get("INTERLACE_TEST_SET_AT_START"))


def test_a_second_engine_core_forks_from_the_server_with_the_callers_environment(llama, monkeypatch):
    first = _engine_core(llama)
    server = first.parent()
    assert server.pid != os.getpid() and "forkserver" in " ".join(server.cmdline())
    monkeypatch.setenv("INTERLACE_TEST_SET_AT_START", "yes")  # set after the server started
    sockets = socket_files()
    second = interlace.Model("tiny-llama")
    try:
        assert _engine_core(second).parent().pid == server.pid  # the same server: vLLM imported once
        assert second.generate("Hi", program=_set_at_start).saves["env"] == "yes"
        assert second.generate("Hello", max_tokens=3).token_ids == llama.generate("Hello", max_tokens=3).token_ids
        made = socket_files() - sockets
        assert len(made) >= 6, made  # its ZMQ endpoints' files (the client's, its core's, its worker's)
    finally:
        second.close()
    assert llama.generate("Hi", program=_set_at_start).saves["env"] is None  # started before it was set
    # Closed, it leaves none of them: vLLM's shutdown kills its processes, and libzmq left each
    # file (7 for every engine started), the handshake's too
    left = socket_files() - sockets
    assert not left, left


def test_a_model_closed_while_a_trace_runs_fails_that_trace_rather_than_cut_it_short(tmp_path, llama):
    """vLLM's generate() returned every request aborted, as if finished: the trace came back with
    a fraction of its tokens and saves, and no error."""
    model = interlace.Model("tiny-llama")
    marker = tmp_path / "running"

    def long_running(m):  # tells the test it is generating, then keeps saving
        if m.step == 3:
            marker.touch()
        m.save("h", m.last(m.layers[1].resid))

    failed = []

    def trace():
        try:
            model.generate("Once upon a time", program=long_running, max_tokens=400, ignore_eos=True)
        except RuntimeError as exc:
            failed.append(str(exc))

    runner = threading.Thread(target=trace)
    try:
        model.engine  # started before the trace: its generation, not the engine's start, is cut
        runner.start()
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert marker.exists()
        model.close()
        runner.join(60)
        assert not runner.is_alive()
        assert len(failed) == 1 and "the model was closed (Model.close()) while this trace ran" in failed[0], failed
        # the model serves on, with a new engine
        assert model.generate("Hello", max_tokens=3).token_ids == llama.generate("Hello", max_tokens=3).token_ids
    finally:
        model.close()


def _save_resid(m):
    m.save("h", m.layers[1].resid)


def test_traces_from_several_threads_start_one_engine_and_each_get_their_own_results(llama, monkeypatch):
    """Four threads tracing on a new model at once (its first use starts the engine) started an
    engine each, and all but the last one's traces failed as if the model had been closed under
    them; a thread's RPC beside another thread's trace could end the process in a ZMQ assertion."""
    import interlace.model as model_module

    started = []
    real_start = model_module.start_engine
    monkeypatch.setattr(model_module, "start_engine", lambda *a, **k: started.append(1) or real_start(*a, **k))
    model = interlace.Model("tiny-llama")
    results, errors = {}, []

    def trace(i: int) -> None:
        try:
            with model.trace(max_tokens=4, ignore_eos=True) as tr:
                tr.invoke(f"Hello number {i}", program=_save_resid)
            results[i] = tr.result[0]
        except Exception as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    threads = [threading.Thread(target=trace, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            if model._engine is not None:
                model.step_counts()  # an RPC from this thread beside the traces
            time.sleep(0.05)
        assert not errors, errors
        assert len(started) == 1
        for i, result in results.items():
            alone = llama.generate(f"Hello number {i}", program=_save_resid, max_tokens=4, ignore_eos=True)
            assert result.token_ids == alone.token_ids
            assert (result.saves["h"] == alone.saves["h"]).all()
        assert len(results) == 4
    finally:
        model.close()


SCRIPT = """
import os, sys, time
import interlace
model = interlace.Model("tiny-llama")
print(model.generate("Hi", max_tokens=2).token_ids, flush=True)
print("READY", flush=True)
time.sleep(600)
"""


def test_a_script_with_no_main_guard_runs_an_engine_that_ends_when_the_script_is_killed(tmp_path):
    """A script file that starts a model at its top level, as README's first example does: an
    engine core's process ran the script again (multiprocessing's preparation of a spawned or
    fork-server child) and failed to start with "Engine core initialization failed", unless the
    script was guarded by ``if __name__ == "__main__":`` (engine_processes._preparation_data).

    And vLLM's engine core does not watch the process that started it (vllm-project/vllm#55510):
    a script killed by SIGKILL (the OOM killer, a crash) left its engine core, its workers and
    the fork server they came from running, holding their memory until killed by hand. Each
    ends within seconds of the script now (workers/plugin.py, _end_with_the_owner)."""
    import signal
    import subprocess
    import sys

    import tempfile

    import torch

    from interlace.core.settings import fast_tmp_dir

    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    root = Path(fast_tmp_dir() or tempfile.gettempdir())
    before = set(root.glob("interlace-*"))
    script = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    left: list[psutil.Process] = []
    try:
        assert any(line.strip() == "READY" for line in script.stdout)  # (vLLM logs to stdout too)
        left = psutil.Process(script.pid).children(recursive=True)
        names = [p.name() for p in left]
        assert any(n.startswith("VLLM::EngineCor") for n in names)  # (and on a CPU its worker: a GPU's is in it)
        folders = [f for f in set(root.glob("interlace-*")) - before if f.is_dir()]
        segments = shared_memory_files(left)  # vLLM's message queues between the engine's processes
        assert folders and (segments or torch.cuda.is_available()), (folders, segments)  # (a GPU at TP=1 has none)
        sockets = socket_files([script.pid, *left])  # its ZMQ endpoints' files, the script's client's too
        # (the client's two; on a CPU its core's and its worker's queues too: a GPU at TP=1 has none)
        assert len(sockets) >= (2 if torch.cuda.is_available() else 6), sockets
        os.kill(script.pid, signal.SIGKILL)
        script.wait()
        _gone, alive = psutil.wait_procs(left, timeout=30)
        assert not alive, f"still running 30 s after the script was killed: {[(p.pid, p.name()) for p in alive]}"
        # its report folder (a weakref finalizer's, which a kill never runs) and the segments go
        # with it (driver/core/janitor.py)
        deadline = time.monotonic() + 10
        while [p for p in [*folders, *segments, *sockets] if p.exists()] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in [*folders, *segments, *sockets] if p.exists()]
    finally:
        script.kill()
        for process in left:  # (what a failure left, for the tests after this one)
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def test_cores_the_process_cannot_use_are_refused_before_the_engine_starts(monkeypatch):
    """A replica bound to cores its host does not have (``cpu_cores: [[7]]`` on two cores) started,
    vLLM binding its threads to cores that are not there; it now fails to start, saying why."""
    import pytest

    from interlace.cluster.config import ModelConfig
    from interlace.cluster.engine import prepare_environment

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "INTERLACE_ENGINE_OWNER"):  # set by prepare_environment: restored after
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("INTERLACE_DEVICE", "cpu")  # (CPU engines only bind cores)
    usable = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("INTERLACE_CPU_CORES", f"{usable[0]},{max(usable) + 5}")
    with pytest.raises(ValueError, match=rf"cpu_cores: cores \[{max(usable) + 5}\] are not among those this process may use"):
        prepare_environment(ModelConfig.load("tiny-llama"))
    monkeypatch.setenv("INTERLACE_CPU_CORES", str(usable[0]))
    prepare_environment(ModelConfig.load("tiny-llama"))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(usable[0])


SPAWNING_SCRIPT = """
import os, sys
from interlace.cluster.engine_processes import engine_core_context
with open(sys.argv[1], "a") as record:  # at the top level: once, unless a child runs the script again
    record.write("ran\\n")
context = engine_core_context()
core = context.Process(target=os.getpid)
core.start()
core.join()
print("EXIT", context.get_start_method(), core.exitcode)
"""


def test_a_spawned_engine_core_does_not_run_the_callers_script_again(tmp_path):
    """Where vLLM spawns an engine core (a GPU process whose CUDA is initialized already, e.g. by a
    steering vector made on the device; a Ray actor), the child ran the caller's unguarded script
    again and its nested start failed, as on a CPU (the first test here). vLLM's own choice of
    spawn is set through its environment variable, as vLLM sets it."""
    import subprocess
    import sys

    path, record = tmp_path / "script.py", tmp_path / "record"
    path.write_text(SPAWNING_SCRIPT)
    done = subprocess.run([sys.executable, str(path), str(record)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"})
    assert "EXIT spawn 0" in done.stdout, done.stdout + done.stderr[-2000:]
    assert record.read_text() == "ran\n"
