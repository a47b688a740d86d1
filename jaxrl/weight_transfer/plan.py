"""Which bytes a server pulls from which trainer endpoint: a pure function of the manifest and
the server's target shardings.

For each param, the server's devices are grouped by the box they hold (a box replicated on
several server devices is pulled once and placed on each), and each such target box is cut
along the trainer's shard boundaries: every nonempty intersection with a trainer shard is one
``Pull`` from one endpoint holding that shard. Trainer shards of one sharding tile the array
(two shards are either the same box, replicated, or disjoint), so these pulls cover the target
box exactly once: no byte is pulled twice for a server shard and none it does not need.
Where several endpoints hold the same shard, the pull goes to the one with the fewest bytes
assigned so far (ties: the lowest index), so replicated params spread over the trainer processes.

A pull names its region as an index box (what goes on the wire); ``Pull.byte_ranges`` lists the
contiguous byte ranges of the trainer's shard buffer (row-major) that box is made of.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import jax
import numpy as np

from jaxrl.weight_transfer.manifest import Box, Manifest, box_of, box_shape, box_size, intersect


@dataclass(frozen=True)
class Pull:
    """``region`` of ``param``, read from the shard ``shard`` that ``endpoint`` holds."""

    endpoint: int
    param: str
    shard: Box
    region: Box
    itemsize: int

    @property
    def nbytes(self) -> int:
        return box_size(self.region) * self.itemsize

    def byte_ranges(self) -> list[tuple[int, int]]:
        """``(offset, length)`` in bytes of the contiguous runs of the shard's row-major buffer
        that make up ``region``, in order, adjacent runs merged: the minimal list."""
        return byte_ranges(self.shard, self.region, self.itemsize)


def byte_ranges(shard: Box, region: Box, itemsize: int) -> list[tuple[int, int]]:
    """See ``Pull.byte_ranges``."""
    extent, size = box_shape(shard), box_shape(region)
    offset = [r0 - s0 for (r0, _), (s0, _) in zip(region, shard, strict=True)]
    strides = [int(np.prod(extent[d + 1 :], dtype=np.int64)) * itemsize for d in range(len(extent))]
    # Dimensions inside the last partial one are whole: a run spans them and the partial one.
    partial = [d for d in range(len(extent)) if size[d] != extent[d]]
    if not partial:
        return [(0, box_size(shard) * itemsize)] if box_size(shard) else []
    k = partial[-1]
    run = size[k] * strides[k]
    runs: list[tuple[int, int]] = []
    for outer in np.ndindex(*size[:k]):
        start = sum((offset[d] + i) * strides[d] for d, i in enumerate(outer)) + offset[k] * strides[k]
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + run)
        else:
            runs.append((start, run))
    return runs


@dataclass(frozen=True)
class TargetPiece:
    """One box of ``param`` as the server holds it, on ``devices`` (device ids), and the pulls
    that fill it."""

    param: str
    box: Box
    devices: tuple[int, ...]
    pulls: tuple[Pull, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return box_shape(self.box)


@dataclass(frozen=True)
class Plan:
    version: int
    pieces: tuple[TargetPiece, ...]
    reused: tuple[str, ...]  # params unchanged since a version the server holds: nothing to pull

    def bytes_per_endpoint(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for piece in self.pieces:
            for p in piece.pulls:
                out[p.endpoint] = out.get(p.endpoint, 0) + p.nbytes
        return out


def target_pieces(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> list[tuple[Box, tuple[int, ...]]]:
    """The distinct boxes of ``sharding`` among this process's devices, each with its device ids (ascending)."""
    by_box: dict[Box, list[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        if device.process_index == jax.process_index():
            by_box.setdefault(box_of(index, shape), []).append(device.id)
    return [(box, tuple(sorted(ids))) for box, ids in by_box.items()]


def plan_pulls(
    manifest: Manifest, targets: Mapping[str, jax.sharding.Sharding], *, have_version: int | None = None
) -> Plan:
    """The pulls that give this process every target shard of ``manifest``'s params.

    ``targets`` maps each param path to its sharding on the server's mesh (one device, or
    tensor-parallel over several). ``have_version``: the version the server serves now; params
    the manifest marks unchanged since a version <= it are not pulled (``Plan.reused``).
    """
    missing, extra = (
        sorted({p.path for p in manifest.params} - set(targets)),
        sorted(set(targets) - {p.path for p in manifest.params}),
    )
    if missing or extra:
        raise ValueError(f"plan_pulls: targets miss params {missing} and name unknown ones {extra}")
    load = [0] * len(manifest.endpoints)
    pieces, reused = [], []
    for param in manifest.params:
        if (
            have_version is not None
            and param.unchanged_since is not None
            and param.unchanged_since <= have_version
        ):
            reused.append(param.path)
            continue
        holders: dict[Box, list[int]] = {}
        for s in param.shards:
            holders.setdefault(s.box, []).append(s.endpoint)
        for box, devices in target_pieces(targets[param.path], param.shape):
            pulls = []
            for shard, endpoints in holders.items():
                if (region := intersect(box, shard)) is None:
                    continue
                endpoint = min(endpoints, key=lambda e: (load[e], e))
                pull = Pull(endpoint, param.path, shard, region, param.itemsize)
                load[endpoint] += pull.nbytes
                pulls.append(pull)
            covered = sum(box_size(p.region) for p in pulls)
            if covered != box_size(box):
                raise ValueError(
                    f"plan_pulls: the trainer shards of {param.path} cover {covered} of the {box_size(box)} "
                    f"elements of the server's box {box} (an incomplete or overlapping manifest)"
                )
            pieces.append(TargetPiece(param.path, box, devices, tuple(pulls)))
    return Plan(manifest.version, tuple(pieces), tuple(reused))
