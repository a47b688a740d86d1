"""Segment attention kernel (interpret mode) and the splash path against the reference.

Each case compiles one jitted function returning the output and the q/k/v gradients together.
The segment layouts hold the awkward cases: one-token segments, segments crossing tile edges,
padding id 0 at the end, T not a multiple of either block, grouped-query heads.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxrl_kernels.attention import (
    blocked_segment_attention_reference,
    segment_attention,
    segment_attention_reference,
    select_attention,
    splash_segment_attention,
)

from jaxrl.models.layers import attention, packed_causal_mask

SEGMENTS_13 = np.array(
    [
        [1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 0, 0, 0],  # one-token segment 2, padding 0 at the end
        [5, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7, 8, 9],  # one-token segments at both ends
    ],
    np.int32,
)


def _qkv(b, t, h, kv_heads, d, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, w = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((b, t, h, d), (b, t, kv_heads, d), (b, t, kv_heads, d), (b, t, h, d))
    )
    return q, k, v, w


def _out_and_grads(fn, q, k, v, segment_ids, cot):
    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, segment_ids), q, k, v)
        return out, vjp(cot)

    return run(q, k, v)


def _assert_matches_reference(fn, q, k, v, segment_ids, cot):
    out, grads = _out_and_grads(fn, q, k, v, segment_ids, cot)
    out_r, grads_r = _out_and_grads(segment_attention_reference, q, k, v, segment_ids, cot)
    np.testing.assert_allclose(out, out_r, rtol=1e-5, atol=1e-5)
    for name, g, g_r in zip("qkv", grads, grads_r):
        assert g.shape == g_r.shape, name
        np.testing.assert_allclose(g, g_r, rtol=1e-4, atol=1e-4, err_msg=f"d{name}")


def test_reference_matches_decoder_attention():
    q, k, v, _ = _qkv(2, 13, 4, 2, 8)
    seg = jnp.asarray(SEGMENTS_13)
    expected = jax.jit(attention)(q, k, v, packed_causal_mask(seg))
    np.testing.assert_allclose(segment_attention_reference(q, k, v, seg), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [4, 5, 13, 64])
def test_blocked_reference_matches_dense_reference(block):
    """Query blocks that split segments, a last partial block, one block for all: same output and
    gradients as the dense reference."""
    q, k, v, cot = _qkv(2, 13, 4, 2, 8, seed=3)
    blocked = lambda q, k, v, seg: blocked_segment_attention_reference(q, k, v, seg, block=block)
    _assert_matches_reference(blocked, q, k, v, jnp.asarray(SEGMENTS_13), cot)


@pytest.mark.parametrize(
    "heads, kv_heads, block_q, block_k",
    [
        (4, 2, 8, 4),  # GQA groups of 2; q tiles span two kv tiles; T padded 13 -> 16
        (3, 1, 4, 8),  # MQA; kv tiles span two q tiles (exercises the dk/dv clamped fetch)
    ],
)
def test_kernel_matches_reference(heads, kv_heads, block_q, block_k):
    q, k, v, cot = _qkv(2, 13, heads, kv_heads, 8, seed=heads)
    seg = jnp.asarray(SEGMENTS_13)
    kernel = lambda q, k, v, s: segment_attention(
        q, k, v, s, block_q=block_q, block_k=block_k, interpret=True
    )
    _assert_matches_reference(kernel, q, k, v, seg, cot)


def test_splash_path_matches_reference():
    # The TPU path's glue (scaling, head-major layout, GQA, segment ids), run in interpret mode.
    q, k, v, cot = _qkv(1, 128, 4, 2, 128)
    seg = jnp.asarray(np.repeat([1, 2, 3, 0], [50, 1, 60, 17])[None], jnp.int32)
    splash = lambda q, k, v, s: splash_segment_attention(q, k, v, s, interpret=True)
    _assert_matches_reference(splash, q, k, v, seg, cot)


def test_select_attention_by_platform():
    assert select_attention("cpu") is segment_attention_reference
    assert select_attention("gpu") is segment_attention_reference
    assert select_attention("tpu") is not segment_attention_reference


def test_rejects_bad_shapes():
    q, k, v, _ = _qkv(1, 6, 3, 2, 8)
    seg = jnp.ones((1, 6), jnp.int32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        segment_attention(q, k, v, seg, interpret=True)
    q, k, v, _ = _qkv(1, 6, 4, 2, 8)
    with pytest.raises(ValueError, match="segment_ids must be"):
        segment_attention(q, k, v, seg[:, :5], interpret=True)
    with pytest.raises(ValueError, match="T a multiple of 128"):
        splash_segment_attention(q, k, v, seg, interpret=True)
