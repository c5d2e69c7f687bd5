"""Compiled engines with CUDA graphs: steps without interventions replay graphs, the others run eager.

interlace's programs and ops run in forward hooks, which a CUDA graph replay or a torch.compile'd
forward never calls. On a compiled engine (vLLM's V2 GPU runner, ``enforce_eager`` off) a step
whose batch holds an intervened request therefore runs the model's own ``nn.Module`` forward, and
every other step runs as plain vLLM would (full or piecewise graphs). vLLM 0.26 has both switches
this needs, and uses them itself for encoder-decoder steps:

- the runner's graph manager picks a step's CUDA-graph mode in ``dispatch``; for an intervened
  step :class:`GraphSwitch` returns the descriptor vLLM uses for a batch too large to capture (no
  graph, no padding), so inputs and attention metadata are built for an eager step;
- ``ForwardContext.skip_compiled`` makes the ``@support_torch_compile`` model call its original
  ``forward`` instead of the compiled code; set in the forward pre-hook, where the context exists.

vLLM's custom ops (SiLU-and-mul, rotary embedding) and IR ops (RMSNorm) run their PyTorch-native
code in a compiled engine (traced into the compiled graphs); an eager step would run those as
several small kernels each. Compiled code never calls the modules' Python again, so
:func:`eager_kernels` points them at their CUDA kernels for eager steps only: an intervened step should cost what it costs on
an eager engine, and compute the same (an H100's eager step still took 21 ms of forward against
an eager engine's 14 ms before SiLU-and-mul's compiled native code was caught here too; what
remains is in docs/benchmarks.md).

vLLM's IR ops also go through a torch custom-op layer in a compiled engine (compiled code needs it
to trace them); an eager engine calls them directly. An eager step does too (:meth:`GraphSwitch.running`).

A step marked eager that did not reach the model eagerly (a vLLM whose runner changed) fails that
step's invokes with a clear error, never dropping their interventions silently. Counters say how
many steps ran each way (the worker extension's ``interlace_step_counts``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from interlace.workers.plugin import SPLITTING_OPS
from interlace.workers.tap_graphs import EitherGraph


class GraphSwitch:
    """Per-step choice between vLLM's graphs and an eager forward, on one compiled V2 runner."""

    def __init__(self, runner, taps=None):
        from vllm import forward_context
        from vllm.config.compilation import CUDAGraphMode
        from vllm.forward_context import ForwardContext
        from vllm.v1.worker.gpu.cudagraph_utils import BatchExecutionDescriptor

        manager = getattr(runner, "cudagraph_manager", None)
        if "skip_compiled" not in getattr(ForwardContext, "__dataclass_fields__", {}):
            raise RuntimeError("this vLLM's forward context has no skip_compiled switch: interlace cannot run "
                               "interventions on a compiled engine here; start it with enforce_eager=True")
        self._none = CUDAGraphMode.NONE
        self._contexts = forward_context  # read in every eager step's pre-hook: no import there
        self.eager = False  # this step must run the nn.Module forward
        self.entered = False  # and it did
        self.seen = ""  # what the step ran instead, for the error when it did not
        # taps: graphs that ran ops (taps.py); pieces: programs at taps between graph pieces
        # graph_idle: of the graph steps, those that replayed a FULL graph with the taps idle (tap_graphs.py)
        self.steps = {"graph": 0, "taps": 0, "pieces": 0, "eager": 0, "graph_idle": 0}
        self.pieces = False  # this step runs piecewise graphs, with programs at the taps between them
        self.tapping = False  # this step runs ops in the graph taps (else a FULL graph may leave them idle)
        self.can_piece = splits_at_taps(runner.vllm_config.compilation_config)
        try:
            from vllm.ir import enable_torch_wrap
        except ImportError:  # a vLLM without IR ops
            enable_torch_wrap = None
        self._ir_unwrapped = enable_torch_wrap
        broken = taps.broken if taps is not None else {}
        if manager is not None:
            for desc, graph in broken.items():  # steps whose programs run at the taps replay these
                manager.graphs[desc] = EitherGraph(manager.graphs[desc], graph, taps.idle.get(desc), self)
            original = manager.dispatch

            @functools.wraps(original)
            def dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras=0):
                desc = original(num_reqs, num_tokens, uniform_token_count, num_active_loras=num_active_loras)
                if self.pieces and desc.cg_mode == CUDAGraphMode.FULL:
                    if desc in broken:
                        return desc  # its FULL graph cut at the taps (tap_graphs.py)
                    # no uniform-decode match: the PIECEWISE graph of this size, if any
                    desc = original(num_reqs, num_tokens, None, num_active_loras=num_active_loras)
                if (self.eager or self.pieces) and desc.cg_mode == CUDAGraphMode.FULL:
                    # A FULL graph runs no Python: a mode with no piecewise graph of this size
                    # falls back to the compiled pieces, called one by one, taps between them.
                    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                                                    num_reqs=num_reqs, num_active_loras=desc.num_active_loras)
                if self.eager and desc.cg_mode != CUDAGraphMode.NONE:
                    # What dispatch returns for a batch no graph was captured for: unpadded, no graph.
                    return BatchExecutionDescriptor(cg_mode=CUDAGraphMode.NONE, num_tokens=num_tokens,
                                                    num_reqs=num_reqs, num_active_loras=desc.num_active_loras)
                return desc

            manager.dispatch = dispatch

    def begin(self, eager: bool, taps: bool = False, pieces: bool = False) -> None:
        """Before the runner's step: whether it must run eager, runs ops in graph taps, or runs
        piecewise graphs with programs at the taps between pieces."""
        self.eager, self.pieces, self.entered, self.seen = eager, pieces, False, "no call of the model's forward"
        self.tapping = taps
        self.steps["eager" if eager else "pieces" if pieces else "taps" if taps else "graph"] += 1

    def running(self):
        """Around the runner's step: in an eager step, vLLM's IR ops (RMSNorm) are called directly,
        as on an eager engine, not through the torch op layer that only compiled code needs (an H100's
        eager 1B step spent 1.6 ms in 31.5 such calls, half of it in that layer)."""
        if self.eager and self._ir_unwrapped is not None:
            return self._ir_unwrapped(False)
        return contextlib.nullcontext()

    def enter_forward(self) -> bool:
        """In the model's forward pre-hook of an eager step: skip the compiled code; True when this
        forward really runs eager (no graph mode chosen for it)."""
        if not self.eager or not self._contexts.is_forward_context_available():
            return False
        context = self._contexts.get_forward_context()
        context.skip_compiled = True
        self.entered = context.cudagraph_runtime_mode == self._none
        self.seen = f"a forward in CUDA-graph mode {context.cudagraph_runtime_mode}"
        return self.entered

    def missed(self) -> bool:
        """After the step: it was marked eager and never ran the model eagerly."""
        missed = self.eager and not self.entered
        self.eager = False
        return missed


