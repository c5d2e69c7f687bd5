"""The one config schema: which model an engine serves and how it is laid out.

Python, YAML files under ``configs/`` and (later) the CLI, Serve and Helm values all read these
models, so a setting means the same thing everywhere.

    >>> from interlace.cluster.config import ModelConfig
    >>> cfg = ModelConfig.load("tiny-llama")                 # a bundled config, by name
    >>> cfg = ModelConfig.load("configs/models/mine.yaml")   # or any YAML file
    >>> cfg.model_copy(update={"tensor_parallel_size": 2}).world_size
    2
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

EMBEDDED_PREFIX = "embedded:"


class ModelConfig(BaseModel):
    """One model served by one engine (one replica, TP x PP ranks)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = Field(description="Short name used in logs, metrics and results.")
    source: str = Field(
        description="'embedded:<name>' for a bundled tiny model, or a local checkpoint folder."
    )
    dtype: str = Field("auto", description="Weights and activations dtype, as vLLM spells it.")
    max_model_len: int = Field(512, gt=0, description="Longest prompt plus generation, in tokens.")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks one layer is split across.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages the layers are split into.")
    seed: int = Field(0, description="Engine sampling seed.")
    kv_cache_bytes: int | None = Field(
        None, gt=0, description="KV cache size; default: 256 MiB on CPU, vLLM's sizing on GPU."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Further vLLM engine arguments, passed through as is."
    )

    @model_validator(mode="after")
    def _check_source(self) -> "ModelConfig":
        if self.source.startswith(EMBEDDED_PREFIX):
            from interlace.tiny_models import TINY_MODELS

            name = self.source[len(EMBEDDED_PREFIX) :]
            if name not in TINY_MODELS:
                raise ValueError(
                    f"source {self.source!r}: no embedded model {name!r}; "
                    f"choose one of {[EMBEDDED_PREFIX + n for n in sorted(TINY_MODELS)]}"
                )
        return self

    @classmethod
    def load(cls, name_or_path: str | Path) -> "ModelConfig":
        """Load a bundled config by name (``"tiny-llama"``) or any YAML file by path."""
        path = Path(name_or_path)
        if path.suffix in (".yaml", ".yml"):
            return cls.model_validate(yaml.safe_load(path.read_text()))
        bundled = resources.files("interlace.configs") / "models" / f"{name_or_path}.yaml"
        if not bundled.is_file():
            known = sorted(
                p.name.removesuffix(".yaml")
                for p in (resources.files("interlace.configs") / "models").iterdir()
                if p.name.endswith(".yaml") and ".example" not in p.name
            )
            raise ValueError(
                f"no bundled model config {name_or_path!r}; choose one of {known} "
                "or pass the path of a .yaml file"
            )
        return cls.model_validate(yaml.safe_load(bundled.read_text()))

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine (TP x PP)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def checkpoint_path(self) -> str:
        """The folder vLLM and transformers load; builds an embedded model on first use."""
        if self.source.startswith(EMBEDDED_PREFIX):
            from interlace.tiny_models import ensure_tiny_model

            return str(ensure_tiny_model(self.source[len(EMBEDDED_PREFIX) :]))
        return self.source
