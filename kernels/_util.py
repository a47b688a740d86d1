"""Small helpers shared by the kernels (kept out of ``kernels/__init__.py``, which must stay light)."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

# A large finite negative score for masked attention positions: finite so that the running max of
# an online softmax never becomes -inf (exp(-inf - -inf) would be NaN), and far enough from
# float32's limit that subtracting a real score never overflows. jax's own TPU kernels use it.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def check_block(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def tpu_params(*semantics: str) -> pltpu.CompilerParams:
    """Grid-axis semantics for Mosaic: "parallel" axes may be split across cores; "arbitrary"
    ones carry a reduction in scratch and must run in order. Ignored in interpret mode."""
    return pltpu.CompilerParams(dimension_semantics=semantics)
