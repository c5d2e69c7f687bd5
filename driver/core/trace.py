"""Traces: one or more invokes (prompts, each with a program and/or ops) run together.

A trace is built on the driver, validated, and turned into one vLLM request per invoke. Programs
travel by value (cloudpickle) in ``SamplingParams.extra_args``, so closures, lambdas and captured
tensors work from scripts and notebooks alike.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import io
import operator
import pickle
import sys
import sysconfig
import threading
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import cloudpickle

from interlace.core.wire import InvokePayload



def batched(program: Callable) -> Callable:
    """Mark a program as written for a batch of invokes.

    The invokes of a trace that share a batched program run it once per step over all of their
    rows (``m.rows[j]`` is invoke j's rows, ``m.last(x)`` each invoke's last row), instead of once
    per invoke. Saves and shared contributions are still split per invoke.

        >>> @interlace.batched
        ... def keep_last(m):
        ...     m.save("h", m.last(m.layers[2].resid))
    """
    if not callable(program):
        raise TypeError(f"interlace.batched marks a program, a function of m; got {program!r}")
    try:
        program.__interlace_batched__ = True
    except AttributeError:  # it keeps no attributes of its own: the mark would be lost
        raise TypeError(f"interlace.batched cannot mark {program!r} (a bound method or a builtin keeps no attributes "
                        "of its own); mark a function that calls it: interlace.batched(lambda m: obj.method(m))") from None
    return program


def check_programless(steps: Any, batched: bool = False) -> None:
    """Refuse program settings given to an invoke without a program (they would be silently
    ignored: ops run at every step whatever the invoke's ``steps`` say).

        >>> check_programless(steps=[0])
        Traceback (most recent call last):
        ValueError: steps=[0] selects the steps a program runs at, and this invoke has no program; an op takes steps of its own (interlace.ops.save(point, steps=[0]))
    """
    if steps is not None:
        raise ValueError(f"steps={list(steps)} selects the steps a program runs at, and this invoke has no program; "
                         f"an op takes steps of its own (interlace.ops.save(point, steps={list(steps)}))")
    if batched:
        raise ValueError("batched marks a program as @interlace.batched, and this invoke has no program")


def check_program(program: Any) -> None:
    """Refuse, on the driver, a program the engine would run without ever doing its work: a
    generator or ``async`` function (calling it only builds the generator or coroutine, so the
    invoke would succeed having done nothing), or one that cannot be called with the view ``m``
    alone (it would fail on the engine at its first step, after the trace was sent).

        >>> check_program(lambda m: None)
        >>> check_program(lambda: None)
        Traceback (most recent call last):
        TypeError: program <lambda>() cannot be called with one argument, the model view m, as the engine calls it at every step: define it as `def program(m): ...`
    """
    if not callable(program):
        raise TypeError(f"program must be a function taking the model view m, got {program!r}")
    target = getattr(program, "__call__", None) if not inspect.isroutine(program) and not inspect.isclass(program) else program
    if inspect.isgeneratorfunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError(f"program {_name(program)} is a generator function: calling it only builds a generator, "
                        "so none of its code would run. Programs are plain functions (no `yield`); the engine "
                        "calls them at every step, in forward order")
    if inspect.iscoroutinefunction(target):
        raise TypeError(f"program {_name(program)} is an async function: calling it only builds a coroutine, so "
                        "none of its code would run. Programs are plain functions (no `async`/`await`); a point's "
                        "value is there when the program reads it")
    try:
        signature = inspect.signature(program)
    except (TypeError, ValueError):  # a builtin or extension callable without one: let the engine try
        return
    try:
        signature.bind(None)
    except TypeError:
        raise TypeError(f"program {_name(program)}{signature} cannot be called with one argument, the model "
                        "view m, as the engine calls it at every step: define it as `def program(m): ...`") from None


def op_list(ops: Any) -> list[dict]:
    """An invoke's ops as a list; None is none, as for ``program``. One op not in a list is refused
    saying so: as a list, a dict is its keys, which were refused as "not made with interlace.ops".

        >>> op_list(None)
        []
        >>> op_list({"op": "save", "point": "logits", "key": "k"})
        Traceback (most recent call last):
        TypeError: ops takes a list of ops, got one op (save at logits): pass ops=[...]
    """
    if ops is None:
        return []
    if isinstance(ops, dict):
        raise TypeError(f"ops takes a list of ops, got one op ({ops.get('op')} at {ops.get('point')}): pass ops=[...]")
    if isinstance(ops, (str, bytes)) or not isinstance(ops, Iterable):
        raise TypeError(f"ops takes a list of ops made with interlace.ops (save, add, ...), got {ops!r}")
    return list(ops)


def prompt_of(prompt: Any) -> str | list[int]:
    """A prompt as the engine takes it: text, or token ids as a list of ints. Ids may be any
    integers (numpy's too) in a list or tuple, or a 1-D integer numpy array or torch tensor
    (one row of a tokenizer's ``return_tensors`` output); anything else is refused here, not by
    the engine after the trace was sent.

        >>> prompt_of((5, 6, 7))
        [5, 6, 7]
        >>> prompt_of([[5, 6, 7]])
        Traceback (most recent call last):
        TypeError: prompt must be text or token ids (a list of ints, or a 1-D integer array or tensor), got list [[5, 6, 7]]
    """
    if isinstance(prompt, str):
        return prompt
    shape = getattr(prompt, "shape", None)
    if shape is not None and len(shape) == 1 and hasattr(prompt, "tolist"):  # numpy, torch
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        try:
            if not any(type(t) is bool for t in prompt):  # (a bool is an int; no token id is one)
                return [operator.index(t) for t in prompt]
        except TypeError:
            pass
    shown = f" of shape {tuple(shape)}" if shape is not None else f" {prompt!r}"[:80]
    raise TypeError("prompt must be text or token ids (a list of ints, or a 1-D integer array or tensor), got "
                    f"{type(prompt).__name__}{shown}")


def _name(program: Any) -> str:
    return getattr(program, "__qualname__", None) or type(program).__qualname__


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
    printed: str = ""  # what its program printed (stdout and stderr), step by step; the driver prints it too

    def __post_init__(self):
        self.saves = Saves(self.saves)


class Saves(dict):
    """An invoke's saves by name; a name never saved is a KeyError that lists the names saved."""

    def __missing__(self, name: str) -> Any:
        raise KeyError(
            f"no save named {name!r}; this invoke saved {sorted(self)}. A save the program makes "
            "only under a condition (e.g. `if m.step == 50:`) is missing when the condition never "
            "held: steps run from 0 to max_tokens - 1, and generation may stop earlier (EOS, stop)"
        )


@dataclass
class TraceResult:
    """Per invoke results (indexable) plus the trace's merged shared values."""

    invokes: list[InvokeResult]
    shared: dict[str, Any]

    def __getitem__(self, index: int) -> InvokeResult:
        return self.invokes[index]

    def __len__(self) -> int:
        return len(self.invokes)


def echo_printed(result: "TraceResult | None") -> None:
    """Print what the trace's programs printed, invoke by invoke, here on the driver: they ran in
    an engine's process, maybe on another machine (workers/printed.py keeps their output)."""
    if result is None:
        return
    for invoke in result.invokes:
        if invoke.printed:
            sys.stdout.write(invoke.printed)
    sys.stdout.flush()


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


class ProgramEndedEngine(WorkerDied):
    """A trace's own program ended the engine it ran on: it would not stop at the trace's time
    limit (interlace's watchdog ended the process) or it ended the process itself (``os._exit``,
    a crash). On a cluster the trace is not run again (it would end the next engine too); the
    other traces that shared the engine are. ``invoke``: whose program; ``cause``: "time_limit"
    or "exited"."""

    def __init__(self, message: str, invoke: int | None = None, cause: str | None = None):
        super().__init__(message)
        self.invoke, self.cause = invoke, cause

    def __reduce__(self):
        return type(self), (str(self), self.invoke, self.cause)


_BY_VALUE = threading.Lock()
_INSTALLED = tuple(str(Path(p).resolve()) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")})


@contextlib.contextmanager
def programs_by_value(programs: Iterable[Callable | None]):
    """Pickle the programs' own modules by value while encoding: an engine's ranks under Ray's
    executor, a replica's processes and a server cannot import a user's script or test module
    (installed packages, interlace included, stay by reference: every node has them)."""
    modules = set()
    # each module once: resolving its path for every invoke cost a 256-invoke trace 4 ms
    names = {getattr(program, "__module__", None) or "" for program in programs}
    for module in filter(None, map(sys.modules.get, names)):
        path = getattr(module, "__file__", None)
        if path and module.__name__ != "__main__" and not module.__name__.startswith("interlace") \
                and not str(Path(path).resolve()).startswith(_INSTALLED):
            modules.add(module)
    with _BY_VALUE:
        modules -= {m for m in modules if m.__name__ in cloudpickle.list_registry_pickle_by_value()}  # the caller's own
        for module in modules:
            cloudpickle.register_pickle_by_value(module)
        try:
            yield
        finally:
            for module in modules:
                cloudpickle.unregister_pickle_by_value(module)


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, and modules of a ``types.ModuleType`` subclass by name: torch makes
    ``torch.backends.cudnn`` and ``torch.backends.mkldnn`` such objects, which cloudpickle's table
    of modules misses (keyed by the exact type), so a program pickled by value that used
    ``torch.backends.cudnn`` could not be sent ("cannot pickle 'CudnnModule' object")."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType \
                and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps`` for programs and what carries them (see :class:`_Pickler`)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _program_bytes(program: Any, index: int) -> bytes:
    """The program's pickle, or a refusal that says what travels and what cannot (pickle's own
    error, e.g. "cannot pickle '_thread.lock' object", named neither the invoke nor the program)."""
    try:
        return dumps(program)
    except Exception as exc:  # noqa: BLE001 - pickling runs user objects' code: any error may come out
        raise TypeError(f"invoke {index}'s program {_name(program)} cannot be sent to the workers: pickling it, or "
                        f"something it references, failed ({type(exc).__name__}: {exc}). Programs travel by value "
                        "(cloudpickle): keep locks, open files, sockets, models and clients out of what they "
                        "reference, or make them inside the program") from exc


def encode_payloads(invokes: list[Invoke], trace_id: str, sink: str, timeout_s: float,
                    max_save_bytes: int) -> list[InvokePayload | None]:
    """What each intervened invoke's request carries to the workers (None: plain request);
    ``payload_bytes`` turns one into the bytes its request holds."""
    pickled: dict[int, tuple[bytes, str]] = {}  # one pickle per distinct program object
    pickled_ops: dict[str, bytes] = {}  # and per distinct list of ops (a sweep's steering vector once, not per invoke)
    payloads: list[InvokePayload | None] = []
    with programs_by_value(inv.program for inv in invokes):
        for index, inv in enumerate(invokes):
            if not inv.intervened:
                payloads.append(None)
                continue
            program_bytes = key = None
            if inv.program is not None:
                if id(inv.program) not in pickled:
                    data = _program_bytes(inv.program, index)
                    pickled[id(inv.program)] = (data, hashlib.sha256(data).hexdigest()[:16])
                program_bytes, key = pickled[id(inv.program)]
            ops_key = "+".join(op["key"] for op in inv.ops)  # ops are data: equal keys, equal ops
            if ops_key not in pickled_ops:
                pickled_ops[ops_key] = cloudpickle.dumps(inv.ops)
            payloads.append(InvokePayload(
                trace=trace_id, invoke=index, program=program_bytes, program_key=key,
                batched=bool(getattr(inv.program, "__interlace_batched__", False)),
                ops=pickled_ops[ops_key], ops_key=ops_key, steps=inv.steps, sink=sink,
                timeout_s=timeout_s, max_save_bytes=max_save_bytes))
    return payloads


def payload_bytes(payload: InvokePayload, **changes: Any) -> bytes:
    """The bytes an intervened request carries in ``extra_args`` (read by workers/interleaver.py),
    with ``changes`` to the payload's fields. Plain pickle: the payload is plain data (the
    program and ops inside are cloudpickled bytes already), and cloudpickle's pure-Python pickler
    is several times slower on it."""
    return pickle.dumps(payload.to_worker(**changes), protocol=pickle.HIGHEST_PROTOCOL)


def new_trace_id() -> str:
    return uuid.uuid4().hex[:12]


def check_trace(invokes: list[Invoke], settings: dict, tree) -> None:
    """Every check a target makes before it sends a trace anywhere (``Model`` and ``Cluster``
    both call this, so a trace one refuses the other refuses too)."""
    if not invokes:
        raise ValueError("the trace has no invokes; add one with tr.invoke(prompt, ...)")
    if settings.get("n", 1) != 1:  # vLLM would return n sequences where a result holds one
        raise ValueError(f"n={settings['n']}: each invoke generates one sequence, with its own result; for several "
                         "samples of one prompt, invoke it several times (with a temperature each samples its own)")
    max_tokens = settings.get("max_tokens")
    for inv in invokes:
        check_ops(inv.ops, tree, max_tokens)
        if inv.steps is not None and not len(inv.steps):  # the program would silently never run
            raise ValueError("program steps=[]: the program would never run; pass steps=None (every step) or the "
                             "steps to run at")
        never = _never_run(inv.steps or (), max_tokens)
        if never:  # the program would silently never run at them
            raise ValueError(f"program steps {never} never run in a trace with max_tokens={max_tokens} "
                             f"(steps 0-{max_tokens - 1}; 0 is the prompt); raise max_tokens or select steps that run")


def check_ops(ops: Iterable[dict], tree, max_tokens: int | None = None) -> None:
    """Refuse, before anything is sent, ops that name a point the model does not have (or one an
    op cannot act on), saves of two points under one name, or steps that never run: a trace of
    ``max_tokens`` runs steps 0 to ``max_tokens - 1``. (Positions past the generation are found by
    the workers.)"""
    saved: dict[str, tuple] = {}  # save name -> (its point, as written)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "key" not in op:  # the key batches equal ops
            raise TypeError(f"ops must be made with interlace.ops (save, add, ...), got {op!r}")
        point = tree.op_point(op["point"])
        if op["op"] == "save":
            first = saved.setdefault(op["name"], (point, op["point"]))
            if first[0] != point:  # their rows would be concatenated under one name, indistinguishable
                raise ValueError(f"two saves name {op['name']!r}: {first[1]} and {op['point']}; give each point its "
                                 "own name (one point saved at several steps may share one)")
        if op.get("steps") is not None and not len(op["steps"]):  # (the workers would find it selected nothing)
            raise ValueError(f"op {op['op']} at {op['point']}: steps=[] never runs; pass steps=None (every step) "
                             "or the steps to act at")
        never = _never_run(op.get("steps") or (), max_tokens)
        if never:
            raise ValueError(
                f"op {op['op']} at {op['point']}: steps {never} never run in a trace with "
                f"max_tokens={max_tokens} (steps 0-{max_tokens - 1}; 0 is the prompt); raise max_tokens "
                "or select steps that run"
            )


def _never_run(steps: Iterable[int], max_tokens: int | None) -> list:
    """The steps of ``steps`` that a trace of ``max_tokens`` never runs (it runs 0 to max_tokens - 1)."""
    return [s for s in steps if max_tokens is not None and not 0 <= s < max_tokens]
