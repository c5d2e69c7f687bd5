"""One invoke's bad write never changes another request, now or later, and never kills the engine.

Each case runs a trace with a hostile invoke (NaN or inf written into its own activations, a
forced token outside the vocabulary, a program that swallows its time-limit interruption) and
then a trace of new prompts whose plain and intervened requests must equal a fresh engine's:
transformers in float32 on the same weights, which these tiny models match token for token.
tests/test_parallel.py runs the write cases again at TP=2, PP=2 and TP=2 x PP=2.
"""

from __future__ import annotations

import io
import itertools
import sys
import time

import pytest
import torch

import interlace
from interlace import ops
from test_cluster import swallow  # catches the time limit's interruption, for ever

_fresh = itertools.count()  # a new prompt for every check: nothing is served from the prefix cache


def _prompt(oracle, words: str) -> list[int]:
    return oracle.ids(f"{words} {next(_fresh)} and then")


def _next_trace_is_exact(model, oracle) -> None:
    """A plain request and two intervened ones (a save, a steering program) equal transformers."""
    plain, saved, steered = (_prompt(oracle, w) for w in ("One two three", "The quick brown fox", "Once upon"))
    vector = torch.randn(oracle.model.config.hidden_size, generator=torch.Generator().manual_seed(3)) * 2

    def steer(m):
        m.layers[1].resid += vector

    with model.trace(max_tokens=6, ignore_eos=True) as tr:
        tr.invoke(plain)
        tr.invoke(saved, ops=[ops.save("layers.2.resid", steps=[0])])
        tr.invoke(steered, program=steer)
    assert tr.result[0].token_ids == oracle.greedy(plain, 6)
    assert tr.result[1].token_ids == oracle.greedy(saved, 6)
    torch.testing.assert_close(tr.result[1].saves["layers.2.resid"], oracle.run(saved)["resid"][2],
                               atol=1e-4 if not torch.cuda.is_available() else 1e-2, rtol=0)
    assert tr.result[2].token_ids == oracle.greedy(steered, 6, hooks={oracle.layers[1]: lambda out: out + vector})


def _nan_in_place(m):
    m.layers[1].resid[:] = float("nan")


def _inf_module_output(m):
    m.layers[2].mlp.output = torch.full_like(m.layers[2].mlp.output, float("inf"))


def _huge_finite(m):  # finite, and overflows in the next norm
    m.layers[0].resid[:] = 1e30


BAD_WRITES = {
    "nan-program": dict(program=_nan_in_place),
    "inf-module-output": dict(program=_inf_module_output),
    "huge-finite": dict(program=_huge_finite),
    "op-scale-inf": dict(ops=[ops.scale("layers.1.resid", float("inf"))]),
    "op-replace-nan": dict(ops=[ops.replace("layers.2.resid", torch.tensor(float("nan")))]),
}


@pytest.mark.parametrize("bad", list(BAD_WRITES))
def test_non_finite_writes_never_reach_other_requests(llama, oracles, bad):
    """The hostile invoke gets what it wrote (its own business); its neighbour in the trace and
    every request of the next trace are exact (its KV-cache blocks are cleared when vLLM takes
    them back: kv_blocks.py)."""
    oracle = oracles["tiny-llama"]
    neighbour = _prompt(oracle, "A neighbour")
    with llama.trace(max_tokens=8, ignore_eos=True) as tr:
        tr.invoke(_prompt(oracle, "Alpha beta gamma delta epsilon zeta"), **BAD_WRITES[bad])
        tr.invoke(neighbour)
    assert tr.result[1].token_ids == oracle.greedy(neighbour, 8)
    _next_trace_is_exact(llama, oracle)


def _force(token, in_place=False):
    def program(m):
        if m.step == 1:
            if in_place:
                m.samples[0] = token
            else:
                m.samples = torch.tensor([token])
    return program


