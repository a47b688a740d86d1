"""One typed config tree per run (DESIGN contract 7): the root schema and its cross-section checks.

``RunConfig`` holds every section (each section's model lives beside the code that reads it:
``[trainer]`` in ``jaxrl.trainer.config``, ``[inference]`` in ``jaxrl.rollout.config``, ...) and
checks what sections decide together, all when it is validated: a config that validates is one
the run can start with (what only the machine shows, a free port or a loadable env, is checked
by the entry points before any work). The command line (``--config`` files, dotted overrides,
prime-rl's spellings) becomes a ``RunConfig`` in ``jaxrl.cli``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxrl import renamed
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.parallel.distributed import DistributedConfig
from jaxrl.rollout.config import InferenceConfig
from jaxrl.trainer.checkpoint import CkptConfig
from jaxrl.trainer.config import TrainerConfig


class ConfigError(ValueError):
    """A run the config (or what it names: a model, an output_dir) cannot start: the entry points
    print its one line and exit 2, before any work."""


class ScratchModelConfig(BaseModel):
    """A new, randomly initialised Qwen3-shaped model (with jaxrl's byte-level tokenizer)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 1024
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    seed: int = 0
    """Initialisation seed."""
    num_experts: int = Field(0, ge=0, le=4096)
    """Mixture of experts (a Qwen3-MoE model): routed experts per layer in place of the MLP; 0 = dense."""
    num_experts_per_tok: int | None = Field(None, ge=1)
    """MoE: experts per token (k); default 2."""
    moe_intermediate_size: int | None = Field(None, ge=1)
    """MoE: each expert's MLP width; default: the width that makes the active MLP weights (k experts
    plus the router) equal to the dense `intermediate_size` MLP's, where one exists."""
    norm_topk_prob: bool | None = None
    """MoE: renormalise the k routing weights to sum to 1 (default true, as Qwen3-MoE)."""

    @model_validator(mode="after")
    def _experts(self) -> ScratchModelConfig:
        moe_fields = ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
        if self.num_experts == 0:
            set_ = [f for f in moe_fields if getattr(self, f) is not None]
            if set_:
                raise ValueError(f"{', '.join(set_)} set but num_experts = 0 (a dense model); set num_experts")
            return self
        k = self.num_experts_per_tok or 2
        if k > self.num_experts:
            raise ValueError(f"num_experts_per_tok = {k} must be <= num_experts = {self.num_experts}")
        if self.moe_intermediate_size is None:
            width, rest = divmod(3 * self.intermediate_size - self.num_experts, 3 * k)
            if rest or width < 1:
                raise ValueError(
                    f"no expert width gives the active parameters of intermediate_size = {self.intermediate_size} "
                    f"with {self.num_experts} experts, {k} per token; set moe_intermediate_size"
                )
            self.moe_intermediate_size = width
        self.num_experts_per_tok = k
        self.norm_topk_prob = True if self.norm_topk_prob is None else self.norm_topk_prob
        return self


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    name: str | None = None
    """A Hugging Face model directory (config.json + safetensors) or a hub id (`Qwen/Qwen3-0.6B`),
    fetched into the HF cache (`HF_HOME`, `HF_HUB_OFFLINE`, `HF_TOKEN` honoured)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub id `name`; default: the repo's main branch."""
    scratch: ScratchModelConfig | None = None
    """Build a new random model instead of loading `name` (for from-scratch recipes)."""
    tokenizer: str | None = None
    """Tokenizer directory; default: `name` (or a new jaxrl byte-level tokenizer for scratch)."""
    renderer: str = "auto"
    """Chat template family, a `renderers` renderer name (`qwen3`, `llama-3`, `gpt-oss`, `default`,
    ...) or `auto` (from the hub id, else config.json's model_type). Used alike by env servers,
    SFT rendering and the engine's chat endpoint."""
    renderer_args: dict[str, Any] = {}
    """Fields of that renderer's config, e.g. `{enable_thinking = true}` for qwen3."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Activation/compute dtype (float32 on CPU; bfloat16 on TPU/GPU)."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter (and optimizer master) dtype."""

    @model_validator(mode="after")
    def _source(self) -> ModelConfig:
        if self.scratch is not None and self.name is not None:
            raise ValueError("model: set either `name` (load a HF directory) or `[model.scratch]`, not both")
        if self.revision is not None and self.name is None:
            raise ValueError("model.revision: set only with `name` (a hub id)")
        from jaxrl.models.renderer import validate_renderer

        validate_renderer(self.renderer, self.renderer_args)
        return self


class DataConfig(BaseModel):
    """SFT data: the user's conversations (`path`) or a built-in taskset's reference answers,
    rendered with the run's renderer (`[model] renderer`) so SFT sees exactly the tokens RL
    rollouts will produce. The loss is on the assistant's tokens."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    path: str | None = None
    """Your conversations: a JSONL file of `{"messages": [...], "tools": [...]}` rows (OpenAI chat
    shape), a directory of *.jsonl / *.parquet files, or a Hugging Face dataset id."""
    revision: str | None = None
    """Hub revision of a dataset id `path`."""
    skip_bad_rows: bool = False
    """Skip (and count) rows that fail validation instead of stopping with their file and line."""
    content_roles: list[Literal["system", "user", "tool"]] = []
    """Also train on the content tokens (not the chat scaffold) of these roles' messages (echo-style)."""
    taskset: str | None = None
    """Built-in taskset whose reference conversations are the SFT examples (default: reverse_text
    when `path` is unset)."""
    taskset_args: dict[str, Any] = {}
    """Extra arguments for the taskset's config (e.g. min_words / max_words)."""
    num_examples: int | None = Field(None, ge=1)
    """Distinct training conversations: a taskset draws this many (default 4096); of `path`, the
    first this many (default: all)."""
    batch_size: int = Field(32, ge=1)
    """Conversations per optimizer step."""
    seed: int = 0
    eval_examples: int = Field(64, ge=1)
    """Held-out conversations (never trained on) scored for `eval/ce_loss`, at most: from the
    taskset's eval split, or with `path`, from `eval_path` / the `eval_fraction` held out."""
    eval_path: str | None = None
    """Held-out conversations for `path` runs, in `path`'s formats (a file, a directory or a dataset id)."""
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of `path`'s rows held out for eval (a seeded random subset, by `seed`), never trained on."""
    eval_interval: int = Field(50, ge=0)
    """Steps between two held-out evals (NLL per assistant token, logged as `eval/ce_loss`); the
    last step always evaluates. 0: no eval."""

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.path is not None and (self.taskset is not None or self.taskset_args):
            raise ValueError("data: set either `path` (your conversations) or `taskset`, not both")
        if self.path is None and (self.revision is not None or self.skip_bad_rows):
            raise ValueError("data.revision / data.skip_bad_rows apply to `path`; set data.path")
        if self.path is None and (self.eval_path is not None or self.eval_fraction):
            raise ValueError("data.eval_path / data.eval_fraction hold out conversations of `path`; a taskset has its own eval split")
        if self.eval_path is not None and self.eval_fraction:
            raise ValueError("data: set either `eval_path` or `eval_fraction`, not both")
        return self


class WandbConfig(BaseModel):
    """Weights & Biases run: metrics per step, sample tables of train and eval rollouts. The run id
    goes into every checkpoint, so `--resume` continues the same W&B run."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    project: str = Field(min_length=1)
    entity: str | None = None
    """Team or user (None: your default entity)."""
    name: str | None = None
    """Run name (None: W&B picks one)."""
    tags: list[str] = []
    mode: Literal["online", "offline", "disabled"] = "online"
    """`offline` writes under <output_dir>/wandb for a later `wandb sync`."""
    samples: int = Field(8, ge=0)
    """Rollouts per step logged to the `samples/train` and `samples/eval` tables (0: none)."""


class LogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    progress: bool = True
    """Rich progress bar when stdout is a terminal; elsewhere (a file, ``kubectl logs``) a plain
    line every `interval` steps instead."""
    rollout_episodes: bool = False
    """Also store each rollout's raw episode (every trace's token ids, log-probs, masks) in
    rollouts.jsonl. Off by default: ~8 KB per two-word rollout; the flat record (env, prompt,
    completion, reward, fate, seed, error, task) is enough to read a run."""
    interval: int = Field(1, ge=1)
    """Steps between two plain progress lines off a terminal (the last step always prints)."""
    plot: bool = True
    """Write <output_dir>/metrics.png at the end."""
    wandb: WandbConfig | None = None
    """`[log.wandb]`: also log to Weights & Biases (off by default; needs the `wandb` extra)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <output_dir>/tb (needs `tensorboardX`)."""

    @model_validator(mode="after")
    def _extras_installed(self) -> LogConfig:
        """An optional logger that is asked for must be importable now, not after the model is built."""
        for wanted, module, extra, field in (
            (self.wandb is not None, "wandb", "wandb", "[log.wandb]"),
            (self.tensorboard, "tensorboardX", "tensorboard", "log.tensorboard"),
        ):
            if wanted and importlib.util.find_spec(module) is None:
                raise ValueError(f'{field} is set but {module} is not installed: pip install -e ".[{extra}]"')
        return self


class WarmstartConfig(BaseModel):
    """Run another recipe first (e.g. SFT) when `[model] name` is that recipe's export and has
    no weights yet. It never runs for any other `[model] name` (a typo fails at config time)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    config: str
    """The recipe TOML to run first; its export (`<its output_dir>/hf`) must be this run's `[model] name`."""

    def export_dir(self) -> Path:
        """Where the recipe exports its model: ``<its output_dir>/hf``."""
        try:
            data = read_toml(self.config)
        except FileNotFoundError as e:
            raise ValueError(f"warmstart.config: {e}") from None
        return Path(data.get("output_dir", RunConfig.model_fields["output_dir"].default)) / "hf"


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    output_dir: str = "outputs/run"
    """Metrics, rollouts, checkpoints, exports and plots go here."""
    seed: int = 0
    model: ModelConfig = ModelConfig(scratch=ScratchModelConfig())
    trainer: TrainerConfig = TrainerConfig()
    data: DataConfig | None = None
    """SFT data (defaults apply when neither this nor `[orchestrator]` is set)."""
    inference: InferenceConfig = InferenceConfig()
    orchestrator: OrchestratorConfig | None = None
    """RL: environments, sampling, batch sizes. Unset means an SFT run."""
    warmstart: WarmstartConfig | None = None
    ckpt: CkptConfig = CkptConfig()
    log: LogConfig = LogConfig()
    distributed: DistributedConfig = DistributedConfig()

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if found := renamed.find_renamed(data):
            raise ValueError("prime-rl key(s): " + "; ".join(found))
        return data

    @model_validator(mode="after")
    def _mode(self) -> RunConfig:
        if self.model.name is None and self.model.scratch is None:
            raise ValueError("model: set `name` (a HF model directory) or `[model.scratch]`")
        name = self.model.name
        if name is not None and self.warmstart_export() is None and not Path(name).is_dir() and not _HUB_ID.match(name):
            made_by = ""
            if self.warmstart is not None:
                made_by = f" (nor the export of [warmstart] {self.warmstart.config}: {self.warmstart.export_dir()})"
            raise ValueError(
                f"model.name: {self.model.name} is not a directory nor a hub id (org/name){made_by}; point it at a "
                "Hugging Face model directory (config.json + safetensors) or a hub id"
            )
        context = model_context_len(self.model)
        if context is not None:
            self.inference = self.inference.with_model_len(context)
        elif self.inference.max_model_len is None and self.orchestrator is not None:
            raise ValueError(
                f"inference.max_model_len: unset, and model.name = {self.model.name!r} has no config.json to read "
                "the model's context length from (yet: a warm start creates it, or a hub id not in the local "
                "cache); set inference.max_model_len"
            )
        if self.data is not None and self.orchestrator is not None:
            raise ValueError("set only one of `[data]` (SFT) and `[orchestrator]` (RL)")
        if self.orchestrator is not None and self.distributed.expected_processes() > 1:
            check_multihost_rl(self.inference.backend.type)
        replay = self.orchestrator is not None and self.trainer.moe_routing == "replay"
        if replay and self.inference.backend.type == "vllm":
            raise ValueError(
                'trainer.moe_routing = "replay" needs routing from the rollout backend; the vllm backend does not '
                'return it: use inference.backend.type = "embedded" (or "external" jaxrl servers) or moe_routing = "recompute"'
            )
        if self.inference.max_model_len is None:
            return self  # an SFT run whose model is not there yet: nothing below applies
        if self.orchestrator is not None and self.trainer.seq_len < self.inference.max_model_len:
            raise ValueError(
                f"trainer.seq_len = {self.trainer.seq_len} < inference.max_model_len = "
                f"{self.inference.max_model_len}: a full rollout would not fit one packed row"
            )
        if self.orchestrator is not None:
            orch = self.orchestrator
            splits = [("train", orch.train)] + ([("eval", orch.eval)] if orch.eval else [])
            for split, cfg in splits:
                for where, sampling in [("", cfg.sampling)] + [
                    (f"env {e.name!r}: ", cfg.sampling_for(e)) for e in cfg.env
                ]:
                    if sampling.max_completion_tokens < self.inference.max_model_len:
                        continue
                    raise ValueError(
                        f"{where}orchestrator.{split}.sampling.max_completion_tokens = {sampling.max_completion_tokens} "
                        f"must be < inference.max_model_len = {self.inference.max_model_len} (the prompt needs "
                        "room too); lower it or raise max_model_len"
                    )
        return self

    def warmstart_export(self) -> Path | None:
        """The `[warmstart]` recipe's export when it is this run's `[model] name` (the only case
        in which the warm start may run), else None."""
        if self.warmstart is None or self.model.name is None:
            return None
        export = self.warmstart.export_dir()
        return export if Path(self.model.name).resolve() == export.resolve() else None

    @property
    def mode(self) -> Literal["sft", "rl"]:
        """RL when `[orchestrator]` is set, else SFT (with `[data]` or its defaults)."""
        return "rl" if self.orchestrator is not None else "sft"


