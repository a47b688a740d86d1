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

import uuid
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from jaxrl.engine.config import EngineConfig
from jaxrl.engine.sampling import SamplingBatch, SamplingParams


@dataclass
class Request:
    """One generation request (one completion; ``n`` completions are ``n`` requests)."""

    prompt: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    session_id: str | None = None
    stop_fn: Callable[[list[int]], bool] | None = None
    """Extra host-side stop test on the completion so far (e.g. stop strings); True = stop."""
    on_tokens: Callable[[TokenDelta], None] | None = None
    """Streaming: called on the engine thread after each device call that sampled tokens for this
    request, with those tokens, before the request's future completes. It must return at once
    (hand the delta to another thread: the engine loop waits for it); what it raises is logged
    and the request goes on."""


@dataclass(frozen=True)
class TokenDelta:
    """Completion tokens sampled by one engine device call (a prefill's first token, or up to
    ``decode_steps`` decode tokens), with their log-probs and the weights version that drew them."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]


@dataclass
class Completion:
    """The result of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # completion tokens, the matched stop token included
    logprobs: list[float]  # one per completion token (see jaxrl.engine.sampling)
    finish_reason: str  # "stop" | "length" | "abort"
    policy_version: int  # weights version that sampled the first completion token
    policy_version_final: int  # ... and the last (differs only with weight_update = "immediate")
    cached_prompt_tokens: int  # prompt tokens whose keys/values came from the prefix cache
    stop_token: int | None = None  # the stop token id that ended the completion (its last token)
    routed_experts: np.ndarray | None = None
    """MoE models: uint8/uint16 [prompt + completion - 1, n_moe_layers, k], the experts each fed
    token used per sparse layer (the last completion token is never fed); None for dense ones."""
    token_versions: list[int] = field(default_factory=list)
    """The weights version that sampled each completion token (``weight_update = "immediate"``
    swaps weights between engine steps, so one completion can span versions)."""


