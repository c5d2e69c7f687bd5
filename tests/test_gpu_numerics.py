"""On GPUs (vLLM's V2 runner): what a program sees matches the CPU and transformers, eager and compiled.

- A program sees exactly the steps whose tokens are returned: vLLM's asynchronous scheduling
  (on by default on GPUs, off on CPUs) runs one step past a request's EOS; interlace drops it
  (workers/interleaver.py, ``Interleaver.finish``). The same check runs on CPUs in
  tests/test_interventions.py.
- ``dtype: float32`` computes in float32: residuals and logits within 1e-4 (relative to their
  largest value) of transformers float32 on the same weights, also while a neighbour's program
  switches on TF32 for itself. vLLM's float32 attention on Hopper
  is its Triton kernel, whose dots ran in TF32 (1.5e-3 off) until interlace set
  ``TRITON_F32_DEFAULT=ieee`` in its workers (workers/plugin.py, ``float32_dots_in_float32``).
- A trace interrupted by Ctrl-C leaves nothing running for the next one (as on CPUs, in
  tests/test_errors.py).

One engine per layout (TP=1, TP=2, PP=2) and mode (eager, compiled with CUDA graphs), started
once for the module's tests. Run on a lent GPU host (1 or 2 GPUs; TP=2 and PP=2 need 2):

    bash bench/gpu_session.sh python3 -m pytest -q -rA tests/test_gpu_numerics.py
"""

from __future__ import annotations

import pytest
import torch

import interlace
from conftest import kept_engine
from test_errors import check_ctrl_c_leaves_nothing
from test_interventions import PROMPT, check_invokes_stop_at_eos

pytestmark = pytest.mark.gpu

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
FLOAT32_RTOL = 1e-4  # largest difference over largest value, per layer and for the logits


def _param(name: str, eager: bool):
    tp, pp = LAYOUTS[name]
    marks = [pytest.mark.gpu] + ([pytest.mark.ranks(tp * pp)] if tp * pp > 1 else [])
    return pytest.param((tp, pp, eager), marks=marks, id=f"{name}-{'eager' if eager else 'compiled'}")


@pytest.fixture(scope="module", params=[_param(name, eager) for name in LAYOUTS for eager in (True, False)])
def engine(request):
    tp, pp, eager = request.param
    if not eager:  # the compiled ones are tests/test_graphs.py's too
        yield kept_engine("tiny-llama", tensor_parallel_size=tp, pipeline_parallel_size=pp, enforce_eager=False)
        return
    model = interlace.Model("tiny-llama", tensor_parallel_size=tp, pipeline_parallel_size=pp, enforce_eager=True)
    model.engine  # start now: a start-up failure shows in the fixture
    yield model
    model.close()


def test_saved_steps_are_the_returned_tokens_when_invokes_stop_at_eos(engine, oracles):
    check_invokes_stop_at_eos(engine, oracles["tiny-llama"])


def test_a_trace_interrupted_by_ctrl_c_leaves_nothing_for_the_next(engine):
    """vLLM 0.26's LLM, like 0.32's, kept an interrupted trace's requests running and handed their
    outputs to the next trace; interlace aborts them (driver/model.py, its 0.26 branch)."""
    check_ctrl_c_leaves_nothing(engine)


def test_float32_residuals_and_logits_match_transformers(engine, oracles):
    _check_float32(engine, oracles["tiny-llama"])


def _sets_tf32(m):
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # TF32 matmuls: about 1e-3 off float32
    m.layers[0].resid
    m.save("tf32", torch.backends.cuda.matmul.fp32_precision == "tf32")


def test_a_programs_tf32_is_its_own_and_its_neighbours_stay_float32(engine, oracles):
    """torch's matmul precision is the process's: a program that switched on TF32 made every
    later matmul of the engine TF32, everyone's (program_settings.py). Its neighbour in the batch
    still matches transformers float32, and the program keeps its own setting across its read."""
    _check_float32(engine, oracles["tiny-llama"], neighbour=_sets_tf32)


def _check_float32(engine, oracle, neighbour=None) -> None:
    ids = oracle.ids(PROMPT)
    n_layers = len(oracle.layers)

    def save_all(m):
        for i in range(n_layers):
            m.save(f"resid{i}", m.layers[i].resid)
        m.save("logits", m.logits)

    with engine.trace(max_tokens=4, ignore_eos=True) as tr:
        if neighbour is not None:
            tr.invoke(oracle.ids("A neighbour of its own"), program=neighbour)
        tr.invoke(ids, program=save_all)
    out = tr.result[-1]
    if neighbour is not None:
        assert tr.result[0].saves["tf32"] == [True] * 4
    seq = ids + out.token_ids[:-1]
    expected = oracle.run(seq)
    pairs = {f"resid{i}": (out.saves[f"resid{i}"], expected["resid"][i]) for i in range(n_layers)}
    pairs["logits"] = (out.saves["logits"], expected["logits"][len(ids) - 1:])
    errors = {}
    for name, (got, want) in pairs.items():
        assert got.dtype == torch.float32 and got.shape == want.shape, (name, got.dtype, got.shape, want.shape)
        errors[name] = float((got - want).abs().max() / want.abs().max())
    print("float32 vs transformers, max |diff| / max |value|:", {k: f"{v:.2e}" for k, v in errors.items()})
    assert max(errors.values()) <= FLOAT32_RTOL, errors
