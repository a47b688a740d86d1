"""GPU as a target, checked on CPU: what "auto" resolves to per platform, when the cuDNN training
attention is taken, that its call has the reference's semantics (the same call with XLA's
implementation), and that the train step lowers for CUDA with cuDNN's fused attention in the
forward and backward passes (``jax.export``; nothing runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from jax import export
from jaxrl_kernels import cudnn_attention

from jaxrl.kernel_dispatch import Kernels, resolve
from jaxrl.models.layers import CAUSAL_BLOCK, attention, packed_causal_mask
from jaxrl.trainer.config import TrainerConfig


@pytest.mark.parametrize(
    "platform, impl", [("tpu", "pallas"), ("gpu", "cudnn"), ("cuda", "cudnn"), ("cpu", "reference"), ("rocm", "reference")]
)
def test_auto_resolves_per_platform(platform: str, impl: str) -> None:
    assert resolve("auto", platform, field="x") == impl
    assert resolve("reference", platform, field="x") == "reference"


def test_cudnn_is_taken_for_bf16_training_attention_only() -> None:
    kernels = Kernels("cudnn")
    seg = jnp.ones((2, 64), jnp.int32)
    bf16 = jax.ShapeDtypeStruct((2, 64, 4, 128), jnp.bfloat16)
    assert kernels.training_attention(seg, bf16) is not None
    for bad in (
        jax.ShapeDtypeStruct((2, 64, 4, 128), jnp.float32),  # cuDNN: half precision only
        jax.ShapeDtypeStruct((2, 63, 4, 128), jnp.bfloat16),  # odd length with a bias
        jax.ShapeDtypeStruct((2, 64, 4, 100), jnp.bfloat16),  # head_dim not a multiple of 8
    ):
        assert cudnn_attention.unsupported(bad) is not None
        assert kernels.training_attention(seg, bad) is None
    # decode attention and log-probs: the XLA references on GPU
    assert kernels.token_logprobs() is None
    assert kernels.cached_attention(jnp.zeros((2, 1), jnp.int32), jnp.arange(2)) is None


def test_the_cudnn_call_has_the_reference_semantics() -> None:
    """Three packed samples per row, grouped heads: ``cudnn_segment_attention``'s arguments (causal
    mask type + segment mask) run through XLA's implementation give the decoder's attention."""
    rng = np.random.default_rng(0)
    b, t, h, k, d = 2, 40, 4, 2, 16
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    kv = [jnp.asarray(rng.normal(size=(b, t, k, d)), jnp.float32) for _ in range(2)]
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], [12, 9, 15, 4], axis=1)[:, :t], jnp.int32)
    want = attention(q, *kv, packed_causal_mask(seg), causal_block=CAUSAL_BLOCK)
    got = cudnn_attention.cudnn_segment_attention(q, *kv, seg, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_train_forward_and_backward_lower_for_cuda_with_cudnn_attention(monkeypatch) -> None:
    """bf16 loss + gradients of the decoder with ``Kernels("cudnn")`` lower for CUDA: one fused
    attention forward and one backward custom call (the layer body is scanned). jax asks the
    installed cuDNN for its version at trace time; a CPU jaxlib has none, so the test names one."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)
    model = tiny_model(vocab=64, head_dim=16)
    model.dtype = jnp.bfloat16
    graphdef, params = nnx.split(model)
    kernels = Kernels("cudnn")

    def loss(params, tokens, seg):  # type: ignore[no-untyped-def]
        hidden, _ = nnx.merge(graphdef, params)(tokens, tokens, seg, kernels=kernels)
        return hidden.astype(jnp.float32).sum()

    tokens = jnp.zeros((2, 32), jnp.int32)
    calls = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
    checks = [export.DisabledSafetyCheck.custom_call(c) for c in calls]
    module = export.export(jax.jit(jax.grad(loss)), platforms=["cuda"], disabled_checks=checks)(
        params, tokens, tokens + 1
    ).mlir_module()
    assert module.count(f"custom_call @{calls[0]}(") == 1
    assert module.count(f"custom_call @{calls[1]}(") == 1


def test_remat_auto_is_full_on_gpu_and_tpu() -> None:
    cfg = TrainerConfig()
    assert cfg.remat == "auto"
    assert cfg.remat_policy("gpu") == cfg.remat_policy("tpu") == "full"
    assert cfg.remat_policy("cpu") == "none"
