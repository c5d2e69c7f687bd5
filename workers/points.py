"""Points: the places in a forward pass a program can read or write.

A point is a module of vLLM's tree plus what to take from it. Module paths are written as users
think of them (``layers.3.mlp.down_proj``); they resolve under the causal-LM wrapper first and then
under its inner ``model``, so ``layers.3`` and ``model.layers.3`` name the same module.

Kinds:
    output   the module's output (a tuple stays a tuple)
    input    the module's first positional input
    resid    the residual stream after a decoder layer: vLLM's layers return ``(hidden, residual)``
             and the stream is their sum; reading ``hidden`` alone is the classic silent error
    final    the final norm's output (normalised hidden states)
    logits   pre-sampling logits, one row per request sampled this step
    samples  sampled token ids, one per request; writing one forces that token
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from interlace.workers.layout import BatchLayout

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.\d+$")  # a decoder layer's qualified name
MAILBOX = "@mailbox"  # pseudo-module of the points receivers wait at: Point(MAILBOX, name)
TOKEN_KINDS = ("output", "input", "resid", "final")
ROW_PER_REQUEST_KINDS = ("logits", "samples")
KINDS = TOKEN_KINDS + ROW_PER_REQUEST_KINDS


@dataclass(frozen=True)
class Point:
    module: str  # qualified name in the vLLM model ("model.layers.3"); "" for logits/samples
    kind: str

    def __str__(self) -> str:
        if self.kind in ROW_PER_REQUEST_KINDS:
            return self.kind
        return f"{short_name(self.module)}.{self.kind}"


def short_name(module: str) -> str:
    """A module path as users write it (without the leading "model.")."""
    return module[len("model.") :] if module.startswith("model.") else module


class ModuleTree:
    """Name resolution over a model's module names (the live model in a worker, or the names a
    driver fetched from the engine to check declarative ops before sending them)."""

    def __init__(self, model: nn.Module | None = None, names: list[str] | None = None):
        """``model``: this rank's live model; ``names``: every module name of the whole model
        (all pipeline stages). Modules another stage runs map to None, as do all with no model."""
        self.modules: dict[str, nn.Module | None] = dict.fromkeys(names or [])
        for name, module in model.named_modules() if model is not None else ():
            # PPMissingLayer stands in for a module another pipeline stage runs
            self.modules[name] = None if type(module).__name__ == "PPMissingLayer" else module
        self.local = {name for name, module in self.modules.items() if module is not None}
        self._resolved: dict[str, str] = {}
        self._points: dict[tuple[str, str], Point] = {}
        self._children: dict[str, tuple[str, ...]] = {}
        self.final_norm = "model.norm" if "model.norm" in self.modules else None
        self.embeddings = next(
            (n for n in ("model.embed_tokens", "model.embed_in", "model.wte") if n in self.modules), None
        )

    def resolve(self, path: str) -> str:
        """Qualified module name for a user path; raises with the valid children on a typo."""
        found = self._resolved.get(path)  # programs resolve the same few paths at every step
        if found is None:
            found = self._resolved[path] = self._resolve(path)
        return found

    def at(self, module: str, kind: str) -> Point:
        """``Point(module, kind)``, one object per point: a program makes the same few at every
        step, and the view compares the one it reads with the one it holds by identity first."""
        key = (module, kind)
        found = self._points.get(key)
        if found is None:
            found = self._points[key] = Point(module, kind)
        return found

    def _resolve(self, path: str) -> str:
        path = path.strip(".")
        for candidate in (path, f"model.{path}"):
            if candidate in self.modules:
                return candidate
        parent, _, leaf = path.rpartition(".")
        for base in (parent, f"model.{parent}" if parent else "model"):
            if base in self.modules:
                children = self.children(base)
                raise AttributeError(
                    f"no module {leaf!r} under {short_name(base) or 'the model'!r} (path {path!r}); "
                    f"its children are {children}"
                )
        raise AttributeError(f"no module {path!r} in the model; top-level modules: {self.top_level()}")

    def top_level(self) -> list[str]:
        return self.children("model")

    def children(self, qualified: str) -> list[str]:
        """The names of a module's children, in order. Kept once found: a program's
        ``m.layers[3]`` asks for the count of ``layers`` in every new view (one per call per
        epoch), and a pass over every module name took a tenth of the time per-invoke steering
        programs' worker greenlets ran on an H100 host (py-spy, 2026-12-06)."""
        found = self._children.get(qualified)
        if found is None:
            prefix = f"{qualified}." if qualified else ""
            seen: dict[str, None] = {}
            for name in self.modules:
                if name.startswith(prefix) and name != qualified:
                    seen.setdefault(name[len(prefix) :].split(".")[0])
            found = self._children[qualified] = tuple(seen)
        return list(found)

    def point(self, spec: str) -> Point:
        """Parse ``"layers.3.resid"``, ``"layers.3.mlp.output"``, ``"logits"``, ``"embeddings"``..."""
        if spec in ROW_PER_REQUEST_KINDS:
            return Point("", spec)
        if spec == "embeddings":
            return Point(self._need(self.embeddings, spec), "output")
        if spec == "final":
            return Point(self._need(self.final_norm, spec), "final")
        path, _, kind = spec.rpartition(".")
        if kind not in TOKEN_KINDS or not path:
            raise ValueError(
                f"point {spec!r} must end in one of {list(TOKEN_KINDS)} (e.g. 'layers.3.resid', "
                f"'layers.3.mlp.down_proj.output') or be one of {['embeddings', 'final', *ROW_PER_REQUEST_KINDS]}"
            )
        return Point(self.resolve(path), kind)

    def op_point(self, spec: str) -> Point:
        """A declarative op's point: as :meth:`point`, refusing a decoder layer's ``output`` (an
        op acts on one tensor and could only guess which of (hidden, residual) is meant) and
        ``resid`` on a module that is not a decoder layer."""
        point = self.point(spec)
        layer = self.is_layer(point.module)
        if point.kind == "output" and layer:
            raise ValueError(
                f"ops cannot act on {spec!r}: vLLM's decoder layers return (hidden, residual) and the "
                f"residual stream is their sum, so either alone is the classic silent error; write "
                f"'{short_name(point.module)}.resid' (a program can read the pair as m.layers[i].output)"
            )
        if point.kind == "resid" and not layer:
            raise ValueError(f"'resid' is defined on decoder layers (e.g. 'layers.1.resid'), not on {short_name(point.module)!r}")
        return point

    def is_layer(self, module: str) -> bool:
        """Whether ``module`` is a decoder layer (``model.layers.3``), whose output is (hidden, residual)."""
        return _LAYER.search(module) is not None

    def _need(self, name: str | None, spec: str) -> str:
        if name is None:
            raise AttributeError(f"this model has no {spec!r} module")
        return name


