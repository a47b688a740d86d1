"""Dual-clip PPO (Ye et al. 2020; verl's ``clip_ratio_c``) under ppo, dppo and gspo, against a
torch float64 reference written the way verl writes it, on hand-made ratios up to e^6."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest
import torch

from jaxrl.trainer.loss import LossConfig, combine, loss_sums

# One row, one sample: token 0 is the sample's first token (never trained). Tokens 1-6 are the
# cases; logq is chosen so each token has the ratio r = exp(logp - logq) written beside it.
#   1: A=-1, r=e^6 (p .135 vs q 3.4e-4: the probability *rose*, so DPPO's low mask keeps it)
#   2: A=-1, r=5        3: A=-2, r=2 (inside c = 3: untouched)    4: A=-1, r=0.5 (PPO-clipped low)
#   5: A=+1, r=e^6 (positive advantages are never dual-clipped)   6: A=-0.5, r=1
LOGP = [-1.0, -2.0, -1.0, -0.5, -0.3, -2.0, -0.7]
LOG_R = [0.0, 6.0, math.log(5.0), math.log(2.0), math.log(0.5), 6.0, 0.0]
ADV = [0.0, -1.0, -1.0, -2.0, -1.0, 1.0, -0.5]
MASK = [False, True, True, True, True, True, True]
N = 6  # RL tokens


def torch_reference(kind: str, c: float | None, kl_tau: float = 1e-3) -> tuple[float, np.ndarray]:
    """verl's ``compute_policy_loss`` (dual-clip branch) in float64 for ppo; DPPO's probability
    mask then the same floor for dppo. Token-mean over the RL tokens. Returns (loss, d loss/d logp)."""
    lp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    lq = torch.tensor(LOGP, dtype=torch.float64) - torch.tensor(LOG_R, dtype=torch.float64)
    adv = torch.tensor(ADV, dtype=torch.float64)
    mask = torch.tensor(MASK)
    ratio = torch.exp(lp - lq)
    if kind == "ppo":
        lo, hi = 0.2, 0.28
        loss1 = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - lo, 1 + hi))
    else:  # dppo: keep = not (A > 0 and p - q > 0.2) nor (A <= 0 and p - q < -0.2)
        dp = torch.exp(lp) - torch.exp(lq)
        masked = torch.where(adv > 0, dp > 0.2, dp < -0.2)
        loss1 = torch.where(masked, torch.zeros_like(adv), -adv * ratio)
    if c is not None:
        loss1 = torch.where(adv < 0, torch.minimum(-adv * c, loss1), loss1)
    per_token = loss1 + kl_tau * (lp - lq) ** 2
    total = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / mask.sum()
    total.backward()
    total = total.detach()
    return total.item(), lp.grad.numpy()


def _jax(cfg: LossConfig) -> tuple[float, np.ndarray, dict]:
    logp = jnp.asarray([LOGP], jnp.float32)
    logq = jnp.asarray([np.subtract(LOGP, LOG_R)], jnp.float32)
    adv = jnp.asarray([ADV], jnp.float32)
    ones, mask = jnp.ones_like(logp), jnp.asarray([MASK])

    def f(lp):
        return combine(loss_sums(lp, logq, adv, ones, 0 * ones, mask, cfg))

    (value, m), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return float(value), np.asarray(grad[0]), m


@pytest.mark.parametrize("kind", ["ppo", "dppo"])
@pytest.mark.parametrize("c", [3.0, None])
def test_value_and_gradient_match_torch(kind, c):
    value, grad, _ = _jax(LossConfig(type=kind, clip_ratio_c=c))
    want, want_grad = torch_reference(kind, c)
    np.testing.assert_allclose(value, want, rtol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("kind", ["ppo", "dppo"])
def test_the_e6_token_is_bounded_and_off_reproduces_the_old_loss(kind):
    on_value, on_grad, m = _jax(LossConfig(type=kind))  # the default: c = 3
    off_value, off_grad, m_off = _jax(LossConfig(type=kind, clip_ratio_c=None))
    # Off: token 1 weighs e^6 ~ 403 (d(-A r)/d logp = r); on: only its kl_tau term is left.
    np.testing.assert_allclose(off_grad[1] * N, math.exp(6) + 2e-3 * 6, rtol=1e-5)
    np.testing.assert_allclose(on_grad[1] * N, 2e-3 * 6, rtol=1e-4)
    # ... and its loss is c * |A| = 3 instead of 403; token 2 (r = 5) likewise 3 instead of 5.
    np.testing.assert_allclose((on_value - off_value) * N, (3 - math.exp(6)) + (3 - 5), rtol=1e-5)
    # Tokens 3-6 (inside c, PPO-clipped, positive A, r = 1) are untouched.
    np.testing.assert_allclose(on_grad[3:], off_grad[3:], rtol=1e-6, atol=1e-9)
    assert float(m["dual_clipped_frac"]) == pytest.approx(2 / N)
    assert float(m_off["dual_clipped_frac"]) == 0.0
    assert float(m["masked_high_frac"]) == m_off["masked_high_frac"]  # dual clip is its own metric


def test_gspo_dual_clips_the_sequence_ratio():
    """GSPO's term is per sequence: with s = e^2 and A < 0 the floor c * A holds on every token
    and the policy gradient is gone; c = None keeps the paper's s * A."""
    logp = jnp.asarray([[-1.0, -1.0, -1.0, -1.0]], jnp.float32)
    logq = logp - jnp.asarray([[0.0, 1.0, 2.0, 3.0]])  # mean log r over tokens 1-3 = 2
    adv = jnp.full_like(logp, -1.0)
    ones, mask = jnp.ones_like(logp), jnp.asarray([[False, True, True, True]])

    def run(c):
        f = lambda lp: combine(
            loss_sums(lp, logq, adv, ones, 0 * ones, mask, LossConfig(type="gspo", clip_ratio_c=c))
        )
        return jax.value_and_grad(f, has_aux=True)(logp)

    (on, m), g_on = run(3.0)
    (off, _), g_off = run(None)
    kl = 1e-3 * (1 + 4 + 9) / 3
    np.testing.assert_allclose([float(on), float(off)], [3.0 + kl, math.exp(2) + kl], rtol=1e-5)
    np.testing.assert_allclose(g_on[0, 1:], 2e-3 * np.array([1.0, 2.0, 3.0]) / 3, rtol=1e-4)
    np.testing.assert_allclose(g_off[0, 1:], (math.exp(2) + 2e-3 * np.array([1.0, 2.0, 3.0])) / 3, rtol=1e-4)
    assert float(m["dual_clipped_frac"]) == 1.0


