"""Finished groups -> training samples, rollout records (with their fate) and rollout metrics.

Every rollout gets a record in ``rollouts.jsonl`` whatever happens to it, with a fate that is
never rewritten: ``trained``, ``failed`` (its error is on the record) or ``no_signal`` (its
group carried no learning signal). Records of a batch that had no signal at all and was
replaced by a resample also carry ``resampled: true``. Nothing is dropped silently.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from jaxrl.orchestrator.algo import Algorithm
from jaxrl.orchestrator.orchestrator import Group
from jaxrl.samples import TrainingSample


@dataclass
class Batch:
    samples: list[TrainingSample]
    records: list[dict]
    metrics: dict[str, float]

    @property
    def has_signal(self) -> bool:
        return bool(self.samples)

    def mark_resampled(self) -> None:
        """Flag every record of a batch replaced by a resample (each keeps its own fate)."""
        for r in self.records:
            r["resampled"] = True


def build_batch(groups: list[Group], algorithms: dict[str, Algorithm], step: int) -> Batch:
    samples: list[TrainingSample] = []
    records: list[dict] = []
    rewards: dict[str, list[float]] = defaultdict(list)
    failed = 0
    lags = []
    for group in groups:
        group_samples = algorithms[group.env].samples(group.rollouts)
        samples += group_samples
        lags.append(step - 1 - group.dispatch_version)
        for r in group.rollouts:
            if r.ok:
                rewards[group.env].append(r.reward)
                fate = "trained" if group_samples else "no_signal"
            else:
                failed += 1
                fate = "failed"
            records.append({"step": step, "split": "train", "fate": fate, **r.to_record()})
    all_rewards = [x for v in rewards.values() for x in v]
    n = len(records)
    metrics: dict[str, float] = {
        "reward_mean": float(np.mean(all_rewards)) if all_rewards else float("nan"),
        "reward_std": float(np.std(all_rewards)) if all_rewards else float("nan"),
        "rollouts": float(n),
        "rollouts_failed": float(failed),
        "rollouts_failed_frac": failed / max(n, 1),
        "samples": float(len(samples)),
        "sampled_tokens_mean": float(np.mean([s.sampled_mask.sum() for s in samples])) if samples else 0.0,
        "policy_lag_max": float(max(lags)) if lags else 0.0,
        "group_seconds_mean": float(np.mean([g.seconds for g in groups])) if groups else 0.0,
    }
    for env, values in rewards.items():
        metrics[f"reward/{env}"] = float(np.mean(values))
    return Batch(samples, records, metrics)
