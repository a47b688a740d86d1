"""Publisher and puller in one process: versions kept and refused, a clean stop, pulls racing
new versions (each whole and right, or refused), target checks and reused (delta) params."""

from __future__ import annotations

import socket
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from jax.sharding import SingleDeviceSharding

from jaxrl.models.sharding import shard_params
from jaxrl.parallel.mesh import MeshConfig, make_mesh
from jaxrl.weight_transfer import Publisher, PullError, VersionUnavailable, get_transport, pull_weights
from jaxrl.weight_transfer.manifest import param_leaves


@pytest.fixture(scope="module")
def state() -> nnx.State:
    """The tiny decoder's params, fsdp-4 on devices 0-3."""
    _, params = nnx.split(tiny_model())
    return shard_params(params, make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4]))


def plus(state: nnx.State, v: float) -> nnx.State:
    return jax.tree.map(lambda x: x + v, state)


def one_device(state: nnx.State, dtype=jnp.bfloat16) -> nnx.State:
    sh = SingleDeviceSharding(jax.devices()[5])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype, sharding=sh), state)


def same_bits(pulled: nnx.State, state: nnx.State) -> bool:
    return all(
        np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b.astype(jnp.bfloat16)).view(np.uint16))
        for a, b in zip(jax.tree.leaves(pulled), jax.tree.leaves(state), strict=True)
    )


def test_the_newest_versions_are_kept_and_older_ones_refused(state: nnx.State) -> None:
    with Publisher(keep=2) as pub:
        for v in (1, 2, 3):
            pub.publish(v, plus(state, v))
        assert pub.versions == [2, 3]
        box = ((0, 64), (0, 8))  # embed [64, 32] under fsdp-4: columns 0-7
        assert pub.shard(3, "embed", box).dtype == jnp.bfloat16
        with pytest.raises(
            VersionUnavailable,
            match=r"version 1 is not held .* holds versions \[2, 3\]; it keeps the newest 2",
        ):
            pub.shard(1, "embed", box)
        with pytest.raises(ValueError, match="version 3 must be newer than 3"):
            pub.publish(3, state)


def test_the_publisher_listens_on_loopback_and_stops_cleanly(state: nnx.State) -> None:
    before = set(threading.enumerate())
    pub = Publisher()
    host, port = pub.address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    manifest = pub.publish(1, state)
    assert same_bits(
        pull_weights(manifest, one_device(state), timeout_s=20), state
    )  # leaves open connections
    pub.stop()
    pub.stop()  # idempotent
    assert set(threading.enumerate()) - before <= {
        t for t in threading.enumerate() if t.name.startswith("weights-pull")
    }
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(port)), timeout=2)
    with pytest.raises(RuntimeError, match="after stop"):
        pub.publish(2, state)


def test_pulls_racing_new_versions_get_a_whole_version_or_a_clear_refusal(state: nnx.State) -> None:
    versions = {v: plus(state, v) for v in range(1, 7)}
    manifests, outcomes, lock = {}, [], threading.Lock()
    with Publisher(keep=2) as pub:
        manifests[1] = pub.publish(1, versions[1])

        def puller() -> None:
            for _ in range(6):
                with lock:
                    v = (
                        max(manifests) - 1 if len(manifests) > 1 else 1
                    )  # the older held version: racing eviction
                try:
                    ok = same_bits(pull_weights(manifests[v], one_device(state), timeout_s=20), versions[v])
                    outcomes.append("ok" if ok else f"wrong bits in version {v}")
                except PullError as e:
                    outcomes.append("refused" if f"version {v} is not held" in str(e) else repr(e))

        threads = [threading.Thread(target=puller) for _ in range(3)]
        for t in threads:
            t.start()
        for v in range(2, 7):
            m = pub.publish(v, versions[v])
            with lock:
                manifests[v] = m
        for t in threads:
            t.join(60)
    assert set(outcomes) <= {"ok", "refused"} and "ok" in outcomes, outcomes


def test_a_target_unlike_the_manifest_is_refused_before_any_pull(state: nnx.State) -> None:
    with Publisher() as pub:
        manifest = pub.publish(1, state)
    with pytest.raises(
        ValueError, match=r"attn_norm is bfloat16\[2, 32\] in version 1, the target expects float32\[2, 32\]"
    ):
        pull_weights(
            manifest, one_device(state, jnp.float32)
        )  # the publisher is stopped: nothing was asked of it
    with pytest.raises(ValueError, match="unknown weight transport 'udp'"):
        get_transport("udp")


def test_params_unchanged_since_a_held_version_are_reused_not_pulled(state: nnx.State) -> None:
    with Publisher() as pub:
        first = pull_weights(pub.publish(1, state), one_device(state), timeout_s=20)
        changed = dict(param_leaves(state)) | {"wq": dict(param_leaves(state))["wq"] + 1}
        new = jax.tree_util.tree_unflatten(
            jax.tree.structure(state), [changed[p] for p, _ in param_leaves(state)]
        )
        unchanged = {p: 1 for p, _ in param_leaves(state) if p != "wq"}
        manifest = pub.publish(2, new, unchanged_since=unchanged)
        second = pull_weights(manifest, one_device(state), timeout_s=20, previous=first, have_version=1)
    a, b = dict(param_leaves(first)), dict(param_leaves(second))
    assert all(b[p] is a[p] for p in unchanged)  # the same device buffers, not copies
    assert same_bits(second, new)


