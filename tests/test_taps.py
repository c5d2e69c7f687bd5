"""Graph taps (workers/taps.py): declarative ops at declared points (decoder layers' residual
streams, attention and MLP outputs) run inside the forward from device buffers, so a compiled engine
replays its CUDA graphs for them.

On a CPU the same taps run in the eager forward: every op result here must equal, bit for bit, the
hook path's on an engine without taps (itself checked against transformers in test_ops_order and
test_interventions). On a GPU both engines are compiled, so they agree in tokens and to TF32's
last digits (ENGINES). The compiled-engine tests are GPU-marked. Taps under chunked prefill are
tested in test_chunked_prefill.py, on that module's engine.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import no_new_socket_files, socket_files
import interlace
from interlace import ops
from interlace.cluster.config import ModelConfig
from interlace.cluster.engine import start_async_engine

TAPS = ["layers.1.resid", "layers.2.resid", "layers.1.mlp.output", "layers.2.self_attn.output"]
HIDDEN = 128  # tiny-llama's
ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2  # against transformers: GPU float32 matmuls run in TF32
# Where a failed invoke leaves the batch, its neighbours' later steps run in a smaller batch: bit
# for bit on CPU, whose kernels are batch-invariant; GPU kernels are not (last digits, 2026-11-26).
OTHER_BATCH = dict(atol=0.0, rtol=0.0) if not torch.cuda.is_available() else dict(atol=1e-3, rtol=1e-3)


@pytest.fixture(scope="module")
def tapped():
    model = interlace.Model("tiny-llama", graph_taps=TAPS)
    model.engine
    yield model
    model.close()


def tap_steps(model) -> int:
    [rank] = model.step_counts()
    return rank["taps"]["steps"]


def vector(seed: int) -> torch.Tensor:
    return torch.randn(HIDDEN, generator=torch.Generator().manual_seed(seed))


def run(model, oplists: list[list[dict]], max_tokens: int = 5, program=None):
    prompts = ["The quick brown fox", "Hello there, my friend", "One two three"]
    with model.trace(max_tokens=max_tokens, ignore_eos=True) as tr:
        for prompt, oplist in zip(prompts, oplists):
            tr.invoke(prompt, ops=oplist)
        if program is not None:
            tr.invoke("A program runs here", program=program)
    return tr.result


# Two engines' results: bit for bit on a CPU, where both run eager and its kernels are the same. On
# a GPU both are compiled (`llama` with the default taps, every layer's resid): their graphs are cut
# at other points and captured at other sizes, and programs between graph pieces meet the hook path
# of an eager step, so kernels differ and values agree to ATOL (TF32 either way), tokens exactly.
ENGINES = {} if not torch.cuda.is_available() else dict(atol=ATOL, rtol=ATOL)


def assert_same(got, want, **tolerance) -> None:
    tolerance = tolerance or ENGINES
    for a, b in zip(got.invokes, want.invokes, strict=True):
        assert a.token_ids == b.token_ids
        assert sorted(a.saves) == sorted(b.saves)
        for name in a.saves:
            if tolerance:
                torch.testing.assert_close(a.saves[name], b.saves[name], **tolerance)
            else:
                assert torch.equal(a.saves[name], b.saves[name]), name


CASES = {
    "save last": [[ops.save("layers.1.resid", tokens="last")], [ops.save("layers.2.resid")], []],
    "add, save after; save elsewhere": [
        [ops.add("layers.1.resid", vector(1)), ops.save("layers.1.resid", name="after"), ops.save("layers.2.resid")],
        [ops.save("layers.1.resid", name="before"), ops.add("layers.1.resid", vector(2), tokens="last")],
        [],
    ],
    "scale, replace, zero on positions and steps": [
        [ops.save("layers.2.resid", name="before"), ops.scale("layers.2.resid", 0.5, tokens="last")],
        [ops.replace("layers.1.resid", vector(3), tokens=[2, 3]), ops.save("layers.1.resid")],
        [ops.zero("layers.2.resid", steps=[1, 2]), ops.save("layers.2.resid", steps=[0, 2])],
    ],
    "attention and MLP outputs, beside resid": [
        [ops.add("layers.1.mlp.output", vector(14)), ops.save("layers.1.mlp.output", name="after"),
         ops.save("layers.1.resid")],
        [ops.save("layers.2.self_attn.output", name="before"), ops.scale("layers.2.self_attn.output", 0.5, tokens="last"),
         ops.add("layers.1.resid", vector(15), tokens="last")],
        [ops.replace("layers.1.mlp.output", vector(16), tokens=[1]), ops.zero("layers.2.self_attn.output", steps=[1]),
         ops.save("layers.2.resid")],
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_ops_at_taps_run_in_the_taps_and_equal_the_hook_path_bit_for_bit(tapped, llama, case):
    before = tap_steps(tapped)
    got = run(tapped, CASES[case])
    assert tap_steps(tapped) >= before + 5  # every step of the trace ran its ops in the taps
    assert_same(got, run(llama, CASES[case]))


def test_a_steering_tap_changes_tokens_as_transformers_does(tapped, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("The capital of France is")
    steer = vector(4) * 2
    out = tapped.generate(ids, ops=[ops.add("layers.1.resid", steer)], max_tokens=6, ignore_eos=True)
    want = oracle.greedy(ids, 6, hooks={oracle.layers[1]: lambda h: h + steer})
    assert out.token_ids == want != oracle.greedy(ids, 6)


def test_steps_with_a_program_or_ops_taps_cannot_run_use_hooks_and_stay_exact(tapped, llama):
    def keep(m):
        m.save("resid1", m.layers[1].resid)

    two_edits = [ops.add("layers.1.resid", vector(5)), ops.add("layers.1.resid", vector(6)), ops.save("layers.2.resid")]
    untapped = [ops.zero("layers.3.mlp.output", tokens="last")]
    for oplists, program in (([[ops.add("layers.1.resid", vector(7))]], keep), ([two_edits], None), ([untapped], None)):
        before = tap_steps(tapped)
        got = run(tapped, oplists, program=program)
        assert tap_steps(tapped) == before  # ran with hooks
        assert_same(got, run(llama, oplists, program=program))


def program_steps(model) -> int:
    [rank] = model.step_counts()
    return rank["taps"]["programs"]


def send_layer1(m):
    """Patching across invokes: send this invoke's layer-1 stream (also tests/test_graphs.py)."""
    m.send("r", m.layers[1].resid)


