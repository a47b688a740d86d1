"""Build the run's model on the mesh: load a HF directory or hub id, or create a new random one.

A new model gets a real HF directory (``config.json`` written by transformers' ``Qwen3Config``
and jaxrl's byte-level tokenizer), so every later stage (engine, env servers' renderer,
export) treats it exactly like a downloaded checkpoint.
"""

from __future__ import annotations

import json
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxrl.models.arch import arch_from_hf_config
from jaxrl.models.decoder import Decoder, param_name
from jaxrl.models.hf_io import load_decoder
from jaxrl.models.hub import resolve_model_dir
from jaxrl.models.sharding import param_sharding_fn
from jaxrl.models.tiny import qwen3_config, qwen3_moe_config
from jaxrl.models.tokenizer import build_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def scratch_hf_config(scratch: Any, vocab_size: int) -> dict[str, Any]:
    """config.json of a new Qwen3-shaped model (Qwen3-MoE with ``num_experts``), written by
    transformers itself."""
    moe = {}
    if scratch.num_experts:
        moe = {"num_experts": scratch.num_experts, "num_experts_per_tok": scratch.num_experts_per_tok,
               "moe_intermediate_size": scratch.moe_intermediate_size, "norm_topk_prob": scratch.norm_topk_prob}  # fmt: skip
    cfg = (qwen3_moe_config if moe else qwen3_config)(
        **moe,
        vocab_size=vocab_size,
        hidden_size=scratch.hidden_size,
        intermediate_size=scratch.intermediate_size,
        num_layers=scratch.num_layers,
        num_heads=scratch.num_heads,
        num_kv_heads=scratch.num_kv_heads,
        head_dim=scratch.head_dim,
        max_position_embeddings=scratch.max_position_embeddings,
        tie_word_embeddings=scratch.tie_word_embeddings,
        rope_theta=scratch.rope_theta,
        bos_token_id=None,
    )
    return cfg.to_dict()


def padded_vocab(tok_dir: str | Path) -> int:
    """A new model's vocabulary: the tokenizer's, rounded up to a multiple of 64."""
    from transformers import AutoTokenizer

    return -(-len(AutoTokenizer.from_pretrained(tok_dir)) // 64) * 64


def init_decoder(hf_config: dict[str, Any], mesh: Mesh, *, seed: int, param_dtype: Any, dtype: Any) -> Decoder:
    """Random weights created directly in their shardings (never a full copy on one device)."""
    arch = arch_from_hf_config(hf_config)
    make = partial(Decoder, arch, param_dtype=param_dtype, dtype=dtype)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(rngs=nnx.Rngs(seed))))
    fn = param_sharding_fn(mesh)
    shardings = jax.tree_util.tree_map_with_path(lambda p, x: fn(param_name(p), x.shape), abstract)
    state = jax.jit(lambda: nnx.split(make(rngs=nnx.Rngs(seed)))[1], out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def prepare_model(model_cfg: Any, mesh: Mesh, output_dir: str | Path) -> tuple[Decoder, str, dict[str, Any]]:
    """(model on ``mesh``, tokenizer directory, HF config dict) for the run."""
    param_dtype, dtype = DTYPES[model_cfg.param_dtype], DTYPES[model_cfg.dtype]
    if model_cfg.scratch is not None:
        # Every process needs the tokenizer, but only process 0 writes the run's copy: processes
        # sharing output_dir (multi-host on shared storage) must never write the same files.
        main = jax.process_index() == 0
        base = Path(output_dir) / "base" if main else Path(tempfile.mkdtemp(prefix="jaxrl-tokenizer-"))
        tok_dir = model_cfg.tokenizer or str(build_tokenizer(base))
        hf_config = scratch_hf_config(model_cfg.scratch, vocab_size=padded_vocab(tok_dir))
        (base / "config.json").write_text(json.dumps(hf_config, indent=2))
        model = init_decoder(hf_config, mesh, seed=model_cfg.scratch.seed, param_dtype=param_dtype, dtype=dtype)
        return model, tok_dir, hf_config
    name = resolve_model_dir(model_cfg.name, model_cfg.revision)
    if not (name / "config.json").exists():
        raise FileNotFoundError(
            f"model.name = {model_cfg.name!r}: no config.json in {name}. Point it at a Hugging Face model "
            "directory or hub id, or set [warmstart] to produce it first"
        )
    hf_config = json.loads((name / "config.json").read_text())
    model = load_decoder(name, param_dtype=param_dtype, dtype=dtype, sharding_fn=param_sharding_fn(mesh))
    return model, model_cfg.tokenizer or str(name), hf_config
