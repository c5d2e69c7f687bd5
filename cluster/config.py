"""The one config schema: which model an engine serves and how it is laid out.

Python, YAML files under ``configs/``, the CLI, Serve and Helm values all read these
models, so a setting means the same thing everywhere.

    >>> from interlace.cluster.config import ModelConfig
    >>> cfg = ModelConfig.load("tiny-llama")                 # a bundled config, by name
    >>> cfg = ModelConfig.load("configs/models/mine.yaml")   # or any YAML file
    >>> cfg = ModelConfig.load("/models/Llama-3.2-1B")       # or a checkpoint folder (or a Hugging Face id)  # doctest: +SKIP
    >>> cfg.model_copy(update={"tensor_parallel_size": 2}).world_size
    2
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from interlace.core.tiny_models import TINY_MODELS, ensure_tiny_model
from interlace.core.trace import check_programless

EMBEDDED_PREFIX = "embedded:"
# A decoder layer's resid, or the output of one of its children (as workers/taps.py reads them).
_GRAPH_TAP = re.compile(r"(model\.)?layers\.\d+\.(resid|[A-Za-z_]\w*\.output)")


def _read_yaml(path) -> Any:
    """A config file's YAML; a syntax error is a ValueError naming the file and line, as every other
    refused config is (``interlace sweep`` answered a YAML typo with a traceback)."""
    try:
        with path.open() as stream:  # (a stream: the error's mark names the file)
            return yaml.safe_load(stream)
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {exc}") from None


class ModelConfig(BaseModel):
    """One model served by one engine (one replica, TP x PP ranks)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = Field(description="Short name used in logs, metrics and results.")
    source: str = Field(
        description="'embedded:<name>' for a bundled tiny model, a local checkpoint folder, or a Hugging Face "
        "model id (vLLM finds it in the Hugging Face cache or downloads it)."
    )
    dtype: str = Field("auto", description="Weights and activations dtype, as vLLM spells it.")
    max_model_len: int | None = Field(512, gt=0, description="Longest prompt plus generation, in tokens; None: "
                                      "the model's own, as vLLM takes it.")
    tensor_parallel_size: int = Field(1, ge=1, description="Ranks one layer is split across.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Stages the layers are split into.")
    seed: int = Field(0, description="Engine sampling seed.")
    kv_cache_bytes: int | None = Field(
        None, gt=0, description="KV cache size; default: 256 MiB on CPU, vLLM's sizing on GPU."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Further vLLM engine arguments, passed through as is."
    )
    graph_taps: list[str] | Literal["resid", "all"] | None = Field(
        None,
        description="Points of a compiled engine where programs and declarative ops run between or inside its "
        "CUDA graphs: decoder layers' residual streams ('layers.3.resid') and their attention or MLP outputs "
        "('layers.3.mlp.output'). 'resid': every layer's residual stream; 'all': every layer's residual "
        "stream, attention and MLP outputs; []: none. Default: 'resid' on a compiled engine, none on an "
        "eager one. Steps that intervene anywhere else run eager.",
    )

    @model_validator(mode="after")
    def _check_source(self) -> "ModelConfig":
        if self.source.startswith(EMBEDDED_PREFIX):
            name = self.source[len(EMBEDDED_PREFIX) :]
            if name not in TINY_MODELS:
                raise ValueError(
                    f"source {self.source!r}: no embedded model {name!r}; "
                    f"choose one of {[EMBEDDED_PREFIX + n for n in sorted(TINY_MODELS)]}"
                )
        return self

    @model_validator(mode="after")
    def _check_graph_taps(self) -> "ModelConfig":
        for spec in self.graph_taps if isinstance(self.graph_taps, list) else ():
            if not _GRAPH_TAP.fullmatch(spec):
                raise ValueError(f"graph_taps entry {spec!r}: a tap is a decoder layer's residual stream "
                                 "('layers.3.resid') or the output of its mlp or attention ('layers.3.mlp.output')")
        return self

    @classmethod
    def load(cls, name_or_path: str | Path) -> "ModelConfig":
        """Load a bundled config by name (``"tiny-llama"``), any YAML file by path, or the config
        vLLM would take for a checkpoint: a local Hugging Face checkpoint folder, or a Hugging
        Face model id (``"meta-llama/Llama-3.2-1B"``; vLLM finds it in the Hugging Face cache or
        downloads it), with vLLM's defaults: dtype "auto" and the model's own context length. Overrides go to ``Model``:
        ``Model("/models/llama-8b", max_model_len=4096, tensor_parallel_size=2)``."""
        path = Path(name_or_path)
        if path.suffix in (".yaml", ".yml"):
            return cls.model_validate(_read_yaml(path))
        bundled = resources.files("interlace.configs") / "models" / f"{name_or_path}.yaml"
        if bundled.is_file():
            return cls.model_validate(_read_yaml(bundled))
        if path.is_dir() and (path / "config.json").is_file():
            return cls(name=path.resolve().name, source=str(path.resolve()), max_model_len=None)
        text = str(name_or_path)
        if text.count("/") == 1 and not path.exists() and all(text.split("/")):  # "org/name"
            return cls(name=text.split("/")[1], source=text, max_model_len=None)
        known = sorted(
            p.name.removesuffix(".yaml")
            for p in (resources.files("interlace.configs") / "models").iterdir()
            if p.name.endswith(".yaml") and ".example" not in p.name
        )
        raise ValueError(
            f"no model {name_or_path!r}: not a bundled config (one of {known}), a .yaml file, a checkpoint "
            "folder with a config.json, or a Hugging Face model id (org/name)"
        )

    @property
    def world_size(self) -> int:
        """Worker ranks of one engine (TP x PP)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def with_overrides(self, overrides: dict[str, Any]) -> tuple["ModelConfig", dict[str, Any]]:
        """This config with the keyword arguments that name its fields applied
        (``tensor_parallel_size=2``, ``dtype="float32"``), and the rest: vLLM's engine arguments."""
        rest = dict(overrides)
        fields = {k: rest.pop(k) for k in list(rest) if k in ModelConfig.model_fields}
        if not fields:
            return self, rest
        return ModelConfig.model_validate({**self.model_dump(), **fields}), rest

    def checkpoint_path(self) -> str:
        """The folder vLLM and transformers load; builds an embedded model on first use."""
        if self.source.startswith(EMBEDDED_PREFIX):
            return str(ensure_tiny_model(self.source[len(EMBEDDED_PREFIX) :]))
        return self.source


