"""Traces: one or more invokes (prompts, each with a program and/or ops) run together.

A trace is built on the driver, validated, and turned into one vLLM request per invoke. Programs
travel by value (cloudpickle) in ``SamplingParams.extra_args``, so closures, lambdas and captured
tensors work from scripts and notebooks alike.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import cloudpickle



def batched(program: Callable) -> Callable:
    """Mark a program as written for a batch of invokes.

    The invokes of a trace that share a batched program run it once per step over all of their
    rows (``m.rows[j]`` is invoke j's rows, ``m.last(x)`` each invoke's last row), instead of once
    per invoke. Saves and shared contributions are still split per invoke.

        >>> @interlace.batched
        ... def keep_last(m):
        ...     m.save("h", m.last(m.layers[2].resid))
    """
    program.__interlace_batched__ = True
    return program


@dataclass
class Invoke:
    prompt: str | list[int]
    program: Callable | None = None
    ops: list[dict] = field(default_factory=list)
    steps: list[int] | None = None  # program steps to run; None = every step

    @property
    def intervened(self) -> bool:
        return self.program is not None or bool(self.ops)


@dataclass
class InvokeResult:
    """One invoke's outcome: generated tokens and text, and its saves."""

    prompt: str | list[int]
    token_ids: list[int]
    text: str
    saves: dict[str, Any]
    logprobs: list[float] | None = None  # log-probability of each generated token


@dataclass
class TraceResult:
    """Per invoke results (indexable) plus the trace's merged shared values."""

    invokes: list[InvokeResult]
    shared: dict[str, Any]

    def __getitem__(self, index: int) -> InvokeResult:
        return self.invokes[index]

    def __len__(self) -> int:
        return len(self.invokes)


class InterventionError(RuntimeError):
    """A program or op failed; carries the worker-side record with the user's traceback."""

    def __init__(self, invoke: int, record: dict, partial: TraceResult | None = None):
        self.invoke = invoke
        self.record = record
        self.partial = partial
        super().__init__(
            f"invoke {invoke} failed at {record['where']}: {record['type']}: {record['message']}\n"
            f"--- worker traceback ---\n{record['traceback']}"
        )


class WorkerDied(RuntimeError):
    """The engine's worker process died while running a trace (a program crashed the interpreter,
    the kernel killed the process for memory...). The trace fails; the model starts a new engine
    for the next one."""


def encode_payloads(invokes: list[Invoke], trace_id: str, sink: str, timeout_s: float,
                    max_save_bytes: int) -> list[bytes | None]:
    """The bytes each intervened invoke's request carries to the workers (None: plain request)."""
    pickled: dict[int, tuple[bytes, str]] = {}  # one pickle per distinct program object
    pickled_ops: dict[str, bytes] = {}  # and per distinct list of ops (a sweep's steering vector once, not per invoke)
    payloads = []
    for index, inv in enumerate(invokes):
        if not inv.intervened:
            payloads.append(None)
            continue
        program_bytes = key = None
        if inv.program is not None:
            if id(inv.program) not in pickled:
                data = cloudpickle.dumps(inv.program)
                pickled[id(inv.program)] = (data, hashlib.sha256(data).hexdigest()[:16])
            program_bytes, key = pickled[id(inv.program)]
        ops_key = "+".join(op["key"] for op in inv.ops)  # ops are data: equal keys, equal ops
        if ops_key not in pickled_ops:
            pickled_ops[ops_key] = cloudpickle.dumps(inv.ops)
        payloads.append(cloudpickle.dumps({
            "trace": trace_id,
            "invoke": index,
            "program": program_bytes,
            "program_key": key,
            "batched": bool(getattr(inv.program, "__interlace_batched__", False)),
            "ops": pickled_ops[ops_key],
            "ops_key": ops_key,
            "steps": inv.steps,
            "sink": sink,
            "timeout_s": timeout_s,
            "max_save_bytes": max_save_bytes,
        }))
    return payloads


def new_trace_id() -> str:
    return uuid.uuid4().hex[:12]


def check_ops(ops: Iterable[dict], tree) -> None:
    """Refuse ops that name a point the model does not have, before anything is sent."""
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "key" not in op:  # the key batches equal ops
            raise TypeError(f"ops must be made with interlace.ops (save, add, ...), got {op!r}")
        tree.point(op["point"])

