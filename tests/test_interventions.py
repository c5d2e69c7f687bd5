"""Interventions on one engine, checked against transformers (float32, same weights)."""

from __future__ import annotations

import pytest
import torch

import interlace
from interlace import ops

# float32 on both sides; on CPU kernels differ only in summation order. On GPUs vLLM's float32
# attention kernel (Triton) ran its dots in TF32, 1.5e-3 off the CPU oracle, until interlace's
# workers asked Triton for float32 dots (workers/plugin.py); tests/test_gpu_numerics.py holds
# GPUs to 1e-4, and the wider tolerance here stays until a GPU run of this module at 1e-4.
ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2
# Two runs of the same batches: bit for bit on CPU. On a compiled TP=2 engine on two H200s the same
# plain request's logprobs once differed by 9e-5 (tokens equal; 2026-11-26): a write leaking into
# other rows moves them by far more.
SAME_BATCH = dict(abs=0.0, rel=0.0) if not torch.cuda.is_available() else dict(abs=1e-3, rel=0.0)
PROMPT = "The capital of France is"


def test_residual_stream_every_layer_prefill_and_decode(any_model, oracle):
    ids = oracle.ids(PROMPT)
    n_layers = len(oracle.layers)

    def save_all(m):
        for i in range(n_layers):
            m.save(f"resid{i}", m.layers[i].resid)

    out = any_model.generate(ids, program=save_all, max_tokens=4, ignore_eos=True)
    seq = ids + out.token_ids[:-1]  # the last token is sampled but never run through the model
    expected = oracle.run(seq)["resid"]
    for i in range(n_layers):
        got = out.saves[f"resid{i}"]
        assert got.shape == (len(seq), oracle.model.config.hidden_size)
        torch.testing.assert_close(got, expected[i], atol=ATOL, rtol=ATOL)


