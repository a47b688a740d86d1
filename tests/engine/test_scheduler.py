"""Scheduler bookkeeping without a device: rows, prefix reuse, budgets, buckets, stops."""

from __future__ import annotations

import numpy as np

from jaxrl.engine.config import EngineConfig
from jaxrl.engine.requests import Request, Sequence
from jaxrl.engine.scheduler import Scheduler
from jaxrl.engine.token_sampling import SamplingParams

STOP = 99
CFG = EngineConfig(
    max_model_len=64,
    max_seqs=2,
    max_batched_tokens=32,
    decode_steps=3,
    decode_batch_buckets=[1, 2],
    prefill_len_buckets=[8, 16],
    prefill_batch_buckets=[1, 2],
    min_prefix_reuse=4,
)


def _seq(prompt: list[int], session: str | None = None, max_tokens: int = 16) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=(STOP,))
    return Sequence(Request(prompt, params, session_id=session), seed=0, max_model_len=CFG.max_model_len)


def _prefill_all(s: Scheduler, first_token: int = 50) -> list[Sequence]:
    done = []
    while (plan := s.plan_prefill()) is not None:
        n = len(plan.seqs)
        done += s.finish_prefill(plan, np.full(n, first_token), np.zeros(n), version=0)
    return done


def _decode(s: Scheduler, tokens: list[list[int]]) -> list[Sequence]:
    plan = s.plan_decode(CFG.decode_steps)
    assert plan is not None
    arr = np.asarray(tokens, np.int32).reshape(CFG.decode_steps, -1)
    return s.finish_decode(plan, arr, np.zeros(arr.shape, np.float32), version=0)


def test_next_turn_reuses_the_finished_row_and_prefills_only_the_new_tokens() -> None:
    s = Scheduler(CFG)
    prompt = list(range(1, 11))
    a = _seq(prompt, session="conv")
    s.add(a)
    assert s.admit() == []
    _prefill_all(s)
    assert a.tokens == [50]
    done = _decode(s, [[51], [52], [STOP]])
    assert done == [a] and a.finish_reason == "stop" and a.tokens == [50, 51, 52, STOP]
    # Cached: the prompt and every completion token fed back (the stop token never was).
    np.testing.assert_array_equal(s.rows.warm[a.row], prompt + [50, 51, 52])

    b = _seq(prompt + [50, 51, 52, STOP, 7, 8], session="conv")
    s.add(b)
    assert s.admit() == []  # no copy: the warm row is taken over
    assert b.row == a.row and b.prefilled == b.cached_prompt == 13
    plan = s.plan_prefill()
    assert plan.chunk == [3]
    np.testing.assert_array_equal(plan.tokens[0, :3], [STOP, 7, 8])
    np.testing.assert_array_equal(plan.positions[0, :3], [13, 14, 15])
    assert (plan.positions[0, 3:] == CFG.max_model_len).all()  # padding is never written


def test_same_prompt_group_waits_for_one_prefill_then_copies_the_row() -> None:
    s = Scheduler(CFG)
    prompt = list(range(1, 21))
    first, second = _seq(prompt), _seq(prompt)
    s.add(first)
    s.add(second)
    assert s.admit() == []
    assert s.running == [first] and list(s.waiting) == [second]  # deferred: its prefix is coming
    plan = s.plan_prefill()
    assert plan.chunk == [16]
    s.finish_prefill(plan, np.zeros(1), np.zeros(1), 0)
    assert s.admit() == []  # only 16 of 20 shared tokens cached so far: keep waiting
    _prefill_all(s)
    copies = s.admit()
    assert copies == [(first.row, second.row)]
    assert second.prefilled == 19  # the last prompt token is recomputed for its logits
    assert s.stats.prefill_tokens == 20 and s.stats.cached_prompt_tokens == 19


def test_prefill_respects_token_budget_and_buckets() -> None:
    s = Scheduler(CFG)
    a, b = _seq(list(range(1, 31))), _seq([5, 6, 7])
    s.add(a)
    s.add(b)
    s.admit()
    plan = s.plan_prefill()
    # a's first chunk is the largest bucket (16); b joins at the same width: 2 x 16 = 32 = budget.
    assert plan.seqs == [a, b] and plan.chunk == [16, 3] and plan.tokens.shape == (2, 16)
    np.testing.assert_array_equal(plan.last, [15, 2])
    s.finish_prefill(plan, np.array([40, 41]), np.zeros(2), 0)
    assert b.tokens == [41] and a.tokens == [] and a.prefilled == 16
    # One sequence decoding leaves 31 tokens of budget: a's remaining 14 tokens fit in one chunk.
    plan = s.plan_prefill()
    assert plan.seqs == [a] and plan.chunk == [14] and plan.tokens.shape == (1, 16)


