"""Sampling: greedy, temperature, top-k/top-p, seeds, and which log-prob is reported."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.engine.token_sampling import ARGMAX_BLOCK, SamplingBatch, SamplingParams, argmax_first, sample

LOGITS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], np.float32)


N = 4096  # draws per call: one compiled shape for every test


def _draw(
    logits: np.ndarray, params: SamplingParams, n: int = N, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """n draws for one row of logits (draw positions 0..n-1 of one seeded request)."""
    batch = SamplingBatch.host([params] * n, [seed] * n, list(range(n)), n)
    tokens, logprobs = jax.jit(sample)(jnp.asarray(np.repeat(logits, n, axis=0)), batch)
    return np.asarray(tokens), np.asarray(logprobs)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()


def test_greedy_is_argmax_and_reports_temperature_one_logprob() -> None:
    tokens, logprobs = _draw(LOGITS, SamplingParams(temperature=0.0))
    assert (tokens == 0).all()
    np.testing.assert_allclose(logprobs, _log_softmax(LOGITS[0])[0], rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_temperature_scaled_distribution(temperature: float) -> None:
    n = N
    tokens, logprobs = _draw(LOGITS, SamplingParams(temperature=temperature))
    want = np.exp(_log_softmax(LOGITS[0] / temperature))
    freq = np.bincount(tokens, minlength=6) / n
    assert np.abs(freq - want).max() < 4 * np.sqrt(want.max() / n)  # ~4 sigma
    np.testing.assert_allclose(logprobs, np.log(want)[tokens], rtol=1e-5)


def test_top_k_and_top_p_restrict_draws_but_report_unfiltered_logprob() -> None:
    tokens, logprobs = _draw(LOGITS, SamplingParams(top_k=2))
    assert set(tokens) == {0, 1}
    np.testing.assert_allclose(logprobs, _log_softmax(LOGITS[0])[tokens], rtol=1e-5)
    # top_p: tokens 0 and 1 hold ~0.80 of the mass; with top_p = 0.75 token 1 is still needed.
    p = np.exp(_log_softmax(LOGITS[0]))
    assert p[0] < 0.75 < p[0] + p[1] < 0.9
    tokens, _ = _draw(LOGITS, SamplingParams(top_p=0.75))
    assert set(tokens) == {0, 1}
    tokens, _ = _draw(LOGITS, SamplingParams(top_p=0.85))  # 0, 1, 2 hold 0.89
    assert set(tokens) == {0, 1, 2}
    tokens, _ = _draw(LOGITS, SamplingParams(top_k=1, temperature=3.0))
    assert (tokens == 0).all()


def test_seed_and_token_index_determine_the_draw() -> None:
    params = SamplingParams(temperature=1.0)
    a, _ = _draw(LOGITS, params, seed=7)
    b, _ = _draw(LOGITS, params, seed=7)
    c, _ = _draw(LOGITS, params, seed=8)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    big = (1 << 40) + 7  # 64-bit seeds use both halves
    d, _ = _draw(LOGITS, params, seed=big)
    assert (a != d).any()


def test_sampling_params_validation() -> None:
    for bad in ({"max_tokens": 0}, {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.0, top_k=5).filtered
    assert SamplingParams(top_k=5).filtered and SamplingParams(top_p=0.9).filtered


def test_inverse_cdf_over_many_blocks_matches_numpy_and_skips_zero_mass() -> None:
    from jaxrl.engine.token_sampling import _inverse_cdf

    rng = np.random.default_rng(0)
    probs = rng.random((3, 1000)).astype(np.float32) * (rng.random((3, 1000)) < 0.05)
    probs[2] = 0.0
    probs[2, [3, 700, 999]] = [0.2, 0.5, 0.3]  # mass in three blocks, the last one partial
    u = np.linspace(1e-6, 1.0, 257, dtype=np.float32)
    got = np.asarray(jax.vmap(lambda x: _inverse_cdf(jnp.asarray(probs), jnp.full(3, x)))(jnp.asarray(u)))
    for row in range(3):
        cdf = np.cumsum(probs[row].astype(np.float64))
        want = np.minimum(np.searchsorted(cdf, u * cdf[-1], side="left"), 999)
        assert (probs[row, got[:, row]] > 0).all()
        assert (got[:, row] == want).mean() > 0.98  # float32 vs float64 cumsum may differ at edges
    assert set(got[:, 2]) == {3, 700, 999}


@pytest.mark.parametrize("vocab", [ARGMAX_BLOCK * 3, ARGMAX_BLOCK * 3 + 37, 5])
def test_argmax_first_is_jnp_argmax_with_ties_and_a_partial_last_block(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    x = rng.integers(-3, 3, (64, vocab)).astype(np.float32)  # many ties per row
    x[0, -1] = 9.0  # maximum in the (partial) last block
    x[1, :] = -np.inf  # every entry -inf: index 0, as jnp.argmax
    x[2, [3, vocab - 1]] = 7.0  # tie across blocks: the first wins
    got = np.asarray(jax.jit(argmax_first)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def _penalties_reference(logits, output_counts, prompt_mask, presence, frequency, repetition):
    """vLLM's penalties, one row, float64 numpy (repetition, then frequency, then presence)."""
    x = logits.astype(np.float64).copy()
    seen = prompt_mask | (output_counts > 0)
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    return x - frequency * output_counts - presence * (output_counts > 0)


