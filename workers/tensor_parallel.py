"""Tensor parallelism as programs see it: full tensors, whatever each rank holds.

Under TP every rank runs each program in lockstep, so every rank must hand it the same full value
and apply the same edit. vLLM leaves some values split across ranks; a :class:`Split` describes how
one is laid out, gathers the full value on every rank, and cuts a full write back into this
rank's piece:

    qkv_proj.output     column-parallel: each rank holds its heads of q, then of k, then of v
    gate_up_proj.output column-parallel: each rank holds its part of gate, then of up
    o_proj.input        row-parallel input: each rank holds its slice of the features
    attn.output         each rank's heads
    act_fn.input        each rank's part of gate, then of up (act_fn.output: its part of the MLP)
    down_proj.output    with reduce_results=False, partial sums: read = sum, write = rank 0 only

Values that vLLM already reduces (embeddings, decoder layers, self_attn and mlp outputs, norms,
logits) are full on every rank. A value interlace cannot place in either group is refused under
TP rather than handed out as one rank's shard: a silent shard would be the classic silent error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Part:
    """One logical piece of a split feature dim (q, k or v; gate or up; or the whole)."""

    local: int  # features of this piece on each rank
    replicas: int = 1  # ranks holding the same shard (kv heads replicated when kv heads < TP)


@dataclass(frozen=True)
class Split:
    """A tensor whose last dim is split across the TP group, one or more parts side by side."""

    parts: tuple[Part, ...]
    tp_rank: int
    tp_size: int

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_gather

        gathered = tensor_model_parallel_all_gather(local.contiguous(), dim=-1)  # [.., rank-major]
        width = local.shape[-1]
        pieces, offset = [], 0
        for part in self.parts:
            for rank in range(0, self.tp_size, part.replicas):  # one shard per distinct holder
                start = rank * width + offset
                pieces.append(gathered[..., start : start + part.local])
            offset += part.local
        return torch.cat(pieces, dim=-1)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        pieces, offset = [], 0
        for part in self.parts:
            shard = self.tp_rank // part.replicas
            start = offset + shard * part.local
            pieces.append(full[..., start : start + part.local])
            offset += part.local * (self.tp_size // part.replicas)
        return torch.cat(pieces, dim=-1)


@dataclass(frozen=True)
class Partial:
    """Partial sums that vLLM reduces later (``reduce_results=False``)."""

    tp_rank: int

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(local.clone())

    def local(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.tp_rank == 0 else torch.zeros_like(full)


class Unknown:
    """A value that may be one rank's shard in a way interlace does not know how to gather."""

    def __init__(self, what: str):
        self.what = what

    def gather(self, local):
        raise NotImplementedError(
            f"{self.what} is split across tensor-parallel ranks in a layout interlace does not know, "
            "so a program would see one rank's shard. Read a point of the enclosing module "
            "(e.g. the attention or MLP output, or a layer's resid), or run with tensor_parallel_size=1"
        )

    local = gather


