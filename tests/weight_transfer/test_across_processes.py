"""Weights pulled across real processes: two trainer processes (JAX's multi-controller runtime,
2 CPU devices each, one fsdp-4 mesh across them: each holds half of every sharded param, and
both hold the replicated ones) publish versions of a tiny decoder; this process pulls them
onto one device and onto a tensor-parallel layout of its own devices, over each transport, and
gets the trainer's weights cast to bfloat16 bit for bit. An evicted version and a dead endpoint
fail with one clear error naming the endpoint and the param."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_model
from xla_flags import cpu_devices

from jaxrl.engine import weights
from jaxrl.weight_transfer import Manifest, PullError, merge_manifests, pull_weights
from jaxrl.weight_transfer.manifest import param_leaves
from jaxrl.ports import free_port

# Starts process trees of its own: one such module at a time (conftest).
pytestmark = pytest.mark.usefixtures("one_process_tree_at_a_time")

HERE = Path(__file__).resolve().parent
PROCESSES = 2
START_S = 90  # a safety net: two processes start in ~10 s on a loaded 2-core host


class Trainers:
    """The trainer processes (``trainer_proc.py``), driven over their stdin."""

    def __init__(self, out: Path):
        self.out, self.version = out, 0
        env = dict(os.environ, XLA_FLAGS=cpu_devices(2), JAX_PLATFORMS="cpu")
        coordinator = f"127.0.0.1:{free_port()}"
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(HERE / "trainer_proc.py"),
                    "--process-id",
                    str(i),
                    "--num-processes",
                    str(PROCESSES),
                    "--coordinator",
                    coordinator,
                    "--out",
                    str(out),
                ],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=(out / f"p{i}.log").open("w"),
                text=True,
                start_new_session=True,
            )
            for i in range(PROCESSES)
        ]
        for p in self.procs:
            self._expect(p, "READY")

    def _expect(self, proc: subprocess.Popen, prefix: str) -> str:
        line = proc.stdout.readline()  # the replies alone: the process's C++ prints go to its log
        if not line.startswith(prefix):
            self.kill()
            logs = "\n".join((self.out / f"p{i}.log").read_text()[-2000:] for i in range(PROCESSES))
            pytest.fail(f"trainer process said {line!r}, expected {prefix}:\n{logs}")
        return line

    def publish(self) -> dict[str, Manifest]:
        """Publish the next version on every process; its merged manifest per transport."""
        self.version += 1
        for p in self.procs:
            p.stdin.write(f"publish {self.version}\n")
            p.stdin.flush()
        replies = [json.loads(self._expect(p, "{")) for p in self.procs]
        merged = {
            t: merge_manifests(Manifest.from_json(r["manifests"][t]) for r in replies)
            for t in replies[0]["manifests"]
        }
        # The publishers' fragments joined == what any process computes from the global shardings.
        assert all(merged[t] == Manifest.from_json(r["whole"][t]) for r in replies for t in merged)
        return merged

    def reference(self, version: int) -> dict[str, np.ndarray]:
        """The float32 params of ``version`` cast to bfloat16 (on host, round to nearest even as XLA does)."""
        with np.load(self.out / f"ref_{version}.npz") as f:
            return {k: f[k].astype(jnp.bfloat16) for k in f.files}

    def kill(self, index: int | None = None) -> None:
        for i, p in enumerate(self.procs):
            if (index is None or i == index) and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory):
    t = Trainers(tmp_path_factory.mktemp("trainers"))
    try:
        yield t
    finally:
        t.kill()


def target(tensor_parallel: int) -> nnx.State:
    """The engine's param state in abstract form (bfloat16) on a serving mesh of devices 4-7
    (None: device 0), as ``ModelRunner`` builds it."""
    _, state = nnx.split(tiny_model())
    mesh = weights.serving_mesh(tensor_parallel, jax.devices()[4:])
    shardings = weights.state_shardings(state, weights.param_sharding_fn(mesh))
    return jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=sh), state, shardings
    )


def assert_bitwise(pulled: nnx.State, like: nnx.State, want: dict[str, np.ndarray]) -> None:
    assert jax.tree.structure(pulled) == jax.tree.structure(like)
    for (path, x), t in zip(param_leaves(pulled), jax.tree.leaves(like), strict=True):
        assert x.sharding == t.sharding and x.dtype == jnp.bfloat16, path
        for s in x.addressable_shards:  # each device's own buffer
            np.testing.assert_array_equal(
                np.asarray(s.data).view(np.uint16), want[path][s.index].view(np.uint16), path
            )


@pytest.mark.parametrize("transport", ["tcp", "jax"])
def test_pulls_onto_one_device_and_tensor_parallel_equal_the_trainers_weights(
    trainers: Trainers, transport: str
) -> None:
    manifest = trainers.publish()[transport]
    assert len(manifest.endpoints) == PROCESSES
    # fsdp-4 over two processes: each endpoint holds two of the four row blocks of w_up's embed dim.
    assert sorted(s.endpoint for s in manifest.param("w_up").shards) == [0, 0, 1, 1]
    want = trainers.reference(manifest.version)
    for tp in (1, 4):
        like = target(tp)
        assert_bitwise(pull_weights(manifest, like, timeout_s=30), like, want)
    # Host memory bounded to 2 KB: the stacked weights cut into single layers, embed and lm_head
    # into row blocks, each written into its device buffer in place.
    like = target(1)
    assert_bitwise(pull_weights(manifest, like, timeout_s=30, host_bytes=2048), like, want)


def test_an_evicted_version_fails_with_a_clear_error(trainers: Trainers) -> None:
    old = trainers.publish()["tcp"]
    trainers.publish()
    newest = trainers.publish()["tcp"]  # the publishers keep 2: `old` is gone
    with pytest.raises(PullError, match=rf"version {old.version} is not held by the publisher at 127\.0\.0\.1:\d+ "
                       rf"\(it holds versions \[{old.version + 1}, {newest.version}\]") as e:  # fmt: skip
        pull_weights(old, target(1), timeout_s=30)
    assert e.value.endpoint in old.endpoints and e.value.param in {p.path for p in old.params}
    assert (
        f"endpoint {old.endpoints.index(e.value.endpoint)} ({e.value.endpoint}), param {e.value.param!r}"
        in str(e.value)
    )
    assert_bitwise(
        pull_weights(newest, target(1), timeout_s=30), target(1), trainers.reference(newest.version)
    )


def test_a_dead_endpoint_fails_within_the_timeout(trainers: Trainers) -> None:
    manifest = trainers.publish()["tcp"]
    # An endpoint that accepts connections and never answers: the pull gives up at its deadline.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        mute = f"127.0.0.1:{silent.getsockname()[1]}"
        stuck = Manifest(manifest.version, (manifest.endpoints[0], mute), manifest.params, "tcp")
        t0 = time.monotonic()
        with pytest.raises(PullError, match=rf"failed at endpoint 1 \({mute}\), param '\w+': TimeoutError"):
            pull_weights(stuck, target(1), timeout_s=2)
        assert 2 <= time.monotonic() - t0 < 4
    # A trainer process that died: refused at once, naming it.
    trainers.kill(1)
    t0 = time.monotonic()
    with pytest.raises(
        PullError, match=rf"endpoint 1 \({manifest.endpoints[1]}\), param '\w+': ConnectionRefusedError"
    ):
        pull_weights(manifest, target(1), timeout_s=10)
    assert time.monotonic() - t0 < 2