class ResourcesConfig(BaseModel):
    """What one engine rank (one TP x PP worker) takes from the Ray cluster. A replica's ranks share
    one node: its placement group is one bundle of every rank's resources
    (:mod:`interlace.cluster.placement`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_cpus: float = Field(1.0, ge=0, description="CPUs per rank (on CPU machines, the rank's compute).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per rank; 0 on CPU machines.")
    accelerator_type: str | None = Field(
        None, description="Ray accelerator type the ranks need (e.g. 'H100'); None: any."
    )
    custom: dict[str, float] = Field(
        default_factory=dict, description="Further Ray resources per rank, e.g. {'interlace_slot': 1}."
    )


class ClusterConfig(BaseModel):
    """A model served by ``replicas`` engines on a Ray cluster, with the driver's bounds.

        >>> cfg = ClusterConfig.load("tiny-llama-2")                       # bundled: two CPU replicas
        >>> cfg = ClusterConfig(model=ModelConfig.load("tiny-llama"), replicas=4, max_in_flight=8)
    """

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    model: ModelConfig = Field(description="The model every replica serves (a bundled name or the fields).")
    replicas: int = Field(1, ge=1, description="Engine replicas (each TP x PP ranks on one node, its own placement group).")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Ray resources per rank.")
    max_in_flight: int = Field(8, ge=1, description="Trace shards running at once on one replica (backpressure).")
    max_queued: int = Field(
        10_000, ge=1, description="Traces the driver holds (queued and running); submit() waits past it."
    )
    max_retries: int = Field(3, ge=0, description="Re-runs of a trace shard whose replica died, before it fails.")
    min_shard_invokes: int = Field(
        16, ge=1, description="A trace is split across replicas only into shards of at least this many invokes."
    )
    cpu_cores: list[list[int]] | None = Field(
        None, description="CPU engines: the cores each replica's ranks are bound to (replica i gets entry "
        "i mod len); None: every core the replica's process may use."
    )

    @model_validator(mode="before")
    @classmethod
    def _by_name(cls, data: Any) -> Any:
        """A cluster given by name or YAML path wherever one is expected (``cluster: tiny-llama-2``
        in a sweep or serve config); its model by name too."""
        if isinstance(data, (str, Path)):
            return cls.load(data).model_dump()  # fields, re-validated below: a before-validator returns input
        if isinstance(data, dict) and isinstance(data.get("model"), str):
            data = {**data, "model": ModelConfig.load(data["model"])}
        return data

    @classmethod
    def load(cls, name_or_path: "str | Path | ClusterConfig") -> "ClusterConfig":
        """A bundled cluster config by name (``"tiny-llama-2"``), a YAML file, or a config as is."""
        if isinstance(name_or_path, ClusterConfig):
            return name_or_path
        path = Path(name_or_path)
        if path.suffix in (".yaml", ".yml"):
            return cls.model_validate(_read_yaml(path))
        folder = resources.files("interlace.configs") / "clusters"
        bundled = folder / f"{name_or_path}.yaml"
        if not bundled.is_file():
            known = sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
            raise ValueError(f"no bundled cluster config {name_or_path!r}; choose one of {known} "
                             "or pass the path of a .yaml file")
        return cls.model_validate(_read_yaml(bundled))


    def with_overrides(self, overrides: dict[str, Any]) -> tuple["ClusterConfig", dict[str, Any]]:
        """This config with the keyword arguments that name its fields or its model's applied
        (``replicas=2``, ``pipeline_parallel_size=2``), and the rest: vLLM's engine arguments.
        ``Cluster`` reads keywords this way and ``Model`` the same way for a model alone, so a
        keyword means one thing everywhere (placement, executor and ranks follow the sizes)."""
        model, rest = self.model.with_overrides(overrides)
        fields = {k: rest.pop(k) for k in list(rest) if k in ClusterConfig.model_fields and k != "model"}
        if not fields and model is self.model:
            return self, rest
        return ClusterConfig.model_validate({**self.model_dump(), **fields, "model": model.model_dump()}), rest

# --- serving: a Ray Serve application over the engine replicas (``interlace serve SERVE.yaml``) ----


class AutoscalingConfig(BaseModel):
    """Serve's autoscaling of the engine deployment (replaces ``cluster.replicas`` when given)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Engine replicas kept up when idle.")
    max_replicas: int = Field(1, ge=1, description="The most engine replicas Serve starts under load.")
    target_ongoing_requests: float = Field(
        4.0, gt=0, description="Trace shards in flight per replica that Serve aims for when it scales.")
    # Serve's own timing knobs, passed through with Serve's defaults.
    upscale_delay_s: float = Field(
        30.0, ge=0, description="How long the load must call for more replicas before Serve adds them.")
    downscale_delay_s: float = Field(
        600.0, ge=0, description="How long the load must call for fewer replicas before Serve removes them "
        "(a removed replica finishes its shards in flight first, up to 30 s).")
    look_back_period_s: float = Field(
        30.0, gt=0, description="The window over which Serve averages the shards in flight to decide.")

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingConfig":
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"autoscaling: max_replicas {self.max_replicas} < min_replicas {self.min_replicas}")
        return self