def average_with_received(m):
    """Average this invoke's layer-1 stream with the last row sent, then save layer 2's."""
    r = m.layers[1].resid
    r[:] = (r + m.recv("r")[-1:]) / 2
    m.save("patched", m.layers[2].resid)


def test_programs_run_at_the_taps_after_their_first_step_and_equal_the_hook_path(tapped, llama):
    """A program that reads and writes only taps (and logits) runs its first step with hooks and
    every later one at the taps, where a compiled engine runs it between CUDA-graph pieces: bit for
    bit the hook path's, with batched programs, per-invoke programs, send/recv and ops beside them."""
    steer = vector(21)

    def program(m):
        m.save("mlp", m.layers[1].mlp.output)
        m.layers[1].resid += steer
        m.layers[2].self_attn.output = m.layers[2].self_attn.output * 0.5
        m.save("resid", m.layers[2].resid)
        m.save("logits", m.logits)

    together = interlace.batched(lambda m: program(m))

    def trace(model):
        with model.trace(max_tokens=6, ignore_eos=True) as tr:
            tr.invoke("The quick brown fox", program=together)
            tr.invoke("Hello there, my friend", program=together)
            tr.invoke("One two three", program=program)
            tr.invoke("A sender", program=send_layer1)
            tr.invoke("A receiver", program=average_with_received)
            tr.invoke("Ops beside", ops=[ops.save("layers.1.mlp.output"), ops.save("layers.2.resid", name="before"),
                                         ops.add("layers.2.resid", vector(22)), ops.save("layers.2.resid", name="after")])
        return tr.result

    before = program_steps(tapped)
    got = trace(tapped)
    assert program_steps(tapped) >= before + 5  # every step after the first
    assert_same(got, trace(llama))


def test_a_program_that_reads_a_point_no_tap_serves_runs_eager_or_fails_clearly(tapped, llama):
    """A program that reads a point that is not a tap in its first step keeps its steps eager and
    exact; one that first reads it in a later step, which ran at the taps, fails with the reason
    and the fix, alone."""
    first, second = vector(23), vector(24)  # held by the programs: moved to the model's device with them

    def always(m):
        m.save("q", m.layers[1].self_attn.qkv_proj.output[0])
        m.layers[1].resid += first

    def later(m):
        m.layers[1].resid += second
        if m.step == 3:
            m.save("q", m.layers[1].self_attn.qkv_proj.output[0])

    before = program_steps(tapped)
    assert_same(run(tapped, [[]], program=always), run(llama, [[]], program=always))
    assert program_steps(tapped) == before
    with pytest.raises(interlace.InterventionError, match="qkv_proj.output is not a graph tap.*enforce_eager=True") as failed:
        with tapped.trace(max_tokens=5, ignore_eos=True) as tr:
            tr.invoke("A program runs here", program=later)
            tr.invoke("The quick brown fox", ops=[ops.save("layers.1.resid")])
    assert failed.value.invoke == 0
    alone = run(llama, [[ops.save("layers.1.resid")]])
    assert_same(SimpleNamespace(invokes=failed.value.partial.invokes[1:]), alone)


def test_a_trace_after_a_tapped_one_gets_none_of_its_edits(tapped, llama):
    run(tapped, [[ops.replace("layers.1.resid", vector(8))], [ops.scale("layers.2.resid", 0.0)]])
    assert_same(run(tapped, [[], []]), run(llama, [[], []]))
    saved = run(tapped, [[ops.save("layers.1.resid")]])  # saves only: the stream as it is
    assert_same(saved, run(llama, [[ops.save("layers.1.resid")]]))


def test_graph_taps_name_residual_streams_or_attention_and_mlp_outputs():
    base = ModelConfig.load("tiny-llama").model_dump()
    for spec in ("layers.1.mlp.down_proj.output", "layers.1.mlp.input", "layers.1.output", "lm_head.output"):
        with pytest.raises(ValueError, match="a tap is a decoder layer's residual stream .* or the output of its mlp"):
            ModelConfig.model_validate({**base, "graph_taps": [spec]})
    assert ModelConfig.model_validate({**base, "graph_taps": TAPS}).graph_taps == TAPS


def test_a_tap_at_an_output_that_is_not_an_attention_or_mlp_block_is_refused():
    """Only blocks that end in a reduced row-parallel layer (attention, MLP) are whole on every TP
    rank, whatever the TP size; anything else (here a norm, which also returns a pair inside vLLM's
    layers) is refused when the model loads, and the caller gets the worker's reason, not only
    vLLM's "Engine core initialization failed"."""
    load_errors = lambda: set(Path(tempfile.gettempdir()).glob("interlace-load-errors-*"))  # noqa: E731
    before = load_errors()  # a process killed while starting an engine leaves its file: not this test's
    sockets = socket_files()
    with pytest.raises(ValueError, match="graph tap 'layers.1.input_layernorm.output': RMSNorm is not an attention "
                                         "or MLP block") as refused:
        interlace.Model("tiny-llama", graph_taps=["layers.1.input_layernorm.output"]).engine
    assert "initialization failed" in str(refused.value.__cause__)  # vLLM's own error, kept as the cause
    # A typo, on the async engine a cluster replica starts: the reason lists the layer's children.
    typo = ModelConfig.load("tiny-llama").model_copy(update={"graph_taps": ["layers.1.self_atn.output"]})
    with pytest.raises(ValueError, match=r"graph tap 'layers.1.self_atn.output'.*children are \[.*'self_attn'"):
        asyncio.run(start_async_engine(typo))
    assert "INTERLACE_LOAD_ERRORS" not in os.environ
    assert load_errors() <= before  # each start's file went with it
    no_new_socket_files(sockets)  # and its processes' socket files (7 a start were left)


