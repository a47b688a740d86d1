"""Off-policy objectives (GSPO, PPO clip-higher, CISPO, TIS, MIS/IcePop, staleness) against a
NumPy reference written per sample with loops, on a hand-made packed batch of several segments."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

from jaxrl.trainer.loss import (
    LossBatch,
    LossConfig,
    RLTokenLoss,
    combine,
    loss_counts,
    loss_sums,
    normalized_loss,
)

# Two packed rows of 8 tokens. Row 0: sample 1 (4 tokens), sample 2 (3 tokens), 1 padding token.
# Row 1: sample 1 (5 tokens), sample 2 (3 tokens). Each sample's first token is never trained.
SEG = np.array([[1, 1, 1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 2]])
MASK = np.array([[0, 1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 0, 1, 1]], bool)
ADV_PER_SEG = {(0, 1): 1.0, (0, 2): -0.5, (1, 1): -1.5, (1, 2): 2.0}
# rl_w: one half-weighted token, one non-RL token (e.g. a tool output) inside sample (1, 1).
RL_W = np.array([[1, 1, 1, 0.5, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1, 1]], np.float32)
# Sampling versions: the engine swapped from version 1 to 2 inside sample (0, 1); trainer at 3.
VERSIONS = np.array([[1, 1, 2, 2, 3, 3, 3, 0], [0, 0, 0, 0, 0, 2, 2, 2]], np.int32)
TRAINER_VERSION = 3


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    logq = np.log(rng.uniform(0.05, 0.95, size=SEG.shape))
    logp = logq + rng.normal(0.0, 0.35, size=SEG.shape)  # ratios from ~0.4 to ~2.5: clips fire
    logp = np.minimum(logp, -1e-3)
    logp[0, 7] = np.nan  # padding holds garbage that must not leak
    adv = np.zeros(SEG.shape)
    for (r, s), a in ADV_PER_SEG.items():
        adv[r][SEG[r] == s] = a
    return logp, logq, adv


def _run(cfg: LossConfig, logp: np.ndarray, logq: np.ndarray, adv: np.ndarray, **kw):
    zeros = jnp.zeros(SEG.shape, jnp.float32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    kw = {"segment_ids": jnp.asarray(SEG), "policy_version": jnp.asarray(VERSIONS),
          "trainer_version": TRAINER_VERSION} | kw  # fmt: skip
    counts = loss_counts(f32(RL_W), zeros, jnp.asarray(MASK), cfg=cfg, **{k: kw[k] for k in kw if k != "positions"})

    def loss(lp):
        sums = loss_sums(lp, f32(logq), f32(adv), f32(RL_W), zeros, jnp.asarray(MASK), cfg, **kw)
        return normalized_loss(sums, counts), sums

    (value, sums), grad = jax.value_and_grad(loss, has_aux=True)(f32(logp))
    return float(value), sums, np.asarray(grad), counts


# --- the NumPy reference --------------------------------------------------------------------


def _segments():
    for r in range(SEG.shape[0]):
        for s in sorted(set(SEG[r]) - {0}):
            yield r, np.flatnonzero(SEG[r] == s)


def _stale_w(cfg: LossConfig) -> np.ndarray:
    w = RL_W.astype(np.float64).copy()
    if cfg.staleness is not None:
        lag = TRAINER_VERSION - VERSIONS
        over = np.maximum(lag - cfg.staleness.max_lag, 0)
        w *= (over == 0) if cfg.staleness.mode == "drop" else cfg.staleness.decay**over
    return w


def reference(cfg: LossConfig, logp, logq, adv) -> tuple[float, np.ndarray]:
    """(normalised RL loss, d loss / d logp where the gradient is analytic: stop-gradient weights)."""
    w = _stale_w(cfg)
    on = MASK & (w != 0)
    total, grad, n_seqs = 0.0, np.zeros(SEG.shape), 0
    for r, idx in _segments():
        t = [i for i in idx if on[r, i]]
        if not t:
            continue
        n_seqs += 1
        lr = np.array([logp[r, i] - logq[r, i] for i in t])
        a = adv[r, t[0]]
        seq_lr_mean, seq_lr_sum = lr.mean(), lr.sum()
        terms = []
        for k, i in enumerate(t):
            ratio = math.exp(lr[k])
            g_pg = None  # analytic d pg / d logp where the term is a stop-gradient weight
            if cfg.type == "gspo":
                lo, hi = cfg.clip_bounds()
                s = math.exp(seq_lr_mean)
                pg = min(s * a, min(max(s, 1 - lo), 1 + hi) * a)
            elif cfg.type == "ppo":
                lo, hi = cfg.clip_bounds()
                pg = min(ratio * a, min(max(ratio, 1 - lo), 1 + hi) * a)
            elif cfg.type == "cispo":
                lo, hi = cfg.clip_bounds()
                pg = g_pg = min(max(ratio, 1 - lo), 1 + hi) * a
            elif cfg.type == "tis":
                iw = ratio if cfg.tis_level == "token" else math.exp(seq_lr_sum)
                pg = g_pg = min(iw, cfg.tis_cap) * a
            else:  # dppo
                dp = math.exp(logp[r, i]) - math.exp(logq[r, i])
                masked = dp > cfg.mask_high if a > 0 else dp < -cfg.mask_low
                pg = 0.0 if masked else a * ratio
            if cfg.type in ("dppo", "ppo", "gspo") and cfg.clip_ratio_c and a < 0:
                pg = max(pg, cfg.clip_ratio_c * a)  # dual clip: the term's floor for A < 0
            if cfg.mis is not None:
                test = {"token": lr[k], "sequence": seq_lr_sum, "geometric": seq_lr_mean}[cfg.mis.level]
                if not math.log(cfg.mis.low) <= test <= math.log(cfg.mis.high):
                    pg = g_pg = 0.0
            terms.append(w[r, i] * (-cfg.adv_tau * pg + cfg.kl_tau * lr[k] ** 2))
            if g_pg is not None:
                grad[r, i] = w[r, i] * (-cfg.adv_tau * g_pg + 2 * cfg.kl_tau * lr[k])
        if cfg.normalization() == "sequence":
            total += sum(terms) / len(t)
            grad[r, t] /= len(t)
        else:
            total += sum(terms)
    den = n_seqs if cfg.normalization() == "sequence" else on.sum()
    return total / den, grad / den


def _fd_grad(cfg, logp, logq, adv, eps=1e-6) -> np.ndarray:
    """Central finite differences of the float64 reference loss."""
    g = np.zeros(SEG.shape)
    for r, i in zip(*np.nonzero(MASK), strict=True):
        up, down = logp.copy(), logp.copy()
        up[r, i] += eps
        down[r, i] -= eps
        g[r, i] = (reference(cfg, up, logq, adv)[0] - reference(cfg, down, logq, adv)[0]) / (2 * eps)
    return g


CASES = {
    "dppo": LossConfig(),
    "ppo_clip_higher": LossConfig(type="ppo", clip_low=0.2, clip_high=0.28),
    "gspo": LossConfig(type="gspo", clip_low=0.05, clip_high=0.08),
    "gspo_defaults": LossConfig(type="gspo"),
    # c low enough to fire on this batch (one A < 0 token at r = 1.15); tests/trainer/test_dual_clip.py has e^6
    "ppo_dual_clip": LossConfig(type="ppo", clip_ratio_c=1.1),
    "dppo_dual_clip": LossConfig(clip_ratio_c=1.1),
    "cispo": LossConfig(type="cispo", clip_low=0.3, clip_high=0.2),
    "tis_token": LossConfig(type="tis", tis_level="token", tis_cap=1.3),
    "tis_sequence": LossConfig(type="tis", tis_level="sequence", tis_cap=1.2),
    "icepop_token": LossConfig(type="ppo", mis={"level": "token", "low": 0.7, "high": 1.4}),
    "mis_sequence": LossConfig(mis={"level": "sequence", "low": 0.7, "high": 1.8}),
    "mis_geometric": LossConfig(type="gspo", mis={"level": "geometric", "low": 0.9, "high": 1.1}),
    "stale_drop": LossConfig(staleness={"max_lag": 2, "mode": "drop"}),
    "stale_downweight": LossConfig(type="cispo", staleness={"max_lag": 1, "mode": "downweight", "decay": 0.5}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_loss_matches_numpy_reference(name):
    cfg = CASES[name]
    logp, logq, adv = _batch()
    value, _, grad, _ = _run(cfg, logp, logq, adv)
    want, want_grad = reference(cfg, logp, logq, adv)
    np.testing.assert_allclose(value, want, rtol=2e-5, atol=1e-7)
    assert np.isfinite(grad).all()
    if cfg.type in ("cispo", "tis"):  # stop-gradient weights: the analytic gradient
        np.testing.assert_allclose(grad, want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "name", ["dppo", "ppo_clip_higher", "gspo", "mis_geometric", "stale_drop", "ppo_dual_clip", "dppo_dual_clip"]
)
def test_gradient_matches_finite_differences(name):
    cfg = CASES[name]
    logp, logq, adv = _batch()
    grad = _run(cfg, logp, logq, adv)[2]
    np.testing.assert_allclose(grad, _fd_grad(cfg, logp, logq, adv), rtol=1e-3, atol=1e-6)


def test_the_cases_exercise_their_clips_and_masks():
    """Each threshold above fires on this batch (so a wrong comparison would show)."""
    logp, logq, adv = _batch()
    m = lambda name: combine(_run(CASES[name], logp, logq, adv)[1])[1]
    assert 0 < float(m("ppo_clip_higher")["masked_high_frac"]) + float(m("ppo_clip_higher")["masked_low_frac"]) < 1
    assert 0 < float(m("cispo")["clipped_frac"]) < 1
    assert 0 < float(m("tis_token")["clipped_frac"]) < 1
    assert 0 < float(m("icepop_token")["mis_rejected_frac"]) < 1
    assert 0 < float(m("mis_sequence")["mis_rejected_frac"]) < 1
    for name in ("ppo_dual_clip", "dppo_dual_clip"):
        assert 0 < float(m(name)["dual_clipped_frac"]) < 1, name
    assert float(m("ppo_clip_higher")["dual_clipped_frac"]) == 0  # c = 3 never fires at ratios < 3
    gspo = m("gspo")
    assert 0 < float(gspo["masked_high_frac"]) + float(gspo["masked_low_frac"]) < 1


def test_gspo_normalises_per_sequence():
    """Under GSPO the RL denominator is the number of samples (4), not tokens (10)."""
    logp, logq, adv = _batch()
    _, sums, _, counts = _run(CASES["gspo"], logp, logq, adv)
    assert (float(counts["rl"]), float(counts["rl_norm"])) == (10.0, 4.0)
    assert (float(sums["rl_count"]), float(sums["rl_norm_count"])) == (10.0, 4.0)


def test_ratio_and_staleness_metrics_by_hand():
    logp, logq, adv = _batch()
    cfg = CASES["stale_drop"]
    _, sums, _, counts = _run(cfg, logp, logq, adv)
    m = combine(sums)[1]
    raw_on = MASK & (RL_W != 0)  # 10 RL tokens before the staleness rule
    lag = (TRAINER_VERSION - VERSIONS)[raw_on]
    np.testing.assert_allclose(
        [m[f"stale_lag{b}_frac"] for b in ("0", "1", "2", "3p")],
        [np.mean(lag == 0), np.mean(lag == 1), np.mean(lag == 2), np.mean(lag >= 3)],
    )
    on = raw_on & (TRAINER_VERSION - VERSIONS <= 2)  # lag 3 tokens dropped
    np.testing.assert_allclose(m["stale_dropped_frac"], 1 - on.sum() / raw_on.sum())
    assert float(counts["rl"]) == on.sum() == float(m["rl_tokens"])
    ratio = np.exp(logp - logq)[on]
    np.testing.assert_allclose([m["ratio_mean"], m["ratio_max"], m["ratio_min"]],
                               [ratio.mean(), ratio.max(), ratio.min()], rtol=1e-5)  # fmt: skip
    seq = [np.exp(np.mean((logp - logq)[r, [i for i in idx if on[r, i]]])) for r, idx in _segments() if on[r, idx].any()]
    np.testing.assert_allclose([m["seq_ratio_mean"], m["seq_ratio_max"], m["seq_ratio_min"], m["rl_seqs"]],
                               [np.mean(seq), np.max(seq), np.min(seq), len(seq)], rtol=1e-5)  # fmt: skip


def test_micro_batches_with_global_counts_equal_the_full_batch_under_gspo():
    """Row 0 and row 1 as two micro-batches, each divided by the step's global sample count."""
    logp, logq, adv = _batch()
    cfg = CASES["gspo"]
    full_value, _, full_grad, counts = _run(cfg, logp, logq, adv)
    zeros = jnp.zeros((1, SEG.shape[1]), jnp.float32)

    def part(r):
        def f(lp):
            sums = loss_sums(lp, jnp.asarray(logq[r : r + 1], jnp.float32), jnp.asarray(adv[r : r + 1], jnp.float32),
                             jnp.asarray(RL_W[r : r + 1]), zeros, jnp.asarray(MASK[r : r + 1]), cfg,
                             segment_ids=jnp.asarray(SEG[r : r + 1]))  # fmt: skip
            return normalized_loss(sums, counts)

        return jax.value_and_grad(f)(jnp.asarray(logp[r : r + 1], jnp.float32))

    (va, ga), (vb, gb) = part(0), part(1)
    np.testing.assert_allclose(float(va + vb), full_value, rtol=1e-6)
    np.testing.assert_allclose(np.concatenate([ga, gb]), full_grad, rtol=1e-6, atol=1e-9)


