"""The Serve application over real HTTP on 127.0.0.1: one CPU engine replica of the tiny Llama.

One local Ray and one Serve application (started here, shut down at the end) with two API
tokens, one per role, and tight limits so each can be reached cheaply. References: the session's
``llama`` Model, and a one-replica ``interlace.Cluster`` on the same Ray. Every request answers
with its own status; hostile payloads get a 4xx and correct requests sent in between keep getting
correct answers.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import pickle
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

import interlace
from interlace import ops
from interlace.remote import RequestRefused

CODE = "code-token-0123456789abcdef"
OPS = "ops-token-0123456789abcdef"
ONE_AT_A_TIME = "single-token-0123456789abc"
TOKENS = json.dumps({"tokens": [
    {"name": "coder", "token": CODE, "role": "code"},
    {"name": "analyst", "token": OPS, "role": "ops"},
    {"name": "single", "token": ONE_AT_A_TIME, "role": "code", "max_in_flight": 1},
]})
LIMITS = dict(max_body_bytes=1 << 20, max_invokes=80, max_tokens=20_000, max_trace_s=120.0,
              max_save_bytes=4 << 20, max_in_flight_per_token=64)
STEER = torch.linspace(-0.5, 0.5, 128)


def keep(m):
    m.save("r1", m.layers[1].resid)
    print(f"step {m.step}: r1 saved")  # comes back with the result (workers/printed.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def endpoint():
    import ray
    from ray import serve

    from interlace.cluster.serve import app as serve_app
    from interlace.cluster.config import ServeConfig

    assert not ray.is_initialized()
    os.environ["INTERLACE_API_TOKENS"] = TOKENS
    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=400 << 20, log_to_driver=False)
    cfg = ServeConfig.model_validate({"cluster": {"model": "tiny-llama", "replicas": 1, "max_in_flight": 8},
                                      "port": _free_port(), "limits": LIMITS})
    url = serve_app.start(cfg)
    yield url
    serve.shutdown()
    ray.shutdown()
    del os.environ["INTERLACE_API_TOKENS"]


@pytest.fixture(scope="module")
def coder(endpoint):
    with interlace.connect(endpoint, token=CODE) as remote:
        yield remote


@pytest.fixture(scope="module")
def analyst(endpoint):
    with interlace.connect(endpoint, token=OPS) as remote:
        yield remote


def script(target):
    """One user script: a program, ops and a plain invoke in one trace."""
    with target.trace(max_tokens=5) as tr:
        tr.invoke("The capital of France is", program=keep)
        tr.invoke("Once upon a time", ops=[ops.add("layers.1.resid", STEER), ops.save("layers.2.resid", tokens="last")])
        tr.invoke([5, 6, 7, 8])
    return tr.result


def assert_same(got, want, atol=1e-4):
    assert len(got) == len(want)
    for g, w in zip(got.invokes, want.invokes):
        assert g.token_ids == w.token_ids
        assert g.text == w.text
        assert g.printed == w.printed
        assert sorted(g.saves) == sorted(w.saves)
        for name in w.saves:
            assert torch.allclose(g.saves[name].float(), w.saves[name].float(), atol=atol), name


def test_an_endpoint_that_is_not_there_is_named_in_the_error():
    """httpx said only "[Errno 111] Connection refused", from deep in httpcore."""
    from interlace.remote import EndpointUnreachable

    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    with interlace.connect(url, token=CODE) as remote:
        with pytest.raises(EndpointUnreachable, match=rf"cannot reach the interlace endpoint at {url} \(.*refused"):
            remote.generate("Hello")
        with pytest.raises(ConnectionError):  # what to catch without importing interlace's class
            remote.tree


def test_tokens_from_the_environment_reach_the_ingress_as_digests_only(monkeypatch):
    """A runtime environment is readable by whoever can read the Ray cluster's state: the tokens
    document put there holds each token's SHA-256, and the ingress accepts the tokens with it."""
    from interlace.cluster.serve.auth import Tokens
    from interlace.cluster.config import AuthConfig, ServeConfig
    from interlace.cluster.serve.app import _auth_env

    monkeypatch.setenv("INTERLACE_API_TOKENS", TOKENS)
    cfg = ServeConfig.model_validate({"cluster": {"model": "tiny-llama"}})
    shipped = _auth_env(cfg)["INTERLACE_API_TOKENS"]
    assert all(token not in shipped for token in (CODE, OPS, ONE_AT_A_TIME))
    monkeypatch.setenv("INTERLACE_API_TOKENS", shipped)  # what the ingress reads
    tokens = Tokens.load(AuthConfig())
    assert tokens.caller(f"Bearer {CODE}").role == "code"
    assert tokens.caller(f"Bearer {ONE_AT_A_TIME}").max_in_flight == 1
    assert tokens.caller(f"Bearer {OPS}").role == "ops" and tokens.caller("Bearer " + "x" * 26) is None