class TensorParallelLayout:
    """Which (module, kind) values are split on this rank, and how; also full parameters."""

    def __init__(self, modules: dict[str, nn.Module | None], tp_rank: int, tp_size: int, hidden_size: int):
        self.modules = modules
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.hidden_size = hidden_size
        self._cache: dict[tuple[str, str], Any] = {}

    def split(self, module: str, kind: str):
        """A :class:`Split`, :class:`Partial` or :class:`Unknown` for the value, None if it is full.

        ``kind`` is "output" or "input" (resid and final are full by construction)."""
        if self.tp_size == 1 or kind not in ("output", "input"):
            return None
        key = (module, kind)
        if key not in self._cache:
            self._cache[key] = self._classify(module, kind)
        return self._cache[key]

    def forget(self) -> None:
        """Classify values again on next use (a module was changed after start-up)."""
        self._cache.clear()

    def gathers_parameter(self, module: str, name: str) -> bool:
        """Whether reading parameter ``name`` of ``module`` whole enters a TP collective."""
        param = getattr(self.modules[module], name, None)
        return (self.tp_size > 1 and isinstance(param, torch.Tensor) and param.numel() > 0
                and _sharded_class(self.modules[module]))

    def full_parameter(self, module: str, name: str) -> torch.Tensor:
        """Parameter ``name`` of ``module`` as the unsharded model has it (a copy when gathered)."""
        mod = self.modules[module]
        param = getattr(mod, name)
        if param is None:  # e.g. no bias
            return None
        if isinstance(param, torch.Tensor) and param.numel() == 0 and getattr(mod, "cpu_linear", None):
            raise ValueError(
                f"{module}.{name} is not readable on vLLM's CPU backend: it repacks linear weights "
                "for its matmul kernel and frees the originals (GPU builds keep them)"
            )
        if not self.gathers_parameter(module, name):
            return param.detach()
        cls = type(mod).__name__
        if "VocabParallelEmbedding" in _mro(mod) or cls == "ParallelLMHead":
            full = _all_gather(param.detach(), dim=0)
            return full[: mod.org_vocab_size]
        dim = getattr(param, "output_dim", None)
        if dim is not None and "RowParallelLinear" not in _mro(mod):
            split = self._column_split(mod)
            return split.gather(param.detach().movedim(dim, -1)).movedim(-1, dim)
        dim = getattr(param, "input_dim", None)
        if dim is not None:
            return _all_gather(param.detach(), dim=dim)
        return param.detach()  # e.g. a row-parallel bias: whole on every rank

    # --- classification ----------------------------------------------------------------------

    def _classify(self, module: str, kind: str):
        mod = self.modules.get(module)
        if mod is None:
            return None  # lives on another pipeline stage; that stage decides
        mro = _mro(mod)
        split = lambda *parts: Split(tuple(parts), self.tp_rank, self.tp_size)  # noqa: E731
        if "ColumnParallelLinear" in mro:
            if kind == "input":
                return None
            return None if getattr(mod, "gather_output", False) else self._column_split(mod)
        if "RowParallelLinear" in mro:
            if kind == "input":
                return split(Part(mod.input_size_per_partition)) if mod.input_is_parallel else None
            return None if mod.reduce_results else Partial(self.tp_rank)
        if type(mod).__name__ == "Attention":  # per-rank heads in (query) and out
            return split(Part(mod.num_heads * mod.head_size))
        if type(mod).__name__.endswith("AndMul") and self._beside_column_parallel(module):
            width = self._sibling_intermediate(module)
            return split(Part(width), Part(width)) if kind == "input" else split(Part(width))
        if self._known_full(module, mod):
            return None
        return Unknown(f"{module}.{kind} ({type(mod).__name__})")

    def _column_split(self, mod: nn.Module) -> Split:
        if "QKVParallelLinear" in _mro(mod):
            rep = getattr(mod, "num_kv_head_replicas", 1)
            parts = (
                Part(mod.num_heads * mod.head_size),
                Part(mod.num_kv_heads * mod.head_size, rep),
                Part(mod.num_kv_heads * getattr(mod, "v_head_size", mod.head_size), rep),
            )
        elif getattr(mod, "output_sizes", None):
            parts = tuple(Part(size // self.tp_size) for size in mod.output_sizes)
        else:
            parts = (Part(mod.output_size_per_partition),)
        return Split(parts, self.tp_rank, self.tp_size)

    def _beside_column_parallel(self, module: str) -> bool:
        parent = module.rpartition(".")[0]
        return any("MergedColumnParallelLinear" in _mro(m) for m in children(self.modules, parent))

    def _sibling_intermediate(self, module: str) -> int:
        parent = module.rpartition(".")[0]
        merged = next(m for m in children(self.modules, parent) if "MergedColumnParallelLinear" in _mro(m))
        return merged.output_sizes[0] // self.tp_size

    def _known_full(self, module: str, mod: nn.Module) -> bool:
        """Values vLLM has already reduced or never split."""
        mro = _mro(mod)
        if module.rpartition(".")[2].isdigit() or module in ("", "model"):
            return True  # decoder layers and the model itself
        if "VocabParallelEmbedding" in mro or "ReplicatedLinear" in mro or "LogitsProcessor" in mro:
            return True
        weight = getattr(mod, "weight", None)
        if "Norm" in type(mod).__name__ and isinstance(weight, torch.Tensor) and weight.numel() == self.hidden_size:
            return True  # layer norms over the hidden size (not per-head q/k norms)
        return ends_in_reduction(self.modules, module)


def ends_in_reduction(modules: dict[str, nn.Module | None], module: str) -> bool:
    """Whether ``module`` is a block that ends in a reducing row-parallel layer (self_attn, mlp):
    its output is whole on every rank, whatever the TP size."""
    return any("RowParallelLinear" in _mro(m) and m.reduce_results for m in children(modules, module))


def children(modules: dict[str, nn.Module | None], parent: str) -> list[nn.Module]:
    """``parent``'s direct children on this rank."""
    prefix = f"{parent}."
    return [m for n, m in modules.items() if m is not None and n.startswith(prefix) and "." not in n[len(prefix):]]


def _sharded_class(mod: nn.Module) -> bool:
    mro = _mro(mod)
    return any(c in mro for c in ("ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"))


def _mro(mod: nn.Module) -> set[str]:
    return {c.__name__ for c in type(mod).__mro__}


def _all_gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(t.contiguous(), dim=dim)
