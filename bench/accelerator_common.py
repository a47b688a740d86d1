"""What the accelerator run's correctness checks and benchmarks share: the device, its peak
FLOP/s, the torch device beside it, the shapes of a full or a smoke run, and model builders.

Split from ``accelerator.py`` (the command) so that each file keeps one job; nothing here runs
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

# Dense bfloat16 peak per device (datasheets), matched in order against jax's ``device_kind``
# (lower-cased): "NVIDIA H100 80GB HBM3", "NVIDIA H200", "TPU v5 lite" (v5e), "TPU v6 lite" (v6e),
# "TPU v5" / "TPU v5p", "TPU v4". The first entry that is a substring wins, so the more specific
# names come first. An unknown device has no MFU (null), never a guessed one.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("h100 pcie", 756.0),
    ("h100", 989.0),  # SXM
    ("h200", 989.0),
    ("a100", 312.0),
    ("nvidia l4", 121.0),
    ("v5 lite", 197.0),
    ("v5e", 197.0),
    ("v6 lite", 918.0),
    ("v6e", 918.0),
    ("v5p", 459.0),
    ("tpu v5", 459.0),
    ("v4", 275.0),
)

# Targets printed beside the numbers; judged (``meets_target``) on the devices they are set for.
TARGET_DEVICES = ("h100", "h200")
TARGETS = {
    "train_step_mfu": 0.35,
    "train_step_vs_transformers": 1.3,
    "decode_b32_vs_generate": 3.0,
}


def peak_flops(device_kind: str) -> float | None:
    """Peak dense bf16 FLOP/s of one device of this kind, None when it is not in the table."""
    kind = device_kind.lower()
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in kind:
            return tflops * 1e12
    return None


def mfu(params: int, tokens: float, seconds: float, peak: float | None) -> float | None:
    """6 * params * tokens / time / peak (the usual training-FLOPs estimate, attention left out)."""
    return None if peak is None or seconds <= 0 else 6.0 * params * tokens / seconds / peak


@dataclass(frozen=True)
class Device:
    """The accelerator jax sees (the first device of its default backend) and torch beside it."""

    platform: str  # "cpu" | "gpu" | "tpu"
    kind: str
    count: int
    peak: float | None
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
    return Device(platform, dev.device_kind, jax.device_count(), peak_flops(dev.device_kind), torch_device, same, note)


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
    decode_steps_idle: int  # inference.decode_steps_idle (decode steps per call when no request waits)
    decode_prefill_batches: tuple[int, ...]  # inference.prefill_batch_buckets
    repeats: int  # timed repeats of each decode measure (median reported)
    kernel_dims: dict[str, int]  # sizes of the kernel-vs-reference inputs
    rl_scratch: dict[str, Any]  # [model.scratch] of the RL run
    rl_overrides: dict[str, Any] = field(default_factory=dict)  # on configs/reverse_text/rl.toml


def _tiny_qwen3(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, max_len: int) -> dict[str, Any]:
    from jaxrl.models.tiny import qwen3_config

    return qwen3_config(
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        max_position_embeddings=max_len, rms_norm_eps=1e-6,
    ).to_dict()


def qwen3_0_6b(layers: int | None = None, max_len: int = 40960) -> dict[str, Any]:
    """The released Qwen3-0.6B architecture (``jaxrl.models.presets``), optionally cut to ``layers``."""
    from jaxrl.models.presets import preset_hf_config

    cfg = copy.deepcopy(preset_hf_config("Qwen3-0.6B"))
    assert cfg is not None
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    cfg["max_position_embeddings"] = max_len
    return cfg


def full_shapes() -> Shapes:
    rl_tiny = {"hidden_size": 256, "intermediate_size": 768, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
               "head_dim": 64, "max_position_embeddings": 256}
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
        rl_scratch=rl_tiny,
        rl_overrides={"inference": {"max_seqs": 64, "decode_batch_buckets": [64], "prefill_len_buckets": [256],
                                    "prefill_batch_buckets": [8], "max_batched_tokens": 2048}},
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
            "inference": {"max_model_len": 128, "max_seqs": 16, "decode_batch_buckets": [16],
                          "prefill_len_buckets": [128], "prefill_batch_buckets": [4], "max_batched_tokens": 512},
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