@pytest.mark.parametrize("token", [100000, -5])
@pytest.mark.parametrize("in_place", [False, True], ids=["assigned", "in-place"])
def test_forced_tokens_outside_the_vocabulary_fail_that_invoke_and_the_engine_serves(llama, oracles, token, in_place):
    oracle = oracles["tiny-llama"]
    neighbour = _prompt(oracle, "A neighbour")
    with pytest.raises(interlace.InterventionError, match=rf"token id {token}\b.*outside the vocabulary.*0 to \d+") as err:
        with llama.trace(max_tokens=4, ignore_eos=True) as tr:
            tr.invoke(_prompt(oracle, "Force a token"), program=_force(token, in_place))
            tr.invoke(neighbour)
    assert err.value.invoke == 0
    partial = err.value.partial
    vocab = oracle.model.config.vocab_size
    assert all(0 <= t < vocab for t in partial[0].token_ids)  # the refused token never reached the model
    assert partial[1].token_ids == oracle.greedy(neighbour, 4)
    _next_trace_is_exact(llama, oracle)


def test_a_program_that_swallows_its_interruption_is_stopped_and_the_next_trace_is_exact(llama, oracles):
    """A program that catches every interruption cannot be stopped from inside its thread (the
    engine's): a few seconds past its limit the worker ends itself with a record, the trace
    fails with that reason, and the next trace runs on a new engine."""
    from interlace.workers.watchdog import GRACE_S

    oracle = oracles["tiny-llama"]
    start = time.monotonic()
    with pytest.raises(interlace.WorkerDied, match=r"time limit of 1s.*ended the engine's worker process"):
        llama.generate(_prompt(oracle, "Stubborn"), program=swallow, max_tokens=2, timeout_s=1)
    assert time.monotonic() - start < 1 + GRACE_S + 10  # not vLLM's own time-outs (minutes)
    _next_trace_is_exact(llama, oracle)


def _own_settings(m):
    """Sets torch's thread-wide settings, and reads the model under them (the engine runs its
    layers 1 and 2, and the neighbour's program, while this one waits at layer 2)."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)  # (vLLM's CPU worker ignores this; a GPU worker's is put back)
    torch.set_default_device("meta")  # left set: it ends with this program
    sys.stdout = io.StringIO()  # so is this: what the neighbour prints meanwhile is still the neighbour's
    with torch.enable_grad(), torch.device("meta"):
        m.layers[0].resid += 0
        m.layers[2].resid += 0
        kept = [torch.zeros(1).is_meta, torch.get_default_dtype() == torch.float64, torch.is_grad_enabled()]
    torch.set_default_device(None)
    m.save("kept", torch.tensor(kept))


def test_a_programs_torch_settings_are_its_own(llama, oracles):
    """Settings torch keeps per thread (grad mode, default dtype and device, ``with
    torch.device(...)``) and ``sys.stdout`` that a program sets stay its own across its reads: the
    engine's forward pass and the other invokes' programs run with the engine's. A meta default device across a
    read used to end the engine's worker, failing every trace in the batch."""
    oracle = oracles["tiny-llama"]
    hostile, neighbour = _prompt(oracle, "Settings of my own"), _prompt(oracle, "A neighbour steers")
    vector = torch.randn(oracle.model.config.hidden_size, generator=torch.Generator().manual_seed(5)) * 2

    def steer(m):
        m.layers[1].resid += vector
        m.save("seen", torch.tensor([torch.zeros(1).is_meta, torch.get_default_dtype() == torch.float32,
                                     torch.is_grad_enabled()]))
        print("neighbour", m.step)

    with llama.trace(max_tokens=4, ignore_eos=True) as tr:
        tr.invoke(hostile, program=_own_settings)
        tr.invoke(neighbour, program=steer)
    assert tr.result[0].saves["kept"].all(), "the program lost its own settings at a read"
    assert tr.result[0].token_ids == oracle.greedy(hostile, 4)
    assert tr.result[1].saves["seen"].tolist() == [False, True, False] * 4, "a neighbour ran with another's settings"
    assert tr.result[1].token_ids == oracle.greedy(neighbour, 4, hooks={oracle.layers[1]: lambda out: out + vector})
    assert tr.result[1].printed == "".join(f"neighbour {k}\n" for k in range(4))
    _next_trace_is_exact(llama, oracle)


