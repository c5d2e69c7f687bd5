"""A request vLLM preempts and recomputes cannot have its interventions replayed: it must fail
clearly, never run with interventions applied to the wrong tokens."""

from __future__ import annotations

import pytest

import interlace
from interlace import ops


@pytest.fixture(scope="module")
def small_cache():
    # 2 KiB of KV per token (4 layers x K,V x 64 dims x fp32): 5 blocks of 128 tokens in 1.25 MiB,
    # while six 100 + 200 token requests need up to 18.
    cfg = interlace.Model("tiny-llama").config.model_copy(update={"kv_cache_bytes": 5 * 256 * 1024})
    model = interlace.Model(cfg)
    model.engine
    yield model
    model.close()


def test_preempted_request_fails_clearly_and_the_engine_serves_on(small_cache, oracles):
    ids = oracles["tiny-llama"].ids("One two three four five six seven eight nine ten. " * 8)[:100]
    with pytest.raises(interlace.InterventionError, match="preempted this request"):
        with small_cache.trace(max_tokens=200, ignore_eos=True) as tr:
            for _ in range(6):
                tr.invoke(ids, ops=[ops.save("layers.1.resid", tokens="last")])
    out = small_cache.generate(ids[:20], ops=[ops.save("layers.1.resid")], max_tokens=2)
    assert out.saves["layers.1.resid"].shape[0] == 21
