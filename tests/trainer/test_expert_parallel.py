"""Expert parallelism in the trainer (an "expert" mesh axis: each device holds num_experts /
expert of a Qwen3-MoE's experts; the axis is data-parallel elsewhere): a packed micro-batch's
log-probs, loss and gradients equal one device's; expert counts the axis cannot split fail at
build naming trainer.mesh.expert."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import micro_batch_run as _run
from helpers import random_samples, tiny_model

from jaxrl.models.sharding import state_shardings
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.step import Trainer

MOE = {
    "vocab": 64,
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
}


@pytest.mark.slow  # the MoE sharded invariants run in the slow tier (the dense ones in the fast tier)
def test_expert_4_by_fsdp_2_equals_one_device() -> None:
    cfg = TrainerConfig(seq_len=64)
    samples = random_samples(14, seed=5, max_len=30)
    model = tiny_model(**MOE)
    want = _run(model, samples, cfg, rows=8)
    mesh = make_mesh(MeshConfig(data=1, fsdp=2, expert=4))
    # Each device holds 2 of the 8 experts (their embed over fsdp); dense weights over fsdp x expert.
    specs = {".".join(map(str, p)): s.spec for p, s in jax.tree_util.tree_leaves_with_path(
        state_shardings(nnx.split(model)[1], mesh), is_leaf=lambda x: hasattr(x, "spec"))}  # fmt: skip
    moe_gate = next(s for name, s in specs.items() if "moe_gate" in name)
    assert tuple(moe_gate)[:3] == (None, "expert", "fsdp")
    got = _run(model, samples, cfg, mesh, rows=8)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1] == pytest.approx(want[1], rel=1e-5)
    for a, b in zip(jax.tree.leaves(want[2]), jax.tree.leaves(got[2]), strict=True):
        scale = max(float(np.abs(np.asarray(a)).max()), 1e-6)
        assert float(np.abs(np.asarray(b) - np.asarray(a)).max()) <= 1e-5 * scale + 1e-7


@pytest.mark.parametrize(
    "model_kw, needle",
    [
        ({**MOE, "num_experts": 6}, "trainer.mesh.expert = 4 does not divide the model's 6 experts"),
        ({"vocab": 64}, "trainer.mesh.expert = 4 but the model is dense"),
    ],
)
def test_experts_the_axis_cannot_split_fail_at_build(model_kw, needle) -> None:
    mesh = make_mesh(MeshConfig(fsdp=2, expert=4))
    with pytest.raises(ValueError, match=needle):
        Trainer(tiny_model(**model_kw), TrainerConfig(seq_len=64, micro_batch_rows=8), mesh)