def test_a_worker_tells_only_a_start_still_waiting_for_its_refusals(tmp_path, monkeypatch):
    """A refusal goes to the file of the start that is running; once that start is over (its file
    removed), nothing is written and no file is made again."""
    from interlace.workers.plugin import LOAD_ERRORS_ENV, tell_the_caller

    waiting = tmp_path / "waiting.txt"
    waiting.write_text("")
    monkeypatch.setenv(LOAD_ERRORS_ENV, str(waiting))
    tell_the_caller(ValueError("graph tap 'x':\n  not here"))
    assert waiting.read_text() == "graph tap 'x': not here\n"
    monkeypatch.setenv(LOAD_ERRORS_ENV, str(tmp_path / "over.txt"))
    tell_the_caller(ValueError("late"))
    assert not (tmp_path / "over.txt").exists()


@pytest.fixture(scope="module")
def compiled_tapped():
    model = interlace.Model("tiny-llama", enforce_eager=False, graph_taps=TAPS)
    model.engine
    yield model
    model.close()


@pytest.mark.gpu
def test_a_compiled_engine_runs_ops_at_taps_inside_its_graphs_exactly(compiled_tapped, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("The capital of France is")
    steer = vector(9) * 2
    [before] = compiled_tapped.step_counts()
    out = compiled_tapped.generate(ids, ops=[ops.save("layers.1.resid", name="before"), ops.add("layers.1.resid", steer),
                                             ops.save("layers.2.resid", name="after")], max_tokens=6, ignore_eos=True)
    [after] = compiled_tapped.step_counts()
    graphs_before, graphs_after = before["graph_steps"], after["graph_steps"]
    assert graphs_after["eager"] == graphs_before["eager"] and graphs_after["taps"] >= graphs_before["taps"] + 6
    ran_before, ran_after = before["taps"]["ran"], after["taps"]["ran"]
    assert ran_after["model.layers.1"] >= ran_before["model.layers.1"] + 6  # the op ran in the forward
    hooks = {oracle.layers[1]: lambda h: h + steer}
    assert out.token_ids == oracle.greedy(ids, 6, hooks=hooks) != oracle.greedy(ids, 6)
    seq = ids + out.token_ids[:-1]
    torch.testing.assert_close(out.saves["before"], oracle.run(seq)["resid"][1], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out.saves["after"], oracle.run(seq, hooks)["resid"][2], atol=ATOL, rtol=ATOL)
    plain = compiled_tapped.generate(ids, max_tokens=6, ignore_eos=True).token_ids  # nothing left in the buffers
    assert plain == oracle.greedy(ids, 6)


@pytest.mark.gpu
def test_ops_at_taps_apply_in_forwards_larger_than_any_captured_graph(compiled_tapped, oracles):
    """vLLM runs a batch past its largest capture size through the compiled code without a graph,
    which calls the tap ops' Python; they skip work only where their step asks for none
    (Taps._work), so a 3 x 250-token prefill with ops still runs them."""
    oracle = oracles["tiny-llama"]
    prompts = [[3 + (7 * i + 31 * k) % 250 for i in range(250)] for k in range(3)]
    steer = vector(11) * 2
    hooks = {oracle.layers[1]: lambda h: h + steer}
    with compiled_tapped.trace(max_tokens=2, ignore_eos=True) as tr:
        for ids in prompts:
            tr.invoke(ids, ops=[ops.add("layers.1.resid", steer), ops.save("layers.2.resid", name="after")])
    for ids, out in zip(prompts, tr.result):
        want = oracle.run(ids + out.token_ids[:-1], hooks)["resid"][2]
        torch.testing.assert_close(out.saves["after"], want, atol=ATOL, rtol=ATOL)
    plain = compiled_tapped.generate(prompts[0], max_tokens=2, ignore_eos=True)  # idle taps: no edit left
    assert plain.token_ids == oracle.greedy(prompts[0], 2)


def test_saves_in_a_prefill_wider_than_the_taps_saved_rows_equal_the_hook_path(tapped, llama):
    """The taps keep fixed save rows only as wide as the largest captured graph (512 tokens here);
    a 3 x 250-token prefill saves into rows of its own (Taps.wide), and every save, before and
    after an edit, equals the hook path's bit for bit."""
    prompts = [[3 + (7 * i + 31 * k) % 250 for i in range(250)] for k in range(3)]
    oplists = [[ops.add("layers.1.resid", vector(17)), ops.save("layers.1.resid", name="after"),
                ops.save("layers.2.resid"), ops.save("layers.2.self_attn.output")],
               [ops.save("layers.1.resid", name="before"), ops.scale("layers.1.resid", 0.5, tokens="last")],
               [ops.save("layers.2.resid", tokens="last")]]
    results = []
    for model in (tapped, llama):
        with model.trace(max_tokens=3, ignore_eos=True) as tr:
            for ids, oplist in zip(prompts, oplists):
                tr.invoke(ids, ops=oplist)
        results.append(tr.result)
    assert results[0][0].saves["layers.2.resid"].shape[0] == 252  # the prefill's rows, then two steps
    assert_same(*results)


def test_a_tap_called_outside_a_graph_does_what_its_step_asks_and_no_more():
    """A tap op called where no graph was captured (Taps._work) against the whole path, on this
    machine's device: a step that asks nothing passes values through and records nothing; one
    that asks only saves records the stream as the whole path would; an edit edits its rows.
    Batches that take turns (pipeline parallelism) each get their own rows back."""
    import itertools
    from collections import defaultdict

    import numpy as np

    from interlace.workers import taps as taps_module

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    taps = taps_module.Taps(["model.layers.1", "model.layers.2"],
                            {("model.layers.1", "resid"), ("model.layers.2", "resid")}, HIDDEN, max_tokens=8,
                            max_vectors=2, dtype=torch.float32, device=device)
    hidden, residual = torch.randn(4, HIDDEN, device=device), torch.randn(4, HIDDEN, device=device)

    epochs, memos = itertools.count(1), defaultdict(dict)  # the interleaver's memo per epoch

    def at_layer_1(kind: str, rows: list[int], value=None) -> dict:  # one op, as the interleaver hands it over
        op = SimpleNamespace(rows=np.array(rows, dtype=np.int64), op={"op": kind, "value": value, "key": kind})
        return {("model.layers.1", "resid"): [(None, op)]}

    def step(kind: str, rows: list[int], value=None, ops=None, epoch=None):
        """Each tap op edits its layer's (hidden, residual) in place: here, copies of the inputs."""
        taps.fill(ops or at_layer_1(kind, rows, value), memos[epoch or next(epochs)])
        outs = [(hidden.clone(), residual.clone()) for _ in range(2)]
        for index, (h, r) in enumerate(outs):
            assert taps.run(h, r, index) is None
        return outs

    (out_hidden, out_residual), _ = step("save", [])  # no rows this step: nothing asked
    assert torch.equal(out_hidden, hidden) and torch.equal(out_residual, residual)
    assert taps.ran.tolist() == [0, 0] and not taps.saved.any()
    (out_hidden, out_residual), _ = step("save", [1, 2])
    assert torch.equal(out_hidden, hidden) and torch.equal(out_residual, residual)
    assert taps.ran.tolist() == [1, 0] and torch.equal(taps.saved[0, :4], hidden + residual)
    assert not taps.saved[1].any()  # layer 2 was asked nothing
    (out_hidden, out_residual), _ = step("scale", [1], 2.0)
    assert taps.ran.tolist() == [2, 0]
    torch.testing.assert_close(out_hidden[1], (hidden[1] + residual[1]) * 2)
    assert not out_residual[1].any()
    assert torch.equal(out_hidden[[0, 2, 3]], hidden[[0, 2, 3]])
    taps.clear()
    (out_hidden, _), _ = step("save", [])
    assert torch.equal(out_hidden, hidden) and taps.ran.tolist() == [2, 0]
    # two decoding batches taking turns, each a step on in its own epoch: each step gets its own rows
    first, second = at_layer_1("scale", [0, 1, 2], 3.0), at_layer_1("zero", [3])
    for epoch, ops_of in [(100, first), (101, second), (100, first), (101, second), (100, first)]:
        (out_hidden, out_residual), _ = step("", [], ops=ops_of, epoch=epoch)
    torch.testing.assert_close(out_hidden[:3], (hidden[:3] + residual[:3]) * 3)
    assert torch.equal(out_hidden[3], hidden[3]) and torch.equal(out_residual[3], residual[3])
    (out_hidden, out_residual), _ = step("", [], ops=second, epoch=101)
    assert torch.equal(out_hidden[:3], hidden[:3]) and torch.equal(out_residual[:3], residual[:3])
    assert not out_hidden[3].any() and not out_residual[3].any()
    # a forward wider than the fixed save rows (the largest graph) saves into rows of its own,
    # which the step's gather reads, and the next step lets go of
    narrow = taps_module.Taps(["model.layers.1"], {("model.layers.1", "resid")}, HIDDEN, max_tokens=8,
                              max_vectors=2, dtype=torch.float32, device=device, graph_rows=2)
    assert narrow.saved.shape == (1, 2, HIDDEN)
    save = SimpleNamespace(rows=np.array([1, 3], dtype=np.int64), op={"op": "save", "point": "layers.1.resid"},
                           invokes=[SimpleNamespace(trace=1)], slots=np.array([0]), starts=np.array([0]), stops=np.array([2]))
    narrow.fill({("model.layers.1", "resid"): [(SimpleNamespace(module="model.layers.1"), save)]}, {})
    narrow.run(hidden.clone(), residual.clone(), 0)
    [group] = narrow.save_groups([(SimpleNamespace(module="model.layers.1"), save)])
    [rows] = group.gather(narrow)
    assert torch.equal(rows, (hidden + residual)[[1, 3]]) and not narrow.saved.any()
    narrow.clear()
    assert narrow.wide == {}


def _output_taps_match_transformers(model, oracle, atol: float) -> None:
    """An add at an MLP's output and a scale at an attention output, run in their taps (every step
    counted as a tap step), against transformers with the same edits in forward hooks."""
    ids = oracle.ids("The capital of France is")
    steer, seen = vector(17) * 2, {}

    def mlp(h):
        seen["mlp"] = (h + steer)[0]
        return h + steer

    hooks = {oracle.layers[1].mlp: mlp, oracle.layers[2].self_attn: lambda out: (out[0] * 0.5, *out[1:])}
    before = tap_steps(model)
    out = model.generate(ids, ops=[ops.add("layers.1.mlp.output", steer), ops.save("layers.1.mlp.output", name="mlp"),
                                   ops.scale("layers.2.self_attn.output", 0.5), ops.save("layers.2.resid", name="after")],
                         max_tokens=6, ignore_eos=True)
    assert tap_steps(model) >= before + 6
    assert out.token_ids == oracle.greedy(ids, 6, hooks=hooks) != oracle.greedy(ids, 6)
    ref = oracle.run(ids + out.token_ids[:-1], hooks)
    torch.testing.assert_close(out.saves["mlp"], seen["mlp"], atol=atol, rtol=atol)
    torch.testing.assert_close(out.saves["after"], ref["resid"][2], atol=atol, rtol=atol)


def test_ops_at_attention_and_mlp_output_taps_match_transformers(tapped, oracles):
    _output_taps_match_transformers(tapped, oracles["tiny-llama"], atol=ATOL)


@pytest.mark.gpu
def test_a_compiled_engine_runs_ops_at_output_taps_inside_its_graphs(compiled_tapped, oracles):
    [before] = compiled_tapped.step_counts()
    _output_taps_match_transformers(compiled_tapped, oracles["tiny-llama"], atol=ATOL)
    [after] = compiled_tapped.step_counts()
    assert after["graph_steps"]["eager"] == before["graph_steps"]["eager"]


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_every_pipeline_stage_takes_the_same_path_in_a_step(llama):
    """Stage 0 runs layers 0-1, stage 1 layers 2-3. Whether a step runs ops in taps is decided from
    all of an invoke's ops, on every stage alike: on a GPU a stage replaying a padded graph while
    the other runs eager would hand the next stage a batch of the wrong size."""
    staged = interlace.Model("tiny-llama", pipeline_parallel_size=2,
                             graph_taps=["layers.1.resid", "layers.3.resid", "layers.2.mlp.output"])
    try:
        def per_rank() -> list[int]:
            return [rank["taps"]["steps"] for rank in staged.step_counts()]

        tapped_only = [[ops.add("layers.1.resid", vector(10)), ops.save("layers.3.resid")],
                       [ops.scale("layers.2.mlp.output", 2.0, tokens="last"), ops.save("layers.2.mlp.output")]]
        before = per_rank()
        got = run(staged, tapped_only)
        after = per_rank()
        assert len(after) == 2 and all(a >= b + 5 for a, b in zip(after, before))
        assert_same(got, run(llama, tapped_only))

        # an op at a point no tap serves, on stage 0, holds stage 1's steps eager too
        mixed = [[ops.zero("layers.0.mlp.output", tokens="last"), ops.save("layers.3.resid")]]
        got = run(staged, mixed)
        assert per_rank() == after
        assert_same(got, run(llama, mixed))
    finally:
        staged.close()


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_batches_taking_turns_on_pipeline_stages_each_keep_their_own_ops(oracles):
    """Under pipeline parallelism vLLM keeps several batches in flight, and their steps take turns
    on every stage. Each batch keeps its own per-epoch work (its invokes' rows, its ops, its staged
    tap rows): eight invokes, each steering with its own vector and saving its last token, split by
    a small token budget into two batches that decode in turns, all equal transformers."""
    oracle, n, steps = oracles["tiny-llama"], 8, 8
    prompts = [f"Prompt number {i} says" for i in range(n)]
    staged = interlace.Model("tiny-llama", pipeline_parallel_size=2, graph_taps=["layers.1.resid", "layers.3.resid"],
                             enable_chunked_prefill=True, max_num_batched_tokens=32)
    try:
        before = [rank["taps"]["steps"] for rank in staged.step_counts()]
        with staged.trace(max_tokens=steps, ignore_eos=True) as tr:
            for i, prompt in enumerate(prompts):
                tr.invoke(prompt, ops=[ops.add("layers.1.resid", vector(30 + i)), ops.save("layers.3.resid", tokens="last")])
        after = [rank["taps"]["steps"] for rank in staged.step_counts()]
    finally:
        staged.close()
    assert all(a - b >= 2 * (steps - 1) for a, b in zip(after, before))  # two batches, in turns, every step tapped
    for i, (prompt, got) in enumerate(zip(prompts, tr.result.invokes, strict=True)):
        ids, hooks = oracle.ids(prompt), {oracle.layers[1]: lambda h, v=vector(30 + i): h + v}
        assert got.token_ids == oracle.greedy(ids, steps, hooks=hooks), i
        want = oracle.run(ids + got.token_ids[:-1], hooks)["resid"][3][len(ids) - 1:]
        torch.testing.assert_close(got.saves["layers.3.resid"], want, atol=ATOL, rtol=ATOL)


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_tensor_parallel_ranks_apply_the_same_taps_to_whole_values(llama):
    """TP=2: residual streams and attention and MLP outputs are whole on every rank (vLLM reduces
    them), so every rank's taps apply the same edits; equal to one rank's hooks within the rounding
    of split matmuls, tokens exactly."""
    split = interlace.Model("tiny-llama", tensor_parallel_size=2, graph_taps=TAPS)
    try:
        def per_rank() -> list[int]:
            return [rank["taps"]["steps"] for rank in split.step_counts()]

        case = CASES["attention and MLP outputs, beside resid"]
        before = per_rank()
        got = run(split, case)
        after = per_rank()
        assert len(after) == 2 and all(a >= b + 5 for a, b in zip(after, before))
        for a, b in zip(got.invokes, run(llama, case).invokes, strict=True):
            assert a.token_ids == b.token_ids and sorted(a.saves) == sorted(b.saves)
            for name in b.saves:
                torch.testing.assert_close(a.saves[name], b.saves[name], atol=ATOL, rtol=ATOL)
    finally:
        split.close()


def test_compile_passes_that_move_the_all_reduce_past_a_tap_are_refused(monkeypatch):
    from interlace.cluster.engine import engine_args

    monkeypatch.setenv("INTERLACE_DEVICE", "cuda")  # the GPU engine's arguments, built here
    cfg = ModelConfig.load("tiny-llama").model_copy(update={"graph_taps": TAPS})
    mine = {"mode": 3, "pass_config": {"enable_qk_norm_rope_fusion": True}}
    kwargs = engine_args(cfg, compilation_config=mine)  # the user's settings, and the passes kept off
    off = {"fuse_allreduce_rms": False, "enable_sp": False, "fuse_gemm_comms": False}  # vLLM's default may be on
    splitting = kwargs["compilation_config"].pop("splitting_ops")
    assert kwargs["compilation_config"] == {"mode": 3, "pass_config": {**off, "enable_qk_norm_rope_fusion": True}}
    assert splitting[0] == "vllm::unified_attention_with_output" and splitting[-2:] == ["interlace::tap", "interlace::tap_output"]
    untapped = engine_args(cfg.model_copy(update={"graph_taps": []}))
    assert untapped["compilation_config"] == {"pass_config": {"fuse_allreduce_rms": False}}  # vLLM's choice
    for name in ("enable_sp", "fuse_allreduce_rms"):
        with pytest.raises(ValueError, match=rf"\['{name}'\] with graph_taps"):
            engine_args(cfg, compilation_config={"pass_config": {name: True}})


def test_a_gpu_engine_is_compiled_with_every_layers_resid_tapped_unless_the_config_says_otherwise(monkeypatch):
    """The defaults a GPU engine gets (built here as arguments): compiled, every layer's resid a
    tap that splits the compiled graph (programs run between its pieces); eager on request, with
    no taps; 'all'; the user's own splitting ops kept; a CPU engine stays eager with no taps."""
    from interlace.cluster.engine import engine_args
    from interlace.workers.plugin import TAPS_KEY

    cfg = ModelConfig.load("tiny-llama")
    monkeypatch.setenv("INTERLACE_DEVICE", "cpu")  # (what a CPU engine gets, also where torch sees a GPU)
    cpu = engine_args(cfg)
    assert cpu["enforce_eager"] is True and TAPS_KEY not in cpu.get("additional_config", {})
    monkeypatch.setenv("INTERLACE_DEVICE", "cuda")
    gpu = engine_args(cfg)
    assert gpu["enforce_eager"] is False and gpu["additional_config"][TAPS_KEY] == "resid"
    assert "interlace::tap" in gpu["compilation_config"]["splitting_ops"]
    eager = engine_args(cfg, enforce_eager=True)
    assert TAPS_KEY not in eager.get("additional_config", {}) and "splitting_ops" not in eager["compilation_config"]
    assert engine_args(cfg.model_copy(update={"graph_taps": "all"}))["additional_config"][TAPS_KEY] == "all"
    mine = engine_args(cfg, compilation_config={"splitting_ops": ["vllm::unified_attention_with_output"]})
    assert mine["compilation_config"]["splitting_ops"] == ["vllm::unified_attention_with_output", "interlace::tap",
                                                          "interlace::tap_output"]
    with pytest.raises(ValueError, match=r"splitting_ops=\[\] with graph taps"):
        engine_args(cfg, compilation_config={"splitting_ops": []})


def test_every_layer_expands_to_each_stage_alike():
    from interlace.workers.points import ModuleTree
    from interlace.workers.taps import every_layer

    names = ["model", "model.layers", *(f"model.layers.{i}" for i in range(12)), "model.layers.0.mlp",
             "model.layers.0.self_attn", "model.layers.0.mlp.down_proj"]
    tree = ModuleTree(names=names)
    tree.modules["model.layers.0"] = object()  # this stage runs layer 0 (the others: another stage's)
    assert every_layer(tree, "resid") == [f"model.layers.{i}.resid" for i in range(12)]
    assert len(every_layer(tree, "all")) == 36 and "model.layers.11.mlp.output" in every_layer(tree, "all")
    with pytest.raises(ValueError, match="'resid' or 'all'"):
        every_layer(tree, "some")


def test_graph_taps_reach_the_engine_beside_the_users_own_additional_config():
    from interlace.cluster.engine import engine_args
    from interlace.workers.plugin import TAPS_KEY

    cfg = ModelConfig.load("tiny-llama").model_copy(update={"graph_taps": TAPS})
    kwargs = engine_args(cfg, additional_config={"mine": 1})
    assert kwargs["additional_config"] == {"mine": 1, TAPS_KEY: TAPS}


def test_a_cluster_replica_runs_ops_in_its_graph_taps_equal_to_one_engine(llama):
    """Taps travel with the model config: a Ray replica's engine (its processes load vLLM's plugins
    themselves) runs the ops in them, with results equal to one engine's hooks. Then a server's
    traffic: one-invoke traces sent together, each with its own steering vector and a save at the
    same tap (their saves are one gather per step for all of them, taps.TappedSaves), beside a
    two-invoke trace saving there too: each gets its own rows, equal to running it alone."""
    import ray

    from interlace.cluster.config import ClusterConfig

    assert not ray.is_initialized()
    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=300 << 20)
    try:
        model = ModelConfig.load("tiny-llama").model_copy(update={"graph_taps": TAPS})
        cluster = interlace.Cluster(ClusterConfig(model=model, replicas=1, cpu_cores=[[0]]))
        try:
            case = CASES["add, save after; save elsewhere"]
            got = run(cluster, case)
            [[rank]] = cluster.step_counts()
            assert rank["taps"]["steps"] >= 5
            assert (rank["graph_steps"] is None) == (not torch.cuda.is_available())  # eager on a CPU only
            assert_same(got, run(llama, case))

            prompts = ["The quick brown fox", "Hello there, my friend", "One two three", "Once upon a time",
                       "It was a dark and stormy night"]
            oplists = [[ops.add("layers.1.resid", vector(20 + i)), ops.save("layers.2.resid", tokens="last")]
                       for i in range(len(prompts))]
            traces = []
            for prompt, oplist in zip(prompts, oplists):
                tr = cluster.trace(max_tokens=6, ignore_eos=True)
                tr.invoke(prompt, ops=oplist)
                traces.append(tr)
            pair = cluster.trace(max_tokens=6, ignore_eos=True)
            for prompt in prompts[:2]:
                pair.invoke(prompt, ops=[ops.save("layers.2.resid", tokens="last")])
            traces.append(pair)
            results = [future.result(timeout=300) for future in [cluster.submit(tr) for tr in traces]]
            for tr, result in zip(traces, results):
                with llama.trace(max_tokens=6, ignore_eos=True) as alone:
                    for invoke in tr.invokes:
                        alone.invoke(invoke.prompt, ops=invoke.ops)
                assert_same(result, alone.result)
                assert all(len(inv.saves["layers.2.resid"]) == 6 for inv in result.invokes)
        finally:
            cluster.close()
    finally:
        ray.shutdown()


