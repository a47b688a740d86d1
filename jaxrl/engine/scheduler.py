"""Continuous-batching scheduler: which sequences run, in which KV cache rows, in which step.

Pure host-side bookkeeping (no JAX), so it is tested on its own. Each engine step the engine
asks for (1) admissions and prefix-cache row copies, (2) one prefill batch, (3) one decode
batch, runs them on device and hands the sampled tokens back here.

KV cache rows. The cache has ``max_seqs`` rows of ``max_model_len`` positions. A running
sequence owns one row. When it finishes, the row keeps its keys/values ("warm") and remembers
which tokens they belong to, until a new sequence needs the row (least recently used first).
A new request whose prompt starts with the tokens cached in some row reuses them instead of
recomputing them: a warm row is taken over directly (multi-turn rollouts: the next turn's
prompt extends the previous prompt + completion; ``X-Session-ID`` marks rows of the same
conversation, reused at any prefix length), a row still in use is copied (the requests of a
GRPO group share one prompt). A request whose prefix is about to be cached by a prompt being
prefilled right now waits a step for it instead of computing it twice.

Routing records (mixture-of-experts models, routing replay). The engine hands back the experts
each fed token used per sparse layer; each sequence keeps them for the positions its row holds
(``Sequence.routing``), and a reused prefix takes them from the row it reuses, as it takes the
keys/values (a warm row keeps its last owner's records), so every position of a completion has
the routing that actually produced its keys/values.

Shared prefixes. Copies and takeovers leave many rows holding the same keys/values over their
first positions (a GRPO group's prompt; an env's system prompt and tool specs in every row).
Each row records where its leading positions came from (``RowTable.origin``: one prefill's id
and how many of its positions the row still holds unchanged), and every decode plan names, per
sequence, one row holding the same values (``DecodePlan.share_rows`` / ``share_lens``), so a
kernel can read one copy for all of them (``kernels/cpu_cached_attention.cc``: the copy stays
in the CPU's cache). The values are equal, so the result does not depend on it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass

import numpy as np

from jaxrl.engine.config import EngineConfig
from jaxrl.engine.prefix_cache import RowTable, common_prefix
from jaxrl.engine.requests import Sequence
from jaxrl.engine.token_sampling import SamplingBatch


def _top(top: tuple[np.ndarray, np.ndarray] | None, *index: int) -> tuple[np.ndarray, np.ndarray] | None:
    """One token's (ids, log-probs) of the most likely tokens, or None."""
    return None if top is None else (top[0][index], top[1][index])


def bucket_at_least(buckets: list[int], n: int) -> int:
    return buckets[min(bisect_left(buckets, n), len(buckets) - 1)]


@dataclass
class PrefillPlan:
    seqs: list[Sequence]
    chunk: list[int]  # prompt tokens each sequence prefills now
    tokens: np.ndarray  # i32[B, T]
    positions: np.ndarray  # i32[B, T]; padding at max_model_len (not written)
    rows: np.ndarray  # i32[B]
    last: np.ndarray  # i32[B]: index in the chunk of the sequence's last token
    sampling: SamplingBatch


@dataclass
class DecodePlan:
    seqs: list[Sequence]
    tokens: np.ndarray  # i32[B]: each sequence's last sampled token, fed now
    positions: np.ndarray  # i32[B]
    rows: np.ndarray  # i32[B]; padding rows = max_seqs (out of range: not written, reads discarded)
    sampling: SamplingBatch
    steps: int  # decode steps of this call
    share_rows: np.ndarray  # i32[B]: a row holding the same keys/values as ``rows`` ...
    share_lens: np.ndarray  # i32[B]: ... over this many first positions (0: none; RowTable.shares)


@dataclass
class SchedulerStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    cached_prompt_tokens: int = 0  # ... whose keys/values came from the prefix cache
    prefill_tokens: int = 0  # prompt tokens computed (no padding)
    generated_tokens: int = 0
    row_copies: int = 0
    shared_prefix_positions: int = 0  # cached positions planned to be read from another row's copy
    prefill_calls: int = 0
    decode_calls: int = 0


