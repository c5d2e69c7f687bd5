"""Wiring the interleaver into vLLM's model runner, V1 (CPU builds) and V2 (GPU builds).

This is the only file that knows runner internals, and it stays thin: it wraps three runner entry
points and builds a :class:`BatchLayout` per step.

    execute_model(scheduler_output)  finish requests vLLM has dropped, keeping only the steps whose
                                     tokens they returned (scheduler.py counts them), clearing the
                                     KV-cache blocks of those that may have written (kv_blocks.py);
                                     admit new ones; on a
                                     compiled engine, run the step eager iff it intervenes (graphs.py)
      model forward pre-hook         begin_step(layout): rows are final once the forward starts
      ... module hooks ...
    runner sampling                  programs at samples, then forced tokens checked (check_samples)
    sample_tokens(...)               end_step() once sampling is done (the last PP stage), or
    execute_model returning a value  end_step() on stages that send activations onward, whose
                                     carry (see pipeline.py) rides along in IntermediateTensors
"""

from __future__ import annotations

import contextlib
import functools
import logging

from interlace.workers.calls import error_record
from interlace.workers.graphs import GraphSwitch, eager_kernels, is_compiled
from interlace.workers.interleaver import PAYLOAD_KEY, Interleaver
from interlace.workers.kv_blocks import KVBlocks
from interlace.workers.layout import layout_from_v1_runner, layout_from_v2_input_batch
from interlace.workers.pipeline import pack, take_carry, unpack
from interlace.workers.scheduler import OUTPUT_COUNTS, UNLOGGED

logger = logging.getLogger("interlace")


