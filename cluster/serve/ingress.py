"""The HTTP ingress of the Serve application: auth, limits, traces over the engine replicas.

Routes (OpenAPI schema at ``/openapi.json``, docs at ``/docs``):

    POST   /v1/traces              run a trace (JSON :class:`TraceRequest`); answers the result,
                                   server-sent events (``stream: true``) or 202 and an id (``wait: false``)
    GET    /v1/traces/{id}         an asynchronous trace's result (202 while it runs)
    DELETE /v1/traces/{id}         cancel it
    GET    /v1/model               the model's name and module names (what ops may address)
    GET    /healthz  /readyz       liveness; readiness (an engine replica answers)
    GET    /metrics                Prometheus metrics of the whole application (no token needed)

Every answer other than 2xx is ``{"error": {"type", "message", ...}}`` with a 4xx for what the
request did wrong (401 no or bad token, 403 code with a declarative-only token, 413 body or saves
too large, 422 invalid trace or a failed intervention, 429 too many traces in flight for the
token) and 503/504 when the engines failed or the trace ran out of time. A request never gets a
500 for its own content: whatever it sends is parsed by pydantic models that refuse the unknown,
and nothing it sends is unpickled unless its token's role is ``code``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from interlace.cluster.assembly import assemble
from interlace.cluster.config import ServeConfig
from interlace.cluster.serve.auth import Caller, Tokens
from interlace.cluster.serve.http_api import (
    SAFETENSORS_TYPE,
    ErrorBody,
    TraceRequest,
    TraceResponse,
    encode_result,
    parse_request,
    safetensors_body,
    saved_bytes,
    tensors_b64,
)
from interlace.cluster.serve.state import SharedState
from interlace.cluster.shards import plan_shards
from interlace.core.trace import InterventionError, Invoke, check_trace, encode_payloads
from interlace.core.wire import InvokePayload, ShardTask, printed_text
from interlace.workers.points import ModuleTree

api = FastAPI(title="interlace", description="Intervention programs inside vLLM, over HTTP.", version="1")

_TRACE_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": TraceRequest.model_json_schema(ref_template="#/components/schemas/{model}")}}}}


class Refused(Exception):
    """An answer other than 2xx, with its status."""

    def __init__(self, status: int, type_: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.body = status, ErrorBody(type=type_, message=message, **extra)


def _error(status: int, body: ErrorBody) -> JSONResponse:
    return JSONResponse({"error": body.model_dump(exclude_none=True)}, status_code=status)


@dataclasses.dataclass
class _Run:
    """One trace request on its way through."""

    trace_id: str
    caller: Caller
    request: TraceRequest
    accepted: float  # time.time() at arrival


class Ingress:
    """The FastAPI routes over a handle to the engine deployment and one to the state deployment."""

    def __init__(self, config: dict, engine, state):
        self.config = ServeConfig.model_validate(config)
        self.tokens = Tokens.load(self.config.auth)
        self.engine, self.state = engine, SharedState(state)
        self._tree = None
        self._ready: asyncio.Future | None = None  # the engine's ready call under way (_module_tree)
        self._model_names: list[str] = []
        self._background: set[asyncio.Task] = set()  # asynchronous traces running in this replica

    # --- helpers ---------------------------------------------------------------------------

    async def _module_tree(self):
        """The model's module names, from an engine replica's ``ready`` (which starts its engine).
        One call at a time, shared by every caller (each waits without cancelling it): /readyz
        is polled every few seconds while an engine starts, for tens of seconds, and a call per
        poll piled requests onto the starting replica, which Serve's autoscaler took for load
        and answered with a second replica before any traffic came."""
        if self._tree is None:
            if self._ready is None or (self._ready.done() and (self._ready.cancelled() or self._ready.exception())):
                self._ready = asyncio.ensure_future(self.engine.ready.remote())
            info = await asyncio.shield(self._ready)
            self._model_names = info["module_names"]
            self._tree = ModuleTree(names=self._model_names)
        return self._tree

    def _caller(self, request: Request) -> Caller:
        caller = self.tokens.caller(request.headers.get("authorization"))
        if caller is None:
            raise Refused(401, "Unauthorized", "a valid API token is needed: send 'Authorization: Bearer <token>'")
        return caller

    async def _body(self, request: Request) -> bytes:
        limit = self.config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise Refused(413, "PayloadTooLarge", f"the body is {declared} bytes; the limit is {limit}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Refused(413, "PayloadTooLarge", f"the body is over the limit of {limit} bytes")
        return bytes(body)

    def _check_limits(self, caller: Caller, req: TraceRequest) -> None:
        limits = self.config.limits
        if req.has_code and not caller.may_send_code:
            raise Refused(403, "Forbidden", f"token {caller.name!r} has role {caller.role!r}, which may send "
                          "declarative ops only; programs need a token with role 'code'")
        if len(req.invokes) > limits.max_invokes:
            raise Refused(422, "LimitExceeded", f"{len(req.invokes)} invokes; the limit is {limits.max_invokes}")
        # Text prompts count one token per byte: an upper bound that needs no tokenizer here.
        tokens = sum(len(inv.prompt.encode()) if isinstance(inv.prompt, str) else len(inv.prompt)
                     for inv in req.invokes) + req.max_tokens * len(req.invokes)
        if tokens > limits.max_tokens:
            raise Refused(422, "LimitExceeded", f"the trace asks for up to {tokens} tokens (prompts, text counted "
                          f"per byte, plus max_tokens per invoke); the limit is {limits.max_tokens}")
        if req.timeout_s is not None and req.timeout_s > limits.max_trace_s:
            raise Refused(422, "LimitExceeded", f"timeout_s {req.timeout_s}; the limit is {limits.max_trace_s}")
        if req.max_save_bytes is not None and req.max_save_bytes > limits.max_save_bytes:
            raise Refused(422, "LimitExceeded", f"max_save_bytes {req.max_save_bytes}; the limit is "
                          f"{limits.max_save_bytes}")

    async def _invokes(self, req: TraceRequest, trace_id: str):
        """The trace's invokes and payloads: ops built from data, programs left pickled (never
        unpickled here: the workers do, for code tokens only)."""
        import base64
        import binascii

        import cloudpickle

        invokes = []
        try:
            for inv in req.invokes:
                invokes.append(Invoke(inv.prompt, None, [op.build() for op in inv.ops], inv.steps))
            check_trace(invokes, req.settings(), await self._module_tree())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise Refused(422, type(exc).__name__, str(exc).strip("'\"")) from None
        timeout_s = req.timeout_s or self.config.limits.max_trace_s
        max_save = min(req.max_save_bytes or self.config.limits.max_save_bytes, self.config.limits.max_save_bytes)
        payloads = encode_payloads(invokes, trace_id, "", timeout_s, max_save)
        for index, inv in enumerate(req.invokes):
            if inv.program is None:
                continue
            try:
                program = base64.b64decode(inv.program, validate=True)
            except (binascii.Error, ValueError):
                raise Refused(400, "BadRequest", f"invoke {index}: program is not base64") from None
            base = payloads[index] or _empty_payload(trace_id, index, cloudpickle.dumps([]), timeout_s, max_save)
            payloads[index] = dataclasses.replace(base, program=program, program_key=hashlib.sha256(program).hexdigest()[:16],
                                                  batched=inv.batched)
        return invokes, payloads

    # --- running -----------------------------------------------------------------------------

    async def run(self, run: _Run, on_event=None):
        """The trace's result (TraceResult); ``on_event`` gets stream events when streaming."""
        import ray

        req = run.request
        invokes, payloads = await self._invokes(req, run.trace_id)
        replicas = self.config.autoscaling.min_replicas if self.config.autoscaling else self.config.cluster.replicas
        joined = [i for i, p in enumerate(payloads) if p is not None and p.program is not None]
        shards = plan_shards(len(invokes), joined, max(1, replicas), self.config.cluster.min_shard_invokes)
        stages = self.config.cluster.model.pipeline_parallel_size
        completions: list = [None] * len(invokes)
        reports: dict[int, list] = {}
        timing = {"started": None, "first_token": None}
        sent = _StreamSent()  # what a streaming client has, across a shard's attempts

        async def shard(n: int, indices: list[int]) -> None:
            for attempt in range(self.config.cluster.max_retries + 1):
                task = ShardTask(run.trace_id, n, attempt, [invokes[i].prompt for i in indices],
                                 [payloads[i] for i in indices], req.settings(), stages)
                try:
                    if on_event is None:
                        outcome = await _cancelled_with_caller(self.engine.run_here.remote(task))
                        timing["started"] = min(filter(None, [timing["started"], outcome.started_at]))
                        if outcome.first_token_s is not None:
                            first = outcome.started_at + outcome.first_token_s
                            timing["first_token"] = min(filter(None, [timing["first_token"], first]))
                        for i, done in zip(indices, outcome.completions):
                            completions[i] = done
                        for r in outcome.reports:
                            reports.setdefault(r.invoke, []).append(r)
                    else:
                        sent.new_attempt(indices)
                        await self._stream_shard(task, indices, completions, reports, timing, sent.filter(on_event))
                    return
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    for i in indices:  # a new attempt reports afresh
                        reports.pop(i, None)
                    # Serve replaces a dead replica; until its router knows, a retry may meet it again.
                    await asyncio.sleep(min(2.0 ** attempt, 10.0))
                    continue
                except Exception as exc:  # noqa: BLE001 - vLLM refusing a request: token ids past the vocabulary...
                    if not _refused_by_engine(exc):
                        raise
                    raise Refused(422, "InvalidTrace", _engine_message(exc)) from None
            raise Refused(503, "WorkerDied", f"trace {run.trace_id}: shard {n} lost its engine replica "
                          f"{self.config.cluster.max_retries + 1} times")

        await asyncio.gather(*(shard(n, indices) for n, indices in enumerate(shards)))
        run_timing = {"queue_s": timing["started"] - run.accepted if timing["started"] else None,
                      "first_token_s": timing["first_token"] - run.accepted if timing["first_token"] else None}
        return assemble(invokes, completions, reports), run_timing

    async def _stream_shard(self, task, indices, completions, reports, timing, on_event) -> None:
        stream = self.engine.options(stream=True).stream.remote(task)
        try:
            async for message in stream:
                # The engine deployment sends what a stream gathered meanwhile as one ("batch", events).
                for event in message[1] if message[0] == "batch" else [message]:
                    await self._stream_event(event, indices, completions, reports, timing, on_event)
        except asyncio.CancelledError:
            stream.cancel()  # as in _cancelled_with_caller
            raise

    async def _stream_event(self, event, indices, completions, reports, timing, on_event) -> None:
        kind = event[0]
        if kind == "started":
            timing["started"] = min(filter(None, [timing["started"], event[1]]))
        elif kind == "tokens":
            timing["first_token"] = timing["first_token"] or time.time()
            await on_event("tokens", {"invoke": indices[event[1]], "token_ids": event[2], "text": event[3]})
        else:
            _, j, done, invoke_reports = event
            completions[indices[j]] = done
            for r in invoke_reports:
                reports.setdefault(r.invoke, []).append(r)
            await on_event("invoke", _invoke_event(indices[j], done, invoke_reports))

    async def finish(self, run: _Run, on_event=None, binary: bool = False,
                     streamed: set[str] | None = None) -> tuple[int, bytes, str, dict]:
        """Run the trace to its answer: (status, body, content type, metrics outcome); ``binary``: a
        200 answer as one .safetensors file (no base64 or JSON of the tensors: about a tenth of the
        CPU per answer, in the ingress and the client alike)."""

        outcome: dict[str, Any] = {}
        try:
            result, timing = await asyncio.wait_for(self.run(run, on_event), self.config.limits.max_trace_s)
            outcome.update(timing)
            saved = saved_bytes(result)  # before any copy of the saves
            if saved > self.config.limits.max_save_bytes:
                raise Refused(413, "SavesTooLarge", f"the trace saved {saved} bytes; the limit is "
                              f"{self.config.limits.max_save_bytes}")
            # A stream's invoke events carried their tensors: once is enough.
            response, tensors = encode_result(run.trace_id, result, run.caller.may_send_code, streamed or frozenset())
            self._count(outcome, run.request, result, saved)
            if binary:
                return 200, safetensors_body(response, tensors), SAFETENSORS_TYPE, outcome
            response.tensors = tensors_b64(tensors)
            return 200, response.model_dump_json().encode(), "application/json", outcome
        except InterventionError as exc:
            partial = None
            if exc.partial is not None:
                partial, tensors = encode_result(run.trace_id, exc.partial, run.caller.may_send_code)
                partial.tensors = tensors_b64(tensors)
            outcome.update(ok=0, failed=1)
            body = ErrorBody(type="InterventionError", message=str(exc), invoke=exc.invoke, record=exc.record,
                             partial=partial)
            return 422, json.dumps({"error": body.model_dump(exclude_none=True)}).encode(), "application/json", outcome
        except asyncio.TimeoutError:
            return *_error_bytes(504, "Timeout", f"the trace ran past the limit of {self.config.limits.max_trace_s}s"), outcome
        except Refused as exc:
            return exc.status, json.dumps({"error": exc.body.model_dump(exclude_none=True)}).encode(), "application/json", outcome
        except ValueError as exc:  # a saved value that cannot be sent
            return *_error_bytes(422, "ValueError", str(exc)), outcome

    def _count(self, outcome: dict, req: TraceRequest, result, saved: int) -> None:
        intervened = sum(1 for inv in req.invokes if inv.ops or inv.program)
        outcome.update(tokens=sum(len(inv.token_ids) for inv in result.invokes), ok=intervened, failed=0,
                       saved_bytes=saved)

    # --- routes (Serve binds them to each ingress replica through serve.ingress) ---------------

    @api.post("/v1/traces", openapi_extra=_TRACE_BODY, response_model=TraceResponse,
              responses={202: {"description": "wait=false: the trace's id"}, 401: {"model": ErrorBody},
                         403: {"model": ErrorBody}, 413: {"model": ErrorBody}, 422: {"model": ErrorBody},
                         429: {"model": ErrorBody}, 503: {"model": ErrorBody}, 504: {"model": ErrorBody}})
    async def submit(self, request: Request):
        """Run a trace. ``Accept: application/octet-stream``: the result as one .safetensors file."""
        return await self._answer(request, "/v1/traces", self._submit)

    @api.get("/v1/traces/{trace_id}")
    async def result(self, trace_id: str, request: Request):
        """An asynchronous trace's result (202 while it runs), for the token that made it."""
        return await self._answer(request, "/v1/traces/{id}", lambda r: self._result(r, trace_id))

    @api.delete("/v1/traces/{trace_id}")
    async def cancel(self, trace_id: str, request: Request):
        """Cancel an asynchronous trace of this token."""
        return await self._answer(request, "/v1/traces/{id}:delete", lambda r: self._cancel(r, trace_id))

    @api.get("/v1/model")
    async def model(self, request: Request):
        """The served model: name, module names (what ops and programs may address)."""
        async def describe(r):
            self._caller(r)
            await self._module_tree()
            return JSONResponse({"name": self.config.cluster.model.name, "module_names": self._model_names,
                                 "pipeline_parallel_size": self.config.cluster.model.pipeline_parallel_size})
        return await self._answer(request, "/v1/model", describe)

    @api.get("/healthz")
    async def healthz(self):
        return {"status": "ok"}

    @api.get("/readyz")
    async def readyz(self):
        try:
            await asyncio.wait_for(self._module_tree(), 5.0)
        except Exception as exc:  # noqa: BLE001 - not ready, whatever the reason
            return JSONResponse({"status": "starting", "detail": type(exc).__name__}, status_code=503)
        return {"status": "ready"}

    @api.get("/metrics")
    async def metrics(self):
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await self.state.call("exposition"), media_type=CONTENT_TYPE_LATEST)

    async def _answer(self, request: Request, route: str, handler):
        try:
            response = await handler(request)
        except Refused as exc:
            response = _error(exc.status, exc.body)
        except Exception as exc:  # noqa: BLE001 - a fault of the server's: answered and counted like any other
            response = _error(500, ErrorBody(type="InternalError", message=f"{type(exc).__name__}: {exc}"))
        if not getattr(response, "counted", False):  # a trace answered at once counts it with its metrics
            await self.state.call("record_request", route, response.status_code)
        return response

    async def _submit(self, request: Request):
        caller = self._caller(request)
        body = await self._body(request)
        try:
            req = parse_request(body)
        except ValueError as exc:
            status = 422 if isinstance(exc, ValidationError) else 400
            message = _validation_message(exc) if isinstance(exc, ValidationError) else str(exc)
            raise Refused(status, "InvalidTrace" if status == 422 else "BadRequest", message) from None
        self._check_limits(caller, req)
        limit = caller.max_in_flight or self.config.limits.max_in_flight_per_token
        if not await self.state.call("acquire", caller.name, limit):
            raise Refused(429, "TooManyRequests", f"token {caller.name!r} has {limit} traces in flight, its limit")
        run = _Run(uuid.uuid4().hex[:16], caller, req, time.time())
        if req.stream:
            return StreamingResponse(self._events(run), media_type="text/event-stream")
        if not req.wait:
            await self.state.call("begin", run.trace_id, caller.name)
            self._background.add(task := asyncio.get_running_loop().create_task(self._in_background(run)))
            task.add_done_callback(self._background.discard)
            return JSONResponse({"id": run.trace_id, "status": "running"}, status_code=202)
        try:
            status, payload, content_type, outcome = await self.finish(
                run, binary=SAFETENSORS_TYPE in request.headers.get("accept", ""))
        except BaseException:
            await self.state.call("release", caller.name)
            raise
        await self._record(run, outcome, request=("/v1/traces", status))  # and frees the token's slot
        response = Response(payload, status_code=status, media_type=content_type)
        response.counted = True
        return response

    async def _record(self, run: _Run, outcome: dict, request: tuple[str, int] | None = None) -> None:
        """The trace's metrics, and its token's slot freed (and the HTTP request counted, when
        given as its route and status): one call. The trace's answer does not depend on it: when
        the application is deleted (``interlace serve`` stopping) the state's replica stops at
        once, while the ingress replicas finish the traces they run."""
        outcome["completion_s"] = time.time() - run.accepted
        try:
            await self.state.call("trace_done", run.caller.name, outcome, request)
        except Exception:  # noqa: BLE001 - the state gone (Serve stopping, its host restarting): answer anyway
            pass  # the trace's metrics are lost, and its slot with the state that counted it

    async def _in_background(self, run: _Run, poll_s: float = 0.5) -> None:
        """An asynchronous trace; a cancel may arrive at any ingress replica (the state holds it)."""
        work = asyncio.get_running_loop().create_task(self.finish(run))
        while not work.done():
            await asyncio.wait({work}, timeout=poll_s)
            if not work.done() and await self.state.call("cancelled", [run.trace_id]):
                work.cancel()
        try:
            status, payload, content_type, outcome = await work
            await self._record(run, outcome)
        except asyncio.CancelledError:
            status, payload, content_type = _error_bytes(499, "Cancelled", "the trace was cancelled")
            await self.state.call("release", run.caller.name)
        await self.state.call("finish", run.trace_id, status, payload, content_type)

    async def _events(self, run: _Run) -> AsyncIterator[bytes]:
        """The trace's server-sent events. Each chunk handed to Serve is a message through this
        replica and the proxy whatever its size: what arrived while the last chunk went out goes
        as one chunk."""
        queue: asyncio.Queue = asyncio.Queue()
        streamed: set[str] = set()  # wire keys of the tensors the invoke events carried

        async def on_event(kind: str, data: dict) -> None:
            if kind in ("invoke", "restart"):
                prefix = f"invokes.{data['invoke']}."
                streamed.difference_update([key for key in streamed if key.startswith(prefix)])
                streamed.update(prefix + name for name in data.get("saves", ()))
            queue.put_nowait((kind, data))

        async def produce() -> None:
            try:
                status, payload, _, outcome = await self.finish(run, on_event, streamed=streamed)
            except Exception as exc:  # noqa: BLE001 - a fault of the server's: the stream ends saying so
                await self.state.call("release", run.caller.name)
                body = _error_bytes(500, "InternalError", f"{type(exc).__name__}: {exc}")[1]
                queue.put_nowait(("error", _with_status(body, 500)))
                queue.put_nowait(None)
                return
            except BaseException:
                await self.state.call("release", run.caller.name)
                queue.put_nowait(None)
                raise
            await self._record(run, outcome)
            queue.put_nowait(("result" if status == 200 else "error", _with_status(payload, status)))
            queue.put_nowait(None)

        producer = asyncio.get_running_loop().create_task(produce())
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                if items[-1] is not None:
                    yield _sse_chunk(items)
                    continue
                if len(items) > 1:
                    yield _sse_chunk(items[:-1])
                return
        finally:
            producer.cancel()

    async def _result(self, request: Request, trace_id: str):
        caller = self._caller(request)
        found = await self.state.call("result", trace_id, caller.name)
        if found is None:
            raise Refused(404, "NotFound", f"no trace {trace_id!r} of this token (results are kept "
                          f"{self.config.limits.results_ttl_s:.0f}s)")
        status, body, content_type = found
        if body is None:
            return JSONResponse({"id": trace_id, "status": "running"}, status_code=202)
        return Response(body, status_code=status, media_type=content_type)

    async def _cancel(self, request: Request, trace_id: str):
        caller = self._caller(request)
        state = await self.state.call("cancel", trace_id, caller.name)
        if state is None:
            raise Refused(404, "NotFound", f"no trace {trace_id!r} of this token")
        return JSONResponse({"id": trace_id, "status": state})  # "cancelling", or "finished" already


