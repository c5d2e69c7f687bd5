"""One GPU kernel per tap call: the tap's whole work (taps.py) as one Triton kernel that first reads
what the step asks of its tap, from a device buffer.

vLLM's own FULL CUDA graphs, replayed for every step whose ops run in the taps, hold every tap's
work whatever the step asks of it (a graph serves every later step). In torch ops that work is
about a dozen small kernels per tap, a tap per layer: on four H200s a 70B-shaped step of ops at one
or four of its 80 taps ran at 0.86-0.88 x plain vLLM, where steps that ask nothing of the taps (an
idle graph, tap_graphs.py) ran at 0.99 (bench/results/2026-11-28-h200x4-idle-taps-70b-tp4/). Here
the work is one launch per tap, and a tap the step does not ask anything of returns at once; no
library kernel reads its own work from device memory this way, hence a kernel of our own.

The numbers are the torch path's (Taps._apply): the stream ``s = hidden + residual`` rounded to the
model's dtype; an edit ``s * mul + vector`` in float32, rounded once (or the vector, for replace
and zero); rows saved before or after their edit. Triton may fuse the multiply and the add, which
rounds once where torch rounds twice in float32: the result can differ in the last bit of a
float32 before rounding to the model's dtype (GPU tests compare with a tolerance for that).

    >>> # on a GPU, or on a CPU under TRITON_INTERPRET=1 (tests/test_tap_kernels.py)
    >>> # tap_kernels.run_resid(hidden, residual, taps.control, index, taps.asked, taps.vectors, saved, taps.ran)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

IDLE, SAVES, EDITS = 0, 1, 2  # taps._IDLE, _SAVES, _EDITS
EDITED, MUL, ROW, SETS, AFTER = range(5)  # taps' control columns


@triton.jit
def _tap(hidden, residual, value_stride, residual_stride, control, index, n_taps, asked, vectors, saved, saved_stride,
         ran, hidden_size, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    what = tl.load(asked + index)
    if what == 0:  # IDLE
        return
    if row == 0:
        tl.store(ran + index, tl.load(ran + index) + 1)
    base = control + (row.to(tl.int64) * n_taps + index) * 5
    edited = tl.load(base + 0) != 0.0
    mul = tl.load(base + 1)
    vector_row = tl.load(base + 2).to(tl.int64)
    sets = tl.load(base + 3) != 0.0
    after = tl.load(base + 4) != 0.0
    editing = (what == 2) & edited
    for start in range(0, hidden_size, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < hidden_size
        h = tl.load(hidden + row * value_stride + cols, mask=inside)
        if HAS_RESIDUAL:
            r = tl.load(residual + row * residual_stride + cols, mask=inside)
            s = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        else:
            s = h
        if editing:
            v = tl.load(vectors + vector_row * hidden_size + cols, mask=inside)
            if sets:
                e = v
            else:
                e = (s.to(tl.float32) * mul + v.to(tl.float32)).to(h.dtype)
            tl.store(hidden + row * value_stride + cols, e, mask=inside)
            if HAS_RESIDUAL:
                tl.store(residual + row * residual_stride + cols, tl.zeros_like(r), mask=inside)
            if after:
                tl.store(saved + row * saved_stride + cols, e, mask=inside)
            else:
                tl.store(saved + row * saved_stride + cols, s, mask=inside)
        else:
            tl.store(saved + row * saved_stride + cols, s, mask=inside)


def run(value: torch.Tensor, residual: torch.Tensor | None, control: torch.Tensor, index: int, asked: torch.Tensor,
        vectors: torch.Tensor, saved: torch.Tensor, ran: torch.Tensor) -> None:
    """The tap ``index``'s work on ``value`` (a layer's hidden, with its ``residual``; or a module's
    output, residual None), in place, with ``saved`` the rows its saves go to ([rows, hidden])."""
    rows, hidden_size = value.shape
    if rows == 0:
        return
    block = min(triton.next_power_of_2(hidden_size), 1024)
    _tap[(rows,)](value, residual if residual is not None else value, value.stride(0),
                  residual.stride(0) if residual is not None else 0, control, index, control.shape[1], asked,
                  vectors, saved, saved.stride(0), ran, hidden_size, HAS_RESIDUAL=residual is not None, BLOCK=block)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernel can take these tensors: rows of contiguous elements (a layer's hidden
    and residual, a module's output are; anything else takes the torch path)."""
    return all(t.dim() == 2 and t.stride(1) == 1 for t in tensors)
