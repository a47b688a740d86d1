"""The server side: pull one version's weights straight into this process's device buffers.

``pull_weights(manifest, target)`` plans the pulls (``plan.plan_pulls``) for the target
shardings, then works through the server's shards group by group, each group at most
``host_bytes`` of host memory: a param's shard larger than that is cut along its first
dimension, which for the decoder's stacked weights is the layer axis, so a group is a range of
layers of one or more weights. For each group it pulls every piece from every endpoint at once
(``connections`` per endpoint), assembles each target shard in host memory and ``device_put``s
it to the devices that hold it (a shard cut in rows is written into a device buffer in place,
by a donated ``dynamic_update_slice``); the host buffers are let go before the next group. A
server passes a ``HostBufferPool`` (``buffers=``) so that versions reuse the host memory of the
ones it no longer serves (``host_buffers`` says why and when a buffer is free).

A delta manifest (``Manifest.base_version``) is applied as a delta only on top of exactly its
base: ``previous`` must be the state pulled as ``(have_lineage, have_version) == (manifest.lineage,
manifest.base_version)`` (``applies_as_delta``). Each host buffer then starts with the previous
state's bytes there (``_Fetcher._start``: the pooled buffer the base was pulled into when it is
free, else the base it serves, copied in as the changed blocks are written) and only the
changed blocks are fetched over it; new device buffers are made as for a full pull, so the
previous state (still being served) is never written. On GPUs (``on_device``) a delta skips
host buffers: each piece's changed elements go to its devices as offsets and values and are
scattered into a copy of the base's shard there, so a delta step moves ~6 bytes a changed
element to the device instead of the whole version. Any other server pulls the version whole:
a publisher serves every version it holds in full.

What it returns has ``target``'s tree structure with a ``jax.Array`` on the target sharding for
each leaf: for the engine, ``target`` is its param state's abstract form (the runner's
``_stacked``: an ``nnx.State`` of ``jax.ShapeDtypeStruct``s with the engine's shardings) and the
result is what ``Engine.update_weights_from_state`` takes. Either every param arrives, by the
deadline (``timeout_s`` for the whole version), or ``PullError`` names the endpoint and the
param that failed; a partial state is never returned.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Self

import jax
import numpy as np
from jax import lax

from jaxrl.weight_transfer.base import Connection, FetchFailed, Transport, WeightTransferError
from jaxrl.weight_transfer.bits import copy_into
from jaxrl.weight_transfer.delta import Patch, element_offsets, write_regions
from jaxrl.weight_transfer.host_buffers import HostBufferPool, aligned_empty
from jaxrl.weight_transfer.manifest import (
    Box,
    Manifest,
    box_shape,
    box_size,
    intersect,
    local_slices,
    param_leaves,
    param_path,
)
from jaxrl.weight_transfer.plan import Plan, Pull, TargetPiece, plan_pulls
from jaxrl.weight_transfer.transport import get_transport


class PullError(WeightTransferError):
    """A version could not be pulled; names the endpoint and param, the cause chained."""

    def __init__(self, message: str, *, endpoint: str | None = None, param: str | None = None):
        super().__init__(message)
        self.endpoint, self.param = endpoint, param


@dataclass(frozen=True)
class Chunk:
    """Rows ``box`` (a sub-box of ``piece.box`` cut along the first dimension) of a target piece."""

    piece: TargetPiece
    box: Box

    @property
    def whole(self) -> bool:
        return self.box == self.piece.box

    @property
    def nbytes(self) -> int:
        return box_size(self.box) * (self.piece.pulls[0].itemsize if self.piece.pulls else 0)


def chunk_groups(plan: Plan, host_bytes: int) -> list[list[Chunk]]:
    """The plan's target pieces cut into row chunks of at most ``host_bytes`` (at least one row)
    and packed, in order, into groups of at most ``host_bytes`` (a single row larger than that
    is a group of its own)."""
    chunks = [chunk for piece in plan.pieces for chunk in _row_chunks(piece, host_bytes)]
    return _pack(chunks, [c.nbytes for c in chunks], host_bytes)


def _pack(items: list[Any], sizes: list[int], limit: int) -> list[list[Any]]:
    """``items`` in order, in groups of at most ``limit`` bytes by ``sizes`` (a larger one alone)."""
    groups: list[list[Any]] = [[]]
    used = 0
    for item, size in zip(items, sizes, strict=True):
        if groups[-1] and used + size > limit:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += size
    return [g for g in groups if g]


def _row_chunks(piece: TargetPiece, host_bytes: int) -> list[Chunk]:
    itemsize = piece.pulls[0].itemsize if piece.pulls else 1
    if not piece.box or box_size(piece.box) * itemsize <= host_bytes:
        return [Chunk(piece, piece.box)]
    (r0, r1), rest = piece.box[0], piece.box[1:]
    row = box_size(rest) * itemsize
    step = max(1, host_bytes // max(row, 1))
    return [Chunk(piece, ((a, min(a + step, r1)), *rest)) for a in range(r0, r1, step)]


def pull_weights(
    manifest: Manifest,
    target: Any,
    *,
    timeout_s: float = 300.0,
    host_bytes: int = 1 << 30,
    connections: int = 4,
    previous: Any = None,
    have_version: int | None = None,
    have_lineage: str | None = None,
    buffers: HostBufferPool | None = None,
    on_device: bool | None = None,
) -> Any:
    """``manifest``'s version pulled onto ``target``'s shardings; see the module docstring.

    ``target``: a pytree of ``jax.ShapeDtypeStruct`` (with shardings), its leaf paths the
    manifest's param paths, shapes and dtypes equal. ``previous`` (the same tree of arrays,
    pulled as version ``have_version`` of ``have_lineage``) supplies params the manifest marks
    unchanged since then, and the base of a delta (``applies_as_delta``). ``on_device``: write a
    delta's changed elements on the devices (``_Fetcher.apply_on_device``) rather than into host
    buffers that are then put on the devices whole; None: on GPUs (the host-to-device copy of a
    whole version is what a delta step costs there), not on CPUs (the host buffer is the device
    buffer) nor TPUs (their scatter is not measured yet: docs/benchmarks.md).
    """
    deadline = time.monotonic() + timeout_s
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = {path: x for path, x in param_leaves(target)}
    _check_target(manifest, leaves)
    plan = plan_pulls(manifest, {p: x.sharding for p, x in leaves.items()}, have_version=have_version)
    arrays: dict[str, Any] = {}
    if plan.reused:
        if previous is None:
            raise ValueError(
                f"pull_weights: {list(plan.reused)} are unchanged since a version held, pass previous="
            )
        held = dict(param_leaves(previous))
        arrays.update({p: held[p] for p in plan.reused})
    devices = {d.id: d for x in leaves.values() for d in x.sharding.addressable_devices}
    placed: dict[str, dict[int, jax.Array]] = {p: {} for p in leaves if p not in arrays}
    base = None
    if previous is not None and applies_as_delta(manifest, have_lineage, have_version):
        base = dict(param_leaves(previous))
    host_plan = plan
    with _Fetcher(manifest, get_transport(manifest.transport), connections, deadline, base, buffers) as fetcher:
        if base is not None and (on_device if on_device is not None else _gpu(devices.values())):
            scattered = [p for p in plan.pieces if p.pulls and _scatters_on_device(manifest, p)]
            sizes = [box_size(p.box) * p.pulls[0].itemsize for p in scattered]
            for pieces in _pack(scattered, sizes, host_bytes):  # a delta is at most its pieces' bytes on host
                fetcher.apply_on_device(pieces, devices, placed)
            host_plan = dataclasses.replace(plan, pieces=tuple(p for p in plan.pieces if p not in scattered))
        for group in chunk_groups(host_plan, host_bytes):
            host = fetcher.fetch_group(group)
            _place(group, host, devices, placed)
            del host
    if buffers is not None:
        buffers.settle()
    for path, per_device in placed.items():
        x = leaves[path]
        arrays[path] = jax.make_array_from_single_device_arrays(
            x.shape, x.sharding, [per_device[d.id] for d in _addressable(x.sharding)]
        )
    return jax.tree_util.tree_unflatten(treedef, [arrays[param_path(k)] for k, _ in flat])


def _gpu(devices: Iterable[Any]) -> bool:
    return any(d.platform in ("gpu", "cuda", "rocm") for d in devices)


def _scatters_on_device(manifest: Manifest, piece: TargetPiece) -> bool:
    """Whether a delta piece can be scattered on its devices: blocks of one element, offsets
    (the padding's past the end included, ``_bucket``) that fit ``int32``, jax's index width."""
    size = box_size(piece.box)
    return manifest.block_bytes == piece.pulls[0].itemsize and size + _step(size) < 2**31


def _bucket(n: int) -> int:
    """``n`` changed elements padded to a few sizes, so a device scatter compiles for few shapes:
    rounded up to a multiple of ``_step(n)`` (at most 12.5% more), at least 1024."""
    return -(-max(n, 1) // _step(n)) * _step(n)


def _step(n: int) -> int:
    """An eighth of ``n``'s power of two, at least 1024: ``_bucket``'s padding stays below it."""
    return max(1024, 1 << max(0, n.bit_length() - 4))


def applies_as_delta(manifest: Manifest, have_lineage: str | None, have_version: int | None) -> bool:
    """Whether a server whose last pulled version is ``have_version`` of ``have_lineage`` pulls
    ``manifest`` as a delta: only when that is exactly the manifest's base; else it pulls whole."""
    return (
        manifest.base_version is not None
        and have_version == manifest.base_version
        and have_lineage == manifest.lineage
    )


def _addressable(sharding: jax.sharding.Sharding) -> list[Any]:
    return sorted(sharding.addressable_devices, key=lambda d: d.id)


def _check_target(manifest: Manifest, leaves: dict[str, Any]) -> None:
    names = {p.path for p in manifest.params}
    missing, extra = sorted(names - set(leaves)), sorted(set(leaves) - names)
    if missing or extra:
        raise ValueError(f"pull_weights: the target lacks {missing} and the manifest lacks {extra}")
    for p in manifest.params:
        x = leaves[p.path]
        if x.sharding is None:
            raise ValueError(
                f"pull_weights: the target's {p.path} has no sharding (give ShapeDtypeStructs one)"
            )
        if tuple(x.shape) != p.shape or jax.numpy.dtype(x.dtype).name != p.dtype:
            raise ValueError(
                f"pull_weights: {p.path} is {p.dtype}{list(p.shape)} in version {manifest.version}, "
                f"the target expects {jax.numpy.dtype(x.dtype).name}{list(x.shape)}"
            )


def _place(
    group: list[Chunk],
    buffers: list[np.ndarray],
    devices: dict[int, Any],
    placed: dict[str, dict[int, jax.Array]],
) -> None:
    """Put a group's host buffers on their devices: whole pieces as they are, row chunks into
    the piece's device buffer (created on the first chunk)."""
    where, on_device = [], []
    for chunk, buf in zip(group, buffers, strict=True):
        for i, d in enumerate(chunk.piece.devices):
            # A CPU device takes an aligned host buffer as it is (no copy); a buffer replicated
            # on several is copied for all but the first, so no two devices share memory.
            on_device.append(jax.device_put(buf, devices[d], may_alias=None if i == 0 else False))
            where.append((chunk, d))
    for (chunk, d), x in zip(where, on_device, strict=True):
        per_device = placed[chunk.piece.param]
        if chunk.whole:
            per_device[d] = x
            continue
        if d not in per_device:
            per_device[d] = _zeros(chunk.piece.shape, x.dtype, devices[d])
        row = chunk.box[0][0] - chunk.piece.box[0][0]
        per_device[d] = _write_rows(per_device[d], x, np.int32(row))


@jax.jit
def _scatter_elements(base: jax.Array, offsets: jax.Array, values: jax.Array) -> jax.Array:
    """A copy of ``base`` with its row-major elements ``offsets`` set to ``values`` (offsets past
    the end are padding, dropped)."""
    flat = base.reshape(-1).at[offsets].set(values, mode="drop", unique_indices=True)
    return flat.reshape(base.shape)


def _shape_only(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An array of ``shape`` and ``dtype`` over one element of memory (every stride 0): what a
    delta fetched for a device scatter is described against; nothing reads or writes it."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape=shape, strides=(0,) * len(shape))


def _zeros(shape: tuple[int, ...], dtype: Any, device: Any) -> jax.Array:
    return jax.numpy.zeros(shape, dtype, device=device)


@functools.partial(jax.jit, donate_argnums=0)
def _write_rows(buf: jax.Array, rows: jax.Array, start: jax.Array) -> jax.Array:
    return lax.dynamic_update_slice_in_dim(buf, rows, start, 0)


class _Fetcher:
    """Connections to every endpoint (``connections`` each, opened on demand, reused across
    groups) and the threads that fill a group's buffers from them."""

    def __init__(
        self,
        manifest: Manifest,
        transport: Transport,
        connections: int,
        deadline: float,
        base: dict[str, jax.Array] | None = None,
        buffers: HostBufferPool | None = None,
    ):
        self.manifest, self.transport, self.deadline = manifest, transport, deadline
        self.empty = aligned_empty if buffers is None else buffers.empty
        self.buffers = buffers
        self.connections = connections
        self.base = base  # a delta's base arrays by param path; None: a full pull
        self.delta = None if base is None else (manifest.base_version, manifest.block_bytes)
        self._idle: list[queue.SimpleQueue[Connection]] = [queue.SimpleQueue() for _ in manifest.endpoints]
        self._open: list[Connection] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, len(manifest.endpoints) * connections), "weights-pull")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for c in conns:  # wakes any thread still blocked on one (a failed or timed-out pull)
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def fetch_group(self, group: list[Chunk]) -> list[np.ndarray]:
        started = [self._start(c) for c in group]
        buffers = [buf for buf, _, _ in started]
        items: dict[int, list[tuple[Pull, np.ndarray | Patch]]] = {}
        copies: list[tuple[np.ndarray, np.ndarray]] = []  # (temporary, destination) for strided destinations
        merged: list[tuple[np.ndarray, np.ndarray, list[Any]]] = []  # (buffer, base, its regions' deltas)
        for chunk, (buf, base, merge) in zip(group, started, strict=True):
            later: list[Any] | None = None
            if merge:
                assert base is not None
                later = []
                merged.append((buf, base, later))
            for pull in chunk.piece.pulls:
                if (region := intersect(pull.region, chunk.box)) is None:
                    continue
                # A delta's region stays whole: the publisher reuses its bitmap of a whole shard.
                for part in [region] if self.delta else _cut(region, pull.itemsize, self.connections):
                    pieces = [part] if self.delta else _contiguous_parts(part, chunk.box, pull.itemsize)
                    for piece in pieces:
                        sub = Pull(pull.endpoint, pull.param, pull.shard, piece, pull.itemsize)
                        where = local_slices(piece, chunk.box)
                        dst = buf[where]
                        if self.delta is None:
                            if not dst.flags.c_contiguous:
                                tmp = self.empty(dst.shape, dst.dtype)
                                copies.append((tmp, dst))
                                dst = tmp
                            items.setdefault(pull.endpoint, []).append((sub, dst))
                            continue
                        patch = Patch(dst, None if base is None or merge else base[where], later)
                        # A delta of whole elements is written through a strided view (scatter_blocks).
                        if not dst.flags.c_contiguous and self.delta[1] != dst.itemsize:
                            tmp = self.empty(dst.shape, dst.dtype)
                            copies.append((tmp, dst))
                            patch = Patch(tmp, dst if base is None else patch.base)
                        items.setdefault(pull.endpoint, []).append((sub, patch))
        self._run(items)
        for buf, base, later in merged:
            assert self.delta is not None
            write_regions(buf, base, later, self.delta[1])
        for tmp, dst in copies:
            copy_into(dst, tmp)
        if self.buffers is not None:  # what each buffer now holds, for the next delta (``_start``)
            for chunk, buf in zip(group, buffers, strict=True):
                self.buffers.tag(buf, self._key(self.manifest.version, chunk))
        return buffers

    def _run(self, items: dict[int, list[tuple[Pull, np.ndarray | Patch]]]) -> None:
        """Fetch every item, each endpoint's over its connections at once, by the deadline."""
        futures: dict[Future[None], tuple[int, Pull]] = {}
        for endpoint, its in items.items():
            for batch in _split(its, self.connections):
                futures[self._pool.submit(self._fetch, endpoint, batch)] = (endpoint, batch[0][0])
        done, pending = wait(
            futures, timeout=max(0.0, self.deadline - time.monotonic()), return_when=FIRST_EXCEPTION
        )
        for f in done:
            if (e := f.exception()) is not None:
                endpoint, pull = futures[f]
                if isinstance(e, FetchFailed):
                    pull, e = e.pull, e.cause
                raise self._error(endpoint, pull.param, f"{type(e).__name__}: {e}") from e
        if pending:
            endpoint, pull = futures[next(iter(pending))]
            raise self._error(endpoint, pull.param, "TimeoutError: no answer before the pull's deadline")

    def apply_on_device(
        self, pieces: list[TargetPiece], devices: dict[int, Any], placed: dict[str, dict[int, jax.Array]]
    ) -> None:
        """A delta's pieces written on their devices: each region's changed elements fetched
        (their gaps and values only: no host buffer of the piece), turned into offsets in the
        piece, and scattered into a copy of the base's shard on each device that holds the piece.
        What crosses to the device is the changed elements (~6 bytes each), not the version: a
        whole 8B bfloat16 version is 16.4 GB to each server's devices, 2.2 s at the H200's
        7.6 GB/s host-to-device, where an RL step's 3% is ~1.4 GB."""
        assert self.base is not None
        items: dict[int, list[tuple[Pull, np.ndarray | Patch]]] = {}
        found: list[tuple[TargetPiece, Box, list[Any]]] = []
        for piece in pieces:
            for pull in piece.pulls:
                later: list[Any] = []
                found.append((piece, pull.region, later))
                dtype = _dtype(self.manifest, piece.param)
                items.setdefault(pull.endpoint, []).append((pull, Patch(_shape_only(box_shape(pull.region), dtype), None, later)))
        self._run(items)
        parts: dict[int, list[tuple[Box, Any, np.ndarray]]] = {}
        for piece, region, later in found:
            ((_, changed, payload),) = later
            parts.setdefault(id(piece), []).append((region, changed, payload))
        for piece in pieces:
            dtype = _dtype(self.manifest, piece.param)
            got = parts[id(piece)]
            offsets = element_offsets(piece.box, [(region, changed) for region, changed, _ in got])
            values = np.concatenate([payload for _, _, payload in got]).view(dtype) if got else np.zeros(0, dtype)
            size = box_size(piece.box)
            pad = _bucket(offsets.size) - offsets.size
            offsets = np.concatenate([offsets, np.arange(size, size + pad, dtype=np.int32)])  # past the end: dropped
            values = np.concatenate([values, np.zeros(pad, dtype)])
            base = {s.device.id: s.data for s in self.base[piece.param].addressable_shards}
            for d in piece.devices:
                on = devices[d]
                placed[piece.param][d] = _scatter_elements(
                    base[d], jax.device_put(offsets, on), jax.device_put(values, on)
                )

    def _key(self, version: int | None, chunk: Chunk) -> tuple[Any, ...]:
        return (self.manifest.lineage, version, chunk.piece.param, chunk.box)

    def _start(self, chunk: Chunk) -> tuple[np.ndarray, np.ndarray | None, bool]:
        """A host buffer for ``chunk`` and, for a delta, where its base's bytes come from, and
        whether its regions' deltas are written together. The base: None when the buffer holds
        it already (the pooled buffer the base was pulled into, free again: a TPU / GPU server's
        staging buffer, so no read back of the whole base from the device, 1.7 GB/s on an H200),
        else the base's rows of ``chunk`` on the device (a view on CPU, which serves from its
        pulled buffers: they are not free), copied in as the delta is written: by each region
        (``delta.Patch``) where its runs of contiguous memory are long, else by the chunk once all
        its regions' deltas are in (``delta.write_regions``, True): one pass over the memory
        either way, not a copy and then a scatter. When the pulls do not cover the chunk, or
        its blocks are not elements, the base is copied in first."""
        shape, dtype = box_shape(chunk.box), _dtype(self.manifest, chunk.piece.param)
        if self.base is None:
            return self.empty(shape, dtype), None, False
        if self.buffers is not None:
            if (buf := self.buffers.take(self._key(self.manifest.base_version, chunk), shape, dtype)) is not None:
                return buf, None, False
        buf, base = self.empty(shape, dtype), self._base_bytes(chunk)
        regions = [r for p in chunk.piece.pulls if (r := intersect(p.region, chunk.box)) is not None]
        assert self.delta is not None
        if sum(map(box_size, regions)) != box_size(chunk.box) or self.delta[1] != buf.itemsize:
            copy_into(buf, base)
            return buf, None, False
        return buf, base, min(_run(r, chunk.box) for r in regions) < MIN_RUN

    def _base_bytes(self, chunk: Chunk) -> np.ndarray:
        """The delta's base bytes of ``chunk``: its rows of the previous state's shard on the
        piece's first device (a view on CPU devices, a device-to-host copy elsewhere)."""
        assert self.base is not None
        device = chunk.piece.devices[0]
        shard = next(s for s in self.base[chunk.piece.param].addressable_shards if s.device.id == device)
        return np.asarray(shard.data)[local_slices(chunk.box, chunk.piece.box)]

    def _error(self, endpoint: int, param: str, why: str) -> PullError:
        address = self.manifest.endpoints[endpoint]
        return PullError(
            f"weight pull of version {self.manifest.version} failed at endpoint {endpoint} ({address}), "
            f"param {param!r}: {why}",
            endpoint=address,
            param=param,
        )

    def _fetch(self, endpoint: int, batch: list[tuple[Pull, np.ndarray | Patch]]) -> None:
        try:
            conn = self._idle[endpoint].get_nowait()
        except queue.Empty:
            try:
                conn = self.transport.connect(self.manifest.endpoints[endpoint], self.deadline)
            except OSError as e:
                raise FetchFailed(batch[0][0], e) from e
            with self._lock:
                self._open.append(conn)
        try:
            conn.fetch(self.manifest.version, batch, self.deadline, self.delta)
        except BaseException:
            conn.close()
            raise
        self._idle[endpoint].put(conn)