async def _cancelled_with_caller(response):
    """``await response`` (a call to the engine deployment), cancelling the call on its replica
    when the awaiting task is cancelled: the trace ran past ``max_trace_s``, an asynchronous trace
    was cancelled. Serve cancels a call only when asked (or when the HTTP request that made it is
    gone); left alone, the shard ran on to its end on the engine, holding one of the replica's
    ``max_in_flight`` places and its share of every step for a trace whose caller had its answer."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise


def _refused_by_engine(exc: BaseException) -> bool:
    """Whether a replica's error is vLLM refusing the request itself (its input was invalid)."""
    cause = getattr(exc, "cause", None) or exc
    return isinstance(cause, ValueError) or type(cause).__module__.startswith("vllm")


def _engine_message(exc: BaseException) -> str:
    """The engine's own words from a replica's error (Ray wraps it with the replica's traceback)."""
    cause = getattr(exc, "cause", None) or exc
    return str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__


def _error_bytes(status: int, type_: str, message: str) -> tuple[int, bytes, str]:
    return status, json.dumps({"error": {"type": type_, "message": message}}).encode(), "application/json"


def _empty_payload(trace_id: str, index: int, ops: bytes, timeout_s: float, max_save: int):
    return InvokePayload(trace=trace_id, invoke=index, program=None, program_key=None, batched=False, ops=ops,
                         ops_key="", steps=None, sink="", timeout_s=timeout_s, max_save_bytes=max_save)