# --- reading and writing rows of a module's output -------------------------------------------


def token_dim(t: torch.Tensor, num_tokens: int) -> int | None:
    """Which dim of ``t`` runs over the flat token batch: 0 for vLLM's ``[tokens, ...]`` layout,
    1 for Transformers-backend models' ``[1, tokens, ...]``, None when ``t`` is not per-token."""
    if t.dim() >= 1 and t.shape[0] >= num_tokens > 0:
        return 0
    if t.dim() >= 2 and t.shape[0] == 1 and t.shape[1] >= num_tokens > 0:
        return 1
    return None


def device_index(index: torch.Tensor, device) -> torch.Tensor:
    """Move a host index to ``device`` without stalling: a plain host-to-device copy from pageable
    memory waits for the GPU to drain, which would serialise every step with the CPU."""
    if torch.device(device).type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The rows of ranges ``starts[i] : starts[i] + lengths[i]``, concatenated (no Python loop)."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)


class Rows:
    """A selection of rows (contiguous when possible, so reads are views and cost nothing)."""

    def __init__(self, index: torch.Tensor | slice):
        self.index = index

    @classmethod
    def of(cls, starts: np.ndarray, stops: np.ndarray, device) -> "Rows":
        """Rows ``starts[i]:stops[i]`` for each i, in that order."""
        if len(starts) == 1 or np.array_equal(starts[1:], stops[:-1]):
            return cls(slice(int(starts[0]), int(stops[-1])))
        return cls(device_index(torch.from_numpy(expand_ranges(starts, stops - starts)), device))

    @classmethod
    def at(cls, rows: np.ndarray, device) -> "Rows":
        """Given rows; a contiguous run stays a slice (a view, no index tensor at all)."""
        if len(rows) and np.all(np.diff(rows) == 1):
            return cls(slice(int(rows[0]), int(rows[-1]) + 1))
        return cls(device_index(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)), device))

    def take(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if isinstance(self.index, slice):
            return t[self.index] if dim == 0 else t[:, self.index]
        with torch.inference_mode(False):  # a normal tensor: its version counter shows edits
            return t.index_select(dim, self.index)

    def put(self, t: torch.Tensor, dim: int, value: torch.Tensor) -> None:
        if dim == 0:
            t[self.index] = value
        else:
            t[:, self.index] = value


# --- the value a hook received, read and written by rows, for every kind ---------------------


class PointAccess:
    """Row-wise reads and writes of the value a hook received, for every point kind."""

    def __init__(self, hooked: Any, layout: BatchLayout):
        self.hooked = hooked
        self.layout = layout
        self.device = first_tensor(hooked).device if first_tensor(hooked) is not None else "cpu"

    def _base(self, kind: str):
        h = self.hooked
        if kind == "input":
            return h[0]
        if kind == "resid":
            if not (isinstance(h, tuple) and len(h) == 2 and all(isinstance(t, torch.Tensor) for t in h)):
                raise TypeError("resid is defined on decoder layers, whose output is (hidden, residual)")
            return h
        if kind == "final":
            return h[0] if isinstance(h, tuple) else h
        if kind == "samples":
            return h.sampled_token_ids[:, 0]
        return h

    def read(self, point: Point, rows: Rows) -> Any:
        base = self._base(point.kind)
        if point.kind == "resid":
            hidden, residual = base
            with torch.inference_mode(False):  # a normal tensor: its version counter shows edits
                return rows.take(hidden, 0) + rows.take(residual, 0)
        return _map(base, lambda t, d: rows.take(t, d), self.layout.num_tokens, point.kind)

    def write(self, point: Point, rows: Rows, value: Any) -> None:
        base = self._base(point.kind)
        if point.kind == "resid":  # put the whole stream in hidden and zero residual: exact sum
            hidden, residual = base
            rows.put(hidden, 0, value)
            rows.put(residual, 0, torch.zeros_like(value))
            return
        if isinstance(base, tuple):
            for t, v in zip(base, value):
                d = _dim(t, self.layout.num_tokens, point.kind)
                if d is not None and v is not None:
                    rows.put(t, d, v)
            return
        rows.put(base, _dim(base, self.layout.num_tokens, point.kind) or 0, value)

    def read_tensor(self, point: Point, rows: Rows) -> torch.Tensor:
        """The one tensor a declarative op acts on: the point's value, or the first element of a
        module's tuple output (vLLM's linear layers return ``(out, bias)``, its norms
        ``(normed, residual)``; decoder layers' ``(hidden, residual)`` are refused by ``op_point``)."""
        if point.kind != "output" or not isinstance(self.hooked, tuple):
            return self.read(point, rows)
        return _map(self.hooked[0], lambda t, d: rows.take(t, d), self.layout.num_tokens, point.kind)

    def write_tensor(self, point: Point, rows: Rows, value: torch.Tensor) -> None:
        """Write what :meth:`read_tensor` read."""
        if point.kind != "output" or not isinstance(self.hooked, tuple):
            return self.write(point, rows, value)
        first = self.hooked[0]
        rows.put(first, _dim(first, self.layout.num_tokens, point.kind) or 0, value)

    def is_copy(self, point: Point, rows: Rows) -> bool:
        """Whether reads hand out copies (gathered rows, or the computed resid sum). Copies are
        made outside inference mode, so their version counter tells whether a program edited
        them in place (inference tensors have none); an edited copy is written back."""
        return point.kind == "resid" or not isinstance(rows.index, slice)

    def is_fresh(self, point: Point, rows: Rows) -> bool:
        """Whether reads are new tensors that no later write here touches (an op's save keeps
        them as they are, without another copy)."""
        return self.is_copy(point, rows)

    def result(self) -> Any:
        return self.hooked


class TapAccess(PointAccess):
    """Reads and writes of a tap's value between CUDA-graph pieces, where the next replay
    overwrites the value's memory (a program may keep what it read past the step) and where every
    kernel launched per program shows at a program per invoke.

    A layer's residual stream (``hidden + residual``) or a block's output is copied once per tap;
    every program's read is a view of its rows of that copy (a copy for rows that are not one run),
    its in-place edits land there, and the copy goes back into the value once, when the tap
    returns (``result``): the stream into ``hidden`` and zeros into ``residual`` for all of the
    step's rows. The next layer adds the two, so untouched rows come out bit for bit as they went
    in. A layer's ``(hidden, residual)`` pair (its ``output``) is read as copies and written
    directly, after the shared copy is written back."""

    def __init__(self, hooked: Any, layout: BatchLayout):
        super().__init__(hooked, layout)
        self._copy: torch.Tensor | None = None
        self._written = 0  # the copy's version when it was last written back

    def _shared(self, point: Point) -> bool:
        return point.kind == "resid" or (point.kind == "output" and isinstance(self.hooked, torch.Tensor))

    def _own(self, point: Point) -> torch.Tensor:
        if self._copy is None:
            n = self.layout.num_tokens
            with torch.inference_mode(False):  # a normal tensor: its version counter shows edits
                if point.kind == "resid":
                    hidden, residual = self._base("resid")
                    self._copy = hidden[:n] + residual[:n]
                else:
                    self._copy = self.hooked[:n].clone()
            self._written = self._copy._version
        return self._copy

    def read(self, point: Point, rows: Rows) -> Any:
        copy, index = self._copy, rows.index
        if copy is not None and type(index) is slice and point.kind == "resid":
            return copy[index]  # the usual read of a program per invoke, a few calls spared: as below
        if not self._shared(point):
            self._give_back()
            with torch.inference_mode(False):
                return _map(super().read(point, rows), lambda t, _d: t.clone(), self.layout.num_tokens, point.kind)
        # A view of the copy (a normal tensor) is normal in inference mode too, and its version
        # counter shows edits: no inference_mode(False) around it (5 us a read on an H200 host)
        return rows.take(self._own(point), 0)

    def write(self, point: Point, rows: Rows, value: Any) -> None:
        if not self._shared(point):
            self._give_back()
            self._copy = None  # later reads copy the value as written
            return super().write(point, rows, value)
        copy = self._own(point)
        if isinstance(value, torch.Tensor) and value._base is copy:
            return  # a view of the copy, edited in place: there already
        rows.put(copy, 0, value)

    def is_copy(self, point: Point, rows: Rows) -> bool:
        return True

    def is_fresh(self, point: Point, rows: Rows) -> bool:
        return not self._shared(point) or not isinstance(rows.index, slice)  # a view of the shared copy is not

    def result(self) -> Any:
        self._give_back()
        return self.hooked

    def _give_back(self) -> None:
        copy = self._copy
        if copy is None or copy._version == self._written:
            return
        n = self.layout.num_tokens
        if isinstance(self.hooked, tuple):
            hidden, residual = self.hooked
            hidden[:n].copy_(copy)
            residual[:n].zero_()
        else:
            self.hooked[:n].copy_(copy)
        self._written = copy._version


def _dim(t: Any, num_tokens: int, kind: str) -> int | None:
    if not isinstance(t, torch.Tensor):
        return None
    if kind in ROW_PER_REQUEST_KINDS:
        return 0
    return token_dim(t, num_tokens)


def _map(base: Any, fn, num_tokens: int, kind: str) -> Any:
    if isinstance(base, tuple):
        return tuple(_map(t, fn, num_tokens, kind) for t in base)
    d = _dim(base, num_tokens, kind)
    return base if d is None else fn(base, d)


def first_tensor(x: Any):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for t in x:
            found = first_tensor(t)
            if found is not None:
                return found
    sampled = getattr(x, "sampled_token_ids", None)
    return sampled if isinstance(sampled, torch.Tensor) else None
