"""The C++ CPU matmul on packed weight stacks (``jaxrl_kernels.cpu_matmul``) against ``x @ w[layer]``:
row counts off the kernel's 8-row tiles, column counts off its 32-wide panels (zero padding
never written), every layer of a stack (a traced index, as in the layer scan), the decoder's
3-D projection weights, long inputs in row blocks, determinism, and the engine serving the
packed layout with the reference's tokens."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from jaxrl_kernels import cpu_matmul
from jaxrl_kernels.cpu_build import default_compiler
from jaxrl_kernels.cpu_matmul import X_BLOCK_FLOATS, PackedWeight

from jaxrl.engine.config import EngineConfig
from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if default_compiler() is None:
        pytest.skip("no C++ compiler: the engine runs XLA's dots (tested elsewhere)")
    assert cpu_matmul.load() is not None, "a C++ compiler is installed, so the kernel must build"


@pytest.mark.parametrize("m", [1, 5, 8, 13, 32, 64])
@pytest.mark.parametrize("k, n", [(16, 32), (100, 70), (256, 200), (64, 1536)])
def test_kernel_matches_the_product(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(3, k, n)).astype(np.float32)  # three layers
    packed = PackedWeight.pack({"w": jnp.asarray(w)}, k)
    assert packed.panels.shape == (3, -(-n // 32), k, 32)
    run = jax.jit(lambda p, x, i: p.at(i).matmul(x)[0])
    for layer in range(3):
        got = np.asarray(run(packed, jnp.asarray(x), layer))
        want = x.astype(np.float64) @ w[layer].astype(np.float64)
        assert got.shape == (m, n)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


def test_packing_round_trips_the_decoders_weight_shapes_and_groups() -> None:
    """q, k and v packed side by side (one call gives all three), and o alone."""
    rng = np.random.default_rng(0)
    f32 = jnp.float32
    wq = jnp.asarray(rng.normal(size=(2, 48, 3, 20)), f32)  # [L, D, heads, head_dim]: N = 60
    wk = jnp.asarray(rng.normal(size=(2, 48, 1, 20)), f32)  # N = 20: the group's N = 100
    wv = jnp.asarray(rng.normal(size=(2, 48, 1, 20)), f32)
    wo = jnp.asarray(rng.normal(size=(2, 3, 20, 48)), f32)  # [L, heads, head_dim, D]: K = 60
    for ws, k in (({"wq": wq, "wk": wk, "wv": wv}, 48), ({"wo": wo}, 60)):
        packed = PackedWeight.pack(ws, k)
        assert packed.names == tuple(ws)
        for name, w in packed.unpack().items():
            np.testing.assert_array_equal(np.asarray(w), np.asarray(ws[name]))
        x = jnp.asarray(rng.normal(size=(2, 3, k)), f32)  # leading axes kept
        got = packed.at(1).matmul(x)
        assert len(got) == len(ws)
        for y, w in zip(got, ws.values()):
            want = jnp.einsum("btk,kn->btn", x, w[1].reshape(k, -1), precision="highest")
            assert y.shape == (2, 3, w[1].size // k)
            np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)


def test_long_inputs_go_through_in_row_blocks_with_the_same_result() -> None:
    """Prefill chunks: x longer than ``X_BLOCK_FLOATS`` is cut into row blocks, one call each."""
    rng = np.random.default_rng(1)
    k = 64
    w = rng.normal(size=(k, 96)).astype(np.float32)
    packed = PackedWeight.pack({"w": jnp.asarray(w)[None]}, k)
    rows = X_BLOCK_FLOATS // k
    x = rng.normal(size=(2 * rows + 5, k)).astype(np.float32)
    hlo = jax.jit(PackedWeight.matmul).lower(packed, jnp.asarray(x)).as_text()
    assert hlo.count(f"@{cpu_matmul.KERNEL.target}(") == 3
    got = np.asarray(jax.jit(PackedWeight.matmul)(packed, jnp.asarray(x))[0])
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)


def test_columns_read_a_tied_embedding_from_its_packed_transpose() -> None:
    embed = jnp.asarray(np.random.default_rng(4).normal(size=(70, 24)), jnp.float32)  # [V, D]
    head = PackedWeight.pack({"embed": embed.T[None]}, 24)
    tokens = jnp.array([[0, 31, 32], [69, 5, 64]])
    np.testing.assert_array_equal(np.asarray(head.columns(tokens)), np.asarray(embed[tokens]))


def test_results_do_not_depend_on_timing() -> None:
    """Every output element is summed in one fixed order, whichever thread takes its item."""
    rng = np.random.default_rng(2)
    packed = PackedWeight.pack({"w": jnp.asarray(rng.normal(size=(1, 256, 512)), jnp.float32)}, 256)
    x = jnp.asarray(rng.normal(size=(32, 256)), jnp.float32)
    run = jax.jit(lambda p, x: p.matmul(x)[0])
    first = np.asarray(run(packed, x))
    for _ in range(20):
        np.testing.assert_array_equal(np.asarray(run(packed, x)), first)


def test_no_compiler_leaves_the_kernel_unbuilt_with_a_warning(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("JAXRL_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="jaxrl_kernels.cpu_build"):
        assert cpu_matmul.KERNEL.build_and_register(None) is None
        assert cpu_matmul.KERNEL.build_and_register(str(tmp_path / "no-such-c++")) is None
    assert "no C++ compiler" in caplog.text and "cpu_matmul.cc" in caplog.text
    assert not list(tmp_path.glob("*.so"))


def _engine(model, kernels: str) -> Engine:  # type: ignore[no-untyped-def]
    cfg = EngineConfig(max_model_len=64, max_seqs=4, max_batched_tokens=64, kernels=kernels, decode_batch_buckets=[4])
    return Engine(model, cfg)


def _is_packed(x: object) -> bool:
    return isinstance(x, PackedWeight)


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_engine_serves_packed_weights_with_the_reference_tokens(tied: bool) -> None:
    """On one CPU device ``kernels = "auto"`` packs the layer projections and the output
    projection (a tied embedding's rows are then read from its panels); the tokens are those of
    the references (XLA's dots on plain weights) and the log-probs agree to rounding, before and
    after a weight update (which lands in the packed layout too)."""
    model = tiny_model(seed=3, intermediate_size=72, tie_word_embeddings=tied, vocab=70)  # partial last panels
    auto, reference = _engine(model, "auto"), _engine(model, "reference")
    packed = {n: x.get_value() for n, x in auto.params.items() if _is_packed(x.get_value())}
    assert set(packed) == {"wq", "wo", "w_gate", "w_down", "embed" if tied else "lm_head"}  # one per group
    assert packed["wq"].names == ("wq", "wk", "wv") and packed["w_gate"].names == ("w_gate", "w_up")
    assert not tied or "lm_head" not in auto.params  # a tied table is kept once, packed
    assert not any(_is_packed(x) for x in jax.tree.leaves(reference.params, is_leaf=_is_packed))

    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17], [3, 3]]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)

    def same_outputs() -> None:
        a, b = (e.generate([Request(p, greedy) for p in prompts]) for e in (auto, reference))
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-4)

    same_outputs()
    update = jax.tree.map(lambda x: x * 1.5, nnx.state(model))
    assert auto.update_weights_from_state(update) == 1 == reference.update_weights_from_state(update)
    after = auto.params["w_gate"].get_value()
    np.testing.assert_allclose(np.asarray(after.panels), 1.5 * np.asarray(packed["w_gate"].panels), rtol=1e-6)
    same_outputs()