def test_a_tap_past_the_last_layer_is_refused_before_an_engine_starts():
    cfg = ModelConfig.load("tiny-llama").model_copy(update={"graph_taps": ["layers.9.resid"]})
    with pytest.raises(ValueError, match=r"'layers.9.resid': the model has 4 decoder layers \(0-3\)"):
        interlace.Model(cfg).engine


def test_a_non_finite_write_in_a_tap_fails_nothing_else_and_reaches_no_later_trace(tapped, llama):
    poison = torch.full((HIDDEN,), float("nan"))
    bad = run(tapped, [[ops.replace("layers.1.resid", poison)], [ops.save("layers.2.resid")]])
    want = run(llama, [[], [ops.save("layers.2.resid")]])
    assert bad[1].token_ids == want[1].token_ids  # the neighbour in the same steps
    torch.testing.assert_close(bad[1].saves["layers.2.resid"], want[1].saves["layers.2.resid"], **OTHER_BATCH)
    later = [[], [ops.save("layers.1.resid")], [ops.add("layers.2.resid", vector(13))]]
    assert_same(run(tapped, later), run(llama, later))


def test_tapped_saves_over_a_long_decode_arrive_as_the_hook_paths(tapped, llama):
    """Saves of the last token at two taps every step, and at one tap on chosen steps (whose steps
    change which saves a step makes), over a decode of 37 steps: every invoke's rows arrive in step
    order, as on the hook path."""
    steps = 37
    oplists = [[ops.save("layers.1.resid", tokens="last"), ops.save("layers.2.resid", tokens="last")],
               [ops.save("layers.2.resid", tokens="last", steps=list(range(0, steps, 3)))],
               [ops.save("layers.1.resid", tokens="last"), ops.save("layers.2.resid", tokens="last")]]
    before = tap_steps(tapped)
    got = run(tapped, oplists, max_tokens=steps)
    assert tap_steps(tapped) >= before + steps
    assert got[0].saves["layers.1.resid"].shape[0] == steps and got[1].saves["layers.2.resid"].shape[0] == 13
    assert_same(got, run(llama, oplists, max_tokens=steps))


