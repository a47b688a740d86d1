"""Training attention on NVIDIA GPUs: cuDNN's fused flash attention through the public
``jax.nn.dot_product_attention(..., implementation="cudnn")``, with our packed-segment semantics.

What cuDNN can express, as jax exposes it (checked in jax 0.10-0.12 source,
``jax/_src/nn/functions.py`` and ``jax/_src/cudnn/fused_attention_stablehlo.py``):

* causal masking as a mask *type* (``is_causal=True``): the blocks above the diagonal are never
  computed, in the forward pass or the backward;
* padding by per-row lengths (``query_seq_lengths`` / ``key_value_seq_lengths``): one sequence
  per row, so not packed rows;
* an arbitrary boolean ``mask`` [B, 1, T, S], which jax turns into an additive bias tensor;
* several sequences per row ("sequence packing", ``q_offsets`` / ``kv_offsets``) only through
  the private ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``, on Hopper or
  newer, with a static maximum segment count per row; the public API has no segment ids (jax
  PR #29731 proposing them is open). MaxText's ``cudnn_flash_jax`` calls that private function
  with a causal mask alone and so attends across packed samples (its issue #4476).

So packed rows go in as causal mask type plus the segment mask as a bias: exact (attention never
crosses samples), public API only. Its cost over a true segment-aware kernel: a [B, 1, T, T]
bfloat16 bias per call and, in the backward pass, its (unused) gradient of the same size; still
no [B, heads, T, T] scores, which the XLA reference materialises per query block in float32.

cuDNN takes float16 / bfloat16 inputs only, head_dim a multiple of 8 up to 128 (256 on Hopper),
and with a bias in training even sequence lengths; ``unsupported`` names what a call breaks, and
``jaxrl.kernel_dispatch`` keeps the XLA reference for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HEAD_DIM_MAX = 256  # Hopper and newer; 128 before (cuDNN raises NotImplementedError there)


def unsupported(query: jax.ShapeDtypeStruct) -> str | None:
    """Why cuDNN flash attention cannot take queries like ``query`` [B, T, heads, head_dim] in
    training (None when it can)."""
    _, t, _, head_dim = query.shape
    if jnp.dtype(query.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"cuDNN flash attention takes bfloat16/float16 inputs, these are {jnp.dtype(query.dtype)}"
    if head_dim % 8 or head_dim > HEAD_DIM_MAX:
        return f"cuDNN flash attention needs head_dim a multiple of 8 up to {HEAD_DIM_MAX}, got {head_dim}"
    if t % 2:
        return f"cuDNN flash attention with a bias (our segment mask) needs an even sequence length in training, got {t}"
    return None


def cudnn_segment_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, implementation: str = "cudnn"
) -> jax.Array:
    """Causal attention within ``segment_ids`` [B, T]: q [B, T, H, D], k and v [B, T, K, D] (grouped
    query heads: H a multiple of K); out like q. The semantics of the decoder's reference
    attention (``jaxrl.models.layers.attention`` with ``packed_causal_mask``); every query sees
    at least itself, so no row of the softmax is empty. ``implementation="xla"`` makes the same
    call through XLA (how CPU tests check the arguments)."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=True, implementation=implementation)
