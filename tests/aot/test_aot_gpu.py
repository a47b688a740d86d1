"""AOT compiles for NVIDIA GPUs on this CPU host: the CUDA PJRT plugin describes compile-only
GPUs from a target description (``jaxrl.aot.topology.GPU_TARGETS``), no GPU or driver needed.
The compile needs the plugin (``pip install -e ".[cuda]"``) and is skipped without it; the
topology names are checked everywhere."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jaxrl.aot import get_topology
from jaxrl.aot.topology import GPU_MEMORY, GPU_TARGETS

SMALL = Path(__file__).parent / "small_rl.toml"
HAS_CUDA_PLUGIN = any(importlib.util.find_spec(p) is not None for p in ("jax_cuda13_plugin", "jax_cuda12_plugin"))


@pytest.mark.parametrize("name", ["gpu:b999", "gpu:h100xtwo", "gpu:"])
def test_bad_gpu_topology_names_the_form(name: str) -> None:
    with pytest.raises(ValueError, match=r"gpu:<model>\[x<GPUs>\].*h100"):
        get_topology(name)


def test_every_gpu_target_has_its_memory() -> None:
    for model, text in GPU_TARGETS.items():
        assert f"device_memory_size: {GPU_MEMORY[model]}" in text


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason='needs the CUDA PJRT plugin: pip install -e ".[cuda]"')
def test_small_model_compiles_for_h100s() -> None:
    """The small model's train step and engine on 4 compile-only H100s, with their memory. The
    references' kernels: cuDNN's fused attention also needs the cuDNN library on this host."""
    from jaxrl.aot import plan
    from jaxrl.cli import build_config
    from jaxrl.config import read_toml

    cfg = build_config(read_toml(SMALL), ["--trainer.kernels", "reference"])
    topo = get_topology("gpu:h100x4")
    assert topo.num_devices == 4 and topo.hbm_per_device == GPU_MEMORY["h100"]
    fits = plan(cfg, topo)
    assert [f.program for f in fits] == ["train_micro_step[4x512]", "train_update", "engine_decode[16x512]", "engine_prefill[8x128]"]
    for f in fits:
        assert f.error is None, f
        assert f.fits and 0 < f.total_bytes < topo.hbm_per_device


@pytest.mark.skipif(not HAS_CUDA_PLUGIN, reason='needs the CUDA PJRT plugin: pip install -e ".[cuda]"')
def test_the_gpu_expert_mlp_does_not_run_every_token_through_every_expert() -> None:
    """XLA:GPU rewrites ``jax.lax.ragged_dot`` into an [E, M, D] select and a dense dot (jaxlib
    0.10.2), so the expert MLP GPU runs (``Kernels.expert_mlp``) must not be the ragged dot: the
    ragged dot's forward + backward scratch holds at least E copies of the routed rows, and ours
    needs under an eighth of it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jaxrl_kernels.moe import expert_mlp_reference

    from jaxrl.kernel_dispatch import Kernels

    n, k, d, f, e = 4096, 8, 1024, 384, 32
    mesh = Mesh(np.array(get_topology("gpu:h100").devices[:1]), ("data",))
    kernels = Kernels.create("auto", field="trainer.kernels", mesh=mesh)
    spec = NamedSharding(mesh, PartitionSpec())
    args = [
        jax.ShapeDtypeStruct((n, d), jnp.bfloat16, sharding=spec),
        jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=spec),
        jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=spec),
        jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16, sharding=spec),
        jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16, sharding=spec),
        jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16, sharding=spec),
    ]

    def scratch(mlp) -> int:
        loss = lambda x, *rest: mlp(x, *rest).astype(jnp.float32).sum()
        grad = jax.jit(jax.grad(loss, argnums=(0, 3, 4, 5)))
        return grad.lower(*args).compile().memory_analysis().temp_size_in_bytes

    ours, ragged = scratch(kernels.expert_mlp()), scratch(expert_mlp_reference)
    every_expert = e * n * k * d * 2  # one [E, N * k, D] bfloat16 copy of the routed rows
    assert ragged >= every_expert and ours < ragged / 8, (ours, ragged, every_expert)  # 1.1 vs 13.5 GB
