"""Compiled GPU engines with CUDA graphs (``enforce_eager=False``) at TP=1, TP=2 and PP=2: steps
without interventions run vLLM's graphs, ops at the default taps run inside them, programs that
touch only taps run between graph pieces, other steps run eager, and all match transformers
(workers/graphs.py, workers/tap_graphs.py). The engine tests are GPU-marked (TP=2 and PP=2 need
two GPUs); the choice of eager kernels runs on a CPU too.

The whole fidelity suite also runs on such engines: ``INTERLACE_TEST_ENGINE_ARGS='{"enforce_eager":
false}' pytest tests/test_interventions.py ...`` on a GPU machine, with ``"graph_taps": [...]``
added for ops in taps, and at TP=2 and PP=2 through tests/test_parallel.py on two GPUs (one layout
per run, ``-k "tp2 and not tp2xpp2"``: a compiled TP=2 engine's first start took 2 min 40 s on
two H100s, so give pytest-timeout room).
"""

from __future__ import annotations

import pytest
import torch

import interlace
from conftest import kept_engine
from interlace import ops
from test_taps import average_with_received, send_layer1

ATOL = 1e-2  # GPUs: see test_interventions.ATOL


LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


@pytest.fixture(scope="module", params=[pytest.param((tp, pp), id=name, marks=[pytest.mark.ranks(tp * pp)] if tp * pp > 1 else [])
                                        for name, (tp, pp) in LAYOUTS.items()])
def compiled(request):
    tp, pp = request.param
    return kept_engine("tiny-llama", tensor_parallel_size=tp, pipeline_parallel_size=pp, enforce_eager=False)


def steps(model) -> dict[str, int]:
    """The first rank's step counts (every rank takes the same path in a step)."""
    return dict(model.step_counts()[0]["graph_steps"])


