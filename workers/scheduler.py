"""Gang admission: a trace's intervened invokes enter vLLM's scheduler together.

vLLM's engine core starts a step as soon as the first request arrives, so the invokes of one trace
could otherwise land in different steps, and a program that patches invoke 0's activations into
invoke 1 "in the same forward pass" would find nothing to patch. This scheduler (runs in the engine
core process) holds each intervened request until every intervened invoke of its trace has arrived,
then queues them together in invoke order: they share a step whenever the token budget allows
(``max_num_batched_tokens``, ``max_num_seqs``). Held requests that already fill a step's budget go
on at once, as a group: the ones behind them could not have joined their step anyway, and holding
a large trace until its last request arrives left the GPU idle while the driver added them (plain
vLLM starts on requests as they come). A trace that fits one step still runs as one batch, the
same one every time it runs (vLLM's results depend on the batch a request shares, in the last
bits). Plain requests pass straight through.

It also keeps whole the prompts of requests whose program runs at step 0 (a program sees the
whole prompt at once; only the first time: recomputed after a preemption, its rows are replayed
from the write log and may be split): while such a request waits, chunked prefill is off for that
scheduling pass, so a prompt that does not fit the step's remaining token budget waits for the
next step instead of being split. This is skipped while any waiting prompt exceeds the whole budget (it
could never be admitted unsplit and would block the queue); a program prompt that is split
anyway fails with a message naming the fix.

When the KV cache runs short, vLLM preempts the running request that came last (first-come
first-served) and recomputes it later. Declarative ops and plain requests come through that
exactly (ops are replayed on the recomputed rows); a program's cannot, so its invoke fails
(step_schedule.py, ``StepScheduler.schedule``). So requests with a program go first in vLLM's
running queue: vLLM preempts them only when no other running request is left to preempt. (Under
vLLM's ``priority`` policy the user's priorities decide, as they would without interlace.)

A program request that vLLM could never preempt keeps no write log (write_log.py): the workers
learn which (``SchedulerOutput.interlace_unlogged``) as it is first scheduled. With programs ahead
of plain requests and vLLM preempting from the end, a program request is preempted only once
every request behind it is, so only the program requests ahead of it hold blocks then; if
their and its own largest size (prompt and ``max_tokens``, with room to spare) fitted the whole
cache when it was first scheduled, they still do (requests only leave from ahead of it: preempted
ones come back behind it), and it never is. Logging costs every step a host copy of what
programs wrote; an ample cache, the usual case, pays none of it. Under the ``priority`` policy,
a KV connector or several KV-cache groups, every program request logs.

It also tells the workers how many tokens each finished intervened request returned
(``SchedulerOutput.interlace_output_counts``, next to vLLM's ``finished_req_ids``). Under
asynchronous scheduling (vLLM's default on GPUs) the scheduler plans step k+1 before step k's
token is known, so a request whose step k sampled EOS (or a stop token) has already been
scheduled, and run by the workers, for one step more (``AsyncScheduler`` skips that extra step
only for ``max_tokens``: vllm/v1/core/sched/scheduler.py, the ``num_output_placeholders`` check in
``schedule``). That step's token is dropped; the workers drop what programs did in it
(interleaver.py, ``Interleaver.finish``).

Selected with ``scheduler_cls="interlace.workers.scheduler.make_scheduler"``; it subclasses
whichever scheduler vLLM would have used (async scheduling keeps working).
"""

from __future__ import annotations

import operator

GANG_KEY = "interlace_gang"  # extra_args[GANG_KEY] = [trace id, invoke index, intervened invokes]
WHOLE_PROMPT_KEY = "interlace_whole_prompt"  # extra_args[WHOLE_PROMPT_KEY] = True: do not split
PROGRAM_KEY = "interlace_program"  # extra_args[PROGRAM_KEY] = True: a program runs (preempt it last)
# SchedulerOutput attribute: {request id: output tokens} of intervened requests finished since the
# last step (pickled with the output to every rank; read by workers/runner_hooks.py)
OUTPUT_COUNTS = "interlace_output_counts"
# SchedulerOutput attribute: ids of program requests first scheduled in this step that vLLM can
# never preempt (read by workers/runner_hooks.py: they keep no write log)
UNLOGGED = "interlace_unlogged"


