"""The RL math end to end, without env servers: the engine samples, group-relative rewards, the trainer
updates, the engine gets the weights back. On a one-token bandit (reward 1 for a target
token) the target's probability must rise steeply, with zero mismatch KL on-policy."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model

from jaxrl.engine.config import EngineConfig
from jaxrl.engine.engine import Engine
from jaxrl.engine.requests import Request
from jaxrl.engine.token_sampling import SamplingParams
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.trainer.config import TrainerConfig
from jaxrl.trainer.step import Trainer
from jaxrl.training_sample import TrainingSample

PROMPT = [3, 14, 15, 9, 2, 6]
TARGETS = {7, 8, 9, 10}  # rewarded tokens (of 64)
GROUPS, GROUP_SIZE = 4, 16  # ~4 rewarded draws per step at the start (p ~ 0.06): a rise that no run of luck decides


def target_prob(trainer: Trainer) -> float:
    model = trainer.model()
    import jax.numpy as jnp

    hidden, _ = model(jnp.asarray([PROMPT]), jnp.arange(len(PROMPT))[None])
    probs = np.asarray(nnx.softmax(model.logits(hidden)[0, -1]))
    return float(probs[list(TARGETS)].sum())


@pytest.mark.slow  # a learning run (the slow tier)
def test_grpo_raises_reward_of_a_one_token_bandit() -> None:
    model = tiny_model(seed=1, vocab=64)
    mesh = make_mesh(MeshConfig(fsdp=1, num_devices=1))
    cfg = TrainerConfig(seq_len=16, seq_len_buckets=[16], micro_batch_rows=8, steps=8)
    cfg.optim.lr, cfg.optim.schedule, cfg.optim.weight_decay = 2e-2, "constant", 0.0
    trainer = Trainer(model, cfg, mesh)
    engine = Engine(trainer.model(), EngineConfig(max_model_len=16, max_seqs=16, prefill_len_buckets=[8]))
    start = target_prob(trainer)
    kls = []
    for step in range(1, 9):
        requests = [
            Request(PROMPT, SamplingParams(max_tokens=1, temperature=1.0, seed=1000 * step + i))
            for i in range(GROUPS * GROUP_SIZE)
        ]
        completions = engine.generate(requests)
        samples: list[TrainingSample] = []
        for g in range(GROUPS):  # GRPO: reward minus group mean
            group = completions[g * GROUP_SIZE : (g + 1) * GROUP_SIZE]
            rewards = [float(c.token_ids[0] in TARGETS) for c in group]
            for c, adv in zip(group, np.asarray(rewards) - np.mean(rewards)):
                n = len(PROMPT) + 1
                samples.append(TrainingSample(
                    token_ids=PROMPT + c.token_ids, sampled_mask=np.arange(n) == n - 1,
                    logprobs=np.where(np.arange(n) == n - 1, c.logprobs[0], 0.0),
                    rl_w=(np.arange(n) == n - 1) * float(adv != 0), ce_w=np.zeros(n), advantage=float(adv),
                ))
        if any(s.rl_w.any() for s in samples):
            metrics = trainer.train_step(samples)
            kls.append(metrics["mismatch_kl"])
        engine.update_weights_from_state(trainer.params, version=step)
        assert engine.policy_version == step
    end = target_prob(trainer)
    assert end > start + 0.3, (start, end)
    assert kls and max(kls) < 1e-6  # the engine's log-probs are the trainer's, on-policy
