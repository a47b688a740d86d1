"""One typed config tree per run (DESIGN contract 7): TOML file + dotted CLI overrides.

``load_config(argv)`` reads ``--config FILE`` (optional: every field has a default), applies
``--section.field value`` overrides (parsed by pydantic-settings' CLI source, so types and
unknown names are checked by the same models), and validates everything before any work
starts: a bad field fails with a message naming it.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict, SettingsError

from jaxrl import renamed
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.parallel.distributed import DistributedConfig
from jaxrl.rollout.config import BACKEND_SECTIONS, InferenceConfig, backend_flags, backend_table
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
    """Multi-process RL samples from external servers only (the embedded engine and a launched
    vLLM server live in one process); called at config time and again once the process count is
    known (a TPU slice discovers it at start-up)."""
    if backend != "external":
        raise ValueError(
            f'inference.backend = "{backend}" with several processes: multi-host RL samples rollouts from '
            'servers outside the trainer; set inference.backend = "external" and inference.base_url to '
            "`python -m jaxrl.serve` servers (README: Multi-host RL)"
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


class _Cli(BaseSettings):
    """Carrier for pydantic-settings' CLI parser (dotted overrides of RunConfig fields)."""

    model_config = SettingsConfigDict(extra="forbid", cli_prog_name="jaxrl")


def _cli_model(fields: Sequence[str] | None = None, hidden: Mapping[str, str] | None = None) -> type[BaseSettings]:
    """The CLI's model: RunConfig's fields, or only the ``fields`` sections an entry point reads,
    without the ``hidden`` ``section.field`` paths it refuses (so ``--help`` does not offer them)."""
    from pydantic import Field as _Field
    from pydantic import create_model

    chosen = {n: (f.annotation, f) for n, f in RunConfig.model_fields.items() if fields is None or n in fields}
    for path in hidden or {}:
        section, name = path.split(".", 1)
        info = RunConfig.model_fields[section]
        model: Any = info.annotation
        kept = {n: (f.annotation, f) for n, f in model.model_fields.items() if n != name}
        reduced = create_model(model.__name__, __config__=model.model_config, **kept)
        chosen[section] = (reduced, _Field(default_factory=reduced, description=info.description))
    return create_model("RunCli", __base__=_Cli, **chosen)  # type: ignore[call-overload]


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"--config {p}: no such file")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {p}: invalid TOML: {e}") from None


