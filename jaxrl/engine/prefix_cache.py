"""Prefix reuse over the KV cache's rows: which sequence owns each row, which tokens a
freed ("warm") row still holds, which session it served, and where its leading positions came
from (the scheduler's docstring tells the policy; this is the table it reads and writes)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jaxrl.engine.requests import Sequence


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


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