def test_one_script_gives_the_same_results_on_a_model_a_cluster_and_the_endpoint(endpoint, coder, llama):
    from interlace.cluster.config import ClusterConfig

    want = script(llama)
    assert want[0].printed == "".join(f"step {k}: r1 saved\n" for k in range(len(want[0].token_ids)))
    assert_same(script(coder), want)
    cluster = interlace.Cluster(ClusterConfig(model="tiny-llama", replicas=1, cpu_cores=[[1]]))  # joins this Ray
    try:
        assert_same(script(cluster), want)
    finally:
        cluster.close()


def test_saves_and_shares_of_every_dtype_come_back_through_the_endpoint(coder):
    """A program's uint16, float8 and complex32 tensors crossed Ray from the engine replica to the
    ingress with torch's own pickling, which cannot read them back (HTTP 500, "UntypedStorage has
    no attribute 'dtype'"); complex128 and float8_e8m0fnu ones, which a .safetensors answer
    cannot hold, failed the answer (HTTP 500, KeyError). Each comes back bit for bit."""
    dtypes = [torch.uint16, torch.float8_e4m3fn, torch.complex32, torch.complex128, torch.float8_e8m0fnu]

    def convert(x, dtype):
        return x.to(dtype) if dtype.is_floating_point or dtype.is_complex else (x * 1000).to(torch.int64).to(dtype)

    def program(m):
        h = m.layers[0].resid.float()
        m.save("f32", h)
        for dtype in dtypes:
            m.save(str(dtype), convert(h, dtype))
        m.share("u16", convert(h[-1:], torch.uint16), merge="append")

    with coder.trace(max_tokens=2) as tr:
        tr.invoke("The capital of France is", program=program)
    saves = tr.result[0].saves
    for dtype in dtypes:
        want = convert(saves["f32"], dtype)
        assert saves[str(dtype)].dtype == dtype and torch.equal(saves[str(dtype)].view(torch.uint8), want.view(torch.uint8))
    shared = tr.result.shared["u16"]
    assert len(shared) == 2 and all(v.dtype == torch.uint16 for v in shared)
    assert torch.equal(shared[-1], convert(saves["f32"][-1:], torch.uint16))


def test_two_users_sending_the_same_stateful_program_at_once_each_get_their_own_state(endpoint, coder):
    """Equal program bytes from two traces in flight at once (a lab's shared script) were loaded
    once on the engine, so each trace's counter also counted the other's steps."""
    state = {"steps": 0}

    def counts(m):
        state["steps"] += 1
        m.save("counted", state["steps"])

    traces = []
    for prompt in ("One user's prompt", "Another user's prompt"):
        tr = coder.trace(max_tokens=24, ignore_eos=True)
        tr.invoke(prompt, program=counts)
        traces.append(tr)
    futures = [coder.submit(tr) for tr in traces]  # both generate together
    for future in futures:
        assert future.result(timeout=120).invokes[0].saves["counted"] == list(range(1, 25))