class AuthConfig(BaseModel):
    """Where the API tokens are: never in this config. A tokens document (YAML or JSON) lists
    ``tokens: [{name, token | sha256, role: ops | code, max_in_flight}]``; it is read from the file
    ``tokens_file`` names, else from the environment variable ``tokens_env`` names (a Kubernetes
    Secret mounted either way)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_file: str | None = Field(None, description="Path of the tokens document (a mounted Secret).")
    tokens_env: str = Field("INTERLACE_API_TOKENS", description="Environment variable holding the tokens "
                            "document, read when tokens_file is not set.")
    anonymous_role: str | None = Field(
        None, description="Role of requests without a token: None refuses them (401); 'ops' lets anyone run "
        "declarative traces (a local, single-user server).")

    @model_validator(mode="after")
    def _check(self) -> "AuthConfig":
        if self.anonymous_role not in (None, "ops", "code"):
            raise ValueError(f"auth.anonymous_role {self.anonymous_role!r}: choose null (default), ops or code")
        return self


class LimitsConfig(BaseModel):
    """What one request may ask of the endpoint; each limit is answered with its own 4xx."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(64 * 2**20, gt=0, description="Largest request body (413 past it).")
    max_invokes: int = Field(1024, gt=0, description="Invokes per trace (422 past it).")
    max_tokens: int = Field(1_000_000, gt=0, description="Prompt plus generated tokens per trace, summed over its "
                            "invokes (422 past it).")
    max_trace_s: float = Field(600.0, gt=0, description="Time limit of one trace's programs and its whole run "
                               "(a trace asking for more gets 422; one running past it, 504).")
    max_save_bytes: int = Field(1 << 30, gt=0, description="Bytes one trace may save, all invokes together "
                                "(422 when asked for more; a trace saving more fails with 413).")
    max_in_flight_per_token: int = Field(16, gt=0, description="Traces one token may have running at once "
                                         "(429 past it); a token's own max_in_flight wins.")
    max_results_kept: int = Field(1024, gt=0, description="Finished results of asynchronous traces kept for "
                                  "GET /v1/traces/{id}; the oldest are dropped first.")
    results_ttl_s: float = Field(3600.0, gt=0, description="How long a finished asynchronous result is kept.")


