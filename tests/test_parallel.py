"""Tensor and pipeline parallelism on CPU (multiprocessing backend), against transformers.

Every fidelity test of tests/test_interventions.py and every test of tests/test_waits.py and
tests/test_ops_order.py is collected again in this module and runs
unchanged against TP=2, PP=2 and TP=2 x PP=2 engines of the tiny Llama (and, on a CPU, TP=2 of the
tiny Qwen2; every layout of it on GPUs): the fixtures below stand in for the single-rank engines. The tests after them cover what only parallelism has: values vLLM
splits across TP ranks seen whole, parameters seen whole, a program that reads on one pipeline
stage and writes on another, forced tokens reaching every stage, and failures on every rank.
"""

from __future__ import annotations

import os

import pytest
import torch

import interlace
from conftest import ENGINE_OVERRIDES
from test_interventions import *  # noqa: F403 - the runner's fidelity tests, collected again here
from test_interventions import ATOL, PROMPT
from test_waits import *  # noqa: F403 - writes after waits, collected again here
from test_ops_order import *  # noqa: F403 - ops' order among shared ops, tuple outputs, empty selections
from test_isolation import (  # noqa: F401 - bad writes never reach other requests, collected again here
    _next_trace_is_exact,
    test_a_program_that_seeds_torch_draws_its_own_stream_and_sampling_stays_random,
    test_a_programs_numerics_settings_are_its_own,
    test_a_programs_torch_settings_are_its_own,
    test_forced_tokens_outside_the_vocabulary_fail_that_invoke_and_the_engine_serves,
    test_non_finite_writes_never_reach_other_requests,
)

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}
# On a CPU, Qwen2 runs at TP=2 only, where it differs from Llama (attention biases, split with
# their projections); the pipeline code is the same for both models. Its PP=2 and TP=2 x PP=2
# engines cost the CPU suite about 2 minutes; GPU runs take every layout (conftest.py).
CPU_LAYOUTS = {"tiny-qwen2": ["tp2"]}
# On a CPU, TP=2 x PP=2 (four ranks on two cores) runs this module's own tests, which are about
# ranks and stages; the fidelity tests collected again here run at TP=2 and at PP=2 (2.5 minutes
# of the CI suite at TP=2 x PP=2). GPU runs take them at every layout.
CPU_OWN_TESTS_ONLY = {"tp2xpp2"}
# vLLM's executor for the ranks: "mp" (one host) or "ray" (what multi-node deployments use; the
# CPU platform refuses it, so it runs on the GPU machines: INTERLACE_TEST_EXECUTOR=ray).
EXECUTOR = os.environ.get("INTERLACE_TEST_EXECUTOR", "mp")


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.ranks(tp * pp))
                                        for name, (tp, pp) in LAYOUTS.items()])
def layout(request):
    return LAYOUTS[request.param]


def _parallel(name: str, layout):
    tp, pp = layout
    # INTERLACE_TEST_ENGINE_ARGS (conftest.py) applies here too: e.g. compiled GPU engines with taps.
    model = interlace.Model(name, **{**ENGINE_OVERRIDES, "tensor_parallel_size": tp, "pipeline_parallel_size": pp,
                                     "distributed_executor_backend": EXECUTOR})
    model.engine
    return model


@pytest.fixture(scope="module")
def llama(layout):
    model = _parallel("tiny-llama", layout)
    yield model
    model.close()


@pytest.fixture(scope="module")
def qwen(layout):
    model = _parallel("tiny-qwen2", layout)
    yield model
    model.close()


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def any_model(request, layout):
    # Engines start lazily, so `-k "not qwen"` starts only the Llama engine.
    return request.getfixturevalue({"tiny-llama": "llama", "tiny-qwen2": "qwen"}[request.param])


def test_greedy_generation_matches_transformers(llama, oracles):
    oracle = oracles["tiny-llama"]
    for prompt in ["The capital of France is", "One two three four"]:
        ids = oracle.ids(prompt)
        assert llama.generate(ids, max_tokens=8, ignore_eos=True).token_ids == oracle.greedy(ids, 8)


