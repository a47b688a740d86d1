"""The TPU expert MLP (Megablox grouped matmul, ``jaxrl_kernels.megablox``) compiles for v5e,
v5p and v6e at Qwen3-30B-A3B's shapes (hidden 2048, expert width 768, 128 experts, top-8),
forward and backward, each Mosaic kernel within its chip's default scoped VMEM (Megablox asks
for no more), and without the dense every-expert product. libtpu's compile-only client
(``jax.experimental.topologies``), no TPU needed; skipped without libtpu (the ``tpu`` extra)."""

from __future__ import annotations

import importlib.util
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if importlib.util.find_spec("libtpu") is None:
    pytest.skip("TPU compiles need libtpu: pip install -e '.[tpu]'", allow_module_level=True)

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: no TPU to lock

from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxrl_kernels import megablox
from jaxrl_kernels.moe import expert_mlp_reference
from jaxrl_kernels.tpu_budget import MiB, compiled_kernel_vmem

D, F, E, K = 2048, 768, 128, 8  # Qwen3-30B-A3B
TOKENS = 1024  # 8192 (token, expert) rows: 64 per expert
BF16 = jnp.bfloat16
# Mosaic's default scoped VMEM per kernel (Megablox passes no vmem_limit_bytes).
SCOPED_VMEM = {"v5e:2x2": 16 * MiB, "v5p:2x2x1": 16 * MiB, "v6e:2x2": 32 * MiB}


@pytest.mark.parametrize("topology", list(SCOPED_VMEM))
def test_expert_mlp_forward_and_backward_fit(topology) -> None:
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = Mesh(np.array(devices[:1]), ("x",))  # one chip: what each shard_map call gets
    mlp = partial(expert_mlp_reference, gmm=megablox.gmm)

    def loss(x, gates, w_gate, w_up, w_down, ids):
        return jnp.sum(mlp(x, ids, gates, w_gate, w_up, w_down).astype(jnp.float32))

    rep = NamedSharding(mesh, PartitionSpec())
    shapes = [((TOKENS, D), BF16), ((TOKENS, K), jnp.float32), ((E, D, F), BF16), ((E, D, F), BF16),
              ((E, F, D), BF16), ((TOKENS, K), jnp.int32)]  # fmt: skip
    args = [jax.ShapeDtypeStruct(s, d, sharding=rep) for s, d in shapes]
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(*args).compile()
    kernels = compiled_kernel_vmem(compiled)
    # Forward: gate, up, down gmm; backward: a transposed gmm and a tgmm for each.
    assert len(kernels) >= 9, kernels
    assert all(0 < size <= SCOPED_VMEM[topology] for _, size in kernels), kernels
    # XLA's dense fallback would hold [rows, experts, width] (8192 x 128 x 768 floats: 3 GiB).
    assert compiled.memory_analysis().temp_size_in_bytes < 256 * MiB
