"""A program sees exactly the steps whose tokens vLLM returns.

Under asynchronous scheduling (vLLM's default on GPUs; CPUs run without it) a request that
samples EOS at step k has been scheduled, and run, for step k+1 before the scheduler sees its
token. The gang scheduler tells the workers how many tokens each finished intervened request
returned, and the workers drop what its program did past them. The engine-level check
(``check_invokes_stop_at_eos``) runs in tests/test_interventions.py (CPU, and every parallel
layout through tests/test_parallel.py) and on GPUs, eager and compiled, in tests/test_gpu_numerics.py;
these are its pieces on their own.
"""

from types import SimpleNamespace

import torch

from interlace.workers.scheduler import GANG_KEY, OUTPUT_COUNTS, GangAdmission
from interlace.workers.slots import SlotTable
from interlace.workers.states import InvokeState


class _Base:
    """Stands in for vLLM's Scheduler: what GangAdmission calls of it."""

    def __init__(self):
        self.scheduler_config = SimpleNamespace(enable_chunked_prefill=False)
        self.policy = SimpleNamespace(value="fcfs")
        self.running = []

    def schedule(self):
        return SimpleNamespace(finished_req_ids=set())

    def _free_request(self, request):
        return None


def _scheduler():
    scheduler = type("Gang", (GangAdmission, _Base), {})()
    scheduler._interlace_start()
    return scheduler


def _request(req_id: str, tokens: int, intervened: bool):
    extra = {GANG_KEY: ["trace", 0, 1]} if intervened else {}
    return SimpleNamespace(request_id=req_id, num_output_tokens=tokens,
                           sampling_params=SimpleNamespace(extra_args=extra))


def test_the_next_step_tells_the_workers_how_many_tokens_each_finished_invoke_returned():
    scheduler = _scheduler()
    scheduler._free_request(_request("a", 4, intervened=True))
    scheduler._free_request(_request("plain", 7, intervened=False))  # plain requests cost nothing
    assert getattr(scheduler.schedule(), OUTPUT_COUNTS) == {"a": 4}
    assert not hasattr(scheduler.schedule(), OUTPUT_COUNTS)  # told once


def test_values_and_shares_of_steps_past_the_last_returned_token_are_dropped():
    state = InvokeState("r", 0, "t", 0, 3, None, None, [], None, "dir:/tmp", 1.0, 1 << 20)
    for step in range(5):
        state.saves.setdefault("step", []).append(step)
        state.save_steps.setdefault("step", []).append(step)
        state.shared.append(("steps", "append", step))
        state.shared_steps.append(step)
    state.saves["late"], state.save_steps["late"] = [torch.zeros(())], [4]
    state.keep_steps_to(3)
    assert state.saves == {"step": [0, 1, 2, 3]} and state.save_steps == {"step": [0, 1, 2, 3]}
    assert [value for _n, _how, value in state.shared] == [0, 1, 2, 3] and state.shared_steps == [0, 1, 2, 3]


def test_an_error_met_past_the_last_returned_token_is_dropped_one_met_before_is_kept():
    slots = SlotTable()
    states = []
    for failed_at in (4, 3):
        slot = slots.add(prompt_len=3, max_save_bytes=1 << 20, timeout_s=1.0, invoke=0, some_steps=False)
        state = InvokeState("r", slot, "t", 0, 3, None, None, [], None, "dir:/tmp", 1.0, 1 << 20, slots=slots)
        slots.next_position[slot] = 3 + failed_at  # the step scheduled when the program failed
        state.fail({"type": "ValueError", "message": f"at step {failed_at}"})
        slots.next_position[slot] = 3 + 4
        state.keep_steps_to(3)
        states.append(state)
    assert states[0].error is None
    assert states[1].error == {"type": "ValueError", "message": "at step 3"}
