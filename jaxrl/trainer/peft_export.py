"""LoRA adapters in Hugging Face PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``,
which ``peft.PeftModel.from_pretrained(base_model, adapter_dir)`` loads onto the base model.

Our adapters are stacked over layers in the decoder's layouts (``A`` ``[L, *in, r]``, ``B``
``[L, r, *out]``, see ``lora``); PEFT keeps one ``lora_A`` / ``lora_B`` ``torch.nn.Linear`` per
adapted module, weight ``[out, in]``: ``lora_A.weight`` ``[r, in_features]``, ``lora_B.weight``
``[out_features, r]``. The per-layer layout change is ``hf_io.WEIGHT_MAP``'s own export function
for the adapted weight: it turns a weight ``[*in, *out]`` into torch's ``[out, in]``, and ``A`` is
such a weight from the input axes to the rank axis, ``B`` one from the rank axis to the output
axes, so the same function gives both (any head reshaping or row order of the export applies
to ``B``'s output rows alike, and ``W + s * A @ B`` exports as ``W_hf + s * lora_B @ lora_A``).
PEFT's scale is ``lora_alpha / r`` (no rslora), ours ``alpha / rank``: the same update.

Torch and peft are not imported here: the files are written with ``safetensors.numpy``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from jaxrl.models.arch import ModelArch
from jaxrl.models.hf_io import WEIGHT_MAP, host_array
from jaxrl.trainer.lora import TARGETS, LoraConfig

PREFIX = "base_model.model."
"""PEFT's prefix of a causal LM's module names (``PeftModelForCausalLM.base_model.model``)."""
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
Adapters = Mapping[str, Mapping[str, jax.Array]]  # decoder weight name -> {"a": A, "b": B}


def peft_tensors(adapters: Adapters, arch: ModelArch) -> Iterator[tuple[str, np.ndarray]]:
    """(PEFT name, host array) of every layer's ``lora_A`` / ``lora_B`` weight; gathers across
    hosts when multi-process (every process must consume it)."""
    for name in [w for w, _ in TARGETS.values() if w in adapters]:  # in TARGETS' order
        template, (_, from_ours) = WEIGHT_MAP[name]
        module = PREFIX + template.removesuffix(".weight")
        a, b = host_array(adapters[name]["a"]), host_array(adapters[name]["b"])
        rank = a.shape[-1]
        n_in, n_out = int(np.prod(a.shape[1:-1])), int(np.prod(b.shape[2:]))
        for i in range(a.shape[0]):
            lora_a, lora_b = from_ours(a[i], arch), from_ours(b[i], arch)
            shapes = (lora_a.shape, lora_b.shape)
            assert shapes == ((rank, n_in), (n_out, rank)), (name, shapes)
            yield module.format(i=i) + ".lora_A.weight", np.ascontiguousarray(lora_a)
            yield module.format(i=i) + ".lora_B.weight", np.ascontiguousarray(lora_b)


def adapter_config(
    lora_cfg: LoraConfig,
    target_modules: list[str],
    *,
    base_model_name_or_path: str | None,
    revision: str | None,
) -> dict[str, Any]:
    """PEFT's ``LoraConfig`` fields for these adapters (plain LoRA: no dropout, bias, rslora or DoRA)."""
    alpha = lora_cfg.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "revision": revision,
        "r": lora_cfg.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": target_modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
    }


def export_peft_adapter(
    adapters: Adapters,
    lora_cfg: LoraConfig,
    arch: ModelArch,
    out_dir: str | Path,
    *,
    base_model_name_or_path: str | None = None,
    revision: str | None = None,
) -> Path:
    """Write ``adapters`` (decoder weight name -> ``{"a", "b"}``, as ``Trainer.trainable`` holds
    them with ``[trainer.lora]``) as a PEFT adapter directory.

    Every process must call this (adapters may need a cross-host gather); only process 0 writes.
    """
    modules = [m for m in TARGETS if TARGETS[m][0] in adapters]
    if sorted(modules) != sorted(lora_cfg.target_modules) or len(modules) != len(adapters):
        targets = lora_cfg.target_modules
        raise ValueError(f"adapters for {sorted(adapters)} do not match target_modules {targets}")
    tensors = dict(peft_tensors(adapters, arch))
    out = Path(out_dir)
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = adapter_config(
        lora_cfg, modules, base_model_name_or_path=base_model_name_or_path, revision=revision
    )
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    save_file(tensors, out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out