class GangAdmission:
    """Mixed into vLLM's Scheduler: holds requests until their trace's gang is complete, keeps
    program prompts whole, and has vLLM preempt requests with a program last."""

    def _interlace_start(self, vllm_config=None) -> None:
        """interlace's state beside vLLM's, once vLLM's scheduler is built (``vllm_config`` None:
        nothing known of the model or the cache; every program request logs)."""
        self._interlace_held: dict[str, _Held] = {}  # by trace
        self._interlace_whole_waiting = False  # a request that needs its prompt whole may wait
        self._interlace_programs = set()  # live requests with a program, by id: preempted last
        self._interlace_counts = {}  # finished intervened requests' output tokens, for the next step
        self._interlace_all_fit = vllm_config is not None and (
            vllm_config.model_config.max_model_len <= vllm_config.scheduler_config.max_num_batched_tokens)
        self._interlace_blocks = _never_preempted_rule(self, vllm_config) if vllm_config is not None else None
        self._interlace_undecided = 0  # program requests not scheduled yet (whether they log is decided then)

    def schedule(self, *args, **kwargs):
        if self._interlace_programs and self.policy.value == "fcfs":
            # vLLM preempts from the end of the running queue: programs first (a stable sort keeps
            # each kind in vLLM's order). Only while a program request is live: plain traffic
            # never pays for it. The key is an attribute read in C: a lambda per request cost a
            # thousand running requests 0.2 ms a step.
            self.running.sort(key=_PLAIN)
        config = self.scheduler_config
        if not config.enable_chunked_prefill or not self._interlace_keep_whole():
            return self._interlace_after(super().schedule(*args, **kwargs))
        config.enable_chunked_prefill = False  # read by vLLM only while admitting waiting requests
        try:
            return self._interlace_after(super().schedule(*args, **kwargs))
        finally:
            config.enable_chunked_prefill = True

    def _interlace_after(self, output):
        """After vLLM's pass: ``output`` carrying the output token counts of the intervened
        requests freed since the last step (their ids are in its ``finished_req_ids``, or, freed
        during this very pass, in the next one's: the workers keep counts until the id finishes)
        and the program requests first scheduled now that need no write log; and the prompts
        first scheduled now no longer kept whole."""
        if self._interlace_whole_waiting:
            for new in output.scheduled_new_reqs:
                # Its program sees the prompt whole now. Recomputed after a preemption, its rows are
                # replayed from the write log, so it may be split then, as vLLM splits any other
                # recompute: held whole, it could stall the queue behind it for want of room.
                request = self.requests.get(new.req_id)
                if request is not None:
                    request.interlace_whole = False
        if self._interlace_undecided and output.scheduled_new_reqs:
            setattr(output, UNLOGGED, self._interlace_never_preempted(output))
        if self._interlace_counts:
            setattr(output, OUTPUT_COUNTS, self._interlace_counts)
            self._interlace_counts = {}
        return output

    def _interlace_never_preempted(self, output) -> list[str]:
        """The program requests first scheduled in ``output`` that vLLM can never preempt (see
        the module's docstring): the blocks the program requests ahead of each (and its own)
        could ever take fit the cache."""
        new = [self.requests.get(r.req_id) for r in output.scheduled_new_reqs]
        new = {r.request_id for r in new if r is not None and not r.interlace_plain and r.interlace_logs is None}
        if not new:
            return []
        self._interlace_undecided -= len(new)
        blocks, spare, model_len = self._interlace_blocks
        never = []
        taken = 0
        for request in self.running:  # programs keep their order when sorted ahead of plain requests
            if request.interlace_plain:
                continue
            largest = min(request.num_prompt_tokens + (request.max_tokens or model_len), model_len)
            taken += -(-(largest + spare) // self.block_size)
            if taken > blocks:  # so for every program request from here on: they log
                break
            if request.request_id in new:
                request.interlace_logs = False
                never.append(request.request_id)
        for request_id in new.difference(never):
            self.requests[request_id].interlace_logs = True
        return never

    def _interlace_keep_whole(self) -> bool:
        if not self._interlace_whole_waiting:  # plain traffic never pays for the scans below
            return False
        if self._interlace_all_fit:  # no request can exceed a step's budget: the first wanted one decides
            wanted = any(request.interlace_whole for request in self.waiting)
        else:
            budget = self.scheduler_config.max_num_batched_tokens
            wanted = False
            for request in self.waiting:
                if request.num_tokens > budget:
                    return False
                wanted = wanted or request.interlace_whole
        self._interlace_whole_waiting = wanted
        return wanted

    def add_request(self, request) -> None:
        gang = _gang(request)
        if gang is None or gang[2] <= 1 or request.request_id in self.requests:
            return self._interlace_enqueue(request)
        trace, _index, size = gang
        held = self._interlace_held.get(trace)
        if held is None:
            held = self._interlace_held[trace] = _Held()
        held.arrived += 1
        if held.open:  # a partner was aborted: the rest go on as they come
            self._interlace_enqueue(request)
        else:
            held.requests.append(request)
            held.tokens += request.num_tokens
        config = self.scheduler_config
        if held.arrived == size:
            del self._interlace_held[trace]
            self._interlace_release(held)
        elif held.tokens >= config.max_num_batched_tokens or len(held.requests) >= config.max_num_seqs:
            self._interlace_release(held)  # a step's worth: the rest could not join its step

    def finish_requests(self, request_ids, finished_status):
        # An aborted request of an incomplete gang would hold the others forever: release them
        # (they run without their partner), drop the aborted one, and let later ones through.
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids or ())
        for held in self._interlace_held.values():
            if any(r.request_id in ids for r in held.requests):
                held.requests = [r for r in held.requests if r.request_id not in ids]
                held.open = True
                self._interlace_release(held)
        return super().finish_requests(request_ids, finished_status)

    def _interlace_release(self, held: "_Held") -> None:
        for request in sorted(held.requests, key=lambda r: _gang(r)[1]):
            self._interlace_enqueue(request)
        held.requests, held.tokens = [], 0

    def _interlace_enqueue(self, request) -> None:
        """Hand ``request`` to vLLM's waiting queue (every request comes this way: its marks,
        read at every step, are attributes)."""
        extra = _extra(request)
        request.interlace_whole = bool(extra.get(WHOLE_PROMPT_KEY))
        request.interlace_plain = not extra.get(PROGRAM_KEY)
        if request.interlace_whole:
            self._interlace_whole_waiting = True
        if not request.interlace_plain and getattr(request, "interlace_logs", None) is None:
            request.interlace_logs = None  # decided as it is first scheduled (None: not yet)
            self._interlace_undecided += self._interlace_blocks is not None
        if not request.interlace_plain:
            self._interlace_programs.add(request.request_id)
        super().add_request(request)

    def _free_request(self, request, *args, **kwargs):
        self._interlace_programs.discard(request.request_id)  # finished or aborted
        if getattr(request, "interlace_logs", False) is None and self._interlace_blocks is not None:
            self._interlace_undecided -= 1  # aborted before it was ever scheduled
        if _gang(request) is not None:  # intervened: its workers learn how many tokens it returned
            self._interlace_counts[request.request_id] = request.num_output_tokens
        return super()._free_request(request, *args, **kwargs)


