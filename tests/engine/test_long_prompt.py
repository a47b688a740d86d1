"""A 32k-token prompt through the engine (chunked prefill bounded by max_batched_tokens, the KV
cache read in place at that length): the sampled tokens' log-probs equal one full forward of
prompt + completion; the KV cache is accounted per sequence; a request past max_model_len is
refused with one line."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.tiny import qwen3_config, save_random_checkpoint

VOCAB = 272  # as the other engine tests' model: the byte tokenizer's 265 tokens and spare rows
PROMPT = 32768
MAX_LEN = PROMPT + 256


@pytest.mark.slow
def test_a_32k_token_prompt_is_served_exactly(tmp_path, make_config, kl) -> None:
    # One layer, two query heads over one KV head: the length is under test, not the width.
    cfg = qwen3_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=16, max_position_embeddings=MAX_LEN)  # fmt: skip
    save_random_checkpoint(tmp_path, cfg, seed=0, embed_scale=3.0)
    config = make_config(max_model_len=MAX_LEN, max_seqs=2, max_batched_tokens=2048, prefill_len_buckets=[2048],
                         prefill_batch_buckets=[1], decode_batch_buckets=[2])  # fmt: skip
    engine = Engine.from_pretrained(tmp_path, config)
    try:
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, 265, PROMPT).tolist()
        (out,) = engine.generate([Request(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=3))])
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        # KV cache accounting: 1 layer x 1 KV head x 33,024 positions x 16 x (k, v) x 4 bytes a row.
        m = engine.metrics()
        assert m.kv_bytes_per_sequence == 1 * 1 * MAX_LEN * 16 * 2 * 4 and m.kv_cache_bytes == 2 * m.kv_bytes_per_sequence
        assert m.kv_tokens_in_use == 0 and m.prompt_tokens == PROMPT
        with pytest.raises(ValueError, match=f"prompt has {MAX_LEN} tokens, max_model_len is {MAX_LEN}"):
            engine.generate([Request(rng.integers(0, 265, MAX_LEN).tolist(), SamplingParams(max_tokens=1))])
    finally:
        engine.stop()
    # The trainer's view: one causal forward over all 32,776 tokens, then log-probs at T = 1.
    import jax
    import jax.numpy as jnp

    from jaxrl.trainer.logprobs import token_logprobs

    model = load_decoder(tmp_path)
    seq = np.asarray(prompt + list(out.token_ids), np.int32)
    hidden, _ = jax.jit(lambda t: model(t[None], jnp.arange(t.shape[0])[None]))(seq)
    logp, _ = token_logprobs(hidden[0, :-1], model.lm_head_weight(), jnp.asarray(seq[1:]), jnp.ones(len(seq) - 1))
    want = np.asarray(logp)[PROMPT - 1 :]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=1e-5, atol=1e-5)
    assert kl(want, out.logprobs) < 1e-8
