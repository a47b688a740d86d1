"""trainer.remat: the policies keep less of the forward for the backward pass, in that order."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import tiny_arch

from jaxrl.models.decoder import Decoder
from jaxrl.trainer.config import TrainerConfig


def _backward_temp_bytes(remat: str) -> int:
    arch = tiny_arch(vocab=256, hidden_size=128, intermediate_size=512, num_layers=2, max_position_embeddings=512)
    model = Decoder(arch, rngs=nnx.Rngs(0), remat=remat)
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, 128), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(128), (2, 128))

    def loss(p):  # type: ignore[no-untyped-def]
        hidden, _ = nnx.merge(graphdef, p)(tokens, positions)
        return jnp.sum(hidden.astype(jnp.float32) ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow  # compiles every remat policy: the slow tier
def test_remat_policies_order_backward_memory() -> None:
    none, dots, full = (_backward_temp_bytes(r) for r in ("none", "save_dots", "full"))
    assert none > dots > full, (none, dots, full)


def test_remat_setting_accepts_policies_and_booleans() -> None:
    assert TrainerConfig(remat=True).remat == "full" and TrainerConfig(remat=False).remat == "none"
    auto = TrainerConfig()
    assert (auto.remat_policy("tpu"), auto.remat_policy("cpu")) == ("full", "none")
    assert TrainerConfig(remat="save_dots").remat_policy("tpu") == "save_dots"
    with pytest.raises(ValueError, match="remat"):
        TrainerConfig(remat="some")
