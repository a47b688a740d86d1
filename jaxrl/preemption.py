"""SIGTERM / SIGINT (a preempted TPU VM, a Ctrl-C) become a flag the training loop polls:
it stops dispatching work and writes a checkpoint; the entry point says "interrupted at step N —
rerun with --resume" and exits 130 after a Ctrl-C, 0 after SIGTERM (a preemption the job's
supervisor restarts), and ``--resume`` continues."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType


class RunAborted(RuntimeError):
    """A run that cannot go on (e.g. an env server that keeps dying) after it wrote a checkpoint
    and ``result.json``: the entry point prints the message and exits 1; ``--resume`` continues."""


class StopRequest:
    """Context manager installing the handlers (main thread only) and restoring them on exit."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._previous: dict[int, object] = {}
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str = "requested") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signal.Signals(signum).name)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
