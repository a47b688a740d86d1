"""The decode reference attention (chunked, dynamic trip count) against plain attention over the
same cache rows: ragged positions, a cache length that is not a multiple of the chunk (the last
chunk overlaps the one before), out-of-range padding rows, a bfloat16 cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.layers import CACHE_CHUNK, attention, cached_attention


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunked_decode_attention_matches_dense(dtype) -> None:
    layers, n_rows, kv_heads, max_len, d, heads = 2, 6, 2, CACHE_CHUNK * 2 + 44, 16, 4
    kk, kv, kq = jax.random.split(jax.random.key(0), 3)
    kc = jax.random.normal(kk, (layers, n_rows, kv_heads, max_len, d)).astype(dtype)
    vc = jax.random.normal(kv, (layers, n_rows, kv_heads, max_len, d)).astype(dtype)
    rows = jnp.array([4, 0, 5, 2, n_rows], jnp.int32)  # the last one is padding (out of range)
    positions = jnp.array([[max_len - 1], [3], [CACHE_CHUNK], [CACHE_CHUNK * 2 + 7], [0]], jnp.int32)
    q = jax.random.normal(kq, (len(rows), 1, heads, d)).astype(dtype)
    for layer in range(layers):
        got = cached_attention(q, kc, vc, jnp.int32(layer), rows, positions)
        real = rows[:4]
        k, v = kc[layer][real].astype(jnp.float32), vc[layer][real].astype(jnp.float32)
        mask = jnp.arange(max_len)[None, None, :] <= positions[:4, :, None]
        want = attention(q[:4].astype(jnp.float32), k.swapaxes(1, 2), v.swapaxes(1, 2), mask)
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(got[:4], np.float32), np.asarray(want), atol=tol, rtol=tol)
        assert np.isfinite(np.asarray(got[4], np.float32)).all()  # padding reads something harmless


def test_chunked_prefill_attention_matches_dense() -> None:
    """Prompt chunks (T > 1) at ragged offsets, padding queries at position S (discarded)."""
    n_rows, kv_heads, max_len, d, heads, t = 4, 2, CACHE_CHUNK + 60, 8, 4, 5
    kc = jax.random.normal(jax.random.key(3), (1, n_rows, kv_heads, max_len, d))
    vc = jax.random.normal(jax.random.key(4), (1, n_rows, kv_heads, max_len, d))
    q = jax.random.normal(jax.random.key(5), (3, t, heads, d))
    rows = jnp.array([2, 0, 3], jnp.int32)
    positions = jnp.stack([jnp.arange(t) + 40, jnp.arange(t) + CACHE_CHUNK - 2, jnp.full(t, max_len)]).astype(jnp.int32)
    positions = positions.at[1, 3:].set(max_len)  # a shorter chunk, padded
    got = cached_attention(q, kc, vc, jnp.int32(0), rows, positions)
    mask = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]
    want = attention(q, kc[0][rows].swapaxes(1, 2), vc[0][rows].swapaxes(1, 2), mask)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1, :3], want[1, :3], atol=1e-5, rtol=1e-5)


def test_chunked_decode_attention_reads_only_up_to_the_longest_position() -> None:
    """Positions beyond every query's own never matter: garbage (NaN) there changes nothing."""
    kc = jax.random.normal(jax.random.key(1), (1, 3, 1, CACHE_CHUNK * 4, 8))
    q = jax.random.normal(jax.random.key(2), (3, 1, 2, 8))
    rows, positions = jnp.arange(3, dtype=jnp.int32), jnp.array([[5], [CACHE_CHUNK + 1], [17]], jnp.int32)
    clean = cached_attention(q, kc, kc, jnp.int32(0), rows, positions)
    dirty = kc.at[:, :, :, CACHE_CHUNK * 2 :].set(jnp.nan)  # chunks no query reaches are never read
    np.testing.assert_array_equal(cached_attention(q, dirty, dirty, jnp.int32(0), rows, positions), clean)


def test_row_blocks_each_stop_at_their_own_furthest_query() -> None:
    """16 rows = two blocks of ``ROW_BLOCK``; the second block's rows are short, so garbage
    beyond them is not read for that block while the first block reads further."""
    from jaxrl.models.layers import ROW_BLOCK

    n, max_len = 2 * ROW_BLOCK, CACHE_CHUNK * 3
    kc = jax.random.normal(jax.random.key(6), (1, n, 2, max_len, 8))
    q = jax.random.normal(jax.random.key(7), (n, 1, 4, 8))
    rows = jnp.arange(n, dtype=jnp.int32)[::-1]
    positions = jnp.concatenate([jnp.full((ROW_BLOCK, 1), max_len - 3), jnp.full((ROW_BLOCK, 1), 9)]).astype(jnp.int32)
    got = cached_attention(q, kc, kc, jnp.int32(0), rows, positions)
    mask = jnp.arange(max_len)[None, None, :] <= positions[:, :, None]
    want = attention(q, kc[0][rows].swapaxes(1, 2), kc[0][rows].swapaxes(1, 2), mask)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    short_rows = rows[ROW_BLOCK:]
    dirty = kc.at[:, short_rows, :, CACHE_CHUNK:].set(jnp.nan)  # past the short block's only chunk
    np.testing.assert_array_equal(cached_attention(q, dirty, dirty, jnp.int32(0), rows, positions)[ROW_BLOCK:], got[ROW_BLOCK:])