def test_split_values_and_parameters_are_whole(any_model, oracle):
    """qkv_proj / gate_up_proj outputs and o_proj / down_proj inputs are split across TP ranks in
    vLLM; programs see them whole, laid out as the unsharded model's merged projections (Qwen2's
    with their biases)."""
    ids = oracle.ids(PROMPT)
    hf_attn, hf_mlp = oracle.layers[1].self_attn, oracle.layers[1].mlp
    seen, handles = {}, []
    for name, mod in [("q", hf_attn.q_proj), ("k", hf_attn.k_proj), ("v", hf_attn.v_proj),
                      ("gate", hf_mlp.gate_proj), ("up", hf_mlp.up_proj)]:
        handles.append(mod.register_forward_hook(lambda _m, _a, out, name=name: seen.__setitem__(name, out[0])))
    for name, mod in [("o_in", hf_attn.o_proj), ("down_in", hf_mlp.down_proj)]:
        handles.append(mod.register_forward_pre_hook(lambda _m, args, name=name: seen.__setitem__(name, args[0][0])))
    try:
        oracle.run(ids)
    finally:
        for h in handles:
            h.remove()

    def program(m):
        attn, mlp = m.layers[1].self_attn, m.layers[1].mlp
        m.save("embed_rows", m.embed_tokens.weight[[5, 7]])
        m.save("qkv", attn.qkv_proj.output[0])
        m.save("o_in", attn.o_proj.input)
        m.save("gate_up", mlp.gate_up_proj.output[0])
        m.save("act_in", mlp.act_fn.input)
        m.save("down_in", mlp.down_proj.input)
        if attn.qkv_proj.bias is not None:
            m.save("qkv_bias", attn.qkv_proj.bias)
        if torch.cuda.is_available():  # vLLM's CPU backend frees linear weights after repacking them
            m.save("qkv_weight", attn.qkv_proj.weight)  # (under PP: read before later stages' points)
            m.save("down_weight", mlp.down_proj.weight)
        m.save("lm_head_rows", m.lm_head.weight[[5, 7]])

    saves = any_model.generate(ids, program=program, max_tokens=1).saves
    close = lambda a, b: torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)  # noqa: E731
    close(saves["qkv"], torch.cat([seen["q"], seen["k"], seen["v"]], dim=-1))
    close(saves["o_in"], seen["o_in"])
    close(saves["gate_up"], torch.cat([seen["gate"], seen["up"]], dim=-1))
    close(saves["act_in"], saves["gate_up"])
    close(saves["down_in"], seen["down_in"])
    embed = oracle.model.model.embed_tokens.weight[[5, 7]]
    close(saves["embed_rows"], embed)
    close(saves["lm_head_rows"], oracle.model.lm_head.weight[[5, 7]])
    if hf_attn.q_proj.bias is not None:
        close(saves["qkv_bias"], torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias]))
    if torch.cuda.is_available():
        close(saves["qkv_weight"], torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight]))
        close(saves["down_weight"], hf_mlp.down_proj.weight)


def test_writes_to_split_values_reach_every_rank(any_model, oracle):
    """Zero the values (v) inside the merged qkv output and halve the MLP's up projection: each
    rank must apply its own piece of the same edit."""
    ids = oracle.ids(PROMPT)

    def program(m):
        qkv = m.layers[2].self_attn.qkv_proj.output[0]
        qkv[:, 192:] = 0  # q: 128 features, k: 64, v: 64 (2 query heads, 1 kv head of 64)
        m.layers[2].self_attn.qkv_proj.output = (qkv, None)
        m.layers[2].mlp.gate_up_proj.output[0][:, 256:] *= 0.5  # an in-place edit of the copy

    hooks = {oracle.layers[2].self_attn.v_proj: lambda o: o * 0, oracle.layers[2].mlp.up_proj: lambda o: o * 0.5}
    out = any_model.generate(ids, program=program, max_tokens=5, ignore_eos=True)
    assert out.token_ids == oracle.greedy(ids, 5, hooks=hooks)


