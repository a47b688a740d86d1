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
    from jaxrl.inference.http_thread import check_port_free
    from jaxrl.inference.server import EngineServer
    from jaxrl.models.chat import model_renderer
    from jaxrl.models.hub import resolve_model_dir

    if cfg.model.name is None:
        raise ValueError("model.name: set --model.name (or [model] name) to a Hugging Face model directory or hub id")
    if cfg.inference.backend != "embedded":
        raise ValueError(
            f'inference.backend = "{cfg.inference.backend}": jaxrl.serve runs the embedded engine; that backend '
            "names a server that runs elsewhere"
        )
    check_port_free(cfg.inference.server.host, cfg.inference.server.port)  # before the model loads
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.revision)
    engine = Engine.from_pretrained(model_dir, cfg.inference, dtype=cfg.model.dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or model_dir)
    return EngineServer.from_config(
        engine,
        tokenizer,
        cfg.inference.server,
        model_name=cfg.model.name,
        stop_token_ids=eos_token_ids(model_dir, tokenizer),
        renderer=model_renderer(cfg.model, json.loads((model_dir / "config.json").read_text()), tokenizer),
    )


def _print_ready(server, url: str) -> None:  # type: ignore[no-untyped-def]
    warm = server.engine.metrics()
    took = "" if warm.warmup_s is None else f" (warm-up: {warm.compiles} programs in {warm.warmup_s:.1f} s)"
    print(f"jaxrl.serve: serving {server.model_name} at {url}{took}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 after a clean stop, 2 for a config error (one message, before any work),
    1 when the engine failed beyond recovery (a supervisor should restart the process)."""
    try:
        cfg, flags = load_config(argv, prog="python -m jaxrl.serve")
        if flags.dry_run:
            print(cfg.inference.model_dump_json(indent=2))
            return 0
        server = build_server(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server.serve_forever(on_ready=lambda url: _print_ready(server, url))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("jaxrl.serve: stopped", flush=True)
    return 0


def cli() -> None:
    """The ``jaxrl-serve`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
