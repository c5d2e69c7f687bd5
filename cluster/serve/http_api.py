"""The HTTP API's messages: what a client sends and what it gets back, for server and client alike.

A trace request is JSON (:class:`TraceRequest`): invokes with a prompt, declarative ops
(:class:`~interlace.cluster.config.OpSpec`, tensors inline as base64 safetensors or nested lists)
and, with a token whose role allows code, a program (base64 cloudpickle). A result
(:class:`TraceResponse`) carries tokens and text as JSON and every saved or shared tensor in one
base64 ``.safetensors`` file, named ``invokes.<i>.<save name>`` and ``shared.<name>``; saved values
that are not tensors go as JSON where they can, else (code tokens only) pickled, as do tensors of
dtypes that file cannot hold (complex128, complex32, float4, float8_e8m0fnu: only programs make them). With
``Accept: application/octet-stream`` the result is that ``.safetensors`` file itself, the rest of
the response in its ``__metadata__["interlace"]``.

    >>> req = TraceRequest(invokes=[InvokeRequest(prompt="Hello", ops=[{"op": "save", "point": "layers.1.resid"}])],
    ...                    max_tokens=4)
    >>> req.model_dump_json()
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from interlace.cluster.config import InlineTensor, OpSpec, Positions
from interlace.core.trace import InvokeResult, TraceResult, check_programless
from interlace.core.wire import portable

ROLES = ("ops", "code")
SAFETENSORS_TYPE = "application/octet-stream"
_Id = Annotated[int, Field(ge=0, lt=2**31)]


# Requests are read strictly (no "yes" for true, no "4" for 4) and numbers must be finite.
_STRICT = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class HttpOp(OpSpec):
    """An op in an HTTP request: as :class:`OpSpec`, but tensors only inline (never a server file)."""

    model_config = _STRICT

    value: float | list[float] | list[list[float]] | InlineTensor | None = Field(
        None, description="add/replace: a vector or rows (nested lists, or {safetensors: base64}); scale: a factor.")


class SamplingOptions(BaseModel):
    """The ``vllm.SamplingParams`` fields a request may set (nothing that carries code or payloads)."""

    model_config = _STRICT

    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=2**31)
    min_p: float | None = Field(None, ge=0, le=1)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, lt=2**31)
    stop: list[Annotated[str, Field(max_length=256)]] | None = Field(None, max_length=16)
    stop_token_ids: list[_Id] | None = Field(None, max_length=256)
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class InvokeRequest(BaseModel):
    """One prompt of a trace, with its ops and (code tokens only) its program."""

    model_config = _STRICT

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[_Id], Field(min_length=1)] = Field(
        description="Text, or token ids.")
    ops: list[HttpOp] = Field(default_factory=list, max_length=256, description="Declarative ops, in order.")
    program: str | None = Field(None, description="A program, base64 of its cloudpickle (needs a code token).")
    batched: bool = Field(False, description="The program is @interlace.batched.")
    steps: Positions | None = Field(None, description="Program steps to run; None: every step.")

    @model_validator(mode="after")
    def _check(self) -> "InvokeRequest":
        if self.program is None:
            check_programless(self.steps, self.batched)
        return self


class TraceRequest(BaseModel):
    """A trace: invokes that run together, and the sampling settings they share."""

    model_config = _STRICT

    invokes: list[InvokeRequest] = Field(min_length=1, description="The trace's invokes.")
    max_tokens: int = Field(1, ge=1, lt=2**31, description="Tokens generated per invoke.")
    temperature: float = Field(0.0, ge=0, le=100, description="0: greedy.")
    seed: int | None = Field(None, ge=0, lt=2**63, description="Sampling seed.")
    logprobs: bool = Field(False, description="Return each generated token's log-probability.")
    timeout_s: float | None = Field(None, gt=0, description="Time limit of the trace's programs (at most the "
                                    "server's max_trace_s).")
    max_save_bytes: int | None = Field(None, gt=0, description="The most the trace may save (at most the server's).")
    sampling: SamplingOptions = Field(default_factory=SamplingOptions, description="Further sampling settings.")
    stream: bool = Field(False, description="Answer with server-sent events: tokens as they are generated, "
                         "each invoke as it completes, then the result.")
    wait: bool = Field(True, description="False: answer 202 with the trace's id at once; GET /v1/traces/{id} "
                       "later.")

    @model_validator(mode="after")
    def _check(self) -> "TraceRequest":
        if self.stream and not self.wait:
            raise ValueError("stream and wait=false cannot go together: a stream is the answer")
        return self

    @property
    def has_code(self) -> bool:
        return any(inv.program is not None for inv in self.invokes)

    def settings(self) -> dict[str, Any]:
        """SamplingParams fields, as ``Model.trace`` builds them."""
        extra = self.sampling.model_dump(exclude_none=True)
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed,
                    logprobs=0 if self.logprobs else None, **extra)


class InvokeResponse(BaseModel):
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    saves: list[str] = Field(description="The invoke's save names; tensors under invokes.<i>.<name>.")
    printed: str = Field("", description="What the invoke's program printed (stdout and stderr), step by step.")


class TraceResponse(BaseModel):
    """A trace's result. Tensors: ``tensors`` (base64 .safetensors); other values: ``values`` (JSON)
    or ``objects`` (base64 cloudpickle of {key: value}, code tokens only); keys
    ``invokes.<i>.<name>`` and ``shared.<name>``."""

    id: str
    invokes: list[InvokeResponse]
    shared: list[str] = Field(default_factory=list)
    tensors: str = ""
    values: dict[str, Any] = Field(default_factory=dict)
    objects: str | None = None
    tensors_in_events: bool = Field(False, description="A stream's result: the tensors its `invoke` events "
                                    "carried are not repeated in `tensors`.")


class ErrorBody(BaseModel):
    """Every error answer: ``{"error": {...}}``; an intervention error also carries the partial result."""

    type: str
    message: str
    invoke: int | None = None
    record: dict[str, str] | None = None
    partial: TraceResponse | None = None


# --- results <-> wire ------------------------------------------------------------------------------


def flat_values(result) -> dict[str, Any]:
    """A TraceResult's saves and shared values under their wire keys."""
    flat = {f"invokes.{i}.{name}": value for i, inv in enumerate(result.invokes) for name, value in inv.saves.items()}
    flat.update({f"shared.{name}": value for name, value in result.shared.items()})
    return flat


