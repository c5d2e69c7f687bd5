"""What an intervention program sees as ``m``.

A program is called once per generation step (``m.step``: 0 is the prompt, then one per generated
token) for one invoke, or, when it is marked batched, once per scheduler step for every invoke of
its trace that runs it (``m.steps[j]``: invoke j's step). The model is a tree that mirrors vLLM's
module tree::

    def program(m):
        h = m.layers[3].resid                     # residual stream after layer 3: [rows, hidden]
        m.layers[3].mlp.down_proj.output *= 0.5   # rewrite a module's output in place
        m.save("h3", m.last(h))                   # last-token row of each invoke
        if m.step == 2:
            m.samples = torch.tensor([42])        # force the token sampled at step 2

Values hold the rows of this call's invokes only, stacked in invoke order (``m.rows[j]`` selects
invoke j's rows). Module accesses must follow the forward order within a step.
"""

from __future__ import annotations

from typing import Any

import torch

from interlace.core.merge import check_merge
from interlace.workers.points import MAILBOX, Point


class Node:
    """A module of the tree: read or write its ``output``, ``input`` or (for layers) ``resid``."""

    __slots__ = ("_view", "_path", "_kids")

    def __init__(self, view: "ProgramView", path: str):
        object.__setattr__(self, "_view", view)
        object.__setattr__(self, "_path", path)
        # Children made so far, by name or index: a view lives for an epoch's steps (ProgramCall.again)
        # and a program walks the same few paths at each, so ``m.layers[3]`` is two lookups.
        object.__setattr__(self, "_kids", {})

    def __getattr__(self, name: str) -> "Node | torch.Tensor":
        """A child module, or a parameter (``weight``, ``bias``) as the unsharded model has it."""
        kid = self._kids.get(name)
        if kid is not None:
            return kid
        if name.startswith("__"):
            raise AttributeError(name)
        if self._view._is_parameter(self._path, name):
            return self._view._parameter(self._path, name)
        kid = self._kids[name] = Node(self._view, self._view._resolve(f"{self._path}.{name}"))
        return kid

    def __getitem__(self, index: int | slice) -> "Node | list[Node]":
        kid = self._kids.get(index) if type(index) is int else None
        if kid is not None:
            return kid
        if isinstance(index, slice):  # ``m.layers[1:3]``: a list of its modules
            return [self[i] for i in range(*index.indices(len(self)))]
        if not isinstance(index, int):
            raise TypeError(f"module lists are indexed by int or slice, not {type(index).__name__}")
        count = len(self)
        at = index + count if index < 0 else index
        if not 0 <= at < count:  # IndexError: what ends ``for layer in m.layers`` too
            raise IndexError(f"module list {self._path!r} has {count} modules; index {index} is out of range")
        kid = self._kids[index] = Node(self._view, self._view._resolve(f"{self._path}.{at}"))
        return kid

    def __iter__(self):
        """``for layer in m.layers``: the modules of a module list, in order."""
        names = self._view._tree.children(self._path)
        if not all(name.isdigit() for name in names):
            raise TypeError(f"module {self._path!r} is not a module list; its children are {names}")
        return (self[i] for i in range(len(names)))

    def __len__(self) -> int:
        return len(self._view._tree.children(self._path))

    def __bool__(self) -> bool:  # a module without children (``o_proj``) is still a module, not an empty list
        return True

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("output", "input", "resid"):
            raise AttributeError(f"cannot set {name!r} on module {self._path!r}; set output, input or resid")
        self._view._write(self._point(name, "." + name), value)

    def _point(self, kind: str, key: str) -> Point:
        """This module's point of ``kind``, kept with its children under ``key`` (".kind": no
        child's name starts with a dot)."""
        point = self._kids.get(key)
        if point is None:
            point = self._kids[key] = self._view._tree.at(self._path, kind)
        return point

    @property
    def output(self) -> Any:
        return self._view._read(self._point("output", ".output"))

    @property
    def input(self) -> Any:
        return self._view._read(self._point("input", ".input"))

    @property
    def resid(self) -> torch.Tensor:
        """The residual stream after this decoder layer (vLLM's ``hidden + residual``)."""
        return self._view._read(self._point("resid", ".resid"))

    def __repr__(self) -> str:
        return f"<module {self._path}>"


