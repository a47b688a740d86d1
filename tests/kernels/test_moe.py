"""Expert dispatch (``jaxrl_kernels.moe``): the sorted grouped-matmul reference equals a per-token
loop, and CPU's ``tiled_gmm`` equals XLA's ragged dot, values and gradients, empty groups included."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxrl_kernels.moe import expert_mlp_reference, ragged_dot, route, tile_rows, tiled_gmm


@pytest.mark.parametrize(("rows", "groups", "tile"), [(37, 5, 8), (64, 8, None), (3, 8, None), (300, 4, 16)])
def test_tiled_gmm_equals_ragged_dot_with_gradients(rows: int, groups: int, tile: int | None) -> None:
    rng = np.random.default_rng(rows)
    lhs = jnp.asarray(rng.normal(size=(rows, 16)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(groups, 16, 24)), jnp.float32)
    ids = np.sort(rng.integers(1, groups, rows))  # group 0 empty; the rest uneven
    sizes = jnp.asarray(np.bincount(ids, minlength=groups), jnp.int32)
    np.testing.assert_allclose(tiled_gmm(lhs, rhs, sizes, tile), ragged_dot(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)

    def loss(gmm, lhs, rhs):  # type: ignore[no-untyped-def]
        return jnp.sum(jnp.sin(gmm(lhs, rhs, sizes)))

    want = jax.grad(partial(loss, ragged_dot), argnums=(0, 1))(lhs, rhs)
    got = jax.grad(partial(loss, partial(tiled_gmm, tile=tile)), argnums=(0, 1))(lhs, rhs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_tile_rows_is_about_one_tile_per_group() -> None:
    assert tile_rows(64, 8) == 8 and tile_rows(4096, 8) == 128 and tile_rows(1, 128) == 8


@pytest.mark.parametrize("gmm", [ragged_dot, tiled_gmm])
def test_expert_mlp_reference_equals_a_per_token_loop(gmm) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    n, d, f, e, k = 11, 8, 12, 5, 2
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.normal(size=(e, d, f)), jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.normal(size=(e, f, d)), jnp.float32)
    ids, gates, probs = route(x, jnp.asarray(rng.normal(size=(d, e)), jnp.float32), k, norm_topk_prob=False)
    np.testing.assert_allclose(jnp.sum(probs, -1), 1.0, rtol=1e-6)
    got = expert_mlp_reference(x, ids, gates, w_gate, w_up, w_down, gmm=gmm)
    want = np.zeros((n, d), np.float32)
    for i in range(n):
        for j in range(k):
            g = int(ids[i, j])
            want[i] += float(gates[i, j]) * np.asarray((jax.nn.silu(x[i] @ w_gate[g]) * (x[i] @ w_up[g])) @ w_down[g])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_route_top_k_normalised_and_forced() -> None:
    h = jnp.asarray([[1.0, 0.0], [0.0, 1.0]])
    w = jnp.asarray([[3.0, 1.0, 0.0], [0.0, 1.0, 3.0]])  # token 0 prefers expert 0, token 1 expert 2
    ids, gates, probs = route(h, w, 2, norm_topk_prob=True)
    assert ids.tolist() == [[0, 1], [2, 1]]
    np.testing.assert_allclose(jnp.sum(gates, -1), 1.0, rtol=1e-6)
    forced = jnp.asarray([[2, 0], [0, 1]])
    f_ids, f_gates, _ = route(h, w, 2, norm_topk_prob=False, forced=forced)
    assert f_ids.tolist() == forced.tolist()
    np.testing.assert_allclose(f_gates, jnp.take_along_axis(probs, forced, -1), rtol=1e-6)