def test_tokens_and_roles(endpoint, analyst, llama):
    with analyst.trace(max_tokens=3) as tr:  # ops work with a declarative-only token
        tr.invoke("Hello", ops=[ops.save("layers.0.resid")])
    with llama.trace(max_tokens=3) as want:
        want.invoke("Hello", ops=[ops.save("layers.0.resid")])
    assert_same(tr.result, want.result)

    with pytest.raises(RequestRefused) as refused:
        analyst.generate("Hello", program=keep, max_tokens=2)
    assert refused.value.status == 403
    body = {"invokes": [{"prompt": "Hi"}]}
    for headers in ({}, {"Authorization": "Bearer nope-nope-nope-nope"}, {"Authorization": CODE},
                    {"Authorization": f"Basic {CODE}"}, {"Authorization": "Bearer"}):
        response = httpx.post(f"{endpoint}/v1/traces", json=body, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["type"] == "Unauthorized"
    assert httpx.get(f"{endpoint}/v1/model").status_code == 401
    assert httpx.get(f"{endpoint}/healthz").status_code == 200
    assert httpx.get(f"{endpoint}/readyz").status_code == 200


def _post(endpoint, body, token=OPS, **kwargs):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{endpoint}/v1/traces", content=content, timeout=120,
                      headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"}, **kwargs)


def test_each_limit_has_its_own_answer(endpoint):
    plain = {"prompt": "Hello"}
    cases = {
        413: [b"{" + b" " * (1 << 20) + b"}"],
        422: [{"invokes": [plain] * 81},  # max_invokes
              {"invokes": [{"prompt": list(range(10, 400))}] * 60, "max_tokens": 2},  # max_tokens (prompts)
              {"invokes": [plain], "max_tokens": 30_000},  # max_tokens (generation)
              {"invokes": [plain], "timeout_s": 121},
              {"invokes": [plain], "max_save_bytes": 5 << 20}],
    }
    for status, bodies in cases.items():
        for body in bodies:
            response = _post(endpoint, body)
            assert response.status_code == status, (status, str(body)[:80], response.text[:300])
            assert "limit" in response.json()["error"]["message"]
    # Saves past the trace's byte limit (4 MiB): 40 invokes x 300 rows x 128 x 4 B = 6 MiB.
    big = {"invokes": [{"prompt": list(range(10, 310)), "ops": [{"op": "save", "point": "layers.0.resid"}]}] * 40}
    response = _post(endpoint, big)
    assert response.status_code == 413, response.text[:300]
    assert response.json()["error"]["type"] == "SavesTooLarge"


def test_a_token_past_its_traces_in_flight_gets_429(endpoint):
    def slow(m):
        import time as t

        if m.step == 0:
            t.sleep(3)

    with interlace.connect(endpoint, token=ONE_AT_A_TIME) as single:
        tr = single.trace(max_tokens=2)
        tr.invoke("Hello", program=slow)
        first = single.submit(tr)
        deadline = time.monotonic() + 60
        while _scrape(endpoint).get(("interlace_traces_in_flight", ()), 0) < 1:  # the first one holds the slot
            assert time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(RequestRefused) as refused:
            single.generate("Hi", max_tokens=1)
        assert refused.value.status == 429
        assert len(first.result(timeout=120)[0].token_ids) == 2
        assert single.generate("Hi", max_tokens=1).token_ids  # its slot is free again


def test_64_concurrent_clients_each_get_their_solo_result(endpoint, analyst, llama):
    vectors = [torch.randn(128, generator=torch.Generator().manual_seed(i)) * 0.5 for i in range(64)]

    def trace(target, i):
        tr = target.trace(max_tokens=4)
        tr.invoke(f"Client {i} asks", ops=[ops.add("layers.1.resid", vectors[i]),
                                           ops.save("layers.2.resid", tokens="last")])
        return tr

    clients = [interlace.connect(endpoint, token=OPS) for _ in range(64)]
    try:
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            got = list(pool.map(lambda i: clients[i]._run(trace(clients[i], i)), range(64)))
    finally:
        for c in clients:
            c.close()
    for i, result in enumerate(got):
        solo = trace(llama, i).run()
        assert_same(result, solo)


def test_streaming_delivers_tokens_before_the_trace_completes(coder, llama):
    tr = coder.trace(max_tokens=24, ignore_eos=True)
    tr.invoke("Stream this one", ops=[ops.save("logits")])
    tr.invoke("And this one", program=keep)
    events, times = [], []
    for event in coder.stream(tr):
        events.append(event)
        times.append(time.monotonic())
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "result"
    first_tokens = kinds.index("tokens")
    assert first_tokens < kinds.index("invoke") < len(kinds) - 1
    # Tokens come as they are generated (vLLM merges a step's delta into the next when the reader
    # lags, so the count varies with load), not all at the end.
    assert kinds.count("tokens") >= 4
    assert times[-1] > times[first_tokens]
    with llama.trace(max_tokens=24, ignore_eos=True) as want:
        want.invoke("Stream this one", ops=[ops.save("logits")])
        want.invoke("And this one", program=keep)
    assert_same(events[-1]["result"], want.result)
    streamed = {e["invoke"]: e for e in events if e["event"] == "invoke"}
    for i in (0, 1):
        assert streamed[i]["token_ids"] == want.result[i].token_ids
        assert streamed[i]["printed"] == want.result[i].printed  # "" for the ops invoke
        for name, value in want.result[i].saves.items():
            assert torch.allclose(streamed[i]["saves"][name], value, atol=1e-4)
    tokens = [t for e in events if e["event"] == "tokens" and e["invoke"] == 0 for t in e["token_ids"]]
    assert tokens == want.result[0].token_ids


def test_a_streams_result_does_not_repeat_the_tensors_its_invoke_events_carried(endpoint):
    body = {"invokes": [{"prompt": "Once", "ops": [{"op": "save", "point": "layers.1.resid", "tokens": "last"}]}],
            "max_tokens": 2, "stream": True}
    text = _post(endpoint, body).text
    data = {line[7:]: json.loads(following[6:]) for line, following in zip(text.splitlines(), text.splitlines()[1:])
            if line.startswith("event: ")}
    assert data["invoke"]["saves"] == ["layers.1.resid"] and data["invoke"]["tensors"]
    assert data["result"]["tensors_in_events"] is True and data["result"]["tensors"] == ""


def test_asynchronous_traces_binary_results_and_cancel(endpoint, llama):
    auth = {"Authorization": f"Bearer {OPS}"}
    body = {"invokes": [{"prompt": "Hello", "ops": [{"op": "save", "point": "layers.1.resid", "tokens": "last"}]}],
            "max_tokens": 3, "wait": False}
    started = httpx.post(f"{endpoint}/v1/traces", json=body, headers=auth)
    assert started.status_code == 202
    trace_id = started.json()["id"]
    assert httpx.get(f"{endpoint}/v1/traces/{trace_id}", headers={"Authorization": f"Bearer {CODE}"}).status_code == 404
    for _ in range(200):
        answer = httpx.get(f"{endpoint}/v1/traces/{trace_id}", headers=auth)
        if answer.status_code != 202:
            break
        time.sleep(0.1)
    assert answer.status_code == 200
    with llama.trace(max_tokens=3) as want:
        want.invoke("Hello", ops=[ops.save("layers.1.resid", tokens="last")])
    assert answer.json()["invokes"][0]["token_ids"] == want.result[0].token_ids

    from safetensors import safe_open

    binary = httpx.post(f"{endpoint}/v1/traces", json=body | {"wait": True},
                        headers=auth | {"Accept": "application/octet-stream"})
    assert binary.status_code == 200
    path = f"/tmp/interlace-test-{os.getpid()}.safetensors"
    with open(path, "wb") as f:
        f.write(binary.content)
    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["interlace"])
        saved = f.get_tensor("invokes.0.layers.1.resid")
    os.unlink(path)
    assert meta["invokes"][0]["token_ids"] == want.result[0].token_ids
    assert torch.allclose(saved, want.result[0].saves["layers.1.resid"], atol=1e-4)

    slow = {"invokes": [{"prompt": "Hello"}], "max_tokens": 500, "sampling": {"ignore_eos": True}, "wait": False}
    started = httpx.post(f"{endpoint}/v1/traces", json=slow, headers=auth)
    trace_id = started.json()["id"]
    assert httpx.delete(f"{endpoint}/v1/traces/{trace_id}", headers=auth).status_code == 200
    for _ in range(100):
        answer = httpx.get(f"{endpoint}/v1/traces/{trace_id}", headers=auth)
        if answer.status_code != 202:
            break
        time.sleep(0.1)
    assert answer.status_code == 499 and answer.json()["error"]["type"] == "Cancelled"