def install(runner, all_modules: list[str]) -> Interleaver:
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    rank = {
        "tp_rank": get_tp_group().rank_in_group,
        "tp_size": get_tp_group().world_size,
        "pp_rank": get_pp_group().rank_in_group,
        "pp_size": get_pp_group().world_size,
    }
    is_v2 = not hasattr(runner, "input_batch")
    samples_slot = CallbackSlot()
    sample_fn = "sample" if is_v2 else "_sample"  # both return the SamplerOutput (V2: first item)
    original_sample_fn = getattr(runner, sample_fn)

    @functools.wraps(original_sample_fn)
    def sample_with_slot(*args, **kwargs):
        result = original_sample_fn(*args, **kwargs)
        if samples_slot.callback is not None:  # some program reads (and may force) samples
            output = result[0] if isinstance(result, tuple) else result
            sampled = output.sampled_token_ids.clone()  # what vLLM sampled, kept where a forced token is refused
            samples_slot.callback(output)
            _guard(inter, inter.check_samples, output.sampled_token_ids, sampled)
        if inter.step is not None:
            # An intervened request's non-finite logits (its own writes) can make the GPU sampler
            # draw an id outside the vocabulary, which the next step's embedding lookup turns into
            # a device-side assert that kills the worker (seen on an H100). Its own tokens are its
            # business; the engine's life is not. One small kernel, no host sync.
            output = result[0] if isinstance(result, tuple) else result
            output.sampled_token_ids.clamp_(0, inter.vocab_size - 1)
        return result

    setattr(runner, sample_fn, sample_with_slot)
    inter = Interleaver(runner.model, samples_slot, rank, all_modules, runner.model_config.get_hidden_size(),
                        agree_max=_max_over(get_tp_group().cpu_group) if rank["tp_size"] > 1 else None)
    inter.vocab_size = runner.model_config.get_vocab_size()
    captured = {}

    if is_v2:  # V2 builds a fresh InputBatch each step: keep the one the forward will use
        original_prepare = runner.prepare_inputs

        @functools.wraps(original_prepare)
        def prepare_inputs(*args, **kwargs):
            batch = original_prepare(*args, **kwargs)
            captured["batch"] = batch
            if state["in_step"] and (inter.tap_step or inter.piece_step) and inter.step is None:  # a graph replay calls no hook:
                _guard(inter, inter.begin_step, current_layout())  # the taps' buffers are set here
            return batch

        runner.prepare_inputs = prepare_inputs

    switch = None  # a compiled engine's per-step choice between graphs and eager (graphs.py)
    if is_compiled(runner):
        if not is_v2:
            raise RuntimeError("interlace runs interventions on a compiled engine only with vLLM's V2 GPU runner; "
                               "start this engine with enforce_eager=True")
        switch = GraphSwitch(runner, inter.taps)
        inter.graph_steps = switch.steps  # read by the extension's interlace_step_counts
        inter.pieces_ok = inter.taps is not None and switch.can_piece
        logger.info("interlace: compiled engine; %d custom ops run their CUDA kernels in eager steps",
                    eager_kernels(runner.model))

    elif inter.taps is not None:  # an eager engine runs its taps' Python in every forward: as between pieces
        inter.pieces_ok = True

    def current_layout():
        return layout_from_v2_input_batch(captured["batch"]) if is_v2 else layout_from_v1_runner(runner)

    original_execute = runner.execute_model
    original_sample = runner.sample_tokens
    state = {"in_step": False}
    kv_blocks = KVBlocks(runner)  # intervened requests' KV-cache blocks, zeroed when let go

    @functools.wraps(original_execute)
    def execute_model(scheduler_output, intermediate_tensors=None, *args, **kwargs):
        counts = getattr(scheduler_output, OUTPUT_COUNTS, None)  # tokens each finished invoke returned
        if counts:
            inter.output_counts.update(counts)
        _guard(inter, inter.finish, scheduler_output.finished_req_ids)
        if kv_blocks.held or kv_blocks.marked:  # before this step's forward, which may reuse their blocks
            _guard(inter, kv_blocks.release, scheduler_output.finished_req_ids)
            _guard(inter, kv_blocks.preempted, getattr(scheduler_output, "preempted_req_ids", None) or ())
        if kv_blocks.marked:  # blocks of preempted requests, given to others this step
            _guard(inter, _give_blocks, kv_blocks, scheduler_output)
        unlogged = set(getattr(scheduler_output, UNLOGGED, None) or ())  # program requests never preempted
        for new in scheduler_output.scheduled_new_reqs:
            payload = _payload(new)
            # V2 drops a preempted request's state and adds it again as new when it resumes; its
            # invoke keeps its state here, so the rows recomputed are replayed (StepScheduler.schedule)
            # as on V1, which resumes it in place.
            if payload is not None and new.req_id not in inter.invokes:
                _guard(inter, inter.admit, new.req_id, len(new.prompt_token_ids or ()), payload,
                       new.req_id not in unlogged)
            if payload is not None and _may_write(inter.invokes.get(new.req_id)):
                kv_blocks.hold(new.req_id, new.block_ids)
        if kv_blocks.held or kv_blocks.preempted_waiting:
            _guard(inter, kv_blocks.update, scheduler_output.scheduled_cached_reqs)
        state["in_step"] = inter.active
        scheduled = scheduler_output.num_scheduled_tokens
        inter.tap_step = inter.active and bool(_guard(inter, inter.runs_on_taps, scheduled))
        inter.piece_step = (inter.active and not inter.tap_step and scheduler_output.total_num_scheduled_tokens > 0
                            and bool(_guard(inter, inter.runs_between_pieces, scheduled)))
        if inter.taps is not None and not inter.tap_step:
            _guard(inter, inter.taps.clear)  # ops of an earlier step must not reach this one's rows
        if intermediate_tensors is not None and inter.active:  # an earlier stage's carry
            inter.carry_in = _guard(inter, lambda: unpack(take_carry(intermediate_tensors.tensors))) or {}
        if switch is not None:  # the same choice on every rank: admission is. A step of no tokens
            # (one that only lets finished requests go) runs no forward at all.
            runs = scheduler_output.total_num_scheduled_tokens > 0
            switch.begin(eager=inter.active and not inter.tap_step and not inter.piece_step and runs,
                         taps=inter.tap_step and runs, pieces=inter.piece_step)
        with switch.running() if switch is not None else contextlib.nullcontext():
            output = original_execute(scheduler_output, intermediate_tensors, *args, **kwargs)
        if switch is not None and switch.missed():
            _fail_all(inter, RuntimeError(f"a step that intervenes ran {switch.seen} instead of an eager forward, "
                                          "so interlace's hooks did not run; start the engine with enforce_eager=True"),
                      "a compiled step")
        if inter.piece_step and inter.taps.index and inter.taps.served == 0:
            _fail_all(inter, RuntimeError("a step whose programs run at graph taps never reached a tap: this vLLM "
                                          "did not split its compiled graph there; start the engine with "
                                          "enforce_eager=True"), "a compiled step")
        if output is not None and state["in_step"]:
            state["in_step"] = False
            carry = _guard(inter, inter.end_step)
            if carry and hasattr(output, "tensors"):  # IntermediateTensors for the next stage
                output.tensors.update(_guard(inter, pack, carry, rank["tp_size"], inter.device) or {})
        return output

    @functools.wraps(original_sample)
    def sample_tokens(*args, **kwargs):
        output = original_sample(*args, **kwargs)
        if state["in_step"]:
            state["in_step"] = False
            _guard(inter, inter.end_step)
        return output

    def begin_step(_module, _args, _kwargs):
        if switch is not None and not switch.enter_forward():
            return  # a step with graphs, or one whose invokes fail after it (switch.missed)
        if state["in_step"] and inter.step is None:
            _guard(inter, inter.begin_step, current_layout())

    runner.execute_model = execute_model
    runner.sample_tokens = sample_tokens
    runner.model.register_forward_pre_hook(begin_step, with_kwargs=True)
    return inter


