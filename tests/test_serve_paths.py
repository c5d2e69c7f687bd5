"""The Serve application's paths that need a fault, a clock or load: a server fault mid-stream,
the 504 of ``limits.max_trace_s``, a cancelled asynchronous trace, a client that hangs up, and Serve
autoscaling the engine replicas up and back down.

Real parts only: a local Ray started here, the Serve application on 127.0.0.1, HTTP through
httpx, CPU engines of the tiny Llama. Two applications, one after the other on the same Ray (at
most two engines at once):

- a strict one (one engine replica, ``max_trace_s`` of 4 s, ``cluster.max_retries`` 0, so the first
  engine death fails the trace instead of re-running it);
- an autoscaling one (1 to 2 engine replicas, Serve's delays shortened).

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
import threading
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


def _engine_replica_states() -> dict[str, int]:
    """The engine deployment's replicas by state, as Serve reports them (``{"RUNNING": 2}``...)."""
    from ray import serve

    app = serve.status().applications.get("interlace")
    deployment = app.deployments.get("InterlaceEngine") if app is not None else None
    return dict(deployment.replica_states) if deployment is not None else {}


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
    replica some 12 s more): the replica runs no shard of it, its engine has none of its requests
    left (a shard whose call was cancelled but whose requests ran on was seen by the first alone),
    and its token's slot is free. Returns what ``end`` returned."""
    engine = _engine_handle()
    replica = str(engine.info.remote().result()["pid"])
    _wait_until("the slow trace runs on the engine", lambda: _shards_in_flight(url).get(replica, 0) >= 1, MAX_TRACE_S)
    ended = end()
    _wait_until("the trace stops on the engine", lambda: _shards_in_flight(url)[replica] == 0
                and engine.info.remote().result()["engine_requests"] == 0, 3.0)
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

    @pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streamed"])
    def test_a_client_that_hangs_up_stops_its_trace_on_the_engine(self, strict, plain_answer, stream):
        """A client that closes its connection mid-trace (a killed script, a dropped network) gets
        its trace stopped on the engine, well before ``max_trace_s`` would stop it (it stopped
        about 1 s after the close here), and the endpoint serves on."""
        host, port = strict.split("//")[1].split(":")
        body = json.dumps(SLOW | {"stream": stream}).encode()
        started = time.monotonic()
        client = socket.create_connection((host, int(port)))  # raw, so that closing it hangs up at once
        client.sendall(f"POST /v1/traces HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {CODE}\r\n"
                       f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)

        def hang_up():
            if stream:  # the stream has begun
                client.settimeout(30)
                assert client.recv(64).startswith(b"HTTP/1.1 200")
            client.close()

        _stopped_on_the_engine(strict, hang_up)
        assert time.monotonic() - started < MAX_TRACE_S  # its hang-up stopped it, not the limit
        _same_answer(_post(strict, PLAIN).json(), plain_answer)

    def test_an_engine_replica_killed_mid_stream_ends_it_with_an_error_event_and_is_replaced(self, strict, plain_answer):
        """With ``max_retries: 0`` the first death of the engine replica running a stream fails
        it: the client's last event is ``error`` (503 WorkerDied), the dead replica's engine
        processes end with it, and Serve's replacement answers as the first replica did."""
        engine = _engine_handle()
        before = engine.info.remote().result()
        processes = [psutil.Process(pid) for pid in [before["pid"], *before["engine_pids"]]]
        # long enough to be killed mid-stream (the kill lands after 16 tokens)
        body = {"invokes": [{"prompt": "Stream through a fault", "ops": SAVE}], "max_tokens": 240,
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
        # The replacement gets only as many tokens as were streamed: 240 more on its fresh engine took
        # past the strict endpoint's 4 s in CI on 2026-11-29 (a 2-core machine)
        again = body | {"max_tokens": len(streamed)}
        answer = _post(strict, again)
        assert answer.status_code == 200, answer.text[:300]
        assert streamed == answer.json()["invokes"][0]["token_ids"]  # what was sent was right
        status, events = _stream(strict, again)  # and streams again, in full
        assert status == 200 and events[-1][0] == "result", events[-1]
        assert [t for kind, d in events if kind == "tokens" for t in d["token_ids"]] == streamed
        invoke = next(d for kind, d in events if kind == "invoke")
        assert torch.allclose(load_tensors(base64.b64decode(invoke["tensors"]))["layers.1.resid"],
                              load_tensors(base64.b64decode(answer.json()["tensors"]))["invokes.0.layers.1.resid"], atol=1e-4)


# --- autoscaling ----------------------------------------------------------------------------------

AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 5, "look_back_period_s": 2}
HEAVY_CLIENTS = 8
PROMPTS = [f"Load {k}: the quick brown fox" for k in range(6)]


