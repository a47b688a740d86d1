"""8-bit serving weights (``[inference.backend] quantization``, ``jaxrl.models.quantize``):
the rounding bounds of each format, the engine holding its projections in 8 bits and sampling
close to (not equal to) the trainer, weight swaps quantized too, and the config's spellings."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.models.decoder import param_name
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.quantize import CONTRACTING, QArray, dequantize_state, quantize_array, quantize_state


def test_int8_rounds_each_output_channel_to_half_a_step_and_fp8_to_its_mantissa() -> None:
    rng = np.random.default_rng(0)
    # [layers, embed, heads, head_dim] like wq, channels of very different magnitudes
    w = rng.normal(size=(2, 32, 4, 8)).astype(np.float32) * np.array([1e-3, 1.0, 30.0, 0.2])[None, None, :, None]
    w[0, :, 1, 3] = 0.0  # an all-zero channel: scale 1, values 0, no NaN
    q = quantize_array(jnp.asarray(w), (1,), "int8")
    assert q.values.dtype == jnp.int8 and q.scale.shape == (2, 1, 4, 8)
    amax = np.abs(w).max(axis=1, keepdims=True)
    np.testing.assert_allclose(np.asarray(q.scale), np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    back = np.asarray(q.dequantize(jnp.float32))
    assert np.all(np.abs(back - w) <= np.asarray(q.scale) / 2 * (1 + 1e-5))
    assert np.abs(np.asarray(q.values)).max() == 127 and np.all(back[0, :, 1, 3] == 0)
    f = quantize_array(jnp.asarray(w), (1,), "fp8")
    assert f.values.dtype == jnp.float8_e4m3fn and np.isfinite(np.asarray(f.values, np.float32)).all()
    back = np.asarray(f.dequantize(jnp.float32))
    # e4m3 keeps 3 mantissa bits: <= 2^-4 relative for normal values, plus the subnormal step near 0
    assert np.all(np.abs(back - w) <= np.abs(w) * 2**-4 + np.asarray(f.scale) * 2**-9)


def test_only_the_projections_are_quantized_each_over_its_own_input(model_dir) -> None:
    state = nnx.state(load_decoder(model_dir))
    served = quantize_state(state, "int8")
    kinds = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(served, is_leaf=lambda x: isinstance(x, QArray))[0]:
        kinds[param_name(path)] = type(leaf).__name__
    assert {n for n, k in kinds.items() if k == "QArray"} == set(CONTRACTING) & set(kinds)
    assert kinds["embed"] != "QArray" and kinds.get("lm_head", "Array") != "QArray"
    wo = next(x for p, x in jax.tree_util.tree_flatten_with_path(served, is_leaf=lambda x: isinstance(x, QArray))[0]
              if param_name(p) == "wo")  # fmt: skip
    assert wo.scale.shape[1:3] == (1, 1)  # [layers, q_heads, head_dim, embed]: one scale per output (embed) column
    back = dequantize_state(served, jnp.float32)
    for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(back), strict=True):
        tol = 0.0 if param_name(p) not in CONTRACTING else float(np.abs(np.asarray(a)).max()) / 127
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= tol, param_name(p)


@pytest.mark.parametrize(("kind", "dtype", "mean_bound"), [("int8", jnp.int8, 3e-3), ("fp8", jnp.float8_e4m3fn, 1e-2)])
def test_quantized_engine_serves_8_bit_projections_close_to_the_trainer(
    model_dir, other_model_dir, make_config, score, kind, dtype, mean_bound
) -> None:
    model = load_decoder(model_dir)
    engine = Engine(model, make_config(quantization=kind))
    served = jax.tree.leaves(engine.params)
    assert any(x.dtype == dtype for x in served)
    full = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert sum(x.nbytes for x in served) < 0.55 * full  # float32 tiny model: projections at 1/4, the rest kept
    rng = np.random.default_rng(0)
    reqs = [Request(rng.integers(0, 265, n).tolist(), SamplingParams(max_tokens=16, temperature=1.0, seed=i))
            for i, n in enumerate((5, 40, 12, 70))]  # fmt: skip
    outs = engine.generate(reqs)
    delta = np.concatenate([np.asarray(o.logprobs) - score(model, r.prompt, o.token_ids, 1.0) for r, o in zip(reqs, outs)])
    # quantized: the log-probs move (float32 serving matches the trainer to ~1e-7), but little
    assert 1e-5 < np.abs(delta).mean() < mean_bound, np.abs(delta).mean()
    # a weight swap is quantized on the way in as well
    other = load_decoder(other_model_dir)
    engine.update_weights_from_state(other, version=1)
    assert any(x.dtype == dtype for x in jax.tree.leaves(engine.params))
    again = engine.generate(reqs[:1])[0]
    delta = np.asarray(again.logprobs) - score(other, reqs[0].prompt, again.token_ids, 1.0)
    assert again.token_versions == [1] * 16 and np.abs(delta).mean() < mean_bound


def test_quantization_is_an_engine_setting_and_reads_from_inference_too(capsys) -> None:
    from jaxrl.rollout.config import InferenceConfig

    assert InferenceConfig.model_validate({"backend": {"quantization": "int8"}}).engine_config().quantization == "int8"
    moved = InferenceConfig.model_validate({"quantization": "fp8"})  # the spelling: [inference] quantization
    assert moved.backend.quantization == "fp8"
    assert "inference.quantization is now inference.backend.quantization" in capsys.readouterr().err
    with pytest.raises(ValueError, match="quantization"):  # never accepted and ignored by a vLLM backend
        InferenceConfig.model_validate({"backend": {"type": "vllm", "quantization": "int8"}})
    with pytest.raises(ValueError, match="int4|int8"):
        InferenceConfig.model_validate({"backend": {"quantization": "int4"}})


def test_quantized_on_the_trainer_pulls_bit_for_bit_what_the_server_would_quantize(
    model_dir, other_model_dir, make_config
) -> None:
    """Direct transfer to an int8 server (issue 40 item 3): the trainer's publisher quantizes
    (``quantize_param``), about half the bytes travel, and the server swaps in exactly the
    values, scales and shardings its own quantize of the same weights gives."""
    from jaxrl.models.quantize import quantize_param
    from jaxrl.models.sharding import param_sharding_fn
    from jaxrl.parallel.mesh import MeshConfig, make_mesh
    from jaxrl.weight_transfer import Publisher, manifest_for

    trainer = load_decoder(other_model_dir, sharding_fn=param_sharding_fn(make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))))
    engine = Engine(load_decoder(model_dir), make_config(quantization="int8"))
    serving_dtype = jax.tree.leaves(nnx.state(trainer))[0].dtype
    try:
        with Publisher(dtype=None, prepare=lambda p, x: quantize_param(p, x, serving_dtype, "int8"),
                       delta=True, block_bytes=serving_dtype.itemsize) as pub:  # fmt: skip
            pub.publish(1, nnx.state(trainer))
            manifest = manifest_for(1, pub.layout(), [pub.address], None, lineage=pub.lineage)
            full = manifest_for(1, nnx.state(trainer), [pub.address], serving_dtype)
            assert manifest.nbytes < 0.55 * full.nbytes  # float32 here: projections at 1/4 (bf16: 1/2)
            assert {p.dtype for p in manifest.params if p.path.endswith("/values")} == {"int8"}
            engine.update_weights_from_manifest(manifest, version=1)
            pulled = engine.params
            # The same weights again, as a delta: nothing changed, and the pull applies over version 1.
            again = pub.publish(2, nnx.state(trainer))
            assert again.base_version == 1 and pub.changes(2).changed_bytes == 0
            delta = manifest_for(2, pub.layout(), [pub.address], None, lineage=pub.lineage, base_version=1,
                                 block_bytes=pub.block_bytes)  # fmt: skip
            engine.update_weights_from_manifest(delta, version=2)
            pulled_delta = engine.params
        engine.update_weights_from_state(trainer, version=3)  # the server quantizes the weights itself
        local = engine.params
        is_q = lambda x: isinstance(x, QArray)
        assert sum(map(is_q, jax.tree.leaves(local, is_leaf=is_q))) > 0
        for a, b, c in zip(jax.tree.leaves(pulled), jax.tree.leaves(pulled_delta), jax.tree.leaves(local), strict=True):
            assert a.dtype == c.dtype and a.sharding == c.sharding
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
            np.testing.assert_array_equal(np.asarray(b), np.asarray(c))
        # A format the server does not serve is refused by name; its weights stay.
        with Publisher(dtype=None, prepare=lambda p, x: quantize_param(p, x, serving_dtype, "fp8")) as pub:
            pub.publish(1, nnx.state(trainer))
            fp8 = manifest_for(1, pub.layout(), [pub.address], None, lineage=pub.lineage)
            with pytest.raises(ValueError, match="trainer sent fp8 weights but this server serves quantization"):
                engine.update_weights_from_manifest(fp8, version=4)
        assert engine.policy_version == 3
    finally:
        engine.stop()


def test_projections_are_cast_to_the_compute_dtype_for_tpu_engines_only(model_dir) -> None:
    """``cast_projections``: exactly the ``CONTRACTING`` weights, only where stored wider, arrays
    and abstract shapes alike; a TPU engine stores its projections so (``projection_storage``), a
    CPU one keeps the float32 weights (XLA:CPU's dots read them at float32, as the trainer's do)."""
    from jaxrl.kernel_dispatch import Kernels
    from jaxrl.models.quantize import cast_projections

    state = nnx.state(load_decoder(model_dir))  # float32
    for tree in (state, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)):
        cast = cast_projections(tree, jnp.bfloat16)
        for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(cast), strict=True):
            assert b.dtype == (jnp.bfloat16 if param_name(p) in CONTRACTING else a.dtype), param_name(p)
        assert jax.tree.leaves(cast_projections(tree, jnp.float32))[0].dtype == jnp.float32
    bf16 = cast_projections(state, jnp.bfloat16)
    wq = next(x for p, x in jax.tree_util.tree_flatten_with_path(bf16)[0] if param_name(p) == "wq")
    wq32 = next(x for p, x in jax.tree_util.tree_flatten_with_path(state)[0] if param_name(p) == "wq")
    assert np.array_equal(np.asarray(wq), np.asarray(wq32.astype(jnp.bfloat16)))  # the model's own cast
    assert Kernels(tpu=True).projection_storage(jnp.bfloat16) == jnp.bfloat16
    assert Kernels().projection_storage(jnp.bfloat16) is None
