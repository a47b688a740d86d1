"""The trainer side: every trainer process serves the shards of each new version it holds.

``Publisher.publish(version, state)`` casts each param to the serving dtype on device (a jitted
cast in the param's own sharding: no gather, no collective), copies the distinct shards this
process holds to host once, and keeps them for pullers: the newest ``keep`` versions (2 by
default, so servers still pulling version n can finish while n + 1 is published). Requests for
any other version fail with ``VersionUnavailable`` naming the versions held.

With ``delta=True`` each publish also compares the new version's host copies with the previous
version's, block by block (``delta.diff``; a block is one element of the serving dtype
unless ``block_bytes`` says otherwise), and the fragment names that version as its
base (``Manifest.base_version``) unless ``full=True``: servers holding the base then pull only the
changed blocks (``delta_of``). Each shard's delta (which blocks changed: ``delta.Changed``, and
their bytes) is made once, at publish, for every server that asks (making it is most of a delta's
CPU: every server asking for its own was twice the pull time with two servers). This costs the
previous version (held anyway: ``keep = 2``), the deltas (the changed blocks' indices and bytes,
or a bit per block when more than 1/8 changed: ``delta.Changed``), and one compare pass per
publish; ``changes(version)`` reports what changed (``Changes``). A delta pull of
version n needs n - 1 too, so it must finish before n + 1 is published (the external backend
waits for every server's answer before its next step); a full pull only before n + 2.

``prepare`` replaces the cast when a server serves another form than the trainer's params: it
maps one param (path, global array) to what is served, an array or a mapping of named arrays
(each published as ``path/name``), on device and in the param's own sharding. The external
rollout backend quantizes this way for servers that serve 8-bit weights (``jaxrl.models.quantize``:
``values`` int8 / fp8 and a float32 ``scale`` per projection), so half a bfloat16 version's
bytes travel and the server swaps them in as they arrive, with no quantize pass of its own.

Under the multi-controller runtime every process calls ``publish`` at the same point (the cast
is a jitted program over the global arrays), as it calls the train step.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Self

import jax
import numpy as np

from jaxrl.weight_transfer.base import Transport, TransportServer, VersionUnavailable, WeightTransferError
from jaxrl.weight_transfer.bits import contiguous, copy_into
from jaxrl.weight_transfer.delta import (
    Changed,
    all_changed,
    delta_payload_bytes,
    diff,
    gather_blocks,
    num_blocks,
)
from jaxrl.weight_transfer.host_buffers import HostBufferPool
from jaxrl.weight_transfer.manifest import (
    Box,
    Manifest,
    ParamEntry,
    Shard,
    box_of,
    local_slices,
    param_leaves,
)
from jaxrl.weight_transfer.transport import get_transport


@dataclass(frozen=True)
class Changes:
    """What changed in a version against its predecessor, on this process's shards."""

    base: int  # the version compared against
    bytes: int  # this process's shards' bytes (serving dtype)
    changed_bytes: int  # the bytes of the changed blocks
    blocks: int
    changed_blocks: int
    sent_bytes: int | None = None  # what the delta sends for these shards (its descriptions and changed bytes); None when published whole

    @property
    def fraction(self) -> float:
        return self.changed_bytes / self.bytes if self.bytes else 0.0