def _load_body(k: int) -> dict:
    return {"invokes": [{"prompt": PROMPTS[k], "ops": SAVE}], "max_tokens": 24, "sampling": {"ignore_eos": True}}


@pytest.fixture(scope="class")
def scaling(local_ray):
    from ray import serve

    url = _start({"cluster": {"model": "tiny-llama", "max_in_flight": 4}, "autoscaling": AUTOSCALING})
    yield url
    serve.shutdown()


def test_the_autoscaling_knobs_reach_serve():
    from ray.serve.config import AutoscalingConfig as ServeAutoscaling

    from interlace.cluster.config import ServeConfig
    from interlace.cluster.serve.app import _engine_options

    cfg = ServeConfig.model_validate({"cluster": {"model": "tiny-llama"}, "autoscaling": AUTOSCALING})
    options = _engine_options(cfg)
    assert "num_replicas" not in options
    serve_config = ServeAutoscaling(**options["autoscaling_config"])  # names and values Serve takes
    assert {name: getattr(serve_config, name) for name in AUTOSCALING} == AUTOSCALING


class TestAutoscaling:
    def test_serve_scales_the_engines_up_under_load_and_down_when_idle_each_request_answered_once(self, scaling):
        url = scaling
        assert _engine_replica_states() == {"RUNNING": 1}
        want = {}
        for k in range(len(PROMPTS)):
            response = _post(url, _load_body(k))
            assert response.status_code == 200, response.text[:300]
            want[k] = response.json()
        before = _scrape(url)

        sent = [0]
        answers: list[tuple[int, int, dict | str]] = []  # (prompt, status, answer), one per request sent
        lock = threading.Lock()

        def send(k: int) -> None:
            with lock:
                sent[0] += 1
            response = _post(url, _load_body(k))
            with lock:
                answers.append((k, response.status_code, response.json() if response.status_code == 200 else response.text))

        def client(i: int, until: threading.Event) -> None:
            n = 0
            while not until.is_set():
                send((i + n) % len(PROMPTS))
                n += 1

        # Up: 8 clients keep 8 traces in flight against a target of 2 per replica, until Serve runs
        # 2 engine replicas and both have run shards (the new one starts its engine on its first).
        heavy_done = threading.Event()
        heavy = [threading.Thread(target=client, args=(i, heavy_done)) for i in range(HEAVY_CLIENTS)]
        for t in heavy:
            t.start()
        busy: dict[str, float] = {}  # replica (process id) -> most shards in flight seen
        started = time.monotonic()
        try:
            def both_serving():
                for replica, value in _shards_in_flight(url).items():
                    busy[replica] = max(busy.get(replica, 0), value)
                return _engine_replica_states() == {"RUNNING": 2} and sum(v > 0 for v in busy.values()) == 2

            _wait_until("Serve runs 2 engine replicas and both run shards", both_serving, 180, every_s=0.5)
        finally:
            heavy_done.set()
            for t in heavy:
                t.join(300)
        scaled_up_s = time.monotonic() - started
        replicas = [int(r) for r in busy]
        processes = {pid: [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)] for pid in replicas}

        # Down: one client, one trace at a time (half the target of one replica), until Serve is back
        # at one engine replica; requests keep coming while it stops the other.
        light_done = threading.Event()
        light = threading.Thread(target=client, args=(0, light_done))
        light.start()
        try:
            _wait_until("Serve is back at 1 engine replica", lambda: _engine_replica_states() == {"RUNNING": 1},
                        120, every_s=0.5)
            scaled_down_s = time.monotonic() - started - scaled_up_s
            n = len(answers)
            _wait_until("3 more answers on one replica", lambda: len(answers) >= n + 3, 60)
        finally:
            light_done.set()
            light.join(300)

        # Every request sent was answered once, with the answer its body has on a lone replica.
        assert len(answers) == sent[0] and sent[0] > 2 * HEAVY_CLIENTS
        for k, status, answer in answers:
            assert status == 200, answer[:300]
            _same_answer(answer, want[k])
        after = _scrape(url)
        for name, labels in [("interlace_requests_total", (("route", "/v1/traces"), ("status", "200"))),
                             ("interlace_completion_seconds_count", ())]:
            assert after[(name, labels)] - before.get((name, labels), 0) == sent[0], name
        # One replica was stopped, and every process of its engine ended with it.
        stopped = _wait_until("a stopped replica's process ends",
                              lambda: [pid for pid in replicas if not psutil.pid_exists(pid)], 30)
        assert len(stopped) == 1, (replicas, stopped)
        _, alive = psutil.wait_procs(processes[stopped[0]], timeout=30)
        assert not alive, f"processes of the stopped engine replica left running: {alive}"
        print(f"\n{sent[0]} requests; 2 replicas serving after {scaled_up_s:.0f}s of load, back to 1 "
              f"{scaled_down_s:.0f}s after the load eased")
