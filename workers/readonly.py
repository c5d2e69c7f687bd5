"""Parameters handed to programs are read-only.

Every request an engine serves shares the model's weights, so an in-place edit a program makes to a
parameter it read (``m.layers[0].mlp.down_proj.weight.zero_()``) would change every later request
of every user. A program gets its parameters as :class:`ReadOnlyTensor`: computing with them works
as usual (results are plain tensors), while an in-place operation on them, or on a view of them,
raises with the fix (``w.clone()`` to change a copy). A copy per read would be the alternative, and
a logit lens reading the unembedding at every step would copy hundreds of MiB per step on a real
model; torch has no read-only tensors of its own, hence this small subclass.

    >>> w = ReadOnlyTensor.of(torch.ones(2, 2))
    >>> (w * 2).sum()          # fine: a new tensor
    >>> w.zero_()              # RuntimeError: parameters are read-only ...
"""

from __future__ import annotations

from typing import Any

import torch

_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})


class ReadOnlyTensor(torch.Tensor):
    """A tensor whose storage a program may read but not write."""

    @classmethod
    def of(cls, tensor: torch.Tensor | None) -> "ReadOnlyTensor | None":
        return None if tensor is None else tensor.detach().as_subclass(cls)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _writes_read_only(func, args, kwargs):
            raise RuntimeError(
                f"{getattr(func, '__name__', func)}: parameters are read-only in a program (every "
                "request shares the model's weights); change a copy instead, e.g. w = w.clone()"
            )
        with torch._C.DisableTorchFunctionSubclass():  # plain torch below: no recursion into here
            out = func(*args, **kwargs)
            return _protect_views(out, _storages(args))


def _writes_read_only(func, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    if name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_")):
        return bool(args) and isinstance(args[0], ReadOnlyTensor)
    out = kwargs.get("out")
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(isinstance(o, ReadOnlyTensor) for o in outs)


def _storages(args: tuple) -> set[int]:
    return {a.untyped_storage().data_ptr() for a in args if isinstance(a, ReadOnlyTensor)}


def _protect_views(out: Any, storages: set[int]) -> Any:
    """Views of a read-only tensor (``w[0]``, ``w.T``, ``w.detach()``) stay read-only; results
    with storage of their own are plain tensors."""
    if isinstance(out, torch.Tensor) and not isinstance(out, ReadOnlyTensor):
        if out.untyped_storage().data_ptr() in storages:
            return out.as_subclass(ReadOnlyTensor)
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_protect_views(o, storages) for o in out)
    return out
