"""Addresses interlace cannot use, each said at once with what to do: a Ray address where no
cluster answers (a typo in ``--address``, a head node that is down), for ``interlace sweep``,
``interlace serve`` and ``interlace.Cluster``; what is no Ray address at all; and a port the
endpoint cannot listen on.

Each in a process of its own, which has no Ray yet (the check is made where interlace joins Ray).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def a_port_nobody_listens_on() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connecting to it is refused


def test_an_address_where_no_ray_answers_is_refused_at_once(tmp_path):
    address = f"127.0.0.1:{a_port_nobody_listens_on()}"
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "a"}) + "\n")
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"cluster": "tiny-llama-2", "input": {"paths": ["prompts.jsonl"]},
                                     "intervention": {"ops": [{"op": "save", "point": "logits"}]}, "output": "out"}))
    tokens = json.dumps({"tokens": [{"name": "a", "token": "t" * 24, "role": "ops"}]})
    commands = {
        "sweep": [sys.executable, "-m", "interlace", "sweep", str(sweep), "--address", address],
        "serve": [sys.executable, "-m", "interlace", "serve", str(ROOT / "configs/serve/tiny-llama.yaml"), "--address", address],
        "Cluster": [sys.executable, "-c", f"import interlace; interlace.Cluster('tiny-llama-2', address={address!r})"],
    }
    for name, command in commands.items():
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                              env={**os.environ, "INTERLACE_API_TOKENS": tokens})
        took = time.monotonic() - started
        said = f"no Ray cluster answers at {address} ("
        assert said in done.stderr and "ray start --head" in done.stderr, (name, done.stderr[-2000:])
        assert took < 60, (name, took)  # Ray's own retries took minutes
        if name != "Cluster":  # the commands: one line and status 2, no traceback
            assert done.returncode == 2 and "Traceback" not in done.stderr, (name, done.returncode, done.stderr[-2000:])
        else:
            assert "ConnectionError" in done.stderr


def test_a_port_another_process_holds_is_refused_with_one_line(tmp_path):
    """Serve's proxy failed to bind and `interlace serve` ended with Ray's traceback (status 1)."""
    config = yaml.safe_load((ROOT / "configs/serve/tiny-llama.yaml").read_text())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        config.update(host="127.0.0.1", port=holder.getsockname()[1])
        (tmp_path / "serve.yaml").write_text(yaml.safe_dump(config))
        tokens = json.dumps({"tokens": [{"name": "a", "token": "t" * 24, "role": "ops"}]})
        done = subprocess.run([sys.executable, "-m", "interlace", "serve", str(tmp_path / "serve.yaml")], capture_output=True,
                              text=True, timeout=180, cwd=tmp_path, env={**os.environ, "INTERLACE_API_TOKENS": tokens})
    assert done.returncode == 2 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-3000:])
    assert f"interlace serve: Serve's HTTP proxy cannot listen on 127.0.0.1:{config['port']}: another process holds" \
        in done.stderr, done.stderr[-3000:]


def test_what_is_no_ray_address_is_refused_saying_what_one_is():
    """`interlace.connect("not a url")` failed in ray.init with "Invalid address format: not a url",
    and an endpoint's URL given to a Cluster (or in RAY_ADDRESS, which `ray job submit` users set to
    the dashboard's) with "Module: http does not exist"."""
    import pytest
    import ray

    import interlace
    from interlace.cluster.ray_init import check_reachable

    with pytest.raises(ValueError, match=r"'not a url' is not a Ray address: give 'auto' .*'host:port' .*'ray://host:port'"):
        interlace.connect("not a url")
    with pytest.raises(ValueError, match=r"http://127.0.0.1:8265 is a web address, not a Ray cluster's: .*interlace.connect"):
        interlace.Cluster("tiny-llama-2", address="http://127.0.0.1:8265")
    assert not ray.is_initialized()
    for fine in ("local", "auto", "ray://head", "[::1]:1"):  # Ray's to resolve, or refused as unreachable
        with contextlib.suppress(ConnectionError):
            check_reachable(fine)
