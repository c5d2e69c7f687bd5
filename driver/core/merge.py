"""The one merge function for trace-shared values.

Programs contribute to a named shared value with a declared merge; once every invoke (and every
pipeline stage) of the trace has reported, the contributions are merged here. The local driver
uses it now; the cluster's collector actor uses it as is.

    >>> merge_shared([(0, "n", "sum", 1), (1, "n", "sum", 2)])
    {'n': 3}
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

MERGES = ("append", "sum", "mean", "max", "concat")

Contribution = tuple[int, str, str, Any]  # (invoke index, name, merge, value)


def check_merge(how: str) -> str:
    """``how`` if it names a merge (``concat`` may take a dim, ``concat:1``), else a ValueError
    that lists them: a program's ``m.share`` is checked at its line, before the trace runs on."""
    kind, colon, arg = how.partition(":") if isinstance(how, str) else ("", "", "")
    if kind in MERGES and (not colon or (kind == "concat" and arg.lstrip("-").isdigit())):
        return how
    raise ValueError(f"unknown merge {how!r}; choose one of {list(MERGES)} (concat takes ':dim', e.g. 'concat:1')")


class MergeError(ValueError):
    """A shared value whose contributions cannot be merged; ``invoke``: the first that contributed."""

    def __init__(self, name: str, invoke: int, message: str):
        super().__init__(message)
        self.name, self.invoke = name, invoke

    def __reduce__(self):
        return MergeError, (self.name, self.invoke, str(self))


def merge_shared(contributions: Iterable[Contribution]) -> dict[str, Any]:
    """Merge every name's contributions, in invoke order (stable within one invoke); a name that
    cannot be merged raises :class:`MergeError`, saying which name, which merge and what each
    invoke contributed."""
    by_name: dict[str, list[tuple[int, str, Any]]] = {}
    for invoke, name, how, value in contributions:
        by_name.setdefault(name, []).append((invoke, how, value))
    merged = {}
    for name, items in by_name.items():
        items.sort(key=lambda item: item[0])
        hows = {how for _, how, _ in items}
        if len(hows) != 1:
            raise MergeError(name, items[0][0], f"shared value {name!r} was contributed with different merges "
                                                f"{sorted(hows)}; use one")
        how = hows.pop()
        try:
            merged[name] = merge_values([value for _, _, value in items], how)
        except Exception as exc:  # noqa: BLE001 - the contributions are the programs' own
            raise MergeError(name, items[0][0], f"shared value {name!r} (merge {how!r}) could not be merged: "
                                                f"{type(exc).__name__}: {exc}; contributed {_described(items)}") from None
    return merged


def _described(items: list[tuple[int, str, Any]], most: int = 8) -> str:
    """What each invoke contributed, by shape (``invoke 0: (6,) float32``), the first ``most``."""
    def one(value: Any) -> str:
        if isinstance(value, torch.Tensor):
            return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        return type(value).__name__
    listed = ", ".join(f"invoke {invoke}: {one(value)}" for invoke, _, value in items[:most])
    return listed + (f", ... ({len(items)} in all)" if len(items) > most else "")


def merge_values(values: list[Any], how: str) -> Any:
    kind, _, arg = check_merge(how).partition(":")
    if kind == "append":
        return list(values)
    if kind == "sum":
        return _reduce(values, lambda a, b: a + b)
    if kind == "mean":
        return _reduce(values, lambda a, b: a + b) / len(values)
    if kind == "max":
        return _reduce(values, lambda a, b: torch.maximum(a, b) if isinstance(a, torch.Tensor) else max(a, b))
    return torch.cat([torch.as_tensor(v) for v in values], dim=int(arg or 0))  # concat


def _reduce(values: list[Any], fn) -> Any:
    out = values[0]
    for value in values[1:]:
        out = fn(out, value)
    return out
