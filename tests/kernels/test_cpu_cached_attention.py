"""The C++ CPU cached attention (``jaxrl_kernels.cpu_cached_attention``) against the pure-JAX reference
(``cached_attention``): one-token and multi-token queries, grouped heads, positions across several
of the kernel's 64-position blocks, a head_dim off the vector width, float32 and bfloat16 caches,
padding rows (out of range, negative) and padding positions (>= the cache length) giving zeros.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxrl_kernels import cpu_cached_attention as cpu_kernel
from jaxrl_kernels.cpu_build import default_compiler

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.layers import cached_attention


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if default_compiler() is None:
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


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_shared_prefix_reads_come_from_the_named_row_and_change_nothing(dtype) -> None:
    """Rows 1 and 4 hold row 2's values over their first 150 positions (as the engine's row
    copies leave them): reading those positions from row 2 gives the same result bit for bit;
    and the kernel does read there (with row 2 changed, the result changes)."""
    layers, n_rows, kv_heads, max_len, d, heads, t = 2, 5, 2, 300, 32, 4, 2
    rng = np.random.default_rng(7)
    kc = np.asarray(rng.normal(size=(layers, n_rows, kv_heads, max_len, d)), np.float32)
    vc = np.asarray(rng.normal(size=(layers, n_rows, kv_heads, max_len, d)), np.float32)
    for copy in (1, 4):
        kc[:, copy, :, :150], vc[:, copy, :, :150] = kc[:, 2, :, :150], vc[:, 2, :, :150]
    rows = jnp.array([1, 4, 3, 2], jnp.int32)
    positions = jnp.array([[200, 201], [149, 150], [120, 121], [10, 11]], jnp.int32)
    share_rows = jnp.array([2, 2, 0, 2], jnp.int32)
    share_lens = jnp.array([150, 150, 0, 150], jnp.int32)  # row 3 shares nothing; row 2 names itself
    q = jnp.asarray(rng.normal(size=(4, t, heads, d)), jnp.float32)
    run = jax.jit(cpu_kernel.cpu_cached_attention)
    for layer in (0, 1):
        args = (q, jnp.asarray(kc, dtype), jnp.asarray(vc, dtype), jnp.int32(layer), rows, positions)
        alone = np.asarray(run(*args))
        np.testing.assert_array_equal(np.asarray(run(*args, share_rows, share_lens)), alone)
        np.testing.assert_allclose(alone, np.asarray(jax.jit(cached_attention)(*args)), atol=2e-6, rtol=2e-6)
    changed = kc.copy()
    changed[:, 2, :, :150] += 1.0
    args = (q, jnp.asarray(changed, dtype), jnp.asarray(vc, dtype), jnp.int32(0), rows, positions)
    moved = np.abs(np.asarray(run(*args, share_rows, share_lens)) - np.asarray(run(*args))).max(axis=(1, 2, 3))
    assert (moved[:2] > 1e-3).all() and moved[2] == 0


def test_dispatch_takes_the_kernel_for_auto_on_cpu_decode_steps() -> None:
    rows = jnp.arange(2)
    auto = Kernels.create("auto", field="inference.backend.kernels")
    assert auto.cpu and auto.reference  # the trainer's call sites keep their references
    assert auto.cached_attention(jnp.zeros((2, 1), jnp.int32), rows) is not None
    assert auto.cached_attention(jnp.zeros((2, 4), jnp.int32), rows) is None  # prefill chunks: XLA's
    reference = Kernels.create("reference", field="inference.backend.kernels")
    assert reference.cached_attention(jnp.zeros((2, 1), jnp.int32), rows) is None


def test_no_compiler_falls_back_to_the_reference_with_a_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("JAXRL_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="jaxrl_kernels.cpu_build"):
        assert cpu_kernel.build_and_register(None) is None
        assert cpu_kernel.build_and_register(str(tmp_path / "no-such-c++")) is None
    assert "no C++ compiler" in caplog.text and "pure-JAX reference" in caplog.text
    assert not list(tmp_path.glob("*.so"))  # nothing half-built is left to load