def parse_args(
    argv: list[str] | None,
    prog: str = "python -m jaxrl.train",
    fields: Sequence[str] | None = None,
    hidden: Mapping[str, str] | None = None,
) -> tuple[argparse.Namespace, list[str]]:
    """The entry points' own flags; everything else is a dotted override. ``--help`` lists both
    (every field of ``fields`` sections, default all, with its type, default and docstring) and
    exits 0. ``@ FILE`` (prime-rl's form) is ``--config FILE``."""
    parser = argparse.ArgumentParser(
        prog=prog,
        add_help=False,
        allow_abbrev=False,  # "--conf" must not swallow anything: unknown flags are overrides
        description="Run with a TOML config (every field has a default) and dotted overrides of its fields.",
        epilog="overrides: --section.field VALUE, every field listed below",
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help (and every field) and exit")
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="FILE",
        help="TOML file (or `@ FILE`); repeat to merge several, later files winning field by field",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate, print the resolved config as TOML, exit")
    parser.set_defaults(resume=False, overwrite=False)
    if fields is None or "output_dir" in fields:  # flags of an entry point that writes a run
        parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
        parser.add_argument(
            "--overwrite", action="store_true", help="delete what output_dir holds (an earlier run) and start over"
        )
    args = prime_rl_flags(_at_files(list(sys.argv[1:] if argv is None else argv)))
    flags, rest = parser.parse_known_args(args)
    if flags.help:
        print(parser.format_help())
        CliSettingsSource(_cli_model(fields, hidden), cli_prog_name=prog, cli_parse_args=["--help"])()  # exits 0
    return flags, rest


def _at_files(argv: list[str]) -> list[str]:
    """prime-rl's ``@ cfg.toml`` / ``@cfg.toml`` as ``--config cfg.toml``."""
    out: list[str] = []
    args = iter(argv)
    for a in args:
        if a == "@":
            out += ["--config", next(args, "")]
        elif a.startswith("@") and len(a) > 1:
            out += ["--config", a[1:]]
        else:
            out.append(a)
    return out


_OWN_FLAGS = {"dry_run": "dry-run"}  # the entry points' own flags keep their argparse spelling
_ALIASES = {"ckpt.resume": "resume"}  # prime-rl's spelling of an entry-point flag


def prime_rl_flags(argv: list[str]) -> list[str]:
    """prime-rl's flag habits in jaxrl's spelling: kebab-case keys (``--inference.max-model-len``
    is ``--inference.max_model_len``), a bare boolean field (``--log.tensorboard`` alone means
    true, as pydantic-settings' implicit flags do in prime-rl) and ``--ckpt.resume`` (``--resume``).
    Only flag names are rewritten, never values."""
    bools = bool_paths()
    out: list[str] = []
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or arg == "--":
            out.append(arg)
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        key = _ALIASES.get(key, _OWN_FLAGS.get(key, key))
        out.append(f"--{key}{eq}{value}")
        bare = not eq and (i + 1 == len(argv) or argv[i + 1].startswith("--"))
        if bare and key in bools:
            out.append("true")
    return out


def bool_paths(model: type[BaseModel] | None = None, prefix: str = "") -> set[str]:
    """Dotted paths of every boolean field (the flags that may stand alone)."""
    out: set[str] = set()
    for name, info in (model or RunConfig).model_fields.items():
        if info.annotation is bool or (get_origin(info.annotation) is not None and set(get_args(info.annotation)) == {bool, type(None)}):
            out.add(prefix + name)
        for sub in _submodels(info.annotation):
            out |= bool_paths(sub, f"{prefix}{name}.")
    return out


def field_paths(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every dotted path an override can name: sections and their fields (not into lists)."""
    out: list[str] = []
    for name, info in (model or RunConfig).model_fields.items():
        out.append(prefix + name)
        for sub in _submodels(info.annotation):
            out += field_paths(sub, f"{prefix}{name}.")
    return out


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (list, dict, tuple):
        return []
    return [m for a in get_args(annotation) for m in _submodels(a)]


def _unknown_flag(flag: str) -> str:
    """What an override the config does not have should be: its prime-rl rename, or the nearest field."""
    key = flag.lstrip("-").split("=", 1)[0]
    nested: dict[str, Any] = {}
    node = nested
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = 1
    if found := renamed.find_renamed(nested):
        return f"--{key}: prime-rl key: " + "; ".join(found)
    close = difflib.get_close_matches(key, field_paths(), n=1, cutoff=0.75)
    hint = f"did you mean --{close[0]}?" if close else "--help lists every field"
    return f"unknown flag --{key}: {hint}"


_NO_INPUT = ("value_error", "assertion_error", "missing")  # their message says it all (or there is no input)


def one_line(e: ValidationError) -> str:
    """A pydantic error as one line per problem, each naming its field, joined by '; '."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ").replace("\n", " ")
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, field_paths(), n=1, cutoff=0.75)
            msg = "unknown field" + (f"; did you mean {close[0]}?" if close else "")
        elif err["type"] not in _NO_INPUT and not isinstance(err.get("input"), (dict, list)):
            msg += f" (got {err.get('input')!r})"
        parts.append(f"{loc}: {msg}" if loc and not msg.startswith(loc.rsplit(".", 1)[-1]) else msg)
    return "; ".join(parts)


def _backend_as_table(config: dict[str, Any]) -> dict[str, Any]:
    inference = config.get("inference")
    return config | {"inference": backend_table(inference)} if isinstance(inference, dict) else config


