"""Sweeps on a real Ray cluster: shards written by engine replicas (Ray Data actors), read back,
resumed, and equal prompt for prompt to the single-engine ``Model``.

One local Ray for the module (2 logical CPUs; each replica's actor takes one and binds its engine
to its own core). Each sweep starts its own pool of engines, the main cost here, so the cases
share sweeps: the ops sweep is also the one rerun; the program sweep also carries the malformed
rows and the failing prompts, and is stopped by ``max_failures`` before it is resumed; the sweep
from a Hugging Face dataset into an object store also has its engine killed as it starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file

import interlace
from interlace import ops
from interlace.cluster.config import SweepConfig
from interlace.cluster.sweep.runner import SweepStopped, run_sweep

ATOL = 1e-4
STEER = torch.linspace(-0.5, 0.5, 128)
CLUSTER = {"model": "tiny-llama", "replicas": 2, "cpu_cores": [[0], [1]]}
RAY_AGENTS = ("ray::RuntimeEnvAgent", "ray::DashboardAgent")

PROGRAMS = textwrap.dedent('''
    import torch


    def keep_or_fail(m):
        """Saves and shares; fails on prompts of exactly 8 tokens (data-dependent, as user code does);
        saves a complex128 spectrum, which a sweep's file cannot store, on prompts of 7."""
        if m.step == 0 and len(m.positions[0]) == 8:
            raise ValueError("eight-token prompt")
        if m.step == 0 and len(m.positions[0]) == 7:
            m.save("spectrum", torch.fft.rfft(m.layers[0].resid.double(), dim=-1))
        m.layers[1].resid += 0.25
        m.save("r2", m.layers[2].resid)
        m.share("total", m.layers[2].resid.sum(), merge="sum")
        m.share("last_mean", m.last(m.layers[3].resid)[0], merge="mean")
        print(f"step {m.step}")  # kept in the index's printed column
