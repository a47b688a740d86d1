"""Deltas between weight versions: changed blocks found exactly, and after any sequence of full
and delta pulls the server's weights are bitwise the trainer's latest version in the serving
dtype; a delta is applied only over exactly its base (a missed version, another lineage or no
previous state pulls whole), and every ``full_every``-th version is published whole."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxrl.models.sharding import shard_params
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.weight_transfer import Publisher, applies_as_delta, pull_weights
from jaxrl.weight_transfer.delta import (
    Changed,
    _runs,
    changed_blocks,
    delta_payload_bytes,
    diff,
    gather_blocks,
    scatter_blocks,
)
from jaxrl.weight_transfer.manifest import Manifest, param_leaves

BLOCK = 64  # bytes: the tiny model's weights span many blocks


@pytest.fixture(scope="module")
def state() -> nnx.State:
    """The tiny decoder's params (float32, as the trainer holds them), fsdp-4 on devices 0-3."""
    _, params = nnx.split(tiny_model())
    return shard_params(params, make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4]))


def one_device(state: nnx.State) -> nnx.State:
    sh = SingleDeviceSharding(jax.devices()[5])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=sh), state)


def tensor_parallel(state: nnx.State) -> nnx.State:
    """Devices 5 and 6, every 2-D param split on its last dimension (strided against fsdp's rows)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[5:7]), ("tensor",))

    def like(x: jax.Array) -> jax.ShapeDtypeStruct:
        spec = (
            PartitionSpec(*([None] * (x.ndim - 1)), "tensor")
            if x.ndim >= 2 and x.shape[-1] % 2 == 0
            else PartitionSpec()
        )
        return jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(like, state)


def same_bits(pulled: nnx.State, state: nnx.State) -> bool:
    return all(
        np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b.astype(jnp.bfloat16)).view(np.uint16))
        for a, b in zip(jax.tree.leaves(pulled), jax.tree.leaves(state), strict=True)
    )


def step(state: nnx.State, seed: int) -> nnx.State:
    """A sparse update: a few embedding rows and one weight's first row move (as an optimizer
    step moves the rows of the tokens a batch saw), float32 changes some bf16 bits round away."""
    rng = np.random.default_rng(seed)
    leaves = dict(param_leaves(state))
    rows = rng.choice(leaves["embed"].shape[0], 3, replace=False)
    embed = leaves["embed"].at[rows].add(0.25)
    wq = leaves["wq"].at[0, 0].add(jnp.asarray(rng.standard_normal(leaves["wq"].shape[2:]), jnp.float32))
    new = leaves | {
        "embed": jax.device_put(embed, leaves["embed"].sharding),
        "wq": jax.device_put(wq, leaves["wq"].sharding),
    }
    return jax.tree_util.tree_unflatten(jax.tree.structure(state), [new[p] for p, _ in param_leaves(state)])


def test_changed_blocks_and_their_runs_are_exact() -> None:
    old = np.zeros(1000, np.uint8)
    new = old.copy()
    new[[0, 130, 131, 999]] = 1  # blocks of 64: 0, 2, 15 (the short last one)
    bits = changed_blocks(old, new, 64)  # packed: 16 blocks in 2 bytes
    rows = Changed(16, packed=bits)
    assert bits.size == 2 and [int(i) for w in rows.windows() for i in w] == [0, 2, 15]
    payload = gather_blocks(new, rows, 64)  # blocks 0 and 2 whole, then the 40-byte last one
    assert payload.size == delta_payload_bytes(rows, new.size, 64) == 2 * 64 + 40
    back = old.copy()
    scatter_blocks(back, rows, 64, payload)
    assert np.array_equal(back, new)
    nan = np.array([np.nan], np.float32)  # equal bits count as unchanged, whatever they mean
    assert not changed_blocks(nan, nan.copy(), 64).any()
    assert changed_blocks(np.float32([0.0]), np.float32([-0.0]), 64).tolist() == [1]  # -0.0 == 0.0, not the same bits


def test_a_delta_of_elements_is_written_through_a_strided_region() -> None:
    """A trainer shard's region inside a server's buffer (an fsdp split along the second axis):
    the changed elements land through the view, the rest of the buffer untouched; blocks of
    several elements are refused there (they would straddle the view's rows)."""
    rng = np.random.default_rng(0)
    server = rng.integers(0, 1 << 16, (6, 10), dtype=np.uint16).view(ml_dtypes.bfloat16)
    before = server.copy()
    region = server[:, 5:]  # strided: 6 rows of 5
    new = region.copy()
    new.view(np.uint16)[[0, 2, 5], [4, 0, 3]] ^= 1
    changed = Changed.of(changed_blocks(region, new, 2), region.size)
    payload = gather_blocks(new.reshape(-1).view(np.uint8), changed, 2)
    scatter_blocks(region, changed, 2, payload)
    assert np.array_equal(server[:, 5:].view(np.uint16), new.view(np.uint16))
    assert np.array_equal(server[:, :5].view(np.uint16), before[:, :5].view(np.uint16))
    cube = rng.integers(0, 1 << 16, (3, 4, 6), dtype=np.uint16)  # a view whose rows do not merge
    view, want = cube[:, 1:3, ::2], cube[:, 1:3, ::2].copy()
    want[[0, 2], [1, 0], [2, 1]] += 1
    changed = Changed.of(changed_blocks(view, want, 2), view.size)
    scatter_blocks(view, changed, 2, gather_blocks(want.reshape(-1).view(np.uint8), changed, 2))
    assert np.array_equal(cube[:, 1:3, ::2], want)
    # Stacked layers with the fsdp split on the middle axis (12 runs of 4 elements), or whole rows
    # of it (3 runs of 4 x 6: the split axis merges into the run): written through the memory
    # span by run offsets, few or many changed elements per run, the rest untouched.
    for cut, runs, changes in ((np.s_[:, 2:6, 1:5], 12, 9), (np.s_[:, 2:6, :], 3, 9), (np.s_[:, 2:6, :], 3, 40)):
        stack = rng.integers(0, 1 << 16, (3, 8, 6), dtype=np.uint16)
        before = stack.copy()
        view, want = stack[cut], stack[cut].copy()
        assert _runs(view) is not None and _runs(view)[1].size == runs
        want.reshape(-1)[rng.choice(want.size, changes, replace=False)] ^= 1
        changed = Changed.of(changed_blocks(view, want, 2), view.size)
        scatter_blocks(view, changed, 2, gather_blocks(want.reshape(-1).view(np.uint8), changed, 2))
        assert np.array_equal(stack[cut], want)
        outside = np.ones(stack.shape, bool)
        outside[cut] = False
        assert np.array_equal(stack[outside], before[outside])
    with pytest.raises(ValueError, match="strided destination takes blocks of one element"):
        scatter_blocks(region, Changed.of(changed_blocks(region, new, 4), 15), 4, payload)


@pytest.mark.parametrize("form", ["gaps", "bitmap"])
def test_a_delta_given_its_base_copies_every_element_in_the_same_pass(monkeypatch, form: str) -> None:
    """``scatter_blocks(..., base=)`` (a CPU server's delta: the base is the array it serves,
    copied in as the delta is written): every element of the region ends up the new version's,
    none left from the buffer's old contents, the memory around a strided region untouched;
    whole regions, runs of stacked layers, empty bitmap windows, and a base laid out otherwise
    (copied first) alike."""
    from jaxrl.weight_transfer import delta, delta_loops

    monkeypatch.setattr(delta, "WINDOW_BLOCKS", 64)  # bitmap windows with no change in them
    monkeypatch.setattr(delta_loops, "patch_runs", counted := _Counted(delta_loops.patch_runs))
    rng = np.random.default_rng(5)
    base_stack = rng.integers(0, 1 << 16, (3, 8, 96), dtype=np.uint16)
    cases = {
        "whole": (np.s_[...], False),
        "runs": (np.s_[:, 2:6, :], False),  # 3 runs of 4 x 96
        "short runs": (np.s_[:, :, 16:48], False),
        "another layout": (np.s_[:, 2:6, :], True),  # the base a contiguous copy: copied first
    }
    for name, (cut, contiguous_base) in cases.items():
        stack = np.full(base_stack.shape, 0xDEAD, np.uint16)  # what the buffer held before
        base = base_stack[cut].copy() if contiguous_base else base_stack[cut]
        want = base_stack[cut].copy()
        n = want.size
        hit = rng.choice(n, n // 40 if form == "gaps" else n // 2, replace=False)
        want.reshape(-1)[np.sort(hit)[n // 10 < np.sort(hit)]] ^= 1  # no change in the first windows
        changed = Changed.of(changed_blocks(base, want, 2), n)
        assert (changed.indices is not None) == (form == "gaps"), name
        calls = counted.calls
        scatter_blocks(stack[cut], changed, 2, gather_blocks(want.reshape(-1).view(np.uint8), changed, 2), base=base)
        assert np.array_equal(stack[cut], want), name
        outside = np.ones(stack.shape, bool)
        outside[cut] = False
        assert (stack[outside] == 0xDEAD).all(), name
        assert (counted.calls > calls) == (not contiguous_base), name  # one pass unless laid out otherwise
    with pytest.raises(ValueError, match="base uint16\\[2\\] for uint16\\[3\\]"):
        scatter_blocks(np.zeros(3, np.uint16), Changed(3, indices=np.zeros(0, "<u4")), 2, np.zeros(0, np.uint8), base=np.zeros(2, np.uint16))


@pytest.mark.parametrize("form", ["gaps", "bitmap"])
def test_regions_written_together_over_their_base_are_the_new_version(monkeypatch, form: str) -> None:
    """``write_regions``: a buffer split among regions along its last axis (runs of 8 elements,
    interleaved), some changed elements in each, written over its base in one pass: every
    element the new version's, none left from the buffer's old contents. Blocks larger than an
    element (regions of whole rows) take the copy-then-scatter way, with the same result."""
    from jaxrl.weight_transfer import delta_loops
    from jaxrl.weight_transfer.delta import write_regions

    monkeypatch.setattr(delta_loops, "patch_regions", merged := _Counted(delta_loops.patch_regions))
    rng = np.random.default_rng(9)
    base = rng.integers(0, 1 << 16, (40, 32), dtype=np.uint16)
    want = base.copy()
    want.reshape(-1)[rng.choice(want.size, want.size // 30 if form == "gaps" else want.size // 2, replace=False)] ^= 1
    for block, cuts in ((2, [np.s_[:, c : c + 8] for c in range(0, 32, 8)]), (4, [np.s_[r : r + 10] for r in range(0, 40, 10)])):
        buf = np.full(base.shape, 0xBEEF, np.uint16)
        parts = []
        for cut in cuts:
            new = want[cut].copy()
            changed = Changed.of(changed_blocks(base[cut], new, block), new.size * 2 // block)
            assert (changed.indices is not None) == (form == "gaps")
            payload = gather_blocks(new.reshape(-1).view(np.uint8), changed, block)
            if len(parts) == 1:  # one read-only payload among writable ones (np.frombuffer's kind)
                payload = np.frombuffer(payload.tobytes(), np.uint8)
            parts.append((buf[cut], changed, payload))
        calls = merged.calls
        write_regions(buf, base, parts, block)
        assert np.array_equal(buf, want), block
        assert (merged.calls > calls) == (block == 2)


def test_the_package_imports_without_numba_and_a_delta_says_what_it_needs(monkeypatch) -> None:
    """A host that never makes a delta (the accelerator check's offline install leaves numba's
    60 MB out) imports the delta module and pulls whole versions; the first delta names the
    missing package and the install line. In this process (no child: the fast tier's memory),
    the module loaded afresh under another name with numba made unimportable."""
    import importlib.util

    from jaxrl.weight_transfer import delta

    monkeypatch.setitem(sys.modules, "numba", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "jaxrl.weight_transfer.delta_loops", raising=False)
    spec = importlib.util.spec_from_file_location("delta_without_numba", delta.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "delta_without_numba", fresh)  # dataclasses look their module up
    spec.loader.exec_module(fresh)  # the import itself needs no numba
    with pytest.raises(ImportError, match=r"weight deltas need numba.*pip install 'numba>=0.62'"):
        fresh.diff(np.zeros(64, np.uint16), np.ones(64, np.uint16), 2)


class _Counted:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["64-byte-blocks", "elements"])
def test_a_sequence_of_full_and_delta_pulls_is_bitwise_the_latest_version(state: nnx.State, block: int | None) -> None:
    versions = [state]
    for v in range(2, 8):
        versions.append(step(versions[-1], v))
    with Publisher(delta=True, full_every=3, block_bytes=block) as pub:
        held, have = None, None
        kinds = []
        for v, params in enumerate(versions, start=1):
            manifest = pub.publish(v, params)
            delta = applies_as_delta(manifest, pub.lineage if have else None, have)
            kinds.append("delta" if delta else "full")
            held = pull_weights(
                manifest,
                one_device(state),
                timeout_s=20,
                previous=held,
                have_version=have,
                have_lineage=pub.lineage,
            )
            have = v
            assert same_bits(held, params), f"version {v}"
            if manifest.base_version is not None:
                changes = pub.changes(v)
                assert changes is not None and changes.base == v - 1
                assert 0 < changes.changed_bytes < changes.bytes / 4  # a sparse step: few blocks
                # What travels: the changed bytes and their description, at most a bitmap's worth
                # (1 bit a block) and each shard's head.
                assert changes.sent_bytes is not None
                assert changes.changed_bytes < changes.sent_bytes <= changes.changed_bytes + changes.blocks / 8 + 64 * 17
        assert kinds == ["full", "delta", "delta", "full", "delta", "delta", "full"]  # full_every = 3


@pytest.mark.parametrize("target", [one_device, tensor_parallel], ids=["one-device", "tensor-parallel"])
@pytest.mark.parametrize(
    "staging,min_run", [(False, None), (False, 1), (True, None)], ids=["serves-its-buffers", "serves-patching-runs", "staging-buffers"]
)
def test_delta_pulls_through_a_pool_start_from_the_buffer_that_holds_the_base(
    state: nnx.State, target, staging: bool, min_run: int | None, monkeypatch
) -> None:
    """A server with a host buffer pool (as the engine's runner keeps one), swapping each version
    in. Where its device arrays are not its host buffers (a TPU / GPU server: the host buffers
    are staging copies; here the served arrays are copied off them), each delta pull starts from
    the free buffer its base was pulled into, not from a read of the base back from the device;
    a CPU server serves from those buffers, so it copies its base. Every version is bitwise the
    trainer's either way, a full version (``full_every``) in the chain included. A CPU server
    copies its base in with each region's delta where the runs are long (``min_run`` 1 here:
    every region, the test's tensors being small), else up front."""
    from jaxrl.weight_transfer import HostBufferPool, delta_loops, puller

    counted, merged = _Counted(delta_loops.patch_runs), _Counted(delta_loops.patch_regions)
    monkeypatch.setattr(delta_loops, "patch_runs", counted)
    monkeypatch.setattr(delta_loops, "patch_regions", merged)
    if min_run is not None:
        monkeypatch.setattr(puller, "MIN_RUN", min_run)

    versions = [state]
    for v in range(2, 8):
        versions.append(step(versions[-1], v))
    pool, size = HostBufferPool(), sum(x.size * 2 for x in jax.tree.leaves(state))
    taken = []
    with Publisher(delta=True, full_every=4, block_bytes=None) as pub:
        served, have = None, None
        for v, params in enumerate(versions, start=1):
            manifest = pub.publish(v, params)
            new = pull_weights(manifest, target(state), timeout_s=20, previous=served, have_version=have,
                               have_lineage=pub.lineage, buffers=pool)  # fmt: skip
            if staging:  # device memory of its own: the pulled host buffers are free again
                new = jax.tree.map(lambda x: jnp.array(x, copy=True), new)
            assert same_bits(new, params), f"version {v}"
            served, have = new, v  # the swap: the version before is let go
            taken.append(pool.taken_bytes)
    gained = np.diff([0, *taken])  # per pull: full, delta, delta, delta, full, delta, delta
    if staging:
        assert [g >= size for g in gained] == [False, True, True, True, False, True, True], gained
    else:
        assert not gained.any(), gained
    # How a CPU server copied its base in: region by region (runs at least min_run), else by
    # the chunk with its regions' deltas (the tests' tensors have runs below MIN_RUN).
    assert (counted.calls > 0, merged.calls > 0) == (min_run == 1, not staging and min_run is None)


def test_a_delta_is_written_over_exactly_the_base_it_is_given(state: nnx.State) -> None:
    """Only changed blocks travel: a block the server corrupted in its base stays corrupted after
    a delta (the delta was applied over it), and is mended by the next full pull."""
    v2 = step(state, 2)
    with Publisher(delta=True, full_every=10, block_bytes=BLOCK) as pub:
        first = pull_weights(pub.publish(1, state), one_device(state), timeout_s=20)
        manifest = pub.publish(2, v2)
        norm = dict(param_leaves(first))["final_norm"]  # no step changes it
        bad = dict(param_leaves(first)) | {"final_norm": norm + 1}
        bad = jax.tree_util.tree_unflatten(
            jax.tree.structure(first), [bad[p] for p, _ in param_leaves(first)]
        )
        second = pull_weights(
            manifest, one_device(state), timeout_s=20, previous=bad, have_version=1, have_lineage=pub.lineage
        )
        got = dict(param_leaves(second))
        assert np.array_equal(np.asarray(got["final_norm"]), np.asarray(norm + 1))
        assert np.array_equal(
            np.asarray(got["embed"]), np.asarray(dict(param_leaves(v2))["embed"].astype(jnp.bfloat16))
        )
        whole = pull_weights(manifest, one_device(state), timeout_s=20)  # no previous: a full pull
        assert same_bits(whole, v2)


def test_a_server_that_missed_a_version_or_another_run_pulls_whole(state: nnx.State) -> None:
    v2, v3 = step(state, 2), step(step(state, 2), 3)
    with Publisher(delta=True, block_bytes=BLOCK) as pub:
        first = pull_weights(pub.publish(1, state), one_device(state), timeout_s=20)
        pub.publish(2, v2)  # this server never pulls version 2
        m3 = pub.publish(3, v3)
        assert m3.base_version == 2 and not applies_as_delta(m3, pub.lineage, 1)
        got = pull_weights(
            m3, one_device(state), timeout_s=20, previous=first, have_version=1, have_lineage=pub.lineage
        )
        assert same_bits(got, v3)
        # The same version number from another run (a restarted trainer) is not a base either.
        assert not applies_as_delta(m3, "another-run", 2)
        other = pull_weights(
            m3, one_device(state), timeout_s=20, previous=first, have_version=2, have_lineage="another-run"
        )
        assert same_bits(other, v3)


@pytest.mark.parametrize("block", [BLOCK, None], ids=["64-byte-blocks", "elements"])
def test_a_delta_onto_a_strided_tensor_parallel_layout(state: nnx.State, block: int | None) -> None:
    v2 = step(state, 2)
    like = tensor_parallel(state)
    with Publisher(delta=True, block_bytes=block) as pub:
        first = pull_weights(pub.publish(1, state), like, timeout_s=20)
        second = pull_weights(
            pub.publish(2, v2), like, timeout_s=20, previous=first, have_version=1, have_lineage=pub.lineage
        )
    assert same_bits(second, v2)


def test_delta_fields_round_trip_and_are_checked(state: nnx.State) -> None:
    with Publisher(delta=True, block_bytes=BLOCK) as pub:
        pub.publish(1, state)
        m = pub.publish(2, step(state, 2))
    back = Manifest.from_json(m.to_json())
    assert (back.lineage, back.base_version, back.block_bytes) == (pub.lineage, 1, BLOCK)
    with Publisher(delta=True) as pub:  # the default block: one element of the serving dtype
        pub.publish(1, state)
        assert pub.publish(2, step(state, 2)).block_bytes == 2 == jnp.dtype(jnp.bfloat16).itemsize
    with pytest.raises(ValueError, match="base version 2 is not below version 2"):
        Manifest(2, m.endpoints, m.params, base_version=2)
    with pytest.raises(ValueError, match="deltas travel over tcp only"):
        Publisher(delta=True, transport="jax")
    with pytest.raises(ValueError, match="keep at least one version"):
        Publisher(delta=True, keep=1)


@pytest.mark.parametrize("block_bytes", [2, 64])
def test_windowed_passes_equal_one_pass_over_the_whole_shard(monkeypatch, block_bytes: int) -> None:
    """The compare, gather and scatter walk the bitmap a window at a time (delta.py says why):
    across window edges and a short last block they give what one pass over everything gives."""
    from jaxrl.weight_transfer import delta

    monkeypatch.setattr(delta, "WINDOW_BLOCKS", 16)
    rng = np.random.default_rng(0)
    old = rng.integers(0, 255, 50 * block_bytes + 3, dtype=np.uint8)  # 50 whole blocks and a short one
    new = old.copy()
    new[rng.choice(new.size, 40, replace=False)] ^= 1
    bits = changed_blocks(old, new, block_bytes)
    per_block = np.r_[[np.any(old[i : i + block_bytes] != new[i : i + block_bytes]) for i in range(0, old.size, block_bytes)]]
    assert np.array_equal(np.unpackbits(bits, count=per_block.size, bitorder="little").astype(bool), per_block)
    rows = Changed.of(bits, per_block.size)  # 40 of 51 blocks at most: the bitmap
    assert np.array_equal(np.concatenate(list(rows.windows())), np.flatnonzero(per_block))
    payload = gather_blocks(new, rows, block_bytes)
    want = np.concatenate([new[i : i + block_bytes] for i in np.flatnonzero(per_block) * block_bytes])
    assert np.array_equal(payload, want) and payload.size == delta_payload_bytes(rows, new.size, block_bytes)
    back = old.copy()
    scatter_blocks(back, rows, block_bytes, payload)
    assert np.array_equal(back, new)


def test_a_delta_names_its_blocks_by_bitmap_or_gaps_whichever_is_shorter_and_bad_ones_are_refused(
    monkeypatch,
) -> None:
    from jaxrl.weight_transfer import delta

    monkeypatch.setattr(delta, "WINDOW_BLOCKS", 1024)  # windows of indices too

    def read_from(parts: list[np.ndarray]):
        data = memoryview(b"".join(p.tobytes() for p in parts))
        at = 0

        def read(n: int) -> bytes:
            nonlocal at
            at += n
            return bytes(data[at - n : at])

        return read

    blocks, block_bytes = 4096, 2
    rng = np.random.default_rng(1)
    old = rng.integers(0, 255, blocks * block_bytes - 1, dtype=np.uint8)  # the last block short
    cases = {  # changed blocks -> the description that is shorter
        "sparse": ([3, 700, 4095], delta.GAPS),
        "an RL step's 3%": (sorted(rng.choice(blocks, 123, replace=False).tolist()), delta.GAPS),
        "a gap past one varint byte each": (list(range(0, 4096, 200)), delta.GAPS),
        "half": (list(range(0, 4096, 2)), delta.BITMAP),
        "every 3rd: more gaps than bitmap bytes": (list(range(0, 4096, 3)), delta.BITMAP),
    }
    for changed, kind in cases.values():
        new = old.copy()
        new[np.array(changed) * block_bytes] ^= 1
        sent = Changed.of(changed_blocks(old, new, block_bytes), blocks)
        parts = sent.encode()
        assert parts[0][0] == kind
        assert sum(p.nbytes for p in parts) <= 1 + blocks // 8
        if kind == delta.GAPS:  # a byte a changed block while the gaps are under 128
            assert parts[2].nbytes == len(changed) + sum(b - a > 128 for a, b in zip([-1, *changed], changed))
        got = Changed.decode(read_from(parts), blocks)
        assert [int(i) for w in got.windows() for i in w] == changed and got.count == len(changed)
        back = old.copy()
        scatter_blocks(back, got, block_bytes, gather_blocks(new, sent, block_bytes))
        assert np.array_equal(back, new)

    def gaps(count: int, data: list[int]) -> list[np.ndarray]:
        return [np.array([delta.GAPS], np.uint8), np.array([count, len(data)], "<u8").view(np.uint8), np.array(data, np.uint8)]

    bad = {
        "gaps do not describe": gaps(2, [4000 & 127 | 128, 4000 >> 7, 100]),  # 4000, then 4101: past the region
        "gaps do not describe ": gaps(2, [5]),  # two rows promised, one sent
        "gaps do not describe  ": gaps(1, [5, 6]),  # a byte left over
        "gaps do not describe   ": gaps(1, [0x80, 0x80, 0x80, 0x80, 0x80]),  # a varint that never ends
        "4097 changed blocks": gaps(blocks + 1, [0] * 4),
    }
    for message, parts in bad.items():
        with pytest.raises(ValueError, match=message.strip()):
            Changed.decode(read_from(parts), blocks)
    with pytest.raises(ValueError, match="unknown delta kind 7"):
        Changed.decode(read_from([np.array([7], np.uint8)]), blocks)


def test_gaps_round_trip_every_varint_length() -> None:
    """Rows whose gaps need 1 to 5 varint bytes (up to 2**32 - 1, an index's range) decode back."""
    from jaxrl.weight_transfer import delta_loops

    rng = np.random.default_rng(3)
    steps = np.concatenate([rng.integers(1, 1 << b, 50) for b in (7, 14, 21, 25)] + [[1 << 31]])
    rows = np.cumsum(rng.permutation(steps)) - 1
    assert int(rows[-1]) < 1 << 32
    rows = rows.astype("<u4")
    out = np.empty(5 * rows.size, np.uint8)
    n = delta_loops.encode_gaps(rows, out)
    back = np.empty(rows.size, "<u4")
    assert delta_loops.decode_gaps(out[:n], 1 << 32, back) and np.array_equal(back, rows)
    assert not delta_loops.decode_gaps(out[:n], int(rows[-1]), back)  # the last row not below the bound


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.02, 0.5])
def test_diff_describes_the_same_blocks_and_bytes_as_the_bitmap_pass(dtype, fraction: float) -> None:
    """``diff`` of element blocks (found a word at a time while few change) against the bitmap
    pass + gather: the same changed blocks and payload, a region whose length is not a whole
    number of 8-byte words included; indices while they are the shorter description, a bitmap
    beyond (0.5 changed)."""
    rng = np.random.default_rng(int(fraction * 1000) + np.dtype(dtype).itemsize)
    old = rng.integers(0, np.iinfo(dtype).max, (37, 301), dtype=dtype)  # 11137 elements: a ragged last word
    new = old.copy()
    hit = rng.choice(new.size, round(fraction * new.size), replace=False)
    new.reshape(-1)[hit] ^= 1
    new.reshape(-1)[-1] ^= 2  # the tail past the last whole word changes too
    k = np.dtype(dtype).itemsize
    changed, payload = diff(old, new, k)
    want = Changed.of(changed_blocks(old, new, k), old.size)
    assert list(changed.windows().__next__()) == list(want.windows().__next__())
    assert (changed.indices is None) == (want.indices is None) == (fraction == 0.5)
    assert np.array_equal(payload, gather_blocks(new.reshape(-1).view(np.uint8), want, k))
    back = old.copy()
    scatter_blocks(back, changed, k, payload)
    assert np.array_equal(back, new)


@pytest.mark.parametrize("target", [one_device, tensor_parallel], ids=["one-device", "tensor-parallel"])
def test_a_delta_scattered_on_the_devices_is_bitwise_the_new_version(state: nnx.State, target, monkeypatch) -> None:
    """``on_device=True`` (the default on GPUs; forced here on CPU): a server's delta pieces take
    their changed elements' offsets and values to the devices and scatter them into a copy of
    the base there; no host buffer the size of a piece is made, and every version of a chain
    (full versions in it included) is bitwise the trainer's, on one device and on strided
    tensor-parallel shards."""
    from jaxrl.weight_transfer import HostBufferPool, puller

    scattered = _Counted(puller._scatter_elements)
    monkeypatch.setattr(puller, "_scatter_elements", scattered)
    versions = [state]
    for v in range(2, 7):
        versions.append(step(versions[-1], v))
    pool = HostBufferPool()
    with Publisher(delta=True, full_every=3, block_bytes=None) as pub:
        held, have = None, None
        for v, params in enumerate(versions, start=1):
            manifest = pub.publish(v, params)
            delta = applies_as_delta(manifest, pub.lineage if have else None, have)
            before, calls = pool.fresh_bytes + pool.reused_bytes, scattered.calls
            # host_bytes small: the delta's pieces go in several groups, the full versions in row chunks
            held = pull_weights(manifest, target(state), timeout_s=20, previous=held, have_version=have,
                                have_lineage=pub.lineage, buffers=pool, on_device=True, host_bytes=4096)  # fmt: skip
            have = v
            assert same_bits(held, params), f"version {v}"
            if delta:  # no piece went through host memory; every piece was scattered on its device(s)
                assert pool.fresh_bytes + pool.reused_bytes == before and scattered.calls > calls, v
            else:
                assert scattered.calls == calls, v


def test_device_scatter_counts_pad_to_few_sizes_within_an_eighth() -> None:
    """The GPU path's padding: at least the count, at most 1/8 more (or 1024), few distinct sizes
    over a range of counts, and past-the-end padding offsets that still fit int32 wherever the
    path is taken."""
    from jaxrl.weight_transfer.puller import _bucket, _step

    counts = range(1, 3_000_000, 997)
    for n in counts:
        assert n <= _bucket(n) < n + _step(n) and _step(n) <= max(1024, n / 4)
    assert len({_bucket(n) for n in counts}) <= 8 * ((3_000_000 // 1024).bit_length() + 1)  # 8 an octave
    size = 2**31 - 1 - _step(2**31 - 1)  # the largest piece the path takes: its padding still fits
    assert size + _bucket(size) - size < 2**31
