"""Decode attention kernel (interpret mode) against its reference and the decoder's attention.

The cache is the engine's heads-major ``[layers, rows, K, S, Dh]``; queries pick their rows
(not in order, one outside the cache as the engine's padding) and a layer. Stale cache entries
(positions at or past a row's length, other rows, other layers) are filled with huge values: if
the kernel read them into the softmax or the value sum, the outputs would be far off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxrl_kernels.decode_attention import decode_attention, decode_attention_reference

from jaxrl.models.layers import attention

B, S, H, K, D = 5, 11, 6, 2, 8
LAYERS, ROWS, LAYER = 3, 7, 1
LENGTHS = np.array([1, 11, 5, 0, 4], np.int32)  # a lone token, full cache, empty row, tile edge
QUERY_ROWS = np.array([6, 0, 3, 2, 5], np.int32)
PAD_ROW = ROWS  # outside the cache: the engine's padding entries


def _inputs(seed=0, stale=1e30):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, D))
    k, v = np.full((LAYERS, ROWS, K, S, D), stale), np.full((LAYERS, ROWS, K, S, D), -stale)
    live = rng.standard_normal((2, B, K, S, D))
    for b, (row, n) in enumerate(zip(QUERY_ROWS, LENGTHS)):
        k[LAYER, row, :, :n], v[LAYER, row, :, :n] = live[0, b, :, :n], live[1, b, :, :n]
    return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


def test_reference_matches_decoder_attention():
    q, k, v = _inputs(stale=0.0)
    lengths, rows = jnp.asarray(LENGTHS), jnp.asarray(QUERY_ROWS)
    out = decode_attention_reference(q, k, v, lengths, rows, LAYER)
    mask = jnp.asarray(np.arange(S)[None, None, :] < LENGTHS[:, None, None])
    expected = jax.jit(lambda *a: attention(*a))(q[:, None], k[LAYER][rows].swapaxes(1, 2), v[LAYER][rows].swapaxes(1, 2), mask)
    live = LENGTHS > 0
    np.testing.assert_allclose(out[live], expected[:, 0][live], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(out[~live], 0.0)


def test_kernel_matches_reference():
    q, k, v = _inputs()
    lengths, rows = jnp.asarray(LENGTHS), jnp.asarray(QUERY_ROWS)

    @jax.jit
    def run(q, k, v, lengths, rows, layer):
        # S = 11 in tiles of 4: the last tile is partial, and query 4 ends exactly on a tile edge.
        return decode_attention(q, k, v, lengths, rows=rows, layer=layer, block_s=4, interpret=True)

    out = run(q, k, v, lengths, rows, jnp.int32(LAYER))
    expected = decode_attention_reference(q, k, v, lengths, rows, LAYER)
    assert bool(jnp.all(jnp.isfinite(out)))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    # A row of length 1 returns exactly its only value vector (per kv head's group).
    only = v[LAYER, QUERY_ROWS[0], :, 0]  # [K, D]
    np.testing.assert_allclose(out[0].reshape(K, H // K, D), np.broadcast_to(only[:, None], (K, H // K, D)))
    # A query whose row is outside the cache attends to nothing, whatever its length.
    padded = run(q, k, v, lengths.at[1].set(S), rows.at[1].set(PAD_ROW), jnp.int32(LAYER))
    np.testing.assert_array_equal(padded[1], 0.0)
    np.testing.assert_allclose(np.delete(padded, 1, 0), np.delete(out, 1, 0))


def test_four_dimensional_cache_is_one_layer():
    q, k, v = _inputs()
    lengths, rows = jnp.asarray(LENGTHS), jnp.asarray(QUERY_ROWS)
    run = jax.jit(lambda *a: decode_attention(*a, rows=rows, block_s=8, interpret=True))
    np.testing.assert_allclose(
        run(q, k[LAYER], v[LAYER], lengths), decode_attention_reference(q, k, v, lengths, rows, LAYER), atol=1e-5
    )


def test_rejects_bad_shapes():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="lengths must be"):
        decode_attention(q, k, v, jnp.ones((B + 1,), jnp.int32), layer=0, interpret=True)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q[:, :5], k, v, jnp.asarray(LENGTHS), layer=0, interpret=True)
    with pytest.raises(ValueError, match="needs `layer`"):
        decode_attention(q, k, v, jnp.asarray(LENGTHS), interpret=True)
