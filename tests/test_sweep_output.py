"""A sweep's output when something goes wrong with it: a real file system that runs out of space
mid-sweep, and shard files changed after the sweep wrote them, read back with ``open_sweep``.

`interlace sweep` runs in a mount namespace of its own (``unshare --map-root-user --mount``, which
needs no privilege where user namespaces are on) over a tmpfs of 64 KiB: the first shards fit,
a later one does not. The command must stop with one line naming the cause, keep every committed
shard whole, and, once the file system has room (the same tmpfs remounted larger), a rerun of the
same command must finish the sweep with every prompt once.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import interlace
from interlace.cluster.sweep.runner import committed_shards
from interlace.cluster.sweep.store import SweepStore

PROMPTS = 12
SHARD_SIZE = 2


@pytest.fixture(scope="module")
def full_then_room(tmp_path_factory) -> Path:
    """The sweep run twice in one mount namespace: on a full tmpfs, then remounted larger. Its
    folder: the commands' output (``first.*``, ``second.*``) and copies of the sweep's output
    after each run (``after-first``, ``after-second``)."""
    tmp_path = tmp_path_factory.mktemp("full")
    assert shutil.which("unshare"), "util-linux's unshare runs this test's sweep in its own mount namespace"
    out = tmp_path / "full"
    out.mkdir()
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"Sample {i} of the sweep is"}) + "\n"
                                                     for i in range(PROMPTS)))
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({
        "cluster": {"model": "tiny-llama", "replicas": 1, "cpu_cores": [[0]]},
        "input": {"paths": ["prompts.jsonl"]},
        # every step's logits (a few KiB a token): 12 prompts need about 250 KiB
        "intervention": {"ops": [{"op": "save", "point": "logits"}, {"op": "save", "point": "layers.1.resid"}]},
        # one shard at a time: two written at once could both find the disk full, and none commit
        "generation": {"max_tokens": 4}, "output": str(out), "shard_size": SHARD_SIZE, "shards_in_flight": 1}))
    script = textwrap.dedent(f"""
        mount -t tmpfs -o size=64k tmpfs {out} || exit 90
        {sys.executable} -m interlace sweep {config} > {tmp_path}/first.out 2> {tmp_path}/first.err
        echo $? > {tmp_path}/first.rc
        cp -a {out} {tmp_path}/after-first
        mount -o remount,size=8m {out} || exit 91
        {sys.executable} -m interlace sweep {config} > {tmp_path}/second.out 2> {tmp_path}/second.err
        echo $? > {tmp_path}/second.rc
        cp -a {out} {tmp_path}/after-second
    """)
    done = subprocess.run(["unshare", "--map-root-user", "--mount", "sh", "-c", script], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return tmp_path


def test_a_full_output_stops_the_sweep_with_one_line_and_a_rerun_with_room_finishes_it(full_then_room):
    """A full disk failed `interlace sweep` with Ray Data's "UDF failed to process a data block",
    a traceback, and a manifest status naming only the Ray wrapper."""
    tmp_path, out = full_then_room, full_then_room / "full"
    first_err = (tmp_path / "first.err").read_text()
    assert (tmp_path / "first.rc").read_text().strip() == "1", first_err[-3000:]
    assert "Traceback" not in first_err, first_err[-3000:]
    said = [line for line in first_err.splitlines() if line.startswith("interlace sweep: ")]
    assert len(said) == 1, first_err[-3000:]  # before, Ray's core worker ended the process before this line
    assert said[0].startswith("interlace sweep: sweep stopped: shard ") and "No space left on device" in said[0], said
    assert str(out) in said[0] and "rerun the same command" in said[0], said
    first = tmp_path / "after-first"
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["status"].startswith("stopped: shard ") and "No space left on device" in manifest["status"]
    shards = -(-PROMPTS // SHARD_SIZE)
    kept = committed_shards(SweepStore(first), shards)
    assert 0 < len(kept) < shards, sorted(kept)  # the disk held some shards, not all
    assert not [p.name for p in first.iterdir() if ".tmp-" in p.name]  # no half-written file left behind

    second_err = (tmp_path / "second.err").read_text()
    assert (tmp_path / "second.rc").read_text().strip() == "0", second_err[-3000:]
    assert f"({len(kept)} kept from before)" in second_err  # the progress and summary lines go to stderr
    assert {k: committed_shards(SweepStore(tmp_path / "after-second"), shards)[k] for k in kept} == kept
    sweep = interlace.open_sweep(tmp_path / "after-second")
    index = sweep.to_pandas()
    assert sorted(index["prompt_id"]) == list(range(PROMPTS)) and not index["error"].any()
    for i in range(PROMPTS):
        assert sweep[i].saves["logits"].shape[0] == 4 and sweep[i].saves["layers.1.resid"].shape[0] > 4


def test_a_shard_file_changed_after_the_sweep_is_named_when_read(full_then_room, tmp_path):
    """A tensors file cut short (a partial copy) failed in safetensors with "incomplete metadata,
    file not fully covered", naming neither the shard nor what to do."""
    folder = tmp_path / "copy"
    shutil.copytree(full_then_room / "after-second", folder)
    with open(folder / "shard-00001.safetensors", "r+b") as f:
        f.truncate(1000)
    (folder / "shard-00002.parquet").unlink()
    sweep = interlace.open_sweep(folder)
    assert sweep[0].saves["logits"].shape[0] == 4  # the other shards read as before
    with pytest.raises(OSError, match=r"shard 1's tensors file shard-00001.safetensors in .* is 1000 bytes, not the "
                                      r"\d+ its record says: .*Rerun the sweep's command"):
        sweep[SHARD_SIZE].saves
    with pytest.raises(OSError, match=r"shard 2's index file shard-00002.parquet in .* is missing: "):
        sweep.to_pandas()
