"""SIGTERM, by pid, to ``interlace serve``, ``interlace sweep`` and a script using ``interlace.Cluster``
(each a real subprocess with its own local Ray): a clean stop, as on Ctrl-C.

Each process must exit promptly with its documented status and no Ray stack dump; every process it
started (Ray's head, workers and agents, the replica actors, their engines) must end, and so must
the replicas' report folders and their janitors. The SIGTERMed sweep resumes, and so does a SIGKILLed one.
One subprocess runs at a time (one Ray, one engine).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

import interlace
from test_sweep import RAY_AGENTS, assert_equals_model, shard_mtimes, text_prompts, write_config, write_jsonl

TOKEN = "sigterm-token-0123456789abcdef"
TOKENS = json.dumps({"tokens": [{"name": "t", "token": TOKEN, "role": "code"}]})
RAY_DUMP = "SIGTERM received"  # the first line of the native stack dump Ray's handler prints
STOP_S = 90  # from SIGTERM to the exit: Serve's graceful shutdown, the pool stopped, Ray shut down


class Driver:
    """A subprocess whose stdout lines are read as they come; stderr goes to a file."""

    def __init__(self, args: list[str], folder: Path, env: dict[str, str] | None = None):
        self.err_path = folder / f"stderr-{time.monotonic_ns()}.txt"
        self.lines: list[str] = []
        env = {**os.environ, "RAY_ADDRESS": "", "VLLM_LOGGING_LEVEL": "ERROR", **(env or {})}  # its own local Ray
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, *args], cwd=folder, env=env, stdout=subprocess.PIPE,
                                         stderr=err, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, done, what: str, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert self.proc.poll() is None, f"it ended before {what}: {self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"not {what} within {timeout_s}s"
            time.sleep(0.2)

    def stderr(self) -> str:
        return self.err_path.read_text()

    def family(self) -> dict[psutil.Process, str]:
        """Every process it started, and each one's name now."""
        found = {}
        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                found[proc] = proc.name()
        return found

    def terminate(self, signalled: bool = False) -> tuple[int, float]:
        """SIGTERM by pid (unless ``signalled`` already); its exit status and how long it took."""
        start = time.monotonic()
        if not signalled:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {STOP_S}s after SIGTERM: {self.stderr()[-3000:]}")
        return code, time.monotonic() - start

    def kill(self) -> None:
        """After a failure: the process and everything it started."""
        if self.proc.poll() is None:
            family = self.family()
            for proc in [psutil.Process(self.proc.pid), *family]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            self.proc.wait()


def report_folders(family: dict[psutil.Process, str]) -> list[str]:
    """The replicas' node-local report folders (``interlace-<name>-<actor pid>``, in /dev/shm or the
    temporary folder: interlace.cluster.replica) of the processes in ``family``."""
    started = {}
    for proc in family:
        with contextlib.suppress(psutil.Error):
            started[str(proc.pid)] = proc.create_time()
    roots = {"/dev/shm", tempfile.gettempdir()}
    # A folder older than the process now holding its pid is another's, left by an earlier one that
    # was killed (the pid was used again): a dev machine's /dev/shm collects such leftovers.
    return sorted(f for root in roots for f in glob.glob(f"{root}/interlace-*")
                  if f.rsplit("-", 1)[-1] in started and os.stat(f).st_mtime >= started[f.rsplit("-", 1)[-1]] - 1.0)


def assert_left_nothing(family: dict[psutil.Process, str], folders: list[str], wait_s: float = 30) -> None:
    """Every process of ``family`` ended, each report folder removed and its janitor gone (within
    30 s: Ray's agents and the janitors end a little after the driver)."""
    _gone, alive = psutil.wait_procs(list(family), timeout=wait_s)
    left = [f"{p.pid} {family[p]}" for p in alive]
    for proc in alive:  # report, then clean up
        with contextlib.suppress(psutil.Error):
            proc.kill()
    deadline = time.monotonic() + wait_s
    while any(Path(f).exists() for f in folders) and time.monotonic() < deadline:
        time.sleep(0.5)
    janitors = [p.pid for p in psutil.process_iter(["cmdline"])
                if any(f in " ".join(p.info["cmdline"] or []) for f in folders)]
    assert not left, f"processes left behind: {left}"
    assert not [f for f in folders if Path(f).exists()], f"report folders left behind: {folders}"
    assert not janitors, f"janitors left behind: {janitors}"


def assert_clean_stop(stderr: str) -> None:
    assert RAY_DUMP not in stderr, f"Ray's stack dump:\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slow(m):
    """50 ms a step of each invoke (a worker runs the invokes' programs one after the other)."""
    time.sleep(0.05)


