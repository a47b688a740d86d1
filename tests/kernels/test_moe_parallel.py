"""The expert MLP split over an "expert" mesh axis (``jaxrl_kernels.moe_parallel``) against the
one-device reference, loss and gradients (router included), on 8 CPU devices (conftest)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxrl_kernels.moe import expert_mlp_reference, route, tiled_gmm
from jaxrl_kernels.moe_parallel import sharded_expert_mlp

from jaxrl.parallel.mesh import MeshConfig, make_mesh

N, D, F, E, K = 64, 16, 8, 8, 2


def _loss(mlp, x, router, w_gate, w_up, w_down):
    ids, gates, _ = route(x, router, K, True)
    return jnp.sum(jnp.sin(mlp(x, ids, gates, w_gate, w_up, w_down)))


@pytest.mark.parametrize(
    "mesh_kw, tokens",
    [
        ({"expert": 4, "fsdp": 2}, ("fsdp", "expert")),  # tokens gathered over expert, reduce-scattered back
        ({"expert": 2, "data": 4, "fsdp": 1}, "data"),  # tokens whole over expert (the engine's case): psum
    ],
    ids=["gather", "psum"],
)
def test_expert_parallel_matches_one_device(mesh_kw, tokens) -> None:
    keys = jax.random.split(jax.random.key(0), 5)
    args = (
        jax.random.normal(keys[0], (N, D)),
        jax.random.normal(keys[1], (D, E)),
        jax.random.normal(keys[2], (E, D, F)) / 4,
        jax.random.normal(keys[3], (E, D, F)) / 4,
        jax.random.normal(keys[4], (E, F, D)) / 4,
    )
    grad = partial(jax.value_and_grad, argnums=(0, 1, 2, 3, 4))
    want = grad(partial(_loss, expert_mlp_reference))(*args)
    mesh = make_mesh(MeshConfig(**mesh_kw))
    mlp = sharded_expert_mlp(partial(expert_mlp_reference, gmm=tiled_gmm), mesh, tokens)
    with jax.set_mesh(mesh):
        got = jax.jit(grad(partial(_loss, mlp)))(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))