def _cli_backend_wins(toml: dict[str, Any], cli: dict[str, Any]) -> dict[str, Any]:
    """A backend chosen on the command line replaces the file's: the file's settings for another
    backend are dropped, not refused. A recipe names how its trainer reaches rollout servers;
    ``jaxrl.serve --config rl.toml --inference.backend embedded`` (GKE's rendered rollout pods)
    serves that recipe's model as one of those servers."""
    chosen = ((cli.get("inference") or {}).get("backend") or {}).get("type")
    inference = toml.get("inference")
    if chosen is None or not isinstance(inference, dict):
        return toml
    backend = inference.get("backend") or {}
    if (backend.get("type") if isinstance(backend, dict) else None) == chosen:
        return toml
    kept = {k: v for k, v in inference.items() if k != "backend" and (k not in BACKEND_SECTIONS or k == chosen)}
    return toml | {"inference": kept}


def build_config(
    toml: dict[str, Any],
    overrides: list[str],
    fields: Sequence[str] | None = None,
    hidden: Mapping[str, str] | None = None,
) -> RunConfig:
    """TOML dict + CLI override strings -> validated RunConfig (raises ValueError with the field).
    ``hidden``: ``section.field`` paths the entry point refuses, each with the reason."""
    overrides = backend_flags(overrides)
    for arg in overrides:
        key = arg.lstrip("-").split("=", 1)[0]
        for path, reason in (hidden or {}).items():
            if arg.startswith("--") and (key == path or key.startswith(path + ".")):
                raise ValueError(f"--{key}: {reason}")
    try:
        cli = CliSettingsSource(_cli_model(fields, hidden), cli_parse_args=overrides, cli_exit_on_error=False)()
    except SettingsError as e:
        unknown = re.search(r"unrecognized arguments: (.*)", str(e))
        flags = [t for t in unknown.group(1).split() if t.startswith("--")] if unknown else []
        if not flags:
            raise ValueError(str(e).replace("\n", " ")) from None
        raise ValueError("; ".join(_unknown_flag(f) for f in flags)) from None
    toml, cli = _backend_as_table(toml), _backend_as_table(cli)
    toml = _cli_backend_wins(toml, cli)
    try:
        return RunConfig.model_validate(deep_merge(toml, cli))
    except ValidationError as e:
        raise ValueError(f"invalid config: {one_line(e)}") from None


def load_config(
    argv: list[str] | None = None,
    prog: str = "python -m jaxrl.train",
    fields: Sequence[str] | None = None,
    defaults: dict[str, Any] | None = None,
    hidden: Mapping[str, str] | None = None,
) -> tuple[RunConfig, argparse.Namespace]:
    """Parse an entry point's argv: (validated config, flags --config/--dry-run/--resume/--overwrite).
    Several ``--config`` files merge left to right over the entry point's own ``defaults``;
    overrides apply last. ``fields``: the top-level sections the entry point reads (``--help`` and
    overrides are limited to them); ``hidden``: ``section.field`` paths of them it refuses, with
    the reason (left out of ``--help``; an override of one fails with the reason)."""
    flags, rest = parse_args(argv, prog, fields, hidden)
    toml: dict[str, Any] = dict(defaults or {})
    for path in flags.config:
        toml = deep_merge(toml, resolve_recipe_paths(read_toml(path), Path(path).parent))
    return build_config(toml, rest, fields, hidden), flags


def resolve_recipe_paths(data: dict[str, Any], recipe_dir: Path) -> dict[str, Any]:
    """A recipe's relative ``[warmstart] config`` names a file beside the recipe, so a recipe
    runs from any working directory (outputs, like ``output_dir``, stay relative to it)."""
    warm = data.get("warmstart")
    if isinstance(warm, dict) and isinstance(warm.get("config"), str) and not Path(warm["config"]).is_absolute():
        data = {**data, "warmstart": {**warm, "config": str((recipe_dir / warm["config"]).resolve())}}
    return data


def to_toml(cfg: BaseModel, include: set[str] | None = None) -> str:
    """The resolved config as TOML that ``--config`` reads back to the same config (unset
    optional values, None, are left out: their default is None)."""
    import tomli_w

    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True, include=include))