def test_hidden_alone_is_not_the_residual_stream(llama, oracles):
    """The classic silent error: a decoder layer's first output is not the residual stream."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def both(m):
        m.save("hidden", m.layers[1].output[0])
        m.save("resid", m.layers[1].resid)

    out = llama.generate(ids, program=both)
    expected = oracle.run(ids)["resid"][1]
    torch.testing.assert_close(out.saves["resid"], expected, atol=ATOL, rtol=ATOL)
    assert (out.saves["hidden"] - expected).abs().max() > 0.1


def test_module_output_and_logits_match(any_model, oracle):
    ids = oracle.ids(PROMPT)

    def program(m):
        m.save("down", m.layers[1].mlp.down_proj.output[0])  # vLLM linears return (out, bias)
        m.save("mlp", m.layers[1].mlp.output)  # runs after down_proj: accesses follow the forward
        m.save("logits", m.logits)

    captured = {}
    hook = {oracle.layers[1].mlp: lambda out: captured.setdefault("mlp", []).append(out[0].clone())}
    out = any_model.generate(ids, program=program, max_tokens=3, ignore_eos=True)
    seq = ids + out.token_ids[:-1]
    ref = oracle.run(seq, hooks=hook)
    torch.testing.assert_close(out.saves["mlp"], captured["mlp"][0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out.saves["down"], out.saves["mlp"])
    # logits: one row per step, for the last prompt token and then each new token
    rows = [len(ids) - 1 + k for k in range(3)]
    torch.testing.assert_close(out.saves["logits"], ref["logits"][rows], atol=ATOL, rtol=ATOL)


def test_steering_program_and_op_match_transformers(any_model, oracle):
    ids = oracle.ids(PROMPT)
    vector = torch.randn(oracle.model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 2

    def steer(m):
        m.layers[1].resid += vector

    expected = oracle.greedy(ids, 6, hooks={oracle.layers[1]: lambda out: out + vector})
    plain = any_model.generate(ids, max_tokens=6, ignore_eos=True).token_ids
    by_program = any_model.generate(ids, program=steer, max_tokens=6, ignore_eos=True).token_ids
    by_op = any_model.generate(ids, ops=[ops.add("layers.1.resid", vector)], max_tokens=6, ignore_eos=True).token_ids
    assert expected != plain  # the vector is strong enough to matter
    assert by_program == expected
    assert by_op == expected


def test_ablation_program_and_op_match_transformers(any_model, oracle):
    ids = oracle.ids("One two three four")

    def ablate(m):
        m.layers[2].mlp.output = torch.zeros_like(m.layers[2].mlp.output)

    expected = oracle.greedy(ids, 6, hooks={oracle.layers[2].mlp: lambda out: torch.zeros_like(out)})
    by_program = any_model.generate(ids, program=ablate, max_tokens=6, ignore_eos=True).token_ids
    by_op = any_model.generate(ids, ops=[ops.zero("layers.2.mlp.output")], max_tokens=6, ignore_eos=True).token_ids
    assert by_program == expected
    assert by_op == expected


def test_activation_patching_across_invokes(any_model, oracle):
    clean = oracle.ids("The capital of France is")
    pos = len(clean) - 2
    corrupt = clean[:pos] + [(clean[pos] + 7) % 500] + clean[pos + 1 :]  # one token swapped

    def send_clean(m):
        m.send("clean", m.layers[1].resid.clone())

    def patch(m):
        r = m.layers[1].resid
        r[pos] = m.recv("clean")[pos]
        m.save("logits", m.logits)

    with any_model.trace(max_tokens=1) as tr:
        tr.invoke(clean, program=send_clean)
        tr.invoke(corrupt, program=patch)

    clean_resid = oracle.run(clean)["resid"][1]

    def hf_patch(out):
        out = out.clone()
        out[0, pos] = clean_resid[pos]
        return out

    expected = oracle.run(corrupt, hooks={oracle.layers[1]: hf_patch})["logits"][-1]
    torch.testing.assert_close(tr.result[1].saves["logits"][0], expected, atol=ATOL, rtol=ATOL)
    unpatched = oracle.run(corrupt)["logits"][-1]
    assert (unpatched - expected).abs().max() > 1e-2  # patching changed something


def test_patching_with_a_batched_program(any_model, oracle):
    clean = oracle.ids("The capital of France is")
    corrupt = clean[:-2] + [(clean[-2] + 7) % 500, clean[-1]]

    @interlace.batched
    def patch(m):
        r = m.layers[1].resid
        r[m.rows[1]] = r[m.rows[0]]  # invoke 1's rows take invoke 0's
        m.save("logits", m.logits)

    with any_model.trace(max_tokens=1) as tr:
        tr.invoke(clean, program=patch)
        tr.invoke(corrupt, program=patch)
    torch.testing.assert_close(tr.result[1].saves["logits"], tr.result[0].saves["logits"], atol=ATOL, rtol=ATOL)


def test_recv_without_sender_fails_clearly(llama, oracles):
    ids = oracles["tiny-llama"].ids(PROMPT)

    def lonely(m):
        m.recv("clean")

    try:
        llama.generate(ids, program=lonely)
    except interlace.InterventionError as err:
        assert "no invoke of this trace sent 'clean'" in str(err)
    else:
        raise AssertionError("recv without a sender must fail")


def test_a_name_sent_twice_in_a_step_fails_the_second_sender(llama, oracles):
    """The receiver got the first or the second value by whether it was already waiting."""
    ids = oracles["tiny-llama"].ids(PROMPT)

    def receive(m):
        m.save("got", m.recv("clean"))

    def send_twice(m):
        m.send("clean", torch.ones(1))
        m.send("clean", torch.zeros(1))

    for senders in ([send_twice], [lambda m: m.send("clean", torch.ones(1)), lambda m: m.send("clean", torch.zeros(1))]):
        try:
            with llama.trace(max_tokens=1) as tr:
                for sender in senders:
                    tr.invoke(ids, program=sender)
                tr.invoke(ids, program=receive)
        except interlace.InterventionError as err:
            assert err.invoke == len(senders) - 1, err
            who = "this invoke" if len(senders) == 1 else "invoke 0"
            assert f"{who} sent 'clean' already in this step" in str(err), err
            torch.testing.assert_close(err.partial[len(senders)].saves["got"], torch.ones(1))  # the first value
        else:
            raise AssertionError("a second send of one name in one step must fail")


def test_sixteen_invokes_each_see_only_their_rows(llama, oracles):
    oracle = oracles["tiny-llama"]
    prompts = [oracle.ids(f"{word} is a day of the week number {i}") for i, word in
               enumerate(["Monday", "Tuesday", "Friday", "Sunday"] * 4)]
    plain_prompts = [oracle.ids("Once upon a time"), oracle.ids("def add(a, b):")]

    def make(layer: int, scale: float, write: bool = True):
        def program(m):
            m.save("resid", m.layers[layer].resid)
            if write:
                m.layers[layer].resid *= scale
        return program

    def run(programs):
        with llama.trace(max_tokens=4, ignore_eos=True, logprobs=True) as tr:
            for i, ids in enumerate(prompts):
                tr.invoke(ids, program=programs[i] if programs else None)
            for ids in plain_prompts:
                tr.invoke(ids)
        return tr.result

    mixed = run([make(i % 4, 1.0 + 0.1 * i) for i in range(16)])
    alone = [llama.generate(ids, program=make(i % 4, 1.0 + 0.1 * i), max_tokens=4, ignore_eos=True)
             for i, ids in enumerate(prompts)]
    for i in range(16):
        assert mixed[i].token_ids == alone[i].token_ids
        torch.testing.assert_close(mixed[i].saves["resid"], alone[i].saves["resid"], atol=ATOL, rtol=ATOL)
    # Plain requests, bit for bit, against the same trace whose programs only read: same gang
    # admission, so the same batches (GPU kernels are not batch-invariant; CPU ones are).
    read_only = run([make(i % 4, 1.0, write=False) for i in range(16)])
    untouched = run(None)
    for j in range(16, 18):
        assert mixed[j].token_ids == read_only[j].token_ids == untouched[j].token_ids
        assert mixed[j].logprobs == pytest.approx(read_only[j].logprobs, **SAME_BATCH)


def test_batched_program_runs_once_per_step_for_the_group(llama, oracles):
    oracle = oracles["tiny-llama"]
    prompts = [oracle.ids(p) for p in ["The capital of France is", "One two three", "Hello there", "Monday Tuesday"]]

    @interlace.batched
    def batched(m):
        m.save("group", torch.full((m.n,), m.n))
        m.save("last", m.last(m.layers[2].resid))

    def single(m):
        m.save("last", m.last(m.layers[2].resid))

    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        for ids in prompts:
            tr.invoke(ids, program=batched)
    for i, ids in enumerate(prompts):
        ref = llama.generate(ids, program=single, max_tokens=3, ignore_eos=True)
        assert tr.result[i].token_ids == ref.token_ids
        torch.testing.assert_close(tr.result[i].saves["last"], ref.saves["last"], atol=ATOL, rtol=ATOL)
        assert tr.result[i].saves["group"].tolist() == [4, 4, 4]  # one call per step for all four


def _save_counts(model) -> list[tuple[int, int]]:
    """Each rank's programs' saves so far: (held to the step's end, recorded where made)."""
    return [(rank["saves"]["held"], rank["saves"]["at_once"]) for rank in model.step_counts()]


def test_saves_of_every_dtype_come_back_bit_for_bit(llama):
    """uint16, uint32, uint64, complex32 and float8 tensors are saved as any other. The driver
    failed the whole trace reading them ("UntypedStorage has no attribute 'dtype'": torch's own
    pickling cannot read them back), and rows too many for a report's header failed their
    invoke ("index_copy_cpu not implemented for 'UInt16'"). One invoke (its rows in the report's
    header) and eight with long prompts (in its data region), against the same conversion of
    the float32 values saved beside them."""
    dtypes = [torch.uint16, torch.uint32, torch.uint64, torch.complex32, torch.float8_e4m3fn, torch.float8_e5m2]

    def convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point or dtype.is_complex:
            return x.to(dtype)
        return (x * 1000).to(torch.int64).to(dtype)

    @interlace.batched
    def program(m):
        h = m.layers[0].resid.float()
        m.save("f32", h)
        for dtype in dtypes:
            m.save(str(dtype), convert(h, dtype))

    for prompts in (["Hi"], [PROMPT * 16] * 8):  # 3 KiB a row: some 700 rows, past ROWS_IN_HEADER (1 MiB)
        with llama.trace(max_tokens=2) as tr:
            for prompt in prompts:
                tr.invoke(prompt, program=program)
        for result in tr.result:
            for dtype in dtypes:
                saved, want = result.saves[str(dtype)], convert(result.saves["f32"], dtype)
                assert saved.dtype == dtype and saved.shape == want.shape
                assert torch.equal(saved.view(torch.uint8), want.view(torch.uint8)), dtype


def test_structured_outputs_and_extra_args_reach_vllm_beside_a_program(llama):
    """``structured_outputs`` given as a dict (a sweep's YAML, a script) failed with "'dict'
    object has no attribute '_backend'", and the user's ``extra_args`` (for their logits
    processors) with "got multiple values for keyword argument 'extra_args'": interlace's
    payload travels there too. Both now reach vLLM, beside the program."""
    import re

    from interlace.cluster.assembly import build_requests
    from interlace.core.trace import Invoke, encode_payloads

    program = lambda m: m.save("h", m.layers[0].resid)  # noqa: E731
    out = llama.generate(PROMPT, program=program, max_tokens=4, structured_outputs={"regex": "[ab]{3}"})
    assert re.fullmatch("[ab]{3}", out.text) and "h" in out.saves
    out = llama.generate(PROMPT, program=program, max_tokens=2, extra_args={"mine": 1})
    assert "h" in out.saves
    invokes = [Invoke(PROMPT, program=program), Invoke(PROMPT)]
    payloads = encode_payloads(invokes, "t", "dir:/tmp/unused", 60.0, 1 << 20)
    _prompts, params = build_requests([PROMPT, PROMPT], payloads, {"max_tokens": 2, "extra_args": {"mine": 1}}, "t")
    assert params[0].extra_args["mine"] == 1 and "interlace" in params[0].extra_args
    assert params[1].extra_args == {"mine": 1}  # a plain request keeps the user's own
    with pytest.raises(ValueError, match="extra_args keys starting with 'interlace' are interlace's own"):
        llama.generate(PROMPT, program=program, max_tokens=2, extra_args={"interlace_gang": 1})


def test_a_steps_saves_are_snapshots_kept_in_the_order_made(llama, oracles):
    """A program's saves of a step are kept together (one ledger entry per run of saves of the
    same rows) but each is the value as it was when saved, and one name saved twice in a step
    comes back in the order of the saves."""
    oracle = oracles["tiny-llama"]
    prompts = [oracle.ids(p) for p in ["The capital of France is", "One two three", "Hello there"]]

    @interlace.batched
    def program(m):
        h = m.layers[1].resid
        m.save("x", m.last(h))  # before the edit (on decode steps a view of what is edited next)
        m.save("before", h)
        h += 1.0
        m.save("x", m.last(h))  # after it: the same name again in this step
        m.save("later", m.last(m.layers[2].resid))

    before = _save_counts(llama)
    with llama.trace(max_tokens=4, ignore_eos=True) as tr:
        for ids in prompts:
            tr.invoke(ids, program=program)
    held = [(h - h0, a - a0) for (h, a), (h0, a0) in zip(_save_counts(llama), before)]
    # every save held on the rank that ran it (4 saves x 4 steps; under PP the stages share them)
    assert all(at_once == 0 for _h, at_once in held) and max(h for h, _a in held) > 0, held
    assert sum(h for h, _a in held) in (4 * 4, 4 * 4 * len(held)), held  # PP stages, or TP ranks alike
    op_list = [ops.add("layers.1.resid", torch.ones(128)), ops.save("layers.2.resid", name="later", tokens="last")]
    for i, ids in enumerate(prompts):
        got = tr.result[i].saves
        assert got["x"].shape == (8, 128)  # 4 steps, two saves each
        before, after = got["x"][0::2], got["x"][1::2]
        torch.testing.assert_close(after - before, torch.ones_like(before), atol=1e-5, rtol=0)
        rows = len(ids) + torch.arange(4) - 1  # each step's last row of "before" (the prompt's, then one a step)
        torch.testing.assert_close(got["before"][rows], before, atol=0, rtol=0)
        ref = llama.generate(ids, ops=op_list, max_tokens=4, ignore_eos=True)
        assert tr.result[i].token_ids == ref.token_ids
        torch.testing.assert_close(got["later"], ref.saves["later"], atol=ATOL, rtol=ATOL)


def test_a_save_too_large_to_hold_is_recorded_where_made_between_held_ones(llama, oracles):
    """A save larger than a step's held snapshots may be (64 MiB) is recorded where it is made,
    after what the call held before it; the saves around it are held as usual."""
    ids = oracles["tiny-llama"].ids(PROMPT)

    def program(m):
        m.save("x", m.layers[0].resid)
        m.save("big", torch.full((140_000, 128), float(m.step)))  # 72 MB
        m.save("y", m.layers[1].resid)

    before = _save_counts(llama)
    got = llama.generate(ids, program=program, max_tokens=2, ignore_eos=True)
    counts = {(h - h0, a - a0) for (h, a), (h0, a0) in zip(_save_counts(llama), before)}
    assert counts - {(0, 0)} == {(4, 2)}, counts  # x and y held, big not, 2 steps (a later PP stage saves none)
    ref = llama.generate(ids, program=lambda m: (m.save("x", m.layers[0].resid), m.save("y", m.layers[1].resid)),
                         max_tokens=2, ignore_eos=True)
    assert got.token_ids == ref.token_ids
    for name in ("x", "y"):
        torch.testing.assert_close(got.saves[name], ref.saves[name], atol=0, rtol=0)
    assert got.saves["big"].shape == (280_000, 128)
    assert got.saves["big"][:140_000].eq(0).all() and got.saves["big"][140_000:].eq(1).all()


def test_declarative_ops_equal_programs(llama, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("Steering vectors add a direction")
    vector = torch.randn(128, generator=torch.Generator().manual_seed(5))

    def program(m):
        m.layers[1].resid += vector
        m.save("last", m.last(m.layers[2].resid))
        if m.step == 0:
            m.save("first", m.layers[3].resid)

    op_list = [ops.save("layers.3.resid", name="first", steps=[0]),
               ops.add("layers.1.resid", vector),
               ops.save("layers.2.resid", name="last", tokens="last")]
    a = llama.generate(ids, program=program, max_tokens=4, ignore_eos=True)
    b = llama.generate(ids, ops=op_list, max_tokens=4, ignore_eos=True)
    assert a.token_ids == b.token_ids
    for name in ("first", "last"):
        torch.testing.assert_close(a.saves[name], b.saves[name], atol=ATOL, rtol=ATOL)
    assert b.saves["last"].shape == (4, 128)


def test_ops_on_given_positions_and_steps(llama, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("One two three four five")
    expected = oracle.run(ids)["resid"][0][[1, 3]]
    out = llama.generate(ids, ops=[ops.save("layers.0.resid", tokens=[1, 3], steps=[0])], max_tokens=3)
    torch.testing.assert_close(out.saves["layers.0.resid"], expected, atol=ATOL, rtol=ATOL)


def test_forcing_samples(llama, oracles):
    ids = oracles["tiny-llama"].ids(PROMPT)

    def force(m):
        if m.step == 1:
            m.samples = torch.tensor([42])

    out = llama.generate(ids, program=force, max_tokens=4, ignore_eos=True)
    assert out.token_ids[1] == 42


def stops_at_eos_program(oracle, stop: int | None, steer: torch.Tensor):
    """A steered program that saves logits (and its step) at every step and, at step ``stop``,
    pushes the last layer's residual stream towards EOS, so that greedy decoding ends there. Run
    past that step (which no returned token shows) it fails."""
    last = len(oracle.layers) - 1
    eos = oracle.model.config.eos_token_id
    # after the final norm (weight g), g * (w_eos / g) is the EOS row of the unembedding: its logit wins
    toward_eos = oracle.model.lm_head.weight[eos].detach() / oracle.model.model.norm.weight.detach()
    toward_eos = 1e3 * toward_eos / toward_eos.pow(2).mean().sqrt()

    def program(m):
        m.layers[1].resid += steer
        if m.step == stop:
            m.layers[last].resid += toward_eos
        m.save("logits", m.logits)
        m.save("step", m.step)
        m.share("steps", m.step, merge="append")
        if stop is not None and m.step > stop:
            raise RuntimeError(f"the program ran at step {m.step}, past its EOS at step {stop}")

    return program


def check_invokes_stop_at_eos(model, oracle, max_tokens: int = 8) -> None:
    """Invokes that stop at EOS (at different steps) and one that runs to max_tokens: each one's
    saved per-step values have exactly one row per returned token, and each logits row's argmax
    is that step's token. Under vLLM's asynchronous scheduling (GPUs) a request that sampled EOS
    has run one step more; that step is not the user's (workers/interleaver.py, finish): what
    its program saved, shared or raised there is dropped."""
    eos = oracle.model.config.eos_token_id
    steer = torch.randn(oracle.model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    stops = [2, 4, None, 0, 5]
    with model.trace(max_tokens=max_tokens) as tr:
        for i, stop in enumerate(stops):
            tr.invoke(oracle.ids(["The capital of France is", "One two three", "Hello there", "A", "Once upon"][i]),
                      program=stops_at_eos_program(oracle, stop, steer))
    total = 0
    for stop, result in zip(stops, tr.result):
        tokens = result.token_ids
        if stop is not None:
            assert tokens[-1] == eos and len(tokens) <= stop + 1, (stop, tokens)
        else:
            assert len(tokens) == max_tokens or tokens[-1] == eos, tokens
        logits = result.saves["logits"]
        assert logits.shape[0] == len(tokens), (stop, tokens, logits.shape)
        assert logits.argmax(-1).tolist() == tokens
        steps = result.saves["step"]
        assert (steps if isinstance(steps, list) else [steps]) == list(range(len(tokens)))
        total += len(tokens)
    assert sorted(tr.result.shared["steps"]) == sorted(s for r in tr.result for s in range(len(r.token_ids)))
    assert len(tr.result.shared["steps"]) == total


def test_saved_steps_are_the_returned_tokens_when_invokes_stop_at_eos(llama, oracles):
    check_invokes_stop_at_eos(llama, oracles["tiny-llama"])


def test_shared_values_merge_across_invokes(llama, oracles):
    oracle = oracles["tiny-llama"]

    def contribute(m):
        last = m.last(m.layers[0].resid)[0]
        m.share("count", 1, merge="sum")
        m.share("norms", last.norm().reshape(1), merge="concat")
        m.share("ids", m.invokes[0], merge="append")
        m.share("mean", last, merge="mean")

    prompts = [oracle.ids(p) for p in ["Hello", "The capital of Italy is", "One two"]]
    with llama.trace() as tr:
        for ids in prompts:
            tr.invoke(ids, program=contribute)
    shared = tr.result.shared
    assert shared["count"] == 3
    assert shared["ids"] == [0, 1, 2]
    lasts = torch.stack([oracle.run(ids)["resid"][0][-1] for ids in prompts])
    torch.testing.assert_close(shared["norms"], lasts.norm(dim=-1), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(shared["mean"], lasts.mean(0), atol=ATOL, rtol=ATOL)


def test_prefix_caching_never_skips_intervened_tokens(llama, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("Interpretability researchers read and rewrite hidden activations. " * 25)[:300]
    block = llama.engine.llm_engine.vllm_config.cache_config.block_size  # 128 on CPU
    assert len(ids) > 2 * block  # full KV blocks, so there is something to cache
    from vllm import SamplingParams

    for _ in range(2):  # the second plain run is served from the prefix cache
        plain = llama.engine.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens > 0
    for _ in range(2):
        out = llama.generate(ids, ops=[ops.save("layers.1.resid")])
        assert out.saves["layers.1.resid"].shape[0] == len(ids)  # every prompt token seen


def test_hooks_are_removed_after_traces(llama, oracles):
    ids = oracles["tiny-llama"].ids(PROMPT)
    llama.generate(ids, program=lambda m: m.save("x", m.layers[1].mlp.output), ops=[ops.zero("layers.2.resid")])
    assert llama.engine.collective_rpc("interlace_installed_hooks") == [[]] * llama.config.world_size


def test_saves_past_the_reservation_threshold_come_back_exact(llama, oracles):
    """A trace saving more than RESERVE_MIN (16 MiB) has its report data file reserved ahead by
    the reporter thread while it runs; every step's rows still land where they belong."""
    rows = 40_000  # x 128 float32 = 20 MiB a step

    def big(m):
        m.save("big", torch.arange(rows * 128, dtype=torch.float32).reshape(rows, 128) + m.step)

    out = llama.generate(PROMPT, program=big, max_tokens=3, ignore_eos=True)
    got = out.saves["big"]
    assert got.shape == (3 * rows, 128)
    base = torch.arange(rows * 128, dtype=torch.float32).reshape(rows, 128)
    for step in range(3):
        assert torch.equal(got[step * rows : (step + 1) * rows], base + step), step


def test_a_large_program_or_op_list_travels_once_per_trace_with_the_same_results(llama, oracles, tmp_path):
    """A program holding a large tensor, or a long op list, is written once into the trace's
    report folder for the ranks to read, instead of riding in every invoke's request (each is
    copied into vLLM's engine core and to every rank). Results equal those of the same
    interventions small enough to ride inline."""
    from interlace.cluster.assembly import build_requests
    from interlace.core.trace import Invoke, encode_payloads
    from interlace.workers.sink import INLINE_BYTES

    big = torch.randn(1 << 18)  # 1 MiB a program carries, of which it uses 128 values
    small = big[:128].clone()
    vectors = [torch.randn(128, generator=torch.Generator().manual_seed(k)) * 0.01 for k in range(160)]
    long_ops = [ops.add("layers.1.resid", v) for v in vectors] + [ops.save("layers.2.resid", tokens="last")]

    def steers_from(source):
        def steer(m):
            m.layers[1].resid += source[:128]
            m.save("r2", m.layers[2].resid)
        return steer

    def batched_from(source):
        @interlace.batched
        def steer(m):
            m.layers[1].resid += source[:128]
            m.save("r2", m.last(m.layers[2].resid))
        return steer

    def run(steer, batched, op_list):
        with llama.trace(max_tokens=3, ignore_eos=True) as tr:
            for k in range(4):
                tr.invoke(f"Prompt {k} of the trace", program=steer)
                tr.invoke(f"Batched prompt {k}", program=batched)
                tr.invoke(f"Ops prompt {k}", ops=op_list)
        return tr.result

    heavy, light = steers_from(big), steers_from(small)
    got = run(heavy, batched_from(big), long_ops)
    want = run(light, batched_from(small), [ops.add("layers.1.resid", torch.stack(vectors).sum(0))] + long_ops[-1:])
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for name in b.saves:
            torch.testing.assert_close(a.saves[name], b.saves[name], atol=1e-5, rtol=1e-5)

    invokes = [Invoke(f"p{k}", program=heavy) for k in range(8)] + [Invoke("q", ops=long_ops), Invoke("plain")]
    payloads = encode_payloads(invokes, "t", f"dir:{tmp_path}", 60.0, 1 << 20)
    assert len(payloads[0].program) > INLINE_BYTES and len(payloads[8].ops) > INLINE_BYTES
    _, params = build_requests([inv.prompt for inv in invokes], payloads, {"max_tokens": 1}, "t")
    carried = [len(p.extra_args["interlace"]) for p in params if p.extra_args]
    assert len(carried) == 9 and max(carried) < 4096
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "t").iterdir()) == ["ops", "program"]  # each once


def test_module_lists_iterate_and_slice_as_torchs_do(llama, oracles):
    """``for layer in m.layers``, ``m.layers[1:3]``, ``m.layers[-1]`` and ``len(m.layers)`` select
    the modules a ``torch.nn.ModuleList`` would, each reading its own layer's stream. (A name per
    layer: under pipeline parallelism one name is saved on one stage.)"""
    ids = oracles["tiny-llama"].ids("The quick brown fox")

    def iterate(m):
        middle = m.layers[1:3]
        for i, layer in enumerate(m.layers):
            m.save(f"layer{i}", layer.resid[-1])
            if layer in middle:
                m.save(f"middle{i}", layer.resid[-1])
        m.save("last", m.layers[-1].resid[-1])
        m.save("count", torch.tensor(len(m.layers)))

    def index(m):
        for i in range(4):
            m.save(f"layer{i}", m.layers[i].resid[-1])
            if i in (1, 2):
                m.save(f"middle{i}", m.layers[i].resid[-1])

    got = llama.generate(ids, program=iterate)
    want = llama.generate(ids, program=index)
    assert got.saves.pop("count") == 4 and torch.equal(got.saves.pop("last"), got.saves["layer3"])
    assert sorted(got.saves) == sorted(want.saves) == [*(f"layer{i}" for i in range(4)), "middle1", "middle2"]
    for name in want.saves:
        assert torch.equal(got.saves[name], want.saves[name]), name
    ref = oracles["tiny-llama"].run(ids)["resid"]
    torch.testing.assert_close(torch.stack([got.saves[f"layer{i}"] for i in range(4)]), torch.stack([r[-1] for r in ref]),
                               atol=1e-4, rtol=1e-4)


def test_what_a_program_prints_comes_back_with_its_invoke_once_and_in_order(llama, oracles, capsys):
    """workers/printed.py: what a program's code writes to stdout and stderr comes back as
    ``result.printed`` and is printed on the driver, in program order, once: once per TP group,
    and once across pipeline stages (a later stage replays the code before its accesses without
    printing). A batched program's text goes with its call's first invoke."""
    import sys

    oracle = oracles["tiny-llama"]
    ids, last = oracle.ids(PROMPT), len(oracle.layers) - 1

    def chatty(m):
        print(f"{m.step} start")
        rows = m.layers[0].resid.shape[0]
        print(f"{m.step} rows {rows}", file=sys.stderr)
        m.layers[last].resid  # (on the last stage under PP)
        print(f"{m.step} end")

    @interlace.batched
    def together(m):
        print(f"together {m.n}")
        m.layers[last].resid

    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(ids, program=chatty)
        tr.invoke("Once upon a time", program=together)
        tr.invoke("Hello there", program=together)
        tr.invoke("Not a word")
    want = "".join(f"{k} start\n{k} rows {len(ids) if k == 0 else 1}\n{k} end\n" for k in range(3))
    assert tr.result[0].printed == want
    assert [r.printed for r in tr.result.invokes[1:]] == ["together 2\n" * 3, "", ""]
    assert want in capsys.readouterr().out



def test_a_program_recurses_as_deep_as_a_script(llama):
    """Each program runs in a greenlet started a few hundred frames below the engine's (greenlets.py,
    deep_switch), and a greenlet counts its depth on from there: a program had 424 levels of
    recursion left, where a script has about 1,000 (Python's default limit)."""

    def depth(n: int) -> int:
        return n if n == 900 else depth(n + 1)

    def program(m):
        m.save("before", depth(0))  # at the step's start, and at its point
        m.save("after", depth(0) + int(m.layers[0].resid.shape[0] > 0))

    out = llama.generate(PROMPT, program=program, max_tokens=2)
    assert out.saves["before"] == [900, 900] and out.saves["after"] == [901, 901]
