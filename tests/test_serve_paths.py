"""The Serve application's paths that need a fault or a clock: a server fault mid-stream, the 504
of ``limits.max_trace_s``, and a cancelled asynchronous trace.

Real parts only: a local Ray started here, the Serve application on 127.0.0.1, HTTP through
httpx, a CPU engine of the tiny Llama. The application is strict: one engine replica,
``max_trace_s`` of 4 s, ``cluster.max_retries`` 0 (the first engine death fails the trace instead
of re-running it).

References are the endpoint's own first answers to the same bodies, on its first replica before
anything happened (test_serve.py compares the endpoint with ``interlace.Model``).
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import signal
import socket
import time

import cloudpickle
import httpx
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load as load_tensors

CODE = "code-token-0123456789abcdef"
OPS = "ops-token-0123456789abcdef"
TOKENS = json.dumps({"tokens": [{"name": "coder", "token": CODE, "role": "code"},
                                {"name": "analyst", "token": OPS, "role": "ops"}]})
MAX_TRACE_S = 4.0
SAVE = [{"op": "save", "point": "layers.1.resid", "tokens": "last"}]
PLAIN = {"invokes": [{"prompt": "After the fault", "ops": SAVE}], "max_tokens": 6, "sampling": {"ignore_eos": True}}


def _slow_program() -> str:
    """A program sleeping 0.1 s at each step, as a request's base64 (nested: pickled by value)."""
    def slow_step(m):
        import time as t

        t.sleep(0.1)

    return base64.b64encode(cloudpickle.dumps(slow_step)).decode()


# Four invokes, each program sleeping 0.1 s at each of its 100 steps: a step takes 0.4 s, so the trace
# is at step 10 when max_trace_s (4 s) ends it, each program having used 1 s of its own 4 s budget
# (the workers' limit, far off). Left running, it would hold the engine until the programs' budgets
# ran out, 4 s each, 16 s after it began.
SLOW = {"invokes": [{"prompt": f"Slow {i}", "program": _slow_program()} for i in range(4)], "max_tokens": 100,
        "sampling": {"ignore_eos": True}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, token: str = OPS, timeout: float = 300) -> httpx.Response:
    return httpx.post(f"{url}/v1/traces", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)


def _stream(url: str, body: dict, token: str = OPS, on_event=None) -> tuple[int, list[tuple[str, dict]]]:
    """POST ``body`` streamed: the HTTP status and every server-sent event as (event, data);
    ``on_event(events so far)`` after each."""
    events: list[tuple[str, dict]] = []
    with httpx.stream("POST", f"{url}/v1/traces", json=body | {"stream": True}, timeout=300,
                      headers={"Authorization": f"Bearer {token}"}) as response:
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[6:])))
                if on_event is not None:
                    on_event(events)
    return response.status_code, events


def _scrape(url: str) -> dict[tuple, float]:
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def _shards_in_flight(url: str) -> dict[str, float]:
    """``interlace_replica_shards_in_flight`` by replica (its process id), as the replicas last pushed it (each second)."""
    return {dict(labels)["replica"]: value for (name, labels), value in _scrape(url).items()
            if name == "interlace_replica_shards_in_flight"}


def _wait_until(what: str, check, timeout_s: float, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f}s: {what}"
        time.sleep(every_s)
    return found


def _same_answer(got: dict, want: dict) -> None:
    assert [i["token_ids"] for i in got["invokes"]] == [i["token_ids"] for i in want["invokes"]]
    assert [i["text"] for i in got["invokes"]] == [i["text"] for i in want["invokes"]]
    got_t, want_t = load_tensors(base64.b64decode(got["tensors"])), load_tensors(base64.b64decode(want["tensors"]))
    assert got_t.keys() == want_t.keys() and want_t
    for name, value in want_t.items():
        assert torch.allclose(got_t[name], value, atol=1e-4), name


def _engine_handle():
    from ray import serve

    return serve.get_deployment_handle("InterlaceEngine", app_name="interlace")


@pytest.fixture(scope="module")
def local_ray():
    import ray

    assert not ray.is_initialized()
    os.environ["INTERLACE_API_TOKENS"] = TOKENS
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=400 << 20, log_to_driver=False)
    yield
    ray.shutdown()
    del os.environ["INTERLACE_API_TOKENS"]


def _start(config: dict) -> str:
    from interlace.cluster.config import ServeConfig
    from interlace.cluster.serve import app as serve_app

    return serve_app.start(ServeConfig.model_validate(config | {"port": _free_port(), "ingress_replicas": 1}))


@pytest.fixture(scope="class")
def strict(local_ray):
    from ray import serve

    url = _start({"cluster": {"model": "tiny-llama", "replicas": 1, "max_in_flight": 8, "max_retries": 0},
                  "limits": {"max_trace_s": MAX_TRACE_S}})
    yield url
    serve.shutdown()


@pytest.fixture(scope="class")
def plain_answer(strict):
    response = _post(strict, PLAIN)
    assert response.status_code == 200, response.text[:300]
    return response.json()