def splits_at_taps(config) -> bool:
    """Whether vLLM splits the compiled model at interlace's tap ops (engine.py asks it to), so
    that it calls their Python between graph pieces on every PIECEWISE and eager step."""
    from vllm.config.compilation import CompilationMode

    return (config.mode == CompilationMode.VLLM_COMPILE and not config.use_inductor_graph_partition
            and all(op in (config.splitting_ops or ()) for op in SPLITTING_OPS))


def is_compiled(runner) -> bool:
    """Whether the runner's engine compiles the model or captures CUDA graphs."""
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    config = runner.vllm_config.compilation_config
    return config.mode != CompilationMode.NONE or config.cudagraph_mode != CUDAGraphMode.NONE


def eager_kernels(model) -> int:
    """Point vLLM's ops that run PyTorch-native code in a compiled engine at the kernels an eager
    engine runs, for the forwards that run eager; returns how many were changed.

    Two kinds: custom-op modules (SiLU-and-mul, rotary embedding: their bound forward), and
    vLLM's IR ops (RMSNorm, fused add + RMSNorm), which dispatch on a per-process priority that a
    compiled engine sets to "native" so that inductor can fuse them. Compiled graphs and captured
    CUDA graphs hold what was chosen when they were made and never dispatch again.
    """
    from vllm.model_executor.custom_op import CustomOp

    changed = 0
    for module in model.modules():
        if not isinstance(module, CustomOp) or type(module).forward_cuda is CustomOp.forward_cuda:
            continue
        if _is_native(module):
            module._forward_method = module.forward_cuda
            changed += 1
    try:
        from vllm.ir.op import IrOp
    except ImportError:  # a vLLM without IR ops
        return changed
    for op in IrOp.registry.values():
        priority = op.get_priority()
        if priority[:1] == ["native"] and "vllm_c" in op.supported_providers():
            op.set_default(["vllm_c", "native"])  # an eager engine's priority on CUDA
            changed += 1
    return changed


def _is_native(module: Any) -> bool:
    """Whether ``module`` runs its ``forward_native``: bound, a static function (SiLU-and-mul's),
    or either compiled by ``CustomOp.maybe_compile`` (torch.compile's wrapper, or vLLM's own
    ``functools.wraps`` wrapper around it)."""
    method = getattr(module, "_forward_method", None)
    for _ in range(4):  # unwrap: compiled wrappers, then a bound method
        inner = (getattr(method, "_torchdynamo_orig_callable", None) or getattr(method, "__wrapped__", None)
                 or getattr(method, "__func__", None))
        if inner is None:
            break
        method = inner
    return method is not None and method is type(module).forward_native
