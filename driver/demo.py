"""The main job on the embedded default: ``./dev demo`` (or ``python -m interlace.demo``).

By default, the cluster demo: a local Ray cluster with two replicas of the bundled tiny Llama on
CPU, a batch of traces with interventions spread across them (printing which replica served how
many), and one large trace split across both whose shared value merges into one.

``--local``: one local CPU vLLM engine, a few prompts, then one trace with interventions: a logit
lens over every layer, a steering vector as a declarative op, and activation patching between two
invokes in the same forward pass.
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
    parser.add_argument("--local", action="store_true", help="one local engine instead of a two-replica cluster")
    parser.add_argument("--cluster", default="tiny-llama-2", help="bundled cluster config name or YAML path")
    args = parser.parse_args(argv)
    if not args.local:
        return cluster_demo(args.cluster, args.max_tokens)

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


def cluster_demo(config: str, max_tokens: int) -> None:
    import ray

    started = time.monotonic()
    # Engine logs go to Ray's log files, not the terminal.
    ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    logs = ray._private.worker._global_node.get_logs_dir_path()  # noqa: SLF001 - where to look
    print(f"starting a local Ray cluster and the replicas of {config!r} (engine logs: {logs})")
    with interlace.Cluster(config) as cluster:
        print(f"{len(cluster.status()['replicas'])} replicas up in {time.monotonic() - started:.0f}s")

        def keep_last(m):
            m.save("resid2", m.last(m.layers[2].resid))

        vector = torch.randn(128, generator=torch.Generator().manual_seed(0)) * 3
        print("\n== 40 traces at once: programs, steering ops, plain prompts")
        before = _served(cluster)
        futures = []
        for i in range(40):
            tr = cluster.trace(max_tokens=max_tokens)
            prompt = f"{PROMPTS[i % len(PROMPTS)]} ({i})"
            if i % 3 == 0:
                tr.invoke(prompt, program=keep_last)
            elif i % 3 == 1:
                tr.invoke(prompt, ops=[ops.add("layers.1.resid", vector)])
            else:
                tr.invoke(prompt)
            futures.append(cluster.submit(tr))
        results = [f.result() for f in futures]
        print(f"  {results[0][0].prompt!r} -> {results[0][0].text!r}, saved {tuple(results[0][0].saves['resid2'].shape)}")
        print(f"  {results[1][0].prompt!r} (steered) -> {results[1][0].text!r}")
        print("  traces per replica: " + ", ".join(f"replica {i}: {n - b}" for i, (n, b) in enumerate(zip(_served(cluster), before))))

        @interlace.batched
        def mean_resid(m):
            m.share("mean_last", m.last(m.layers[2].resid), merge="mean")

        print("\n== one trace of 64 invokes, split across the replicas, one shared mean")
        before = _served(cluster)
        with cluster.trace(max_tokens=1) as tr:
            for i in range(64):
                tr.invoke(f"Sample {i}: {PROMPTS[i % len(PROMPTS)]}", program=mean_resid)
        shards = [n - b for n, b in zip(_served(cluster), before)]
        print(f"  shards per replica: {shards}; merged mean over 64 invokes: shape "
              f"{tuple(tr.result.shared['mean_last'].shape)}, norm {tr.result.shared['mean_last'].norm():.3f}")
        print(f"\nstatus: {[(r['index'], r['state'], r['shards_served'], r['restarts']) for r in cluster.status()['replicas']]}")
    ray.shutdown()
    print(f"\ndone in {time.monotonic() - started:.0f}s")


def _served(cluster) -> list[int]:
    return [r["shards_served"] for r in cluster.status()["replicas"]]


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