def test_penalties_match_vllm_reference_and_neutral_rows_are_untouched() -> None:
    from jaxrl.engine.token_sampling import TokenCounts, apply_penalties, penalize

    rng = np.random.default_rng(0)
    b, v = 5, 40
    logits = rng.normal(0, 3, (b, v)).astype(np.float32)
    counts = rng.integers(0, 3, (b, v)).astype(np.int32) * (rng.random((b, v)) < 0.3)
    prompt = rng.random((b, v)) < 0.2
    params = [
        SamplingParams(presence_penalty=0.5),
        SamplingParams(frequency_penalty=-1.5, repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7, presence_penalty=-2.0, frequency_penalty=2.0),
        SamplingParams(),  # neutral: bit-identical
        SamplingParams(repetition_penalty=2.0),
    ]
    batch = SamplingBatch.host(params, [0] * b, [0] * b, b)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(prompt), batch))
    for i, p in enumerate(params):
        want = _penalties_reference(logits[i], counts[i], prompt[i], p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[3], logits[3])
    assert not np.allclose(got[4], logits[4])
    # ``penalize`` reads rows of the per-cache-row counts; a batch of neutral rows is untouched.
    table = TokenCounts(jnp.asarray(counts[::-1]), jnp.asarray(prompt[::-1]))
    rows = jnp.arange(b)[::-1]
    np.testing.assert_array_equal(np.asarray(penalize(jnp.asarray(logits), table, rows, batch)), got)
    neutral = SamplingBatch.host([SamplingParams()] * b, [0] * b, [0] * b, b)
    np.testing.assert_array_equal(np.asarray(penalize(jnp.asarray(logits), table, rows, neutral)), logits)


@pytest.mark.parametrize(
    ("field", "value"),
    [("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0.0), ("repetition_penalty", float("inf"))],
)
def test_penalty_ranges_are_vllms(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("repetition", [1.2e-38, 3.4e38])
def test_extreme_repetition_penalty_keeps_draws_and_logprobs_finite(repetition: float) -> None:
    """vLLM allows any repetition_penalty > 0; one that overflows float32 is clipped, so the
    sampled token and its log-prob stay finite (a NaN would fail the response)."""
    from jaxrl.engine.token_sampling import apply_penalties

    params = [SamplingParams(repetition_penalty=repetition, temperature=t) for t in (1e-5, 0.7, 0.0)]
    batch = SamplingBatch.host(params, [1, 2, 3], [0, 0, 0], 3)
    logits = jnp.asarray(np.repeat(LOGITS, 3, axis=0))
    seen = jnp.ones(logits.shape, bool)  # every token is in the prompt
    penalised = apply_penalties(logits, jnp.zeros(logits.shape, jnp.int32), seen, batch)
    tokens, logprobs = sample(penalised, batch)
    assert np.isfinite(np.asarray(penalised)).all() and np.isfinite(np.asarray(logprobs)).all()
    assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < LOGITS.shape[1])).all()
