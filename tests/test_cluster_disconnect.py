"""A caller that disconnects leaves nothing behind on the Ray cluster.

The test starts a Ray cluster (with the dashboard, for the state API) and runs a driver script in
a subprocess that joins it, starts a one-replica ``interlace.Cluster``, submits traces and waits.
The test kills that driver by pid mid-run: its actors, placement groups, engine processes, the
replica's report folder and its engine's shared-memory segments must all go, and the Ray cluster
must get its CPUs back.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import shared_memory_files

DRIVER = """
import json, sys, time
import interlace
from interlace import ops
from interlace.cluster.config import ClusterConfig

cluster = interlace.Cluster(ClusterConfig(model="tiny-llama", replicas=1, max_in_flight=2, cpu_cores=[[0]]),
                            address=sys.argv[1])
futures = []
for i in range(200):
    tr = cluster.trace(max_tokens=16, ignore_eos=True)
    tr.invoke(f"Caller {i}", ops=[ops.save("layers.1.resid")])
    futures.append(cluster.submit(tr))
while sum(f.done() for f in futures) < 2:
    time.sleep(0.01)
info = cluster.replica_info()[0]
print("RUNNING " + json.dumps({"name": cluster.name, "pids": [info["pid"], *info["engine_pids"]],
                                "in_flight": cluster.status()["held"]}), flush=True)
time.sleep(600)
"""


def _sink_folders(name: str) -> list[Path]:
    return [p for root in ("/dev/shm", tempfile.gettempdir()) for p in Path(root).glob(f"interlace-{name}-*")]


def _file_stores() -> set[Path]:
    """vLLM's rendezvous files for an engine's ranks (torch FileStores) in the temp folder."""
    return set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))


def _multiprocessing_temp_dirs(pids) -> list[Path]:
    """The multiprocessing temp folders (``pymp-*``) where the processes ``pids`` listen (a fork server's socket)."""
    found = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found |= {Path(c.laddr).parent for c in psutil.Process(pid).net_connections(kind="unix")
                      if c.laddr and Path(c.laddr).parent.name.startswith("pymp-")}
    return sorted(found)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _alive(lister, address: str) -> list:
    """What the state API lists not dead, on this test's Ray (other Rays may run on the machine)."""
    return [x for x in lister(address=address, filters=[("state", "!=", "DEAD")]) if x.state != "REMOVED"]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=True, object_store_memory=200 << 20)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def test_a_killed_driver_leaves_no_actors_placement_groups_processes_or_folders(ray_cluster, tmp_path):
    import ray
    from ray.util.state import list_actors, list_placement_groups

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    stores_before = _file_stores()
    driver = subprocess.Popen([sys.executable, str(script), ray_cluster], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    try:
        lines = []
        for line in driver.stdout:  # the driver runs its traces until the test kills it
            lines.append(line)
            if line.startswith("RUNNING "):
                break
        else:
            pytest.fail("the driver ended before it ran traces:\n" + "".join(lines[-40:]))
        running = json.loads(line[len("RUNNING "):])
        assert running["in_flight"] > 0
        assert _alive(list_actors, ray_cluster) and _alive(list_placement_groups, ray_cluster)  # what the kill must remove
        assert _sink_folders(running["name"])
        segments = shared_memory_files(running["pids"])
        assert segments
        temp_dirs = _multiprocessing_temp_dirs(running["pids"])
        assert temp_dirs or torch.cuda.is_available()  # a CPU replica's fork server listens in one
        stores = sorted(_file_stores() - stores_before)  # its engine's ranks' rendezvous file
        assert stores or torch.cuda.is_available()  # (vLLM 0.26's GPU executors rendezvous by TCP)
        assert ray.available_resources().get("CPU", 0) < 2
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
            _alive(list_actors, ray_cluster) or _alive(list_placement_groups, ray_cluster) or any(map(_running, running["pids"]))
            or _sink_folders(running["name"]) or [p for p in segments + temp_dirs + stores if p.exists()]
            or ray.available_resources().get("CPU", 0) < 2):
        time.sleep(0.5)
    assert _alive(list_actors, ray_cluster) == [] and _alive(list_placement_groups, ray_cluster) == []
    assert [pid for pid in running["pids"] if _running(pid)] == []  # replica and engine processes
    assert _sink_folders(running["name"]) == []  # the replica's report folder
    # Ray kills the actor's children with it, the resource tracker that unlinks them among them
    assert [p for p in segments if p.exists()] == []
    assert [p for p in temp_dirs if p.exists()] == []  # multiprocessing removes its folder at a normal exit only
    assert [p for p in stores if p.exists()] == []  # torch removes it when its last user closes it cleanly only
    assert ray.available_resources().get("CPU", 0) == 2
