"""The tiny random Qwen3 checkpoint the serving benchmarks share (decode, weight sync, rollouts).

Built with transformers (torch is test/bench-only) and saved as an HF directory, so the
engine, transformers ``generate`` and vLLM all load the same weights.
"""

from __future__ import annotations

from pathlib import Path


def save_tiny_qwen3(out: Path, *, vocab: int, hidden: int, layers: int, max_len: int, tied: bool = True) -> int:
    """Writes the model to ``out`` (seeded) and returns its parameter count. ``tied=False`` for
    vLLM CPU, which does not reload a tied lm_head (DESIGN 9)."""
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_len,
        tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())
