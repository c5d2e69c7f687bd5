"""The embedded default models: tiny random-weight Llama and Qwen2 checkpoints built locally.

Nothing is downloaded. A byte-level BPE tokenizer is trained on a small built-in corpus, the model
is initialised from a fixed seed, and both are written as an ordinary Hugging Face checkpoint that
vLLM and ``transformers`` load alike. The same seed always gives the same weights, so results are
comparable across machines and runs.

    >>> from interlace.core.tiny_models import ensure_tiny_model
    >>> path = ensure_tiny_model("tiny-llama")      # built once, then reused from the cache
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from interlace.core.settings import cache_dir


@dataclass(frozen=True)
class TinySpec:
    """Shape of one embedded model. head_dim is 64: vLLM's CPU attention refuses 16."""

    architecture: str  # "llama" or "qwen2"
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 2
    num_kv_heads: int = 1
    intermediate_size: int = 256
    vocab_size: int = 512
    max_position: int = 1024
    init_std: float = 0.08  # larger than HF's 0.02 so greedy tokens are not near-ties
    seed: int = 0


TINY_MODELS: dict[str, TinySpec] = {
    "tiny-llama": TinySpec("llama"),
    "tiny-qwen2": TinySpec("qwen2", seed=1),
}

# Version of the build recipe: bump it when the generator changes what it writes.
_RECIPE = 1

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads tokens and predicts the next one.
Interpretability researchers read and rewrite hidden activations while the model runs.
The residual stream carries information from layer to layer; attention heads move it between positions.
Steering vectors add a direction to the residual stream and change what the model says next.
Activation patching copies one prompt's activations into another prompt's forward pass.
The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.
Once upon a time there was a small model that lived on a laptop and dreamed of a GPU cluster.
One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June.
def add(a, b): return a + b  # code, numbers 0123456789 and punctuation: ()[]{}<>=+-*/.,;:!?'"
"""


def ensure_tiny_model(name: str) -> Path:
    """Return the folder of embedded model ``name``, building it on first use.

    The build is atomic (written to a temporary folder, then renamed), so concurrent callers, such
    as several test processes, never see a half-written checkpoint.
    """
    if name not in TINY_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; choose one of {sorted(TINY_MODELS)}")
    spec = TINY_MODELS[name]
    digest = hashlib.sha256(json.dumps([asdict(spec), _RECIPE]).encode()).hexdigest()[:12]
    target = cache_dir() / "models" / f"{name}-{digest}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _build(spec, staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").exists():  # lost a race only if the winner finished
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(spec: TinySpec, out: Path) -> None:
    tokenizer = _train_tokenizer(spec.vocab_size)
    tokenizer.save_pretrained(out)
    model = _init_model(spec, vocab_size=len(tokenizer))
    model.save_pretrained(out, safe_serialization=True)


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def _init_model(spec: TinySpec, vocab_size: int):
    import torch
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position,
        initializer_range=spec.init_std,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        torch_dtype="float32",
    )
    if spec.architecture == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif spec.architecture == "qwen2":
        config = transformers.Qwen2Config(**common, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"unknown architecture {spec.architecture!r}")
    torch.manual_seed(spec.seed)
    model = cls(config).to(torch.float32)
    with torch.no_grad():  # norms at 1 would be dull: vary them so every weight matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, spec.init_std)
    return model