def test_a_save_limit_reached_in_tapped_saves_fails_as_on_the_hook_path(tapped, llama):
    """Tapped saves count against max_save_bytes as the hook path's do: the invokes whose saves
    pass it fail with the same error, and the invoke beside them ends with the same tokens."""
    row = HIDDEN * 4  # float32
    outcomes = []
    for model in (tapped, llama):
        with pytest.raises(interlace.InterventionError, match="exceed the limit") as err:
            with model.trace(max_tokens=32, ignore_eos=True, max_save_bytes=row * 19) as tr:
                tr.invoke("The quick brown fox", ops=[ops.save("layers.1.resid", tokens="last"),
                                                      ops.save("layers.2.resid", tokens="last")])
                tr.invoke("Hello there, my friend", ops=[ops.save("layers.1.resid", tokens="last")])
                tr.invoke("One two three")
        outcomes.append((err.value.invoke, [r.token_ids for r in err.value.partial.invokes]))
    assert outcomes[0] == outcomes[1] and len(outcomes[0][1][2]) == 32


def test_a_program_switched_into_at_a_tap_copies_none_of_the_engines_stack(tapped):
    """A greenlet switch copies out whatever part of the C stack the greenlet switched to runs
    over, and on Python 3.12 and later walks the whole Python frame chain of the greenlet it
    leaves. Programs are switched into from a hub whose Python stack starts empty
    (greenlets.run_shallow), not from the engine deep in the forward pass, and hub and programs start
    below every tap (greenlets.deep_switch): at a tap no greenlet on the way has stack saved (8.8 KB
    with programs started where the step begins), and the one a program leaves is a few frames
    deep where the engine is dozens."""
    import greenlet

    def depth(g):
        frame, n = g.gr_frame, 0
        while frame is not None:
            frame, n = frame.f_back, n + 1
        return n

    def program(m):
        m.layers[1].resid += 0.0
        hub = greenlet.getcurrent().parent
        m.save("stack_saved", [hub._stack_saved, hub.parent._stack_saved])
        m.save("frames", [depth(hub), depth(hub.parent)])

    with tapped.trace(max_tokens=3) as tr:
        for _ in range(4):
            tr.invoke("the quick brown fox", program)
    for result in tr.result:
        assert result.saves["stack_saved"] == [[0, 0]] * 3
        for hub, engine in result.saves["frames"]:
            assert hub < 12 < 20 < engine, (hub, engine)  # the engine: 46 frames deep on a CPU, 27 on an H200