def test_decode_plan_pads_with_out_of_range_rows_at_position_zero() -> None:
    s = Scheduler(CFG)
    a = _seq(list(range(1, 30)))
    s.add(a)
    s.admit()
    _prefill_all(s)
    plan = s.plan_decode(CFG.decode_steps)
    assert plan.tokens.shape == (1,) and plan.positions[0] == 29
    s.finish_decode(plan, np.array([[1], [2], [3]]), np.zeros((3, 1)), 0)
    plan = s.plan_decode(CFG.decode_steps)
    assert plan.positions[0] == 32
    b = _seq([1, 2, 3])
    s.add(b)
    s.admit()
    _prefill_all(s)
    plan = s.plan_decode(CFG.decode_steps)
    assert plan.tokens.shape == (2,)
    np.testing.assert_array_equal(plan.rows, [a.row, b.row])
    c = _seq([4, 5, 6])
    s.abort(b.request.request_id)
    s.add(c)
    s.admit()
    _prefill_all(s)
    s.abort(a.request.request_id)
    plan = s.plan_decode(CFG.decode_steps)
    assert plan.seqs == [c] and plan.tokens.shape == (1,)


def test_length_limits_stop_fn_and_discarded_tokens() -> None:
    s = Scheduler(CFG)
    a = _seq(list(range(1, 61)), max_tokens=100)  # 60-token prompt: room for 4 tokens
    b = Sequence(
        Request([1, 2], SamplingParams(max_tokens=10), stop_fn=lambda toks: toks[-2:] == [7, 8]),
        0,
        CFG.max_model_len,
    )
    assert a.max_new == 4
    s.add(a)
    s.add(b)
    s.admit()
    _prefill_all(s)
    done = _decode(s, [[1, 7], [2, 8], [3, 9]])
    assert b.tokens == [50, 7, 8] and b.finish_reason == "stop" and b.stop_token is None
    assert b.fed == 2  # the token drawn after the stop (9) is discarded
    assert a.tokens == [50, 1, 2, 3] and a.finish_reason == "length"
    assert set(done) == {a, b} and s.idle


def test_eviction_prefers_empty_rows_then_least_recently_used() -> None:
    s = Scheduler(CFG)
    seqs = [_seq([10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=1) for i in range(3)]
    for q in seqs[:2]:
        s.add(q)
    s.admit()
    _prefill_all(s)  # max_tokens=1: both finish at prefill, rows warm (first released first)
    assert s.idle and sorted(q.row for q in seqs[:2]) == [0, 1]
    s.add(seqs[2])
    s.admit()
    assert seqs[2].row == seqs[0].row and seqs[2].prefilled == 0


def test_abort_waiting_and_running() -> None:
    s = Scheduler(CFG)
    a, b, c = _seq([1, 2, 3]), _seq([4, 5, 6]), _seq([7, 8, 9])
    for q in (a, b, c):
        s.add(q)
    s.admit()
    assert s.abort(c.request.request_id) is c and c.finish_reason == "abort" and not s.waiting
    assert s.abort(a.request.request_id) is a and a not in s.running
    assert s.rows.owner[a.row] is None
    assert s.abort("nope") is None


def test_config_derives_buckets_and_names_bad_fields() -> None:
    import pytest

    cfg = EngineConfig(max_model_len=1000, max_seqs=24)
    assert cfg.decode_buckets() == [1, 8, 16, 24]
    assert cfg.prefill_lengths() == [16, 64, 256, 512]
    assert cfg.prefill_batches() == [1, 2, 4, 8]
    assert cfg.program_bound() == 4 + 4 * 4 + 2  # decode programs: one per batch bucket, any length
    idle = EngineConfig(max_model_len=1000, max_seqs=24, decode_steps_idle=16)
    assert idle.decode_step_counts() == [4, 16] and idle.program_bound() == 2 * 4 + 4 * 4 + 2
    assert EngineConfig(max_seqs=1).decode_buckets() == [1]
    for bad, field in [
        ({"backend": "external"}, "backend"),  # the [inference] section's field, not the engine's
        ({"max_seqs": 64, "decode_batch_buckets": [8, 32]}, "decode_batch_buckets"),
        ({"prefill_len_buckets": [64, 32]}, "prefill_len_buckets"),
        ({"max_model_len": 2048, "max_batched_tokens": 100}, "max_batched_tokens"),
        ({"decode_steps": 8, "decode_steps_idle": 4}, "decode_steps_idle"),
        ({"surprise": 1}, "surprise"),
        ({"decode_len_buckets": [128]}, "decode_len_buckets was removed"),
    ]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**bad)


