"""Declarative operations: interventions as data, no code.

They give the same results as the equivalent program, run without switching to a program, and batch
across invokes: the form for untrusted users and for speed.

    >>> import torch, interlace
    >>> from interlace import ops
    >>> steer = ops.add("layers.2.resid", torch.randn(128))           # every token, every step
    >>> keep = ops.save("layers.2.resid", tokens="last", steps=[0])   # the prompt's last token
    >>> ablate = ops.zero("layers.1.mlp.output", tokens=[3, 4])       # positions 3 and 4

Points: ``"<module path>.output"`` (of a tuple, its first element: ``out`` of a linear layer's
``(out, bias)``), ``".input"``, ``"layers.<i>.resid"`` (residual stream after a layer; a layer's
own ``.output`` is refused), ``"embeddings"``, ``"final"`` (final norm output), ``"logits"``.
``tokens``: ``"all"``, ``"last"`` (the prompt's last token at step 0, the new token after), or a
list of positions. ``steps``: None for every step, or a list of steps (0 is the prompt). An op
that selects nothing in its invoke's generation is an error. An invoke's ops at one module apply
in the order listed.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Iterable

import cloudpickle
import torch

Tokens = str | Iterable[int]


def save(point: str, name: str | None = None, tokens: Tokens = "all", steps: Iterable[int] | None = None) -> dict:
    """Save ``point`` into each invoke's ``saves[name or point]`` (steps concatenate along dim 0)."""
    if name is not None and (not isinstance(name, str) or not name):  # "" is refused, as m.save refuses it
        raise TypeError(f"save name must be a non-empty string, or None for the point's own, got {name!r} "
                        f"({type(name).__name__})")
    return _op("save", point, tokens, steps, name=str(name) if name is not None else point)


def add(point: str, vector: torch.Tensor, tokens: Tokens = "all", steps: Iterable[int] | None = None) -> dict:
    """Add ``vector`` (broadcast over the selected rows) to ``point``: steering."""
    return _op("add", point, tokens, steps, value=_real_tensor("add", vector))


def scale(point: str, factor: float, tokens: Tokens = "all", steps: Iterable[int] | None = None) -> dict:
    """Multiply ``point`` by ``factor``."""
    return _op("scale", point, tokens, steps, value=float(factor))


def replace(point: str, value: torch.Tensor, tokens: Tokens = "all", steps: Iterable[int] | None = None) -> dict:
    """Replace the selected rows of ``point`` with ``value`` (broadcast)."""
    return _op("replace", point, tokens, steps, value=_real_tensor("replace", value))


def zero(point: str, tokens: Tokens = "all", steps: Iterable[int] | None = None) -> dict:
    """Zero ``point`` (ablation)."""
    return _op("zero", point, tokens, steps)


def _op(kind: str, point: str, tokens: Tokens, steps, **fields) -> dict:
    if not isinstance(point, str) or not point:
        raise TypeError(f"point must be a string like 'layers.3.resid', got {point!r}")
    if point == "samples":
        raise ValueError("ops cannot address 'samples'; force tokens from a program (m.samples = ...)")
    if point == "logits" and tokens != "all":
        raise ValueError("'logits' has one row per step; leave tokens='all'")
    if isinstance(tokens, str):
        if tokens not in ("all", "last"):
            raise ValueError(f"tokens must be 'all', 'last' or a list of positions, got {tokens!r}")
    else:
        tokens = _integers(tokens, "tokens must be 'all', 'last' or a list of integer positions")
    op = {"op": kind, "point": point, "tokens": tokens, "steps": step_list(steps), **fields}
    # Invokes carrying equal ops are applied as one batched tensor operation on the worker, share
    # one vector row in graph taps, and travel as one pickle: equal ops must get equal keys, also
    # when built apart (the endpoint builds each invoke's ops from its JSON).
    op["key"] = content_digest(op)
    return op


def content_digest(value) -> str:
    """A digest of data holding tensors, equal for equal content wherever it was built: tensors
    by dtype, shape and bytes, dicts by sorted keys. A digest of the pickle was not: torch names a
    tensor's storage in it by its memory address, so equal vectors built apart got other keys.

        >>> content_digest({"v": torch.ones(3)}) == content_digest({"v": torch.ones(3)})
        True
    """
    found = hashlib.sha256()

    def walk(item) -> None:
        if isinstance(item, torch.Tensor):
            found.update(f"tensor {item.dtype} {tuple(item.shape)}".encode())
            if item.layout == torch.strided and not item.is_quantized:
                found.update(item.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:  # (refused further on; a pickle keeps the key apart from others meanwhile)
                found.update(cloudpickle.dumps(item))
        elif isinstance(item, dict):
            for key in sorted(item, key=str):
                found.update(f"key {key!r}".encode())
                walk(item[key])
        elif isinstance(item, (list, tuple)):
            found.update(f"{type(item).__name__} {len(item)}".encode())
            for part in item:
                walk(part)
        else:
            found.update(f"{type(item).__name__} {item!r}".encode())

    walk(value)
    return found.hexdigest()[:16]


def step_list(steps: Iterable[int] | None) -> list[int] | None:
    """Generation steps (0 is the prompt) as sorted ints; None stays None (every step). A step that
    is not an integer is refused: int() truncated 1.5 to 1, and a program's 1.5 never ran."""
    if steps is None:
        return None
    return _integers(steps, "steps must be integers (0 is the prompt, then one per generated token)")


def _integers(values: Iterable[int], refusal: str) -> list[int]:
    """Sorted ints (numpy's too); anything int() would truncate or parse is refused."""
    try:
        return sorted(operator.index(value) for value in values)
    except TypeError:
        raise TypeError(f"{refusal}, got {values!r}") from None


def _real_tensor(kind: str, value) -> torch.Tensor:
    """An op's value as a real tensor: a complex one lost its imaginary part when cast to the
    model's dtype, and torch's own refusal of a string named no op."""
    try:
        tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"{kind}: the value must be a tensor or numbers, got {type(value).__name__} ({exc})") from None
    if tensor.is_complex():
        raise TypeError(f"{kind}: the value must be real, got {tensor.dtype}")
    # A meta tensor failed in the op's digest with torch's "Cannot copy out of meta tensor"; a
    # sparse, nested or quantized one failed each invoke on the engine with torch's own errors.
    if tensor.is_meta:
        raise ValueError(f"{kind}: a tensor on the meta device has no values to {kind}")
    if tensor.layout is not torch.strided or tensor.is_nested or tensor.is_quantized:
        kind_of = "nested" if tensor.is_nested else "quantized" if tensor.is_quantized else str(tensor.layout).removeprefix("torch.")
        dense = {"nested": "value.to_padded_tensor(0)", "quantized": "value.dequantize()"}.get(kind_of, "value.to_dense()")
        raise TypeError(f"{kind}: the value must be a dense tensor, got a {kind_of} one; pass {dense}")
    return tensor