def hub_functions() -> list[str]:
    """Called in a program: the functions of the hub that switched into it (greenlets.run_shallow)."""
    import greenlet

    frame, names = greenlet.getcurrent().parent.gr_frame, []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def started_at_its_point() -> bool:
    """Called in a program: whether it was started at its first point (prologue.py), alone or
    with others (calls.start_at_points)."""
    names = hub_functions()
    return "start_at" in names or "start_at_points" in names


def test_a_program_whose_first_statement_walks_to_a_point_starts_there_with_the_same_results(tapped):
    """A program whose first statement only walks the module tree to a point (``m.layers[i].resid
    += v``, prologue.py) is started at that point from its second step in an epoch on, with the
    value handed to its first read (calls.ProgramCall.start_at): one round trip a step instead of
    two. Its tokens and saves equal those of the same program with a statement before the walk,
    which is started at each step's start; a program whose first point moves between steps (its
    index a closure cell it changes) is started at the step's start whenever it moved."""
    layer = 1

    def walks(m):
        m.layers[layer].resid += 0.5
        m.save("started_at", started_at_its_point())
        m.save("h", m.layers[2].resid)

    def runs_code_first(m):
        scale = 0.5
        m.layers[layer].resid += scale
        m.save("started_at", started_at_its_point())
        m.save("h", m.layers[2].resid)

    def moves(m):
        nonlocal layer
        m.layers[layer].resid += 0.5
        m.save("started_at", started_at_its_point())
        m.save("h", m.layers[2].resid)
        layer = 2 if m.step % 2 else 1  # after steps 1, 3, ...: layer 2 next step

    prompts = ["the quick brown fox", "One two three"]
    results = {}
    for program in (walks, runs_code_first):
        with tapped.trace(max_tokens=6, ignore_eos=True) as tr:
            for prompt in prompts:
                tr.invoke(prompt, program)
        results[program.__name__] = tr.result
    for late, early in zip(results["walks"], results["runs_code_first"]):
        assert late.token_ids == early.token_ids
        assert torch.equal(late.saves["h"], early.saves["h"])
        assert not any(early.saves["started_at"])
        started = late.saves["started_at"]
        assert started[0] is False and started[-1] is True, started  # the prompt's step: at the step's start

    with tapped.trace(max_tokens=6, ignore_eos=True) as tr:
        tr.invoke(prompts[0], moves)
    [moved] = tr.result
    assert len(moved.token_ids) == 6
    assert not any(moved.saves["started_at"]), moved.saves["started_at"]  # layers 1, 1, 2, 1, 2, 1