def test_dppo_without_segments_is_unchanged():
    """The default loss does not depend on segments or versions (contract 3's numbers)."""
    logp, logq, adv = _batch()
    with_view = _run(LossConfig(), logp, logq, adv)[0]
    without = _run(LossConfig(), logp, logq, adv, segment_ids=None, policy_version=None, trainer_version=None)[0]
    assert with_view == without


# --- the custom hook sees the whole view ------------------------------------------------------


def sequence_reinforce(batch: LossBatch, cfg: LossConfig) -> RLTokenLoss:
    """A user's loss written against the view: every RL token of a sample carries
    ``-A * mean(logp over the sample's RL tokens)`` (needs segment ids, which the old hook lacked)."""
    from jaxrl.trainer.loss import segment_mean

    none = jnp.zeros(batch.logp.shape, bool)
    per_sample = segment_mean(batch.logp, batch.rl_on, batch.segment_ids)
    return RLTokenLoss(-batch.rl_w * batch.advantages * per_sample, none, none)


def test_custom_loss_receives_the_view():
    cfg = LossConfig(custom=f"{__name__}:sequence_reinforce")
    logp, logq, adv = _batch()
    value = _run(cfg, logp, logq, adv)[0]
    on = MASK & (RL_W != 0)
    want = 0.0
    for r, idx in _segments():
        t = [i for i in idx if on[r, i]]
        want += sum(-RL_W[r, i] * adv[r, i] * np.mean(logp[r, t]) for i in t)
    np.testing.assert_allclose(value, want / on.sum(), rtol=1e-5)