def saved_bytes(result) -> int:
    """The bytes of a TraceResult's saved tensors."""
    import torch

    return sum(v.numel() * v.element_size() for v in flat_values(result).values() if isinstance(v, torch.Tensor))


def encode_result(trace_id: str, result, allow_objects: bool,
                  leave_out: frozenset[str] | set[str] = frozenset()) -> tuple[TraceResponse, dict]:
    """The response for ``result`` (a :class:`interlace.TraceResult`) and its tensors by key, less
    the tensors under the keys ``leave_out`` (a stream's invoke events carried them)."""
    import cloudpickle
    import torch

    tensors, values, objects = {}, {}, {}
    for key, value in flat_values(result).items():
        if isinstance(value, torch.Tensor) and str(value.dtype) in _SAFETENSORS_DTYPES:
            if key not in leave_out:
                tensors[key] = value.detach().cpu().contiguous().clone()  # clone: safetensors refuses shared storage
        elif isinstance(value, torch.Tensor) and not allow_objects:
            raise ValueError(f"{key} is a {value.dtype} tensor, which a .safetensors answer cannot carry")
        elif _json_able(value):
            values[key] = value
        elif allow_objects:
            objects[key] = portable(value)
        else:
            raise ValueError(f"{key} is a {type(value).__name__}, which cannot be sent as JSON")
    response = TraceResponse(
        id=trace_id,
        invokes=[InvokeResponse(token_ids=inv.token_ids, text=inv.text, logprobs=inv.logprobs, saves=sorted(inv.saves),
                                printed=inv.printed)
                 for inv in result.invokes],
        shared=sorted(result.shared), values=values,
        objects=base64.b64encode(cloudpickle.dumps(objects)).decode() if objects else None,
        tensors_in_events=bool(leave_out))
    return response, tensors


# What a .safetensors file carries (safetensors 0.8); a program's complex128, complex32, float4 or
# float8_e8m0fnu tensor goes with the pickled objects (code callers: no other runs programs)
_SAFETENSORS_DTYPES = frozenset({"torch.float64", "torch.float32", "torch.float16", "torch.bfloat16", "torch.int64",
                                 "torch.int32", "torch.int16", "torch.int8", "torch.uint8", "torch.uint16",
                                 "torch.uint32", "torch.uint64", "torch.bool", "torch.float8_e4m3fn",
                                 "torch.float8_e5m2", "torch.complex64"})


def tensors_b64(tensors: dict) -> str:
    from safetensors.torch import save

    return base64.b64encode(save(tensors)).decode() if tensors else ""


def safetensors_body(response: TraceResponse, tensors: dict) -> bytes:
    """The binary answer: the tensors as a .safetensors file, the rest of the response in its metadata."""
    from safetensors.torch import save

    return save(tensors, metadata={"interlace": response.model_dump_json(exclude={"tensors"})})


def read_safetensors_body(body: bytes) -> tuple[TraceResponse, dict]:
    """The response and its tensors from a binary answer (:func:`safetensors_body`)."""
    import struct

    from safetensors.torch import load

    header_len = struct.unpack("<Q", body[:8])[0]  # the format's own layout: u64 length, JSON header
    metadata = json.loads(body[8 : 8 + header_len]).get("__metadata__") or {}
    return TraceResponse.model_validate_json(metadata["interlace"]), load(body)


def decode_result(response: TraceResponse, tensors: dict | None = None):
    """A :class:`interlace.TraceResult` from a response (the client's side)."""

    flat: dict[str, Any] = dict(response.values)
    if tensors is None and response.tensors:
        from safetensors.torch import load

        tensors = load(base64.b64decode(response.tensors))
    flat.update(tensors or {})
    if response.objects:
        import cloudpickle

        flat.update(cloudpickle.loads(base64.b64decode(response.objects)))
    invokes = [InvokeResult(None, inv.token_ids, inv.text, {n: flat[f"invokes.{i}.{n}"] for n in inv.saves}, inv.logprobs,
                            inv.printed)
               for i, inv in enumerate(response.invokes)]
    return TraceResult(invokes, {n: flat[f"shared.{n}"] for n in response.shared})


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=True)
        return True
    except (TypeError, ValueError):
        return False


def parse_request(body: bytes) -> TraceRequest:
    """A request body as a TraceRequest; ValueError (bad JSON) or pydantic's ValidationError."""
    try:
        raw = json.loads(body)
    except RecursionError:
        raise ValueError("the JSON body is nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the body is not JSON: {exc}") from None
    return TraceRequest.model_validate(raw)


Role = Literal["ops", "code"]
