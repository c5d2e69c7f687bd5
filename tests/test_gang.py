"""Gang admission in vLLM's own scheduler (workers/scheduler.py), on its own, with no engine.

A trace's intervened requests wait for each other, so that they share a step when the token
budget allows; a step's worth of them goes on at once (holding more buys nothing and leaves the
engine idle while the driver adds the rest). The
engine-level checks (patching across invokes, batched programs over many steps) are in
tests/test_interventions.py and tests/test_chunked_prefill.py.
"""

from __future__ import annotations

import pytest
import torch

from interlace.core.tiny_models import ensure_tiny_model
from interlace.workers.scheduler import GANG_KEY, PROGRAM_KEY, WHOLE_PROMPT_KEY, make_scheduler

BUDGET = 32  # tokens a step may take
PROMPT = 10  # tokens each request's prompt has: three fit a step, four do not


@pytest.fixture
def scheduler():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = EngineArgs(model=str(ensure_tiny_model("tiny-llama")), max_num_batched_tokens=BUDGET, max_num_seqs=8,
                        enable_chunked_prefill=True, max_model_len=256).create_engine_config()
    config.cache_config.num_gpu_blocks = 100
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return make_scheduler(vllm_config=config, kv_cache_config=kv, block_size=16,
                          structured_output_manager=StructuredOutputManager(config))


def request(invoke: int, gang: int | None, program: bool = True, trace: str = "t"):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = {} if gang is None else {GANG_KEY: [trace, invoke, gang]}
    if program:
        extra.update({PROGRAM_KEY: True, WHOLE_PROMPT_KEY: True})
    params = SamplingParams(max_tokens=4, extra_args=extra or None)
    return Request(f"{trace}-{invoke}", list(range(3, 3 + PROMPT)), params, None)


def waiting(scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def test_program_requests_wait_for_a_step_worth_of_partners(scheduler):
    for invoke in range(3):
        scheduler.add_request(request(invoke, gang=6))
    assert waiting(scheduler) == []  # 30 tokens: the fourth could still share their step
    scheduler.add_request(request(3, gang=6))
    assert waiting(scheduler) == ["t-0", "t-1", "t-2", "t-3"]  # 40 tokens: more than a step holds
    step = scheduler.schedule()
    assert sorted(r.req_id for r in step.scheduled_new_reqs) == ["t-0", "t-1", "t-2"]  # together, whole
    scheduler.add_request(request(4, gang=6))
    assert waiting(scheduler) == ["t-3"]  # held again: invoke 5 may still share a step with it
    scheduler.add_request(request(5, gang=6))
    assert waiting(scheduler) == ["t-3", "t-4", "t-5"]


def test_held_requests_enter_in_invoke_order(scheduler):
    for invoke in (1, 0):
        scheduler.add_request(request(invoke, gang=2))
    assert waiting(scheduler) == ["t-0", "t-1"]


def test_a_gang_of_one_and_plain_requests_wait_for_nobody(scheduler):
    scheduler.add_request(request(0, gang=3))  # waits for the other two
    scheduler.add_request(request(0, gang=1, program=False, trace="one"))  # a one-invoke trace of ops
    scheduler.add_request(request(0, gang=None, program=False, trace="plain"))  # a plain request
    assert waiting(scheduler) == ["one-0", "plain-0"]


def test_an_aborted_partner_lets_the_others_go(scheduler):
    from vllm.v1.request import RequestStatus

    scheduler.add_request(request(0, gang=3))
    scheduler.add_request(request(1, gang=3))
    scheduler.finish_requests("t-0", RequestStatus.FINISHED_ABORTED)
    assert waiting(scheduler) == ["t-1"]
    scheduler.add_request(request(2, gang=3))  # would otherwise wait for invoke 0 forever
    assert waiting(scheduler) == ["t-1", "t-2"]


def test_a_trace_gangs_its_intervened_invokes():
    from interlace import ops
    from interlace.cluster.assembly import build_requests
    from interlace.core.trace import Invoke, encode_payloads

    def program(m):
        m.save("x", m.layers[0].resid)

    invokes = [Invoke([5, 6], program=program), Invoke([5, 7], ops=[ops.zero("layers.0.resid")]), Invoke([5, 8])]
    payloads = encode_payloads(invokes, "t", "dir:/tmp", 10.0, 1 << 20)
    _prompts, params = build_requests([inv.prompt for inv in invokes], payloads, {"max_tokens": 1}, "t")
    assert [(p.extra_args or {}).get(GANG_KEY) for p in params] == [["t", 0, 2], ["t", 1, 2], None]  # plain: none


def test_a_program_prompt_is_kept_whole_only_until_it_is_first_scheduled(scheduler):
    """Recomputed after a preemption, a program request's rows are replayed from its write log:
    it may be split then, and does not keep chunked prefill off for the requests behind it."""
    scheduler.add_request(request(0, gang=1))
    assert scheduler._interlace_keep_whole()  # its program has not seen its prompt yet
    step = scheduler.schedule()
    assert [r.req_id for r in step.scheduled_new_reqs] == ["t-0"]
    preempted = scheduler.requests["t-0"]
    scheduler.running.remove(preempted)  # as vLLM preempts it: back to the front of the queue
    scheduler.waiting.prepend_request(preempted)
    assert not scheduler._interlace_keep_whole()