def _stopped_on_the_engine(url: str, end):
    """``end()`` (what waits for, or makes, the end of the slow trace) after the trace is seen
    running on the engine replica; then the trace stops there within 3 s (left running, it held the
    replica some 12 s more) and its token's slot is free. Returns what ``end`` returned."""
    replica = str(_engine_handle().info.remote().result()["pid"])
    _wait_until("the slow trace runs on the engine", lambda: _shards_in_flight(url).get(replica, 0) >= 1, MAX_TRACE_S)
    ended = end()
    _wait_until("the trace stops on the engine", lambda: _shards_in_flight(url)[replica] == 0, 3.0)
    assert _scrape(url)[("interlace_traces_in_flight", ())] == 0
    return ended


class TestStrictEndpoint:
    def test_a_trace_past_max_trace_s_gets_504_and_stops_on_the_engine(self, strict, plain_answer):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            future = pool.submit(lambda: (_post(strict, SLOW, CODE), time.monotonic()))
            response, answered_at = _stopped_on_the_engine(strict, future.result)
        elapsed = answered_at - started
        assert response.status_code == 504, response.text[:300]
        assert response.json() == {"error": {"type": "Timeout",
                                             "message": f"the trace ran past the limit of {MAX_TRACE_S}s"}}
        assert MAX_TRACE_S <= elapsed < MAX_TRACE_S + 2.0  # answered at the limit
        _same_answer(_post(strict, PLAIN).json(), plain_answer)  # and it goes on serving

    def test_a_stream_past_max_trace_s_ends_with_a_504_error_event(self, strict, plain_answer):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(_stream, strict, SLOW, CODE)
            status, events = _stopped_on_the_engine(strict, future.result)
        assert status == 200  # the stream had begun: the failure comes as its last event
        kinds = [kind for kind, _ in events]
        assert "tokens" in kinds and "invoke" not in kinds and "result" not in kinds
        assert kinds[-1] == "error" and kinds.count("error") == 1
        assert events[-1][1] == {"error": {"type": "Timeout", "message": f"the trace ran past the limit of {MAX_TRACE_S}s"},
                                 "status": 504}
        _same_answer(_post(strict, PLAIN).json(), plain_answer)

    def test_a_cancelled_asynchronous_trace_stops_on_the_engine(self, strict, plain_answer):
        auth = {"Authorization": f"Bearer {CODE}"}
        started = httpx.post(f"{strict}/v1/traces", json=SLOW | {"wait": False}, headers=auth)
        assert started.status_code == 202
        trace = f"{strict}/v1/traces/{started.json()['id']}"
        cancelled = _stopped_on_the_engine(strict, lambda: httpx.delete(trace, headers=auth))
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
        answer = httpx.get(trace, headers=auth)
        assert answer.status_code == 499 and answer.json()["error"]["type"] == "Cancelled"
        _same_answer(_post(strict, PLAIN).json(), plain_answer)

    def test_an_engine_replica_killed_mid_stream_ends_it_with_an_error_event_and_is_replaced(self, strict, plain_answer):
        """With ``max_retries: 0`` the first death of the engine replica running a stream fails
        it: the client's last event is ``error`` (503 WorkerDied), the dead replica's engine
        processes end with it, and Serve's replacement answers as the first replica did."""
        engine = _engine_handle()
        before = engine.info.remote().result()
        processes = [psutil.Process(pid) for pid in [before["pid"], *before["engine_pids"]]]
        body = {"invokes": [{"prompt": "Stream through a fault", "ops": SAVE}], "max_tokens": 480,
                "sampling": {"ignore_eos": True}}
        killed = []

        def kill_mid_stream(events):
            if not killed and sum(len(d["token_ids"]) for kind, d in events if kind == "tokens") >= 16:
                os.kill(before["pid"], signal.SIGKILL)  # the engine replica's process (Serve's replica actor)
                killed.append(len(events))

        status, events = _stream(strict, body, on_event=kill_mid_stream)
        assert killed, "the stream ended before 16 tokens"
        assert status == 200
        kinds = [kind for kind, _ in events]
        assert kinds[-1] == "error" and set(kinds[:-1]) == {"tokens"}  # no invoke, no result: it failed
        error = events[-1][1]
        assert error["status"] == 503 and error["error"]["type"] == "WorkerDied", error
        assert "lost its engine replica" in error["error"]["message"]
        streamed = [t for kind, d in events if kind == "tokens" for t in d["token_ids"]]

        _, alive = psutil.wait_procs(processes, timeout=30)
        assert not alive, f"processes of the killed engine replica left running: {alive}"

        def replaced():  # the deployment's ready call (what /readyz makes) starts the new replica's engine
            try:
                return engine.ready.remote().result(timeout_s=120)["pid"] != before["pid"]
            except Exception:  # noqa: BLE001 - Serve has not replaced the dead replica yet
                return False

        _wait_until("Serve replaces the killed engine replica", replaced, 240, every_s=1.0)
        _same_answer(_post(strict, PLAIN).json(), plain_answer)
        again = _post(strict, body)
        assert again.status_code == 200
        assert streamed == again.json()["invokes"][0]["token_ids"][:len(streamed)]  # what was sent was right
        status, events = _stream(strict, body)  # and streams again, in full
        assert status == 200 and events[-1][0] == "result"
        assert [t for kind, d in events if kind == "tokens" for t in d["token_ids"]] == again.json()["invokes"][0]["token_ids"]
        invoke = next(d for kind, d in events if kind == "invoke")
        assert torch.allclose(load_tensors(base64.b64decode(invoke["tensors"]))["layers.1.resid"],
                              load_tensors(base64.b64decode(again.json()["tensors"]))["invokes.0.layers.1.resid"], atol=1e-4)
