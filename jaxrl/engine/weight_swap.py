"""Weight swaps of the engine: new weights are placed on the engine's shardings in the caller's
thread and take effect between engine steps only.

``weight_update`` = "drain": admission pauses and requests in flight finish on the old weights
first; "immediate": at the next step (requests in flight continue on the new weights). The policy
version counter starts at 0 and every completion records the version that sampled each of its
tokens (``Completion.token_versions``). Cached prefixes are dropped on every update: their keys/values came
from the old weights.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flax import nnx

from jaxrl.engine import weights as W
from jaxrl.models.decoder import Decoder
from jaxrl.models.hf_io import load_decoder

if TYPE_CHECKING:
    from jaxrl.engine.engine import Engine


class StaleVersion(ValueError):
    """A weight update's version is not above the version served or already pending."""


@dataclass
class _Update:
    state: nnx.State
    version: int
    waiters: list[threading.Event] = field(default_factory=list)


class WeightSwaps:
    """``Engine``'s weight hand-off and swap (a mixin: the state it reads is set up by
    ``Engine.__init__``; split out so the step loop reads apart from the swap protocol)."""

    def update_weights_from_state(
        self: Engine, state: nnx.State | Decoder, *, version: int | None = None, wait: bool = True
    ) -> int:
        """Hand new weights (the trainer's params pytree, any sharding) to the engine.

        The copy to the engine's shardings happens in the calling thread; the swap happens
        between engine steps (see ``EngineConfig.weight_update``). Returns the policy version
        served after the swap when ``wait``, else the version the update will have.
        """
        placed = W.place_state(state, self._stacked, self._param_shardings)
        return self._enqueue_update(self._served(placed), version, wait)

    def update_weights_from_path(
        self: Engine, path: str | Path, *, version: int | None = None, wait: bool = True
    ) -> int:
        """Load a Hugging Face model directory (same architecture) as the new weights."""
        model = load_decoder(
            path, param_dtype=self._param_dtype, dtype=self._compute_dtype, sharding_fn=self._sharding_fn
        )
        if model.arch != self.arch:
            raise ValueError(f"update_weights: {path} holds a different architecture than the served model")
        return self._enqueue_update(self._served(nnx.state(model)), version, wait)

    def _enqueue_update(self: Engine, state: nnx.State, version: int | None, wait: bool) -> int:
        done = threading.Event()
        with self._lock:
            latest = self._pending.version if self._pending else self._version
            if version is None:
                version = latest + 1
            if version <= latest:
                raise StaleVersion(f"weight update version {version} must be greater than {latest}")
            if self._pending is None:
                self._pending = _Update(state, version, [done])
            else:
                self._pending.state, self._pending.version = state, version
                self._pending.waiters.append(done)
            self._lock.notify_all()
        if not wait:
            return version
        if self._thread is None:
            while not done.is_set():
                self.step()
        done.wait()
        if self._error is not None:
            raise RuntimeError(f"engine failed: {self._error!r}")
        return self._version

    def _maybe_swap_weights(self: Engine) -> bool:
        """Apply a pending update when the policy allows; True while admission must pause."""
        with self._lock:
            update = self._pending
            if update is None:
                return False
            if self.config.weight_update == "drain" and self._sched.running:
                return True
            self._pending = None
            self._state, self._version = update.state, update.version
        self._sched.rows.invalidate_warm()
        for w in update.waiters:
            w.set()
        return False
