"""Decode attention kernel (interpret mode) against its reference and the decoder's attention.

Stale cache entries (positions at or past a row's length) are filled with huge values: if the
kernel read them into the softmax or the value sum, the outputs would be far off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.decoder import attention
from kernels.decode_attention import decode_attention, decode_attention_reference

B, S, H, K, D = 5, 11, 6, 2, 8
LENGTHS = np.array([1, 11, 5, 0, 4], np.int32)  # a lone token, full cache, empty row, tile edge


def _inputs(seed=0, stale=1e30):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, D))
    k, v = rng.standard_normal((2, B, S, K, D))
    stale_pos = np.arange(S)[None, :] >= LENGTHS[:, None]
    k[stale_pos], v[stale_pos] = stale, -stale
    return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


def test_reference_matches_decoder_attention():
    q, k, v = _inputs(stale=0.0)
    lengths = jnp.asarray(LENGTHS)
    out = decode_attention_reference(q, k, v, lengths)
    mask = jnp.asarray(np.arange(S)[None, None, :] < LENGTHS[:, None, None])
    expected = jax.jit(attention)(q[:, None], k, v, mask)[:, 0]
    live = LENGTHS > 0
    np.testing.assert_allclose(out[live], expected[live], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[~live], 0.0)


def test_kernel_matches_reference():
    q, k, v = _inputs()
    lengths = jnp.asarray(LENGTHS)
    # S = 11 in tiles of 4: the last tile is partial, and row 4 ends exactly on a tile edge.
    out = jax.jit(lambda *a: decode_attention(*a, block_s=4, interpret=True))(q, k, v, lengths)
    expected = decode_attention_reference(q, k, v, lengths)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    # A row of length 1 returns exactly its only value vector (per kv head's group).
    np.testing.assert_allclose(
        out[0].reshape(K, H // K, D), np.broadcast_to(v[0, 0][:, None], (K, H // K, D))
    )


def test_rejects_bad_shapes():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="lengths must be"):
        decode_attention(q, k, v, jnp.ones((B + 1,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q[:, :5], k, v, jnp.asarray(LENGTHS), interpret=True)
