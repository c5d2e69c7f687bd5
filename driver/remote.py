"""A model behind an interlace HTTP endpoint, with the trace API of ``interlace.Model``.

    >>> import interlace
    >>> model = interlace.connect("http://127.0.0.1:8000", token="...")   # or INTERLACE_API_TOKEN
    >>> with model.trace(max_tokens=4) as tr:                            # exactly as with Model
    ...     tr.invoke("Hello", ops=[interlace.ops.save("layers.1.resid", tokens="last")])
    >>> tr.result[0].saves["layers.1.resid"].shape

Declarative ops travel as JSON (tensors as base64 safetensors) and work with any token; results
come back as one .safetensors file (``Accept: application/octet-stream``); programs
travel pickled by value and need a token whose role is ``code``. ``submit(trace)`` returns a
future; ``stream(trace)`` yields the server's events (tokens as they are generated, each invoke as
it completes, then the result). Errors are the ones ``Model`` raises (``InterventionError`` with
the worker's traceback and the partial result, ``WorkerDied``); what the server refuses raises
:class:`RequestRefused` with its HTTP status.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import os
import threading
from typing import Any, Iterator


from interlace.cluster.serve.http_api import (
    SAFETENSORS_TYPE,
    HttpOp,
    InvokeRequest,
    TraceRequest,
    TraceResponse,
    decode_result,
    read_safetensors_body,
)
from interlace.core.settings import trace_timeout_s
from interlace.core.trace import InterventionError, TraceResult, WorkerDied, check_trace, dumps, programs_by_value
from interlace.model import DEFAULT_MAX_SAVE_BYTES, Model, Trace, submitted
from interlace.workers.points import ModuleTree


class RequestRefused(RuntimeError):
    """The endpoint refused a request (auth, limits, an invalid trace): ``status`` is the HTTP code."""

    def __init__(self, status: int, type_: str, message: str):
        super().__init__(f"HTTP {status} {type_}: {message}")
        self.status, self.type = status, type_


class EndpointUnreachable(ConnectionError):
    """No connection to the endpoint at all (refused, unknown host, timed out connecting): the
    server is not running there, or not reachable from here. Nothing was sent."""


def _reaching(url: str, limits):
    """httpx's transport, whose connection failures name the endpoint: httpx's own said only
    "[Errno 111] Connection refused", with no URL, from deep in httpcore."""
    import httpx

    class Reaching(httpx.HTTPTransport):
        def handle_request(self, request):
            try:
                return super().handle_request(request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                raise EndpointUnreachable(f"cannot reach the interlace endpoint at {url} ({exc}); is it running "
                                          "(`interlace serve`), and is the URL's host and port right?") from exc

    return Reaching(limits=limits)


class Remote:
    """See the module docstring. ``token``: an API token (default: ``INTERLACE_API_TOKEN``)."""

    trace = Model.trace
    generate = Model.generate

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 900.0, max_parallel: int = 64):
        import httpx

        token = token or os.environ.get("INTERLACE_API_TOKEN")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=max_parallel, max_keepalive_connections=max_parallel)
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s,
                                  transport=_reaching(self.url, limits))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_parallel, thread_name_prefix="interlace-remote")
        self._tree = None
        self._tree_lock = threading.Lock()  # many threads' first traces ask the endpoint once

    @property
    def tree(self):
        """The model's module names, from the endpoint (ops are checked here before sending)."""

        with self._tree_lock:
            if self._tree is None:
                self._tree = ModuleTree(names=self._json("GET", "/v1/model")["module_names"])
        return self._tree

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> "Remote":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- traces ------------------------------------------------------------------------------

    def _run(self, trace: Trace) -> TraceResult:
        return self._send(trace, self.encode(trace))

    def submit(self, trace: Trace) -> concurrent.futures.Future:
        """Run ``trace`` (built outside a ``with`` block) in the background: a future of its result."""
        body = self.encode(submitted(trace))  # errors in the trace raise here, not in the future
        return self._pool.submit(self._send, trace, body)

    def stream(self, trace: Trace) -> Iterator[dict[str, Any]]:
        """The server's events for ``trace``: ``{"event": "tokens", "invoke", "token_ids", "text"}``
        as tokens are generated, ``{"event": "invoke", ...}`` when an invoke completed (its saves
        under ``"saves"``, tensors), and last ``{"event": "result", "result": TraceResult}``; a
        ``{"event": "restart", "invoke"}`` (rare: an invoke run again after its engine replica died
        generated other tokens) means: drop what came of that invoke so far."""
        from safetensors.torch import load

        body = self.encode(trace) | {"stream": True}
        with self._http.stream("POST", "/v1/traces", json=body) as response:
            if response.status_code != 200:
                response.read()
                self._raise(response.status_code, _body(response))
            event = None
            sent: dict[str, Any] = {}  # each invoke's tensors, from its invoke event, by wire key
            for line in response.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if event == "invoke":
                        data["saves"] = load(base64.b64decode(data.pop("tensors"))) if data.get("tensors") else {}
                        sent.update({f"invokes.{data['invoke']}.{name}": t for name, t in data["saves"].items()})
                        yield {"event": event, **data}
                    elif event == "result":
                        answer = TraceResponse.model_validate(data)  # less what the invoke events carried
                        tensors = sent | (load(base64.b64decode(answer.tensors)) if answer.tensors else {})
                        yield {"event": event, "result": self._decode(trace, answer, tensors)}
                    elif event == "error":
                        self._raise(data.pop("status"), data)
                    else:
                        if event == "restart":  # its invoke event comes again
                            sent = {k: t for k, t in sent.items() if not k.startswith(f"invokes.{data['invoke']}.")}
                        yield {"event": event, **data}

    def encode(self, trace: Trace) -> dict[str, Any]:
        """The trace as the JSON body of ``POST /v1/traces`` (checked against the model first)."""

        check_trace(trace.invokes, trace.settings, self.tree)  # the very checks Model makes
        settings = dict(trace.settings)
        invokes = []
        with programs_by_value(inv.program for inv in trace.invokes):
            for inv in trace.invokes:
                program = None
                if inv.program is not None:
                    program = base64.b64encode(dumps(inv.program)).decode()
                invokes.append(InvokeRequest(
                    prompt=inv.prompt if isinstance(inv.prompt, str) else list(inv.prompt),
                    ops=[HttpOp.of(op) for op in inv.ops], program=program,
                    batched=bool(getattr(inv.program, "__interlace_batched__", False)), steps=inv.steps))
        # Model.trace's defaults stay unsaid: the server's own limits apply to them.
        timeout_s = None if trace.timeout_s == trace_timeout_s() else trace.timeout_s
        max_save = None if trace.max_save_bytes == DEFAULT_MAX_SAVE_BYTES else trace.max_save_bytes
        request = TraceRequest(
            invokes=invokes, max_tokens=settings.pop("max_tokens"), temperature=settings.pop("temperature"),
            seed=settings.pop("seed"), logprobs=settings.pop("logprobs") is not None, timeout_s=timeout_s,
            max_save_bytes=max_save, sampling=settings)
        return request.model_dump(mode="json", exclude_defaults=True) | {"invokes": [
            inv.model_dump(mode="json", exclude_defaults=True) for inv in request.invokes]}

    # --- HTTP --------------------------------------------------------------------------------

    def _send(self, trace: Trace, body: dict) -> TraceResult:
        # The answer as one .safetensors file: no base64 or JSON of the saves on either side.
        response = self._http.post("/v1/traces", json=body, headers={"Accept": SAFETENSORS_TYPE})
        if response.status_code != 200:
            self._raise(response.status_code, _body(response), trace)
        return self._decode(trace, *read_safetensors_body(response.content))

    def _json(self, method: str, path: str) -> dict:
        response = self._http.request(method, path)
        if response.status_code != 200:
            self._raise(response.status_code, _body(response))
        return response.json()

    def _decode(self, trace: Trace, response, tensors: dict | None = None) -> TraceResult:
        result = decode_result(response, tensors)
        for inv, sent in zip(result.invokes, trace.invokes):
            inv.prompt = sent.prompt
        return result

    def _raise(self, status: int, data: dict, trace: Trace | None = None):
        error = data.get("error", {}) if isinstance(data, dict) else {}
        kind, message = error.get("type", "Error"), error.get("message", str(data))
        if kind == "InterventionError":
            partial = error.get("partial")
            if partial is not None and trace is not None:
                partial = self._decode(trace, TraceResponse.model_validate(partial))
            raise InterventionError(error["invoke"], error["record"], partial=partial)
        if kind == "WorkerDied":
            raise WorkerDied(message)
        raise RequestRefused(status, kind, message)


def _body(response) -> dict:
    """An error answer's JSON, or its text as one (a proxy in between may answer in HTML)."""
    try:
        return response.json()
    except ValueError:
        return {"error": {"type": f"HTTP{response.status_code}", "message": response.text[:500]}}
