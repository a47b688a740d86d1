"""What the device check's correctness checks and benchmarks share: the device, its peak FLOP/s
and bandwidth, the FLOP and byte counts the utilizations divide, the torch device beside it, the
shapes of a full or a smoke run, and model builders.

Split from ``run.py`` (the command) so that each file keeps one job; nothing here runs
anything on import. Models are built with the project's own builders
(``jaxrl.models.setup.init_decoder``, random weights, the architecture of a released checkpoint
from ``jaxrl.models.presets``) and handed to transformers through ``jaxrl.models.hf_io.export_hf``:
both sides then hold the same weights, and nothing is downloaded.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

# Per-chip datasheet peaks: dense bfloat16 TFLOP/s and HBM bandwidth (GB/s), matched in order
# against jax's ``device_kind`` (lower-cased): "NVIDIA H100 80GB HBM3", "NVIDIA H200",
# "NVIDIA A100-SXM4-80GB", "TPU v5 lite" (v5e), "TPU v6 lite" (v6e), "TPU v5" / "TPU v5p", "TPU v4".
# The first key that is a substring wins, so the more specific names come first. An unknown
# device has no MFU or bandwidth share (null), never a guessed one.
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("h100 pcie", 756.0, 2000.0),
    ("h100", 989.0, 3350.0),  # SXM
    ("h200", 989.0, 4800.0),
    ("a100-sxm4-40gb", 312.0, 1555.0),
    ("a100-pcie-40gb", 312.0, 1555.0),
    ("a100", 312.0, 2039.0),  # 80 GB
    ("nvidia l4", 121.0, 300.0),
    ("v5 lite", 197.0, 819.0),
    ("v5e", 197.0, 819.0),
    ("v6 lite", 918.0, 1640.0),
    ("v6e", 918.0, 1640.0),
    ("v5p", 459.0, 2765.0),
    ("tpu v5", 459.0, 2765.0),
    ("v4", 275.0, 1228.0),
)

# Targets printed beside the numbers; judged (``meets_target``) on the devices they are set for.
TARGET_DEVICES = ("h100", "h200")
TARGETS = {
    "train_step_mfu": 0.35,
    "train_step_vs_transformers": 1.3,
    "decode_b32_vs_generate": 3.0,
}


def _peaks(device_kind: str) -> tuple[float, float] | None:
    kind = device_kind.lower()
    for key, tflops, gbps in DEVICE_PEAKS:
        if key in kind:
            return tflops, gbps
    return None


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this kind, None when it is not in the table."""
    peaks = _peaks(device_kind)
    return None if peaks is None else peaks[0] * 1e12


def peak_bandwidth(device_kind: str) -> float | None:
    """Peak HBM bytes/s of one device of this kind, None when it is not in the table."""
    peaks = _peaks(device_kind)
    return None if peaks is None else peaks[1] * 1e9


def train_flops_per_token(arch: Any, seq_len: int, remat: str) -> tuple[float, float]:
    """(model, hardware) FLOPs per trained token of a causal decoder over rows of ``seq_len``.

    Model FLOPs are the usual MFU numerator, ``jaxrl.models.arch.Arch.flops_per_token``: 3 x the
    forward's matmuls (6 x matmul params) plus 3 x the causal attention scores and values.
    Hardware FLOPs add what ``remat`` recomputes in the backward pass of the scanned layers
    (``jaxrl.models.decoder.REMAT_POLICIES``): "full" one more forward of every layer (matmuls and
    attention; the LM head is outside the scan), "save_dots" the attention's batched dots only
    (the projections' outputs are saved), "none" nothing."""
    model = arch.flops_per_token(seq_len)
    d, hd, layers = arch.hidden_size, arch.head_dim, arch.num_layers
    attn_fwd = layers * 2 * 2 * arch.num_heads * hd * seq_len / 2
    layer_matmuls = layers * (d * hd * (arch.num_heads * 2 + arch.num_kv_heads * 2) + 3 * d * arch.intermediate_size)
    recompute = {"none": 0.0, "save_dots": attn_fwd, "full": 2.0 * layer_matmuls + attn_fwd}[remat]
    return model, model + recompute


def utilization(flops: float, seconds: float, peak: float | None) -> float | None:
    """Achieved FLOP/s over the peak (MFU with model FLOPs, HFU with hardware FLOPs)."""
    return None if peak is None or seconds <= 0 else flops / seconds / peak


