"""Shard planning: which of a trace's invokes may run on different replicas, and how to split them.

``Cluster`` (the driver's handle) and the Serve ingress split traces the same way, so both import
this module.

    >>> from interlace.cluster.shards import plan_shards
    >>> plan_shards(64, joined=[], replicas=2, min_shard=8)[1][:3]
    [32, 33, 34]
"""

from __future__ import annotations

from typing import Callable, Sequence

from interlace.core.trace import Invoke


def joined_invokes(invokes: Sequence[Invoke]) -> list[int]:
    """The invokes that must share one engine: those whose program may ``send``/``recv``.

    A program's use of them cannot be known for sure, so the rule is conservative: plain and
    ops-only invokes are independent, and so are invokes of a ``@interlace.batched`` program whose
    code names neither ``send`` nor ``recv``; every other program invoke is joined.
    """
    return [i for i, inv in enumerate(invokes) if inv.program is not None and not _independent(inv.program)]


def plan_shards(count_invokes: int, joined: Sequence[int], replicas: int, min_shard: int) -> list[list[int]]:
    """Split a trace's invoke indices into at most ``replicas`` shards of at least ``min_shard``;
    the ``joined`` invokes stay together in the first shard."""
    count = min(replicas, count_invokes // min_shard)
    if count <= 1:
        return [list(range(count_invokes))]
    free = [i for i in range(count_invokes) if i not in set(joined)]
    joined = list(joined)
    target = -(-count_invokes // count)
    first = joined + free[:max(0, target - len(joined))]
    rest = free[len(first) - len(joined):]
    per = -(-len(rest) // (count - 1)) if rest else 1
    shards = [sorted(first)] + [rest[k:k + per] for k in range(0, len(rest), per)]
    return [s for s in shards if s]


def _independent(program: Callable) -> bool:
    if not getattr(program, "__interlace_batched__", False):
        return False
    code = getattr(program, "__code__", None)
    return code is not None and not ({"send", "recv"} & _names(code))


def _names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names
