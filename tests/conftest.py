"""Shared fixtures: real vLLM engines (started once per session) and the transformers oracle.

Engines take 20-70 s to start on CPU, so every test shares the few engines below; the oracle is
``transformers`` running the very same weights in float32.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

import interlace
from interlace.cluster.config import ModelConfig

# Reproducible CPU numerics, and quiet logs.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` run where torch sees a GPU (the lent GPU machines); tests marked
    ``ranks(n)`` run on a CPU (logical ranks) or where at least n GPUs are visible (each rank
    takes one). A module's ``CPU_LAYOUTS`` (model -> layouts) narrows its parallel layouts for a
    model on a CPU, and its ``CPU_OWN_TESTS_ONLY`` the layouts at which only its own tests run there,
    not those it collects again from other modules (tests/test_parallel.py). Elsewhere they are
    deselected, and the summary line counts them."""
    gpus = torch.cuda.device_count()

    def runs_here(item) -> bool:
        ranks = item.get_closest_marker("ranks")
        return ("gpu" not in item.keywords or gpus > 0) and not (ranks and 0 < gpus < ranks.args[0]) \
            and (gpus > 0 or _in_cpu_layouts(item))

    elsewhere = [item for item in items if not runs_here(item)]
    if elsewhere:
        items[:] = [item for item in items if runs_here(item)]
        config.hook.pytest_deselected(items=elsewhere)


def _in_cpu_layouts(item) -> bool:
    layouts = getattr(item.module, "CPU_LAYOUTS", None)
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if params.get("layout") in getattr(item.module, "CPU_OWN_TESTS_ONLY", ()) and item.function.__module__ != item.module.__name__:
        return False  # a test collected again from another module, at a layout that runs only the module's own
    return not layouts or "layout" not in params or params["layout"] in layouts.get(params.get("any_model"), [params["layout"]])


# Engine settings for every shared engine, e.g. '{"enforce_eager": false}' to run the suite on
# compiled GPU engines with CUDA graphs (interventions then run in eager steps: workers/graphs.py).
ENGINE_OVERRIDES = json.loads(os.environ.get("INTERLACE_TEST_ENGINE_ARGS", "{}"))


def _model(name: str, **overrides) -> interlace.Model:
    model = interlace.Model(name, **{**ENGINE_OVERRIDES, **overrides})
    model.engine  # start now, so a start-up failure shows in the fixture, not in a test
    return model


def shared_memory_files(pids) -> list[Path]:
    """The files directly in /dev/shm that the processes ``pids`` (ints or psutil.Process) have
    mapped: an engine's segments (vLLM's message queues between its processes). Read by the
    fault tests, which check that none outlives its engine."""
    import psutil

    paths = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = pid if isinstance(pid, psutil.Process) else psutil.Process(pid)
            paths |= {Path(m.path) for m in process.memory_maps() if os.path.dirname(m.path) == "/dev/shm"}
    return sorted(paths)


def socket_files(pids=None) -> set[Path]:
    """The Unix socket files directly in the temp folder (where vLLM's ZMQ endpoints are made):
    those the processes ``pids`` (ints or psutil.Process) have bound, or every one there."""
    import psutil
    import stat
    import tempfile

    folder = Path(tempfile.gettempdir())
    if pids is None:
        return {p for p in folder.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)}
    found = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            process = pid if isinstance(pid, psutil.Process) else psutil.Process(pid)
            found |= {Path(c.laddr) for c in process.net_connections(kind="unix")
                      if c.laddr and Path(c.laddr).parent == folder}
    return found


def no_new_socket_files(before: set[Path], timeout_s: float = 15) -> None:
    """No socket file in the temp folder besides ``before`` within ``timeout_s`` (a failed
    engine start removes its own over a few seconds: cluster/engine.py)."""
    import time

    deadline = time.monotonic() + timeout_s
    while socket_files() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not socket_files() - before


_KEPT: dict[tuple, interlace.Model] = {}


def kept_engine(name: str, **settings) -> interlace.Model:
    """One engine per settings for the whole session, for modules that need the same one: the
    GPU modules' compiled engines (tests/test_gpu_numerics.py, tests/test_graphs.py) each take
    one to three minutes to start."""
    key = (name, tuple(sorted(settings.items())))
    if key not in _KEPT:
        _KEPT[key] = interlace.Model(name, **settings)
        _KEPT[key].engine
    return _KEPT[key]


@pytest.fixture(scope="session", autouse=True)
def _close_kept_engines():
    yield
    while _KEPT:
        _KEPT.popitem()[1].close()


@pytest.fixture(scope="session")
def llama():
    model = _model("tiny-llama")
    yield model
    model.close()


@pytest.fixture(scope="session")
def qwen():
    model = _model("tiny-qwen2")
    yield model
    model.close()


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen2"])
def any_model(request):
    # Engines start lazily, so `-k "not qwen"` starts only the Llama engine.
    return request.getfixturevalue({"tiny-llama": "llama", "tiny-qwen2": "qwen"}[request.param])


class Oracle:
    """transformers, float32, same checkpoint: the reference for every activation test."""

    def __init__(self, name: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = ModelConfig.load(name).checkpoint_path()
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.layers = self.model.model.layers

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=True)["input_ids"]

    @torch.no_grad()
    def run(self, ids: list[int], hooks: dict | None = None) -> dict:
        """Forward ``ids``; returns logits and the residual stream after every layer.

        ``hooks``: {module: fn(output) -> output} applied during the forward.
        """
        captured, handles = {}, []
        for i, layer in enumerate(self.layers):
            handles.append(layer.register_forward_hook(
                lambda _m, _a, out, i=i: captured.__setitem__(i, (out[0] if isinstance(out, tuple) else out)[0].clone())))
        for module, fn in (hooks or {}).items():
            handles.append(module.register_forward_hook(lambda _m, _a, out, fn=fn: fn(out)))
        try:
            logits = self.model(torch.tensor([ids])).logits[0]
        finally:
            for h in handles:
                h.remove()
        return {"logits": logits, "resid": [captured[i] for i in range(len(self.layers))]}

    @torch.no_grad()
    def greedy(self, ids: list[int], n: int, hooks: dict | None = None) -> list[int]:
        """Greedy continuation, re-running the whole sequence each step (hooks see every token)."""
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.run(seq, hooks)["logits"][-1].argmax()))
        return seq[len(ids):]


@pytest.fixture(scope="session")
def oracles():
    return {name: Oracle(name) for name in ("tiny-llama", "tiny-qwen2")}


@pytest.fixture
def oracle(any_model, oracles):
    return oracles[any_model.config.name]