class Sequence:
    """Scheduler state of one request."""

    def __init__(self, request: Request, seed: int, max_model_len: int):
        self.request = request
        self.params = request.params
        self.seed = seed
        self.prompt = np.asarray(request.prompt, np.int32)
        self.max_new = min(self.params.max_tokens, max_model_len - len(self.prompt))
        self.stop_ids = frozenset(self.params.stop_token_ids)
        self.row = -1
        self.prefilled = 0  # prompt tokens whose keys/values are in the row
        self.cached_prompt = 0  # of which came from the prefix cache
        self.fed = 0  # completion tokens whose keys/values are in the row
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []  # the weights version that sampled each token
        self.finish_reason: str | None = None
        self.stop_token: int | None = None
        self.routing: list[np.ndarray] = []  # chunks of routing records of the row's positions, in order

    def routed_experts(self) -> np.ndarray | None:
        """The routing records of the positions this sequence's row holds (None: none recorded)."""
        if not self.routing:
            return None
        if len(self.routing) > 1:
            self.routing = [np.concatenate(self.routing)]
        return self.routing[0]

    def record_routing(self, experts: np.ndarray) -> None:
        """Append the routing of positions just written to the row (``[n, n_moe_layers, k]``; a
        dense model's are empty and not kept)."""
        if experts.size:
            self.routing.append(experts)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    @property
    def position(self) -> int:
        """Next cache position to write."""
        return self.prefilled + self.fed

    def cached_tokens(self) -> np.ndarray:
        """Tokens whose keys/values this sequence's row holds, in position order."""
        done = np.asarray(self.tokens[: self.fed], np.int32)
        return np.concatenate([self.prompt[: self.prefilled], done])

    def append(self, token: int, logprob: float, version: int) -> bool:
        """Record a sampled token; returns True when the sequence is finished."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        stop_fn = self.request.stop_fn
        if token in self.stop_ids:
            self.finish_reason, self.stop_token = "stop", token
        elif stop_fn is not None and stop_fn(self.tokens):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_new:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def completion(self, version: int) -> Completion:
        """The result so far (``version``: the one served, for a request aborted before its first token)."""
        first, last = (self.versions[0], self.versions[-1]) if self.versions else (version, version)
        return Completion(
            request_id=self.request.request_id,
            prompt_token_ids=list(self.request.prompt),
            token_ids=list(self.tokens),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "abort",
            policy_version=first,
            policy_version_final=last,
            cached_prompt_tokens=self.cached_prompt,
            stop_token=self.stop_token,
            routed_experts=self.routed_experts(),
            token_versions=list(self.versions),
        )


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def bucket_at_least(buckets: list[int], n: int) -> int:
    return buckets[min(bisect_left(buckets, n), len(buckets) - 1)]


class RowTable:
    """Owner, cached tokens, session, recency and prefix origin of every KV cache row."""

    def __init__(self, rows: int):
        self.owner: list[Sequence | None] = [None] * rows
        self.warm: list[np.ndarray] = [np.zeros(0, np.int32)] * rows  # tokens cached in unowned rows
        self.warm_routing: list[np.ndarray | None] = [None] * rows  # ... and their routing records
        self.session: list[str | None] = [None] * rows
        self.last_used = [0] * rows
        self._clock = 0
        # origin[r] = (fill, n): positions < n of row r hold the keys/values that prefill ``fill``
        # computed (once written there). A fresh prefill from position 0 starts a new fill; a row
        # copy or a takeover keeps the source's fill over the positions it keeps; nothing writes
        # below n afterwards (prefill resumes at or after the kept prefix, decode after the prompt).
        self.origin: list[tuple[int, int]] = [(-1 - r, 0) for r in range(rows)]
        self._fills = 0

    def set_origin(self, row: int, seq: Sequence, source: int, *, fresh: bool = False) -> None:
        """Record where ``row``'s leading positions come from once ``seq`` (whose first
        ``seq.prefilled`` positions are kept from row ``source``: itself or a copy's source)
        owns it. ``fresh``: the row was taken for being free, not for its contents; the few
        positions it happens to keep (fewer than ``min_prefix_reuse``, say a chat template's
        opening) would tie it to an unrelated fill for no gain, and cap what later copies of
        this prompt could share at those few, so it starts a fill of its own."""
        fill, n = self.origin[source]
        if seq.prefilled == 0 or fresh:
            self._fills += 1
            self.origin[row] = (self._fills, len(seq.prompt))
        else:
            self.origin[row] = (fill, min(n, seq.prefilled))

    def shares(self, rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``rows``: a row holding the same values over its first positions, and how
        many (0: none). All rows of one fill name the same row, the one holding the most of it."""
        held = [min(n, self.cached_len(r)) for r, (_, n) in enumerate(self.origin)]
        best: dict[int, int] = {}
        for r, (fill, _) in enumerate(self.origin):
            if fill not in best or held[r] > held[best[fill]]:
                best[fill] = r
        share_rows = np.array([best[self.origin[r][0]] for r in rows], np.int32)
        share_lens = np.array([min(held[r], held[c]) for r, c in zip(rows, share_rows)], np.int32)
        return share_rows, share_lens

    def tokens(self, row: int) -> np.ndarray:
        owner = self.owner[row]
        return owner.cached_tokens() if owner is not None else self.warm[row]

    def routing(self, row: int) -> np.ndarray | None:
        """Routing records of the positions ``row`` holds (None: none recorded)."""
        owner = self.owner[row]
        return owner.routed_experts() if owner is not None else self.warm_routing[row]

    def cached_len(self, row: int) -> int:
        owner = self.owner[row]
        return owner.position if owner is not None else len(self.warm[row])

    def free_row(self) -> int | None:
        """An unowned row: an empty one if any, else the least recently used warm one."""
        unowned = [r for r, o in enumerate(self.owner) if o is None]
        if not unowned:
            return None
        return min(unowned, key=lambda r: (len(self.warm[r]) > 0, self.last_used[r]))

    def assign(self, row: int, seq: Sequence) -> None:
        self.owner[row] = seq
        self.warm[row] = np.zeros(0, np.int32)
        self.warm_routing[row] = None
        self.session[row] = seq.request.session_id
        seq.row = row

    def release(self, seq: Sequence) -> None:
        self._clock += 1
        self.owner[seq.row] = None
        self.warm[seq.row] = seq.cached_tokens()
        self.warm_routing[seq.row] = seq.routed_experts()
        self.last_used[seq.row] = self._clock

    def invalidate_warm(self) -> None:
        """Forget every unowned row's cache (its keys/values came from old weights)."""
        for r, o in enumerate(self.owner):
            if o is None:
                self.warm[r] = np.zeros(0, np.int32)
                self.warm_routing[r] = None


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
        self.rows = RowTable(config.max_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.stats = SchedulerStats()
        self.admitted: list[Sequence] = []  # given rows by the last ``admit``
        self._prefill_lens = config.prefill_lengths()
        self._prefill_batches = config.prefill_batches()
        self._decode_batches = config.decode_buckets()

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
        self, plan: PrefillPlan, tokens: np.ndarray, logprobs: np.ndarray, version: int, experts: np.ndarray | None = None
    ) -> list[Sequence]:
        """Advance prefill; sequences whose prompt is complete get their first token.
        ``experts`` [B, T, n_moe_layers, k]: the chunk's routing (empty for a dense model)."""
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
                if seq.append(int(tokens[i]), float(logprobs[i]), version):
                    self._retire(seq)
                    done.append(seq)
        return done

    # -- decode ------------------------------------------------------------------------------

    def plan_decode(self, steps: int) -> DecodePlan | None:
        # Longest first: decode attention reads each block of rows as far as its longest one
        # (``jaxrl.models.decoder.ROW_BLOCK``), so rows of like length share blocks.
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
        self, plan: DecodePlan, tokens: np.ndarray, logprobs: np.ndarray, version: int, experts: np.ndarray | None = None
    ) -> list[Sequence]:
        """Consume ``tokens``/``logprobs`` [steps, B] and ``experts`` [steps, B, n_moe_layers, k]
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
                if seq.append(int(tokens[k, i]), float(logprobs[k, i]), version):
                    self._retire(seq)
                    done.append(seq)
                    break
        return done
