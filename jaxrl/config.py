"""One typed config tree per run (DESIGN contract 7): TOML file + dotted CLI overrides.

``load_config(argv)`` reads ``--config FILE`` (optional: every field has a default), applies
``--section.field value`` overrides (parsed by pydantic-settings' CLI source, so types and
unknown names are checked by the same models), and validates everything before any work
starts: a bad field fails with a message naming it.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict

from jaxrl.inference.config import InferenceConfig
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.parallel.distributed import DistributedConfig
from jaxrl.trainer.checkpoint import CkptConfig
from jaxrl.trainer.config import TrainerConfig


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
    def _source(self) -> "ModelConfig":
        if self.scratch is not None and self.name is not None:
            raise ValueError("model: set either `name` (load a HF directory) or `[model.scratch]`, not both")
        if self.revision is not None and self.name is None:
            raise ValueError("model.revision: set only with `name` (a hub id)")
        from jaxrl.models.chat import validate_renderer

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

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.path is not None and (self.taskset is not None or self.taskset_args):
            raise ValueError("data: set either `path` (your conversations) or `taskset`, not both")
        if self.path is None and (self.revision is not None or self.skip_bad_rows):
            raise ValueError("data.revision / data.skip_bad_rows apply to `path`; set data.path")
        return self


class LogConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    progress: bool = True
    """Rich progress bar on the terminal."""
    plot: bool = True
    """Write <output_dir>/metrics.png at the end."""
    wandb_project: str | None = None
    """Also log to Weights & Biases under this project (off by default; needs `wandb`)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <output_dir>/tb (needs `tensorboardX`)."""


class WarmstartConfig(BaseModel):
    """Run another recipe first (e.g. SFT) when `[model] name` has no weights yet."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    config: str
    """The recipe TOML to run first; its export must land at this run's `[model] name`."""


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

    @model_validator(mode="after")
    def _mode(self) -> "RunConfig":
        if self.model.name is None and self.model.scratch is None:
            raise ValueError("model: set `name` (a HF model directory) or `[model.scratch]`")
        if self.data is not None and self.orchestrator is not None:
            raise ValueError("set only one of `[data]` (SFT) and `[orchestrator]` (RL)")
        if self.orchestrator is not None and self.trainer.seq_len < self.inference.max_model_len:
            raise ValueError(
                f"trainer.seq_len = {self.trainer.seq_len} < inference.max_model_len = "
                f"{self.inference.max_model_len}: a full rollout would not fit one packed row"
            )
        return self

    @property
    def mode(self) -> Literal["sft", "rl"]:
        """RL when `[orchestrator]` is set, else SFT (with `[data]` or its defaults)."""
        return "rl" if self.orchestrator is not None else "sft"


class _Cli(BaseSettings):
    """Carrier for pydantic-settings' CLI parser (dotted overrides of RunConfig fields)."""

    model_config = SettingsConfigDict(extra="forbid", cli_prog_name="jaxrl")


def _cli_model() -> type[BaseSettings]:
    fields = {name: (f.annotation, f) for name, f in RunConfig.model_fields.items()}
    from pydantic import create_model

    return create_model("RunCli", __base__=_Cli, **fields)  # type: ignore[call-overload]


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--config {p}: no such file")
    with p.open("rb") as f:
        return tomllib.load(f)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config", default=None)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--resume", action="store_true")
    return parser.parse_known_args(argv)


def build_config(toml: dict[str, Any], overrides: list[str]) -> RunConfig:
    """TOML dict + CLI override strings -> validated RunConfig (raises ValueError with the field)."""
    cli = CliSettingsSource(_cli_model(), cli_parse_args=overrides, cli_exit_on_error=False)()
    try:
        return RunConfig.model_validate(deep_merge(toml, cli))
    except ValidationError as e:
        raise ValueError(f"invalid config:\n{e}") from None


def load_config(argv: list[str] | None = None) -> tuple[RunConfig, argparse.Namespace]:
    """Parse an entry point's argv: (validated config, flags --config/--dry-run/--resume)."""
    flags, rest = parse_args(argv)
    toml = read_toml(flags.config) if flags.config else {}
    return build_config(toml, rest), flags