def test_read_on_one_stage_write_on_another(llama, oracles):
    """Layer 0 runs on the first pipeline stage and layer 3 on the last: the value read at
    layer 0 is carried to the stage that writes layer 3, every step, and saved exactly once."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def program(m):
        early = m.layers[0].resid
        m.save("early", early)
        m.layers[3].resid = m.layers[3].resid + 0.5 * early
        m.save("late", m.layers[3].resid)

    captured = {}

    def remember(output):
        captured["early"] = output[0] if isinstance(output, tuple) else output
        return output

    def add_early(output):
        hidden = output[0] if isinstance(output, tuple) else output
        return hidden + 0.5 * captured["early"]

    hooks = {oracle.layers[0]: remember, oracle.layers[3]: add_early}
    out = llama.generate(ids, program=program, max_tokens=4, ignore_eos=True)
    assert out.token_ids == oracle.greedy(ids, 4, hooks=hooks)
    sequence = ids + out.token_ids[:-1]
    reference = oracle.run(sequence, hooks=hooks)
    assert out.saves["early"].shape == (len(sequence), 128)  # once per step, not once per stage
    torch.testing.assert_close(out.saves["early"], reference["resid"][0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out.saves["late"], reference["resid"][3], atol=ATOL, rtol=ATOL)


def test_forced_tokens_reach_every_stage(llama, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def force(m):
        if m.step == 1:
            m.samples = torch.tensor([42])

    out = llama.generate(ids, program=force, max_tokens=5, ignore_eos=True)
    assert out.token_ids[1] == 42
    assert out.token_ids[2:] == oracle.greedy(ids + out.token_ids[:2], 3)  # continued from 42


def test_data_dependent_failure_fails_on_every_rank_and_engine_serves(llama, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def program(m):
        gathered = m.layers[1].self_attn.qkv_proj.output[0]  # a collective under TP
        if gathered.abs().sum() > 0:  # same value on every rank: same branch, no deadlock
            late = m.layers[3].resid
            raise ValueError(f"branch taken at step {m.step} with {tuple(late.shape)}")

    with pytest.raises(interlace.InterventionError, match="branch taken at step 0"):
        llama.generate(ids, program=program, max_tokens=3)
    assert llama.generate(ids, max_tokens=4, ignore_eos=True).token_ids == oracle.greedy(ids, 4)


def test_deferred_reductions_are_read_whole_or_refused(llama, oracles, layout):
    """Some blocks leave their output as per-rank partial sums for a later all-reduce (vLLM's
    ``reduce_results=False``, as in MoE layers). Emulated here on layer 0's MLP: its down_proj
    output is read whole (reduced across ranks) and matches transformers; the MLP's own output,
    which is then one rank's partial sum, is refused under TP rather than handed out, and read
    as usual where there is one rank."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def defer(defer_reduction: bool):
        llama.engine.collective_rpc("interlace_set_attribute",
                                    args=("model.layers.0.mlp.down_proj", "reduce_results", not defer_reduction))

    seen = {}
    hf_mlp = oracle.layers[0].mlp
    handles = [hf_mlp.down_proj.register_forward_hook(lambda _m, _a, out: seen.__setitem__("down", out[0])),
               hf_mlp.register_forward_hook(lambda _m, _a, out: seen.__setitem__("mlp", out[0]))]
    try:
        oracle.run(ids)
    finally:
        for h in handles:
            h.remove()

    defer(True)
    try:
        out = llama.generate(ids, program=lambda m: m.save("down", m.layers[0].mlp.down_proj.output[0]), max_tokens=1)
        torch.testing.assert_close(out.saves["down"], seen["down"], atol=ATOL, rtol=ATOL)
        read_mlp = lambda m: m.save("mlp", m.layers[0].mlp.output)  # noqa: E731
        if layout[0] > 1:
            with pytest.raises(interlace.InterventionError, match="split across tensor-parallel ranks"):
                llama.generate(ids, program=read_mlp, max_tokens=1)
        else:
            torch.testing.assert_close(llama.generate(ids, program=read_mlp, max_tokens=1).saves["mlp"],
                                       seen["mlp"], atol=ATOL, rtol=ATOL)
    finally:
        defer(False)
    assert llama.generate(ids, max_tokens=4, ignore_eos=True).token_ids == oracle.greedy(ids, 4)


def test_time_limits_are_decided_alike_on_every_rank(llama, oracles):
    """(At PP=2 too: each stage decides for itself, and nothing is gathered across stages.) Each TP rank used to enforce a program's time limit on its own clock: a program whose
    limit ran out just before it read a value TP gathers was stopped on one rank while the other
    entered the gather, and the group hung. Programs here spin to around their limit and then
    read (and write) such a value; every trace finishes or fails on the time limit, alike on
    every rank, and the engine serves on exactly."""
    import time

    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)
    limit = 0.05
    outcomes = set()
    for i in range(40):
        def program(m, spin=limit * (0.8 + 0.4 * (i % 9) / 8)):
            end = time.monotonic() + spin
            while time.monotonic() < end:
                pass
            x = m.layers[1].mlp.down_proj.input  # split across the TP ranks: gathered whole
            m.layers[1].mlp.down_proj.input = x

        try:
            llama.generate(ids, program=program, max_tokens=1, timeout_s=limit)
            outcomes.add("finished")
        except interlace.InterventionError as err:
            assert "time limit" in str(err)
            outcomes.add("timed out")
    assert outcomes == {"finished", "timed out"}
    _next_trace_is_exact(llama, oracle)


