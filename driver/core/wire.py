"""The wire contract: the messages that cross process boundaries, typed, in one module.

The driver encodes an :class:`InvokePayload` per intervened invoke; workers read it as a plain
dict (code inside a vLLM rank keeps its own dict reader: :meth:`InvokePayload.to_worker` and
:meth:`Report.from_worker` are the one place the two meet). Workers report a :class:`Report` per
invoke and pipeline stage, with an :class:`ErrorRecord` when a program or op failed. Replicas
return a :class:`Completion` per invoke. This module imports nothing else of interlace, so the
local engine, the Ray cluster and (later) an HTTP front end all read the same types.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable


@dataclass(frozen=True)
class InvokePayload:
    """What one intervened invoke's request carries to every worker rank."""

    trace: str  # the id the workers know the trace by (its report folder, gang, batched groups)
    invoke: int  # the invoke's index in the user's trace (reports carry it back)
    program: bytes | None  # the program, cloudpickled; None: ops only
    program_key: str | None  # hash of ``program``: equal programs are loaded once per rank, then copied per invoke
    batched: bool  # the program is @interlace.batched
    ops: bytes  # the invoke's ops list, cloudpickled
    ops_key: str  # equal keys, equal ops: unpickled once per rank
    steps: list[int] | None  # program steps to run; None: every step
    sink: str  # where reports go ("dir:/path", on the node of the engine)
    timeout_s: float  # the trace's time limit for programs
    max_save_bytes: int  # the most the invoke may save

    def to_worker(self, **changes: Any) -> dict[str, Any]:
        """The dict the worker ranks read (workers/interleaver.py), with ``changes`` applied.
        Shallow: every field is plain data already (``asdict``'s deep copy cost a 256-invoke
        trace a few milliseconds on the driver)."""
        return {**self.__dict__, **changes}


@dataclass(frozen=True)
class ErrorRecord:
    """A failure inside a worker, picklable, with the user's traceback."""

    type: str  # the exception's class name
    where: str  # "step 3, layers.1.resid"...
    message: str
    traceback: str

    @classmethod
    def from_worker(cls, record: dict | None) -> "ErrorRecord | None":
        return None if record is None else cls(record["type"], record["where"], record["message"], record["traceback"])

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


Shared = tuple[str, str, Any]  # (name, merge, value): one contribution to a trace-shared value


# dtypes torch's own pickling reads back; others (uint16, uint32, uint64, complex32, float8 and
# float4 kinds) failed to unpickle ("UntypedStorage has no attribute 'dtype'", torch 2.13)
_PICKLED_BY_TORCH = frozenset({"torch.float64", "torch.float32", "torch.float16", "torch.bfloat16", "torch.int64",
                               "torch.int32", "torch.int16", "torch.int8", "torch.uint8", "torch.bool",
                               "torch.complex64", "torch.complex128"})


def portable(value: Any) -> Any:
    """``value`` as it may be pickled to another process: tensors in it (in dicts, lists and
    tuples) where torch's own pickling could not read them back become :class:`RawTensor`."""
    if type(value) in (dict, list, tuple):
        items = value.items() if type(value) is dict else enumerate(value)
        if not any(type(v) in (dict, list, tuple) or _unpicklable(v) for _k, v in items):
            return value
        if type(value) is dict:
            return {k: portable(v) for k, v in value.items()}
        return type(value)(portable(v) for v in value)
    return RawTensor(value) if _unpicklable(value) else value


