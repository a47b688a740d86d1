"""Fused log-prob kernel (interpret mode) against its reference: values and all three gradients.

Interpret-mode cost is compilation, not shape, so each case compiles one jitted function that
returns values and gradients together (``jax.vjp``), and shapes stay tiny. Edge tiles are the
point: ``N`` and ``V`` not multiples of the blocks, so the kernels read unspecified memory
(interpret mode fills it with NaN) that must be masked, and targets in the last, partial tile.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxrl_kernels.logprobs import logprobs, logprobs_reference

from jaxrl.trainer.logprobs import token_logprobs_reference


def _inputs(n, d, v, dtype, seed=0):
    """numpy-made inputs (eager jax.random would compile a dozen tiny programs)."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((n, d)), dtype)
    lm_head = jnp.asarray(0.5 * rng.standard_normal((d, v)), dtype)
    targets = rng.integers(0, v, n)
    targets[:2] = (v - 1, 0)  # the last column lives in the partial tile
    temperature = jnp.asarray(rng.uniform(0.4, 1.6, n), jnp.float32)
    cot = (jnp.asarray(rng.standard_normal(n), jnp.float32), jnp.asarray(np.cos(np.arange(n)), jnp.float32))
    return hidden, lm_head, jnp.asarray(targets, jnp.int32), temperature, cot


def _values_and_grads(fn, hidden, lm_head, targets, temperature, cot):
    @jax.jit
    def run(hidden, lm_head, temperature):
        out, vjp = jax.vjp(lambda h, w, t: fn(h, w, targets, t), hidden, lm_head, temperature)
        return out, vjp(cot)

    return run(hidden, lm_head, temperature)


def test_reference_matches_jaxrl_reference():
    hidden, lm_head, targets, temperature, _ = _inputs(9, 8, 21, jnp.float32)
    ours = logprobs_reference(hidden, lm_head, targets, temperature)
    theirs = token_logprobs_reference(hidden, lm_head, targets, temperature)
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_matches_reference_values_and_grads():
    # A partial token tile (13 = 8 + 5) and a partial vocab tile (37 = 2 * 16 + 5).
    n, d, v, block_n, block_v = 13, 16, 37, 8, 16
    hidden, lm_head, targets, temperature, cot = _inputs(n, d, v, jnp.float32)
    kernel = lambda h, w, y, t: logprobs(h, w, y, t, block_n=block_n, block_v=block_v, interpret=True)
    (logp, ent), grads = _values_and_grads(kernel, hidden, lm_head, targets, temperature, cot)
    (logp_r, ent_r), grads_r = _values_and_grads(
        logprobs_reference, hidden, lm_head, targets, temperature, cot
    )
    np.testing.assert_allclose(logp, logp_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_r, rtol=1e-5, atol=1e-5)
    for name, g, g_r in zip(("hidden", "lm_head", "temperature"), grads, grads_r):
        assert g.shape == g_r.shape and g.dtype == g_r.dtype, name
        np.testing.assert_allclose(g, g_r, rtol=1e-4, atol=1e-4, err_msg=name)
    assert float(jnp.max(jnp.abs(grads_r[1]))) > 0.1  # the comparison is not vacuous


def test_bfloat16_inputs_compute_in_float32_and_blocks_clip():
    # Blocks larger than the arrays are clipped to one whole tile.
    hidden, lm_head, targets, temperature, _ = _inputs(6, 8, 40, jnp.bfloat16, seed=1)
    logp, ent = jax.jit(lambda *a: logprobs(*a, block_n=64, block_v=128, interpret=True))(
        hidden, lm_head, targets, temperature
    )
    logp_r, ent_r = logprobs_reference(hidden, lm_head, targets, temperature)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    np.testing.assert_allclose(logp, logp_r, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, ent_r, rtol=1e-5, atol=1e-5)


def test_rejects_mismatched_shapes_and_blocks():
    hidden, lm_head, targets, temperature, _ = _inputs(4, 8, 10, jnp.float32)
    with pytest.raises(ValueError, match="lm_head must be"):
        logprobs(hidden, lm_head.T, targets, temperature, interpret=True)
    with pytest.raises(ValueError, match="targets and temperature"):
        logprobs(hidden, lm_head, targets[:3], temperature, interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        logprobs(hidden, lm_head, targets, temperature, block_v=0, interpret=True)