def test_a_busy_loop_fails_alone_and_the_engine_serves(any_model, oracle):
    """A program that never reaches another point (``while True: pass``) cannot wait for the
    ranks' next agreement round: each rank interrupts it on its own clock, and the round after
    it unwinds makes the time-out the same on every rank. It fails alone with the time limit,
    in about the limit, its trace's other invokes are exact, and the same engine serves on (it
    used to end the engine's processes at TP=2, losing the neighbours)."""
    import time

    ids = oracle.ids(PROMPT)

    def spin(m):
        m.layers[0].resid  # noqa: B018 - waits for the first point, then spins
        while True:
            pass

    def keep(m):
        m.save("h", m.layers[2].resid)

    started = time.monotonic()
    with pytest.raises(interlace.InterventionError, match="time limit of 2s") as err:
        with any_model.trace(max_tokens=4, ignore_eos=True, timeout_s=2) as tr:
            tr.invoke(ids, program=spin)
            tr.invoke(ids, program=keep)
            tr.invoke(ids)
    assert time.monotonic() - started < 15
    assert err.value.invoke == 0
    healthy, plain = err.value.partial[1], err.value.partial[2]
    assert healthy.token_ids == plain.token_ids == oracle.greedy(ids, 4)
    assert healthy.saves["h"].shape[0] == len(ids) + 3
    assert any_model.generate(ids, max_tokens=4, ignore_eos=True).token_ids == oracle.greedy(ids, 4)


def test_a_program_taking_another_path_on_one_rank_fails_on_every_rank_alone(llama, oracles, layout):
    """Every TP rank runs the program on the same values, but a program may consult something
    rank-local (here the rank itself; in the wild the clock, a file, an error on one GPU). On
    TP rank 1 these programs read a value TP gathers, write where rank 0 only reads, fail,
    read a split parameter, or stop early, before every rank reads values TP gathers. Each
    used to hang the group at its next gather or leave the ranks computing from different
    values; now it fails with a clear error on every rank, its trace's other invoke is exact,
    and the engine serves on. With one rank per stage nothing differs and it runs."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def keep(m):
        m.save("h", m.layers[3].resid)

    alone = llama.generate(ids, program=keep, max_tokens=3, ignore_eos=True)
    assert alone.token_ids == oracle.greedy(ids, 3)
    for how in ["gathers alone", "writes alone", "fails alone", "reads a split parameter alone", "finishes early"]:
        def program(m, how=how):
            from vllm.distributed.parallel_state import get_tp_group

            odd = get_tp_group().rank_in_group == 1
            if how == "gathers alone" and odd:
                m.layers[1].self_attn.qkv_proj.output  # noqa: B018 - the read is the point
            if how == "writes alone":
                x = m.layers[1].mlp.output
                if odd:
                    m.layers[1].mlp.output = x * 2
            if how == "fails alone" and odd:
                raise ValueError("only on rank 1")
            if how == "reads a split parameter alone" and odd:
                m.embed_tokens.weight  # noqa: B018
            if how == "finishes early" and odd:
                return
            m.save("down_in", m.layers[2].mlp.down_proj.input)  # gathered under TP
            m.save("h", m.layers[3].resid)

        if layout[0] > 1:
            with pytest.raises(interlace.InterventionError, match="different paths on the tensor-parallel ranks") as err:
                with llama.trace(max_tokens=3, ignore_eos=True) as tr:
                    tr.invoke(ids, program=keep)
                    tr.invoke(ids, program=program)
            assert err.value.invoke == 1 and err.value.record["where"].startswith("step 0"), how
            other = err.value.partial[0]
        else:
            with llama.trace(max_tokens=3, ignore_eos=True) as tr:
                tr.invoke(ids, program=keep)
                tr.invoke(ids, program=program)
            other = tr.result[0]
            torch.testing.assert_close(tr.result[1].saves["h"], alone.saves["h"], atol=ATOL, rtol=ATOL)
        assert other.token_ids == alone.token_ids, how
        torch.testing.assert_close(other.saves["h"], alone.saves["h"], atol=ATOL, rtol=ATOL)
    _next_trace_is_exact(llama, oracle)


def test_a_program_taking_another_path_on_a_later_stage_fails_instead_of_reading_another_value(llama, oracles, layout):
    """A later pipeline stage replays the values earlier stages' accesses returned, in order. A
    program that asks for another access there (here it reads layer 1 on stage 1 where stage 0
    read layer 0) used to get layer 0's value as layer 1's, silently; now it fails, naming
    both accesses. With one stage nothing differs and it runs."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids(PROMPT)

    def program(m):
        from vllm.distributed.parallel_state import get_pp_group

        first_stage = get_pp_group().rank_in_group == 0
        m.save("early", m.layers[0].resid if first_stage else m.layers[1].resid)
        m.save("late", m.layers[3].resid)

    if layout[1] > 1:
        with pytest.raises(interlace.InterventionError, match="access #1 was layers.0.resid there and layers.1.resid here"):
            llama.generate(ids, program=program, max_tokens=2)
    else:
        saves = llama.generate(ids, program=program, max_tokens=1).saves
        torch.testing.assert_close(saves["early"], oracle.run(ids)["resid"][0], atol=ATOL, rtol=ATOL)
    _next_trace_is_exact(llama, oracle)
