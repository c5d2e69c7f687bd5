"""Tensor and pipeline parallel engines on CPU (multiprocessing backend), against transformers."""

from __future__ import annotations

import pytest
import torch

import interlace
from interlace import ops

ATOL = 1e-4 if not torch.cuda.is_available() else 1e-2  # GPU float32 matmuls run in TF32
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel(request):
    tp, pp = LAYOUTS[request.param]
    cfg = interlace.Model("tiny-llama").config.with_parallelism(tp=tp, pp=pp)
    model = interlace.Model(cfg)
    model.engine
    yield model
    model.close()


def test_greedy_generation_matches_transformers(parallel, oracles):
    oracle = oracles["tiny-llama"]
    for prompt in ["The capital of France is", "One two three four"]:
        ids = oracle.ids(prompt)
        out = parallel.generate(ids, max_tokens=8, ignore_eos=True)
        assert out.token_ids == oracle.greedy(ids, 8)


def test_ops_save_and_steer_match_transformers(parallel, oracles):
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("The capital of France is")
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 2
    out = parallel.generate(ids, ops=[ops.save("layers.0.resid", steps=[0]), ops.save("layers.3.resid", steps=[0])])
    ref = oracle.run(ids)["resid"]
    torch.testing.assert_close(out.saves["layers.0.resid"], ref[0], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(out.saves["layers.3.resid"], ref[3], atol=ATOL, rtol=ATOL)
    expected = oracle.greedy(ids, 5, hooks={oracle.layers[1]: lambda o: o + vector})
    steered = parallel.generate(ids, ops=[ops.add("layers.1.resid", vector)], max_tokens=5, ignore_eos=True)
    assert steered.token_ids == expected


def test_programs(parallel, oracles):
    """TP: every rank runs the program on the same full residual stream; rank 0 reports.
    PP: programs are refused with a message naming the reason (ops work, see above)."""
    oracle = oracles["tiny-llama"]
    ids = oracle.ids("The capital of France is")
    vector = torch.randn(128, generator=torch.Generator().manual_seed(3)) * 2

    def program(m):
        m.layers[1].resid += vector
        m.save("resid2", m.layers[2].resid)

    if parallel.config.pipeline_parallel_size > 1:
        with pytest.raises(interlace.InterventionError, match="lives on another pipeline stage"):
            parallel.generate(ids, program=program)
        return
    out = parallel.generate(ids, program=program, max_tokens=5, ignore_eos=True)
    hooks = {oracle.layers[1]: lambda o: o + vector}
    assert out.token_ids == oracle.greedy(ids, 5, hooks=hooks)
    expected = oracle.run(ids + out.token_ids[:-1], hooks=hooks)["resid"][2]
    torch.testing.assert_close(out.saves["resid2"], expected, atol=ATOL, rtol=ATOL)
