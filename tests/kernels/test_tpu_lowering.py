"""The kernels lower for TPU (Pallas -> Mosaic), checked on CPU through ``jax.export``.

Interpret mode proves the math, not that Mosaic accepts the kernels. Exporting for the ``tpu``
platform runs Pallas's TPU lowering with no TPU present: it rejects illegal block shapes (the
last two block dims must be multiples of (8, 128) or whole), primitives Mosaic cannot lower,
and index-map ops that need a real device. (The final Mosaic compile still happens in libtpu.)
Shapes are realistic (bfloat16, head_dim 128, edge tiles), and nothing is compiled or run.
"""

import jax
import jax.numpy as jnp
from jax import export
from jaxrl_kernels.attention import segment_attention, splash_segment_attention
from jaxrl_kernels.decode_attention import decode_attention
from jaxrl_kernels.logprobs import logprobs

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _tpu_custom_calls(fn, *args) -> int:
    module = export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    return module.count("custom_call @tpu_custom_call(")


def _grad(fn, argnums):
    def loss(*args):
        out = fn(*args)
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))

    return jax.grad(loss, argnums=argnums)


def test_logprobs_forward_and_backward_lower():
    args = (S((500, 256), BF16), S((256, 1000), BF16), S((500,), jnp.int32), S((500,), jnp.float32))
    fn = lambda h, w, y, t: logprobs(h, w, y, t, block_n=256, block_v=512)
    assert _tpu_custom_calls(_grad(fn, (0, 1, 3)), *args) == 3  # forward + two backward kernels


def test_segment_attention_forward_and_backward_lower():
    b, t, h, k, d = 2, 300, 8, 2, 128
    args = (S((b, t, h, d), BF16), S((b, t, k, d), BF16), S((b, t, k, d), BF16), S((b, t), jnp.int32))
    assert _tpu_custom_calls(_grad(segment_attention, (0, 1, 2)), *args) == 3  # forward, dq, dk/dv


def test_splash_path_lowers():
    b, t, h, k, d = 2, 256, 8, 2, 128
    args = (S((b, t, h, d), BF16), S((b, t, k, d), BF16), S((b, t, k, d), BF16), S((b, t), jnp.int32))
    assert _tpu_custom_calls(_grad(splash_segment_attention, (0, 1, 2)), *args) >= 2


def test_decode_attention_lowers():
    layers, rows, b, s, h, k, d = 2, 4, 3, 1000, 8, 2, 128
    cache = S((layers, rows, k, s, d), BF16)
    args = (S((b, h, d), BF16), cache, cache, S((b,), jnp.int32), S((b,), jnp.int32), S((), jnp.int32))
    fn = lambda q, kc, vc, n, r, l: decode_attention(q, kc, vc, n, rows=r, layer=l, block_s=256)
    assert _tpu_custom_calls(fn, *args) == 1