def _unpicklable(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and type(value).__module__.startswith("torch") and str(dtype) not in _PICKLED_BY_TORCH


class RawTensor:
    """A tensor that pickles as its raw bytes and unpickles as a plain tensor (see :func:`portable`):
    saves and shared values cross Ray between a replica and the driver or Serve's ingress."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: Any):
        self.tensor = tensor

    def __reduce__(self):
        import torch

        t = self.tensor.detach().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return tensor_of_bytes, (str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)


def tensor_of_bytes(dtype: str, shape: tuple, raw: bytes) -> Any:
    """The tensor a :class:`RawTensor` pickled."""
    import torch

    kind = getattr(torch, dtype)
    if not raw:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind).view(shape)


@dataclass
class Report:
    """One invoke's outcome on one pipeline stage: saves, shared contributions, error."""

    trace: str  # the user's trace id
    invoke: int
    stage: int  # pipeline stage (0 with no pipeline parallelism)
    attempt: int  # which run of the invoke's shard (a retried shard's reports have a higher one)
    saves: Any  # {name: value}; on a cluster, a SavesRef until the driver fetches it
    shared: list[Shared] = field(default_factory=list)
    error: ErrorRecord | None = None
    printed: list[tuple[int, str]] = field(default_factory=list)  # (step, text) its program printed on this stage

    @property
    def key(self) -> tuple[int, int]:
        return self.invoke, self.stage

    @classmethod
    def from_worker(cls, report: dict, trace: str | None = None, attempt: int = 0) -> "Report":
        """A worker's report dict (workers/reports.py ``_report_of``) as a typed report;
        ``trace`` renames it (a cluster shard's workers know it by the shard's own id)."""
        return cls(trace or report["trace"], report["invoke"], report["stage"], attempt, report["saves"],
                   [tuple(s) for s in report["shared"]], ErrorRecord.from_worker(report["error"]),
                   [tuple(p) for p in report.get("printed", ())])


def printed_text(reports: Iterable["Report"]) -> str:
    """What an invoke's program printed, from its reports (one per pipeline stage): step by step,
    each step's text in stage order, which is the program's own order (a stage's pieces of one
    step keep theirs: the sort is stable)."""
    pieces = sorted(((step, report.stage, text) for report in reports for step, text in report.printed),
                    key=lambda piece: piece[:2])
    return "".join(text for _step, _stage, text in pieces)


@dataclass(frozen=True)
class SavesRef:
    """Where a cluster report's saves wait: entry ``index`` of the Ray object ``ref``. A replica
    puts all of a shard's saves as one object, so a trace costs one put and one fetch per shard,
    not per invoke."""

    ref: Any  # ray.ObjectRef of a list of {name: value}
    index: int


@dataclass(frozen=True)
class SavesOnNode:
    """Where a cluster report's saves wait when the driver runs on the replica's node: the shard's
    report folder there. The driver maps the files (no copy, as ``interlace.Model`` does) and
    removes the folder; chosen at run time, per shard (nodes share no file system)."""

    folder: str
    invoke: int
    stage: int


@dataclass(frozen=True)
class Completion:
    """One invoke's generated tokens, as a replica returns them."""

    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None  # of each generated token; None unless asked for

    @classmethod
    def from_vllm(cls, output) -> "Completion":
        """From a ``vllm.RequestOutput``."""
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)]
        return cls(list(completion.token_ids), completion.text, logprobs)


@dataclass(frozen=True)
class EngineDeath:
    """A replica's engine died while it ran a shard: what ``Replica.run`` returns instead of the
    shard's completions (the replica's process then ends, and Ray restarts it). ``culprit`` names
    the trace whose own program ended the engine, read from the dead ranks' flight records
    (workers/flight.py); None: nothing pins the death on a program (the engine's own failure, the
    system killing a process...)."""

    replica: int  # the replica's index
    culprit: str | None  # the user's trace id whose program ended the engine; None: not attributable
    invoke: int | None = None  # the culprit's invoke whose program it was
    cause: str | None = None  # "time_limit": it did not stop at its limit; "exited": it ended the process
    message: str = ""  # for the culprit's error: what its program did; else what is known (reports stopped)

    def blames(self, trace: str) -> bool:
        return self.culprit == trace


@dataclass
class ShardTask:
    """Part of a trace (or all of it) for one replica to run: the invokes that stay together."""

    trace: str  # the user's trace id
    shard: int  # which part of the trace
    attempt: int  # 0, then 1, 2... for each re-run after a replica died
    prompts: list[Any]  # each invoke's prompt (text or token ids), in invoke order
    payloads: list[InvokePayload | None]  # each invoke's payload (its ``invoke`` is the trace index)
    settings: dict[str, Any]  # SamplingParams fields shared by the trace's invokes
    stages: int = 1  # pipeline stages: each intervened invoke reports once per stage
    driver_node: str | None = None  # the Ray node of the driver: saves stay in files when it is the replica's

    @property
    def wire_trace(self) -> str:
        """The id the workers know this attempt by: unique, so a re-run never meets an old one's state."""
        return f"{self.trace}.{self.shard}.{self.attempt}"

    @staticmethod
    def trace_of(wire_trace: str) -> str:
        """The user's trace id in a :attr:`wire_trace` (the workers know no other)."""
        return wire_trace.rsplit(".", 2)[0]

    def expected(self) -> list[tuple[int, int]]:
        """The (invoke, stage) reports this shard owes the collector."""
        return [(p.invoke, s) for p in self.payloads if p is not None for s in range(self.stages)]
