"""The tiny random Qwen3 checkpoint the serving benchmarks share (decode, weight sync, rollouts).

Built with transformers (torch is test/bench-only) and saved as an HF directory, so the
engine, transformers ``generate`` and vLLM all load the same weights.
"""

from __future__ import annotations

from pathlib import Path


def save_tiny_qwen3(out: Path, *, vocab: int, hidden: int, layers: int, max_len: int, tied: bool = True) -> int:
    """Writes the model to ``out`` (seeded) and returns its parameter count. ``tied=False`` for
    vLLM CPU, which does not reload a tied lm_head (DESIGN 9)."""
    from jaxrl.models.tiny import qwen3_config, save_random_checkpoint

    cfg = qwen3_config(
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=2,
        max_position_embeddings=max_len, tie_word_embeddings=tied,
    )
    return save_random_checkpoint(out, cfg, seed=0)