class ServeConfig(BaseModel):
    """A Ray Serve application: an HTTP ingress (auth, limits, streaming, metrics) over engine
    replicas. The same schema is read by ``interlace serve SERVE.yaml``, by ``serve run`` /
    ``serve deploy`` (as the application's ``args``) and by the Helm chart's values.

        >>> cfg = ServeConfig.load("configs/serve/tiny-llama.yaml")
        >>> cfg.cluster.model.name, cfg.port
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: ClusterConfig = Field(description="The engine replicas: a bundled cluster name, a cluster YAML "
                                   "path, or the fields inline (model, replicas, resources, max_in_flight...).")
    autoscaling: AutoscalingConfig | None = Field(None, description="Scale the engine replicas with load; "
                                                  "None: cluster.replicas, fixed.")
    host: str = Field("127.0.0.1", description="Address Serve's HTTP proxy listens on ('0.0.0.0' in a pod).")
    port: int = Field(8000, ge=1, le=65535, description="Serve's HTTP port.")
    route_prefix: str = Field("/", description="Where the API is mounted on Serve's proxy.")
    ingress_replicas: int = Field(4, ge=1, description="Replicas of the HTTP ingress deployment. At 64 clients on "
                                  "an H100 the ingress processes' CPU bounds the endpoint: one gave 0.82x of the cluster "
                                  "handle, two 0.97x blocking but 0.84-0.86x streaming, four 0.91-0.95x streaming "
                                  "(docs/benchmarks.md).")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API tokens and roles.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Per-request limits.")

    @classmethod
    def load(cls, source: "str | Path | dict | ServeConfig") -> "ServeConfig":
        """A serve YAML by path, a bundled one by name (``"tiny-llama"``), a dict (Serve's ``args``),
        or a config as is."""
        if isinstance(source, ServeConfig):
            return source
        if isinstance(source, dict):
            return cls.model_validate(source)
        path = Path(source)
        if path.suffix not in (".yaml", ".yml"):
            path = Path(str(resources.files("interlace.configs") / "serve" / f"{source}.yaml"))
            if not path.is_file():
                raise ValueError(f"no bundled serve config {source!r}; pass the path of a .yaml file")
        raw = _read_yaml(path)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a serve config is a YAML mapping (cluster, auth, limits...)")
        if isinstance(raw.get("cluster"), str) and raw["cluster"].endswith((".yaml", ".yml")) \
                and not Path(raw["cluster"]).is_absolute():
            raw = {**raw, "cluster": str(path.resolve().parent / raw["cluster"])}
        return cls.model_validate(raw)


# --- sweeps: one intervention over a dataset of prompts (``interlace sweep SWEEP.yaml``) ---------


def _is_url(path: str) -> bool:
    return "://" in path


class TensorFile(BaseModel):
    """A tensor stored by name in a ``.safetensors`` file (a steering vector, a patch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(description="The .safetensors file (relative paths: from the sweep YAML's folder).")
    name: str = Field(description="The tensor's name in that file.")

    def load(self):
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(self.file, framework="pt") as f:
                if self.name not in f.keys():
                    raise ValueError(f"{self.file} has no tensor {self.name!r}; it has {sorted(f.keys())}")
                return f.get_tensor(self.name)
        except SafetensorError as exc:  # e.g. a torch.save file: "header too large", naming no file
            raise ValueError(f"{self.file} is not a .safetensors file ({exc}); write it with "
                             "safetensors.torch.save_file({name: tensor}, path)") from None


class InlineTensor(BaseModel):
    """A tensor inside a JSON or YAML document: a ``.safetensors`` file, base64-encoded."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    safetensors: str = Field(description="Base64 of a .safetensors file (standard alphabet, padded).")
    name: str | None = Field(None, description="The tensor's name in it; None: the file's only tensor.")

    def load(self):
        import base64
        import binascii

        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            tensors = load(base64.b64decode(self.safetensors, validate=True))
        except (binascii.Error, ValueError, SafetensorError) as exc:
            raise ValueError(f"a tensor value is not base64 of a .safetensors file: {exc}") from None
        if self.name is None and len(tensors) != 1:
            raise ValueError(f"the .safetensors value holds {sorted(tensors)}; give the tensor's name")
        if self.name is not None and self.name not in tensors:
            raise ValueError(f"the .safetensors value has no tensor {self.name!r}; it has {sorted(tensors)}")
        return tensors[self.name] if self.name is not None else next(iter(tensors.values()))

    @classmethod
    def of(cls, tensor) -> "InlineTensor":
        import base64

        from safetensors.torch import save

        return cls(safetensors=base64.b64encode(save({"value": tensor.detach().cpu().contiguous()})).decode())


Positions = list[Annotated[int, Field(ge=0, lt=2**31)]]


class OpSpec(BaseModel):
    """One declarative op as data, the same in Python, YAML (sweeps) and JSON (the HTTP API):
    ``{op: save, point: layers.2.resid, tokens: last}``; ``build()`` makes the ``interlace.ops`` op."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    op: str = Field(description="save, add, scale, replace or zero.")
    point: str = Field(max_length=256, description="Where: 'layers.2.resid', 'layers.1.mlp.output', 'logits'...")
    name: str | None = Field(None, min_length=1, max_length=256, description="save only: the save's name (default: the point).")
    tokens: Literal["all", "last"] | Positions = Field("all", description="'all', 'last' or a list of positions.")
    steps: Positions | None = Field(None, description="Steps the op acts at (0 is the prompt); None: every step.")
    value: float | list[float] | list[list[float]] | TensorFile | InlineTensor | None = Field(
        None, description="add/replace: a vector or rows (lists, {file, name} in a .safetensors file, or "
        "{safetensors: base64}); scale: a factor.")

    @model_validator(mode="after")
    def _check(self) -> "OpSpec":
        needs = {"save": False, "zero": False, "add": True, "replace": True, "scale": True}
        if self.op not in needs:
            raise ValueError(f"op {self.op!r}: choose one of {sorted(needs)}")
        if needs[self.op] != (self.value is not None):
            raise ValueError(f"op {self.op} at {self.point}: " + ("give it a value" if needs[self.op] else "takes no value"))
        if self.name is not None and self.op != "save":
            raise ValueError(f"op {self.op} at {self.point}: only save takes a name")
        if self.op == "scale" and not isinstance(self.value, (int, float)):
            raise ValueError(f"op scale at {self.point}: its value is one number (the factor)")
        if self.op in ("add", "replace") and isinstance(self.value, (int, float)):
            raise ValueError(f"op {self.op} at {self.point}: its value is a vector, not one number")
        return self

    def build(self) -> dict:
        """The op as ``interlace.ops`` makes it."""
        import torch

        # lazy: torch, needed to build an op's tensor, not to read a config
        from interlace.core import ops

        value = self.value.load() if isinstance(self.value, (TensorFile, InlineTensor)) else self.value
        where = dict(tokens=self.tokens, steps=self.steps)
        if self.op == "save":
            return ops.save(self.point, name=self.name, **where)
        if self.op == "zero":
            return ops.zero(self.point, **where)
        if self.op == "scale":
            return ops.scale(self.point, float(value), **where)
        return getattr(ops, self.op)(self.point, torch.as_tensor(value, dtype=torch.float32)
                                     if not isinstance(value, torch.Tensor) else value, **where)

    @classmethod
    def of(cls, op: dict) -> "OpSpec":
        """An ``interlace.ops`` op as data (tensor values inline): what a remote client sends."""
        import torch

        value = op.get("value")
        if isinstance(value, torch.Tensor):
            value = InlineTensor.of(value)
        name = op.get("name") if op["op"] == "save" else None
        return cls(op=op["op"], point=op["point"], name=name, tokens=op["tokens"], steps=op["steps"], value=value)


class SweepIntervention(BaseModel):
    """What runs on every prompt: declarative ops, a program by import path, or both (or neither:
    plain generation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ops: list[OpSpec] = Field(default_factory=list, description="Declarative ops, applied in order.")
    program: str | None = Field(
        None, description="A program by import path, 'module:function' (importable from the sweep YAML's "
        "folder or the current one).")
    batched: bool = Field(False, description="Run the program as @interlace.batched (it may be marked already).")
    steps: list[int] | None = Field(None, description="Program steps to run; None: every step.")

    @model_validator(mode="after")
    def _check(self) -> "SweepIntervention":
        if self.program is not None and (":" not in self.program or not all(self.program.split(":", 1))):
            raise ValueError(f"program {self.program!r}: write it as 'module:function', e.g. 'my_probes:keep_resid'")
        if self.program is None:
            check_programless(self.steps, self.batched)
        return self


class SweepInput(BaseModel):
    """The prompts: JSONL, Parquet or CSV files, or Hugging Face datasets saved to disk; one prompt a row."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    paths: list[str] = Field(description="Files or folders (relative: from the sweep YAML's folder), or URLs "
                             "pyarrow/fsspec reads (s3://...). Rows are read in this order.")
    format: str = Field("auto", description="json (JSONL), parquet, csv, hf (a folder written by datasets' "
                        "Dataset.save_to_disk), or auto: from the first path (its suffix, or hf for a folder "
                        "holding state.json and dataset_info.json).")
    column: str = Field("prompt", description="The column holding each prompt: text, or a list of token ids.")
    limit: int | None = Field(None, gt=0, description="Use only the first this many rows (after the shuffle).")
    shuffle_seed: int | None = Field(None, description="Shuffle the rows with this seed before the limit; "
                                     "None: file order.")

    @model_validator(mode="after")
    def _check(self) -> "SweepInput":
        if not self.paths:
            raise ValueError("input.paths is empty; list the JSONL/Parquet/CSV files of prompts")
        if self.format not in ("auto", "json", "parquet", "csv", "hf"):
            raise ValueError(f"input.format {self.format!r}: choose auto, json, parquet, csv or hf")
        return self

    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        if is_hf_dataset_folder(self.paths[0]):
            return "hf"
        name = self.paths[0].rstrip("/").lower()
        for suffixes, fmt in (((".jsonl", ".json", ".jsonl.gz", ".json.gz"), "json"),
                              ((".parquet", ".pq"), "parquet"), ((".csv", ".csv.gz"), "csv")):
            if name.endswith(suffixes):
                return fmt
        raise ValueError(f"input.format auto: cannot tell the format of {self.paths[0]!r}; set format: "
                         "json, parquet, csv or hf")


def is_hf_dataset_folder(path: str) -> bool:
    """A local folder as ``datasets.Dataset.save_to_disk`` writes it (state.json, dataset_info.json)."""
    p = Path(path)
    return not _is_url(path) and (p / "state.json").is_file() and (p / "dataset_info.json").is_file()


class GenerationConfig(BaseModel):
    """Sampling settings for every prompt (as ``model.trace(...)`` takes them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(1, ge=1, description="Tokens generated per prompt (1: the prompt's forward and one token).")
    temperature: float = Field(0.0, ge=0, description="0: greedy.")
    seed: int | None = Field(None, description="Per-prompt sampling seed (reproducible sampling at temperature > 0).")
    ignore_eos: bool = Field(False, description="Generate max_tokens even past an end-of-sequence token.")
    timeout_s: float | None = Field(None, gt=0, description="Time limit of one shard's programs; default INTERLACE_TRACE_TIMEOUT.")
    max_save_bytes: int = Field(1 << 30, gt=0, description="The most one prompt may save.")
    sampling: dict[str, Any] = Field(default_factory=dict, description="Further vllm.SamplingParams fields (top_p...).")

    @model_validator(mode="after")
    def _sampling_adds_fields(self) -> "GenerationConfig":
        # ``sampling: {seed: 1}`` beside the named fields failed the sweep's start with "dict() got
        # multiple values for keyword argument 'seed'" and a traceback
        named = sorted(set(self.sampling) & {"max_tokens", "temperature", "seed", "ignore_eos", "logprobs"})
        if named:
            raise ValueError(f"generation.sampling sets {named}, which are generation's own fields; set "
                             + ", ".join(f"generation.{name}" for name in named) + " instead")
        return self

    def settings(self) -> dict[str, Any]:
        """SamplingParams fields, as ``Model.trace`` builds them."""
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, seed=self.seed, logprobs=None,
                    ignore_eos=self.ignore_eos, **self.sampling)


class SweepConfig(BaseModel):
    """One intervention over a dataset of prompts, written to a folder of shards.

        >>> cfg = SweepConfig.load("configs/sweeps/example.yaml")   # relative paths: from the YAML's folder
        >>> cfg.shard_size, cfg.cluster.replicas
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster: ClusterConfig = Field(description="The engine replicas: a bundled cluster name ('tiny-llama-2'), a "
                                   "cluster YAML path, or the fields inline (model, replicas, resources...).")
    input: SweepInput = Field(description="Where the prompts come from.")
    intervention: SweepIntervention = Field(default_factory=SweepIntervention, description="What runs on every prompt.")
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="Sampling settings.")
    output: str = Field(description="The sweep's folder (relative: from the YAML's folder); a rerun resumes it.")
    shard_size: int = Field(256, ge=1, description="Prompts per shard: shard k holds prompt ids [k*size, (k+1)*size).")
    shards_in_flight: int = Field(4, ge=1, description="Shards one replica runs at once: the engine runs the "
                                  "next ones while finished ones' files are written (see docs/benchmarks.md: 4 "
                                  "kept an H100 as busy as plain vLLM).")
    max_failures: int | None = Field(None, ge=0, description="Stop once more prompts than this have failed; None: never.")
    _base_dir: str | None = PrivateAttr(None)  # the YAML's folder: where the program's module is looked for first

    @classmethod
    def load(cls, path: str | Path) -> "SweepConfig":
        """A sweep YAML; its relative paths are read from the YAML's folder."""
        path = Path(path)
        raw = _read_yaml(path)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a sweep config is a YAML mapping (cluster, input, intervention, output...)")
        cfg = cls.model_validate(_resolve_paths(raw, path.resolve().parent))
        cfg._base_dir = str(path.resolve().parent)
        return cfg

    @property
    def base_dir(self) -> str | None:
        """The folder of the YAML this config was loaded from (None: made in Python)."""
        return self._base_dir

    def identity(self) -> dict[str, Any]:
        """What fixes a sweep's output: a rerun into the same folder must match it (the replica count,
        shards in flight and max_failures may change)."""
        return self.model_dump(mode="json", include={"input", "intervention", "generation", "shard_size"}) | {
            "model": self.cluster.model.model_dump(mode="json")}


def _resolve_paths(raw: dict, base: Path) -> dict:
    def here(p: str) -> str:
        return p if _is_url(p) or Path(p).is_absolute() else str(base / p)

    raw = dict(raw)
    if isinstance(raw.get("cluster"), str) and raw["cluster"].endswith((".yaml", ".yml")):
        raw["cluster"] = here(raw["cluster"])
    if isinstance(raw.get("output"), str):
        raw["output"] = here(raw["output"])
    if isinstance(raw.get("input"), dict) and isinstance(raw["input"].get("paths"), list):
        raw["input"] = {**raw["input"], "paths": [here(p) if isinstance(p, str) else p for p in raw["input"]["paths"]]}
    intervention = raw.get("intervention")
    if isinstance(intervention, dict):
        ops = [{**op, "value": {**op["value"], "file": here(op["value"]["file"])}}
               if isinstance(op, dict) and isinstance(op.get("value"), dict) and isinstance(op["value"].get("file"), str)
               else op for op in intervention.get("ops") or []]
        raw["intervention"] = {**intervention, "ops": ops}
    return raw