def test_large_pulls_travel_in_parts_over_several_connections(state: nnx.State, monkeypatch) -> None:
    from jaxrl.weight_transfer import puller

    monkeypatch.setattr(puller, "SPLIT_BYTES", 256)  # tiny weights cut as a 1 GB one would be
    assert puller._cut(((0, 1), (0, 64), (0, 8)), 2, 3) == [
        ((0, 1), (0, 21), (0, 8)),
        ((0, 1), (21, 42), (0, 8)),
        ((0, 1), (42, 64), (0, 8)),
    ]
    with Publisher() as pub:
        assert same_bits(
            pull_weights(pub.publish(1, state), one_device(state), timeout_s=20, connections=3), state
        )


def test_the_pulled_state_is_what_the_engine_swaps_in(state: nnx.State) -> None:
    # ModelRunner.place (Engine.update_weights_from_state) runs weights.place_state(new, its
    # abstract state, its shardings): the pulled state passes its checks and lands unchanged.
    from jaxrl.engine import weights

    like = one_device(state)
    with Publisher() as pub:
        pulled = pull_weights(pub.publish(1, state), like, timeout_s=20)
    placed = weights.place_state(pulled, like, jax.tree.map(lambda x: x.sharding, like))
    assert same_bits(placed, state)


def test_a_strided_destination_is_pulled_as_contiguous_parts_bit_for_bit() -> None:
    """A weight the trainer splits along its second axis (fsdp over embed) lands on one device as
    one contiguous run per layer, straight from the socket (``_contiguous_parts``), bitwise."""
    from jaxrl.weight_transfer.puller import MIN_PART_BYTES, _contiguous_parts

    within = ((0, 4), (0, 512), (0, 8), (0, 128))
    region = ((0, 4), (128, 256), (0, 8), (0, 128))  # one fsdp-4 shard: 128 x 8 x 128 bf16 = 256 KiB a layer
    assert _contiguous_parts(region, within, 2) == [((i, i + 1), (128, 256), (0, 8), (0, 128)) for i in range(4)]
    assert _contiguous_parts(region, within, 1) == [region]  # 128 KiB parts < MIN_PART_BYTES: one strided copy
    assert _contiguous_parts(within, within, 2) == [within]  # contiguous already
    assert 128 * 8 * 128 * 2 >= MIN_PART_BYTES
    mesh = make_mesh(MeshConfig(data=1, fsdp=4, tensor=1), jax.devices()[:4])
    x = jax.random.normal(jax.random.key(0), (4, 512, 8, 128), jnp.float32)
    w = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "fsdp")))
    with Publisher() as pub:
        manifest = pub.publish(1, {"wq": w})
        pulled = pull_weights(manifest, {"wq": one_device({"wq": w})["wq"]}, timeout_s=30)
    assert same_bits(pulled, {"wq": w})


def test_the_host_buffer_pool_hands_out_only_blocks_nothing_else_holds() -> None:
    from jaxrl.weight_transfer import HostBufferPool

    pool, nbytes = HostBufferPool(), 256 * 64 * 4
    # (Addresses are read outside the asserts: pytest keeps an assert's operands alive.)
    a = pool.empty((256, 64), np.float32)  # pull 1: a CPU device adopts its buffer as the array
    address, shape = a.ctypes.data, a.shape
    assert address % 64 == 0 and shape == (256, 64)
    served = jax.device_put(a, jax.devices()[0])
    del a
    pool.settle()
    b = pool.empty((256, 64), np.float32)  # pull 2: the served array's block is not handed out
    apart = not np.shares_memory(b, np.asarray(served))
    del b
    assert apart
    pool.settle()
    assert pool.fresh_bytes == 2 * nbytes and pool.held_bytes == 2 * nbytes
    del served  # the swap lets version 1 go
    c = pool.empty((256, 64), jnp.bfloat16)  # pull 3: a free block at most twice its size
    assert pool.fresh_bytes == 2 * nbytes and pool.reused_bytes == nbytes // 2
    tiny = pool.empty((16, 64), jnp.bfloat16)  # not a block 16x its size: a fresh one
    assert pool.fresh_bytes == 2 * nbytes + tiny.nbytes
    pool.settle()  # the free block pull 3 did not use is let go
    assert pool.held_bytes == nbytes + tiny.nbytes
    del c, tiny
    pool.settle()
    assert pool.held_bytes == 0


