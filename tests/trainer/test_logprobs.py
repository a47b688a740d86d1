"""Blocked ``token_logprobs`` equals the naive full softmax, and never builds ``[N, V]`` arrays."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.trainer.logprobs import token_logprobs, token_logprobs_reference

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _inputs(n, d, v, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(n, d)), dtype)
    lm_head = jnp.asarray(0.5 * rng.normal(size=(d, v)), dtype)
    targets = jnp.asarray(rng.integers(0, v, size=n), jnp.int32)
    temperature = jnp.asarray(rng.uniform(0.4, 1.7, size=n), jnp.float32)
    return hidden, lm_head, targets, temperature


def _objective(fn, targets, block_size):
    """A weighted sum of logp plus a little entropy: every token's gradient differs."""

    def f(hidden, lm_head, temperature):
        logp, entropy = fn(hidden, lm_head, targets, temperature, block_size=block_size)
        w = jnp.linspace(-1.0, 2.0, logp.shape[0])
        return jnp.sum(w * logp) + 0.3 * jnp.sum(jnp.cos(w) * entropy)

    return f


@pytest.mark.parametrize(
    ("v", "block_size"),
    [(64, 16), (61, 16), (50, 128), (37, 37), (40, 1)],
    ids=["divisible", "ragged", "block>V", "block==V", "block=1"],
)
def test_values_and_grads_match_reference(v, block_size):
    hidden, lm_head, targets, temperature = _inputs(9, 6, v)
    got = token_logprobs(hidden, lm_head, targets, temperature, block_size=block_size)
    want = token_logprobs_reference(hidden, lm_head, targets, temperature)
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, **TOL)

    grad = jax.grad(_objective(token_logprobs, targets, block_size), argnums=(0, 1, 2))
    grad_ref = jax.grad(_objective(token_logprobs_reference, targets, block_size), argnums=(0, 1, 2))
    for g, w in zip(grad(hidden, lm_head, temperature), grad_ref(hidden, lm_head, temperature)):
        assert np.abs(np.asarray(w)).max() > 1e-3  # the comparison is not between zeros
        np.testing.assert_allclose(g, w, **TOL)


def test_logp_is_a_normalised_distribution():
    """exp(logp) over every target id sums to 1 for each row (the last block is not double-counted)."""
    v = 23
    hidden, lm_head, _, temperature = _inputs(3, 4, v, seed=1)
    rows = jnp.repeat(jnp.arange(3), v)
    targets = jnp.tile(jnp.arange(v), 3)
    logp, _ = token_logprobs(hidden[rows], lm_head, targets, temperature[rows], block_size=8)
    np.testing.assert_allclose(jnp.exp(logp).reshape(3, v).sum(axis=1), np.ones(3), rtol=1e-6)


def test_bfloat16_inputs_compute_in_float32():
    hidden, lm_head, targets, temperature = _inputs(8, 16, 100, seed=2, dtype=jnp.bfloat16)
    got = token_logprobs(hidden, lm_head, targets, temperature, block_size=32)
    want = token_logprobs_reference(hidden, lm_head, targets, temperature)
    for g, w in zip(got, want):
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(g, w, **TOL)
    grads = jax.grad(_objective(token_logprobs, targets, 32), argnums=(0, 1))(hidden, lm_head, temperature)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16]


def test_jit_and_extreme_logits_stay_finite():
    """Large logits and a tiny temperature: the online logsumexp must not overflow."""
    hidden, lm_head, targets, _ = _inputs(5, 4, 45, seed=3)
    temperature = jnp.full((5,), 0.01)
    f = jax.jit(lambda h, w: token_logprobs(h, 30.0 * w, targets, temperature, block_size=16))
    got = f(hidden, lm_head)
    want = token_logprobs_reference(hidden, 30.0 * lm_head, targets, temperature)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-3)
    grads = jax.grad(_objective(token_logprobs, targets, 16), argnums=(0, 1))(hidden, lm_head, temperature)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


# --- memory: no [N, V] intermediate, forward or backward -------------------------------------

N, D, V, BLOCK = 128, 16, 8192, 256


def _all_avals(jaxpr):
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval
        for sub in jex.jaxprs_in_params(eqn.params):
            yield from _all_avals(sub)


def _nv_shapes(fn):
    hidden, lm_head, targets, temperature = _inputs(N, D, V)
    value = lambda h, w: jnp.sum(fn(h, w, targets, temperature, block_size=BLOCK)[0])
    shapes = set()
    for f in (value, jax.value_and_grad(value, argnums=(0, 1))):
        closed = jax.make_jaxpr(f)(hidden, lm_head)
        shapes |= {a.shape for a in _all_avals(closed.jaxpr) if getattr(a, "shape", None) == (N, V)}
    return shapes


def test_jaxpr_has_no_n_by_v_intermediate():
    assert _nv_shapes(token_logprobs_reference) == {(N, V)}  # the probe does see full logits
    assert _nv_shapes(token_logprobs) == set()


def _temp_bytes(fn):
    hidden, lm_head, targets, temperature = _inputs(N, D, V)
    value = lambda h, w: jnp.sum(fn(h, w, targets, temperature, block_size=BLOCK)[0])
    compiled = jax.jit(jax.value_and_grad(value, argnums=(0, 1))).lower(hidden, lm_head).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temp_memory_is_far_below_full_logits():
    logits_bytes = N * V * 4
    assert _temp_bytes(token_logprobs_reference) >= logits_bytes
    assert _temp_bytes(token_logprobs) < logits_bytes // 4
