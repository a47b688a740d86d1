"""``[orchestrator]``: environments, sampling, batch shape, off-policy lag, eval."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxrl import renamed

# The HTTP API's own range types: a run cannot configure what the server would refuse.
from jaxrl.sampling_ranges import MaxTokens, Temperature, TopK, TopP
from jaxrl.orchestrator.env_server import EnvConfig


class SamplingConfig(BaseModel):
    """Sampling parameters sent with every rollout request of a split."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_completion_tokens: MaxTokens = 128
    """Tokens the model may generate per turn."""
    temperature: Temperature = 1.0
    """Sampling temperature (finite, >= 0; 0 = greedy); the trainer scores sampled tokens at the
    same temperature."""
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
    def _check(self) -> OrchestratorConfig:
        if not self.train.env:
            raise ValueError("orchestrator.train.env: add at least one [[orchestrator.train.env]] entry")
        if self.batch_size % self.group_size:
            raise ValueError(
                f"orchestrator.batch_size = {self.batch_size} must be a multiple of group_size = {self.group_size}"
            )
        return self