class Publisher:
    """Serves this process's shards of the published versions; see the module docstring.

    ``host`` / ``port``: where to listen (127.0.0.1 and any free port by default; ``address``
    says which); ``advertise``: the host name pullers should use when ``host`` is a wildcard.
    ``delta``: compare each version with the previous and offer it as a delta (tcp only), but
    every ``full_every``-th version (counted from the last full one) as a full version;
    ``block_bytes``: the delta's block (None: one element of ``dtype``; ``delta.py`` says why).
    ``lineage``: this run's id (a fresh one by default). ``prepare``: what each param is served
    as (see the module docstring), given instead of ``dtype`` (``dtype=None``); the default block
    is then one byte (the smallest element of any served dtype).
    """

    def __init__(
        self,
        *,
        dtype: Any | None = "bfloat16",
        transport: str | Transport = "tcp",
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        keep: int = 2,
        delta: bool = False,
        full_every: int = 10,
        block_bytes: int | None = None,
        lineage: str | None = None,
        prepare: Callable[[str, jax.Array], jax.Array | Mapping[str, jax.Array]] | None = None,
    ):
        if keep < (2 if delta else 1):
            raise ValueError(f"Publisher(keep={keep}): keep at least one version (two with delta=True)")
        if (dtype is None) == (prepare is None):
            raise ValueError("Publisher: give either dtype (each param cast to it) or prepare, not both")
        self.dtype = None if dtype is None else jax.numpy.dtype(dtype)
        self._prepare = prepare
        if block_bytes is None:
            block_bytes = 1 if self.dtype is None else self.dtype.itemsize
        if block_bytes < 1 or full_every < 1:
            raise ValueError(
                f"Publisher(block_bytes={block_bytes}, full_every={full_every}): each at least 1"
            )
        self.delta, self.block_bytes, self.full_every = delta, block_bytes, full_every
        self._since_full = 0  # deltas published since the last full version
        self.lineage = lineage or uuid.uuid4().hex
        self.keep = keep
        self._transport = get_transport(transport) if isinstance(transport, str) else transport
        if delta and self._transport.name != "tcp":
            raise ValueError(
                f"Publisher(delta=True): deltas travel over tcp only, not {self._transport.name!r}"
            )
        self._lock = threading.Lock()
        self._versions: dict[int, dict[str, dict[Box, np.ndarray]]] = {}
        # version -> (base, {param: {shard: the delta's parts as they go on the wire}})
        self._deltas: dict[int, tuple[int, dict[str, dict[Box, list[np.ndarray]]]]] = {}
        self._changes: dict[int, Changes] = {}
        self._layout: dict[str, jax.ShapeDtypeStruct] = {}
        # Host copies of CPU shards reuse the memory of versions no longer held (host_buffers
        # says why: fresh pages cost a zero-fill on first touch, Qwen3-0.6B's publish 0.6 s).
        self._buffers = HostBufferPool()
        self._server: TransportServer | None = self._transport.serve(self, host, port, advertise)
        self.address = self._server.address

    @property
    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._versions)

    def publish(
        self,
        version: int,
        state: Any,
        *,
        unchanged_since: Mapping[str, int] | None = None,
        full: bool = False,
    ) -> Manifest:
        """Hold ``state``'s shards on this process (cast to the serving dtype) as ``version``, the
        oldest version beyond ``keep`` dropped; returns this process's manifest fragment (its own
        endpoint only: ``merge_manifests`` joins the processes' fragments). With ``delta``, the
        fragment is a delta against the previous version unless ``full``, there is none, or
        ``full_every - 1`` deltas followed the last full version.

        ``state``: the trainer's param state (nnx.State or any pytree of global jax arrays).
        """
        with self._lock:
            if self._server is None:
                raise RuntimeError("Publisher.publish after stop()")
            if self._versions and version <= max(self._versions):
                raise ValueError(f"publish: version {version} must be newer than {max(self._versions)}")
            base = max(self._versions) if self.delta and self._versions else None
            previous = self._versions.get(base) if base is not None else None
        shards: dict[str, dict[Box, np.ndarray]] = {}
        layout: dict[str, jax.ShapeDtypeStruct] = {}
        params_own = {id(x) for _, x in param_leaves(state)}
        for path, x in self._served(state):  # one leaf on device at a time beyond the params
            shards[path] = self._host_shards(x, id(x) in params_own)
            layout[path] = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        self._buffers.settle()
        changed = self._compare(previous, shards) if previous is not None else None
        full = full or changed is None or self._since_full + 1 >= self.full_every
        self._since_full = 0 if full else self._since_full + 1
        changes = self._count(base, shards, changed) if changed is not None and base is not None else None
        deltas = None
        if changed is not None and not full:
            deltas = {p: {b: _delta_parts(*made) for b, made in boxes.items()} for p, boxes in changed.items()}
            if changes is not None:
                sent = sum(part.nbytes for boxes in deltas.values() for parts in boxes.values() for part in parts)
                changes = dataclasses.replace(changes, sent_bytes=sent)
        with self._lock:
            self._versions[version] = shards
            if changes is not None:
                self._changes[version] = changes
            if deltas is not None and base is not None:
                self._deltas[version] = (base, deltas)
            for old in sorted(self._versions)[: -self.keep]:
                del self._versions[old]  # pulls in flight keep their arrays alive
                self._deltas.pop(old, None)
                self._changes.pop(old, None)
        unchanged_since = unchanged_since or {}
        params = tuple(
            ParamEntry(
                path,
                tuple(x.shape),
                jax.numpy.dtype(x.dtype).name,
                tuple(Shard(0, box) for box in shards[path]),
                unchanged_since.get(path),
            )
            for path, x in layout.items()
        )
        with self._lock:
            self._layout = layout
        return Manifest(
            version, (self.address,), params, self._transport.name, self.lineage,
            None if full else base, None if full else self.block_bytes,
        )  # fmt: skip

    def _served(self, state: Any) -> Iterator[tuple[str, jax.Array]]:
        """``(path, array)`` of every leaf served, made one param at a time: each param cast to
        ``dtype`` on its own sharding, or what ``prepare`` makes of it (a mapping's arrays at
        ``path/name``)."""
        for path, x in param_leaves(state):
            if self._prepare is None:
                assert self.dtype is not None
                yield path, (x if x.dtype == self.dtype else _cast_fn(self.dtype, x.sharding)(x))
                continue
            made = self._prepare(path, x)
            if isinstance(made, Mapping):
                yield from ((f"{path}/{name}", y) for name, y in made.items())
            else:
                yield path, made

    def layout(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The last published version's leaves as served (path -> global shape, dtype and
        sharding): what ``manifest_for`` describes the whole version from, on any process."""
        with self._lock:
            return dict(self._layout)

    def _compare(
        self, previous: dict[str, dict[Box, np.ndarray]], shards: dict[str, dict[Box, np.ndarray]]
    ) -> dict[str, dict[Box, tuple[Changed, np.ndarray]]]:
        """Each shard's delta against ``previous`` (``delta.diff``: its changed blocks and their
        bytes; every block of a new param or box)."""
        out: dict[str, dict[Box, tuple[Changed, np.ndarray]]] = {}
        for path, boxes in shards.items():
            out[path] = {}
            for box, new in boxes.items():
                old = previous.get(path, {}).get(box)
                if old is None or old.shape != new.shape or old.dtype != new.dtype:
                    changed = Changed(blocks := num_blocks(new.nbytes, self.block_bytes), packed=all_changed(blocks))
                    out[path][box] = (changed, gather_blocks(_flat_bytes(new), changed, self.block_bytes))
                else:
                    out[path][box] = diff(old, new, self.block_bytes)
        return out

    def _count(
        self, base: int, shards: dict[str, dict[Box, np.ndarray]], changed: dict[str, dict[Box, tuple[Changed, np.ndarray]]]
    ) -> Changes:
        total = changed_bytes = blocks = changed_n = 0
        for path, boxes in shards.items():
            for box, array in boxes.items():
                c, _ = changed[path][box]
                total += array.nbytes
                blocks += c.blocks
                changed_n += c.count
                changed_bytes += delta_payload_bytes(c, array.nbytes, self.block_bytes)
        return Changes(base, total, changed_bytes, blocks, changed_n)

    def changes(self, version: int) -> Changes | None:
        """What changed in ``version`` against the version before it (``delta`` publishers; None
        for the first version, a version no longer held, or without ``delta``)."""
        with self._lock:
            return self._changes.get(version)

    def delta_of(
        self, version: int, base: int, param: str, shard: Box, region: Box, block_bytes: int
    ) -> list[np.ndarray]:
        """``ShardSource``: ``region``'s delta from ``base`` to ``version`` as it goes on the wire
        (``delta.Changed.encode``, then the changed blocks' bytes); raises
        ``VersionUnavailable`` unless both are held. The ones made at publish are served when the
        region is the whole shard."""
        with self._lock:
            made = self._deltas.get(version)
        if made is not None and made[0] == base and region == shard and block_bytes == self.block_bytes:
            cached = made[1].get(param, {}).get(shard)
            if cached is not None:
                return cached
        new, old = self.shard(version, param, shard), self.shard(base, param, shard)
        where = local_slices(region, shard)
        return _delta_parts(*diff(old[where], new[where], block_bytes))

    def _host_shards(self, x: jax.Array, is_param: bool) -> dict[Box, np.ndarray]:
        """The distinct shards of ``x`` (a served leaf; ``is_param``: the trainer's own array,
        not a cast or prepared copy) on this process, on host."""
        first: dict[Box, jax.Array] = {}
        for s in x.addressable_shards:
            first.setdefault(box_of(s.index, x.shape), s.data)
        boxes = list(first)
        host = jax.device_get([first[b] for b in boxes])
        # On CPU, device_get returns views of the device buffers: when no cast made fresh ones,
        # those are the trainer's own params, which its next step may donate. Copy them.
        alias = is_param and any(d.platform == "cpu" for d in x.sharding.device_set)
        return {b: self._copy(np.asarray(h)) if alias else np.asarray(h) for b, h in zip(boxes, host, strict=True)}

    def _copy(self, x: np.ndarray) -> np.ndarray:
        out = self._buffers.empty(x.shape, x.dtype)
        copy_into(out, x)
        return out

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
            self._deltas.clear()
            self._changes.clear()
        if server is not None:
            server.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _delta_parts(changed: Changed, payload: np.ndarray) -> list[np.ndarray]:
    """A region's delta as it goes on the wire: which blocks changed, then their bytes."""
    return [*changed.encode(), payload]


def _flat_bytes(x: np.ndarray) -> np.ndarray:
    """``x``'s row-major bytes (a copy only when ``x`` is strided)."""
    return contiguous(x).reshape(-1).view(np.uint8)


@functools.cache
def _cast_fn(dtype: Any, sharding: jax.sharding.Sharding) -> Any:
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)
