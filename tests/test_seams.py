"""Dependency seams: jaxrl.parallel knows axis names only; one rules table shards both meshes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "importing, forbidden",
    [
        # parallel knows axis names and meshes, not layers.
        ("jaxrl.parallel.mesh, jaxrl.parallel.rules, jaxrl.parallel.distributed",
         ("jaxrl.models", "jaxrl.trainer", "jaxrl.inference")),
        # Rollout backends produce a `jaxrl.endpoint.ModelEndpoint`; none of them knows the orchestrator.
        ("jaxrl.inference.vllm_backend, jaxrl.inference.serving, jaxrl.inference.server, "
         "jaxrl.inference.external, jaxrl.inference.rollout_backend", ("jaxrl.orchestrator",)),
        # The orchestrator reaches the engine over HTTP only (sampling ranges: jaxrl.sampling_ranges).
        ("jaxrl.orchestrator.orchestrator, jaxrl.orchestrator.config, jaxrl.orchestrator.sampling",
         ("jaxrl.inference",)),
    ],
)
def test_dependencies_point_one_way(importing: str, forbidden: tuple[str, ...]) -> None:
    code = (
        f"import sys, {importing};"
        f"bad = sorted(m for m in sys.modules if m.startswith({forbidden!r}));"
        "assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]  # fmt: skip


def test_serving_and_training_meshes_shard_by_the_same_rules() -> None:
    from jaxrl.inference.weights import cache_sharding, param_sharding_fn, serving_mesh
    from jaxrl.models import sharding
    from jaxrl.parallel.mesh import MeshConfig, make_mesh

    train = make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
    serve = serving_mesh(2)
    shape = (2, 64, 4, 16)  # wq [layers, embed, q_heads, head_dim]
    assert tuple(param_sharding_fn(serve)("wq", shape).spec) == (None, None, "tensor", None)
    # Training adds fsdp on embed; the serving mesh has no fsdp axis, so embed stays whole there.
    assert tuple(sharding.param_sharding_fn(train)("wq", shape).spec) == (None, "fsdp", "tensor", None)
    # KV cache [layers, rows, kv_heads, len, head_dim]: rows over the batch axes when training
    # meshes hold a cache, heads over tensor on both.
    cache = (2, 8, 2, 32, 16)
    assert tuple(cache_sharding(serve, cache).spec) == (None, None, "tensor", None, None)
    assert tuple(sharding.cache_sharding(train, cache).spec) == (None, "fsdp", "tensor", None, None)
