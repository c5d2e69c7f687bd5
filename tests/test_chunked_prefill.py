"""Chunked prefill: long prompts split across scheduler steps.

Declarative ops are row-wise, so they stay exact across chunks. A program sees step 0 once, with
the whole prompt: the scheduler keeps program prompts whole when they fit the token budget, and a
prompt longer than the whole budget fails the program with a message naming the fix.
"""

from __future__ import annotations

import pytest
import torch

import interlace
from interlace import ops

ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2  # GPU float32 matmuls run in TF32


@pytest.fixture(scope="module")
def chunked():
    model = interlace.Model("tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8)
    model.engine
    yield model
    model.close()


@pytest.fixture(scope="module")
def long_ids(oracles):
    ids = oracles["tiny-llama"].ids("Steering vectors add a direction to the residual stream. " * 12)[:100]
    assert len(ids) == 100  # > 32: split into several chunks
    return ids


def test_ops_are_exact_across_chunks(chunked, oracles, long_ids):
    oracle = oracles["tiny-llama"]
    out = chunked.generate(long_ids, ops=[ops.save("layers.1.resid", name="all", steps=[0]),
                                          ops.save("layers.2.resid", name="last", tokens="last", steps=[0])])
    ref = oracle.run(long_ids)["resid"]
    torch.testing.assert_close(out.saves["all"], ref[1], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out.saves["last"], ref[2][-1:], atol=ATOL, rtol=ATOL)


def test_steering_op_across_chunks_matches_transformers(chunked, oracles, long_ids):
    oracle = oracles["tiny-llama"]
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 2
    expected = oracle.greedy(long_ids, 4, hooks={oracle.layers[1]: lambda out: out + vector})
    out = chunked.generate(long_ids, ops=[ops.add("layers.1.resid", vector)], max_tokens=4, ignore_eos=True)
    assert out.token_ids == expected


def test_program_on_a_split_prompt_names_the_fix(chunked, long_ids):
    with pytest.raises(interlace.InterventionError, match="chunked prefill.*enable_chunked_prefill=False"):
        chunked.generate(long_ids, program=lambda m: m.save("x", m.layers[1].resid))


def test_program_on_a_prompt_that_fits_works(chunked, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("The capital of France is")
    out = chunked.generate(ids, program=lambda m: m.save("x", m.layers[1].resid))
    torch.testing.assert_close(out.saves["x"], oracle.run(ids)["resid"][1], atol=ATOL, rtol=ATOL)


def test_program_prompts_sharing_the_budget_are_not_split(chunked, oracles):
    """Three 20-token prompts under a 32-token budget: vLLM would split the second one across
    steps; the scheduler runs each whole in its own step instead."""
    oracle = oracles["tiny-llama"]
    prompts = [oracle.ids(f"Prompt number {i} talks about steering vectors and residual streams")[:20]
               for i in range(3)]
    with chunked.trace(max_tokens=2) as tr:
        for ids in prompts:
            tr.invoke(ids, program=lambda m: m.save("x", m.layers[1].resid) if m.step == 0 else None)
    for ids, result in zip(prompts, tr.result):
        assert len(ids) == 20
        torch.testing.assert_close(result.saves["x"], oracle.run(ids)["resid"][1], atol=ATOL, rtol=ATOL)


def test_batched_program_spans_invokes_admitted_in_different_steps(chunked, oracles):
    """Three 20-token prompts under a 32-token budget enter in three steps, so at any scheduler
    step the invokes are at different generation steps. A batched program still runs once per
    scheduler step over all of them (``m.steps`` tells each one's step), and every invoke's saves
    are its own; ``m.step`` refuses to pick one step for the call."""
    oracle = oracles["tiny-llama"]
    prompts = [oracle.ids(f"Prompt number {i} talks about steering vectors and residual streams")[:20]
               for i in range(3)]

    @interlace.batched
    def sweep(m):
        m.save("steps", torch.tensor(m.steps).reshape(-1, 1))
        m.save("last", m.last(m.layers[1].resid))

    with chunked.trace(max_tokens=3, ignore_eos=True) as tr:
        for ids in prompts:
            tr.invoke(ids, program=sweep)
    for ids, result in zip(prompts, tr.result):
        assert result.saves["steps"].flatten().tolist() == [0, 1, 2]
        ref = chunked.generate(ids, program=lambda m: m.save("last", m.last(m.layers[1].resid)),
                               max_tokens=3, ignore_eos=True)
        assert result.token_ids == ref.token_ids
        torch.testing.assert_close(result.saves["last"], ref.saves["last"], atol=ATOL, rtol=ATOL)

    @interlace.batched
    def uses_step(m):
        if m.step == 0:
            m.save("x", m.last(m.layers[1].resid))

    with pytest.raises(interlace.InterventionError, match=r"generation steps \[0, 1\].*m\.steps\[j\]"):
        with chunked.trace(max_tokens=3, ignore_eos=True) as tr:
            for ids in prompts:
                tr.invoke(ids, program=uses_step)