def test_versions_pulled_through_a_pool_reuse_memory_the_server_let_go_never_what_it_serves(
    state: nnx.State,
) -> None:
    from jaxrl.weight_transfer import HostBufferPool

    pool, like = HostBufferPool(), one_device(state)
    fresh = []  # fresh host bytes after each version
    with Publisher() as pub:
        served = pull_weights(pub.publish(1, state), like, timeout_s=20, buffers=pool)
        fresh.append(pool.fresh_bytes)
        for v in (2, 3, 4):
            new = pull_weights(pub.publish(v, plus(state, v)), like, timeout_s=20, buffers=pool)
            fresh.append(pool.fresh_bytes)
            assert same_bits(served, plus(state, v - 1) if v > 2 else state)  # what is served was not written
            served = new  # the swap: the version before is let go
            assert same_bits(served, plus(state, v))
    size = sum(x.size * 2 for x in jax.tree.leaves(state))  # bfloat16
    # Versions 1 and 2 come into fresh memory (version 1 is served during 2's pull); 3 and 4
    # reuse the memory of the version before the last, and need none of their own.
    assert fresh[0] >= size and fresh[1] >= 2 * size
    assert fresh[3] == fresh[2] == fresh[1] and pool.reused_bytes >= 2 * size


def test_host_copies_reuse_memory_of_dropped_versions_never_what_a_pull_still_reads(state: nnx.State) -> None:
    """Params already in the serving dtype on CPU devices are copied to host (the trainer may
    donate its arrays) into the publisher's pool: a version dropped beyond ``keep`` lends its
    memory to a later one, except what a pull in flight still reads (here: a view of version
    1's embed, held across three more publishes)."""
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state)
    versions = {1: bf16} | {v: plus(bf16, v) for v in range(2, 8)}
    fresh = []
    with Publisher(keep=2) as pub:
        pub.publish(1, versions[1])
        reading = pub.shard(1, "embed", ((0, 64), (0, 8)))  # a pull of version 1 in flight
        want = reading.copy()
        for v in range(2, 8):
            pub.publish(v, versions[v])
            fresh.append(pub._buffers.fresh_bytes)
            for held in (v - 1, v):  # both held versions are exactly what was published
                for path, x in param_leaves(versions[held]):
                    for box in x.sharding.addressable_devices_indices_map(x.shape).values():
                        box = tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(box, x.shape))
                        got = pub.shard(held, path, box).view(np.uint16)
                        assert np.array_equal(got, np.asarray(x)[tuple(slice(a, b) for a, b in box)].view(np.uint16))
            if v == 4:
                assert np.array_equal(reading.view(np.uint16), want.view(np.uint16))  # never written
                del reading
    size = sum(x.size * 2 for x in jax.tree.leaves(bf16))  # one version's shards (fsdp: each element once)
    assert fresh[1] >= 3 * size  # versions 1-3 take fresh memory (two held while the next is made)
    assert fresh[-1] == fresh[-2] == fresh[-3] and pub._buffers.reused_bytes >= 2 * size  # then it is reused


def test_a_bad_request_gets_one_clear_error_and_the_publisher_keeps_serving() -> None:
    """Raw requests over a real socket (as a buggy or hostile puller sends them): a region past
    its shard's end (numpy would clip the slice and serve other bytes), a malformed item, items
    that are not a list, block_bytes 0, an unheld base: each answered with an error naming what
    is wrong, on the same connection, and a real delta pull goes through afterwards."""
    import time

    from jaxrl.weight_transfer import applies_as_delta, tcp
    from jaxrl.weight_transfer.base import RemoteError

    x = {"w": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64)}
    y = {"w": x["w"].at[3, 5].add(1.0)}
    whole = [[0, 64], [0, 64]]
    bad = {
        "is not inside shard": {"op": "delta", "version": 2, "base": 1, "block_bytes": 2, "items": [["w", whole, [[0, 99], [0, 64]]]]},
        "is not inside shard ": {"op": "get", "version": 2, "items": [["w", whole, [[10, 5], [0, 64]]]]},
        "give \\[param, shard box, region box\\]": {"op": "get", "version": 2, "items": [["w", whole]]},
        "items 7: give a list": {"op": "get", "version": 2, "items": 7},
        "block_bytes 0": {"op": "delta", "version": 2, "base": 1, "block_bytes": 0, "items": [["w", whole, whole]]},
        "version 7 is not held": {"op": "delta", "version": 2, "base": 7, "block_bytes": 2, "items": [["w", whole, whole]]},
    }
    with Publisher(delta=True) as pub:
        m1, m2 = pub.publish(1, x), pub.publish(2, y)
        host, port = pub.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for message, request in bad.items():
                tcp.send_request(sock, request, time.monotonic() + 10)
                with pytest.raises(RemoteError, match=message.strip()):
                    tcp.read_reply(sock, time.monotonic() + 10)
        target = {"w": jax.ShapeDtypeStruct((64, 64), jnp.bfloat16, sharding=SingleDeviceSharding(jax.devices()[0]))}
        v1 = pull_weights(m1, target, timeout_s=10)
        assert applies_as_delta(m2, pub.lineage, 1)
        v2 = pull_weights(m2, target, timeout_s=10, previous=v1, have_version=1, have_lineage=pub.lineage)
        assert np.array_equal(np.asarray(v2["w"]), np.asarray(y["w"].astype(jnp.bfloat16)))