def _scrape(endpoint) -> dict[tuple, float]:
    text = httpx.get(f"{endpoint}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_move_by_exactly_the_traffic(endpoint, analyst, coder):
    def failing(m):
        raise ValueError("on purpose")

    before = _scrape(endpoint)
    results = [analyst.generate(f"Count {i}", ops=[ops.save("layers.1.resid", tokens="last")], max_tokens=3,
                                ignore_eos=True) for i in range(3)]
    with pytest.raises(interlace.InterventionError):
        coder.generate("Fail", program=failing, max_tokens=2)
    with pytest.raises(RequestRefused):
        analyst.generate("Code", program=keep, max_tokens=2)
    after = _scrape(endpoint)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("interlace_requests_total", route="/v1/traces", status="200") == 3
    assert delta("interlace_requests_total", route="/v1/traces", status="422") == 1
    assert delta("interlace_requests_total", route="/v1/traces", status="403") == 1
    assert delta("interlace_generated_tokens_total") == 9
    assert delta("interlace_interventions_total", outcome="ok") == 3
    assert delta("interlace_interventions_total", outcome="failed") == 1
    assert delta("interlace_saved_bytes_total") == sum(r.saves["layers.1.resid"].numel() * 4 for r in results)
    assert delta("interlace_completion_seconds_count") == 4
    kv = [value for (name, _), value in after.items() if name == "interlace_kv_cache_usage"]
    assert len(kv) == 1 and 0 <= kv[0] <= 1  # one engine replica reports its KV-cache use


def test_a_killed_state_actor_is_started_again_and_the_endpoint_keeps_serving(endpoint, analyst, llama):
    import ray
    from ray import serve

    host = serve.get_deployment_handle("InterlaceState", app_name="interlace")
    _scrape(endpoint)  # the ingress holds the state actor's handle
    pid = ray.get(host.actor.remote().result().ping.remote())
    os.kill(pid, signal.SIGKILL)  # the state actor (quotas, results, metrics), by pid
    psutil.wait_procs([psutil.Process(pid)], timeout=30)
    # Its callers (the ingress, the engine replicas) find it dead at once: one new actor for all,
    # none killed by another's restart.
    asking = [host.actor.remote(), host.actor.remote()]
    first, second = (asked.result() for asked in asking)
    assert ray.get(first.ping.remote()) == ray.get(second.ping.remote()) != pid
    assert_same(script_ops(analyst), script_ops(llama))  # the ingress reached a new state actor
    assert ray.get(host.actor.remote().result().ping.remote()) != pid
    after = _scrape(endpoint)  # counted afresh, as by any restarted Prometheus target
    assert after[("interlace_requests_total", (("route", "/v1/traces"), ("status", "200")))] == 1
    assert after[("interlace_interventions_total", (("outcome", "ok"),))] == 1


def test_the_client_refuses_to_submit_what_is_not_a_trace(analyst):
    tr = analyst.trace(max_tokens=2)
    tr.invoke("Hello")
    with pytest.raises(TypeError, match=r"submit\(\) takes a trace .* got Invoke"):  # (an AttributeError)
        analyst.submit(tr.invokes[0])


def test_a_killed_engine_is_replaced_its_trace_delivered_once_and_its_stream_sends_each_token_once(
        endpoint, analyst, llama):
    """One kill of the engine core, by pid, with a trace and a stream in flight on it (one restart
    for both: each costs half a minute here)."""
    from ray import serve

    engine = serve.get_deployment_handle("InterlaceEngine", app_name="interlace")
    before = engine.info.remote().result()
    save = [ops.save("layers.1.resid", tokens="last", steps=[0])]
    tr = analyst.trace(max_tokens=480, ignore_eos=True)  # a few seconds of generation on this machine
    tr.invoke("Survive this", ops=save)
    running = analyst.submit(tr)
    streamed_tr = analyst.trace(max_tokens=480, ignore_eos=True)
    streamed_tr.invoke("Stream through a kill", ops=save)
    events: list[dict] = []
    failed: list[BaseException] = []
    some_tokens = threading.Event()

    def consume() -> None:
        try:
            for event in analyst.stream(streamed_tr):
                events.append(event)
                if sum(len(e.get("token_ids", ())) for e in events if e["event"] == "tokens") >= 16:
                    some_tokens.set()
        except BaseException as exc:  # noqa: BLE001 - raised below, on the test's thread
            failed.append(exc)
            some_tokens.set()

    reader = threading.Thread(target=consume)
    reader.start()
    assert some_tokens.wait(120) and not failed
    assert not running.done()  # both are generating
    assert not any(e["event"] in ("invoke", "result") for e in events)
    core = [p for p in map(psutil.Process, before["engine_pids"]) if "EngineCore" in p.name() + " ".join(p.cmdline())]
    os.kill(core[0].pid, signal.SIGKILL)  # the engine core, by pid
    got = running.result(timeout=300)
    reader.join(300)
    assert not reader.is_alive() and not failed, failed

    want = {}
    for prompt in ("Survive this", "Stream through a kill"):
        with llama.trace(max_tokens=480, ignore_eos=True) as want[prompt]:
            want[prompt].invoke(prompt, ops=save)
    assert_same(got, want["Survive this"].result)  # the trace: delivered once, as if never killed
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "result" and kinds.count("invoke") == 1 and "restart" not in kinds  # greedy: the same again
    expected = want["Stream through a kill"].result
    streamed = [t for e in events if e["event"] == "tokens" for t in e["token_ids"]]
    assert streamed == expected[0].token_ids  # every token once, in order: none sent twice after the re-run
    assert "".join(e["text"] for e in events if e["event"] == "tokens") == expected[0].text
    assert_same(events[-1]["result"], expected)
    assert_same(script_ops(analyst), script_ops(llama))  # and it keeps serving
    assert engine.info.remote().result()["pid"] != before["pid"]  # on a new replica


def test_a_rerun_stream_sends_only_what_the_client_lacks_or_says_restart():
    """The ingress's record of what a streaming client has, across a shard's attempts (the
    integration above covers the identical re-run; this covers a re-run that generates other tokens)."""
    import asyncio

    from interlace.cluster.serve.ingress import _StreamSent

    sent, out = _StreamSent(), []

    async def client(kind, data):
        out.append((kind, data["token_ids"] if "token_ids" in data else None))

    async def attempt(deltas, final=None):
        sent.new_attempt([0])
        send = sent.filter(client)
        for ids in deltas:
            await send("tokens", {"invoke": 0, "token_ids": ids, "text": "".join(f"<{t}>" for t in ids)})
        if final is not None:
            await send("invoke", {"invoke": 0, "token_ids": final})

    asyncio.run(attempt([[1], [2, 3]]))  # died after three tokens
    asyncio.run(attempt([[1, 2], [3, 4], [5]], final=[1, 2, 3, 4, 5]))  # the same again, and further
    assert out == [("tokens", [1]), ("tokens", [2, 3]), ("tokens", [4]), ("tokens", [5]), ("invoke", [1, 2, 3, 4, 5])]
    out.clear()
    asyncio.run(attempt([[1, 2], [3, 4], [5]], final=[1, 2, 3, 4, 5]))  # an identical third run: nothing new
    assert out == []
    asyncio.run(attempt([[1], [7]], final=[1, 7]))  # other tokens: drop and resend
    assert out == [("restart", None), ("tokens", [1, 7]), ("invoke", [1, 7])]
    assert sent.text[0] == "<1><7>"


def script_ops(target):
    with target.trace(max_tokens=3) as tr:
        tr.invoke("After the kill", ops=[ops.save("layers.2.resid", tokens="last")])
    return tr.result


# --- hostile payloads --------------------------------------------------------------------------


class Boom:
    """Unpickling this runs code: it must never be unpickled for a declarative-only token."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/interlace-pwned",))


def _hostile_payloads() -> list[tuple[str, bytes | str, str]]:
    """(token, body, what) of 200+ requests that must each be refused with a 4xx."""
    valid = json.dumps({"invokes": [{"prompt": "Hello", "ops": [{"op": "save", "point": "layers.1.resid"}]}],
                        "max_tokens": 2})
    cases: list[tuple[str, bytes | str, str]] = []
    for cut in range(1, len(valid) - 1, max(1, len(valid) // 60)):  # truncated JSON
        cases.append((OPS, valid[:cut], f"truncated at {cut}"))
    wrong_types = {"invokes": [{}, {"prompt": 5}, {"prompt": None}, {"prompt": ""}, {"prompt": []},
                               {"prompt": [-1]}, {"prompt": [1.5]}, {"prompt": ["a"]}, {"prompt": {"a": 1}},
                               {"prompt": "x", "ops": "save"}, {"prompt": "x", "ops": [1]},
                               {"prompt": "x", "ops": [{"op": "explode", "point": "layers.1.resid"}]},
                               {"prompt": "x", "ops": [{"op": "save"}]},
                               {"prompt": "x", "ops": [{"op": "add", "point": "layers.1.resid"}]},
                               {"prompt": "x", "ops": [{"op": "scale", "point": "layers.1.resid", "value": [1, 2]}]},
                               {"prompt": "x", "ops": [{"op": "add", "point": "layers.1.resid", "value": 3}]},
                               {"prompt": "x", "ops": [{"op": "save", "point": "layers.1.resid", "tokens": "first"}]},
                               {"prompt": "x", "ops": [{"op": "save", "point": "layers.1.resid", "steps": [-1]}]},
                               {"prompt": "x", "ops": [{"op": "zero", "point": "layers.1.resid", "name": "n"}]},
                               {"prompt": "x", "unknown": 1}, {"prompt": "x", "steps": "all"},
                               {"prompt": "x", "batched": "yes"},
                               {"prompt": "x", "steps": [0]}, {"prompt": "x", "batched": True}]}  # no program
    for inv in wrong_types["invokes"]:
        cases.append((OPS, json.dumps({"invokes": [inv]}), f"invoke {inv}"))
    for field, values in {"max_tokens": [0, -1, "4", 1.5, None, [], 2**70, 1e400], "temperature": [-1, "hot", 1e9],
                          "seed": [-5, 2**64, "s"], "logprobs": ["yes", 3], "timeout_s": [0, -1, "1"],
                          "max_save_bytes": [0, -1], "stream": ["y"], "wait": [2], "invokes": [[], {}, "x", None],
                          "sampling": [{"extra_args": {"interlace": "x"}}, {"logits_processors": ["x"]},
                                       {"top_p": 2}, {"top_k": "a"}, {"stop": [1]}, "x"],
                          "nonsense": [1]}.items():
        for value in values:
            body = json.loads(valid)
            body[field] = value
            text = json.dumps(body).replace("Infinity", "1e400")
            cases.append((OPS, text, f"{field}={value!r}"))
    for point in ["layers.9.resid", "layers.99.resid", "layers.1.nope", "layers.-1.resid", "", "layers.1.output", "samples",
                  "embed_tokens.weight", "layers..resid", "__class__", "layers.1.resid.output", "lm_head.input.x",
                  "logits.output", "a" * 300, "layers.1.mlp.down_proj.bias", "../../etc/passwd"]:
        body = {"invokes": [{"prompt": "x", "ops": [{"op": "save", "point": point}]}]}
        cases.append((OPS, json.dumps(body), f"point {point[:40]!r}"))
    for b64 in ["%%%", "YQ", "aGVsbG8=", base64.b64encode(b"not safetensors").decode(), "=" * 8, "a" * 1001]:
        body = {"invokes": [{"prompt": "x", "ops": [{"op": "add", "point": "layers.1.resid",
                                                      "value": {"safetensors": b64}}]}]}
        cases.append((OPS, json.dumps(body), f"bad tensor base64 {b64[:10]!r}"))
    tensor_file = {"invokes": [{"prompt": "x", "ops": [{"op": "add", "point": "layers.1.resid",
                                                        "value": {"file": "/etc/passwd", "name": "x"}}]}]}
    cases.append((OPS, json.dumps(tensor_file), "a server file as a tensor"))
    for prompt in [[10**6], [2**31 - 1], list(range(3, 700))]:  # past the vocabulary; past max_model_len
        cases.append((OPS, json.dumps({"invokes": [{"prompt": prompt}]}), f"prompt ids {str(prompt)[:20]}"))
    pickles = [cloudpickle.dumps(Boom()), pickle.dumps(Boom()), cloudpickle.dumps(lambda m: os.system("true")),
               b"\x80\x05garbage", b"", cloudpickle.dumps(keep)]
    for data in pickles:  # programs with a declarative-only token: refused before anything unpickles them
        body = {"invokes": [{"prompt": "x", "program": base64.b64encode(data).decode()}]}
        cases.append((OPS, json.dumps(body), "a program with an ops token"))
    for bad in ["%%%", "YQ", base64.b64encode(b"\x80\x05garbage").decode(), base64.b64encode(b"not a pickle").decode(),
                base64.b64encode(pickle.dumps(42)).decode()]:
        body = {"invokes": [{"prompt": "x", "program": bad}], "max_tokens": 2}
        cases.append((CODE, json.dumps(body), f"a bad program {bad[:12]!r} with a code token"))
    deep = "[" * 100_000 + "]" * 100_000
    for text in [deep, '{"invokes": ' + deep + "}", '{"invokes": [{"prompt": "x", "ops": [{"op": "add", '
                 '"point": "layers.1.resid", "value": ' + "[" * 5000 + "1" + "]" * 5000 + "}]}]}",
                 "null", "[]", "1", '"x"', "\xff\xfe", b"\xff\xfe\x00", "{}", '{"invokes": [{"prompt": "x"}]} trailing',
                 "NaN", '{"invokes": [{"prompt": "x", "ops": [{"op": "scale", "point": "layers.1.resid", '
                 '"value": 1e999}]}]}']:
        cases.append((OPS, text, f"odd JSON {str(text)[:20]!r}"))
    return cases


def test_hostile_payloads_get_4xx_and_the_server_keeps_serving(endpoint, analyst, llama):
    cases = _hostile_payloads()
    assert len(cases) >= 200, len(cases)
    with llama.trace(max_tokens=3) as want:
        want.invoke("Between attacks", ops=[ops.save("layers.1.resid", tokens="last")])
    for n, (token, body, what) in enumerate(cases):
        response = _post(endpoint, body, token=token)
        assert 400 <= response.status_code < 500, (what, response.status_code, response.text[:300])
        assert "error" in response.json(), what
        if n % 25 == 0:
            with analyst.trace(max_tokens=3) as tr:
                tr.invoke("Between attacks", ops=[ops.save("layers.1.resid", tokens="last")])
            assert_same(tr.result, want.result)
    assert not os.path.exists("/tmp/interlace-pwned")
    assert httpx.get(f"{endpoint}/healthz").status_code == 200