def _never_preempted_rule(scheduler, vllm_config) -> tuple[int, int, int] | None:
    """``(blocks in the cache, tokens of room each request may take past its largest size, the
    model's length)`` where requests that could never be preempted can be told (module docstring), else None."""
    blocks = getattr(getattr(scheduler, "cache_config", None), "num_gpu_blocks", None)
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None)
    if (not blocks or groups is None or len(groups) != 1 or getattr(scheduler, "connector", None) is not None
            or scheduler.policy.value != "fcfs" or not getattr(scheduler, "block_size", None)):
        return None  # a vLLM whose scheduler differs from the one this was written against: log them all
    speculative = vllm_config.speculative_config
    lookahead = (speculative.num_speculative_tokens or 0) if speculative is not None else 0
    # a block of vLLM's own (the null block) is never given; two blocks of room past the largest
    # size cover async scheduling's placeholder token and a partly filled last block
    return blocks - 1, 2 * scheduler.block_size + lookahead, vllm_config.model_config.max_model_len


class _Held:
    """A gang's requests waiting for their partners."""

    __slots__ = ("arrived", "requests", "tokens", "open")

    def __init__(self):
        self.arrived = 0  # of the gang's requests, held or gone on
        self.requests: list = []  # held, in arrival order
        self.tokens = 0  # their prompt tokens
        self.open = False  # a partner was aborted: hold no more


_PLAIN = operator.attrgetter("interlace_plain")  # requests without a program sort first: preempted last


def _extra(request) -> dict:
    params = getattr(request, "sampling_params", None)
    return (getattr(params, "extra_args", None) if params is not None else None) or {}


def _gang(request):
    return _extra(request).get(GANG_KEY)


_CLASSES: dict[type, type] = {}


def make_scheduler(*args, vllm_config, **kwargs):
    """Build vLLM's default scheduler for this config, with gang admission mixed in."""
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as base
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as base
    cls = _CLASSES.setdefault(base, type(f"Gang{base.__name__}", (GangAdmission, base), {}))
    scheduler = cls(*args, vllm_config=vllm_config, **kwargs)
    scheduler._interlace_start(vllm_config)
    return scheduler