@pytest.mark.gpu
def test_plain_traces_run_graphs_and_intervened_ones_run_eager_and_exact(compiled, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("The capital of France is")
    vector = torch.randn(oracle.model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 2

    before = steps(compiled)
    plain = compiled.generate(ids, max_tokens=6, ignore_eos=True).token_ids
    after_plain = steps(compiled)
    assert after_plain["eager"] == before["eager"] and after_plain["graph"] >= before["graph"] + 6
    if compiled.config.pipeline_parallel_size == 1:  # (whether vLLM 0.26 captures FULL graphs at PP=2: unchecked)
        assert after_plain["graph_idle"] >= before["graph_idle"] + 5  # decode steps: FULL graphs with the taps idle
    assert plain == oracle.greedy(ids, 6)

    # an op at a point that is not a graph tap (the default taps are every layer's resid)
    steered = compiled.generate(ids, ops=[ops.add("layers.1.mlp.output", vector)], max_tokens=6, ignore_eos=True).token_ids
    after_steer = steps(compiled)
    assert after_steer["eager"] >= after_plain["eager"] + 6  # every step of the intervened request
    assert steered == oracle.greedy(ids, 6, hooks={oracle.layers[1].mlp: lambda out: out + vector}) != plain

    def save_all(m):
        for i in range(len(oracle.layers)):
            m.save(f"resid{i}", m.layers[i].resid)

    out = compiled.generate(ids, program=save_all, max_tokens=4, ignore_eos=True)
    expected = oracle.run(ids + out.token_ids[:-1])["resid"]
    for i, want in enumerate(expected):
        torch.testing.assert_close(out.saves[f"resid{i}"], want, atol=ATOL, rtol=ATOL)
    after_program = steps(compiled)  # its first step eager, the others between graph pieces
    assert after_program["eager"] == after_steer["eager"] + 1 and after_program["pieces"] >= after_steer["pieces"] + 3


@pytest.mark.gpu
def test_programs_run_between_graph_pieces_as_transformers_computes(compiled, oracles):
    """Programs that read and write the default taps (every layer's resid) and logits: after their
    first step, every step runs piecewise CUDA graphs with the programs between the pieces. Batched
    and per-invoke programs, beside a plain invoke, against transformers with the same edits."""
    oracle = oracles["tiny-llama"]
    vector = torch.randn(oracle.model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 2
    prompts = ["One two three four", "The capital of France is", "Hello, my name is", "A plain one"]

    def steer(m):
        m.layers[1].resid += vector
        m.save("resid2", m.layers[2].resid)
        m.save("logits", m.logits)

    @interlace.batched
    def together(m):
        m.layers[1].resid += vector
        m.save("resid2", m.layers[2].resid)
        m.save("logits", m.logits)
    before = steps(compiled)
    with compiled.trace(max_tokens=6, ignore_eos=True) as tr:
        tr.invoke(oracle.ids(prompts[0]), program=together)
        tr.invoke(oracle.ids(prompts[1]), program=together)
        tr.invoke(oracle.ids(prompts[2]), program=steer)
        tr.invoke(oracle.ids(prompts[3]))
    after = steps(compiled)
    assert after["pieces"] >= before["pieces"] + 5 and after["eager"] <= before["eager"] + 1
    hooks = {oracle.layers[1]: lambda out: out + vector}
    for prompt, result in zip(prompts[:3], tr.result.invokes):
        ids = oracle.ids(prompt)
        assert result.token_ids == oracle.greedy(ids, 6, hooks=hooks)
        ref = oracle.run(ids + result.token_ids[:-1], hooks)
        torch.testing.assert_close(result.saves["resid2"], ref["resid"][2], atol=ATOL, rtol=ATOL)
    assert tr.result.invokes[3].token_ids == oracle.greedy(oracle.ids(prompts[3]), 6)


@pytest.mark.gpu
def test_patching_with_recv_between_graph_pieces_beside_a_program_that_reads_no_tap(compiled, oracles):
    """Between graph pieces, a receiver averages its layer-1 stream with the sender's last row
    (``recv`` across invokes) while tap-only programs steer beside it; a program in the same batch
    that reads a point no tap serves (an MLP output) makes those steps eager. Every invoke's tokens
    and saves are transformers' with the same edits."""
    oracle = oracles["tiny-llama"]
    vector = torch.randn(oracle.model.config.hidden_size, generator=torch.Generator().manual_seed(7)) * 2
    n = 6
    sender_ids, receiver_ids = oracle.ids("The capital of France is"), oracle.ids("One two three four")
    steered_ids, reader_ids = oracle.ids("Hello, my name is"), oracle.ids("A program that reads an MLP")

    # a batched program whose closure's function holds the vector on the CPU (moved for it)
    def steer(m):
        m.layers[1].resid += vector
        m.save("resid2", m.layers[2].resid)

    def reader(m):
        m.save("mlp", m.layers[1].mlp.output)
        m.layers[2].resid += vector

    before = steps(compiled)
    with compiled.trace(max_tokens=n, ignore_eos=True) as tr:
        tr.invoke(sender_ids, program=send_layer1)
        tr.invoke(receiver_ids, program=average_with_received)
        tr.invoke(steered_ids, program=interlace.batched(lambda m: steer(m)))
    after = steps(compiled)
    assert after["pieces"] >= before["pieces"] + n - 1
    sent, received, steered = tr.result.invokes

    assert sent.token_ids == oracle.greedy(sender_ids, n)
    stream = oracle.run(sender_ids + sent.token_ids[:-1])["resid"][1]
    last_sent = len(sender_ids) - 1  # the sender's row the receiver's prompt gets; then one per step

    def patch(out):
        out = out.clone()
        p = len(receiver_ids)
        out[0, :p] = (out[0, :p] + stream[last_sent]) / 2
        for pos in range(p, out.shape[1]):
            out[0, pos] = (out[0, pos] + stream[last_sent + pos - p + 1]) / 2
        return out

    patched = {oracle.layers[1]: patch}
    assert received.token_ids == oracle.greedy(receiver_ids, n, hooks=patched)
    torch.testing.assert_close(received.saves["patched"], oracle.run(receiver_ids + received.token_ids[:-1], patched)["resid"][2],
                               atol=ATOL, rtol=ATOL)
    hooks = {oracle.layers[1]: lambda out: out + vector}
    assert steered.token_ids == oracle.greedy(steered_ids, n, hooks=hooks)
    torch.testing.assert_close(steered.saves["resid2"], oracle.run(steered_ids + steered.token_ids[:-1], hooks)["resid"][2],
                               atol=ATOL, rtol=ATOL)

    # the same steering beside a program that reads a point no tap serves: those steps run eager
    before = steps(compiled)
    with compiled.trace(max_tokens=n, ignore_eos=True) as tr:
        tr.invoke(steered_ids, program=steer)
        tr.invoke(reader_ids, program=reader)
    after = steps(compiled)
    assert after["eager"] >= before["eager"] + n
    beside, read = tr.result.invokes
    assert beside.token_ids == steered.token_ids and read.token_ids == oracle.greedy(
        reader_ids, n, hooks={oracle.layers[2]: lambda out: out + vector})
    torch.testing.assert_close(beside.saves["resid2"], steered.saves["resid2"], atol=ATOL, rtol=ATOL)
    assert read.saves["mlp"].shape[0] == len(reader_ids) + n - 1


@pytest.mark.gpu
def test_a_trace_mixing_plain_and_intervened_invokes_is_exact_for_both(compiled, oracles):
    oracle = oracles["tiny-llama"]
    prompts = ["One two three four", "The capital of France is", "Hello, my name is"]
    with compiled.trace(max_tokens=5, ignore_eos=True) as tr:
        tr.invoke(oracle.ids(prompts[0]))
        tr.invoke(oracle.ids(prompts[1]), ops=[ops.zero("layers.2.mlp.output")])
        tr.invoke(oracle.ids(prompts[2]))
    zeroed = {oracle.layers[2].mlp: lambda out: torch.zeros_like(out)}
    assert tr.result[0].token_ids == oracle.greedy(oracle.ids(prompts[0]), 5)
    assert tr.result[1].token_ids == oracle.greedy(oracle.ids(prompts[1]), 5, hooks=zeroed)
    assert tr.result[2].token_ids == oracle.greedy(oracle.ids(prompts[2]), 5)


def test_eager_steps_use_the_kernels_of_an_eager_engine_for_compiled_native_ops():
    """A compiled engine's custom ops run ``forward_native`` compiled by torch.compile (vLLM's
    ``CustomOp.maybe_compile``); SiLU-and-mul's is a static function, RMSNorm's a method. Both
    must be found and pointed at ``forward_cuda`` for eager steps (missing the static one cost an
    H100 eager step 4.5 of 21 ms)."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm

    from interlace.workers.graphs import eager_kernels

    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE, custom_ops=["none"]))
    with set_current_vllm_config(config):
        model = torch.nn.Sequential(SiluAndMul(), RMSNorm(8), torch.nn.Linear(8, 8))
    for op in model[:2]:  # as maybe_compile leaves them on a GPU
        op._forward_method = torch.compile(op.forward_native, dynamic=True)
    assert eager_kernels(model) >= 2
    assert model[0]._forward_method == model[0].forward_cuda
    assert model[1]._forward_method == model[1].forward_cuda
