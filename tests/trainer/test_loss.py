"""Loss contract 3 on tiny arrays with hand-computed expectations."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

from jaxrl.trainer.loss import (
    LossConfig,
    RLTokenLoss,
    add_sums,
    combine,
    loss_counts,
    loss_sums,
    metrics,
    normalized_loss,
)

CFG = LossConfig()
L = math.log

# One sample of 6 tokens. Position 0 is the sample's first token (never trained), position 5 is
# padding holding garbage that must not leak. Positions 1-4 exercise the four RL cases:
#   1: A=+1, p .5 vs q .4  -> dp=+0.1, kept
#   2: A=+2, p .7 vs q .4  -> dp=+0.3 > 0.2, masked high
#   3: A=-1, p .1 vs q .4  -> dp=-0.3 < -0.2, masked low
#   4: A=-.5, p .3 vs q .4 -> dp=-0.1, kept, rl_w = 0.5
LOGP = [L(0.9), L(0.5), L(0.7), L(0.1), L(0.3), float("nan")]
LOGQ = [0.0, L(0.4), L(0.4), L(0.4), L(0.4), 1000.0]
ADV = [1.0, 1.0, 2.0, -1.0, -0.5, float("nan")]
RL_W = [1.0, 1.0, 1.0, 1.0, 0.5, 1.0]
MASK = [False, True, True, True, True, False]

# rl_token_loss = rl_w * (-keep * A * ratio + 1e-3 * log_ratio**2), by hand:
EXPECTED_RL = [
    -1.25 + 1e-3 * L(1.25) ** 2,  # -1.2499502
    1e-3 * L(1.75) ** 2,  # 3.1317e-4 (pg dropped)
    1e-3 * L(0.25) ** 2,  # 1.9218e-3 (pg dropped)
    0.5 * (0.5 * 0.75 + 1e-3 * L(0.75) ** 2),  # 0.18754138
]


def _arrays(*rows, dtype=jnp.float32):
    return [jnp.asarray([r], dtype) for r in rows]


def _rl_batch():
    logp, logq, adv, rl_w = _arrays(LOGP, LOGQ, ADV, RL_W)
    return logp, logq, adv, rl_w, jnp.zeros_like(rl_w), jnp.asarray([MASK])


def test_rl_component_by_hand():
    logp, logq, adv, rl_w, ce_w, mask = _rl_batch()
    sums = loss_sums(logp, logq, adv, rl_w, ce_w, mask, CFG)
    assert float(sums["rl_count"]) == 4
    np.testing.assert_allclose(sums["rl_loss_sum"], sum(EXPECTED_RL), rtol=1e-6)
    loss, m = combine(sums)
    np.testing.assert_allclose(loss, sum(EXPECTED_RL) / 4, rtol=1e-6)
    assert (float(sums["masked_high_count"]), float(sums["masked_low_count"])) == (1, 1)
    assert (float(m["masked_high_frac"]), float(m["masked_low_frac"])) == (0.25, 0.25)
    # mismatch KL r - log r - 1 on kept tokens (r = 1.25, 0.75) and masked ones (1.75, 0.25)
    k3 = lambda r: r - L(r) - 1
    np.testing.assert_allclose(m["mismatch_kl"], (k3(1.25) + k3(0.75)) / 2, rtol=1e-5)
    np.testing.assert_allclose(m["mismatch_kl_masked"], (k3(1.75) + k3(0.25)) / 2, rtol=1e-5)
    assert float(m["ce_loss"]) == 0.0 and float(m["ce_tokens"]) == 0.0


def test_rl_gradient_by_hand_and_padding_stays_finite():
    """d loss / d logp = (-keep * A * ratio + 2e-3 * log_ratio) * rl_w / N_rl; 0 off the mask."""
    logp, logq, adv, rl_w, ce_w, mask = _rl_batch()
    grad = jax.grad(lambda lp: combine(loss_sums(lp, logq, adv, rl_w, ce_w, mask, CFG))[0])(logp)
    want = [
        0.0,
        (-1.25 + 2e-3 * L(1.25)) / 4,
        2e-3 * L(1.75) / 4,
        2e-3 * L(0.25) / 4,
        0.5 * (0.5 * 0.75 + 2e-3 * L(0.75)) / 4,
        0.0,
    ]
    np.testing.assert_allclose(grad[0], want, rtol=1e-5, atol=1e-9)


def test_mask_thresholds_come_from_config():
    """With mask_high 0.35 token 2 (dp=+0.3) keeps its pg term; with mask_low 0.35 token 3 too."""
    logp, logq, adv, rl_w, ce_w, mask = _rl_batch()
    sums = loss_sums(logp, logq, adv, rl_w, ce_w, mask, LossConfig(mask_high=0.35, mask_low=0.35))
    assert (float(sums["masked_high_count"]), float(sums["masked_low_count"])) == (0, 0)
    extra = -2.0 * 1.75 + 1.0 * 0.25  # the two pg terms now kept: -A * ratio
    np.testing.assert_allclose(sums["rl_loss_sum"], sum(EXPECTED_RL) + extra, rtol=1e-6)


def test_zero_advantage_uses_the_low_branch():
    """A == 0 is not > 0: a rise in probability is never masked, a fall beyond mask_low is."""
    logp, logq = _arrays([0.0, L(0.7), L(0.1)], [0.0, L(0.4), L(0.4)])
    adv = jnp.zeros_like(logp)
    ones = jnp.ones_like(logp)
    sums = loss_sums(logp, logq, adv, ones, 0 * ones, jnp.asarray([[False, True, True]]), CFG)
    assert (float(sums["masked_high_count"]), float(sums["masked_low_count"])) == (0, 1)


def test_ce_component_and_gradient():
    """ce_token_loss = -ce_w * logp; d loss / d logp_t = -ce_w_t / N_ce on ce-only tokens."""
    logp, ce_w = _arrays([-5.0, -2.0, -1.0, -3.0], [1.0, 0.5, 1.0, 0.0])
    mask = jnp.asarray([[False, True, True, True]])
    zeros = jnp.zeros_like(logp)
    f = lambda lp: loss_sums(lp, zeros, zeros, zeros, ce_w, mask, CFG)
    sums = f(logp)
    assert float(sums["ce_count"]) == 2  # token 0 is masked, token 3 has weight 0
    loss, m = combine(sums)
    np.testing.assert_allclose(loss, (0.5 * 2.0 + 1.0 * 1.0) / 2, rtol=1e-6)
    np.testing.assert_allclose([m["ce_nll_mean"], m["ce_nll_max"]], [1.5, 2.0], rtol=1e-6)
    grad = jax.grad(lambda lp: combine(f(lp))[0])(logp)
    np.testing.assert_allclose(grad[0], [0.0, -0.5 / 2, -1.0 / 2, 0.0], rtol=1e-6)


def test_components_are_normalised_separately():
    """An rl token and two ce tokens: loss = rl_sum / 1 + ce_sum / 2 (no dilution)."""
    logp, logq, adv, rl_w, ce_w = _arrays(
        [0.0, L(0.5), -2.0, -4.0], [0.0, L(0.4), 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0, 1, 0, 0], [0, 0, 1, 1]
    )
    mask = jnp.asarray([[False, True, True, True]])
    loss, m = combine(loss_sums(logp, logq, adv, rl_w, ce_w, mask, CFG, entropy=2.0 * jnp.ones_like(logp)))
    np.testing.assert_allclose(loss, EXPECTED_RL[0] + 3.0, rtol=1e-6)
    assert [float(m[k]) for k in ("rl_tokens", "ce_tokens", "ref_kl_tokens", "entropy")] == [1, 2, 0, 2.0]


def test_entropy_metrics_exclude_echo_tokens():
    """entropy: the rl token only (1.0); ce_entropy: the two CE (echo) tokens, mean of 3 and 5."""
    logp, logq, adv, rl_w, ce_w = _arrays(
        [0.0, L(0.5), -2.0, -4.0], [0.0, L(0.4), 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0, 1, 0, 0], [0, 0, 1, 1]
    )
    mask = jnp.asarray([[False, True, True, True]])
    entropy = jnp.asarray([[7.0, 1.0, 3.0, 5.0]])
    _, m = combine(loss_sums(logp, logq, adv, rl_w, ce_w, mask, CFG, entropy=entropy))
    assert (float(m["entropy"]), float(m["ce_entropy"])) == (1.0, 4.0)


def test_ref_kl_component_by_hand():
    """-keep * sg(logr - logp) * ratio + 1e-3 * log_ratio**2; the stop-gradient shapes the grad."""
    logp, logq, logr, w = _arrays(
        [0.0, L(0.5), L(0.1)], [0.0, L(0.4), L(0.4)], [0.0, L(0.6), L(0.6)], [1, 1, 1]
    )
    mask = jnp.asarray([[False, True, True]])
    zeros = jnp.zeros_like(logp)

    def loss(lp):
        return combine(loss_sums(lp, logq, zeros, zeros, zeros, mask, CFG, ref_kl_w=w, logr=logr))[0]

    kept = -L(1.2) * 1.25 + 1e-3 * L(1.25) ** 2  # token 1: dp = +0.1
    dropped = 1e-3 * L(0.25) ** 2  # token 2: dp = -0.3 < -0.2, keep = 0
    np.testing.assert_allclose(loss(logp), (kept + dropped) / 2, rtol=1e-6)
    grad = jax.grad(loss)(logp)
    want = [0.0, (-L(1.2) * 1.25 + 2e-3 * L(1.25)) / 2, 2e-3 * L(0.25) / 2]
    np.testing.assert_allclose(grad[0], want, rtol=1e-5)


def test_empty_components_give_zero_loss_and_zero_gradient():
    logp, logq = _arrays([float("nan"), -1.0, -80.0], [0.0, -1.0, 90.0])
    zeros = jnp.zeros_like(logp)
    mask = jnp.asarray([[False, True, True]])

    def loss(lp):
        return combine(loss_sums(lp, logq, zeros + 1.0, zeros, zeros, mask, CFG, entropy=zeros))

    value, m = loss(logp)
    grad = jax.grad(lambda lp: loss(lp)[0])(logp)
    assert float(value) == 0.0
    assert all(np.isfinite(float(v)) for v in m.values()), m
    np.testing.assert_array_equal(grad, np.zeros((1, 3)))


def _random_batch(b=4, t=6, seed=0):
    rng = np.random.default_rng(seed)
    logq = np.log(rng.uniform(0.05, 1.0, size=(b, t)))
    logp = np.log(np.clip(np.exp(logq) + rng.uniform(-0.4, 0.4, size=(b, t)), 0.01, 1.0))
    adv = np.repeat(rng.normal(size=(b, 1)), t, axis=1)
    rl_w = (rng.uniform(size=(b, t)) < 0.6).astype(np.float32)
    ce_w = (1 - rl_w) * (rng.uniform(size=(b, t)) < 0.5) * 0.3
    mask = np.ones((b, t), bool)
    mask[:, 0] = False
    mask[-1, t // 2 :] = False  # padding
    return [jnp.asarray(x, jnp.float32) for x in (logp, logq, adv, rl_w, ce_w)] + [jnp.asarray(mask)]


def test_micro_batches_with_global_counts_equal_the_full_batch():
    logp, logq, adv, rl_w, ce_w, mask = _random_batch()
    counts = loss_counts(rl_w, ce_w, mask)
    assert float(counts["rl"]) > 0 and float(counts["ce"]) > 0

    def part(sl):
        """jit(value_and_grad) of one micro-batch's normalized loss, with its sums as aux."""

        def f(lp):
            sums = loss_sums(lp, logq[sl], adv[sl], rl_w[sl], ce_w[sl], mask[sl], CFG, entropy=-lp)
            return normalized_loss(sums, counts), sums

        return jax.jit(jax.value_and_grad(f, has_aux=True))(logp[sl])

    (full_loss, full_sums), full_grad = part(slice(None))
    (loss_a, sums_a), grad_a = part(slice(0, 1))
    (loss_b, sums_b), grad_b = part(slice(1, 4))
    np.testing.assert_allclose(loss_a + loss_b, full_loss, rtol=1e-6)
    np.testing.assert_allclose(loss_a + loss_b, combine(full_sums)[0], rtol=1e-6)
    np.testing.assert_allclose(jnp.concatenate([grad_a, grad_b]), full_grad, rtol=1e-6)
    full_metrics = metrics(full_sums)
    for k, v in metrics(add_sums(sums_a, sums_b)).items():
        np.testing.assert_allclose(v, full_metrics[k], rtol=1e-6, err_msg=k)