# --- the handler itself, and the checks below, without Ray ---------------------------------------------

HANDLER_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from interlace.core import sigterm

    sigterm.stop_on_sigterm()
    print("waiting", flush=True)
    try:
        time.sleep(60)
    finally:  # Ctrl-C's way out: finally blocks run
        print("cleaning up", sigterm.received(), flush=True)
        if sys.argv[1] == "twice":
            os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM while cleaning up
            time.sleep(60)  # a clean-up that would hang
""")


@pytest.mark.parametrize("signals", ["once", "twice"])
def test_the_first_sigterm_stops_like_ctrl_c_and_a_second_ends_the_process(tmp_path, signals):
    (tmp_path / "handler.py").write_text(HANDLER_SCRIPT)
    driver = Driver(["handler.py", signals], tmp_path)
    try:
        driver.wait_for(lambda: "waiting\n" in driver.lines, "waiting", timeout_s=30)
        code, took = driver.terminate()
    finally:
        driver.kill()
    assert "cleaning up True\n" in driver.lines
    assert took < 10
    if signals == "once":  # interlace.core.sigterm.Terminated, a SystemExit: status 143, no traceback
        assert code == 143 and driver.stderr() == ""
    else:  # ended by the signal itself, as with no handler
        assert code == -signal.SIGTERM


def test_the_leftover_check_catches_a_process_and_a_folder(tmp_path):
    folder = tmp_path / "interlace-serve-1"
    folder.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with pytest.raises(AssertionError, match="processes left behind"):
            assert_left_nothing({psutil.Process(sleeper.pid): "sleep"}, [str(folder)], wait_s=1)
        with pytest.raises(AssertionError, match="report folders left behind"):
            assert_left_nothing({}, [str(folder)], wait_s=1)
    finally:
        sleeper.kill()
        sleeper.wait()


# --- interlace serve: Serve shut down, the trace in flight finished, exit 0 as after Ctrl-C ------------


def test_sigterm_stops_interlace_serve_as_ctrl_c_does(tmp_path):
    port = _free_port()
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump({
        "cluster": {"model": "tiny-llama", "replicas": 1, "resources": {"num_cpus": 1}, "max_in_flight": 4},
        "host": "127.0.0.1", "port": port, "auth": {"tokens_env": "INTERLACE_API_TOKENS"}}))
    driver = Driver(["-m", "interlace", "serve", "serve.yaml"], tmp_path, env={"INTERLACE_API_TOKENS": TOKENS})
    try:
        driver.wait_for(lambda: any("interlace: serving" in line for line in driver.lines), "serving")
        family = driver.family()
        folders = report_folders(family)
        assert len(folders) == 1, folders  # the engine replica's, while it serves
        with interlace.connect(f"http://127.0.0.1:{port}", token=TOKEN) as remote:
            tr = remote.trace(max_tokens=50, ignore_eos=True)
            for i in range(2):
                tr.invoke(f"Prompt {i} in flight when the signal comes", program=slow)
            in_flight = remote.submit(tr)
            time.sleep(1.5)  # sent, and generating (for about 5 s)
            assert not in_flight.done()
            driver.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            late = remote.trace(max_tokens=1)
            late.invoke("Sent after the signal")
            refused = remote.submit(late)
            code, took = driver.terminate(signalled=True)
            result = in_flight.result(timeout=30)  # finished, not cut: Serve drains what runs
            with pytest.raises(Exception):  # noqa: B017 - refused or cut off, whichever way: not run
                refused.result(timeout=30)
        assert [len(r.token_ids) for r in result] == [50] * 2
    finally:
        driver.kill()
    stderr = driver.stderr()
    assert code == 0, stderr[-3000:]  # as after Ctrl-C: a stop is serve's normal end
    assert "SIGTERM: shutting Serve down" in stderr
    assert_clean_stop(stderr)
    assert took < STOP_S
    assert_left_nothing(family, folders)


# --- a user's script with interlace.Cluster: its `with` block closes the cluster, exit 143 ------------

CLUSTER_SCRIPT = textwrap.dedent("""
    import interlace
    from interlace.cluster.config import ClusterConfig

    if __name__ == "__main__":
        cluster = None
        try:
            config = ClusterConfig.model_validate({"model": "tiny-llama", "replicas": 1, "cpu_cores": [[0]]})
            with interlace.Cluster(config) as cluster:
                print("ready", flush=True)
                while True:  # traces keep running until the signal
                    cluster.generate("Hello from a script", max_tokens=16)
        finally:
            print("closed", cluster is not None and cluster._closed, flush=True)
