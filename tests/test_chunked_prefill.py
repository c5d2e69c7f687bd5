"""Chunked prefill: long prompts split across scheduler steps.

Declarative ops are row-wise, so they stay exact across chunks. A program sees step 0 once, with
the whole prompt: the scheduler keeps program prompts whole when they fit the token budget, and a
prompt longer than the whole budget fails the program with a message naming the fix.

The engine also declares graph taps at layers 0 and 3, which the other tests here leave alone (their
ops run in hooks): ops at taps, too, set each step's rows from that step's chunk. One engine for
both, as each engine start costs about half a minute of the suite.
"""

from __future__ import annotations

import pytest
import torch

import interlace
from interlace import ops
from test_taps import tap_steps, vector

ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2  # GPU float32 matmuls run in TF32
CHUNKED_TAPS = ["layers.0.resid", "layers.3.resid"]


@pytest.fixture(scope="module")
def chunked():
    model = interlace.Model("tiny-llama", enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8,
                            graph_taps=CHUNKED_TAPS)
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


def test_patching_across_invokes_in_a_trace_larger_than_a_step(chunked, oracles):
    """Six 10-token program invokes under a 32-token budget: the scheduler lets the first step's
    worth go on before the last ones arrive (workers/scheduler.py), and invokes 0 and 1 still share
    their step, so 1 patches 0's residual in; the rest run in later steps."""
    oracle = oracles["tiny-llama"]
    prompts = [oracle.ids(f"Prompt number {i} talks about steering vectors and residual streams")[:10]
               for i in range(6)]
    pos = 7

    def send_clean(m):
        m.send("clean", m.layers[1].resid.clone())

    def patch(m):
        m.layers[1].resid[pos] = m.recv("clean")[pos]
        m.save("logits", m.logits)

    def keep(m):
        m.save("logits", m.logits)

    with chunked.trace(max_tokens=1) as tr:
        for i, ids in enumerate(prompts):
            tr.invoke(ids, program={0: send_clean, 1: patch}.get(i, keep))
    clean_resid = oracle.run(prompts[0])["resid"][1]

    def hf_patch(out):
        out = out.clone()
        out[0, pos] = clean_resid[pos]
        return out

    expected = oracle.run(prompts[1], hooks={oracle.layers[1]: hf_patch})["logits"][-1]
    torch.testing.assert_close(tr.result[1].saves["logits"][0], expected, atol=ATOL, rtol=ATOL)
    for ids, result in zip(prompts[2:], tr.result[2:]):
        torch.testing.assert_close(result.saves["logits"][-1], oracle.run(ids)["logits"][-1], atol=ATOL, rtol=ATOL)


def test_ops_at_taps_stay_exact_when_prefill_is_chunked(chunked, oracles, long_ids):
    """A 100-token prompt in chunks of at most 32 tokens, beside a short prompt, every op at a
    tap: each step's rows are set from that step's chunk (transformers on the whole sequence is
    the reference)."""
    oracle = oracles["tiny-llama"]
    short = oracle.ids("Hello there")
    steer, patch = vector(11), vector(12)
    oplist = [ops.add("layers.0.resid", steer), ops.save("layers.0.resid", name="after", steps=[0]),
              ops.replace("layers.3.resid", patch, tokens=[5, 50]), ops.save("layers.3.resid", name="last", tokens="last")]
    before = tap_steps(chunked)
    with chunked.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(long_ids, ops=oplist)
        tr.invoke(short, ops=[ops.save("layers.0.resid", name="short", steps=[0])])
    assert tap_steps(chunked) >= before + 4 + 2  # every chunk of the prompt, then decoding

    def patched(out):
        out = out.clone()
        out[0, [p for p in (5, 50) if p < out.shape[1]]] = patch
        return out

    hooks = {oracle.layers[0]: lambda out: out + steer, oracle.layers[3]: patched}
    got = tr.result[0]
    assert got.token_ids == oracle.greedy(long_ids, 3, hooks=hooks)
    ref = oracle.run(long_ids + got.token_ids[:-1], hooks)["resid"]
    # the reference captures each layer's output before the hooks above change it
    torch.testing.assert_close(got.saves["after"], ref[0][: len(long_ids)] + steer, atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got.saves["last"], ref[3][len(long_ids) - 1:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(tr.result[1].saves["short"], oracle.run(short)["resid"][0], atol=ATOL, rtol=ATOL)
