"""Ranges of the sampling values a request or a config can carry (vLLM's meanings), in the
types the device arrays hold: shared by the HTTP API (``jaxrl.inference.api``, a bad value is a
400 naming the field) and the config layer (``[orchestrator.*.sampling]``), so a run cannot
configure what the server would refuse. A ``top_k`` of 2**31 once overflowed an int32 array on
the engine thread.
"""

from __future__ import annotations

from typing import Annotated

import numpy as np
from pydantic import AfterValidator, Field

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs (and OpenAI's top_logprobs limit)
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # each stop string is searched for on the engine thread after every token


def _positive_in_float32(v: float) -> float:
    if not np.float32(v) > 0:
        raise ValueError(f"{v!r} rounds to 0 in float32 (the sampler's precision); use at least 1e-38")
    return v


# Range types of the sampling values (vLLM's meanings); also used by the config layer.
Temperature = Annotated[float, Field(ge=0, le=FLOAT32_MAX, allow_inf_nan=False)]
"""0 = greedy; finite (a float32 on device)."""
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False), AfterValidator(_positive_in_float32)]
"""Nucleus mass in (0, 1]; 1 = off. Must stay positive in float32, or filtering would silently stop."""
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
"""-1 or 0 = off; else the number of most likely tokens kept (an int32 on device)."""
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
"""Any int64 (as vLLM)."""
MaxTokens = Annotated[int, Field(ge=1, le=INT32_MAX)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