class Scheduler:
    """Admission, prefix reuse and batch planning over ``max_seqs`` KV cache rows."""

    def __init__(self, config: EngineConfig):
        self.cfg = config
        self.stats = SchedulerStats()
        self._prefill_lens = config.prefill_lengths()
        self._prefill_batches = config.prefill_batches()
        self._decode_batches = config.decode_buckets()
        self.reset()

    def reset(self) -> None:
        """Start over with no request and no cached prefix (after a failed engine step: which
        rows the failed device call wrote is unknown). The counters go on."""
        self.rows = RowTable(self.cfg.max_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.admitted: list[Sequence] = []  # given rows by the last ``admit``

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is; returns it (finish_reason "abort") or None if unknown."""
        for seq in self.waiting:
            if seq.request.request_id == request_id:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return seq
        for seq in self.running:
            if seq.request.request_id == request_id:
                seq.finish_reason = "abort"
                self._retire(seq)
                return seq
        return None

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.rows.release(seq)

    # -- admission ---------------------------------------------------------------------------

    def admit(self) -> list[tuple[int, int]]:
        """Give waiting requests rows, in arrival order; returns cache row copies (src, dst) to do
        before this step's prefill."""
        copies: list[tuple[int, int]] = []
        deferred: list[Sequence] = []
        self.admitted = []
        while self.waiting and any(o is None for o in self.rows.owner):
            seq = self.waiting.popleft()
            copy = self._place(seq)
            if copy is None:
                deferred.append(seq)
                continue
            self.admitted.append(seq)
            if copy != (-1, -1):
                copies.append(copy)
        self.waiting.extendleft(reversed(deferred))
        self.stats.row_copies += len(copies)
        return copies

    def _place(self, seq: Sequence) -> tuple[int, int] | None:
        """Assign ``seq`` a row. Returns the row copy to do, (-1, -1) for none, None to defer."""
        prompt, session = seq.prompt, seq.request.session_id
        best, best_row, best_key = 0, None, (0, False, False)
        for r in range(len(self.rows.owner)):
            cached = self.rows.tokens(r)
            if not len(cached):
                continue
            m = common_prefix(cached, prompt)
            key = (m, session is not None and self.rows.session[r] == session, self.rows.owner[r] is None)
            if m and key > best_key:
                best, best_row, best_key = m, r, key
        upcoming = max((common_prefix(s.prompt, prompt) for s in self.running if s.prefilling), default=0)
        if upcoming - best >= self.cfg.min_prefix_reuse:
            return None
        copy = (-1, -1)
        reuse = best_row is not None and (best >= self.cfg.min_prefix_reuse or best_key[1])
        if reuse:
            if self.rows.owner[best_row] is None:
                row = best_row
            else:
                row = self.rows.free_row()
                assert row is not None
                copy = (best_row, row)
        else:
            row = self.rows.free_row()
            assert row is not None
            best = common_prefix(self.rows.tokens(row), prompt)
        source_routing = self.rows.routing(copy[0] if copy != (-1, -1) else row)
        self.rows.assign(row, seq)
        seq.prefilled = seq.cached_prompt = min(best, len(prompt) - 1)
        if source_routing is not None and seq.prefilled:  # the kept positions' routing follows their keys/values
            seq.record_routing(source_routing[: seq.prefilled])
        self.rows.set_origin(row, seq, copy[0] if copy != (-1, -1) else row, fresh=not reuse)
        self.running.append(seq)
        self.stats.prompt_tokens += len(prompt)
        self.stats.cached_prompt_tokens += seq.cached_prompt
        return copy

    # -- prefill -----------------------------------------------------------------------------

    def plan_prefill(self) -> PrefillPlan | None:
        """One batch of prompt chunks within the step's token budget (padding counted)."""
        todo = [s for s in self.running if s.prefilling]
        if not todo:
            return None
        decoding = sum(1 for s in self.running if not s.prefilling)
        budget = max(self.cfg.max_batched_tokens - decoding, self._prefill_lens[0])
        lens, batches = self._prefill_lens, self._prefill_batches
        fits = lens[: max(bisect_right(lens, budget), 1)]
        first = min(len(todo[0].prompt) - todo[0].prefilled, fits[-1])
        width = bucket_at_least(lens, first)
        chosen, chunk = [todo[0]], [first]
        for seq in todo[1:]:
            if len(chosen) == batches[-1] or bucket_at_least(batches, len(chosen) + 1) * width > budget:
                break
            chosen.append(seq)
            chunk.append(min(len(seq.prompt) - seq.prefilled, width))
        size = bucket_at_least(batches, len(chosen))
        tokens = np.zeros((size, width), np.int32)
        positions = np.full((size, width), self.cfg.max_model_len, np.int32)
        rows = np.zeros(size, np.int32)
        last = np.zeros(size, np.int32)
        for i, (seq, n) in enumerate(zip(chosen, chunk)):
            tokens[i, :n] = seq.prompt[seq.prefilled : seq.prefilled + n]
            positions[i, :n] = np.arange(seq.prefilled, seq.prefilled + n)
            rows[i], last[i] = seq.row, n - 1
        params = [s.params for s in chosen]
        sampling = SamplingBatch.host(params, [s.seed for s in chosen], [len(s.prompt) for s in chosen], size)
        return PrefillPlan(chosen, chunk, tokens, positions, rows, last, sampling)

    def finish_prefill(
        self,
        plan: PrefillPlan,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        version: int,
        experts: np.ndarray | None = None,
        top: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> list[Sequence]:
        """Advance prefill; sequences whose prompt is complete get their first token.
        ``experts`` [B, T, n_moe_layers, k]: the chunk's routing (empty for a dense model);
        ``top``: (ids, log-probs) [B, max_logprobs] of the most likely tokens (None: not computed)."""
        self.stats.prefill_calls += 1
        done: list[Sequence] = []
        for i, (seq, n) in enumerate(zip(plan.seqs, plan.chunk)):
            if seq.finish_reason is not None:  # aborted meanwhile
                continue
            if experts is not None:
                seq.record_routing(experts[i, :n])
            seq.prefilled += n
            self.stats.prefill_tokens += n
            if not seq.prefilling:
                self.stats.generated_tokens += 1
                if seq.append(int(tokens[i]), float(logprobs[i]), version, _top(top, i)):
                    self._retire(seq)
                    done.append(seq)
        return done

    # -- decode ------------------------------------------------------------------------------

    def plan_decode(self, steps: int) -> DecodePlan | None:
        # Longest first: decode attention reads each block of rows as far as its longest one
        # (``jaxrl.models.layers.ROW_BLOCK``), so rows of like length share blocks.
        seqs = sorted((s for s in self.running if not s.prefilling), key=lambda s: -s.position)
        if not seqs:
            return None
        size = bucket_at_least(self._decode_batches, len(seqs))
        tokens = np.zeros(size, np.int32)
        positions = np.zeros(size, np.int32)
        rows = np.full(size, self.cfg.max_seqs, np.int32)
        for i, seq in enumerate(seqs):
            tokens[i], positions[i], rows[i] = seq.tokens[-1], seq.position, seq.row
        params = [s.params for s in seqs]
        draw_position = [len(s.prompt) + len(s.tokens) for s in seqs]
        sampling = SamplingBatch.host(params, [s.seed for s in seqs], draw_position, size)
        share_rows, share_lens = self._shares(seqs, size)
        return DecodePlan(seqs, tokens, positions, rows, sampling, steps, share_rows, share_lens)

    def _shares(self, seqs: list[Sequence], size: int) -> tuple[np.ndarray, np.ndarray]:
        """``RowTable.shares`` of the sequences' rows, padded to the batch ``size`` with none."""
        share_rows, share_lens = np.zeros(size, np.int32), np.zeros(size, np.int32)
        rows = [s.row for s in seqs]
        share_rows[: len(seqs)], share_lens[: len(seqs)] = self.rows.shares(rows)
        self.stats.shared_prefix_positions += int(share_lens[: len(seqs)][share_rows[: len(seqs)] != rows].sum())
        return share_rows, share_lens

    def finish_decode(
        self,
        plan: DecodePlan,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        version: int,
        experts: np.ndarray | None = None,
        top: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> list[Sequence]:
        """Consume ``tokens``/``logprobs`` [steps, B], ``top`` ([steps, B, max_logprobs] ids and
        log-probs, or None) and ``experts`` [steps, B, n_moe_layers, k]
        (the routing of the token fed at each step; empty for a dense model); tokens drawn after
        a sequence finished are discarded (their cache writes lie beyond the row's recorded
        tokens, so they are harmless)."""
        self.stats.decode_calls += 1
        done: list[Sequence] = []
        for i, seq in enumerate(plan.seqs):
            if seq.finish_reason is not None:
                continue
            for k in range(tokens.shape[0]):
                if experts is not None:
                    seq.record_routing(experts[k, i : i + 1])
                seq.fed += 1
                self.stats.generated_tokens += 1
                if seq.append(int(tokens[k, i]), float(logprobs[k, i]), version, _top(top, k, i)):
                    self._retire(seq)
                    done.append(seq)
                    break
        return done
