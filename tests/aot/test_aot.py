"""AOT compiles for TPU on this CPU host (libtpu's compile-only client): the whole train step
and engine of a small TPU-aligned model on a (fsdp, tensor) mesh, per generation; the exit
status and error of the command when a program does not fit; and the real-size recipes'
resolution (their whole-step compiles take minutes: ``python -m jaxrl.aot`` / studies/tpu_fit/tpu_fit.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("libtpu")

from jaxrl.aot import get_topology, plan
from jaxrl.cli import build_config
from jaxrl.config import read_toml

ROOT = Path(__file__).resolve().parents[2]
SMALL = Path(__file__).parent / "small_rl.toml"


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_small_model_whole_step_and_engine_compile_and_fit(topology: str) -> None:
    cfg = build_config(read_toml(SMALL), [])
    topo = get_topology(topology)
    fits = plan(cfg, topo)
    by_name = {f.program: f for f in fits}
    assert list(by_name) == ["train_micro_step[4x512]", "train_update", "engine_decode[16x512]", "engine_prefill[8x128]"]
    for f in fits:
        assert f.error is None, f
        assert f.fits and 0 < f.total_bytes < topo.hbm_per_device
        assert f.total_bytes == f.argument_bytes + f.output_bytes - f.alias_bytes + f.temp_bytes + f.resident_other_bytes
    step = by_name["train_micro_step[4x512]"]
    assert step.mesh == {"data": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert step.alias_bytes > 0  # the gradient accumulator is donated and updated in place
    assert step.temp_bytes > 0
    decode = by_name["engine_decode[16x512]"]
    assert decode.mesh == {"expert": 1, "tensor": 2}
    # The KV cache (bf16, 2 layers x 16 rows x 512 x 2 kv heads x 128, k and v) is split over
    # the 2 kv heads: 2 MiB... per chip, donated (aliased) to the updated cache.
    cache_per_chip = 2 * (2 * 16 * 512 * 2 * 128 * 2) // 2
    assert decode.alias_bytes >= cache_per_chip
    # Resident state per chip: optimizer state O (during the micro-step, beside the engine's
    # state E), E alone (during the update), parameters P + O (during rollouts). Adam's moments
    # are sharded exactly as the (fsdp x tensor-sharded, float32) parameters: O = 2 P.
    opt = step.resident_other_bytes - by_name["train_update"].resident_other_bytes
    params = decode.resident_other_bytes - opt
    assert abs(opt - 2 * params) <= 64  # + Adam's step counts
    from jaxrl.aot.programs import model_hf_config
    from jaxrl.models.arch import arch_from_hf_config

    full = arch_from_hf_config(model_hf_config(cfg.model)[0]).num_params() * 4
    assert params < full / 3  # sharded 4 ways (norms stay replicated)


def test_lora_compiles_with_the_frozen_base_resident_and_adapter_sized_optimizer() -> None:
    """``[trainer.lora]``: the micro-step takes the frozen base as an argument, the optimizer
    state is the adapters' (a small fraction of full fine-tuning's), and the base weights stay
    resident beside the engine's programs and the update."""
    from jaxrl.aot.programs import run_shapes

    topo = get_topology("v5e:2x2")
    full_cfg = build_config(read_toml(SMALL), [])
    lora_cfg = build_config(read_toml(SMALL), ["--trainer.lora.rank", "4"])
    full_sb, lora_sb = run_shapes(full_cfg, topo).state_bytes(), run_shapes(lora_cfg, topo).state_bytes()
    assert lora_sb["trainer_frozen"] == full_sb["trainer_params"] and full_sb["trainer_frozen"] == 0
    assert lora_sb["trainer_opt_state"] < 0.1 * full_sb["trainer_opt_state"]
    fits = {f.program: f for f in plan(lora_cfg, topo)}
    assert all(f.error is None and f.fits for f in fits.values()), fits
    resident = lora_sb["trainer_params"] + lora_sb["trainer_frozen"] + lora_sb["trainer_opt_state"]
    assert fits["engine_decode[16x512]"].resident_other_bytes == resident
    step = fits["train_micro_step[4x512]"]
    assert step.argument_bytes >= lora_sb["trainer_frozen"] + 2 * lora_sb["trainer_params"]  # base + adapters + grads