class CallbackSlot:
    """A hook point on a plain method: holds at most one callback, removable like a torch hook."""

    def __init__(self):
        self.callback = None

    def set(self, callback) -> "CallbackSlot":
        self.callback = callback
        return self

    def remove(self) -> None:
        self.callback = None


def _max_over(cpu_group):
    """The element-wise max of a small float array over a process group (gloo, on the host: no
    device sync), for decisions every rank of the TP group must take alike."""
    import numpy as np
    import torch
    import torch.distributed as dist

    def agree_max(values: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=cpu_group)
        return tensor.numpy()

    return agree_max


def _give_blocks(kv_blocks: KVBlocks, scheduler_output) -> None:
    """Every block the scheduler handed out this step, to whom (see KVBlocks.given)."""
    cached = scheduler_output.scheduled_cached_reqs
    kv_blocks.given([*((new.req_id, new.block_ids) for new in scheduler_output.scheduled_new_reqs),
                     *((req_id, blocks) for req_id, blocks in zip(cached.req_ids, cached.new_block_ids)
                       if blocks is not None)])


def _may_write(invoke) -> bool:
    """Whether an intervened request may change its own activations (a program, or an op that
    edits): only those can leave poisoned KV-cache blocks behind (see kv_blocks.py)."""
    return invoke is not None and (invoke.program is not None or any(op.get("op") != "save" for op in invoke.ops))


def _payload(new_request) -> bytes | None:
    params = new_request.sampling_params
    extra = getattr(params, "extra_args", None) if params is not None else None
    return extra.get(PAYLOAD_KEY) if extra else None


def _guard(inter: Interleaver, fn, *args):
    """Run an interleaver phase; an internal failure fails the step's invokes, never the engine."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001
        logger.exception("interlace: internal error in %s", getattr(fn, "__name__", fn))
        _fail_all(inter, exc, f"interlace internals ({getattr(fn, '__name__', fn)})")
        return None


def _fail_all(inter: Interleaver, exc: BaseException, where: str) -> None:
    record = error_record(exc, where=where)
    for inv in inter.invokes.values():
        inv.fail(record)
    if inter.taps is not None:  # a step begun halfway must not run the last one's tapped edits
        inter.taps.clear()
        inter.taps.serve = None
