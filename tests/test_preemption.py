"""A request vLLM preempts (KV cache pressure) is recomputed from its tokens. Declarative ops are
replayed on the recomputed rows exactly (edits applied again, saves not repeated); a program is
not run again for the steps it ran: its logged writes are put back on the recomputed rows and it
runs live from the first step it had not run (workers/write_log.py). Requests with a program are
still preempted last; one whose write log passed its limit fails clearly when it is preempted,
never running on the wrong activations."""

from __future__ import annotations

import os

import pytest
import torch

import interlace
from interlace import ops

PROMPT = "One two three four five six seven eight nine ten. " * 8
MAX_TOKENS = 200
# GPU float32 matmuls run in TF32, whose results depend on the batch a row was computed in
ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2


LOG_MIB = "0.5"  # the small engine's write log limit per invoke (INTERLACE_REPLAY_LOG_MIB)


@pytest.fixture(scope="module")
def small_cache():
    # 2 KiB of KV per token (4 layers x K,V x 64 dims x fp32): 5 blocks of 128 tokens in 1.25 MiB,
    # while six 100 + 200 token requests need up to 18.
    cfg = interlace.Model("tiny-llama").config.model_copy(update={"kv_cache_bytes": 5 * 256 * 1024})
    before = os.environ.get("INTERLACE_REPLAY_LOG_MIB")
    os.environ["INTERLACE_REPLAY_LOG_MIB"] = LOG_MIB  # read by the workers as they start
    try:
        model = interlace.Model(cfg)
        model.engine
    finally:
        if before is None:
            del os.environ["INTERLACE_REPLAY_LOG_MIB"]
        else:
            os.environ["INTERLACE_REPLAY_LOG_MIB"] = before
    yield model
    model.close()


@pytest.fixture(scope="module")
def split_cache():
    """The small cache with steps of 112 tokens at most and no prefix cache: a 100-token prompt
    still fits one step whole (as a program's must at step 0), while a recomputation after a
    preemption (the prompt and the tokens so far, up to 163) is split across steps, its earlier
    chunks only replayed. (With the prefix cache a resumed request reads most of its blocks back
    and recomputes a few tokens; counted once by hand, this test's trace splits 23 recomputations.)"""
    cfg = interlace.Model("tiny-llama").config.model_copy(update={"kv_cache_bytes": 5 * 256 * 1024})
    model = interlace.Model(cfg, max_num_batched_tokens=112, enable_prefix_caching=False)
    model.engine
    yield model
    model.close()


def replays(target) -> int:
    """Chunks recomputed after a preemption and replayed, over the ranks of a Model's engine or of
    every replica of a Cluster."""
    counts = target.step_counts()
    ranks = [rank for replica in counts for rank in replica] if isinstance(counts[0], list) else counts
    return sum(rank["replays"] for rank in ranks)


def write_logs(target) -> tuple[int, int]:
    """Program invokes admitted with a write log and without one (vLLM could never preempt
    them), on the first rank of a Model's engine or of each replica of a Cluster."""
    counts = target.step_counts()
    firsts = [replica[0] for replica in counts] if isinstance(counts[0], list) else [counts[0]]
    return sum(r["write_logs"]["kept"] for r in firsts), sum(r["write_logs"]["skipped"] for r in firsts)


def _ids(oracles) -> list[int]:
    return oracles["tiny-llama"].ids(PROMPT)[:100]


def steering(seed: int):
    """A program that writes every step, through a copy (resid) and a view (a module's output
    edited in place), and saves every step."""
    vector = torch.randn(128, generator=torch.Generator().manual_seed(seed))
    scale = 1.0 + 0.01 * seed

    def program(m):
        m.layers[1].resid += vector
        m.layers[2].mlp.output.mul_(scale)
        m.save("h", m.layers[3].resid)
    return program


def batched_steering():
    """The same as one batched program: each invoke's own vector, a call over every invoke of the
    trace vLLM scheduled (some recomputing rows, at different steps)."""
    vectors = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))

    @interlace.batched
    def program(m):
        h = m.layers[1].resid
        for j, rows in enumerate(m.rows):
            h[rows] += vectors[m.invokes[j]]
        m.layers[2].mlp.output.mul_(1.02)
        m.save("h", m.layers[3].resid)
    return program


