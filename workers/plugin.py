"""vLLM plugin: build an engine's graph taps into its model before vLLM compiles it.

Taps (taps.py) must be part of the model when torch.compile traces it, which happens inside the
engine's start-up, long before interlace's worker extension is called. vLLM runs the functions of
the ``vllm.general_plugins`` entry point group in every process it starts; interlace's wraps the
model loader so that a model loaded with ``additional_config={"interlace_taps": [...]}`` (which
:func:`interlace.cluster.engine.engine_args` sets from ``ModelConfig.graph_taps``) leaves the
loader tapped. Any other engine, plain vLLM included, loads as it always did. vLLM hashes
``additional_config`` into its compile cache key, so a tapped engine never loads a plain engine's
compiled graphs, nor the reverse.
"""

from __future__ import annotations

import functools

TAPS_KEY = "interlace_taps"


def register() -> None:
    """The entry point (loaded in every vLLM process, possibly more than once)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.load_model
    if getattr(original, "_interlace", False):
        return

    @functools.wraps(original)
    def load_model(self, vllm_config, model_config, *args, **kwargs):
        model = original(self, vllm_config, model_config, *args, **kwargs)
        specs = (getattr(vllm_config, "additional_config", None) or {}).get(TAPS_KEY)
        if specs and model_config is vllm_config.model_config:  # the served model, not a drafter
            from interlace.workers.taps import install

            scheduler = vllm_config.scheduler_config
            install(model, list(specs), max_tokens=scheduler.max_num_batched_tokens,
                    max_vectors=2 * scheduler.max_num_seqs + 1, dtype=model_config.dtype)
        return model

    load_model._interlace = True
    BaseModelLoader.load_model = load_model
