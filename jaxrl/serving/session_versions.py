"""The policy version of every token each session's generate answers were sampled with, kept
for the RL loop.

Why: verifiers' train client sends each rollout's trace id as ``X-Session-ID`` and builds the
trace's sampled nodes from the generate answers, but its trace has no per-token field for the
policy version, so ``token_versions`` (``/inference/v1/generate``) stops at the env server. The
embedded server records them here per session, in answer order; the RL loop (in the same
process) takes a rollout's record when the rollout is back and puts it on the trace's sampled
nodes (``jaxrl.orchestrator.traces.attach_token_versions``). Versions are kept run-length
encoded (a handful of integers per answer) and at most ``max_sessions`` sessions (oldest
forgotten first: a rollout whose record was dropped keeps its dispatch version, the old rule).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_SESSIONS = 16384  # far more rollouts than are in flight at once


class SessionVersions:
    """Per session id, each answer's per-token policy versions (thread-safe, bounded, taken once)."""

    def __init__(self, max_sessions: int = MAX_SESSIONS):
        self._max = max_sessions
        self._runs: OrderedDict[str, list[tuple[int, list[tuple[int, int]]]]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, session: str, versions: list[int]) -> None:
        """Append one answer (its per-token versions) to ``session``'s record."""
        runs = [(i, v) for i, v in enumerate(versions) if i == 0 or v != versions[i - 1]]
        with self._lock:
            self._runs.setdefault(session, []).append((len(versions), runs))
            self._runs.move_to_end(session)
            while len(self._runs) > self._max:
                self._runs.popitem(last=False)

    def take(self, session: str) -> list[list[int]] | None:
        """``session``'s answers' per-token versions, in answer order, and forget them (None:
        nothing recorded)."""
        with self._lock:
            answers = self._runs.pop(session, None)
        if answers is None:
            return None
        out = []
        for length, runs in answers:
            ends = [start for start, _ in runs[1:]] + [length]
            out.append([v for (start, v), end in zip(runs, ends) for _ in range(end - start)])
        return out