def test_shared_prefix_rows_hold_the_same_values_as_the_rows_they_name() -> None:
    """Every decode plan's (share_rows, share_lens) must name, per sequence, a row whose first
    share_lens positions hold exactly what the sequence's own row holds there: the CPU kernel
    reads them from that row instead. A host model of the cache stamps each written position
    with a fresh number (only row copies make two positions equal, as on the device: two
    prefills of the same tokens need not give the same bits), under a random workload of GRPO
    groups sharing a system prompt, multi-turn sessions, aborts and weight swaps."""
    cfg = EngineConfig(
        max_model_len=96, max_seqs=6, max_batched_tokens=48, decode_steps=3, decode_batch_buckets=[2, 4, 6],
        prefill_len_buckets=[8, 16, 32], prefill_batch_buckets=[1, 2, 4], min_prefix_reuse=4,
    )
    rng = np.random.default_rng(0)
    s = Scheduler(cfg)
    stamps = np.arange(-1, -1 - cfg.max_seqs * cfg.max_model_len, -1).reshape(cfg.max_seqs, cfg.max_model_len)
    fresh = iter(range(1, 10**9))
    system = list(range(1, 21))
    shared_positions = 0

    def check(seqs: list[Sequence], share_rows: np.ndarray, share_lens: np.ndarray) -> int:
        for seq, src, n in zip(seqs, share_rows, share_lens):
            assert n <= seq.position and n <= s.rows.cached_len(int(src))
            np.testing.assert_array_equal(stamps[seq.row, :n], stamps[src, :n])
        assert (share_lens[len(seqs):] == 0).all()
        return int(sum(n for seq, src, n in zip(seqs, share_rows, share_lens) if src != seq.row))

    sessions: dict[str, list[int]] = {}
    for _ in range(400):
        action = rng.random()
        if action < 0.25:  # a GRPO group of 3 on a fresh question
            prompt = system + list(rng.integers(30, 90, rng.integers(2, 10)))
            for _ in range(3):
                s.add(_seq(prompt, session=f"conv{next(fresh)}", max_tokens=int(rng.integers(2, 12))))
        elif action < 0.35 and sessions:  # the next turn of a finished conversation
            sid = list(sessions)[rng.integers(len(sessions))]
            s.add(_seq(sessions.pop(sid) + list(rng.integers(30, 90, 4)), session=sid, max_tokens=6))
        elif action < 0.38 and s.running:
            s.abort(s.running[rng.integers(len(s.running))].request.request_id)
        elif action < 0.40:
            s.rows.invalidate_warm()  # a weight swap
        for src, dst in s.admit():
            stamps[dst] = stamps[src]
        if (plan := s.plan_prefill()) is not None:
            for seq, n in zip(plan.seqs, plan.chunk):
                stamps[seq.row, seq.prefilled : seq.prefilled + n] = [next(fresh) for _ in range(n)]
            n = len(plan.seqs)
            for seq in s.finish_prefill(plan, rng.integers(30, 90, n), np.zeros(n), 0):
                sessions[seq.request.session_id] = list(seq.prompt) + seq.tokens
        if (plan := s.plan_decode(cfg.decode_steps)) is not None:
            for seq in plan.seqs:  # every step writes, even past a sequence's end
                end = min(seq.position + cfg.decode_steps, cfg.max_model_len)
                stamps[seq.row, seq.position : end] = [next(fresh) for _ in range(end - seq.position)]
            shared_positions += check(plan.seqs, plan.share_rows, plan.share_lens)
            tokens = rng.integers(30, 90, (cfg.decode_steps, len(plan.tokens)))
            tokens[rng.random(tokens.shape) < 0.1] = STOP
            for seq in s.finish_decode(plan, tokens, np.zeros(tokens.shape), 0):
                if len(seq.prompt) + len(seq.tokens) < cfg.max_model_len - 16:
                    sessions[seq.request.session_id] = list(seq.prompt) + seq.tokens
    assert shared_positions > 2_000  # the system prompt is read from one row by many


def test_a_group_prefilled_in_a_reused_row_shares_its_whole_prompt() -> None:
    """A free row taken for a new prompt may keep a few tokens it happens to share (a chat
    template's opening); the group's copies of that row must still share the whole prompt, not
    just those few tokens (seen: an engine that had served another env first lost the lookup
    env's shared system prompt)."""
    cfg = EngineConfig(
        max_model_len=64, max_seqs=4, max_batched_tokens=64, decode_steps=1, decode_batch_buckets=[4],
        prefill_len_buckets=[8, 32], prefill_batch_buckets=[1, 4], min_prefix_reuse=4,
    )
    s = Scheduler(cfg)
    opening = [1, 2]
    for i in range(4):  # every row warm with an unrelated conversation that opens the same way
        s.add(_seq(opening + [100 + i] * 6, max_tokens=1))
    s.admit()
    while (plan := s.plan_prefill()) is not None:
        s.finish_prefill(plan, np.full(len(plan.seqs), STOP), np.zeros(len(plan.seqs)), 0)
    assert s.idle and all(len(w) == 8 for w in s.rows.warm)

    prompt = opening + list(range(30, 50))
    group = [_seq(prompt, max_tokens=4) for _ in range(3)]
    for seq in group:
        s.add(seq)
    while s.waiting or any(seq.prefilling for seq in group):
        s.admit()
        if (plan := s.plan_prefill()) is not None:
            s.finish_prefill(plan, np.full(len(plan.seqs), 7), np.zeros(len(plan.seqs)), 0)
    assert group[0].cached_prompt == 2 and group[1].cached_prompt == len(prompt) - 1
    plan = s.plan_decode(1)
    by_row = {seq.row: (r, n) for seq, r, n in zip(plan.seqs, plan.share_rows, plan.share_lens)}
    canonical = {int(r) for r, _ in by_row.values()}
    assert len(canonical) == 1  # one row read by all three
    assert all(n >= len(prompt) - 1 for _, n in by_row.values())
