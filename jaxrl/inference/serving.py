"""One way to put an engine behind its HTTP server, shared by ``jaxrl.serve`` and the RL loop.

Both entry points serve the same API with the same defaults: the model's stop tokens (the
tokenizer's EOS plus ``generation_config.json``'s ``eos_token_id``s), the run's renderer for
the chat endpoint, and the ``[inference.server]`` settings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxrl.inference.config import InferenceConfig
from jaxrl.inference.engine import Engine
from jaxrl.inference.server import EngineServer


def eos_token_ids(model_dir: str | Path | None, tokenizer: Any) -> list[int]:
    """Default stop tokens: the tokenizer's EOS plus ``generation_config.json``'s eos ids."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    gen = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if gen is not None and gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return list(dict.fromkeys(int(i) for i in ids))


def build_engine_server(
    engine: Engine,
    config: InferenceConfig,
    *,
    tokenizer_dir: str | Path,
    model_dir: str | Path | None,
    model_name: str,
    renderer: Mapping[str, Any] | None,
) -> EngineServer:
    """``engine``'s (not yet started) HTTP server; ``model_dir`` is where generation_config.json may be."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return EngineServer.from_config(
        engine,
        tokenizer,
        config.server,
        model_name=model_name,
        stop_token_ids=eos_token_ids(model_dir, tokenizer),
        renderer=renderer,
    )
