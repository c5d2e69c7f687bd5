"""FULL CUDA graphs broken at the taps: decode steps whose programs run between graph segments.

vLLM replays a decode step as one FULL CUDA graph, where no Python runs, and runs other batches as
piecewise graphs split at attention (and at interlace's tap ops, which engine.py adds to the
splitting ops: taps.py). A step whose programs run at the taps could run piecewise, but then every
layer's attention runs outside the graphs as well: on an H200 that cost a 1B-shaped decode step a
third of its speed. So once vLLM has captured its graphs, interlace captures every FULL batch size
a second time, the same forward cut only at the taps: vLLM's ``BreakableCUDAGraphCapture`` (which
vLLM uses to cut graphs at attention when torch.compile is off) ends a graph segment at each tap
op and records the op's Python as a break. Attention, norms and matmuls stay in the segments,
compiled as vLLM compiled them.

A third capture of every FULL size has the taps idle: no kernel of theirs at all. vLLM's own
capture must hold every tap's whole work (the buffers decide each replay what it does), which
cost a step that asks nothing of the taps 8 % of an 8B-shaped decode at 256 requests and 18 % at
one request on an H200 (8 small kernels per tap, a tap per layer).

At replay (:class:`EitherGraph`, in the runner's table of FULL graphs), a step of programs replays
the cut segments, and each break hands the tap's tensors (at the addresses captured, in the graph
pool) to the step's programs and ops, which write into them in place; a step of ops in the taps
replays vLLM's own FULL graph; any other step replays the idle one. The extra captures share
vLLM's graph pool (graphs of one process never run at once) and cost start-up time: two more
captures per FULL size.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger("interlace")


def install(taps) -> None:
    """Capture broken FULL graphs for ``taps`` after vLLM captures its own (this process's V2
    runner), where the engine splits its compiled model at the taps."""
    try:
        from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    except ImportError:  # a vLLM without the V2 GPU runner: programs run piecewise or eager
        return
    try:  # the target model's manager; a speculative decoder's drafter has its own, which also calls this capture
        from vllm.v1.worker.gpu.cudagraph_utils import ModelCudaGraphManager as model_manager
    except ImportError:
        model_manager = CudaGraphManager
    original = CudaGraphManager.capture
    if getattr(original, "_interlace", False):
        return

    @functools.wraps(original)
    def capture(self, create_forward_fn, *args, **kwargs):
        original(self, create_forward_fn, *args, **kwargs)
        # The drafter's graphs have no taps, and its batch sizes' captures would replace the model's in taps.broken.
        if not taps.breaks_graphs or not isinstance(self, model_manager):
            return
        try:
            _capture_broken(self, create_forward_fn, taps)
        except Exception:  # noqa: BLE001 - the engine still serves: programs' decode steps run piecewise
            logger.exception("interlace: capturing FULL graphs cut at the taps failed; steps whose programs run "
                             "at the taps use vLLM's piecewise graphs instead")
            taps.broken.clear()
            taps.idle.clear()

    capture._interlace = True
    CudaGraphManager.capture = capture


def _capture_broken(manager, create_forward_fn, taps) -> None:
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.config.compilation import CUDAGraphMode
    from vllm.distributed.parallel_state import graph_capture
    from vllm.model_executor.offloader.base import get_offloader

    descs = manager._capture_descs.get(CUDAGraphMode.FULL, [])
    with graph_capture(device=manager.device):
        for desc in descs:
            forward_fn = create_forward_fn(desc, warmup=False)  # vLLM's capture warmed it up
            for cut in (True, False):  # cut at the taps; then whole, with every tap idle
                capture = BreakableCUDAGraphCapture(pool=manager.pool)
                get_offloader().sync_prev_onload()
                taps.breaking, taps.idling = (capture, False) if cut else (None, True)
                try:
                    with capture:
                        forward_fn(CUDAGraphMode.NONE)
                        get_offloader().join_after_forward()
                finally:
                    taps.breaking, taps.idling = None, False
                (taps.broken if cut else taps.idle)[desc] = capture
    logger.info("interlace: captured %d FULL CUDA graphs broken at %d taps, and as many with the taps idle",
                len(descs), len(taps.index))


class EitherGraph:
    """One FULL batch size's graphs: vLLM's whole one (every tap's work in it), the one broken at
    the taps, which replays when the step's programs run there (``switch.pieces``), and the one
    with the taps idle, for a step that asks nothing of them (neither pieces nor ``switch.tapping``)."""

    def __init__(self, whole, broken, idle, switch):
        self.whole, self.broken, self.idle, self.switch = whole, broken, idle, switch

    def replay(self) -> None:
        switch = self.switch
        if switch.pieces:
            self.broken.replay()
        elif switch.tapping or self.idle is None:
            self.whole.replay()
        else:
            switch.steps["graph_idle"] += 1
            self.idle.replay()

    def __getattr__(self, name: str):  # anything else vLLM asks of a CUDAGraph
        return getattr(self.whole, name)
