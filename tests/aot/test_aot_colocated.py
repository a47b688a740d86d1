"""``jaxrl.aot`` on a multi-host topology places the embedded engine as the run does with several
processes: colocated over every device (``jaxrl.engine.weights.colocated_mesh``). Checked here on
this host's CPU devices standing in for a 2-host slice (no libtpu needed); tests/aot/test_aot.py
compiles it for a real TPU topology when libtpu is installed."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from jaxrl.aot import plan, run_shapes
from jaxrl.aot.topology import Topology
from jaxrl.cli import build_config
from jaxrl.config import read_toml

SMALL = Path(__file__).parent / "small_rl.toml"


def topology(name: str, generation: str) -> Topology:
    devices = tuple(jax.devices()[:8])
    if len(devices) < 8:
        pytest.skip("needs 8 CPU devices (tests/conftest.py sets --xla_force_host_platform_device_count)")
    return Topology(name, generation, devices, 95 * 1024**3)


@pytest.mark.parametrize(("name", "generation", "hosts"), [
    ("v5p:2x2x2", "v5p", 2), ("v5p:2x2x4", "v5p", 4), ("v5p:2x2x1", "v5p", 1), ("v6e:2x4", "v6e", 1),
    ("v6e:4x4", "v6e", 4), ("v5e:2x2", "v5e", 1), ("gpu:h100x8", "gpu:h100", 1),
])  # fmt: skip
def test_hosts_of_a_topology(name, generation, hosts) -> None:
    assert Topology(name, generation, (), 0).hosts == hosts


def test_multi_host_topology_places_the_engine_on_every_device() -> None:
    cfg = build_config(read_toml(SMALL), ["--trainer.mesh.fsdp", "4"])  # fsdp 4 x tensor 2 = 8 devices
    topo = topology("v5p:2x2x2", "v5p")  # 2 hosts
    colocated, single = run_shapes(cfg, topo), run_shapes(cfg, topo, colocated=False)
    assert dict(colocated.engine.mesh.shape) == {"replica": 4, "expert": 1, "tensor": 2}
    assert dict(single.engine.mesh.shape) == {"expert": 1, "tensor": 2}  # one host: its first 2 devices
    co, one = colocated.state_bytes(), single.state_bytes()
    # The weights and the KV cache are split over tensor and repeated over the replica groups.
    assert co["engine_weights"] == one["engine_weights"]
    assert co["engine_kv_cache"] == one["engine_kv_cache"]
    assert run_shapes(cfg, topology("v6e:2x4", "v6e")).engine.mesh.axis_names == ("expert", "tensor")


@pytest.mark.slow  # two engine compiles (~15 s on 2 cores)
def test_colocated_engine_programs_compile_over_every_device() -> None:
    cfg = build_config(read_toml(SMALL), ["--trainer.mesh.fsdp", "4"])
    fits = plan(cfg, topology("v5p:2x2x2", "v5p"), trainer=False)
    assert [f.program for f in fits] == ["engine_decode[16x512]", "engine_prefill[8x128]"]
    for f in fits:
        assert f.error is None and f.fits, f
        assert f.mesh == {"replica": 4, "expert": 1, "tensor": 2}


@pytest.mark.slow  # an engine decode compile each (~15-25 s on 2 cores)
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_8_bit_engine_weights_take_a_quarter_to_a_half_of_the_bytes_and_compile(kind) -> None:
    """``[inference.backend] quantization``: ``jaxrl.aot`` counts and compiles the served 8-bit
    projections (values in 1 byte, a float32 scale per output channel) instead of the model's dtype."""
    cfg = build_config(read_toml(SMALL), ["--trainer.mesh.fsdp", "4"])
    topo = topology("v6e:2x4", "v6e")
    plain = run_shapes(cfg, topo).state_bytes()["engine_weights"]
    cfg = build_config(read_toml(SMALL), ["--trainer.mesh.fsdp", "4", "--inference.backend.quantization", kind])
    run = run_shapes(cfg, topo)
    quantized = run.state_bytes()["engine_weights"]
    assert quantized < plain and run.engine.layout.quantization == kind
    from jaxrl.models.quantize import QArray

    leaves = jax.tree.leaves(run.engine.weights, is_leaf=lambda x: isinstance(x, QArray))
    assert any(isinstance(x, QArray) for x in leaves)
    (decode, *_) = plan(cfg, topo, trainer=False)
    assert decode.error is None and decode.fits, decode
