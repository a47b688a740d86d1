"""The transport interface and the errors of this package.

A transport has a server side (a trainer's publisher serves its host copies of the shards it
holds, ``ShardSource``) and a client side (a server's puller fetches boxes of them into host
buffers it owns). ``transport.get_transport(name)`` gives one by name: "tcp" (``tcp.py``) or
"jax" (``jax_transport.py``, ``jax.experimental.transfer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from jaxrl.weight_transfer.delta import Patch
from jaxrl.weight_transfer.manifest import Box
from jaxrl.weight_transfer.plan import Pull


class WeightTransferError(RuntimeError):
    """Base of every error of this package."""


class VersionUnavailable(WeightTransferError):
    """A publisher asked for a version it does not hold (never published, or evicted)."""


class RemoteError(WeightTransferError):
    """An endpoint answered a request with an error (its message is this error's)."""


class FetchFailed(WeightTransferError):
    """Raised by ``Connection.fetch``: ``pull`` was being fetched when ``cause`` happened."""

    def __init__(self, pull: Pull, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.pull, self.cause = pull, cause


class ShardSource(Protocol):
    def shard(self, version: int, param: str, box: Box) -> np.ndarray:
        """The host copy of ``param``'s shard ``box`` in ``version``; raises ``VersionUnavailable``."""
        ...

    def delta_of(
        self, version: int, base: int, param: str, shard: Box, region: Box, block_bytes: int
    ) -> list[np.ndarray]:
        """``region``'s delta from ``base`` to ``version`` as it goes on the wire: which of its
        ``block_bytes`` blocks changed (``delta.Changed.encode``), then their bytes in ``version``."""
        ...


class TransportServer(Protocol):
    address: str  # "host:port" pullers connect to

    def stop(self) -> None: ...


class Connection(Protocol):
    def fetch(
        self,
        version: int,
        items: Sequence[tuple[Pull, np.ndarray | Patch]],
        deadline: float,
        delta: tuple[int, int] | None = None,
    ) -> None:
        """Fill each C-contiguous ``out`` (the pull's region shape and dtype) with the pull's
        bytes by ``deadline`` (``time.monotonic()``); raises ``FetchFailed`` naming the pull it
        was on (the cause: ``RemoteError``, ``OSError``, ``TimeoutError``). ``delta = (base,
        block_bytes)``: each item's second part is a ``delta.Patch`` (its ``out`` holds the base
        version's bytes or is given them from ``base``), and only the changed blocks are sent and
        written over the base (transports without deltas raise ``WeightTransferError``)."""
        ...

    def close(self) -> None: ...


class Transport(Protocol):
    name: str

    def serve(
        self, source: ShardSource, host: str, port: int, advertise: str | None = None
    ) -> TransportServer: ...

    def connect(self, address: str, deadline: float) -> Connection: ...