def check_steering(small, ample, ids: list[int], batched: bool = False, count: int = 32) -> None:
    """``count`` program invokes steering and saving at every step, 64 tokens each, on ``small`` (a KV
    cache that makes vLLM preempt them) and on ``ample`` (room for all): the same tokens and
    saves, every step saved once. Only invokes vLLM may preempt keep a write log: on ``small``
    most, but not the first (its largest size, 164 tokens and room to spare, fits the cache's
    four blocks alone) nor others first scheduled while the requests ahead of them and they fit;
    none on ``ample``. Those without one are never preempted (else they would fail), and a batched
    call over both kinds logs every write of those that keep one."""
    runs = {}
    together = batched_steering() if batched else None  # one program object: one call per step for all
    for name, model in (("small", small), ("ample", ample)):
        before, logs_before = replays(model), write_logs(model)
        with model.trace(max_tokens=64, ignore_eos=True) as tr:
            for i in range(count):
                tr.invoke(ids, program=together or steering(i))
        runs[name] = (tr.result, replays(model) - before,
                      tuple(now - then for now, then in zip(write_logs(model), logs_before)))
    assert runs["small"][1] > 0 and runs["ample"][1] == 0  # preempted under pressure only
    kept, skipped = runs["small"][2]
    assert kept + skipped == count and kept > 0 and skipped > 0 and runs["ample"][2] == (0, count)
    for got, want in zip(runs["small"][0], runs["ample"][0]):
        assert got.token_ids == want.token_ids
        assert got.saves["h"].shape == (len(ids) + 63, 128)  # every step saved once
        torch.testing.assert_close(got.saves["h"], want.saves["h"], atol=ATOL, rtol=ATOL)


def check_messages(small, ample, ids: list[int]) -> None:
    """A sender patches its prompt into three receivers at step 0 (send/recv), and every invoke
    shares a count at every step (merge sum), on ``small`` (preempted after step 0) and on
    ``ample``: none of it happens twice (the recomputed step 0 replays the receivers' writes, not
    their programs), and tokens and saves are the same."""
    others = [ids[:50] + ids[60:110], ids[:40] + ids[55:115], ids[5:105]]

    def send(m):
        if m.step == 0:
            m.send("clean", m.layers[1].resid.clone())
        m.share("steps", 1, merge="sum")
        m.save("h", m.layers[2].resid)

    def patch(m):
        if m.step == 0:
            clean = m.recv("clean")
            m.layers[1].resid[-20:] = clean[-20:]
            m.share("received", 1, merge="sum")
        m.share("steps", 1, merge="sum")
        m.save("h", m.layers[2].resid)

    runs = {}
    for name, model in (("small", small), ("ample", ample)):
        before = replays(model)
        with model.trace(max_tokens=64, ignore_eos=True) as tr:
            tr.invoke(ids, program=send)
            for prompt in others:
                tr.invoke(prompt, program=patch)
        runs[name] = (tr.result, replays(model) - before)
    assert runs["small"][1] > 0 and runs["ample"][1] == 0
    got, want = runs["small"][0], runs["ample"][0]
    assert got.shared["steps"] == 4 * 64 and got.shared["received"] == 3
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.saves["h"], b.saves["h"], atol=ATOL, rtol=ATOL)
    unpatched = ample.generate(others[0], program=lambda m: None, max_tokens=64, ignore_eos=True)
    assert unpatched.token_ids != got[1].token_ids  # the patch changed what it generated


def test_preempted_programs_replay_their_writes_and_match_an_ample_cache(small_cache, llama, oracles):
    check_steering(small_cache, llama, _ids(oracles))


def test_a_preempted_program_recomputed_in_chunks_replays_the_earlier_ones(split_cache, llama, oracles):
    check_steering(split_cache, llama, _ids(oracles))


def test_a_preempted_batched_program_replays_each_invokes_writes(small_cache, llama, oracles):
    check_steering(small_cache, llama, _ids(oracles), batched=True)


def test_messages_and_shared_values_are_delivered_once_across_preemptions(small_cache, llama, oracles):
    check_messages(small_cache, llama, _ids(oracles))


