"""The C++ CPU cached attention (``kernels.cpu_cached_attention``) against the pure-JAX reference
(``cached_attention``): one-token and multi-token queries, grouped heads, positions across several
of the kernel's 64-position blocks, a head_dim off the vector width, float32 and bfloat16 caches,
padding rows (out of range, negative) and padding positions (>= the cache length) giving zeros.
"""

from __future__ import annotations

import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.decoder import cached_attention
from kernels import cpu_cached_attention as cpu_kernel


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if not (os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler: the engine runs the pure-JAX reference (tested elsewhere)")
    assert cpu_kernel.load() is not None, "a C++ compiler is installed, so the kernel must build"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 3])
def test_kernel_matches_the_reference(dtype, t: int) -> None:
    layers, n_rows, kv_heads, max_len, d, heads = 3, 6, 2, 300, 24, 6
    rng = np.random.default_rng(t)
    kc = jnp.asarray(rng.normal(size=(layers, n_rows, kv_heads, max_len, d)), dtype)
    vc = jnp.asarray(rng.normal(size=(layers, n_rows, kv_heads, max_len, d)), dtype)
    rows = jnp.array([3, 0, 5, 1, n_rows, -1], jnp.int32)  # the last two are padding rows
    positions = jnp.asarray(rng.integers(0, max_len, (len(rows), t)), jnp.int32)
    positions = positions.at[0, 0].set(max_len - 1).at[1, 0].set(0).at[2, 0].set(64)
    positions = positions.at[3, 0].set(max_len + 5)  # a padding position
    q = jnp.asarray(rng.normal(size=(len(rows), t, heads, d)), jnp.float32)
    for layer in (0, 2):
        args = (q, kc, vc, jnp.int32(layer), rows, positions)
        want = np.asarray(jax.jit(cached_attention)(*args))
        got = np.asarray(jax.jit(cpu_kernel.cpu_cached_attention)(*args))
        real = np.ones(positions.shape, bool)
        real[4:] = False
        real[3, 0] = False
        np.testing.assert_allclose(got[real], want[real], atol=2e-6, rtol=2e-6)
        assert (got[~real] == 0).all()


def test_dispatch_takes_the_kernel_for_auto_on_cpu() -> None:
    rows = jnp.arange(2)
    auto = Kernels.create("auto", field="inference.kernels")
    assert auto.cpu_attention and auto.reference  # the trainer's call sites keep their references
    for t in (1, 4):  # decode steps and prefill chunks
        assert auto.cached_attention(jnp.zeros((2, t), jnp.int32), rows) is not None
    reference = Kernels.create("reference", field="inference.kernels")
    assert reference.cached_attention(jnp.zeros((2, 1), jnp.int32), rows) is None


def test_no_compiler_falls_back_to_the_reference_with_a_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("JAXRL_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.__name__):
        assert cpu_kernel.build_and_register(None) is None
        assert cpu_kernel.build_and_register(str(tmp_path / "no-such-c++")) is None
    assert "no C++ compiler" in caplog.text and "pure-JAX reference" in caplog.text
    assert not list(tmp_path.glob("*.so"))  # nothing half-built is left to load