def decode_bytes_per_step(arch: Any, batch: int, context: float, weight_bytes: int, kv_bytes: int) -> float:
    """HBM bytes one decode step must read at least: every weight once (the embedding table is a
    gather, not read whole: left out unless tied to the LM head) and each row's KV cache up to
    ``context`` positions. Decode is bandwidth-bound, so achieved bytes/s over the peak says how
    close a decode step is to the hardware's limit."""
    embed = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    weights = (arch.num_params() - embed) * weight_bytes
    kv = batch * context * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * kv_bytes
    return weights + kv


@dataclass(frozen=True)
class Device:
    """The accelerator jax sees (the first device of its default backend) and torch beside it."""

    platform: str  # "cpu" | "gpu" | "tpu"
    kind: str
    count: int
    peak: float | None
    bandwidth: float | None  # peak HBM bytes/s
    torch_device: str | None  # where torch runs the references; None: no torch at all
    torch_same_device: bool  # torch on the same device as jax (speed comparisons need it)
    torch_note: str  # why torch runs where it does (or not at all)

    @property
    def judged(self) -> bool:
        """Whether the printed targets apply to this device."""
        return any(k in self.kind.lower() for k in TARGET_DEVICES)

    def describe(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "device_kind": self.kind,
            "devices": self.count,
            "peak_bf16_tflops": None if self.peak is None else self.peak / 1e12,
            "peak_hbm_gbps": None if self.bandwidth is None else self.bandwidth / 1e9,
            "torch_device": self.torch_device,
            "torch_note": self.torch_note,
            "jax": jax.__version__,
        }


def detect_device(skip_torch: bool) -> Device:
    dev = jax.devices()[0]
    platform = dev.platform
    torch_device, same, note = None, False, ""
    if skip_torch:
        note = "--skip-torch"
    else:
        try:
            import torch
        except ImportError:
            note = "torch is not importable"
        else:
            if platform == "cpu":
                torch_device, same, note = "cpu", True, "torch on the CPU, as jax"
            elif platform == "gpu" and torch.cuda.is_available():
                torch_device, same, note = "cuda", True, f"torch {torch.__version__} on CUDA"
            else:
                torch_device = "cpu"
                note = f"torch {torch.__version__} has no {platform} device here: CPU references only"
    kind = dev.device_kind
    return Device(platform, kind, jax.device_count(), peak_flops(kind), peak_bandwidth(kind), torch_device, same, note)


@dataclass(frozen=True)
class Shapes:
    """Sizes of one run: ``full`` on an accelerator, ``smoke`` for a CPU check in seconds."""

    parity: dict[str, Any]  # config.json of the correctness model (logits, engine, bf16 grads)
    parity_tokens: tuple[int, int]  # rows x length of the parity forwards
    engine_prompts: int
    engine_new_tokens: int
    train: dict[str, Any]  # config.json of the train-step model
    train_rows: int
    train_seq: int
    train_steps: int  # timed steps (after one compile / warm-up step)
    decode: dict[str, Any]  # config.json of the decode model
    decode_batches: tuple[int, ...]
    decode_prompt: int
    decode_new: int
    decode_steps_idle: int  # inference.backend.decode_steps_idle (decode steps per call when no request waits)
    decode_prefill_batches: tuple[int, ...]  # inference.backend.prefill_batch_buckets
    repeats: int  # timed repeats of each decode measure (median reported)
    kernel_dims: dict[str, int]  # sizes of the kernel-vs-reference inputs
    rl_scratch: dict[str, Any]  # [model.scratch] of the RL run
    rl_overrides: dict[str, Any] = field(default_factory=dict)  # on speed.RL_RECIPE


def _tiny_qwen3(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, max_len: int) -> dict[str, Any]:
    from jaxrl.models.tiny import qwen3_config

    return qwen3_config(
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        max_position_embeddings=max_len, rms_norm_eps=1e-6,
    ).to_dict()


def qwen3_0_6b(layers: int | None = None, max_len: int = 40960) -> dict[str, Any]:
    """The released Qwen3-0.6B architecture (``jaxrl.models.presets``), optionally cut to ``layers``."""
    from jaxrl.models.presets import preset_hf_config, with_layers

    cfg = copy.deepcopy(preset_hf_config("Qwen3-0.6B"))
    assert cfg is not None
    if layers is not None:
        cfg = with_layers(cfg, layers)
    cfg["max_position_embeddings"] = max_len
    return cfg


