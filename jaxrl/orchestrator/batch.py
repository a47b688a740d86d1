"""Finished groups -> training samples, rollout records (with their fate) and rollout metrics.

Every rollout gets a record in ``rollouts.jsonl`` whatever happens to it, with a fate that is
never rewritten: ``trained``, ``failed`` (its error is on the record) or ``no_signal`` (its
group carried no learning signal). Records of a batch that had no signal at all and was
replaced by a resample also carry ``resampled: true``. Nothing is dropped silently.

With ``[orchestrator.dynamic_sampling]`` (DAPO) a group whose rewards are all equal is dropped
from its batch (records ``dropped: true``) and replaced by new groups, up to ``max_refills``
rounds. ``collect_batch`` gets a step its batch with learning signal, resampling up to
``orchestrator.max_resample`` times; failed rollouts of every try count in that step's
``train/rollouts_failed`` and are reported in one line per step (with the first error).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxrl.orchestrator.algo import Algorithm
from jaxrl.orchestrator.config import DynamicSamplingConfig
from jaxrl.orchestrator.orchestrator import Group
from jaxrl.orchestrator.traces import trace_truncated
from jaxrl.training_sample import TrainingSample

logger = logging.getLogger(__name__)


class BatchFailed(RuntimeError):
    """A step found no batch to train on (every rollout failed, or no learning signal in
    ``max_resample + 1`` tries): the run checkpoints and stops with this message."""


@dataclass
class Batch:
    samples: list[TrainingSample]
    records: list[dict]
    metrics: dict[str, float]
    errors: list[tuple[str, str]] = field(default_factory=list)
    """(env, error) of each failed rollout, in order."""

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
    errors: list[tuple[str, str]] = []
    lags = []
    truncated = filtered = traces = 0
    for group in groups:
        algo = algorithms[group.env]
        group_samples = algo.samples(group.rollouts)
        cut = [trace_truncated(t) for r in group.rollouts if r.ok for t in r.trainable_traces]
        traces, truncated = traces + len(cut), truncated + sum(cut)
        filtered += sum(cut) if getattr(algo, "overlong_filter", False) else 0
        samples += group_samples
        lags.append(step - 1 - group.dispatch_version)
        for r in group.rollouts:
            if r.ok:
                rewards[group.env].append(r.reward)
                fate = "trained" if group_samples else "no_signal"
            else:
                failed += 1
                errors.append((group.env, str(r.error)))
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
        # Over the trainable traces of successful rollouts: cut at a length limit, and of those
        # the ones whose RL weight DAPO's overlong filter zeroed (algo.overlong_filter).
        "truncated_frac": truncated / max(traces, 1),
        "overlong_filtered_frac": filtered / max(traces, 1),
    }
    for env, values in rewards.items():
        metrics[f"reward/{env}"] = float(np.mean(values))
    return Batch(samples, records, metrics, errors)


EQUAL_REWARDS = 1e-8
"""Rewards of one group within this of each other count as equal (float noise)."""


def all_equal_rewards(group: Group) -> bool:
    """Whether the group's successful rollouts all scored the same (no group-relative signal).
    A group with no successful rollout is not: its failures are reported as such."""
    rewards = [r.reward for r in group.rollouts if r.ok]
    return bool(rewards) and max(rewards) - min(rewards) <= EQUAL_REWARDS


def dynamic_batch(
    groups: list[Group],
    next_groups: Callable[[int], list[Group]],
    request_more: Callable[[int], None],
    algorithms: dict[str, Algorithm],
    step: int,
    cfg: DynamicSamplingConfig,
) -> Batch:
    """DAPO's dynamic sampling over one batch's ``groups``: all-equal groups are dropped and as
    many new groups requested, for at most ``cfg.max_refills`` rounds. The batch trains the kept
    groups; the dropped ones' records (``dropped: true``) and failures are part of it."""
    kept = [g for g in groups if not all_equal_rewards(g)]
    dropped = [g for g in groups if all_equal_rewards(g)]
    missing, refills = len(dropped), 0
    while missing and refills < cfg.max_refills:
        request_more(missing)
        refills += 1
        new = next_groups(missing)
        kept += [g for g in new if not all_equal_rewards(g)]
        dropped += (more := [g for g in new if all_equal_rewards(g)])
        missing = len(more)
    batch = build_batch(kept, algorithms, step)
    gone = build_batch(dropped, algorithms, step)
    for r in gone.records:
        r["dropped"] = True
        if r["fate"] != "failed":
            r["fate"] = "no_signal"
    batch.records += gone.records
    batch.errors += gone.errors
    batch.metrics |= {"dynamic_dropped_groups": float(len(dropped)), "dynamic_refills": float(refills),
                      "dynamic_missing_groups": float(missing)}  # fmt: skip
    return batch


def collect_batch(
    next_groups: Callable[..., list[Group]],
    request_more: Callable[..., None],
    algorithms: dict[str, Algorithm],
    step: int,
    *,
    max_resample: int,
    write: Callable[[list[dict]], None],
    env_logs: Mapping[str, Path] = {},
    dynamic: DynamicSamplingConfig | None = None,
) -> Batch:
    """A batch with learning signal for ``step``: a batch without any is written to the rollout
    log (``resampled: true``) and replaced, up to ``max_resample`` times. Its metrics count the
    failed rollouts of every try; raises ``BatchFailed`` when no try had signal.

    ``next_groups(n=None)`` returns ``n`` finished groups (default: a full batch) once
    ``request_more(n=None)`` dispatched them; ``dynamic`` turns on dynamic sampling."""

    def one_try() -> Batch:
        groups = next_groups()
        if dynamic is None:
            return build_batch(groups, algorithms, step)
        return dynamic_batch(groups, next_groups, request_more, algorithms, step, dynamic)

    tries = [one_try()]
    while not tries[-1].has_signal and len(tries) <= max_resample:
        tries[-1].mark_resampled()
        write(tries[-1].records)
        request_more()
        tries.append(one_try())
    batch = tries[-1]
    errors = [e for t in tries for e in t.errors]
    total = sum(len(t.records) for t in tries)
    where = ""
    if errors:
        env, first = errors[0]
        where = f"; first error (env {env!r}): {first}" + (f"; env log {env_logs[env]}" if env in env_logs else "")
        logger.warning("step %d: %d of %d rollouts failed (%d batches)%s", step, len(errors), total, len(tries), where)
    if not batch.has_signal:
        write(batch.records)
        if len(errors) == total:
            raise BatchFailed(f"step {step}: every rollout failed ({total} in {len(tries)} batches){where}")
        raise BatchFailed(
            f"step {step}: {len(tries)} batches in a row had no learning signal (every group's rewards were identical "
            f"and no CE tokens were selected; {len(errors)} of {total} rollouts failed{where}); check the env's reward, "
            "raise the temperature, or raise orchestrator.max_resample. Rollouts are in rollouts.jsonl"
        )
    batch.metrics |= {"rollouts_failed": float(len(errors)), "rollouts_failed_frac": len(errors) / max(total, 1),
                      "resampled_batches": float(len(tries) - 1)}  # fmt: skip
    return batch
