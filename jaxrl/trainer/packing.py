"""Sequence packing: samples -> fixed-shape rows with segment ids (DESIGN contract 4).

Rows have one of a few bucketed lengths and their count is padded to a multiple of the
micro-batch, so the jitted micro-step compiles once per bucket. Attention never crosses a
segment; positions restart at 0 per sample; the first token of every sample (and padding)
has ``loss_mask = False``, whatever its weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from jaxrl.trainer.loss import LossConfig, loss_counts
from jaxrl.training_sample import TrainingSample


@dataclass
class PackedBatch:
    """Token-aligned arrays [rows, seq_len]: entry t describes token t (its log-prob is
    predicted from position t - 1, so column 0 is never in a loss)."""

    tokens: np.ndarray  # int32
    positions: np.ndarray  # int32
    segment_ids: np.ndarray  # int32, 0 = padding
    loss_mask: np.ndarray  # bool
    logq: np.ndarray  # float32 inference logprobs
    advantages: np.ndarray  # float32, the sample's advantage on each of its tokens
    temperature: np.ndarray  # float32, 1.0 on padding
    rl_w: np.ndarray  # float32
    ce_w: np.ndarray  # float32
    ref_kl_w: np.ndarray  # float32
    logr: np.ndarray  # float32 reference (teacher) logprobs, 0 where unscored
    policy_version: np.ndarray  # int32 version of the policy that sampled each token (0 on padding)
    routing: np.ndarray | None = None
    """int32 [rows, seq_len, n_moe_layers, k]: the engine's experts per token (routing replay), -1
    on padding and on samples without them; None when no sample carries routing."""

    @property
    def num_rows(self) -> int:
        return int(self.tokens.shape[0])

    def rows(self, start: int, stop: int) -> "PackedBatch":
        return PackedBatch(
            **{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[start:stop] for f in fields(self)}
        )

    def as_dict(self) -> dict[str, np.ndarray]:
        """The arrays (``routing`` only when present)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def choose_bucket(samples: Sequence[TrainingSample], buckets: Sequence[int], rows_multiple: int = 1) -> int:
    """The bucket row length that packs ``samples`` into the fewest padded tokens (ties: shorter)."""
    lengths = [len(s) for s in samples]
    fitting = [b for b in sorted(buckets) if b >= max(lengths)]
    if not fitting:
        raise ValueError(
            f"a sample has {max(lengths)} tokens but trainer.seq_len is {max(buckets)}; raise trainer.seq_len "
            "(or lower the rollout's max tokens) so that every sample fits one row"
        )

    def padded_tokens(b: int) -> int:
        return -(-len(assign_rows(lengths, b)) // rows_multiple) * rows_multiple * b

    return min(fitting, key=lambda b: (padded_tokens(b), b))


def assign_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per row (deterministic for equal inputs)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def pack(samples: Sequence[TrainingSample], seq_len: int, rows_multiple: int = 1) -> PackedBatch:
    """Pack ``samples`` into rows of ``seq_len`` tokens, padding the row count to a multiple."""
    if not samples:
        raise ValueError("pack() needs at least one sample")
    rows = assign_rows([len(s) for s in samples], seq_len)
    n_rows = -(-len(rows) // rows_multiple) * rows_multiple
    shape = (n_rows, seq_len)
    out = PackedBatch(
        tokens=np.zeros(shape, np.int32),
        positions=np.zeros(shape, np.int32),
        segment_ids=np.zeros(shape, np.int32),
        loss_mask=np.zeros(shape, bool),
        logq=np.zeros(shape, np.float32),
        advantages=np.zeros(shape, np.float32),
        temperature=np.ones(shape, np.float32),
        rl_w=np.zeros(shape, np.float32),
        ce_w=np.zeros(shape, np.float32),
        ref_kl_w=np.zeros(shape, np.float32),
        logr=np.zeros(shape, np.float32),
        policy_version=np.zeros(shape, np.int32),
    )
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    if routed:
        out.routing = np.full((*shape, *routed[0].shape[1:]), -1, np.int32)
    for r, members in enumerate(rows):
        offset = 0
        for seg, i in enumerate(members, start=1):
            s = samples[i]
            n = len(s)
            sl = slice(offset, offset + n)
            out.tokens[r, sl] = s.token_ids
            out.positions[r, sl] = np.arange(n)
            out.segment_ids[r, sl] = seg
            out.loss_mask[r, offset + 1 : offset + n] = True
            out.logq[r, sl] = s.logprobs
            out.advantages[r, sl] = s.advantage
            out.temperature[r, sl] = s.temperature
            out.rl_w[r, sl] = s.rl_w
            out.ce_w[r, sl] = s.ce_w
            out.ref_kl_w[r, sl] = s.ref_kl_w
            if s.logr is not None:
                out.logr[r, sl] = s.logr
            out.policy_version[r, sl] = s.versions()
            if out.routing is not None and s.routed_experts is not None:
                if s.routed_experts.shape[1:] != out.routing.shape[2:]:
                    raise ValueError(
                        f"samples carry routed_experts of different shapes {list(s.routed_experts.shape[1:])} and "
                        f"{list(out.routing.shape[2:])} (layers, k): they come from different models"
                    )
                out.routing[r, sl] = s.routed_experts
            offset += n
    return out


def component_counts(
    batch: PackedBatch, cfg: LossConfig | None = None, trainer_version: int | None = None
) -> dict[str, float]:
    """Global token counts per loss component of a whole optimizer step's batch (they do not
    depend on parameters, so the host computes them once before any micro-batch runs), by
    the loss's own definition (`loss.loss_counts`: the one place a component's tokens are
    defined). With ``cfg``: after its staleness rule, plus ``rl_norm`` (the RL denominator) and
    ``trainer_version`` (the version being trained, which the loss compares token versions to)."""
    if cfg is None:
        counts = loss_counts(batch.rl_w, batch.ce_w, batch.loss_mask, batch.ref_kl_w)
        return {k: float(v) for k, v in counts.items()}
    version = 0 if trainer_version is None else trainer_version
    counts = loss_counts(
        batch.rl_w, batch.ce_w, batch.loss_mask, batch.ref_kl_w, cfg=cfg, segment_ids=batch.segment_ids,
        policy_version=batch.policy_version, trainer_version=version,
    )  # fmt: skip
    return {k: float(v) for k, v in counts.items()} | {"trainer_version": float(version)}