def test_programs_started_together_at_a_tap_each_keep_their_own_path(tapped, llama):
    """Programs per invoke that start at their first point at one tap run one after another in one
    worker greenlet (calls.start_at_points). Each keeps its own path: one that waits again (for a
    later point, or for a value that an invoke after it sends) keeps that worker while the others
    go on in another; one that raises fails alone. Tokens and saves equal the hook path's (an
    engine without taps) bit for bit."""
    steer = vector(31)

    def steers(m):
        m.layers[1].resid += steer
        m.save("together", "start_at_points" in hub_functions())

    def waits_for_layer2(m):
        m.layers[1].resid *= 1.5
        m.save("l2", m.layers[2].resid)

    def receives_first(m):  # an invoke before its sender: it waits for the value mid-run
        r = m.layers[1].resid
        r[:] = (r + m.recv("s")[-1:]) / 2
        m.save("patched", m.layers[2].resid)

    def sends(m):
        m.send("s", m.layers[1].resid * 2)

    def raises(m):
        m.layers[1].resid -= steer
        if m.step == 3:
            raise ValueError("this invoke's own failure at step 3")

    programs = [steers, waits_for_layer2, receives_first, steers, sends, raises, steers]

    def trace(model):
        with pytest.raises(interlace.InterventionError, match="own failure at step 3") as err:
            with model.trace(max_tokens=6, ignore_eos=True) as tr:
                for k, program in enumerate(programs):
                    tr.invoke(f"Prompt number {k} of the run", program=program)
        assert err.value.invoke == 5
        return err.value.partial

    before = program_steps(tapped)
    got, want = trace(tapped), trace(llama)
    assert program_steps(tapped) >= before + 4
    for k in (0, 3, 6):
        together = got[k].saves.pop("together")
        want[k].saves.pop("together")  # (on a GPU the engine without named taps has every layer's resid tapped)
        # the first steps of an epoch start alone: the prompt's, the next, and the one after the failure
        assert together == [False, False, True, True, False, True], together
    assert_same(got, want)