def _seeded(m):
    torch.manual_seed(0)
    first = torch.randn(3)
    m.layers[0].resid
    m.save("drawn", torch.cat([first, torch.randn(3)]))


def _unseeded(m):  # draws between the seeded program's reads, from the engine's stream
    drawn = torch.rand(6)
    m.layers[0].resid
    m.save("drawn", drawn)


def test_a_program_that_seeds_torch_draws_its_own_stream_and_sampling_stays_random(llama, oracles):
    """``torch.manual_seed`` in a program seeds a stream of its own (program_settings.py): its
    draws are its seed's across its reads, whatever its neighbours draw meanwhile, and the
    engine's sampling and the neighbours' draws are not reseeded by it. Before, the seed was the
    engine's: every invoke sampled the same noise in every trace, and a neighbour drew from it."""
    oracle = oracles["tiny-llama"]
    prompts = [_prompt(oracle, "Seeded noise"), _prompt(oracle, "Unseeded noise"), _prompt(oracle, "Sampled freely")]
    own = torch.Generator().manual_seed(0)
    expected = torch.cat([torch.randn(3, generator=own), torch.randn(3, generator=own)])
    own.manual_seed(0)
    torch.randn(3, generator=own)
    leaked = torch.rand(6, generator=own)  # what the neighbour would draw from the program's seed
    sampled = []
    for _ in range(2):
        with llama.trace(max_tokens=12, ignore_eos=True, temperature=1.0) as tr:
            tr.invoke(prompts[0], program=_seeded)
            tr.invoke(prompts[1], program=_unseeded)
            tr.invoke(prompts[2])
        seeded, unseeded, free = tr.result
        assert seeded.saves["drawn"].numel() == 6 * 12
        assert all(torch.equal(row, expected) for row in seeded.saves["drawn"].view(-1, 6)), "the program's seeded stream moved"
        assert not any(torch.equal(row, leaked) for row in unseeded.saves["drawn"].view(-1, 6)), "a neighbour drew from its seed"
        sampled.append(free.token_ids)
    assert sampled[0] != sampled[1], "the engine's sampling was reseeded by a program: the same tokens twice"
    _next_trace_is_exact(llama, oracle)


def _numerics() -> list:
    # (torch.backends.cudnn and .mkldnn are module objects of their own class: a program naming
    # them could not be pickled until the driver's pickler sent such modules by name)
    import gc

    return [torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision,
            torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark, gc.isenabled()]


def _reads_numerics(m):
    m.layers[0].resid
    m.save("numerics", _numerics())


def _sets_numerics(m):
    import gc

    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    torch.set_float32_matmul_precision("medium")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = True
    gc.disable()
    m.layers[0].resid  # a hand-over: the engine's settings run the forward pass until the program resumes
    m.save("numerics", _numerics())


def test_a_programs_numerics_settings_are_its_own(llama, oracles):
    """torch's numerics settings are the process's: a program's TF32 or bf16 float32 matmuls,
    deterministic algorithms (which make kernels without a deterministic version raise) or
    ``gc.disable()`` were every user's until the engine ended. Now they are the program's own across its reads; its
    neighbours, the engine and the next trace run with the engine's."""
    oracle = oracles["tiny-llama"]
    prompts = [_prompt(oracle, "Numerics of my own"), _prompt(oracle, "A neighbour reads")]
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[1], program=_reads_numerics)
    engine = tr.result[0].saves["numerics"][0]  # (a list a step)
    assert engine[0] != "bf16" and engine[2:] == [False, False, True]
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[0], program=_sets_numerics)
        tr.invoke(prompts[1], program=_reads_numerics)
    mine, neighbour = tr.result
    assert mine.saves["numerics"] == [["bf16", "tf32", True, True, False]] * 3, "the program lost its own settings"
    assert neighbour.saves["numerics"] == [engine] * 3, "a neighbour ran with another program's numerics"
    assert [r.token_ids for r in tr.result] == [oracle.greedy(p, 3) for p in prompts]
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[1], program=_reads_numerics)
    assert tr.result[0].saves["numerics"] == [engine] * 3
    _next_trace_is_exact(llama, oracle)


