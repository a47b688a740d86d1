"""The manifest and the pull plan on hand-checkable layouts: exact regions and byte ranges.

Trainer layouts are written as manifests by hand (endpoint i = trainer process i); server
layouts are real shardings on this process's 8 CPU devices (ids 0-7)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.weight_transfer import Manifest, ParamEntry, Shard, manifest_for, merge_manifests, plan_pulls
from jaxrl.weight_transfer.plan import byte_ranges


def one_device() -> SingleDeviceSharding:
    return SingleDeviceSharding(jax.devices()[0])


def tp(n: int, *spec) -> NamedSharding:
    """Tensor-parallel over devices 0..n-1 with ``spec``."""
    return NamedSharding(Mesh(np.array(jax.devices()[:n]), ("tensor",)), PartitionSpec(*spec))


def manifest(*params: ParamEntry, endpoints: int = 4) -> Manifest:
    return Manifest(7, tuple(f"10.0.0.{i}:5000" for i in range(endpoints)), params)


def fsdp4(path: str, shape: tuple[int, ...], dim: int, dtype: str = "float32") -> ParamEntry:
    """``shape`` split in 4 equal parts along ``dim``, part i on endpoint i."""
    step = shape[dim] // 4
    boxes = [
        tuple((i * step, (i + 1) * step) if d == dim else (0, n) for d, n in enumerate(shape))
        for i in range(4)
    ]
    return ParamEntry(path, shape, dtype, tuple(Shard(i, b) for i, b in enumerate(boxes)))


def pulls(plan):
    """[(devices, [(endpoint, region, byte ranges)])] per target piece."""
    return [
        (piece.devices, [(p.endpoint, p.region, p.byte_ranges()) for p in piece.pulls])
        for piece in plan.pieces
    ]


def test_fsdp4_trainer_to_one_device_server_pulls_each_shard_whole() -> None:
    # w [4, 8] f32, fsdp on dim 1: endpoint i holds columns 2i..2i+1 as a [4, 2] buffer (32 bytes).
    plan = plan_pulls(manifest(fsdp4("w", (4, 8), 1)), {"w": one_device()})
    assert pulls(plan) == [
        ((0,), [(i, ((0, 4), (2 * i, 2 * i + 2)), [(0, 32)]) for i in range(4)]),
    ]
    assert plan.bytes_per_endpoint() == {0: 32, 1: 32, 2: 32, 3: 32} and plan.reused == ()


def test_fsdp4_on_columns_to_tensor_parallel_2_on_rows() -> None:
    # Server device 0 holds rows 0-1, device 1 rows 2-3: from each [4, 2] trainer shard, its
    # first two rows (bytes 0-15) or its last two (16-31), each one contiguous run.
    plan = plan_pulls(manifest(fsdp4("w", (4, 8), 1)), {"w": tp(2, "tensor", None)})
    assert pulls(plan) == [
        ((0,), [(i, ((0, 2), (2 * i, 2 * i + 2)), [(0, 16)]) for i in range(4)]),
        ((1,), [(i, ((2, 4), (2 * i, 2 * i + 2)), [(16, 16)]) for i in range(4)]),
    ]


def test_fsdp4_on_rows_to_tensor_parallel_2_on_columns_is_strided() -> None:
    # w [8, 8] f32, endpoint i holds rows 2i..2i+1 ([2, 8], rows of 32 bytes); server device 0
    # takes columns 0-3: the first 16 bytes of each row; device 1 the last 16.
    plan = plan_pulls(manifest(fsdp4("w", (8, 8), 0)), {"w": tp(2, None, "tensor")})
    assert pulls(plan) == [
        ((0,), [(i, ((2 * i, 2 * i + 2), (0, 4)), [(0, 16), (32, 16)]) for i in range(4)]),
        ((1,), [(i, ((2 * i, 2 * i + 2), (4, 8)), [(16, 16), (48, 16)]) for i in range(4)]),
    ]


def test_replicated_params_are_pulled_once_per_server_box_and_spread_over_endpoints() -> None:
    norms = [
        ParamEntry(n, (8,), "bfloat16", tuple(Shard(i, ((0, 8),)) for i in range(4))) for n in ("a", "b", "c")
    ]
    plan = plan_pulls(manifest(*norms), {n: tp(2) for n in ("a", "b", "c")})  # replicated on devices 0, 1
    # One piece per param on both devices, one 16-byte pull each, from the least loaded endpoint.
    assert pulls(plan) == [((0, 1), [(e, ((0, 8),), [(0, 16)])]) for e in (0, 1, 2)]


def test_a_param_replicated_across_processes_is_read_from_both() -> None:
    # Two processes each hold the whole [4, 4] param in two row halves (data-parallel across
    # processes, fsdp within): the server reads one half from each.
    shards = tuple(Shard(e, ((r, r + 2), (0, 4))) for e in (0, 1) for r in (0, 2))
    plan = plan_pulls(manifest(ParamEntry("w", (4, 4), "float32", shards), endpoints=2), {"w": one_device()})
    assert pulls(plan) == [((0,), [(0, ((0, 2), (0, 4)), [(0, 32)]), (1, ((2, 4), (0, 4)), [(0, 32)])])]


def test_misaligned_boundaries_fsdp4_to_tensor_parallel_3() -> None:
    # w [12, 2] f32: trainer rows of 3 (24-byte shards), server rows of 4. Device 1 (rows 4-7)
    # takes rows 4-5 of endpoint 1 (its last two: bytes 8-23) and rows 6-7 of endpoint 2 (its first two).
    plan = plan_pulls(manifest(fsdp4("w", (12, 2), 0)), {"w": tp(3, "tensor", None)})
    assert pulls(plan) == [
        ((0,), [(0, ((0, 3), (0, 2)), [(0, 24)]), (1, ((3, 4), (0, 2)), [(0, 8)])]),
        ((1,), [(1, ((4, 6), (0, 2)), [(8, 16)]), (2, ((6, 8), (0, 2)), [(0, 16)])]),
        ((2,), [(2, ((8, 9), (0, 2)), [(16, 8)]), (3, ((9, 12), (0, 2)), [(0, 24)])]),
    ]


def test_uneven_trainer_shards() -> None:
    # Shards of 3, 3, 3 and 1 rows of a [10, 4] f32 param (16-byte rows), as a trainer that
    # pads its last shard lays them out; server TP-2 takes rows 0-4 and 5-9.
    boxes = [((0, 3), (0, 4)), ((3, 6), (0, 4)), ((6, 9), (0, 4)), ((9, 10), (0, 4))]
    param = ParamEntry("w", (10, 4), "float32", tuple(Shard(i, b) for i, b in enumerate(boxes)))
    plan = plan_pulls(manifest(param), {"w": tp(2, "tensor", None)})
    assert pulls(plan) == [
        ((0,), [(0, ((0, 3), (0, 4)), [(0, 48)]), (1, ((3, 5), (0, 4)), [(0, 32)])]),
        (
            (1,),
            [
                (1, ((5, 6), (0, 4)), [(32, 16)]),
                (2, ((6, 9), (0, 4)), [(0, 48)]),
                (3, ((9, 10), (0, 4)), [(0, 16)]),
            ],
        ),
    ]


def test_byte_ranges_of_inner_boxes() -> None:
    # A [2, 3, 4] shard of bytes (strides 12, 4, 1).
    shard = ((0, 2), (0, 3), (0, 4))
    assert byte_ranges(shard, ((0, 2), (1, 3), (0, 4)), 1) == [(4, 8), (16, 8)]
    assert byte_ranges(shard, ((0, 2), (0, 3), (1, 2)), 1) == [(o, 1) for o in (1, 5, 9, 13, 17, 21)]
    assert byte_ranges(shard, ((1, 2), (0, 3), (0, 4)), 2) == [(24, 24)]
    assert byte_ranges(shard, shard, 2) == [(0, 48)]
    # Rows that happen to be adjacent merge: a one-element middle dimension.
    assert byte_ranges(((0, 2), (0, 1), (0, 4)), ((0, 2), (0, 1), (0, 2)), 1) == [(0, 2), (4, 2)]


def test_incomplete_manifest_and_unknown_targets_are_refused() -> None:
    holes = ParamEntry("w", (4, 4), "float32", (Shard(0, ((0, 2), (0, 4))),))
    with pytest.raises(ValueError, match=r"cover 8 of the 16 elements"):
        plan_pulls(manifest(holes), {"w": one_device()})
    with pytest.raises(ValueError, match=r"miss params \['w'\] and name unknown ones \['v'\]"):
        plan_pulls(manifest(holes), {"v": one_device()})


def test_params_unchanged_since_a_version_held_are_not_pulled() -> None:
    same = ParamEntry("embed", (4, 2), "float32", (Shard(0, ((0, 4), (0, 2))),), unchanged_since=5)
    new = ParamEntry("wq", (4, 2), "float32", (Shard(0, ((0, 4), (0, 2))),))
    m = manifest(same, new, endpoints=1)
    targets = {"embed": one_device(), "wq": one_device()}
    assert plan_pulls(m, targets, have_version=5).reused == ("embed",)
    assert [p.param for p in plan_pulls(m, targets, have_version=5).pieces] == ["wq"]
    assert plan_pulls(m, targets, have_version=4).reused == ()  # too old: pull everything
    assert plan_pulls(m, targets).reused == ()


def test_manifest_from_real_shardings_merges_and_round_trips() -> None:
    # fsdp=4 x tensor=2 on 8 devices of one process: w [8, 6] split in 4 on rows, replicated over tensor.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
    w = jax.ShapeDtypeStruct((8, 6), np.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp", None)))
    m = manifest_for(3, {"w": w}, ["h:1"], "bfloat16", unchanged_since={"w": 2})
    assert m.params == (
        ParamEntry("w", (8, 6), "bfloat16", tuple(Shard(0, ((r, r + 2), (0, 6))) for r in (0, 2, 4, 6)), 2),
    )
    assert Manifest.from_json(m.to_json()) == m
    # Two processes' fragments, each with its own endpoint at index 0, join into one manifest.
    half = lambda rows, e: ParamEntry(
        "w", (8, 6), "bfloat16", tuple(Shard(e, ((r, r + 2), (0, 6))) for r in rows)
    )
    a, b = Manifest(3, ("h:1",), (half((0, 2), 0),)), Manifest(3, ("h:2",), (half((4, 6), 0),))
    assert merge_manifests([a, b]) == Manifest(
        3,
        ("h:1", "h:2"),
        (ParamEntry("w", (8, 6), "bfloat16", (*half((0, 2), 0).shards, *half((4, 6), 1).shards)),),
    )
