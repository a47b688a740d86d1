"""The sampling contract, from TOML to loss: the ranges of the sampling values a request or a
config can carry (vLLM's meanings), in the types the device arrays hold, and the greedy rule.

Shared by the config layer (``[orchestrator.*.sampling]``), the HTTP API
(``jaxrl.serving.protocol``, a bad value is a 400 naming the field), the engine
(``jaxrl.engine.token_sampling.SamplingParams``) and the training sample (``jaxrl.training_sample``), so a run
cannot configure what the server would refuse, nor train on what the trainer cannot score. A
``top_k`` of 2**31 once overflowed an int32 array on the engine thread.

The greedy rule: a temperature below ``GREEDY_BELOW`` (0 included) samples the argmax, as vLLM
does, and the engine reports that token's log-prob at temperature 1. Such tokens have no
log-prob at their own temperature (the distribution is a point mass), so RL cannot train on
them: a split that trains is refused one at config time (``check_trainable_temperature``), and
so is a training sample; eval splits may sample greedily.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import Field

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The widest int64 range whose bounds mean the same to a JSON reader that keeps integers exact
# and to one that reads them as doubles (as schema validators and fuzzers may): near 2**63
# doubles are 1024 apart, and +-(2**63 - 513) rounds so that every integer past it compares past
# it in both readings. A schema bound of 2**63 - 1 would admit 2**63 + 500 to a double reader.
JSON_INT64_MIN, JSON_INT64_MAX = -(2**63) + 513, 2**63 - 513
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32 (~1.18e-38)
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs (and OpenAI's top_logprobs limit)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # each stop string is searched for on the engine thread after every token


GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``); the one threshold everywhere."""


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` samples the argmax (see the module docstring)."""
    return temperature < GREEDY_BELOW


def check_temperature(temperature: float, field: str = "temperature") -> None:
    """A ``Temperature`` outside pydantic (the engine's and the sample's own dataclasses)."""
    if not 0 <= temperature <= FLOAT32_MAX:
        raise ValueError(f"{field} must be a finite number >= 0 (0 = greedy), got {temperature}")


def check_trainable_temperature(temperature: float, field: str) -> None:
    """Refuse a temperature RL cannot train at: greedy ones (below ``GREEDY_BELOW``)."""
    check_temperature(temperature, field)
    if is_greedy(temperature):
        raise ValueError(
            f"{field} = {temperature:g} samples greedily (below {GREEDY_BELOW:g}), and greedy tokens have no "
            f"log-prob to train on: use a temperature >= {GREEDY_BELOW:g} here (greedy suits eval splits)"
        )


# Range types of the sampling values (vLLM's meanings); also used by the config layer.
Temperature = Annotated[float, Field(ge=0, le=FLOAT32_MAX, allow_inf_nan=False)]
"""0 (below ``GREEDY_BELOW``) = greedy; finite (a float32 on device)."""
TopP = Annotated[float, Field(ge=FLOAT32_TINY, le=1, allow_inf_nan=False)]
"""Nucleus mass in (0, 1]; 1 = off. At least float32's smallest normal number: a smaller one
rounds (or flushes) to 0 on device and filtering would silently stop; the bound is in the schema,
so what the schema allows the server accepts."""
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
"""-1 or 0 = off; else the number of most likely tokens kept (an int32 on device)."""
Seed = Annotated[int, Field(ge=JSON_INT64_MIN, le=JSON_INT64_MAX)]
"""An int64 (as vLLM), within the range JSON readers agree on (``JSON_INT64_MAX``); choice i of
a request with ``n`` choices samples with seed + i, which then always fits in int64."""
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
PresencePenalty = Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)]
"""vLLM's range; 0 = off."""
FrequencyPenalty = PresencePenalty
RepetitionPenalty = Annotated[float, Field(ge=FLOAT32_TINY, le=FLOAT32_MAX, allow_inf_nan=False)]
"""vLLM's "> 0", as a positive finite float32; 1 = off."""