""")


def test_sigterm_to_a_cluster_script_closes_the_cluster(tmp_path):
    (tmp_path / "script.py").write_text(CLUSTER_SCRIPT)
    driver = Driver(["script.py"], tmp_path)
    try:
        driver.wait_for(lambda: "ready\n" in driver.lines, "ready")
        time.sleep(1.0)  # a trace or two in flight
        family = driver.family()
        folders = report_folders(family)
        assert len(folders) == 1, folders
        code, took = driver.terminate()
    finally:
        driver.kill()
    stderr = driver.stderr()
    assert code == 143, stderr[-3000:]  # interlace.core.sigterm.Terminated: a SystemExit(128 + SIGTERM)
    assert "closed True\n" in driver.lines  # the `with` block's close() ran, Ray still up
    assert_clean_stop(stderr)
    assert took < STOP_S
    assert_left_nothing(family, folders)


# --- interlace sweep: SIGTERM stops it (exit 143), a rerun resumes, is SIGKILLed, and the next completes ---


def test_sigterm_stops_interlace_sweep_a_killed_rerun_leaves_nothing_and_each_resume_keeps_what_was_done(tmp_path, llama):
    """One sweep, three runs: the first is stopped by SIGTERM (a clean stop, the manifest says so);
    the second resumes and is SIGKILLed (no clean-up code runs: every process it started must still
    end); the third completes. Each prompt once, committed shards never written again, the output
    equal to one engine's. (One test for both stops: each run starts Ray and an engine afresh.)"""
    prompts = text_prompts(60)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts])
    path = write_config(tmp_path, "sweep", cluster={"model": "tiny-llama", "replicas": 1, "cpu_cores": [[0]]},
                        input={"paths": ["prompts.jsonl"]}, output="out", shard_size=4, shards_in_flight=1,
                        generation={"max_tokens": 3},
                        intervention={"ops": [{"op": "save", "point": "layers.3.resid", "name": "r3", "tokens": "last"}]})
    out = tmp_path / "out"

    def committed() -> set[int]:
        return {json.loads(p.read_text())["shard"] for p in out.glob("shard-*.json")}

    driver = Driver(["-m", "interlace", "sweep", str(path)], tmp_path)
    try:
        driver.wait_for(lambda: len(committed()) >= 3, "3 shards committed", timeout_s=240)
        family = driver.family()
        folders = report_folders(family)
        assert len(folders) == 1, folders  # the shard runner's replica's
        code, took = driver.terminate()
    finally:
        driver.kill()
    stderr = driver.stderr()
    assert code == 143, stderr[-3000:]
    assert "interlace sweep: stopped by SIGTERM; finished shards are kept" in stderr
    assert_clean_stop(stderr)
    assert took < STOP_S
    assert_left_nothing(family, folders)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"].startswith("stopped: SIGTERM")
    first = committed()
    assert 3 <= len(first) < 15
    assert set(map(int, manifest["shards"])) <= first  # the manifest names committed shards only
    kept = {n: t for n, t in shard_mtimes(out).items() if int(n[6:11]) in first}

    rerun = Driver(["-m", "interlace", "sweep", str(path)], tmp_path)
    try:
        rerun.wait_for(lambda: len(committed()) >= len(first) + 2, "2 more shards committed", timeout_s=240)
        family = rerun.family()
        folders = report_folders(family)
        rerun.proc.send_signal(signal.SIGKILL)
        rerun.proc.wait()
    finally:
        rerun.kill()
    # Ray's own node agents outlive a killed head by a while; every other process (raylet, workers,
    # the shard actor, its engine) must end, and the replica's report folder with its janitor.
    assert_left_nothing({p: n for p, n in family.items() if n not in RAY_AGENTS}, folders)
    for proc in family:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    second = committed()
    assert second < set(range(15)) and first < second
    kept.update({n: t for n, t in shard_mtimes(out).items() if int(n[6:11]) in second - first})

    last = subprocess.run([sys.executable, "-m", "interlace", "sweep", str(path)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=400, env={**os.environ, "RAY_ADDRESS": "", "VLLM_LOGGING_LEVEL": "ERROR"})
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"({len(second)} kept from before)" in last.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and len(manifest["shards"]) == 15
    assert {n: t for n, t in shard_mtimes(out).items() if n in kept} == kept
    assert_equals_model(out, llama, prompts, max_tokens=3, layer=3)