class ProgramView:
    """The ``m`` a program receives; built by the interleaver for each call."""

    _NAMED = ("embeddings", "final", "logits", "samples")

    def __init__(self, call_ctx):
        # call_ctx: the interleaver's record of this call (invokes, rows, step, services). Set
        # through __dict__ (this class refuses attributes): one call, made 256 times a step with a
        # program per invoke.
        self.__dict__.update(
            _ctx=call_ctx,
            _tree=call_ctx.tree,
            _current=None,  # the point the program holds right now
            _current_value=None,
            _pending_write=None,  # (point, value) assigned since the last switch
            _call=None,
        )

    def _bind(self, call) -> None:
        """The call this view serves from now on: a new one each step (reused views: see
        ProgramCall.again), or None once the step is over (ProgramCall.release)."""
        held = self.__dict__
        held["_call"] = STEP_OVER if call is None else call
        held["_current"] = held["_current_value"] = held["_pending_write"] = None

    # --- step and batch facts -------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Generation step: 0 is the prompt (all of it), k >= 1 the k-th generated token's step."""
        steps = set(self._ctx.steps)
        if len(steps) > 1:
            raise ValueError(
                f"this batched call covers invokes at generation steps {sorted(steps)} (vLLM admitted "
                "their prompts in different scheduler steps, e.g. more prompt tokens than "
                "max_num_batched_tokens); use m.steps[j] for invoke j's step"
            )
        return self._ctx.steps[0]

    @property
    def steps(self) -> list[int]:
        """Each invoke's generation step (a batched call runs every invoke scheduled in this
        scheduler step; their prompts may have been admitted in different steps)."""
        return self._ctx.steps

    @property
    def n(self) -> int:
        """Invokes in this call (1 unless the program is batched)."""
        return len(self._ctx.invokes)

    @property
    def invokes(self) -> list[int]:
        """Index of each invoke of this call within its trace."""
        return [inv.invoke for inv in self._ctx.invokes]

    @property
    def rows(self) -> list[slice]:
        """``rows[j]``: invoke j's token rows within values read in this call."""
        return self._ctx.local_rows

    @property
    def positions(self) -> list[range]:
        """Sequence positions of each invoke's rows (prompt positions at step 0)."""
        return self._ctx.positions

    @property
    def timeout_s(self) -> float:
        return self._ctx.timeout_s

    def last(self, x: torch.Tensor) -> torch.Tensor:
        """Each invoke's last token row of ``x``: ``[n, ...]``."""
        if x.shape[0] == self._ctx.num_rows:
            if self._ctx.num_rows == self.n:  # one row each (decode steps): already the last rows
                return x
            return x.index_select(0, self._ctx.last_rows.to(x.device))
        if x.shape[0] == self.n:
            return x
        raise ValueError(f"last(): expected {self._ctx.num_rows} token rows or {self.n} invoke rows, got shape {tuple(x.shape)}")

    # --- results ---------------------------------------------------------------------------------

    def save(self, name: str, value: Any) -> None:
        """Keep ``value`` in each invoke's result under ``name`` (a detached copy, moved to CPU).

        In a batched call a tensor is split per invoke by its first dim (token rows or one row
        per invoke). Saving one name at several steps concatenates tensors along dim 0, so a
        residual saved at every step is the whole sequence's residual; other values become a list.
        """
        name = check_name("save", name)
        if isinstance(value, (Node, ProgramView)):
            raise TypeError(_NOT_A_VALUE.format(what="save", value=value))
        if isinstance(value, torch.Tensor):
            check_dense("save", name, value)
        if not self._call.replaying:  # an earlier pipeline stage made this save already
            self._ctx.services.save(self._ctx, name, value)

    def share(self, name: str, value: Any, merge: str = "append") -> None:
        """Contribute to the trace-shared value ``name``; merged across invokes once all reported.

        ``merge``: "append" (a list in invoke order), "sum", "mean", "max", or "concat" / "concat:D".
        """
        name, merge = check_name("share", name), check_merge(merge)
        if isinstance(value, (Node, ProgramView)):
            raise TypeError(_NOT_A_VALUE.format(what="share", value=value))
        if isinstance(value, torch.Tensor):
            check_dense("share", name, value)
        if not self._call.replaying:
            self._ctx.services.share(self._ctx, name, value, merge)

    def send(self, name: str, value: Any) -> None:
        """Publish a value to the other invokes of this trace in this same step (see :meth:`recv`)."""
        self._ctx.services.send(self._ctx, name, value)

    def recv(self, name: str) -> Any:
        """A value another invoke of this trace sends in this step (activation patching).

        Waits until the sender has sent it; fails at the end of the step if nobody did. Values
        read before the wait can be written after it only while the forward pass is still at
        their module (see docs/guide.md, "What a program may do after a wait").
        """
        return self._access(lambda: self._ctx.services.recv(self._ctx, name, self._call), Point(MAILBOX, name))

    # --- the tree --------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._NAMED:
            return self._read(self._tree.point(name))
        node = Node(self, self._resolve(name))
        self.__dict__[name] = node  # found directly from now on (for the view's life: see Node)
        return node

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._NAMED:
            raise AttributeError(f"cannot set {name!r}; settable here: {list(self._NAMED)}")
        self._write(self._tree.point(name), value)

    def where(self) -> str:
        return self._ctx.step_words() + (f", at {self._current}" if self._current else "")

    # --- interleaving (called from the program) ------------------------------------------------------

    def _resolve(self, path: str) -> str:
        return self._tree.resolve(path)

    def _is_parameter(self, path: str, name: str) -> bool:
        return self._ctx.services.is_parameter(path, name)

    def _parameter(self, path: str, name: str) -> torch.Tensor:
        return self._access(lambda: self._ctx.services.parameter(path, name, self._call), Point(path, f"param:{name}"))

    def _access(self, live, what: Point) -> Any:
        """One access of the call (see ProgramCall.access). Under pipeline parallelism, the first
        live one on this stage ends the replay of earlier stages' accesses: from then on, edits to
        the values replayed would be lost, and are refused (see holds.py)."""
        call = self._call
        if not call.replaying:
            return call.access(live, what)
        value = call.access(live, what)
        if not call.replaying:
            self._ctx.holds.replay_ended(what)
        return value

    def _read(self, point: Point) -> Any:
        current = self._current
        if point is current or (current is not None and point == current):
            return self._current_value
        call = self._call
        if call.replaying or call.log is not None:  # pipeline parallelism: replayed, or logged
            value = self._access(lambda: call.wait_at(point), point)
            if call.replaying:  # read live on an earlier pipeline stage
                self._ctx.holds.replayed.append((point, value))
        else:  # one stage: ProgramCall.access reduced to its count (a program per invoke runs this 256 times a step)
            call.accesses += 1
            value = call.wait_at(point)
        object.__setattr__(self, "_current", point)
        object.__setattr__(self, "_current_value", value)
        object.__setattr__(self, "_pending_write", None)
        return value

    def _write(self, point: Point, value: Any) -> None:
        # ``m.x += v`` writes the point it has just read: _read's own first test, spared a call
        current = self._current_value if point is self._current else self._read(point)
        if self._call.replaying:  # made, and written, on an earlier pipeline stage
            return
        self._ctx.holds.refuse_write(point)  # its hook has returned: the write would be lost
        if point.kind == "samples":
            check_forced_tokens(value, self._ctx.services.vocab_size)
        # ``m.x += v`` assigns back the very tensor it read: nothing to check
        object.__setattr__(self, "_pending_write", (point, value if value is current else check_write(point, current, value)))

    def _take_write(self) -> Any:
        write = self._pending_write
        object.__setattr__(self, "_pending_write", None)
        return write


