"""Per-env sampling overrides (`[orchestrator.train.env.sampling]`): the fields an env sets
replace its split's `[orchestrator.train.sampling]` (or eval's) for that env's rollouts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jaxrl import renamed


class SamplingOverride(BaseModel):
    """Sampling for one env; unset fields inherit the split's."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Tokens the model may generate per turn in this env."""
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    """Sampling temperature in this env (the trainer scores its tokens at the same one)."""
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """-1: no top-k filtering."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed.reject_renamed(data, renamed.SAMPLING)