def test_a_late_edit_of_a_taps_copy_fails_only_the_program_that_made_it(tapped):
    """Every program's rows of a tap's value are views of one copy, whose version counter they
    share. One program's in-place edit of its rows after the tap returned (late: lost) fails that
    program alone; another that holds its own rows of the same copy, checked after it, goes on."""

    def keeps(m):  # checked again at the logits, after the other edited its rows
        h = m.layers[1].resid
        m.save("l2", m.layers[2].resid)
        m.save("logits", m.logits)
        m.save("h", h)

    def edits_late(m):
        h = m.layers[1].resid
        m.save("l2", m.layers[2].resid)
        if m.step == 2:  # a step at the taps (the first runs with hooks)
            h += 1.0

    before = program_steps(tapped)
    with pytest.raises(interlace.InterventionError, match="edited in place its copy of layers.1.resid") as err:
        with tapped.trace(max_tokens=4, ignore_eos=True) as tr:
            tr.invoke("The quick brown fox", program=keeps)
            tr.invoke("Hello there, my friend", program=edits_late)
    assert err.value.invoke == 1
    assert program_steps(tapped) >= before + 2
    assert len(err.value.partial[0].saves["h"]) == len(err.value.partial[0].saves["l2"])


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, "GreenletExit"])
def test_a_program_raising_a_base_exception_fails_alone_where_programs_start_together(tapped, llama, exc):
    """A program that raises what is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``,
    greenlet's own ``GreenletExit``, which greenlet also raises in a worker it collects) fails its
    invoke alone, as any failure does, among programs started together at a tap (and on the hook
    path of an engine without taps); the others' results are the hook path's."""
    import greenlet

    raised = greenlet.GreenletExit if exc == "GreenletExit" else exc
    steer = vector(41)

    def steers(m):
        m.layers[1].resid += steer

    def raises(m):
        m.layers[1].resid += steer
        if m.step == 2:
            raise raised("this invoke's own")

    def trace(model):
        with pytest.raises(interlace.InterventionError, match=f"{raised.__name__}: this invoke's own") as err:
            with model.trace(max_tokens=4, ignore_eos=True) as tr:
                for k, program in enumerate([steers, raises, steers]):
                    tr.invoke(f"Prompt number {k} of the run", program=program)
        assert err.value.invoke == 1
        return err.value.partial

    got, want = trace(tapped), trace(llama)
    assert_same(got, want)
    assert tapped.generate("Hello there", max_tokens=2, program=steers).token_ids
