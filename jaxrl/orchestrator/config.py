"""``[orchestrator]``: environments, sampling, batch shape, off-policy lag, eval."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from jaxrl import renamed
from jaxrl.envs import check_env_id
from jaxrl.orchestrator.algo import AlgoConfig, GRPOConfig
from jaxrl.orchestrator.env_sampling import SamplingOverride

# The HTTP API's own range types: a run cannot configure what the server would refuse.
from jaxrl.sampling_contract import MaxTokens, Temperature, TopK, TopP, check_trainable_temperature


class EnvConfig(BaseModel):
    """One environment of the run (an `[[orchestrator.train.env]]` entry)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    id: str
    """A built-in env (`reverse_text`, `alphabet_sort`, `lookup`), the import path of a module
    exporting a verifiers `Taskset` (`my_pkg.my_env`), or an installed verifiers env id."""
    name: str = ""
    """Name in logs, metrics and the log file (default: `id`); unique within a run."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Taskset config fields, e.g. `{split = "eval", num_tasks = 100, seed = 1}` for a built-in."""
    env_args: dict[str, Any] = Field(default_factory=dict)
    """Other verifiers env config fields: a paired `Env` (`id = "user-sim"`), agent seat
    overrides (`agent = {max_turns = 4, timeout = {rollout = 60}}`), env timeouts, retries.
    Every seat runs on the local `subprocess` runtime unless its `runtime` is set here."""
    address: str | None = None
    """Attach to an env server already running at this ZeroMQ address (`tcp://host:port`)
    instead of spawning one."""
    pool_size: int = Field(1, ge=1)
    """Worker processes of a spawned server (1: one in-process server; more: verifiers'
    `EnvServerPool` spreads rollouts over that many processes)."""
    elastic: bool = False
    """Grow the pool with load (verifiers' elastic `EnvServerPool`): start with one worker and
    spawn another whenever rollouts in flight reach 90% of `workers * worker_capacity`, up to
    `pool_size`. verifiers 0.4 only grows a pool: workers are not reclaimed when load falls
    (they idle until the run ends). False: all `pool_size` workers start at once."""
    worker_capacity: int = Field(128, ge=1, le=1_000_000)
    """Rollouts one worker is expected to carry, the unit of the elastic scale-up trigger
    (verifiers' `multiplex`); with `elastic = false` it has no effect."""
    max_concurrent: int | None = Field(None, ge=1)
    """Episodes in flight per worker (None: no bound)."""
    group_size: int | None = Field(None, ge=1)
    """Rollouts per task for this env (None: the orchestrator's `group_size`)."""
    algo: AlgoConfig = Field(default_factory=GRPOConfig)
    """How this env's groups become samples: `grpo`, `max_rl`, `echo` or `sft`."""
    sampling: SamplingOverride | None = None
    """`[orchestrator.train.env.sampling]`: this env's temperature, max tokens, top-p/k; unset
    fields inherit the split's `[orchestrator.train.sampling]`."""
    ratio: float = Field(1.0, gt=0, allow_inf_nan=False)
    """Relative share of this env's groups in every batch (e.g. 3 and 1: three quarters and one
    quarter); the schedule is deterministic and keeps every prefix of draws within one group of
    the exact shares."""
    startup_timeout: float = Field(300.0, gt=0)
    """Seconds a spawned server may take to come up and answer health."""
    max_restarts: int = Field(3, ge=0)
    """Times a spawned server that dies mid-run is restarted (each logged); once more, the run
    writes a checkpoint and stops with an error naming this env and its log."""
    rollout_timeout: float | None = Field(None, gt=0)
    """Seconds one rollout may take before it is cancelled and recorded as failed (None: no limit)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed.reject_renamed(data, renamed.ENV)

    @field_validator("id")
    @classmethod
    def _known_id(cls, value: str) -> str:
        check_env_id(value)
        return value

    @model_validator(mode="after")
    def _default_name(self) -> EnvConfig:
        if not self.name:
            self.name = self.id
        if "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"env name {self.name!r} must be usable as a file name; set `name`")
        if self.elastic and self.pool_size < 2:
            raise ValueError(f"env {self.name!r}: elastic = true grows the pool up to pool_size; set pool_size >= 2")
        if self.elastic and self.address is not None:
            raise ValueError(f"env {self.name!r}: elastic applies to a server jaxrl spawns, not one at `address`")
        return self


class DynamicSamplingConfig(BaseModel):
    """``[orchestrator.dynamic_sampling]``: DAPO's dynamic sampling. Groups whose successful
    rollouts all scored the same reward carry no group-relative signal: they are dropped from
    the step (their records stay in rollouts.jsonl, ``fate = "no_signal"``, ``dropped: true``)
    and as many new groups are sampled in their place, at most ``max_refills`` rounds per step;
    what is still missing then is trained short (``train/dynamic_missing_groups``)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_refills: int = Field(4, ge=0, le=1000)
    """Refill rounds per step (each samples as many groups as the previous round dropped)."""


