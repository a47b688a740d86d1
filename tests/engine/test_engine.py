"""The engine on a tiny random Qwen3: trainer/sampler agreement, batching, stops, prefix reuse."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.models.hf_io import load_decoder


@pytest.fixture(scope="module")
def engine(model_dir, make_config) -> Engine:
    return Engine.from_pretrained(model_dir, make_config())


@pytest.fixture(scope="module")
def model(model_dir):
    return load_decoder(model_dir)


def _prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 265, n).tolist()


def _req(prompt: list[int], **kw) -> Request:
    session = kw.pop("session", None)
    return Request(prompt, SamplingParams(**kw), session_id=session)


def test_logprobs_match_trainer_forward(engine, model, score, kl) -> None:
    """Sampled log-probs equal the trainer's on the same tokens: mismatch KL <= 1e-6 (fp32).

    Eight requests on four rows: sequences join and leave between steps, prompts longer than a
    prefill chunk are prefilled in pieces, and temperatures / top-k / top-p / greedy are mixed.
    """
    rng = np.random.default_rng(0)
    settings = [
        {"temperature": 1.0},
        {"temperature": 0.7},
        {"temperature": 0.0},
        {"temperature": 1.3},
        {"temperature": 1.0, "top_k": 5},
        {"temperature": 0.5, "top_p": 0.9},
        {"temperature": 1.0},
        {"temperature": 0.0},
    ]
    reqs = [
        _req(_prompt(rng, int(rng.integers(3, 70))), max_tokens=24, seed=i, **s)
        for i, s in enumerate(settings)
    ]
    outs = engine.generate(reqs)
    for r, o in zip(reqs, outs):
        assert len(o.token_ids) == len(o.logprobs) == 24 and o.finish_reason == "length"
        logp = score(model, r.prompt, o.token_ids, r.params.temperature)
        assert np.abs(logp - np.asarray(o.logprobs)).max() < 1e-5
        assert kl(logp, o.logprobs) <= 1e-6
        if r.params.greedy:  # each token is the argmax of the full forward's logits
            seq = np.asarray(r.prompt + o.token_ids)
            hidden, _ = model(jnp.asarray(seq[None]), jnp.arange(len(seq))[None])
            logits = np.asarray(model.logits(hidden))[0, len(r.prompt) - 1 : -1]
            np.testing.assert_array_equal(logits.argmax(-1), o.token_ids)


def test_seeded_request_is_independent_of_batching_and_arrival(engine) -> None:
    rng = np.random.default_rng(1)
    prompt = _prompt(rng, 20)
    alone = engine.generate([_req(prompt, max_tokens=16, seed=5)])[0]
    others = [engine.submit(_req(_prompt(rng, 45), max_tokens=20)) for _ in range(3)]
    engine.step()
    engine.step()  # the others are mid-flight when the request arrives
    late = engine.submit(_req(prompt, max_tokens=16, seed=5))
    while not (late.done() and all(f.done() for f in others)):
        engine.step()
    got = late.result()
    assert got.token_ids == alone.token_ids
    np.testing.assert_allclose(got.logprobs, alone.logprobs, atol=1e-5)


def test_idle_decode_steps_change_call_grouping_not_tokens(engine, model_dir, make_config) -> None:
    """With ``decode_steps_idle`` the engine runs longer decode calls while nothing waits to join
    (and short ones while something does); seeded samples and their log-probs are the same as
    with fixed short calls, and the engine did make the longer calls."""
    rng = np.random.default_rng(4)
    reqs = [_req(_prompt(rng, int(rng.integers(5, 40))), max_tokens=int(rng.integers(10, 30)), seed=i)
            for i in range(6)]  # six requests on four rows: two wait, then join mid-flight
    fixed = engine.generate(reqs)
    adaptive = Engine.from_pretrained(model_dir, make_config(decode_steps_idle=9))
    calls: list[int] = []
    run_decode = adaptive._run_decode
    adaptive._run_decode = lambda plan: (calls.append(plan.steps), run_decode(plan))
    out = adaptive.generate([_req(r.prompt, max_tokens=r.params.max_tokens, seed=r.params.seed) for r in reqs])
    assert set(calls) == {3, 9} and calls[0] == 3  # short while requests wait, long once none do
    for a, b in zip(fixed, out):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert adaptive.compiled_programs() <= adaptive.config.program_bound()


def test_seeded_draws_follow_the_sequence_position(engine) -> None:
    """A seeded draw is keyed by the token's position in the whole sequence, so re-submitting
    the prompt extended by the first k sampled tokens, with the same seed, continues the same
    sample (keyed by index in the completion, it would replay draws 0.. at positions k..). It is
    also why a later turn that reuses a rollout's seed gets fresh draws."""
    prompt = _prompt(np.random.default_rng(6), 15)
    full = engine.generate([_req(prompt, max_tokens=12, seed=9)])[0].token_ids
    for k in (1, 5):
        rest = engine.generate([_req(prompt + full[:k], max_tokens=12 - k, seed=9)])[0].token_ids
        assert rest == full[k:]


