"""``python -m jaxrl.devicecheck --smoke`` runs as a user runs it (its own process, on the CPU) so
the prepared accelerator run cannot rot: every check and benchmark writes its line, every
correctness check passes, the lines file holds exactly what was printed, the compile cache and the
profiles land in the output folder, and the summary table lists every line. No timing is asserted
(the numbers depend on the machine); the FLOP/byte counts and the deadline watchdog are checked
on their own with exact expectations."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl.devicecheck.common import (
    decode_bytes_per_step,
    peak_bandwidth,
    peak_flops,
    train_flops_per_token,
    utilization,
)
from jaxrl.devicecheck.mismatch import mismatch_stats
from jaxrl.devicecheck.run import Deadline, Report, _run_measure
from jaxrl.models.arch import arch_from_hf_config
from jaxrl.models.tiny import qwen3_config

ROOT = Path(__file__).resolve().parents[1]
HAS_TORCH = importlib.util.find_spec("torch") is not None  # the Python 3.12 CI end runs without it
CHECKS = ("logits_vs_transformers", "engine_vs_trainer", "bf16_loss_grads", "kernel_training_attention",
          "kernel_cached_attention", "kernel_logprobs")


@pytest.mark.slow
def test_smoke_run_writes_every_line_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's machine has (conftest sets 8 virtual ones)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.devicecheck", "--smoke", "--out", str(out), "--profile",
         "--budget-s", "3600", "--measure-s", "1800"],
        check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (lines_file,) = out.glob("lines-*.jsonl")
    lines = [json.loads(x) for x in lines_file.read_text().splitlines()]
    printed = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert printed == lines  # the file holds exactly what was printed

    assert lines[0]["versions"]["jax"] and lines[0]["versions"]["jaxrl"] == "0.1.0"
    assert lines[1]["platform"] == "cpu" and lines[1]["mode"] == "smoke" and lines[1]["peak_bf16_tflops"] is None
    assert any((out / "compile-cache").iterdir())  # the persistent compile cache is in the output folder
    for remat in ("none", "dots", "full"):
        assert list((out).glob(f"profile-*-train_remat_{remat}/**/*.xplane.pb")), remat

    checks = {line["check"]: line for line in lines if "check" in line}
    assert set(checks) == set(CHECKS)
    assert all(line["ok"] is True for line in checks.values()), checks
    # What runs on the CPU is compared, not skipped: only the training attention has no kernel
    # here (and, without torch, the transformers reference).
    skipped = [name for name, line in checks.items() if "skipped" in line]
    expected = ["kernel_training_attention"] if HAS_TORCH else ["logits_vs_transformers", "kernel_training_attention"]
    assert skipped == expected
    assert checks["engine_vs_trainer"]["greedy_exact_argmax"] is True

    benches = [line for line in lines if "bench" in line]
    assert not [line for line in benches if "error" in line or line.get("timed_out")], benches
    (mismatch,) = [line for line in benches if line["bench"] == "logprob_mismatch_bf16"]
    assert mismatch["tokens"] == 2 * 8  # engine_prompts x engine_new_tokens of the smoke shapes
    assert 0 <= mismatch["abs_delta_mean"] <= mismatch["abs_delta_max"] < 0.1 and mismatch["kl_k3"] >= 0

    hw = {}
    for remat, policy in (("none", "none"), ("dots", "save_dots"), ("full", "full")):
        train = {line["impl"]: line for line in benches
                 if line["bench"] == f"train_remat_{remat}" and "profile_dir" not in line}
        assert set(train) == {"jaxrl", "transformers"}, remat
        jl = train["jaxrl"]
        assert jl["remat"] == policy and jl["tokens_per_s"] > 0 and jl["mfu"] is None and jl["hfu"] is None
        hw[remat] = jl["hw_tflops_per_step"] / jl["model_tflops_per_step"]
        if remat == "dots":
            assert "no save-the-matmuls" in train["transformers"]["skipped"]
        elif HAS_TORCH:
            assert train["transformers"]["gradient_checkpointing"] is (remat == "full")
            assert jl["over_transformers"] > 0
        else:
            assert train["transformers"]["skipped"] == "torch is not importable"
    assert hw["none"] == 1.0 < hw["dots"] < hw["full"]  # recompute counted in the hardware FLOPs only

    decode = [line for line in benches if line["bench"] == "decode"]
    assert [line["batch"] for line in decode] == [1, 4]
    assert all(line["engine_tok_s"] > 0 and line["hbm_gbps"] > 0 and line["hbm_share"] is None for line in decode)
    if HAS_TORCH:
        assert all(line["hf_generate_tok_s"] > 0 for line in decode)
    # 8-bit projections: the mismatch grows, stays small; decode runs at the largest batch
    for kind in ("int8", "fp8"):
        (q,) = [line for line in benches if line["bench"] == f"logprob_mismatch_{kind}"]
        assert q["tokens"] == 2 * 8 and 0 < q["abs_delta_mean"] <= q["abs_delta_max"] < 0.1 and q["kl_k3"] >= 0
    quantized = {line["quantization"]: line for line in benches if line["bench"] == "decode_quantized"}
    assert set(quantized) == {"int8", "fp8"} and all(q["batch"] == 4 and q["engine_tok_s"] > 0 for q in quantized.values())
    steps = [line for line in benches if line["bench"] == "rl_step"]
    assert [line["step"] for line in steps] == [1, 2, 3, 4, 5]
    (rl,) = [line for line in benches if line["bench"] == "rl_run"]
    for key in ("rollout_wait_s", "train_s", "weight_sync_s", "step_s"):
        assert rl[key] >= 0, key

    # The summary table names every line once per line.
    names = [line.get("check") or line.get("bench") for line in lines[2:]]
    table_rows = [row.split("│")[1].strip() for row in proc.stdout.splitlines() if row.startswith("│")]
    assert [r for r in table_rows if r][2:] == names


def test_unknown_only_name_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jaxrl.devicecheck", "--only", "train_remat_full,nope"],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "--only: unknown name(s) nope" in proc.stderr


def test_peaks_by_device_kind() -> None:
    """jax's device_kind strings map to datasheet dense bf16 peaks and HBM bandwidths; anything
    else has none (no MFU or bandwidth share rather than a guessed one)."""
    tera, giga = 1e12, 1e9
    assert (peak_flops("NVIDIA H100 80GB HBM3"), peak_bandwidth("NVIDIA H100 80GB HBM3")) == (989 * tera, 3350 * giga)
    assert (peak_flops("NVIDIA H200"), peak_bandwidth("NVIDIA H200")) == (989 * tera, 4800 * giga)
    assert (peak_flops("NVIDIA A100-SXM4-80GB"), peak_bandwidth("NVIDIA A100-SXM4-80GB")) == (312 * tera, 2039 * giga)
    assert peak_bandwidth("NVIDIA A100-SXM4-40GB") == 1555 * giga
    assert (peak_flops("TPU v5 lite"), peak_bandwidth("TPU v5 lite")) == (197 * tera, 819 * giga)
    assert (peak_flops("TPU v6 lite"), peak_bandwidth("TPU v6 lite")) == (918 * tera, 1640 * giga)
    assert (peak_flops("TPU v5p"), peak_bandwidth("TPU v5p")) == (459 * tera, 2765 * giga)
    assert peak_flops("TPU v4") == 275 * tera
    assert peak_flops("cpu") is None and peak_bandwidth("NVIDIA GeForce RTX 4090") is None
    assert utilization(6e12, 1.0, 6e12) == 1.0 and utilization(1.0, 1.0, None) is None


ARCH = arch_from_hf_config(qwen3_config(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                        max_position_embeddings=256).to_dict())


def test_train_flops_count_the_recompute_of_each_remat_policy() -> None:
    d, hd, f, layers, seq = ARCH.hidden_size, ARCH.head_dim, ARCH.intermediate_size, 2, 128
    layer_matmuls = layers * (d * hd * (4 * 2 + 2 * 2) + 3 * d * f)
    attn_fwd = layers * 2 * 2 * 4 * hd * seq / 2  # QK^T and PV, causal half
    model = 6 * (layer_matmuls + d * ARCH.vocab_size) + 3 * attn_fwd
    assert train_flops_per_token(ARCH, seq, "none") == (model, model)
    assert train_flops_per_token(ARCH, seq, "save_dots") == (model, model + attn_fwd)
    assert train_flops_per_token(ARCH, seq, "full") == (model, model + 2 * layer_matmuls + attn_fwd)


def test_decode_bytes_read_the_weights_once_and_the_kv_cache_to_the_context() -> None:
    assert ARCH.tie_word_embeddings  # the table is the LM head: read whole
    kv = 8 * 100 * 2 * 2 * 2 * ARCH.head_dim * 2  # batch x context x layers x (k, v) x kv_heads x head_dim x bytes
    assert decode_bytes_per_step(ARCH, 8, 100, 2, 2) == ARCH.num_params() * 2 + kv


def test_mismatch_stats() -> None:
    trainer = np.log(np.array([0.5, 0.25, 0.2]))
    engine = np.log(np.array([0.5, 0.5, 0.1]))
    delta = trainer - engine  # 0, -log 2, log 2
    s = mismatch_stats(trainer, engine)
    assert s["abs_delta_mean"] == pytest.approx(2 * np.log(2) / 3) and s["abs_delta_max"] == pytest.approx(np.log(2))
    assert s["kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert s["kl_k3"] == pytest.approx(np.mean(np.exp(delta) - 1 - delta)) and s["kl_k3"] > 0
    assert (s["ratio_min"], s["ratio_max"]) == pytest.approx((0.5, 2.0))


def test_a_measure_past_its_deadline_is_written_as_timed_out_and_the_run_goes_on(tmp_path: Path) -> None:
    """The watchdog writes the timed-out line while the measure is still inside a blocking call
    (as a device computation would be); the lines it had already yielded stay; the measure stops
    when it is back in Python; the next measure runs normally."""
    path = tmp_path / "lines.jsonl"
    report = Report(path)
    blocking_ends: list[float] = []

    def slow(**_: object):
        yield {"bench": "slow", "part": 1}
        try:
            time.sleep(3.0)  # one blocking call, past the 0.3 s deadline
        finally:
            blocking_ends.append(time.perf_counter())
        for _ in range(600):  # up to 30 s more in Python: interrupted here
            time.sleep(0.05)
        yield {"bench": "slow", "part": 2}

    def quick(**_: object):
        yield {"check": "quick", "ok": True}

    on_disk: list[float] = []

    def watch() -> None:
        while not on_disk and time.perf_counter() - t0 < 20:
            if "timed_out" in path.read_text():
                on_disk.append(time.perf_counter())
            time.sleep(0.02)

    t0 = time.perf_counter()
    watcher = threading.Thread(target=watch)
    watcher.start()
    _run_measure(report, "bench", "slow", slow, 0.3)
    assert time.perf_counter() - t0 < 25  # interrupted, not run to its end
    _run_measure(report, "check", "quick", quick, 5.0)
    report.close()
    watcher.join()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [{k: v for k, v in line.items() if k != "measure_s"} for line in lines] == [
        {"bench": "slow", "part": 1}, {"bench": "slow", "timed_out": True, "deadline_s": 0.3}, {"check": "quick", "ok": True}]
    assert on_disk[0] < blocking_ends[0]  # written while the measure was still blocked
    assert report.failed == []


def test_only_passed_checks_pass_the_run(tmp_path: Path) -> None:
    """A check with ok false, or timed out (ok null), fails the run; a skipped check or a
    benchmark with an error does not (its line says so). The lines file is never overwritten."""
    report = Report(tmp_path / "lines.jsonl")
    report.emit({"check": "a", "ok": True})
    report.emit({"check": "b", "ok": True, "skipped": "why"})
    report.emit({"bench": "c", "error": "RuntimeError: x"})
    assert report.failed == []
    report.emit({"check": "d", "ok": False, "error": "ValueError: y"})
    report.emit({"check": "e", "ok": None, "timed_out": True})
    report.close()
    assert report.failed == ["d", "e"]
    assert len((tmp_path / "lines.jsonl").read_text().splitlines()) == 5
    with pytest.raises(FileExistsError):
        Report(tmp_path / "lines.jsonl")


def test_deadline_that_does_not_fire_leaves_no_exception_behind() -> None:
    with Deadline(Report(None), "bench", "x", 5.0) as guard:
        pass
    time.sleep(0.05)
    assert not guard.fired


def test_cut_preset_configs_load_in_transformers() -> None:
    """The full run's 2-layer parity model is the released Qwen3-0.6B cut to 2 layers: its per-layer
    lists are cut with it (the first H200 run failed logits_vs_transformers on transformers 5.17,
    which refuses 28 ``layer_types`` for 2 layers)."""
    import transformers

    from jaxrl.devicecheck.common import full_shapes, qwen3_0_6b

    cut = full_shapes().parity
    config = transformers.Qwen3Config(**{k: v for k, v in cut.items() if k not in ("architectures", "model_type")})
    assert config.num_hidden_layers == 2 and len(config.layer_types) == 2
    assert len(qwen3_0_6b()["layer_types"]) == 28  # the whole model keeps its own
    from jaxrl.models.presets import with_layers

    for bad in (0, 3):
        with pytest.raises(ValueError, match=f"with_layers: {bad} layers of 2"):
            with_layers(cut, bad)