''')


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=400 << 20)
    yield
    assert not ray_engines(), "a sweep's engines outlived its actor pool"
    ray.shutdown()
    assert not ray_engines(), "engines left behind after Ray stopped"


def ray_actor_of(pid: int) -> psutil.Process | None:
    """The Ray worker (``ray::...``) a process runs under, if any: an engine core is its replica
    actor's child, or its fork server's (cluster/engine_processes.py); the session's Model
    engines are under this process's own fork server, not under Ray."""
    return next((p for p in psutil.Process(pid).parents() if p.name().startswith("ray::")), None)


def ray_engines(wait_s: float = 30.0) -> list[int]:
    """vLLM engine processes still under this process's Ray after up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in psutil.Process().children(recursive=True):
            try:
                if proc.status() != psutil.STATUS_ZOMBIE and "EngineCore" in " ".join(proc.cmdline() or [proc.name()]) \
                        and ray_actor_of(proc.pid) is not None:
                    found.append(proc.pid)
            except psutil.Error:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_config(folder: Path, name: str, cluster: dict = CLUSTER, **fields) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"cluster": cluster, **fields}))
    return path


def text_prompts(count: int) -> list[str]:
    return [f"Sample {i} of the sweep is" for i in range(count)]


def token_prompts(count: int) -> list[list[int]]:
    return [[(i * 7 + j) % 200 + 10 for j in range(3 + i % 6)] for i in range(count)]  # 3 to 8 tokens


def shard_mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*")}


def read_plain(folder: Path) -> tuple[list[dict], dict[str, list[torch.Tensor]]]:
    """The index rows and each prompt's saves, with pyarrow and safetensors only."""
    rows, saves = [], {}
    for index in sorted(folder.glob("shard-*.parquet")):
        table = pq.read_table(index).to_pylist()
        with safe_open(index.with_suffix(".safetensors"), framework="pt") as f:
            for row in table:
                for name in f.keys():
                    if not name.startswith("__shared__/") and row.get(f"{name}.offset") is not None:
                        start, length = row[f"{name}.offset"], row[f"{name}.length"]
                        saves.setdefault(row["prompt_id"], {})[name] = f.get_slice(name)[start:start + length]
        rows += table
    return rows, saves


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=ATOL, rtol=ATOL)


def assert_equals_model(out: Path, llama, prompts: list[str], max_tokens: int, layer: int) -> None:
    """The sweep in ``out`` saved ``r<layer>``, the last token's residual after ``layer``: read back
    with pyarrow and safetensors, every prompt once, in order, equal to the same trace on ``Model``."""
    name = f"r{layer}"
    rows, plain = read_plain(out)
    assert [r["prompt_id"] for r in rows] == list(range(len(prompts)))
    with llama.trace(max_tokens=max_tokens) as tr:
        for p in prompts:
            tr.invoke(p, ops=[ops.save(f"layers.{layer}.resid", name=name, tokens="last")])
    for i, want in enumerate(tr.result):
        assert rows[i]["token_ids"] == want.token_ids
        assert_close(plain[i][name], want.saves[name])


# --- ops: 200 prompts, two replicas, read back two ways, rerun skips everything ---------------------


@pytest.fixture(scope="module")
def ops_sweep(ray_cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ops")
    save_file({"steer": STEER}, folder / "vec.safetensors")
    rows = [{"prompt": p} for p in text_prompts(200)] + [{"prompt": "  "}, {"text": "no prompt column here"}]
    write_jsonl(folder / "prompts.jsonl", rows)
    path = write_config(folder, "ops", input={"paths": ["prompts.jsonl"]}, output="out", shard_size=25,
                        shards_in_flight=1, generation={"max_tokens": 3},
                        intervention={"ops": [
                            {"op": "add", "point": "layers.1.resid", "value": {"file": "vec.safetensors", "name": "steer"}},
                            {"op": "save", "point": "layers.2.resid", "name": "resid2", "tokens": "last"},
                            {"op": "save", "point": "logits"}]})
    cfg = SweepConfig.load(path)
    killer = threading.Thread(target=kill_an_engine_after_the_first_shard, args=(Path(cfg.output), victims))
    killer.start()
    try:
        manifest = run_sweep(cfg)
    finally:
        killer.join()
    return cfg, manifest, Path(cfg.output)


victims: list[int] = []
actors: list[int] = []


def kill_an_engine_after_the_first_shard(out: Path, killed: list[int]) -> None:
    """Kill one replica's engine core mid-sweep: its actor exits, Ray restarts it, and the shard
    it held runs again."""
    deadline = time.monotonic() + 300
    while not list(out.glob("shard-*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    engines = ray_engines(wait_s=0)
    if engines:
        actors.extend(ray_actor_of(pid).pid for pid in engines)  # the pool's actors now
        os.kill(engines[0], signal.SIGKILL)
        killed.append(engines[0])


def test_an_ops_sweep_on_two_replicas_equals_one_engine_though_a_replica_died(ops_sweep, llama):
    cfg, manifest, out = ops_sweep
    assert manifest["status"] == "complete"
    assert manifest["counts"] == {"prompts": 202, "shards": 9, "shard_size": 25}
    assert len(victims) == 1 and not psutil.pid_exists(victims[0])  # an engine was killed mid-sweep
    writers = {r["pid"] for r in manifest["shards"].values()}
    assert len(actors) == 2 and writers - set(actors)  # the restarted actor ran shards (the killed one's again)
    assert len(writers) >= 2  # and both replicas did work
    with llama.trace(max_tokens=3) as tr:
        for prompt in text_prompts(200):
            tr.invoke(prompt, ops=[ops.add("layers.1.resid", STEER), ops.save("layers.2.resid", name="resid2", tokens="last"),
                                   ops.save("logits")])
    sweep = interlace.open_sweep(out)
    rows, plain = read_plain(out)
    assert [r["prompt_id"] for r in rows] == list(range(202))  # each prompt exactly once, in order
    for i, want in enumerate(tr.result):
        got = sweep[i]
        assert got.error is None and got.prompt == text_prompts(200)[i]
        assert got.token_ids == want.token_ids == rows[i]["token_ids"]
        assert got.text == want.text
        for name in ("resid2", "logits"):
            assert_close(got.saves[name], want.saves[name])
            assert_close(plain[i][name], want.saves[name])
    frame = sweep.to_pandas()
    assert frame["error"].iloc[200] == "empty prompt"
    assert "no prompt in column 'prompt'" in frame["error"].iloc[201]
    assert frame["error"].iloc[:200].isna().all()
    assert manifest["summary"]["failures"] == 2 and manifest["summary"]["prompts"] == 202


def test_a_rerun_skips_every_finished_shard(ops_sweep):
    cfg, manifest, out = ops_sweep
    before = shard_mtimes(out)
    started = time.monotonic()
    again = run_sweep(cfg)
    assert time.monotonic() - started < 30  # no engine started
    assert shard_mtimes(out) == before
    assert again["shards"] == manifest["shards"]
    assert again["status"] == "complete" and again["summary"]["prompts_this_run"] == 0


def test_a_rerun_after_its_vector_file_or_prompts_changed_is_refused_and_resumes_once_restored(ops_sweep):
    """The config's identity did not see a tensor file's or the prompt file's contents: the rerun
    resumed, and the folder held shards of two different sweeps."""
    cfg, manifest, out = ops_sweep
    folder = Path(cfg.output).parent
    vec, prompts = folder / "vec.safetensors", folder / "prompts.jsonl"
    originals = {path: path.read_bytes() for path in (vec, prompts)}
    before = shard_mtimes(out)
    try:
        save_file({"steer": STEER * 2}, vec)
        with pytest.raises(ValueError, match=r"holds 9 finished shards made from other op values"):
            run_sweep(cfg)
        vec.write_bytes(originals[vec])
        prompts.write_text(prompts.read_text().replace("Sample 3 of", "Sample three of"))
        with pytest.raises(ValueError, match=r"holds 9 finished shards made from other prompts"):
            run_sweep(cfg)
    finally:
        for path, data in originals.items():
            path.write_bytes(data)
    assert run_sweep(cfg)["status"] == "complete"  # as it was: resumes, with nothing left to run
    assert shard_mtimes(out) == before


def test_a_shared_value_the_sweeps_file_cannot_store_is_reported_and_the_others_kept():
    """A complex128 partial would have stopped the whole sweep at the shard's file (as the saves
    in the program sweep above would); it is a shared error of the shard, the others written."""
    from interlace.cluster.sweep.shard_writer import Outcome, PromptRow, _shared_partials

    rows = [PromptRow(i, i, [5, 6]) for i in range(2)]
    outcomes = {i: Outcome(shared=[("phase", "sum", torch.ones(3, dtype=torch.complex128)), ("n", "sum", torch.ones(1))])
                for i in range(2)}
    partials, meta, errors = _shared_partials(rows, outcomes)
    assert list(partials) == ["n"] and torch.equal(partials["n"], torch.full((1,), 2.0)) and list(meta) == ["n"]
    assert errors == ["shared value 'phase' (sum) is a torch.complex128 tensor, which a sweep's safetensors file cannot "
                      "store; share torch.view_as_real(x) for a complex one, or x.view(torch.uint8)"]


def test_a_shard_sent_again_after_its_commit_returns_the_committed_record_without_running(tmp_path):
    """Ray Data sends a shard again when its actor died after the commit but before its answer
    reached the driver (a node lost right then): the runner it reaches returns the record that
    committed, and never runs it again (this runner has no engine: running would raise)."""
    from interlace.cluster.sweep.shard_writer import Outcome, PromptRow, ShardRunner, committed_record, write_shard
    from interlace.cluster.sweep.store import SweepStore

    store = SweepStore(tmp_path / "out")
    store.make()
    rows = [PromptRow(8, 8, "a prompt"), PromptRow(9, 9, "another")]
    outcomes = {8: Outcome(token_ids=[5, 6], text="xy", prompt_tokens=2, saves={"r": torch.ones(1, 4)}),
                9: Outcome(token_ids=[7], text="z", prompt_tokens=3, saves={"r": torch.zeros(1, 4)})}
    record = write_shard(store, 4, rows, outcomes, run_s=0.5, host="the-lost-node", pid=4242)
    runner = object.__new__(ShardRunner)
    runner.out = store
    assert runner.run_shard(4, rows) == record
    assert json.loads((tmp_path / "out" / "shard-00004.json").read_text())["pid"] == 4242  # left as committed
    tensors = tmp_path / "out" / record["files"]["tensors"]["name"]
    tensors.write_bytes(tensors.read_bytes()[:-1])  # a record whose files are not as recorded is no commit
    assert committed_record(store, 4) is None and committed_record(store, 4, store.sizes()) is None
    assert committed_record(store, 5) is None


def test_an_absent_column_or_an_op_on_a_missing_module_stops_the_sweep_with_one_message(ray_cluster, tmp_path):
    """A column no input has failed every prompt, one by one, after the engines started; an op on a
    module the model lacks failed each engine replica's start (Ray Data retried it, printing
    hundreds of lines of tracebacks, before the sweep died)."""
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"prompt {i}"} for i in range(8)])
    one = {**CLUSTER, "replicas": 1}
    fields = dict(output="out", shard_size=4, generation={"max_tokens": 2})
    save = {"ops": [{"op": "save", "point": "layers.1.resid", "tokens": "last"}]}
    cfg = SweepConfig.load(write_config(tmp_path, "column", cluster=one, input={"paths": ["prompts.jsonl"], "column": "text"},
                                        intervention=save, **fields))
    with pytest.raises(ValueError, match=r"the input has no column 'text' \(its columns: \['prompt'\]\)"):
        run_sweep(cfg)
    assert not ray_engines()  # refused before any engine started
    missing = {"ops": [{"op": "save", "point": "layers.9.resid", "tokens": "last"}]}
    cfg = SweepConfig.load(write_config(tmp_path, "module", cluster=one, input={"paths": ["prompts.jsonl"]},
                                        intervention=missing, **fields))
    with pytest.raises(SweepStopped, match=r"cannot run on this model: no module '9' under 'layers'"):
        run_sweep(cfg)


# --- a program: failing prompts and malformed rows per prompt, max_failures, resume -----------------


def test_a_program_sweep_reports_failures_per_prompt_stops_at_max_failures_and_resumes(ray_cluster, tmp_path, llama):
    (tmp_path / "sweep_programs.py").write_text(PROGRAMS)
    prompts = token_prompts(200)
    bad = [{"prompt": []}, {"prompt": [5, 10**7]}, {"other": [1, 2]}, {"prompt": None}]
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in prompts] + bad)
    fields = dict(input={"paths": ["prompts.jsonl"]}, output="out", shard_size=25, generation={"max_tokens": 2},
                  intervention={"program": "sweep_programs:keep_or_fail"})
    one = {**CLUSTER, "replicas": 1}  # one engine is enough (the two-replica sweep is the ops sweep's)
    cfg = SweepConfig.load(write_config(tmp_path, "stop", cluster=one, max_failures=3, **fields))
    with pytest.raises(SweepStopped, match="more than max_failures=3"):
        run_sweep(cfg)
    out = Path(cfg.output)
    stopped = json.loads((out / "manifest.json").read_text())
    assert stopped["status"].startswith("stopped") and 0 < len(stopped["shards"]) < 9
    kept = {name: t for name, t in shard_mtimes(out).items() if name.removesuffix(".json").removesuffix(".parquet")
            .removesuffix(".safetensors") in {f"shard-{int(k):05d}" for k in stopped["shards"]}}

    cfg = SweepConfig.load(write_config(tmp_path, "resume", cluster=one, **fields))  # max_failures is not part of its identity
    manifest = run_sweep(cfg)
    assert manifest["status"] == "complete"
    assert {n: t for n, t in shard_mtimes(out).items() if n in kept} == kept  # finished shards not written again

    sys.path.insert(0, str(tmp_path))
    try:
        import sweep_programs
    finally:
        sys.path.remove(str(tmp_path))
    good = [i for i, p in enumerate(prompts) if len(p) not in (7, 8)]
    with llama.trace(max_tokens=2) as tr:  # the engine's workers cannot import sweep_programs: sent by value
        for i in good:
            tr.invoke(prompts[i], program=sweep_programs.keep_or_fail)
    sweep = interlace.open_sweep(out)
    rows, plain = read_plain(out)
    assert [r["prompt_id"] for r in rows] == list(range(204))
    for i, want in zip(good, tr.result):
        assert sweep[i].error is None and sweep[i].prompt_token_ids == prompts[i]
        assert sweep[i].token_ids == want.token_ids
        assert sweep[i].printed == want.printed == "step 0\nstep 1\n"
        assert_close(sweep[i].saves["r2"], want.saves["r2"])
        assert_close(plain[i]["r2"], want.saves["r2"])
    for i in set(range(200)) - set(good):
        if len(prompts[i]) == 8:  # failed before it printed
            assert "ValueError" in sweep[i].error and "eight-token prompt" in sweep[i].error
            assert sweep[i].printed is None
        else:  # its program ran (and printed); the whole sweep stopped at the shard's file
            assert "save 'spectrum' is a torch.complex128 tensor, which a sweep's safetensors file cannot store" in sweep[i].error
            assert sweep[i].printed == "step 0\nstep 1\n"
        assert sweep[i].saves == {}  # a failed prompt keeps no saves
    errors = [sweep[200 + k].error for k in range(4)]
    assert errors[0].startswith("empty prompt")
    assert "outside the vocabulary" in errors[1] and "10000000" in errors[1]
    assert "no prompt in column 'prompt'" in errors[2] and "no prompt in column 'prompt'" in errors[3]
    assert manifest["summary"]["failures"] == 200 - len(good) + 4
    for name, want in tr.result.shared.items():
        torch.testing.assert_close(sweep.shared[name], torch.as_tensor(want), atol=1e-3, rtol=1e-4)

    # The program edited after its shards ran: resuming into them is refused (they were made by the old one).
    module = tmp_path / "sweep_programs.py"
    module.write_text(PROGRAMS + "\nFIXED = True\n")
    with pytest.raises(ValueError, match=r"finished shards made from another version of the program \(.*sweep_programs.py changed"):
        run_sweep(cfg)
    module.write_text(PROGRAMS)
    assert run_sweep(cfg)["status"] == "complete"


def kill_the_first_engine_as_it_starts(killed: list[int]) -> None:
    """Kill the sweep's first engine core while it starts: its replica starts it again in the same
    actor, and the sweep completes."""
    deadline = time.monotonic() + 120
    while not killed and time.monotonic() < deadline:
        engines = ray_engines(wait_s=0)
        if engines:
            os.kill(engines[0], signal.SIGKILL)
            killed.append(engines[0])
        time.sleep(0.05)


# --- the same command as a Ray job, against a `ray start --head` cluster with token authentication ---


def test_ray_job_submit_runs_a_sweep_with_the_token_and_is_refused_without(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    write_jsonl(job / "prompts.jsonl", [{"prompt": p} for p in text_prompts(12)])
    out = tmp_path / "out"  # absolute: the job runs in a copy of its working dir
    (job / "sweep.yaml").write_text(yaml.safe_dump({
        "cluster": {"model": "tiny-llama", "replicas": 1}, "input": {"paths": ["prompts.jsonl"]},
        "intervention": {"ops": [{"op": "save", "point": "layers.2.resid", "name": "r2", "tokens": "last"}]},
        "generation": {"max_tokens": 2}, "output": str(out), "shard_size": 4}))
    temp = Path(tempfile.mkdtemp(prefix="irs", dir="/tmp"))  # a private Ray: its processes are found by this path
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    gcs, dashboard, agent = free_ports(3)
    try:
        subprocess.run([str(bin_dir / "ray"), "start", "--head", "--num-cpus", "2", "--temp-dir", str(temp),
                        "--port", str(gcs), "--dashboard-port", str(dashboard), "--dashboard-agent-listen-port",
                        str(agent), "--include-dashboard", "true", "--disable-usage-stats"],
                       env=env, check=True, capture_output=True, timeout=180)
        submit = [str(bin_dir / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dashboard}",
                  "--working-dir", str(job), "--", "interlace", "sweep", "sweep.yaml"]
        anonymous = {**env, "RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "no-token")}
        del anonymous["RAY_AUTH_TOKEN"]
        refused = subprocess.run(submit, env=anonymous, capture_output=True, text=True, timeout=120)
        assert refused.returncode != 0 and "Missing authentication token" in refused.stdout + refused.stderr
        assert not out.exists()
        done = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=500)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "sweep complete: 12 prompts (0 failed)" in done.stdout + done.stderr
        assert "is deprecated" not in done.stdout + done.stderr  # (Ray Data's, of arguments users never gave)
    finally:
        stop_private_ray(temp, gcs)
    sweep = interlace.open_sweep(out)
    assert sweep.status == "complete" and len(sweep) == 12
    assert sweep.to_pandas()["error"].isna().all() and sweep[11].saves["r2"].shape == (2, 128)


def free_ports(count: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def stop_private_ray(temp: Path, gcs_port: int | None = None) -> None:
    """Kill the processes of the Ray started with ``--temp-dir temp`` (never ``ray stop``: it stops
    every Ray on the machine), then remove the folder. A head's ``gcs_port`` finds its Ray client
    server too, which names no temp folder and outlives ``ray start`` (it was left running)."""
    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            line = " ".join(proc.info["cmdline"] or [])
            if proc.pid != os.getpid() and (str(temp) in line or (
                    gcs_port is not None and "ray.util.client.server" in line and f":{gcs_port} " in line)):
                roots.append(proc)
        except psutil.Error:
            continue
    family = {p.pid: p for root in roots for p in [root, *root.children(recursive=True)]}
    for proc in family.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(list(family.values()), timeout=15)
    shutil.rmtree(temp, ignore_errors=True)


# --- a Hugging Face dataset saved to disk in, an S3 API (moto, on 127.0.0.1) out -------------------


def write_hf_dataset(folder: Path, column: str, parts: list[list[str]]) -> Path:
    """What ``datasets.Dataset.save_to_disk`` writes, made with pyarrow: Arrow IPC stream files
    named data-0000i-of-0000n.arrow (schema metadata 'huggingface' holding the features), and
    state.json / dataset_info.json with sorted keys."""
    import pyarrow as pa

    folder.mkdir()
    features = {column: {"dtype": "string", "_type": "Value"}}
    schema = pa.schema([(column, pa.string())], metadata={"huggingface": json.dumps({"info": {"features": features}})})
    names = [f"data-{i:05d}-of-{len(parts):05d}.arrow" for i in range(len(parts))]
    for name, rows in zip(names, parts):
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(pa.table({column: rows}, schema=schema))
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef", "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    info = {"builder_name": None, "citation": "", "config_name": None, "dataset_name": None, "dataset_size": None,
            "description": "", "download_checksums": None, "download_size": None, "features": features,
            "homepage": "", "license": "", "post_processed": None, "post_processing_size": None,
            "size_in_bytes": None, "splits": None, "supervised_keys": None, "version": None}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return folder


@pytest.fixture
def s3_server():
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"{host}:{port}"
    finally:
        server.stop()


def test_a_saved_hf_dataset_sweeps_into_an_object_store_though_its_engine_died_starting(
        ray_cluster, tmp_path, llama, s3_server, monkeypatch):
    import pyarrow.fs as pafs

    prompts = text_prompts(10)
    write_hf_dataset(tmp_path / "prompts_ds", "text", [prompts[:6], prompts[6:]])  # two data files, in order
    query = f"endpoint_override={s3_server}&scheme=http&region=us-east-1"
    url = f"s3://sweeps/steer?{query}"
    fs, _ = pafs.FileSystem.from_uri(f"s3://testing:testing@sweeps?{query}&allow_bucket_creation=true")
    fs.create_dir("sweeps")
    # A killed attempt of shard 1 left its tensors behind (no record): never read, never counted.
    with fs.open_output_stream("sweeps/steer/shard-00001.0badc0de.safetensors") as f:
        f.write(b"half a shard")
    save_file({"steer": STEER}, tmp_path / "vec.safetensors")
    cfg = SweepConfig.load(write_config(
        tmp_path, "hf", cluster={**CLUSTER, "replicas": 1}, input={"paths": ["prompts_ds"], "column": "text"},
        output=f"s3://testing:testing@sweeps/steer?{query}", shard_size=4, generation={"max_tokens": 2},
        intervention={"ops": [{"op": "add", "point": "layers.1.resid", "value": {"file": "vec.safetensors", "name": "steer"}},
                              {"op": "save", "point": "layers.2.resid", "name": "r2"}]})
)
    assert cfg.input.resolved_format() == "hf"
    killed: list[int] = []  # and its engine dies while it starts: one sweep for both cases, as engines cost
    killer = threading.Thread(target=kill_the_first_engine_as_it_starts, args=(killed,))
    killer.start()
    try:
        manifest = run_sweep(cfg)
    finally:
        killer.join()
    assert killed, "no engine was seen starting"
    assert manifest["status"] == "complete" and manifest["counts"] == {"prompts": 10, "shards": 3, "shard_size": 4}
    assert manifest["summary"]["failures"] == 0
    assert "testing:testing" not in json.dumps(manifest)  # no credentials kept in the manifest
    names = {info.base_name: info.size for info in fs.get_file_info(pafs.FileSelector("sweeps/steer"))}
    for record in manifest["shards"].values():  # each shard's objects under attempt-unique names, as recorded
        for f in record["files"].values():
            assert names[f["name"]] == f["bytes"] and f["name"] != "shard-00001.0badc0de.safetensors"

    with llama.trace(max_tokens=2) as tr:
        for p in prompts:
            tr.invoke(p, ops=[ops.add("layers.1.resid", STEER), ops.save("layers.2.resid", name="r2")])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # credentials from the environment this time
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    sweep = interlace.open_sweep(url)
    assert len(sweep) == 10 and sweep.to_pandas()["prompt_id"].tolist() == list(range(10))
    for i, want in enumerate(tr.result):
        assert sweep[i].prompt == prompts[i] and sweep[i].error is None
        assert sweep[i].token_ids == want.token_ids
        assert_close(sweep[i].saves["r2"], want.saves["r2"])

    again = run_sweep(cfg)  # a rerun finds every shard committed in the store and writes none
    assert again["summary"]["prompts_this_run"] == 0 and again["shards"] == manifest["shards"]
    assert {info.base_name: info.size for info in fs.get_file_info(pafs.FileSelector("sweeps/steer"))
            if info.base_name.startswith("shard-")} == {n: b for n, b in names.items() if n.startswith("shard-")}


# --- the config alone (no engine) -----------------------------------------------------------------


def test_the_example_config_loads_with_paths_from_its_folder():
    root = Path(__file__).resolve().parents[1] / "configs" / "sweeps"
    cfg = SweepConfig.load(root / "example.yaml")
    assert cfg.input.paths == [str(root / "prompts.jsonl")] and cfg.cluster.replicas == 2
    steer = cfg.intervention.ops[0].build()
    assert steer["op"] == "add" and steer["value"].shape == (128,)
    with pytest.raises(ValueError, match="give it a value"):
        SweepConfig.model_validate({**cfg.model_dump(), "intervention": {"ops": [{"op": "add", "point": "layers.1.resid"}]}})