def check_multihost_rl(backend: str) -> None:
    """Multi-process RL samples from the embedded engine colocated over every process
    (``jaxrl.rollout.colocated``) or from external servers; a launched vLLM server lives in one
    process. Called at load when the process count is known then
    (``DistributedConfig.expected_processes``), else by the run once ``jax.distributed`` has
    started (a TPU slice outside GKE learns its process count only then)."""
    if backend == "vllm":
        raise ValueError(
            'inference.backend = "vllm" with several processes: a launched vLLM server runs beside one process; '
            'use the embedded engine (colocated over every process) or inference.backend = "external" with '
            "servers on their own hosts (README: Multi-host RL)"
        )


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # "org/model": left to the model loader, not a local path


def model_context_len(model: ModelConfig) -> int | None:
    """The model's context length (``max_position_embeddings``), or None if its config is not there."""
    if model.scratch is not None:
        return model.scratch.max_position_embeddings
    config = Path(model.name or "") / "config.json"
    if not config.is_file() and model.name and _HUB_ID.match(model.name):  # a cached hub snapshot; no network
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model.name, "config.json", revision=model.revision)
        config = Path(cached) if isinstance(cached, str) else config
    if not config.is_file():
        return None
    try:
        hf = json.loads(config.read_text())
        return int(hf.get("max_position_embeddings", 4096))  # the default jaxrl.models.arch applies
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"model.name: {config} is not a valid model config: {e}") from None


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--config {p}: no such file")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {p}: invalid TOML: {e}") from None