def _invoke_event(index: int, done, reports) -> dict:
    """A streamed invoke: its tokens and its saves (base64 safetensors), or its error."""
    import torch

    saves = {name: value for r in sorted(reports, key=lambda r: r.stage) for name, value in r.saves.items()}
    error = next((r.error.to_dict() for r in reports if r.error is not None), None)
    tensors = {n: v.detach().cpu().contiguous().clone() for n, v in saves.items() if isinstance(v, torch.Tensor)}
    return {"invoke": index, "token_ids": done.token_ids, "text": done.text, "saves": sorted(tensors),
            "tensors": tensors_b64(tensors), "printed": printed_text(reports), "error": error}


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class _StreamSent:
    """What a streaming client was sent, per invoke, so that a shard run again on a new engine
    replica (its replica died mid-stream) sends only what is new: the tokens the client has are
    skipped as the new attempt generates them again, and an ``invoke`` event it has is not sent
    twice. Where the new attempt generates other tokens than were sent (sampling without a seed), a
    ``restart`` event tells the client to drop what it has of that invoke, and the attempt's tokens
    so far follow: a client never holds tokens its result does not have."""

    def __init__(self) -> None:
        self.ids: dict[int, list[int]] = {}  # invoke -> token ids the client has
        self.text: dict[int, str] = {}
        self.done: dict[int, list[int]] = {}  # invoke -> the token ids of the invoke event it has
        self.now_ids: dict[int, list[int]] = {}  # invoke -> this attempt's tokens so far
        self.now_text: dict[int, str] = {}

    def new_attempt(self, indices: list[int]) -> None:
        for i in indices:
            self.now_ids[i], self.now_text[i] = [], ""

    def filter(self, on_event):
        async def send(kind: str, data: dict) -> None:
            for event in self._new(kind, data):
                await on_event(*event)
        return send

    def _new(self, kind: str, data: dict) -> list[tuple[str, dict]]:
        i = data["invoke"]
        if kind == "invoke":
            if self.done.get(i) == data["token_ids"]:
                return []  # the client has this invoke's event from an earlier attempt
            events = self._restart(i) if i in self.done else []
            self.done[i] = list(data["token_ids"])
            return events + [(kind, data)]
        self.now_ids[i] += data["token_ids"]
        self.now_text[i] += data["text"]
        have, now = self.ids.get(i, []), self.now_ids[i]
        if now[:len(have)] == have[:len(now)] and self.now_text[i].startswith(self.text.get(i, "")[:len(self.now_text[i])]):
            if len(now) <= len(have):
                return []  # generated again, already sent
            new = {**data, "token_ids": now[len(have):], "text": self.now_text[i][len(self.text.get(i, "")):]}
            self.ids[i], self.text[i] = list(now), self.now_text[i]
            return [("tokens", new)]
        events = self._restart(i) + [("tokens", {**data, "token_ids": list(now), "text": self.now_text[i]})]
        self.ids[i], self.text[i] = list(now), self.now_text[i]
        return events

    def _restart(self, i: int) -> list[tuple[str, dict]]:
        self.done.pop(i, None)
        return [("restart", {"invoke": i, "reason": "the invoke ran again on another engine replica and "
                             "generated other tokens: drop what was sent of it"})]


def _with_status(payload: bytes, status: int) -> bytes:
    """An answer's JSON object (compact, one line) with ``"status"`` added, without parsing it again."""
    body = payload.rstrip()
    if not body.startswith(b"{") or not body.endswith(b"}") or b"\n" in body:
        return json.dumps(json.loads(payload) | {"status": status}).encode()
    return body[:-1] + (b", " if body != b"{}" else b"") + f'"status": {status}}}'.encode()


def _sse_chunk(items: list[tuple[str, Any]]) -> bytes:
    """Events queued meanwhile as one chunk (the engine deployment merged each invoke's token
    deltas already); a final answer's data is its JSON bytes."""
    return b"".join(f"event: {kind}\ndata: ".encode() + data + b"\n\n" if isinstance(data, bytes) else _sse(kind, data)
                    for kind, data in items)


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False, include_input=False)[:5]
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors)
