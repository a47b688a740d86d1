"""``python -m jaxrl.serve --model.name DIR [--config X.toml] [--inference.server.port 8123]``

Serves a Hugging Face model directory with the embedded engine over the HTTP API of DESIGN
contract 6 (``/inference/v1/generate``, OpenAI ``/v1/chat/completions`` and ``/v1/completions``,
``/v1/models``, ``/update_weights``, ``/health``) until SIGINT/SIGTERM, then shuts down
gracefully. Reads the same config tree as training: ``[model] name / tokenizer / dtype`` and
``[inference]`` (sizes, ``[inference.server] host / port``). ``--dry-run`` prints the resolved
``[inference]`` section and exits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxrl.config import RunConfig, load_config


def eos_token_ids(model_dir: str | Path, tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """Default stop tokens: the tokenizer's EOS plus ``generation_config.json``'s eos ids."""
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    gen = Path(model_dir) / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return list(dict.fromkeys(int(i) for i in ids))


def build_server(cfg: RunConfig):  # type: ignore[no-untyped-def]
    """The engine and its (not yet started) HTTP server for ``cfg``."""
    from transformers import AutoTokenizer

    from jaxrl.inference.engine import Engine
    from jaxrl.inference.server import EngineServer

    if cfg.model.name is None:
        raise SystemExit("jaxrl.serve: set --model.name (or [model] name) to a Hugging Face model directory")
    if cfg.inference.backend != "embedded":
        raise SystemExit(
            f'jaxrl.serve runs the embedded engine; inference.backend = "{cfg.inference.backend}" names a server '
            "that runs elsewhere"
        )
    engine = Engine.from_pretrained(cfg.model.name, cfg.inference, dtype=cfg.model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name)
    return EngineServer.from_config(
        engine,
        tokenizer,
        cfg.inference.server,
        model_name=cfg.model.name,
        stop_token_ids=eos_token_ids(cfg.model.name, tokenizer),
    )


def main(argv: list[str] | None = None) -> None:
    cfg, flags = load_config(sys.argv[1:] if argv is None else argv)
    if flags.dry_run:
        print(cfg.inference.model_dump_json(indent=2))
        return
    server = build_server(cfg)
    def ready(url: str) -> None:
        warm = server.engine.metrics()
        took = "" if warm.warmup_s is None else f" (warm-up: {warm.compiles} programs in {warm.warmup_s:.1f} s)"
        print(f"jaxrl.serve: serving {server.model_name} at {url}{took}", flush=True)

    server.serve_forever(on_ready=ready)
    print("jaxrl.serve: stopped", flush=True)


if __name__ == "__main__":
    main()