def _dtype(manifest: Manifest, param: str) -> Any:
    return jax.numpy.dtype(manifest.param(param).dtype)


SPLIT_BYTES = 16 << 20
"""Pulls larger than this are cut into up to ``connections`` parts that travel side by side."""


def _cut(region: Box, itemsize: int, connections: int) -> list[Box]:
    """``region`` in up to ``connections`` parts of at least ``SPLIT_BYTES``, cut along its first
    dimension longer than 1 (so a part of a contiguous destination stays contiguous)."""
    parts = min(connections, box_size(region) * itemsize // SPLIT_BYTES)
    dims = [d for d, (a, b) in enumerate(region) if b - a > 1]
    if parts < 2 or not dims:
        return [region]
    d = dims[0]
    lo, hi = region[d]
    bounds = np.linspace(lo, hi, min(parts, hi - lo) + 1).astype(int)
    return [(*region[:d], (int(a), int(b)), *region[d + 1 :]) for a, b in itertools.pairwise(bounds) if b > a]


MIN_RUN = 1 << 16
"""Elements a region's runs of contiguous memory hold at least for its delta to copy the base in
as it is written, region by region; shorter runs are written with the chunk's other regions
(``_Fetcher._start``): runs of a few hundred elements (a weight split along its last axis) cost
more a run than a whole chunk's copy does (2-core host 2026-11-30: Qwen3-0.6B's embedding split
in 4 along its columns, 0.031 s through runs, 0.005 s as one copy)."""


def _run(region: Box, within: Box) -> int:
    """Elements of ``region`` that lie one after another in a row-major array holding ``within``."""
    run = 1
    for (a, b), (c, d) in zip(reversed(region), reversed(within), strict=True):
        run *= b - a
        if (a, b) != (c, d):
            break
    return run


MIN_PART_BYTES = 256 << 10
"""A strided destination is pulled as this many bytes or more per contiguous part, else whole
into a temporary and copied into place once."""


def _contiguous_parts(region: Box, within: Box, itemsize: int) -> list[Box]:
    """``region`` cut so that each part lands as one contiguous run of an array holding
    ``within``: one part per index of the dimensions before the last one ``region`` does not
    span whole (e.g. per layer of a weight split along its second axis by the trainer's fsdp).
    Each part then goes from the socket straight into its place; a strided destination would
    need a temporary and a strided copy, which took 70% of a Qwen3-0.6B pull's time here
    (py-spy, 2026-11-29). ``[region]`` when it is contiguous already or the parts would be under
    ``MIN_PART_BYTES``."""
    partial = [d for d, (r, w) in enumerate(zip(region, within, strict=True)) if r != w]
    if not partial:
        return [region]
    lead = region[: partial[-1]]
    count = int(np.prod([b - a for a, b in lead], dtype=np.int64))
    if count <= 1 or box_size(region) // count * itemsize < MIN_PART_BYTES:
        return [region]
    return [
        (*((i, i + 1) for i in index), *region[len(lead) :])
        for index in itertools.product(*(range(a, b) for a, b in lead))
    ]


def _split(items: list[tuple[Pull, np.ndarray | Patch]], n: int) -> list[list[tuple[Pull, np.ndarray | Patch]]]:
    """``items`` in at most ``n`` batches of about equal bytes (largest first, each to the lightest batch)."""
    batches: list[list[tuple[Pull, np.ndarray | Patch]]] = [[] for _ in range(min(n, len(items)))]
    load = [0] * len(batches)
    for item in sorted(items, key=lambda it: -it[1].nbytes):
        i = load.index(min(load))
        batches[i].append(item)
        load[i] += item[1].nbytes
    return batches
