"""What a weight version is made of and who holds which piece: the manifest.

A manifest lists every parameter of one policy version by its path in the decoder's state
(``"embed"``, ``"wq"``; nested states join keys with "/"), its global shape and the dtype it is
served in, and its shards: which trainer endpoint (one per trainer process) holds which index
box. A box is a tuple of ``(start, stop)`` per dimension, in global coordinates. Replicated
params are held by several endpoints; the plan (``plan.py``) pulls each byte from one of them.

Every trainer process can compute the whole manifest from the global shardings alone
(``manifest_for``: the devices of every shard and the process each device belongs to), given
the endpoint address of every process; or each publisher returns its own fragment and process 0
merges them (``merge_manifests``). Both give the same manifest.

Versions and deltas. ``lineage`` names the publishers' run (a new id each time the trainer
starts), so version numbers of two runs are never confused. ``base_version = b`` says the version
is published as a delta against version ``b`` of the same lineage (``delta.py``): a server whose
last pulled version is exactly ``(lineage, b)`` pulls only the changed blocks and writes them over
its own copy of ``b``; any other server (it missed a version, restarted, or loaded weights another
way) pulls the version whole, which every publisher can always serve. ``base_version = None``: a
full version. ``ParamEntry.unchanged_since = k`` (whole params) says the param's bytes equal those
of version ``k``; a server that already serves version >= k keeps its buffer and pulls nothing for
it (``plan_pulls(..., have_version=)``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import jax
import numpy as np

Box = tuple[tuple[int, int], ...]
"""A global index range: ``(start, stop)`` per dimension."""


def box_of(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    """The box of a shard's index (``Sharding.devices_indices_map``'s tuple of slices)."""
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, shape, strict=True))


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    return int(np.prod(box_shape(box), dtype=np.int64))


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, None when empty."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def local_slices(region: Box, within: Box) -> tuple[slice, ...]:
    """``region`` (global) as slices of an array holding ``within``."""
    return tuple(slice(r0 - w0, r1 - w0) for (r0, r1), (w0, _) in zip(region, within, strict=True))


@dataclass(frozen=True)
class Shard:
    endpoint: int  # index into Manifest.endpoints
    box: Box


@dataclass(frozen=True)
class ParamEntry:
    path: str
    shape: tuple[int, ...]
    dtype: str  # the serving dtype's numpy name ("bfloat16", "float32")
    shards: tuple[Shard, ...]
    unchanged_since: int | None = None  # deltas: the bytes equal version k's

    @property
    def itemsize(self) -> int:
        return np.dtype(jax.numpy.dtype(self.dtype)).itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize


@dataclass(frozen=True)
class Manifest:
    version: int
    endpoints: tuple[str, ...]  # "host:port" of each trainer process's publisher
    params: tuple[ParamEntry, ...]
    transport: str = "tcp"
    lineage: str = ""  # the publishers' run; versions compare only within one
    base_version: int | None = None  # a delta against this version of the lineage; None: full
    block_bytes: int | None = None  # a delta's block size (a full version has none)
    _by_path: dict[str, ParamEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_path", {p.path: p for p in self.params})
        if len(self._by_path) != len(self.params):
            raise ValueError("manifest: a param path appears twice")
        for p in self.params:
            for s in p.shards:
                if not 0 <= s.endpoint < len(self.endpoints):
                    raise ValueError(
                        f"manifest: {p.path} names endpoint {s.endpoint} of {len(self.endpoints)}"
                    )
        if self.base_version is not None and not self.base_version < self.version:
            raise ValueError(f"manifest: base version {self.base_version} is not below version {self.version}")
        if self.base_version is not None and self.block_bytes is None:
            raise ValueError(f"manifest: a delta against version {self.base_version} names no block_bytes")
        if self.block_bytes is not None and self.block_bytes < 1:
            raise ValueError(f"manifest: block_bytes {self.block_bytes} < 1")

    def param(self, path: str) -> ParamEntry:
        return self._by_path[path]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "endpoints": list(self.endpoints),
                "transport": self.transport,
                "lineage": self.lineage,
                "base_version": self.base_version,
                "block_bytes": self.block_bytes,
                "params": [
                    {
                        "path": p.path,
                        "shape": list(p.shape),
                        "dtype": p.dtype,
                        "shards": [[s.endpoint, [list(r) for r in s.box]] for s in p.shards],
                        "unchanged_since": p.unchanged_since,
                    }
                    for p in self.params
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        d = json.loads(text)
        params = tuple(
            ParamEntry(
                path=p["path"],
                shape=tuple(p["shape"]),
                dtype=p["dtype"],
                shards=tuple(Shard(e, tuple((a, b) for a, b in box)) for e, box in p["shards"]),
                unchanged_since=p.get("unchanged_since"),
            )
            for p in d["params"]
        )
        return cls(
            d["version"], tuple(d["endpoints"]), params, d.get("transport", "tcp"), d.get("lineage", ""),
            d.get("base_version"), d.get("block_bytes"),
        )  # fmt: skip


# -- parameter paths --------------------------------------------------------------------------


def key_name(key: Any) -> str | None:
    """One tree path key as it appears in a param path (None: a Variable's ``.value``)."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return None if key.name == "value" else key.name
    return str(key)


def param_path(path: tuple[Any, ...]) -> str:
    """The state tree path of a leaf as a param path: ``(DictKey('wq'), GetAttrKey('value'))`` -> "wq"."""
    return "/".join(n for k in path if (n := key_name(k)) is not None)


def param_leaves(state: Any) -> list[tuple[str, Any]]:
    """``(param path, leaf)`` for every leaf of a state (arrays or ``jax.ShapeDtypeStruct``)."""
    return [(param_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]


# -- building manifests -----------------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    return jax.numpy.dtype(dtype).name


def process_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[int, list[Box]]:
    """The distinct boxes of ``sharding`` each process holds (a box on several of its devices once)."""
    held: dict[int, list[Box]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        boxes = held.setdefault(device.process_index, [])
        if (box := box_of(index, shape)) not in boxes:
            boxes.append(box)
    return held


def manifest_for(
    version: int,
    state: Any,
    endpoints: Sequence[str],
    dtype: Any,
    *,
    transport: str = "tcp",
    unchanged_since: Mapping[str, int] | None = None,
    lineage: str = "",
    base_version: int | None = None,
    block_bytes: int | None = None,
) -> Manifest:
    """The manifest of ``state`` (arrays or abstract arrays with shardings) served in ``dtype``
    (None: each leaf in its own, as ``Publisher.layout()`` describes a prepared version),
    with ``endpoints[i]`` the publisher of process ``i`` (a delta against ``base_version`` when
    given, with its ``block_bytes``). Pure: no transfers, no collectives."""
    unchanged_since = unchanged_since or {}
    params = []
    for path, x in param_leaves(state):
        shape = tuple(x.shape)
        shards = tuple(
            Shard(proc, box)
            for proc, boxes in sorted(process_boxes(x.sharding, shape).items())
            for box in boxes
        )
        served = x.dtype if dtype is None else dtype
        params.append(ParamEntry(path, shape, _dtype_name(served), shards, unchanged_since.get(path)))
    return Manifest(version, tuple(endpoints), tuple(params), transport, lineage, base_version, block_bytes)


def merge_manifests(fragments: Iterable[Manifest]) -> Manifest:
    """One manifest from the publishers' fragments (each naming only its own endpoint), with the
    first fragment's lineage (give every process's ``Publisher`` the run's one)."""
    fragments = list(fragments)
    if not fragments:
        raise ValueError("merge_manifests: no fragments")
    first = fragments[0]
    endpoints: list[str] = []
    shards: dict[str, list[Shard]] = {p.path: [] for p in first.params}
    for frag in fragments:
        if (frag.version, frag.transport, frag.base_version, frag.block_bytes) != (
            first.version, first.transport, first.base_version, first.block_bytes
        ):  # fmt: skip
            raise ValueError(
                f"merge_manifests: version/transport/base {frag.version}/{frag.transport}/{frag.base_version} "
                f"!= {first.version}/{first.transport}/{first.base_version}"
            )
        if [(p.path, p.shape, p.dtype) for p in frag.params] != [
            (p.path, p.shape, p.dtype) for p in first.params
        ]:
            raise ValueError("merge_manifests: fragments describe different params")
        offset = len(endpoints)
        endpoints.extend(frag.endpoints)
        for p in frag.params:
            shards[p.path].extend(Shard(s.endpoint + offset, s.box) for s in p.shards)
    params = tuple(replace(p, shards=tuple(shards[p.path])) for p in first.params)
    return Manifest(
        first.version, tuple(endpoints), params, first.transport, first.lineage, first.base_version, first.block_bytes
    )  # fmt: skip