def test_command_exits_nonzero_naming_the_program_and_knobs(tmp_path: Path) -> None:
    """A 6.4B-parameter trainer cannot fit v5e:2x2: 16 bytes per parameter over 4 chips > 16 GiB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = [
        sys.executable, "-m", "jaxrl.aot", "--config", str(SMALL), "--topology", "v5e:2x2", "--no-engine",
        "--model.scratch.hidden_size", "4096", "--model.scratch.intermediate_size", "32768",
        "--model.scratch.num_layers", "16",
    ]
    out = subprocess.run(args, check=False, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    assert out.returncode == 1, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    step = next(r for r in rows if r["program"].startswith("train_micro_step"))
    assert not step["fits"] and step["hbm_bytes"] == 16 * 1024**3
    # Over HBM either by our sum or by XLA's own verdict at compile time (what happens here).
    assert step["oom"] or step["total_bytes"] > step["hbm_bytes"]
    assert "error: train_micro_step[4x512] does not fit" in out.stderr
    assert "trainer.micro_batch_rows" in out.stderr and "trainer.remat" in out.stderr


def test_bad_topology_and_missing_field_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="generations known here: v4, v5e, v5p, v6e"):
        get_topology("v9:2x2")
    # Through the command (one process: each start imports libtpu, ~17 s here): exit 2, one line.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "jaxrl.aot", "--config", str(SMALL)]
    out = subprocess.run([*base, "--topology", "v5e:3x3"], check=False, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and "libtpu cannot describe it" in out.stderr


# Each real-size recipe and the slice it is written for (the header comment of each file).
RECIPES = {
    "configs/qwen3_0_6b/sft.toml": "v6e:2x4",
    "configs/qwen3_0_6b/rl.toml": "v6e:2x4",
    "configs/qwen3_8b/sft.toml": "v5p:2x2x4",
    "configs/qwen3_8b/rl.toml": "v5p:2x2x4",
}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_resolves_and_its_resident_state_fits(recipe: str) -> None:
    """Cheap check (no compile): config, architecture, meshes and per-chip state. The whole-step
    compiles of these recipes are studies/tpu_fit/tpu_fit.py's (minutes each on 2 cores)."""
    from jaxrl.aot import run_shapes

    cfg = build_config(read_toml(ROOT / recipe), [])
    topo = get_topology(RECIPES[recipe])
    run = run_shapes(cfg, topo)
    size = {"qwen3_0_6b": 0.596e9, "qwen3_8b": 8.19e9}[Path(recipe).parent.name]
    assert abs(run.arch.num_params() - size) / size < 0.01
    assert run.mesh.shape["fsdp"] == topo.num_devices  # fsdp = -1 takes the whole slice
    sb = run.state_bytes()
    # float32 master weights and Adam moments, all sharded over the slice: 12 bytes / parameter / chip
    assert abs(sb["trainer_opt_state"] - 2 * sb["trainer_params"]) <= 64
    assert sb["trainer_params"] < 4 * size / topo.num_devices * 1.1
    if cfg.mode == "rl":
        a, i = run.arch, cfg.inference
        cache = 2 * a.num_layers * i.max_seqs * i.max_model_len * a.num_kv_heads * a.head_dim * 2  # bf16 k and v
        # v5p:2x2x4 is 4 hosts: the engine is colocated over all 16 chips, repeated over replica groups.
        replicas = run.engine.mesh.shape.get("replica", 1)
        assert replicas == (topo.num_devices // i.backend.tensor_parallel if topo.hosts > 1 else 1)
        assert sb["engine_kv_cache"] == cache // i.backend.tensor_parallel
    # + gradients (as parameters): well under the chip's HBM, leaving room for activations
    assert sum(sb.values()) + sb["trainer_params"] < 0.6 * topo.hbm_per_device


def test_multi_host_topology_compiles_the_engine_colocated() -> None:
    """v5p:2x2x2 is 8 chips on 2 hosts: the run's engine spans every device (data x expert x
    tensor, ``weights.colocated_mesh``), and so do its compiled programs."""
    cfg = build_config(read_toml(SMALL), ["--trainer.mesh.fsdp", "4"])
    topo = get_topology("v5p:2x2x2")
    assert topo.hosts == 2
    fits = {f.program: f for f in plan(cfg, topo, trainer=False)}
    for f in fits.values():
        assert f.error is None and f.fits, f
        assert f.mesh == {"replica": 4, "expert": 1, "tensor": 2}
