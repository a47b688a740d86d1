"""Per-env sampling overrides (`[orchestrator.train.env.sampling]`): the fields an env sets
replace its split's `[orchestrator.train.sampling]` (or eval's) for that env's rollouts."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from jaxrl import renamed
from jaxrl.sampling_contract import MaxTokens, Temperature, TopK, TopP  # the server's own ranges


class SamplingOverride(BaseModel):
    """Sampling for one env; unset fields inherit the split's."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    max_completion_tokens: MaxTokens | None = None
    """Tokens the model may generate per turn in this env."""
    temperature: Temperature | None = None
    """Sampling temperature in this env (the trainer scores its tokens at the same one)."""
    top_p: TopP | None = None
    top_k: TopK | None = None
    """-1: no top-k filtering."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed.reject_renamed(data, renamed.SAMPLING)
