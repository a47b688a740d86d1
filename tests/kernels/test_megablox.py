"""The Megablox grouped matmul (``jaxrl_kernels.megablox``) in Pallas interpret mode against XLA's
ragged dot, forward and backward, at tiny shapes; and its tiling choice (pure arithmetic)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxrl_kernels.megablox import MegabloxTiling, gmm, row_tile
from jaxrl_kernels.tpu_budget import UNKNOWN


def _ragged(lhs, rhs, sizes):
    return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)


@pytest.mark.parametrize("sizes", [[5, 0, 19, 8], [0, 0, 40, 0]], ids=["uneven", "one-group"])
def test_gmm_matches_ragged_dot_forward_and_backward(sizes) -> None:
    """Rows not a multiple of the row tile (padded inside), an empty group, float32 inputs."""
    key = jax.random.split(jax.random.key(0), 3)
    m, k, n = sum(sizes) + 3, 128, 256  # 3 trailing rows past the groups (the reference zeroes them)
    lhs = jax.random.normal(key[0], (m, k), jnp.float32)
    rhs = jax.random.normal(key[1], (len(sizes), k, n), jnp.float32)
    cot = jax.random.normal(key[2], (m, n), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)

    def loss(fn):
        return lambda a, b: jnp.sum(fn(a, b, group_sizes)[: sum(sizes)] * cot[: sum(sizes)])

    ours = gmm(lhs, rhs, group_sizes, interpret=True)
    ref = _ragged(lhs, rhs, group_sizes)
    np.testing.assert_allclose(ours[: sum(sizes)], ref[: sum(sizes)], rtol=1e-5, atol=1e-4)
    g_ours = jax.grad(loss(lambda a, b, s: gmm(a, b, s, interpret=True)), (0, 1))(lhs, rhs)
    g_ref = jax.grad(loss(_ragged), (0, 1))(lhs, rhs)
    for a, b in zip(g_ours, g_ref, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


def test_row_tile_follows_rows_per_expert() -> None:
    assert row_tile(32768, 128) == 256  # a training micro-batch: 256 rows per expert
    assert row_tile(256, 128) == 16  # a decode step: 2 rows per expert, the smallest tile
    assert row_tile(10**6, 8) == 512  # capped


def test_tiling_fits_the_default_scoped_vmem_at_qwen3_30b_shapes() -> None:
    """Forward (D -> F), down projection (F -> D) and the backward's transposes, bfloat16."""
    tiling = MegabloxTiling(256, 128, 2, 2, UNKNOWN)
    for m, k, n in [(32768, 2048, 768), (32768, 768, 2048)]:
        tm, tk, tn = tiling(m, k, n)
        assert tm == 256 and k % tk == 0 and n % tn == 0
        assert tiling.vmem(tk, tn) <= UNKNOWN.block_budget