def test_each_invoke_runs_its_own_copy_of_its_program(llama, oracles):
    """What a program keeps across its steps (a captured dict, a small captured tensor it adds to)
    is its invoke's: invokes of one trace that pass the same function each counted the others'
    steps too (1, 3, 5 and 2, 4, 6), which a cluster that splits the trace over replicas would
    not, and equal bytes in another trace met the same objects. A batched program is one call
    for its trace's invokes: one copy per trace, as for a program of large Python objects (copied
    per invoke, each would cost milliseconds). Large captured tensors stay one per engine."""
    oracle = oracles["tiny-llama"]
    prompts = [_prompt(oracle, "Count my own steps"), _prompt(oracle, "And mine")]
    state = {"steps": 0}
    small = torch.zeros(1)
    large = torch.zeros(2**19)  # 2 MiB: weights, shared

    def counts(m):
        state["steps"] += 1
        small.add_(1)
        m.save("counted", [state["steps"], small.item(), large.data_ptr()])

    @interlace.batched
    def counts_together(m):
        state["steps"] += 1
        m.save("counted", state["steps"])  # (a value not of rows: each invoke gets it whole)

    table = {i: 0 for i in range(20_000)}  # objects past 64 KiB pickled: one copy per trace

    def counts_with_a_table(m):
        state["steps"] += 1
        m.save("counted", state["steps"] + table[0])

    for _ in range(2):  # the second trace sends the same bytes
        with llama.trace(max_tokens=3, ignore_eos=True) as tr:
            for prompt in prompts:
                tr.invoke(prompt, program=counts)
        counted = [r.saves["counted"] for r in tr.result]
        assert [[c[:2] for c in each] for each in counted] == [[[1, 1.0], [2, 2.0], [3, 3.0]]] * 2
        assert len({c[2] for each in counted for c in each}) == 1, "a large captured tensor was copied"
        with llama.trace(max_tokens=3, ignore_eos=True) as tr:
            for prompt in prompts:
                tr.invoke(prompt, program=counts_together)
        assert [r.saves["counted"] for r in tr.result] == [[1, 2, 3]] * 2
        with llama.trace(max_tokens=3, ignore_eos=True) as tr:
            for prompt in prompts:
                tr.invoke(prompt, program=counts_with_a_table)
        assert [r.saves["counted"] for r in tr.result] == [[1, 3, 5], [2, 4, 6]]
    assert state == {"steps": 0} and small.item() == 0  # (the driver's own objects never moved)
    _next_trace_is_exact(llama, oracle)


class _MadeOnce:
    """An object whose rebuilding works once per process (a reconstructor with side effects)."""

    def __reduce__(self):
        return (_make_once, ())


def _make_once():
    import builtins

    if getattr(builtins, "_interlace_made_once", False):
        raise RuntimeError("made once already")
    builtins._interlace_made_once = True
    return _MadeOnce()


def test_a_program_that_cannot_be_copied_is_shared_as_loaded_and_large_objects_are_not_copied():
    import builtins

    import cloudpickle

    from interlace.workers.program_copies import ProgramCopies

    held, weights, text = _MadeOnce(), torch.zeros(2**19), "x" * 10_000

    def program(m):
        return held, weights, text

    try:
        loaded = cloudpickle.loads(cloudpickle.dumps(program))  # as a rank loads it: made once
        copies = ProgramCopies(loaded)
        assert copies.take() is loaded and not copies.large
        assert copies.take() is loaded and copies.large  # its copy could not be made: shared from now on
    finally:
        del builtins._interlace_made_once
    small = torch.zeros(4)
    copies = ProgramCopies(lambda m: (weights, text, small))
    first, second = copies.take(), copies.take()
    assert first is not second
    (w1, t1, s1), (w2, t2, s2) = first(None), second(None)
    assert w1 is w2 and t1 is t2 and s1 is not s2  # weights and text shared, a small tensor each its own