class _StepOver:
    """The call of a view whose step is over: a program that kept ``m`` (in a global, a closure)
    and uses it in a later step or trace gets this error. The AttributeError of a missing call,
    raised in a property such as ``resid``, was taken by Python for a missing attribute and
    answered with the tree's "no module 'resid' under 'layers.0'"."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError("this m is from a step that is over (the program kept it, e.g. in a global or a list); "
                           "use the m the program is called with at each step")


STEP_OVER = _StepOver()


# m and its modules live in the engine: saved, they failed the invoke at its report, unpicklable
_NOT_A_VALUE = ("{what}() takes a value (a tensor, a number, a list...), not {value!r}: {what} what you read "
                "from it, e.g. m.{what}('h', m.layers[1].resid)")


def check_name(what: str, name: Any) -> str:
    """A save's or shared value's name as a plain string; anything but a non-empty string is
    refused: results, the endpoint's answers and a sweep's files are keyed by it (an int name
    passed a local trace, then failed the endpoint's answer or a whole sweep shard, far from the
    program that chose it)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what}() name must be a non-empty string, got {name!r} ({type(name).__name__}); "
                        f"e.g. m.{what}('resid2', value)")
    return str(name)


def check_dense(what: str, name: str, value: torch.Tensor) -> None:
    """Refuse a tensor that a report cannot carry, at the program's line: a sparse, nested,
    quantized or meta tensor went into the save ledger, whose row gathering failed later for the
    whole batch of reports (a sparse one ended the trace's reports on its rank; a meta one made
    every invoke of its trace come back without saves)."""
    if value.is_meta:
        raise ValueError(f"{what}({name!r}): a tensor on the meta device has no values to {what}")
    if value.layout is not torch.strided or value.is_nested:
        kind = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        dense = "value.to_padded_tensor(0)" if value.is_nested else "value.to_dense()"
        raise TypeError(f"{what}({name!r}) takes dense tensors, got a {kind} tensor; {what} {dense} instead")
    if value.is_quantized:
        raise TypeError(f"{what}({name!r}) takes unquantized tensors, got {value.dtype}; {what} value.dequantize()")


