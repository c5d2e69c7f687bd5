"""Model shapes the benches run: Llama-3 shapes with random bf16 weights (no download), or the
bundled tiny Llama for a CPU smoke run.

A shape's folder holds a Hugging Face config and a small local tokenizer; vLLM makes the weights
itself (``load_format="dummy"``), so an 8B or 70B run needs no checkpoint on the machine.

    python bench/runner_bench.py --shape 8b --graphs       # every bench takes --shape tiny|1b|8b|70b

    >>> import argparse, shapes
    >>> cfg = shapes.model_config(argparse.Namespace(shape="tiny"))
    >>> cfg.name
    'tiny-llama'
"""

from __future__ import annotations

import argparse
import os

# Llama-3.2-1B, Llama-3-8B and Llama-3-70B: the sizes that set a step's cost (vocabulary included).
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, tie_word_embeddings=False),
}
# Two engines (plain vLLM and interlace) share each GPU in the paired benches. A 70B shape's bf16
# weights take 35 GiB per GPU at TP=4: both engines fit four H200s, not four H100s.
GPU_MEMORY_UTILIZATION = 0.35
CHOICES = ["tiny", *SHAPES]


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=CHOICES, default="1b",
                        help="Llama-3 shape with random weights, or the bundled tiny Llama (a CPU smoke run)")


def model_dir(shape: str) -> str:
    return f"/tmp/interlace-bench-llama-{shape}"


def make_model_dir(shape: str) -> str:
    """The shape's folder (written once): its config and a small local tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    path = model_dir(shape)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    LlamaConfig(vocab_size=128256, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                torch_dtype="bfloat16", **SHAPES[shape]).save_pretrained(path)
    return path


def model_config(args: argparse.Namespace, **engine_args):
    """The interlace model config of ``args.shape`` (``engine_args`` over the shape's own)."""
    from interlace.cluster.config import ModelConfig

    if args.shape == "tiny":
        base = ModelConfig.load("tiny-llama")
        return base.model_copy(update={"engine_args": {**base.engine_args, **engine_args}})
    return ModelConfig(name=f"llama-{args.shape}-shape", source=make_model_dir(args.shape), dtype="bfloat16",
                       max_model_len=1024, engine_args={"load_format": "dummy",
                                                        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, **engine_args})


def kv_cache_shape(shape: str) -> tuple[int, int, int, int]:
    """(layers, KV heads, head size, block size) of a shape's KV cache as vLLM lays it out."""
    if shape == "tiny":
        return 4, 1, 64, 128
    dims = SHAPES[shape]
    return dims["num_hidden_layers"], dims["num_key_value_heads"], dims["hidden_size"] // dims["num_attention_heads"], 16