def test_false_turns_the_dual_clip_off():
    """TOML has no null, so ``clip_ratio_c = false`` is the off switch (None reads as it);
    ``true`` is refused; the objectives get None."""
    assert LossConfig(clip_ratio_c=False).clip_ratio_c is False
    assert LossConfig(clip_ratio_c=None).clip_ratio_c is False
    assert LossConfig(clip_ratio_c=None).objective_fields()["clip_ratio_c"] is None
    assert LossConfig(type="ppo").objective_fields()["clip_ratio_c"] == 3.0
    assert LossConfig().clip_ratio_c == 3.0
    with pytest.raises(pydantic.ValidationError, match="clip_ratio_c"):
        LossConfig(clip_ratio_c=True)


@pytest.mark.parametrize(("value", "want"), [("false", False), ("null", False), ("2.5", 2.5)])
def test_the_command_line_sets_and_turns_off_the_dual_clip(value, want):
    from jaxrl.cli import build_config

    assert build_config({}, ["--trainer.loss.clip_ratio_c", value]).trainer.loss.clip_ratio_c == want
    with pytest.raises(ValueError, match="clip_ratio_c = '1': must be a number > 1"):
        build_config({}, ["--trainer.loss.clip_ratio_c", "1"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_ratio_c": 1.0}, "clip_ratio_c = 1.0: must be a number > 1"),
        ({"clip_ratio_c": 0.5}, "clip_ratio_c = 0.5: must be a number > 1"),
        ({"clip_ratio_c": float("inf")}, "clip_ratio_c = inf: must be a number > 1"),
        (
            {"type": "cispo", "clip_ratio_c": 4.0},
            "trainer.loss.clip_ratio_c applies to type dppo / gspo / ppo",
        ),
    ],
)
def test_bad_clip_ratio_c_is_one_clear_error(kwargs, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        LossConfig(**kwargs)
