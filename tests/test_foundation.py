"""Foundation: the embedded models, the config schema and the engine match transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from interlace.cluster.config import ModelConfig
from interlace.core.tiny_models import TINY_MODELS, ensure_tiny_model

PROMPTS = ["The capital of France is", "Steering vectors add a direction", "One two three four"]


def test_tiny_models_are_deterministic(tmp_path, monkeypatch):
    first = load_file(ensure_tiny_model("tiny-qwen2") / "model.safetensors")
    monkeypatch.setenv("INTERLACE_CACHE", str(tmp_path))
    rebuilt_path = ensure_tiny_model("tiny-qwen2")
    assert str(rebuilt_path).startswith(str(tmp_path))
    rebuilt = load_file(rebuilt_path / "model.safetensors")
    assert first.keys() == rebuilt.keys()
    for name in first:
        assert torch.equal(first[name], rebuilt[name]), name


def test_embedded_models_have_the_documented_shape():
    for name, spec in TINY_MODELS.items():
        config = ModelConfig.load(name)
        import json

        hf = json.loads((ensure_tiny_model(name) / "config.json").read_text())
        assert hf["hidden_size"] // hf["num_attention_heads"] == 64  # the CPU backend refuses 16
        assert hf["num_hidden_layers"] == spec.num_layers
        assert config.source == f"embedded:{name}"


def test_config_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"not a bundled config \(one of \['tiny-llama', 'tiny-qwen2'\]\), a .yaml file, a checkpoint folder"):
        ModelConfig.load("no-such-model")
    with pytest.raises(ValueError, match="embedded:tiny-llama"):
        ModelConfig(name="x", source="embedded:nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsource: embedded:tiny-llama\nmax_tokens: 3\n")
    with pytest.raises(ValueError, match="max_tokens"):  # extra fields are refused, not ignored
        ModelConfig.load(bad)


def test_next_token_logprobs_match_transformers(any_model, oracle):
    from vllm import SamplingParams

    for prompt in PROMPTS:
        ids = oracle.ids(prompt)
        out = any_model.engine.generate(
            [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0, logprobs=20),
            use_tqdm=False)[0]
        expected = torch.log_softmax(oracle.run(ids)["logits"][-1], dim=-1)
        got = out.outputs[0].logprobs[0]
        assert len(got) >= 20
        for token_id, lp in got.items():
            # float32 on both sides: on CPU only summation order differs; GPUs run float32
            # matmuls in TF32
            tolerance = 1e-4 if not torch.cuda.is_available() else 2e-2
            assert abs(lp.logprob - expected[token_id].item()) < tolerance, (prompt, token_id)


def test_greedy_continuations_match_transformers(any_model, oracle):
    from vllm import SamplingParams

    for prompt in PROMPTS:
        ids = oracle.ids(prompt)
        out = any_model.engine.generate(
            [{"prompt_token_ids": ids}], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
            use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == oracle.greedy(ids, 8)


def test_a_program_from_a_users_own_module_reaches_ranks_that_cannot_import_it(tmp_path, monkeypatch):
    """Ranks under vLLM's Ray executor, a cluster's replicas and a server have no path to the
    user's scripts or test modules: programs defined in one travel by value (an engine's ranks
    under the multiprocessing executor inherit the path, which hid this)."""
    import subprocess
    import sys

    from interlace.core.trace import Invoke, encode_payloads

    (tmp_path / "my_study.py").write_text("SCALE = 3\n\ndef steer(m):\n    m.layers[1].resid[:] *= SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import my_study

    [payload] = encode_payloads([Invoke("hi", program=my_study.steer)], "t", "", 60.0, 1 << 20)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, cloudpickle; f = cloudpickle.loads(sys.stdin.buffer.read()); "
                               "print(f.__name__, f.__globals__['SCALE'])"],
        input=payload.program, capture_output=True, cwd=elsewhere, timeout=60)
    assert loaded.returncode == 0, loaded.stderr.decode()[-2000:]
    assert loaded.stdout.decode().split() == ["steer", "3"]
    import cloudpickle

    assert "my_study" not in cloudpickle.list_registry_pickle_by_value()  # none left registered


def test_encoding_leaves_a_module_the_caller_registered_by_value_registered(tmp_path, monkeypatch):
    """A caller that pickles its module by value itself (a sweep's plan does) keeps it so after
    interlace encodes a trace inside, and no module interlace registered stays registered."""
    import cloudpickle

    from interlace.core.trace import Invoke, encode_payloads

    (tmp_path / "own_study.py").write_text("def look(m):\n    m.save('x', m.layers[0].resid)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import own_study

    cloudpickle.register_pickle_by_value(own_study)
    try:
        encode_payloads([Invoke("hi", program=own_study.look)], "t", "", 60.0, 1 << 20)
        assert "own_study" in cloudpickle.list_registry_pickle_by_value()
    finally:
        cloudpickle.unregister_pickle_by_value(own_study)
    assert "own_study" not in cloudpickle.list_registry_pickle_by_value()


def test_a_checkpoint_folder_or_a_hugging_face_id_is_a_model(llama):
    """``Model("/models/Llama-3.2-1B")``, as vLLM users name a model, was refused ("no bundled
    model config"): a checkpoint needed a YAML file of its own. A folder with a config.json, or a
    Hugging Face id, is now a config of its own, with vLLM's defaults (dtype "auto", the model's
    context length); the tiny Llama's folder, in float32 as its bundled config says, serves the
    same tokens and saves as that config."""
    import interlace

    folder = ensure_tiny_model("tiny-llama")
    config = ModelConfig.load(str(folder))
    assert (config.source, config.max_model_len, config.dtype) == (str(folder), None, "auto")
    hub = ModelConfig.load("meta-llama/Llama-3.2-1B")
    assert (hub.name, hub.source, hub.max_model_len) == ("Llama-3.2-1B", "meta-llama/Llama-3.2-1B", None)
    model = interlace.Model(str(folder), dtype="float32")
    try:
        program = lambda m: m.save("h", m.layers[1].resid)  # noqa: E731
        got, want = (target.generate(PROMPTS[0], program=program, max_tokens=4, ignore_eos=True) for target in (model, llama))
        assert got.token_ids == want.token_ids and torch.equal(got.saves["h"], want.saves["h"])
        assert model.engine.llm_engine.model_config.max_model_len == 1024  # the checkpoint's own
    finally:
        model.close()


def test_the_command_names_its_version_and_the_stack_it_runs_on(capsys):
    from importlib.metadata import version

    from interlace.cli import main

    with pytest.raises(SystemExit) as ended:
        main(["--version"])
    assert ended.value.code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"interlace {version('interlace')} (") and f"ray {version('ray')}" in line
    assert f"torch {torch.__version__}" in line and "vllm" in line and "not installed" not in line
