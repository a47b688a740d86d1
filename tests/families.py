"""Tiny checkpoints of the three served families, each with its real chat template.

The templates (``tests/fixtures/chat_templates``) are the ones the released Qwen3, Qwen2.5
Instruct and Llama 3.2 Instruct checkpoints ship; tokenizers are byte-level (every byte a
token, like jaxrl's own) plus the family's special tokens, built locally, so nothing is
downloaded. Models are random transformers checkpoints (config.json + safetensors), written
by transformers itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jaxrl.models.tiny import qwen3_config, qwen3_moe_config, save_random_checkpoint

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

QWEN_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
FAMILIES = {
    "qwen3": dict(
        template="qwen3.jinja",
        specials=QWEN_TOKENS + ["<think>", "</think>", "<tool_response>", "</tool_response>"],
        eos="<|im_end|>", pad="<|endoftext|>", bos=None, renderer="qwen3",
    ),
    # Qwen3-MoE ships Qwen3's tokenizer and template; renderer "auto" picks qwen3 by model_type.
    "qwen3_moe": dict(  # noqa: C408
        template="qwen3.jinja",
        specials=QWEN_TOKENS + ["<think>", "</think>", "<tool_response>", "</tool_response>"],
        eos="<|im_end|>", pad="<|endoftext|>", bos=None, renderer="qwen3",
    ),
    "qwen2.5": dict(
        template="qwen2_5.jinja", specials=QWEN_TOKENS, eos="<|im_end|>", pad="<|endoftext|>", bos=None,
        renderer="default",
    ),
    "llama3": dict(
        template="llama3_2.jinja",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
        eos="<|eot_id|>", pad="<|end_of_text|>", bos="<|begin_of_text|>", renderer="llama-3",
    ),
}  # fmt: skip
"""family -> tokenizer recipe and the renderer `auto` must pick for it."""


def build_family_tokenizer(out_dir: Path, family: str) -> Path:
    spec = FAMILIES[family]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet))}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    kw = {"bos_token": spec["bos"]} if spec["bos"] else {}
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=spec["eos"], pad_token=spec["pad"],
        additional_special_tokens=spec["specials"], **kw,
    )  # fmt: skip
    tok.chat_template = (TEMPLATES / spec["template"]).read_text()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out_dir)
    return out_dir


def build_family_model(out_dir: Path, family: str, *, seed: int = 0) -> Path:
    """A random tiny checkpoint of ``family`` with its tokenizer, in one HF directory (transformers
    writes it, so it needs torch: the test skips where torch is not installed)."""
    pytest.importorskip("torch")
    build_family_tokenizer(out_dir, family)
    vocab = -(-len(transformers.AutoTokenizer.from_pretrained(out_dir)) // 64) * 64
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    tok = transformers.AutoTokenizer.from_pretrained(out_dir)
    ids = dict(eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    if family == "qwen3":
        cfg = qwen3_config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False, **ids,
        )  # fmt: skip
    elif family == "qwen3_moe":  # 4 experts of width 64, 2 per token: as many active MLP weights as the others
        cfg = qwen3_moe_config(
            vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=64, max_position_embeddings=1024, tie_word_embeddings=False,
            **ids,
        )  # fmt: skip
    elif family == "qwen2.5":
        cfg = transformers.Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common, **ids)
    else:
        cfg = transformers.LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, **common, **ids)
    save_random_checkpoint(out_dir, cfg, seed=seed)
    return out_dir
