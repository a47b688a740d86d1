"""Token sampling on device, and the log-prob reported with every sampled token.

What the engine reports must be what the trainer recomputes (DESIGN contract 3), so one rule
holds for every token:

- logits are ``hidden @ lm_head`` in float32 (``Decoder.logits_f32``: the same math as
  ``jaxrl.trainer.logprobs.token_logprobs``, which this package may not import);
- the reported log-prob is ``log_softmax(logits / temperature)[token]`` in float32, the
  temperature-scaled distribution *before* top-k / top-p filtering. The trainer scores tokens
  with exactly that formula, so on the engine's own samples the trainer/sampler mismatch is
  only the (fp32 rounding-level) difference between a cached and a full forward. Filtering is a
  property of the sampler, not of the policy the trainer optimises; reporting the filtered
  (renormalised) distribution instead would make every filtered token look off-policy. vLLM's
  ``processed_logprobs`` mode reports the filtered distribution; use top_k / top_p = off for RL;
- a temperature below ``GREEDY_BELOW`` (0 included; ``jaxrl.sampling_contract``, the one rule of
  config, API, engine and samples) means greedy (argmax of the logits); its log-prob is reported
  at temperature 1.0, i.e. ``log_softmax(logits)[argmax]``. A split that trains refuses such
  temperatures at config time: greedy tokens have no log-prob at their own temperature;
- penalties (vLLM's ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, in
  vLLM's order and with its semantics, ``apply_penalties``) change the distribution itself, so
  they come first: ``logits`` above are then the *penalised* logits, greedy takes their argmax,
  and the reported log-prob is ``log_softmax(penalised / temperature)[token]``, the distribution
  the token was drawn from (vLLM's ``processed_logprobs`` also reports post-penalty values). The
  trainer's ``logits / temperature`` does not know the penalties: penalised samples are
  off-policy by exactly the penalty, and the importance ratio sees it. A request with neutral
  penalties (0, 0, 1) is bit-identical to one without.

Random draws invert the cumulative distribution of the temperature-scaled (and, if asked,
filtered) probabilities at one uniform number drawn with a key derived from (request seed,
position of the drawn token in the whole sequence): a seeded request gives the same tokens
whatever else shares its batch and however decode steps are grouped, and the turns of a
multi-turn conversation that reuse one seed (as verifiers' clients do: one sampling config per
rollout) still draw independently, because each turn's tokens sit at new positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.sampling_contract import GREEDY_BELOW, check_temperature, is_greedy

_F32_MAX = float(np.finfo(np.float32).max)
_I32_MAX = 2**31 - 1
_PENALISED_MAX = _F32_MAX * GREEDY_BELOW / 4  # / temperature (>= GREEDY_BELOW), minus another: finite


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (host side)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # [-2, 2]; subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2]; subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 0; divides positive (multiplies negative) logits of every
    # token in the prompt or the generated tokens
    top_logprobs: int = 0  # most likely tokens whose log-probs are returned with each token (0: none)

    def __post_init__(self) -> None:
        # Device arrays are float32 / int32: a value that does not fit must fail here, in the
        # caller's thread, never on the engine thread.
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        check_temperature(self.temperature)
        if not (0 < self.top_p <= 1 and np.float32(self.top_p) > 0):
            raise ValueError(f"top_p must be in (0, 1] and positive in float32, got {self.top_p}")
        if not -1 <= self.top_k <= _I32_MAX:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int32, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):  # vLLM's ranges
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (0 < self.repetition_penalty <= _F32_MAX and np.float32(self.repetition_penalty) > 0):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}"
            )
        if not 0 <= self.top_logprobs <= _I32_MAX:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def filtered(self) -> bool:
        """True when top-k or top-p actually restrict a random draw."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

    @property
    def penalized(self) -> bool:
        """True when a penalty changes the logits (the engine then tracks the row's tokens)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@jax.tree_util.register_dataclass
@dataclass
class SamplingBatch:
    """Device arrays of one batch's sampling settings, one entry per batch row."""

    temperature: jax.Array  # f32[B]; 0 = greedy
    top_p: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]; 0 = off
    seed: jax.Array  # u32[B, 2]: low and high 32 bits of the request seed
    draw_position: jax.Array  # i32[B]: sequence position (prompt + completion) of the token drawn next
    presence: jax.Array  # f32[B]; 0 = off
    frequency: jax.Array  # f32[B]; 0 = off
    repetition: jax.Array  # f32[B]; 1 = off
    top_logprobs: jax.Array  # i32[B]: top log-probs the row asks for (0: none)

    @classmethod
    def host(
        cls, params: list[SamplingParams], seeds: list[int], draw_position: list[int], size: int
    ) -> SamplingBatch:
        """Numpy arrays padded to ``size`` rows (padding rows are greedy and discarded)."""
        temp = np.zeros(size, np.float32)
        top_p = np.ones(size, np.float32)
        top_k = np.zeros(size, np.int32)
        seed = np.zeros((size, 2), np.uint32)
        index = np.zeros(size, np.int32)
        presence, frequency, repetition = np.zeros(size, np.float32), np.zeros(size, np.float32), np.ones(size, np.float32)
        top = np.zeros(size, np.int32)
        for i, (p, s, g) in enumerate(zip(params, seeds, draw_position)):
            temp[i] = 0.0 if p.greedy else p.temperature
            top_p[i] = p.top_p
            top_k[i] = max(p.top_k, 0)
            seed[i] = (s & 0xFFFFFFFF, (s >> 32) & 0xFFFFFFFF)
            index[i] = g
            presence[i], frequency[i], repetition[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
            top[i] = min(p.top_logprobs, _I32_MAX)
        return cls(temp, top_p, top_k, seed, index, presence, frequency, repetition, top)


@jax.tree_util.register_dataclass
@dataclass
class TokenCounts:
    """What the penalties look at, per KV cache row (device-resident, like the cache): how often
    each vocabulary entry was generated so far, and which entries the prompt holds. Only rows of
    penalised requests are kept exact (reset at admission, counted as decode feeds each sampled
    token back); other rows hold stale values that neutral penalties multiply by nothing."""

    output: jax.Array  # i32[R, V]
    prompt: jax.Array  # bool[R, V]

    def count(self, rows: jax.Array, tokens: jax.Array) -> TokenCounts:
        """Add one generated ``tokens[i]`` to row ``rows[i]`` (rows out of range: dropped)."""
        return TokenCounts(self.output.at[rows, tokens].add(1, mode="drop"), self.prompt)

    def reset(self, row: jax.Array, prompt_mask: jax.Array) -> TokenCounts:
        """Start row ``row`` over for a new request: nothing generated, ``prompt_mask`` (bool[V])."""
        return TokenCounts(self.output.at[row].set(0), self.prompt.at[row].set(prompt_mask))


def apply_penalties(logits: jax.Array, output: jax.Array, prompt: jax.Array, batch: SamplingBatch) -> jax.Array:
    """vLLM's penalties on f32 [B, V] logits, in its order: repetition (on tokens of the prompt
    or the output: positive logits divided by it, the others multiplied), then frequency (times
    each token's output count), then presence (once per token in the output). ``output`` i32
    [B, V] counts, ``prompt`` bool [B, V]. Neutral values (1, 0, 0) leave a row bit-identical."""
    generated = output > 0
    rep = jnp.where(prompt | generated, batch.repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - batch.frequency[:, None] * output.astype(jnp.float32)
    logits = logits - batch.presence[:, None] * generated.astype(jnp.float32)
    # An extreme repetition penalty (vLLM allows any > 0) overflows float32; clip so that
    # ``logits / temperature`` stays finite (temperatures >= GREEDY_BELOW) and no row turns NaN.
    return jnp.clip(logits, -_PENALISED_MAX, _PENALISED_MAX)


def penalize(logits: jax.Array, counts: TokenCounts, rows: jax.Array, batch: SamplingBatch) -> jax.Array:
    """``apply_penalties`` with the counts of KV cache rows ``rows`` (padding rows, out of range,
    read a clamped row and have neutral penalties); skipped (``lax.cond``) when no row penalises."""
    on = (batch.presence != 0) | (batch.frequency != 0) | (batch.repetition != 1)

    def apply() -> jax.Array:
        output = jnp.take(counts.output, rows, axis=0, mode="clip")
        prompt = jnp.take(counts.prompt, rows, axis=0, mode="clip")
        return apply_penalties(logits, output, prompt, batch)

    return jax.lax.cond(jnp.any(on), apply, lambda: logits)


def _keys(seed: jax.Array, draw_position: jax.Array) -> jax.Array:
    def one(s: jax.Array, g: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(s[0]), s[1])
        return jax.random.fold_in(key, g)

    return jax.vmap(one)(seed, draw_position)


def _keep_mask(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Tokens kept by top-k then top-p (vLLM's order), per row. Ties at the cut are kept."""
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)
    ranks = jnp.arange(vocab)[None, :]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    in_k = ranks < k
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    n_keep = jnp.sum(in_k & (mass_before < top_p[:, None]), axis=-1)  # >= 1: rank 0 always kept
    threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
    return scaled >= threshold


CDF_BLOCK = 256


def _inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, the first index where ``cumsum(probs) >= u * sum(probs)``; never a zero-prob entry.

    Two levels (block sums, then one block) because a full-length cumsum is slow on CPU.
    """
    b, v = probs.shape
    nb = -(-v // CDF_BLOCK)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * CDF_BLOCK - v))).reshape(b, nb, CDF_BLOCK)
    block_sums = jnp.sum(blocks, axis=-1)
    block_cdf = jnp.cumsum(block_sums, axis=-1)
    target = u * block_cdf[:, -1]
    last_block = nb - 1 - jnp.argmax((block_sums > 0)[:, ::-1], axis=-1)
    blk = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), last_block)
    inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]
    rest = target - (
        jnp.take_along_axis(block_cdf, blk[:, None], axis=-1)[:, 0]
        - jnp.take_along_axis(block_sums, blk[:, None], axis=-1)[:, 0]
    )
    last_in = CDF_BLOCK - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    idx = jnp.minimum(jnp.sum(jnp.cumsum(inner, axis=-1) < rest[:, None], axis=-1), last_in)
    return (blk * CDF_BLOCK + idx).astype(jnp.int32)


ARGMAX_BLOCK = 256


def argmax_first(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first index of each row's maximum) of f32 [B, V], in two
    levels: block maxima, then one block. ``jnp.argmax`` is a variadic (value, index) reduction
    that XLA:CPU does not vectorise: 0.48 ms at [32, 8192] on a 2-core host, this form 0.23."""
    b, v = x.shape
    nb = -(-v // ARGMAX_BLOCK)
    blocks = jnp.pad(x, ((0, 0), (0, nb * ARGMAX_BLOCK - v)), constant_values=-jnp.inf)
    blocks = blocks.reshape(b, nb, ARGMAX_BLOCK)
    blk = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)  # first block holding the maximum
    inner = jnp.take_along_axis(blocks, blk[:, None, None], axis=1)[:, 0]
    return (blk * ARGMAX_BLOCK + jnp.argmax(inner, axis=-1)).astype(jnp.int32)


def sample(logits: jax.Array, batch: SamplingBatch) -> tuple[jax.Array, jax.Array]:
    """``sample_with_top`` without the top log-probs: (tokens i32[B], logprobs f32[B])."""
    tokens, logprobs, _, _ = sample_with_top(logits, batch, 0)
    return tokens, logprobs


def sample_with_top(
    logits: jax.Array, batch: SamplingBatch, top: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Draw one token per row of ``logits`` (f32 [B, V], penalised already when the request asks:
    ``penalize``); returns (tokens i32[B], logprobs f32[B], top_ids i32[B, top], top_logprobs
    f32[B, top]): the ``top`` (static) most likely tokens of the same distribution the sampled
    token's log-prob is read from, by the same arithmetic (a sampled token among them has its own
    log-prob there, bit for bit), in descending order (``lax.top_k``: ties by lower id). They are
    computed only when some row asks (``batch.top_logprobs``; zeros otherwise), so batches that
    do not ask pay nothing but the small output.

    A draw is one uniform number per row mapped through the cumulative distribution (inverse
    CDF): exact sampling from ``softmax(logits / T)`` (restricted to the kept tokens when
    filtering), with one random number per token instead of one per vocabulary entry.
    One program serves every batch: the draw runs only when some row samples, and the top-k /
    top-p sort only when some row filters (``lax.cond``: the branch not taken costs nothing), so
    greedy and unfiltered batches skip that work without a program of their own.
    """
    greedy = batch.temperature <= 0
    temperature = jnp.where(greedy, 1.0, batch.temperature)
    scaled = logits / temperature[:, None]
    # log_softmax's own arithmetic ((x - max) - log(sum(exp(x - max)))), without writing out
    # [B, V] log-probs that only the draw needs.
    row_max = jnp.max(scaled, axis=-1, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(scaled - row_max), axis=-1, keepdims=True))
    filtering = ~greedy & ((batch.top_k > 0) | (batch.top_p < 1.0))

    def draw() -> jax.Array:
        probs = jnp.exp((scaled - row_max) - log_total)
        probs = jax.lax.cond(
            jnp.any(filtering),
            lambda: jnp.where(_keep_mask(scaled, batch.top_k, batch.top_p), probs, 0.0),
            lambda: probs,
        )
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32, minval=jnp.finfo(jnp.float32).tiny))(
            _keys(batch.seed, batch.draw_position)
        )
        return _inverse_cdf(probs, u)

    zeros = lambda: jnp.zeros(greedy.shape, jnp.int32)
    drawn = jax.lax.cond(jnp.all(greedy), zeros, draw)
    best = jax.lax.cond(jnp.any(greedy), lambda: argmax_first(logits), zeros)
    tokens = jnp.where(greedy, best, drawn).astype(jnp.int32)
    picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)
    logprobs = ((picked - row_max) - log_total)[:, 0]
    top = min(top, scaled.shape[-1])

    def top_k() -> tuple[jax.Array, jax.Array]:
        values, ids = jax.lax.top_k(scaled, top)
        return ids.astype(jnp.int32), (values - row_max) - log_total

    def no_top() -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((*greedy.shape, top), jnp.int32), jnp.zeros((*greedy.shape, top), jnp.float32)

    top_ids, top_logprobs = jax.lax.cond(jnp.any(batch.top_logprobs > 0), top_k, no_top) if top else no_top()
    return tokens, logprobs, top_ids, top_logprobs