def test_a_preempted_program_past_its_write_log_fails_clearly_and_the_engine_serves_on(small_cache, oracles):
    """The small engine keeps 0.5 MiB of writes per invoke: this program writes the whole prompt
    at every layer (400 KiB at step 0) and more at each step, so its log is dropped, and when it
    is preempted it fails with the limit named."""
    def heavy(m):
        for i in range(4):
            m.layers[i].mlp.output.mul_(1.0)
            m.layers[i].resid *= 1.0

    with pytest.raises(interlace.InterventionError, match="INTERLACE_REPLAY_LOG_MIB"):
        with small_cache.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
            for _ in range(6):
                tr.invoke(_ids(oracles), program=heavy)
    out = small_cache.generate(_ids(oracles)[:20], ops=[ops.save("layers.1.resid")], max_tokens=2)
    assert out.saves["layers.1.resid"].shape[0] == 21


def test_preempted_ops_are_replayed_exactly(small_cache, llama, oracles):
    ids = _ids(oracles)
    steer = ops.add("layers.1.resid", torch.randn(128, generator=torch.Generator().manual_seed(0)))
    invoke_ops = [steer, ops.save("layers.2.resid"), ops.save("layers.3.resid", tokens="last")]
    replays_before = replays(small_cache)
    with small_cache.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
        for _ in range(6):
            tr.invoke(ids, ops=invoke_ops)
    assert replays(small_cache) > replays_before  # it did preempt

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
    replays_before = replays(small_cache)
    with small_cache.trace(max_tokens=MAX_TOKENS, ignore_eos=True) as tr:
        for _ in range(5):
            tr.invoke(ids, ops=invoke_ops)
        tr.invoke(ids, program=read)
    assert replays(small_cache) > replays_before  # others were preempted

    alone = llama.generate(ids, program=read, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert tr.result[5].token_ids == alone.token_ids
    torch.testing.assert_close(tr.result[5].saves["h"], alone.saves["h"], atol=ATOL, rtol=ATOL)
    alone_ops = llama.generate(ids, ops=invoke_ops, max_tokens=MAX_TOKENS, ignore_eos=True)
    for result in tr.result[:5]:
        assert result.token_ids == alone_ops.token_ids
        torch.testing.assert_close(result.saves["layers.2.resid"], alone_ops.saves["layers.2.resid"], atol=ATOL, rtol=ATOL)


def test_an_unlogged_program_that_vllm_preempts_anyway_fails_naming_why(llama, oracles, monkeypatch):
    """With an ample cache no program keeps a write log (vLLM could never preempt it for room).
    Resetting the prefix cache with requests running preempts them anyway: each program invoke then
    fails, saying its writes cannot be replayed and why, never running on the wrong activations;
    an ops invoke beside them is replayed and comes out as it does undisturbed; the engine serves on."""
    ids = _ids(oracles)
    engine = llama.engine.llm_engine
    preempted = []

    def generate_with_a_reset(trace_id, prompts, params):
        # Model._generate, stepped by hand so the reset lands between two steps of the trace
        names = [f"{trace_id}-{i}" for i in range(len(prompts))]
        for name, prompt, param in zip(names, prompts, params):
            engine.add_request(name, prompt, param)
        outputs, steps = {}, 0
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step() if out.finished)
            steps += 1
            if steps == 6:  # prompts done, a few tokens generated
                preempted.append(engine.reset_prefix_cache(reset_running_requests=True))
        return [outputs[name] for name in names]

    invoke_ops = [ops.save("layers.2.resid", tokens="last")]
    monkeypatch.setattr(llama, "_generate", generate_with_a_reset)
    replays_before = replays(llama)
    with pytest.raises(interlace.InterventionError, match="could never preempt it; vLLM preempted it anyway") as failed:
        with llama.trace(max_tokens=32, ignore_eos=True) as tr:
            tr.invoke(ids, program=steering(0))
            tr.invoke(ids, ops=invoke_ops)
    monkeypatch.undo()
    assert preempted == [True] and replays(llama) > replays_before
    assert "its program's writes cannot be replayed" in str(failed.value)
    alone = llama.generate(ids, ops=invoke_ops, max_tokens=32, ignore_eos=True)
    replayed = failed.value.partial[1]
    assert replayed.token_ids == alone.token_ids
    torch.testing.assert_close(replayed.saves["layers.2.resid"], alone.saves["layers.2.resid"], atol=ATOL, rtol=ATOL)
    after = llama.generate(ids, program=steering(0), max_tokens=4, ignore_eos=True)  # serving on
    assert after.saves["h"].shape == (len(ids) + 3, 128)