def test_stop_tokens_max_tokens_and_context_limit(engine) -> None:
    prompt = _prompt(np.random.default_rng(2), 12)
    full = engine.generate([_req(prompt, max_tokens=12, seed=3)])[0].token_ids
    k = next(i for i in range(1, 12) if full[i] not in full[:i])
    out = engine.generate([_req(prompt, max_tokens=12, seed=3, stop_token_ids=(full[k],))])[0]
    assert out.token_ids == full[: k + 1] and out.finish_reason == "stop" and out.stop_token == full[k]
    out = engine.generate([_req(prompt, max_tokens=5, seed=3)])[0]
    assert out.token_ids == full[:5] and out.finish_reason == "length" and out.stop_token is None
    long_prompt = _prompt(np.random.default_rng(3), engine.max_model_len - 6)
    out = engine.generate([_req(long_prompt, max_tokens=50)])[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_next_turn_and_group_reuse_cached_prefixes(engine, model, score, kl) -> None:
    rng = np.random.default_rng(4)
    stats = engine.stats
    turn1 = _prompt(rng, 30)
    first = engine.generate([_req(turn1, max_tokens=10, seed=0, session="conv")])[0]
    turn2 = turn1 + first.token_ids + [5, 6, 7]
    computed = stats.prefill_tokens
    second = engine.generate([_req(turn2, max_tokens=10, seed=1, session="conv")])[0]
    assert (
        second.cached_prompt_tokens == len(turn1) + len(first.token_ids) - 1
    )  # the last token was never fed
    assert stats.prefill_tokens - computed == len(turn2) - second.cached_prompt_tokens
    assert kl(score(model, turn2, second.token_ids, 1.0), second.logprobs) <= 1e-6

    group_prompt = _prompt(rng, 40)
    computed, copies = stats.prefill_tokens, stats.row_copies
    group = engine.generate([_req(group_prompt, max_tokens=8, seed=10 + i) for i in range(4)])
    assert stats.prefill_tokens - computed == 40 + 3  # one prefill; each copy recomputes its last token
    assert stats.row_copies - copies == 3
    assert len({tuple(g.token_ids) for g in group}) > 1
    for g in group:
        assert g.cached_prompt_tokens in (0, 39)
        assert kl(score(model, group_prompt, g.token_ids, 1.0), g.logprobs) <= 1e-6


def test_compiled_programs_are_bounded(engine) -> None:
    """Independent of test order: generate first, then count (the engine fixture is shared)."""
    rng = np.random.default_rng(5)
    engine.generate([_req(_prompt(rng, int(n)), max_tokens=int(m)) for n, m in rng.integers(2, 60, (6, 2))])
    after_first = engine.compiled_programs()
    assert 0 < after_first <= engine.config.program_bound()
    engine.generate([_req(_prompt(rng, int(n)), max_tokens=int(m)) for n, m in rng.integers(2, 60, (6, 2))])
    assert engine.compiled_programs() <= engine.config.program_bound()


def test_bad_requests_are_refused_with_the_reason(engine) -> None:
    cases = [
        ([], "empty"),
        (list(range(engine.max_model_len)), "max_model_len"),
        ([1, engine.vocab_size], "vocabulary"),
        ([-1, 2], "vocabulary"),
    ]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.submit(_req(prompt))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.submit(_req([1, 2], stop_token_ids=(engine.vocab_size + 5,)))


def test_background_thread_abort_and_stop(engine) -> None:
    engine.start()
    try:
        before = engine.stats.generated_tokens
        long = _req([1, 2, 3], max_tokens=100, temperature=0.0)
        future = engine.submit(long)
        deadline = time.monotonic() + 60
        while engine.stats.generated_tokens == before and time.monotonic() < deadline:
            time.sleep(0.005)
        engine.abort(long.request_id)
        assert engine.submit(_req([4, 5, 6], max_tokens=3)).result(60).finish_reason == "length"
        out = future.result(60)
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 100
    finally:
        engine.stop()
    assert not engine.running


def _penalised_reference(model, prompt: list[int], completion: list[int], p: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Full-forward logits of every completion position with vLLM's penalties applied in numpy
    (counts of the completion so far; repetition over prompt + completion so far): returns the
    penalised logits [n, V] and the log-probs of ``completion`` under ``penalised / T``."""
    seq = np.asarray(prompt + completion)
    hidden, _ = model(jnp.asarray(seq[None]), jnp.arange(len(seq))[None])
    logits = np.asarray(model.logits(hidden), np.float64)[0, len(prompt) - 1 : -1]
    counts = np.zeros(logits.shape[-1])
    in_prompt = np.zeros(logits.shape[-1], bool)
    in_prompt[prompt] = True
    temp = p.temperature if not p.greedy else 1.0
    out, logp = [], []
    for t, tok in enumerate(completion):
        x = logits[t].copy()
        seen = in_prompt | (counts > 0)
        x[seen] = np.where(x[seen] > 0, x[seen] / p.repetition_penalty, x[seen] * p.repetition_penalty)
        x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        z = x / temp
        logp.append(z[tok] - z.max() - np.log(np.exp(z - z.max()).sum()))
        out.append(x)
        counts[tok] += 1
    return np.asarray(out), np.asarray(logp)


def test_penalties_match_numpy_reference(engine, model, score) -> None:
    """Penalised requests (greedy and sampled, beside unpenalised ones in the same batches, with
    prefill chunks, multi-step decode calls, a row copy and a warm-row takeover) against vLLM's
    penalties in numpy on the full forward: greedy tokens are the penalised argmax, and every
    reported log-prob is that of the penalised, temperature-scaled distribution."""
    rng = np.random.default_rng(7)
    shared = _prompt(rng, 40)
    settings = [
        ({"temperature": 0.0, "repetition_penalty": 1.8, "frequency_penalty": 0.7}, shared),
        ({"temperature": 0.8, "presence_penalty": 1.5, "frequency_penalty": -0.5}, shared),  # row copy
        ({"temperature": 1.0}, _prompt(rng, 20)),  # unpenalised, same batches
        ({"temperature": 0.0, "repetition_penalty": 0.6, "presence_penalty": -2.0}, _prompt(rng, 33)),
        ({"temperature": 1.2, "repetition_penalty": 1.3, "presence_penalty": 2.0}, _prompt(rng, 9)),
    ]
    reqs = [_req(prompt, max_tokens=20, seed=i, **s) for i, (s, prompt) in enumerate(settings)]
    outs = engine.generate(reqs)
    # The same prompts again: rows are taken over warm (their counts must start over).
    again = engine.generate([_req(r.prompt, max_tokens=20, seed=i, **s) for i, ((s, _), r) in enumerate(zip(settings, reqs))])
    for r, o, o2 in zip(reqs, outs, again):
        assert o.token_ids == o2.token_ids
        np.testing.assert_allclose(o.logprobs, o2.logprobs, atol=1e-5)
        penalised, logp = _penalised_reference(model, r.prompt, o.token_ids, r.params)
        np.testing.assert_allclose(o.logprobs, logp, atol=1e-4)
        if r.params.greedy:
            np.testing.assert_array_equal(penalised.argmax(-1), o.token_ids)
        if not r.params.penalized:  # untouched by its penalised neighbours: the trainer's log-probs
            np.testing.assert_allclose(o.logprobs, score(model, r.prompt, o.token_ids, r.params.temperature), atol=1e-5)
    # The penalties did change the greedy completion.
    plain = engine.generate([_req(reqs[0].prompt, max_tokens=20, temperature=0.0)])[0]
    assert plain.token_ids != outs[0].token_ids