# --- config boundaries --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"type": "gspo", "mask_high": 0.3}, "trainer.loss.mask_high applies to type dppo, not 'gspo'"),
        ({"clip_high": 0.3}, "trainer.loss.clip_high applies to type cispo / gspo / ppo, not 'dppo'"),
        ({"type": "ppo", "tis_cap": 3.0}, "tis_cap applies to type tis"),
        ({"type": "tis", "tis_cap": 0.5}, "tis_cap"),
        ({"type": "ppo", "clip_low": 1.5}, "clip_low"),
        ({"mis": {"low": 1.2}}, "low"),
        ({"mis": {"high": 0.9}}, "high"),
        ({"mis": {"level": "row"}}, "level"),
        ({"staleness": {"max_lag": -1}}, "max_lag"),
        ({"staleness": {"mode": "downweight", "decay": 1.0}}, "decay"),
        ({"type": "sapo"}, "type"),
        ({"custom": f"{__name__}:sequence_reinforce", "type": "gspo"}, "custom replaces the built-in"),
        ({"custom": f"{__name__}:_batch"}, "takes 0 required arguments"),
    ],
)
def test_bad_loss_config_is_one_clear_error(kwargs, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        LossConfig(**kwargs)


def test_staleness_needs_versions():
    logp, logq, adv = _batch()
    with pytest.raises(ValueError, match="policy_version"):
        _run(CASES["stale_drop"], logp, logq, adv, policy_version=None)