# --- custom RL token loss ----------------------------------------------------------------------


def squared_logp_loss(logp, logq, advantages, rl_w, cfg):
    """A custom loss for the test: rl_w * logp**2, never masked."""
    none = jnp.zeros(logp.shape, bool)
    return RLTokenLoss(rl_w * jnp.square(logp), none, none)


@pytest.mark.parametrize("sep", [":", "."])
def test_custom_loss_is_loaded_and_used(sep):
    cfg = LossConfig(custom=f"{__name__}{sep}squared_logp_loss")
    logp, logq, adv, rl_w, ce_w, mask = _rl_batch()
    sums = loss_sums(logp, logq, adv, rl_w, ce_w, mask, cfg)
    want = L(0.5) ** 2 + L(0.7) ** 2 + L(0.1) ** 2 + 0.5 * L(0.3) ** 2
    np.testing.assert_allclose(sums["rl_loss_sum"], want, rtol=1e-6)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_pkg_xyz.mod:fn", "cannot import module 'no_such_pkg_xyz.mod'"),
        ("jaxrl.trainer.loss:no_such_fn", "has no callable 'no_such_fn'"),
        ("justaname", "expected 'pkg.module:function'"),
    ],
)
def test_bad_custom_path_fails_at_validation(path, message):
    with pytest.raises(pydantic.ValidationError, match="loss.custom") as err:
        LossConfig(custom=path)
    assert message in str(err.value)


def test_config_forbids_unknown_fields_and_documents_fields():
    with pytest.raises(pydantic.ValidationError, match="kl_coef"):
        LossConfig(kl_coef=0.1)
    assert "Trust region" in LossConfig.model_fields["mask_high"].description