def full_shapes() -> Shapes:
    q = qwen3_0_6b()
    rl_0_6b = {"hidden_size": q["hidden_size"], "intermediate_size": q["intermediate_size"],
               "num_layers": q["num_hidden_layers"], "num_heads": q["num_attention_heads"],
               "num_kv_heads": q["num_key_value_heads"], "head_dim": q["head_dim"], "max_position_embeddings": 256}
    return Shapes(
        parity=qwen3_0_6b(layers=2, max_len=4096),
        parity_tokens=(2, 128),
        engine_prompts=4,
        engine_new_tokens=32,
        train=qwen3_0_6b(max_len=4096),
        train_rows=4,
        train_seq=4096,
        train_steps=3,
        decode=qwen3_0_6b(max_len=4096),
        decode_batches=(1, 32, 128),
        decode_prompt=128,
        decode_new=128,
        decode_steps_idle=16,
        decode_prefill_batches=(1, 32),
        repeats=2,
        kernel_dims={"batch": 2, "seq": 1024, "heads": 16, "kv_heads": 8, "head_dim": 128, "cache_len": 1024,
                     "layers": 2, "tokens": 1024, "hidden": 1024, "vocab": 151936},
        rl_scratch=rl_0_6b,  # Qwen3-0.6B's layers and widths (the byte tokenizer's vocabulary)
        rl_overrides={"trainer": {"seq_len_buckets": [256]},  # one train-step compile of the 0.6B model
                      "inference": {"max_seqs": 64, "max_batched_tokens": 2048,
                                    "backend": {"type": "embedded", "decode_batch_buckets": [64],
                                                "prefill_len_buckets": [256], "prefill_batch_buckets": [8]}}},
    )


def smoke_shapes() -> Shapes:
    tiny = _tiny_qwen3(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, max_len=256)
    return Shapes(
        parity=tiny,
        parity_tokens=(2, 24),
        engine_prompts=2,
        engine_new_tokens=8,
        train=tiny,
        train_rows=2,
        train_seq=64,
        train_steps=1,
        decode=tiny,
        decode_batches=(1, 4),
        decode_prompt=16,
        decode_new=8,
        decode_steps_idle=4,  # = decode_steps: one decode program per batch size (fewer compiles)
        decode_prefill_batches=(4,),
        repeats=1,
        kernel_dims={"batch": 2, "seq": 32, "heads": 4, "kv_heads": 2, "head_dim": 16, "cache_len": 64,
                     "layers": 2, "tokens": 64, "hidden": 64, "vocab": 640},
        rl_scratch={"hidden_size": 64, "intermediate_size": 192, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                    "head_dim": 32, "max_position_embeddings": 128},
        rl_overrides={
            "trainer": {"seq_len": 128},
            "inference": {"max_model_len": 128, "max_seqs": 16, "max_batched_tokens": 512,
                          "backend": {"type": "embedded", "decode_batch_buckets": [16], "prefill_len_buckets": [128],
                                      "prefill_batch_buckets": [4]}},
            "orchestrator": {"batch_size": 16, "group_size": 4, "train": {"sampling": {"max_completion_tokens": 16}}},
        },
    )


def one_device_mesh(devices: list[Any] | None = None) -> Any:
    """A one-device mesh (the first of ``devices``, default jax's): every measure here is per chip."""
    from jaxrl.parallel.mesh import MeshConfig, make_mesh

    return make_mesh(MeshConfig(num_devices=1), devices)


def random_decoder(
    hf_config: dict[str, Any], *, param_dtype: Any = jnp.float32, dtype: Any = jnp.float32, seed: int = 0
) -> Any:
    """A random-weight ``Decoder`` of this architecture on one device of jax's default backend."""
    from jaxrl.models.setup import init_decoder

    return init_decoder(hf_config, one_device_mesh(), seed=seed, param_dtype=param_dtype, dtype=dtype)


def export_for_transformers(model: Any, hf_config: dict[str, Any], out: Path) -> Path:
    """The model's weights as a Hugging Face directory that transformers loads."""
    from jaxrl.models.hf_io import export_hf

    return export_hf(model, out, hf_config)


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def torch_sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def torch_free(device: str) -> None:
    """Hand torch's cached device memory back, so jax can grow into it (jax runs without
    preallocation here: ``XLA_PYTHON_CLIENT_PREALLOCATE=false``)."""
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