def check_forced_tokens(value: Any, vocab_size: int) -> None:
    """Refuse forced token ids outside the vocabulary, here in the program where the value is on
    the host (free to check); values on the device, and in-place edits of ``m.samples``, are
    checked once the program is done with the step's samples (Interleaver.check_samples)."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.is_floating_point() or not value.numel():
        return
    low, high = int(value.min()), int(value.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"write to samples: token id {low if low < 0 else high} is outside the vocabulary "
            f"(valid ids are 0 to {vocab_size - 1}); force an id in range(vocab size)"
        )


def check_write(point: Point, current: Any, value: Any) -> Any:
    """Refuse a write whose structure, shape or dtype kind cannot replace ``current``."""
    if isinstance(current, tuple):
        if not isinstance(value, tuple) or len(value) != len(current):
            raise TypeError(f"write to {point}: expected a tuple of {len(current)} like the module's output, got {type(value).__name__}")
        return tuple(check_write(point, c, v) for c, v in zip(current, value))
    if not isinstance(current, torch.Tensor):
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"write to {point}: expected a tensor of shape {tuple(current.shape)}, got {type(value).__name__}")
    if value.shape != current.shape:
        raise ValueError(
            f"write to {point}: shape {tuple(value.shape)} does not match the point's shape "
            f"{tuple(current.shape)}; write a tensor of exactly that shape (index rows with m.rows)"
        )
    if value.dtype.is_floating_point != current.dtype.is_floating_point or value.is_complex():
        raise TypeError(
            f"write to {point}: dtype {value.dtype} cannot replace {current.dtype}; "
            f"convert with .to({current.dtype})"
        )
    return value.to(device=current.device, dtype=current.dtype)