def _reads_stream(m):
    m.layers[1].resid
    m.save("stream", torch.cuda.current_stream().cuda_stream)


def _sets_streams(m):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a read inside: the forward pass goes on on the engine's stream
        m.layers[0].resid
        m.save("inside", torch.cuda.current_stream().cuda_stream == side.cuda_stream)
    torch.cuda.set_stream(side)  # and one left set as the program ends


@pytest.mark.gpu
def test_a_programs_cuda_stream_is_its_own(llama, oracles):
    """The current CUDA stream is the engine thread's: a program that read the model inside ``with
    torch.cuda.stream(side):`` had the rest of everyone's forward pass launched on its stream,
    unordered with the engine's. Now its stream holds in its code across its reads, and the
    engine, its neighbours and the next trace run on the engine's."""
    oracle = oracles["tiny-llama"]
    prompts = [_prompt(oracle, "A stream of my own"), _prompt(oracle, "A neighbour reads")]
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[1], program=_reads_stream)
    engine = tr.result[0].saves["stream"]
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[0], program=_sets_streams)
        tr.invoke(prompts[1], program=_reads_stream)
    mine, neighbour = tr.result
    assert mine.saves["inside"] == [True] * 3, "the program lost its own stream across its read"
    assert neighbour.saves["stream"] == engine, "the forward pass ran on a program's stream"
    assert [r.token_ids for r in tr.result] == [oracle.greedy(p, 3) for p in prompts]
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[1], program=_reads_stream)
    assert tr.result[0].saves["stream"] == engine
    _next_trace_is_exact(llama, oracle)


def _sets_device(m):
    with torch.cuda.device(1):  # a read inside: the engine goes on on its own device
        m.layers[0].resid
        m.save("inside", torch.cuda.current_device())
    torch.cuda.set_device(1)  # and left set as the program ends


def _reads_device(m):
    m.layers[1].resid
    m.save("device", torch.cuda.current_device())


@pytest.mark.gpu
@pytest.mark.ranks(2)
def test_a_programs_cuda_device_is_its_own(llama, oracles):
    """The current CUDA device is the engine thread's too: a program's ``torch.cuda.set_device``
    or ``with torch.cuda.device(1):`` around a read holds in its code only; its neighbours and the
    next trace run on the engine's device (a one-GPU engine on a host of two)."""
    oracle = oracles["tiny-llama"]
    prompts = [_prompt(oracle, "A device of my own"), _prompt(oracle, "A neighbour reads")]
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[1], program=_reads_device)
    engine = tr.result[0].saves["device"]
    assert 1 not in engine
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:
        tr.invoke(prompts[0], program=_sets_device)
        tr.invoke(prompts[1], program=_reads_device)
    mine, neighbour = tr.result
    assert mine.saves["inside"] == [1] * 3, "the program lost its own device across its read"
    assert neighbour.saves["device"] == engine, "the forward pass ran with a program's device"
    assert [r.token_ids for r in tr.result] == [oracle.greedy(p, 3) for p in prompts]
    _next_trace_is_exact(llama, oracle)


def test_engine_settings_that_skip_hooks_are_refused_before_an_engine_starts():
    from interlace.cluster.config import ModelConfig
    from interlace.cluster.engine import engine_args

    for overrides, named in [({"enforce_eager": False}, "enforce_eager=False"),
                             ({"compilation_config": {"mode": 3}}, "mode=3"),
                             ({"compilation_config": 2}, "mode=2"),
                             ({"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}, "cudagraph_mode")]:
        with pytest.raises(ValueError, match=rf"{named}.*forward hooks.*silently"):
            interlace.Model("tiny-llama", **overrides)
        with pytest.raises(ValueError, match=named):  # every engine path (the cluster's too)
            engine_args(ModelConfig.load("tiny-llama"), **overrides)
    model = interlace.Model("tiny-llama", compilation_config={"pass_config": {"fuse_allreduce_rms": False}})
    assert model._engine is None  # accepted, and nothing started
