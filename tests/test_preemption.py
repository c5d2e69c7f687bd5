"""A request vLLM preempts (KV cache pressure) is recomputed from scratch. Declarative ops are
replayed on the recomputed rows exactly (edits applied again, saves not repeated); a program's
accesses cannot be, so requests with a program are preempted last, and one that is preempted all
the same fails clearly, never running on the wrong tokens."""

from __future__ import annotations

import pytest
import torch

import interlace
from interlace import ops

PROMPT = "One two three four five six seven eight nine ten. " * 8
MAX_TOKENS = 200
# GPU float32 matmuls run in TF32, whose results depend on the batch a row was computed in
ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2


@pytest.fixture(scope="module")
def small_cache():
    # 2 KiB of KV per token (4 layers x K,V x 64 dims x fp32): 5 blocks of 128 tokens in 1.25 MiB,
    # while six 100 + 200 token requests need up to 18.
    cfg = interlace.Model("tiny-llama").config.model_copy(update={"kv_cache_bytes": 5 * 256 * 1024})
    model = interlace.Model(cfg)
    model.engine
    yield model
    model.close()


def _ids(oracles) -> list[int]:
    return oracles["tiny-llama"].ids(PROMPT)[:100]


def test_preempted_program_fails_clearly_and_the_engine_serves_on(small_cache, oracles):
    def read(m):
        m.save("h", m.last(m.layers[1].resid))

    with pytest.raises(interlace.InterventionError, match="preempted this request"):
        with small_cache.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
            for _ in range(6):
                tr.invoke(_ids(oracles), program=read)
    out = small_cache.generate(_ids(oracles)[:20], ops=[ops.save("layers.1.resid")], max_tokens=2)
    assert out.saves["layers.1.resid"].shape[0] == 21


def test_preempted_ops_are_replayed_exactly(small_cache, llama, oracles):
    ids = _ids(oracles)
    steer = ops.add("layers.1.resid", torch.randn(128, generator=torch.Generator().manual_seed(0)))
    invoke_ops = [steer, ops.save("layers.2.resid"), ops.save("layers.3.resid", tokens="last")]
    replays_before = sum(small_cache.engine.collective_rpc("interlace_replays"))
    with small_cache.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
        for _ in range(6):
            tr.invoke(ids, ops=invoke_ops)
    assert sum(small_cache.engine.collective_rpc("interlace_replays")) > replays_before  # it did preempt

    alone = llama.generate(ids, ops=invoke_ops, max_tokens=MAX_TOKENS, ignore_eos=True)  # room for all
    for result in tr.result:
        assert result.token_ids == alone.token_ids  # steered the same, recomputed rows included
        for name in ("layers.2.resid", "layers.3.resid"):  # each row saved once
            assert result.saves[name].shape == alone.saves[name].shape
            torch.testing.assert_close(result.saves[name], alone.saves[name], atol=ATOL, rtol=ATOL)


def test_programs_are_preempted_last_so_one_among_ops_invokes_completes_exactly(small_cache, llama, oracles):
    """The program's invoke comes last, the request vLLM would preempt first by itself; the ops
    invokes are preempted instead (and replayed), and the program runs through undisturbed."""
    ids = _ids(oracles)

    def read(m):
        m.save("h", m.last(m.layers[1].resid))

    invoke_ops = [ops.save("layers.2.resid", tokens="last")]
    replays_before = sum(small_cache.engine.collective_rpc("interlace_replays"))
    with small_cache.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
        for _ in range(5):
            tr.invoke(ids, ops=invoke_ops)
        tr.invoke(ids, program=read)
    assert sum(small_cache.engine.collective_rpc("interlace_replays")) > replays_before  # others were preempted

    alone = llama.generate(ids, program=read, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert tr.result[5].token_ids == alone.token_ids
    torch.testing.assert_close(tr.result[5].saves["h"], alone.saves["h"], atol=ATOL, rtol=ATOL)
    alone_ops = llama.generate(ids, ops=invoke_ops, max_tokens=MAX_TOKENS, ignore_eos=True)
    for result in tr.result[:5]:
        assert result.token_ids == alone_ops.token_ids
        torch.testing.assert_close(result.saves["layers.2.resid"], alone_ops.saves["layers.2.resid"], atol=ATOL, rtol=ATOL)
