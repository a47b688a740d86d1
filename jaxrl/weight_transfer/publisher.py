"""The trainer side: every trainer process serves the shards of each new version it holds.

``Publisher.publish(version, state)`` casts each param to the serving dtype on device (a jitted
cast in the param's own sharding: no gather, no collective), copies the distinct shards this
process holds to host once, and keeps them for pullers: the newest ``keep`` versions (2 by
default, so servers still pulling version n can finish while n + 1 is published). Requests for
any other version fail with ``VersionUnavailable`` naming the versions held.

Under the multi-controller runtime every process calls ``publish`` at the same point (the cast
is a jitted program over the global arrays), as it calls the train step.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any, Self

import jax
import numpy as np

from jaxrl.weight_transfer.base import Transport, TransportServer, VersionUnavailable, WeightTransferError
from jaxrl.weight_transfer.manifest import Box, Manifest, ParamEntry, Shard, box_of, param_leaves
from jaxrl.weight_transfer.transport import get_transport


class Publisher:
    """Serves this process's shards of the published versions; see the module docstring.

    ``host`` / ``port``: where to listen (127.0.0.1 and any free port by default; ``address``
    says which); ``advertise``: the host name pullers should use when ``host`` is a wildcard.
    """

    def __init__(
        self,
        *,
        dtype: Any = "bfloat16",
        transport: str | Transport = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        keep: int = 2,
    ):
        if keep < 1:
            raise ValueError(f"Publisher(keep={keep}): keep at least one version")
        self.dtype = jax.numpy.dtype(dtype)
        self.keep = keep
        self._transport = get_transport(transport) if isinstance(transport, str) else transport
        self._lock = threading.Lock()
        self._versions: dict[int, dict[str, dict[Box, np.ndarray]]] = {}
        self._server: TransportServer | None = self._transport.serve(self, host, port, advertise)
        self.address = self._server.address

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def publish(
        self, version: int, state: Any, *, unchanged_since: Mapping[str, int] | None = None
    ) -> Manifest:
        """Hold ``state``'s shards on this process (cast to the serving dtype) as ``version``, the
        oldest version beyond ``keep`` dropped; returns this process's manifest fragment (its own
        endpoint only: ``merge_manifests`` joins the processes' fragments).

        ``state``: the trainer's param state (nnx.State or any pytree of global jax arrays).
        """
        with self._lock:
            if self._server is None:
                raise RuntimeError("Publisher.publish after stop()")
            if self._versions and version <= max(self._versions):
                raise ValueError(f"publish: version {version} must be newer than {max(self._versions)}")
        shards: dict[str, dict[Box, np.ndarray]] = {}
        for path, x in param_leaves(state):
            shards[path] = self._host_shards(x)
        with self._lock:
            self._versions[version] = shards
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]  # pulls in flight keep their arrays alive
        unchanged_since = unchanged_since or {}
        params = tuple(
            ParamEntry(
                path,
                tuple(x.shape),
                self.dtype.name,
                tuple(Shard(0, box) for box in shards[path]),
                unchanged_since.get(path),
            )
            for path, x in param_leaves(state)
        )
        return Manifest(version, (self.address,), params, self._transport.name)

    def _host_shards(self, x: jax.Array) -> dict[Box, np.ndarray]:
        """The distinct shards of ``x`` on this process, in the serving dtype, on host."""
        cast = x if x.dtype == self.dtype else _cast_fn(self.dtype, x.sharding)(x)
        first: dict[Box, jax.Array] = {}
        for s in cast.addressable_shards:
            first.setdefault(box_of(s.index, x.shape), s.data)
        boxes = list(first)
        host = jax.device_get([first[b] for b in boxes])
        # On CPU, device_get returns views of the device buffers: when no cast made fresh ones,
        # those are the trainer's own params, which its next step may donate. Copy them.
        alias = cast is x and any(d.platform == "cpu" for d in x.sharding.device_set)
        return {b: np.array(h) if alias else np.asarray(h) for b, h in zip(boxes, host, strict=True)}

    def shard(self, version: int, param: str, box: Box) -> np.ndarray:
        """``ShardSource``: the host copy of one shard; raises ``VersionUnavailable``."""
        with self._lock:
            held = self._versions.get(version)
            if held is None:
                raise VersionUnavailable(
                    f"version {version} is not held by the publisher at {self.address} "
                    f"(it holds versions {sorted(self._versions)}; it keeps the newest {self.keep})"
                )
        array = held.get(param, {}).get(box)
        if array is None:
            raise WeightTransferError(
                f"the publisher at {self.address} holds no shard {box} of {param!r} in version {version}"
            )
        return array

    def stop(self) -> None:
        """Stop serving and drop every version (idempotent)."""
        with self._lock:
            server, self._server = self._server, None
            self._versions.clear()
        if server is not None:
            server.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@functools.cache
def _cast_fn(dtype: Any, sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)
