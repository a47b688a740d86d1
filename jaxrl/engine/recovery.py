"""Recovery of the engine after a failed step, and the abort of everything it holds.

A failed step is a bug, not bad input: the requests in flight fail with the error, the
scheduler starts over (empty rows, no cached prefixes), donated buffers the failed call
consumed are rebuilt, and the engine keeps serving. When even that fails, every request fails
and the engine reports itself unhealthy (``jaxrl.serve`` then exits for a supervisor to restart).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxrl.engine import weights as W
from jaxrl.engine.scheduler import Scheduler
from jaxrl.models.decoder import KVCache

if TYPE_CHECKING:
    from jaxrl.engine.engine import Engine


class Recovery:
    """``Engine``'s failure handling (a mixin over the state ``Engine.__init__`` sets up)."""

    def _abort_all(self: Engine) -> None:
        """Finish every request still queued or running with finish_reason "abort"."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for seq in inbox:
            self._sched.add(seq)
        for seq in [*self._sched.waiting, *self._sched.running]:
            self._sched.abort(seq.request.request_id)
            self._deliver([seq])

    def _recover(self: Engine, exc: BaseException) -> None:
        """After a failed step: fail the requests the scheduler holds (the one that broke the
        step cannot be told from the others of its batch) with ``exc``, start the scheduler over
        (empty rows, no cached prefixes) and rebuild the KV cache if the failed call consumed it
        (donation). Requests submitted since the step began stay queued."""
        with self._lock:
            queued = {seq.request.request_id for seq in self._inbox}
            failed = {rid: f for rid, f in self._futures.items() if rid not in queued}
            for rid in failed:
                del self._futures[rid]
            self._aborts.clear()
        for f in failed.values():
            if not f.done():
                f.set_exception(RuntimeError(f"engine step failed: {exc!r}"))
        stats = self._sched.stats
        self._sched = Scheduler(self.config)
        self._sched.stats = stats
        old = (self._cache.k, self._cache.v)
        if any(a.is_deleted() for a in old):
            self._cache = KVCache(*(W.zeros_like_sharded(a.shape, a.dtype, a.sharding) for a in old))
        if any(a.is_deleted() for a in (self._counts.output, self._counts.prompt)):
            self._counts = self._layout.zero_counts()

    def _fail(self: Engine, exc: BaseException) -> None:
        with self._lock:
            self._error = exc
            futures, self._futures = self._futures, {}
            pending, self._pending = self._pending, None
        for f in futures.values():
            if not f.done():
                f.set_exception(exc)
        for w in pending.waiters if pending else []:
            w.set()
