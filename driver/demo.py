"""The main job on the embedded default: ``./dev demo`` (or ``python -m interlace.demo``).

Starts a local CPU vLLM engine on the bundled tiny Llama, generates for a few prompts, then runs
one trace with interventions: a logit lens over every layer, a steering vector as a declarative op,
and activation patching between two invokes in the same forward pass.
"""

from __future__ import annotations

import argparse
import time

import torch

import interlace
from interlace import ops

PROMPTS = ["The capital of France is", "Once upon a time", "Steering vectors add"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama", help="bundled config name or YAML path")
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args(argv)

    started = time.monotonic()
    with interlace.Model(args.model) as model:
        model.engine
        print(f"engine up in {time.monotonic() - started:.0f}s: {model.config.name}")

        print("\n== plain generation")
        with model.trace(max_tokens=args.max_tokens) as tr:
            for prompt in PROMPTS:
                tr.invoke(prompt)
        for prompt, out in zip(PROMPTS, tr.result):
            print(f"{prompt!r} -> {out.text!r}")

        print("\n== one trace, three interventions")
        hidden = model.engine.llm_engine.vllm_config.model_config.get_hidden_size()
        vector = torch.randn(hidden, generator=torch.Generator().manual_seed(0)) * 3
        clean = model.tokenizer.encode(PROMPTS[0])
        corrupt = clean[:-2] + [clean[-3], clean[-1]]  # one token swapped: same length

        def logit_lens(m):  # what each layer would predict for the last token, at step 0
            if m.step == 0:
                n_layers = len(m.layers)
                for i in range(n_layers):
                    m.save(f"layer{i}", m.last(m.layers[i].resid))

        def send_clean(m):
            m.send("clean", m.layers[1].resid.clone())

        def patch(m):  # invoke 2 takes invoke 1's layer-1 residual at the swapped position
            m.layers[1].resid[-2] = m.recv("clean")[-2]
            m.save("logits", m.logits)

        with model.trace(max_tokens=args.max_tokens, ignore_eos=True) as tr:
            tr.invoke(PROMPTS[0], program=logit_lens)
            tr.invoke(PROMPTS[0], ops=[ops.add("layers.1.resid", vector)])
            tr.invoke(clean, program=send_clean, steps=[0])  # programs run at step 0 only
            tr.invoke(corrupt, program=patch, steps=[0])

        lens = _logit_lens(model)
        print("logit lens (top token after each layer, prompt's last position):")
        for name, resid in tr.result[0].saves.items():
            print(f"  {name}: {model.tokenizer.decode([int(lens(resid).argmax())])!r}")
        print(f"steered: {PROMPTS[0]!r} -> {tr.result[1].text!r}")
        patched = model.tokenizer.decode([int(tr.result[3].saves["logits"][0].argmax())])
        print(f"patched: next token {patched!r} (clean run: {model.tokenizer.decode(tr.result[2].token_ids[:1])!r})")
    print(f"\ndone in {time.monotonic() - started:.0f}s")


def _logit_lens(model: interlace.Model):
    """Final RMSNorm then unembedding, read from the checkpoint (CPU workers repack weights)."""
    from safetensors.torch import load_file

    weights = load_file(f"{model.config.checkpoint_path()}/model.safetensors")
    norm, unembed = weights["model.norm.weight"], weights["lm_head.weight"]

    def lens(resid: torch.Tensor) -> torch.Tensor:
        normed = resid * torch.rsqrt(resid.pow(2).mean(-1, keepdim=True) + 1e-6) * norm
        return normed @ unembed.T

    return lens


if __name__ == "__main__":
    main()
