"""The examples in README.md and docs/guide.md run as written, on the embedded tiny Llama.

Each file's Python blocks run in order in one namespace, as a reader pasting them into one script
would, against the session's engine (``interlace.Model("tiny-llama")`` in the text is that
engine). Each test then checks what the examples printed, the traces they ran, and the programs
they defined without running.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Blocks that start engines of their own (their content runs in tests/test_parallel.py and, for a
# compiled GPU engine with graph taps, tests/test_taps.py).
STARTS_ANOTHER_ENGINE = ("tensor_parallel_size", "graph_taps")


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _run(path: Path, llama) -> tuple[dict, str, list]:
    """Runs the blocks; returns the namespace, what they printed, and each trace they ran."""
    namespace = {"__name__": "__docs__"}
    printed, traces = io.StringIO(), []
    for block in _blocks(path):
        if any(word in block for word in STARTS_ANOTHER_ENGINE):
            continue
        code = block.replace('interlace.Model("tiny-llama")', "__engine__")
        namespace["__engine__"] = llama
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{path.name} block", "exec"), namespace)  # noqa: S102 - our own docs
        if namespace.get("tr") is not None and (not traces or namespace["tr"] is not traces[-1]):
            traces.append(namespace["tr"])
    return namespace, printed.getvalue(), traces


def test_readme_quickstart_runs(llama):
    namespace, printed, _ = _run(ROOT / "README.md", llama)
    result = namespace["tr"].result
    assert result[0].saves["resid2"].shape == (len(llama.tokenizer.encode("The capital of France is")) + 7, 128)
    assert result[0].saves["logits"].shape[0] == 8
    assert str(result[0].saves["resid2"].shape[-1]) in printed


def test_guide_examples_run(llama):
    namespace, printed, traces = _run(ROOT / "docs" / "guide.md", llama)
    first, patching, sweep, shared = traces
    assert printed.count("\n") == 7  # the first example's text, the debug program's 2 steps, the logit lens's 4 layers
    assert namespace["debugged"].printed.count("resid norm") == 2
    assert first.result[1].saves["h"].shape == (3 + 7, 128)  # 3 prompt tokens, then 7 more steps of 8
    assert namespace["out"].saves.keys() == {f"layer{i}" for i in range(4)}
    assert patching.result[1].saves["logits"].shape == (1, llama.engine.llm_engine.model_config.get_vocab_size())
    assert [r.saves["last"].shape for r in sweep.result] == [(1, 128), (1, 128)]
    assert shared.result.shared["count"] == 2 and shared.result.shared["last"].shape == (2, 128)
    # programs the guide defines without running them (its TP and PP section), here at TP=1
    heads = llama.generate("Hello", program=namespace["heads"])
    assert heads.saves["v"].shape[-1] == 64 and heads.saves["unembed_row"].shape == (128,)
    steered = llama.generate("Hello", program=namespace["probe_gradient"], max_tokens=2)  # Limits today
    assert len(steered.token_ids) == 2
    carried = llama.generate("Hello", program=namespace["carry_forward"], max_tokens=2)
    assert len(carried.token_ids) == 2
    with llama.trace(max_tokens=3, ignore_eos=True) as tr:  # each invoke's own "first" (Programs)
        tr.invoke("Hello", program=namespace["relative_norm"])
        tr.invoke("A longer prompt than that one", program=namespace["relative_norm"])
    solo = llama.generate("Hello", program=namespace["relative_norm"], max_tokens=3, ignore_eos=True)
    assert torch.allclose(torch.as_tensor(tr.result[0].saves["ratio"]), torch.as_tensor(solo.saves["ratio"]), rtol=1e-4)