class SamplingConfig(BaseModel):
    """Sampling parameters sent with every rollout request of a split."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_completion_tokens: MaxTokens = 128
    """Tokens the model may generate per turn."""
    temperature: Temperature = 1.0
    """Sampling temperature (finite, >= 0); the trainer scores sampled tokens at the same
    temperature. Below 1e-5 (0 included) is greedy: eval splits only (a split that trains is
    refused one, as greedy tokens have no log-prob to train on)."""
    top_p: TopP = 1.0
    """Nucleus mass in (0, 1]; 1: no top-p filtering."""
    top_k: TopK = -1
    """-1 (or 0): no top-k filtering; else 1 .. 2**31 - 1 (values above the vocabulary keep all)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed.reject_renamed(data, renamed.SAMPLING)


class TrainSplitConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    sampling: SamplingConfig = SamplingConfig()
    env: list[EnvConfig] = Field(default_factory=list)
    """`[[orchestrator.train.env]]` entries; groups are drawn from them in proportion to their
    `ratio` (equal ratios: in turn)."""

    def sampling_for(self, env: EnvConfig) -> SamplingConfig:
        """This split's sampling with `env`'s `[...env.sampling]` fields over it."""
        if env.sampling is None:
            return self.sampling
        return SamplingConfig.model_validate(self.sampling.model_dump() | env.sampling.model_dump(exclude_none=True))

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed.reject_renamed(data, renamed.TRAIN_SPLIT)

    @model_validator(mode="after")
    def _unique(self) -> TrainSplitConfig:
        names = [e.name for e in self.env]
        if len(names) != len(set(names)):
            raise ValueError(f"env names must be unique within a split, got {names}; set `name`")
        return self


class EvalConfig(TrainSplitConfig):
    interval: int = Field(10, ge=0)
    """Evaluate every N steps (and before the first and after the last); 0: never."""
    num_tasks: int = Field(32, ge=1)
    """Held-out tasks per eval (from each env's eval split)."""
    k: int = Field(4, ge=1)
    """Samples per task: avg@k and pass@k (reward >= pass_threshold)."""
    pass_threshold: float = 1.0
    """A sample with at least this reward counts as a pass."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed.reject_renamed(data, renamed.TRAIN_SPLIT | renamed.EVAL)


class OrchestratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    batch_size: int = Field(64, ge=1)
    """Rollouts per optimizer step (a multiple of group_size)."""
    group_size: int = Field(8, ge=2)
    """Rollouts per task; advantages are relative within a group."""
    max_async_level: int = Field(1, ge=0)
    """Rollouts used at step n were sampled by policy version >= n - max_async_level."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """`[orchestrator.dynamic_sampling]`: drop all-equal-reward groups and refill the batch
    (DAPO); None: off (a batch is resampled only when it has no signal at all)."""
    max_resample: int = Field(3, ge=0)
    """A batch with no learning signal (every group's advantages zero) is re-sampled this many
    times before the run stops with an error."""
    max_concurrent_rollouts: int = Field(64, ge=1)
    """Rollouts in flight at once (across envs)."""
    train: TrainSplitConfig = TrainSplitConfig()
    eval: EvalConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed.reject_renamed(data, renamed.ORCHESTRATOR)

    @model_validator(mode="after")
    def _train_split_samples(self) -> OrchestratorConfig:
        check_trainable_temperature(self.train.sampling.temperature, "orchestrator.train.sampling.temperature")
        for i, env in enumerate(self.train.env):
            if env.sampling is not None and env.sampling.temperature is not None:
                field = f"orchestrator.train.env[{i}].sampling.temperature"
                check_trainable_temperature(env.sampling.temperature, field)
        return self

    @model_validator(mode="after")
    def _check(self) -> OrchestratorConfig:
        if not self.train.env:
            raise ValueError("orchestrator.train.env: add at least one [[orchestrator.train.env]] entry")
        if self.batch_size % self.group_size:
            raise ValueError(
                f"orchestrator.batch_size = {self.batch_size} must be a multiple of group_size = {self.group_size}"
            )
        return self
