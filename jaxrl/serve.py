"""``python -m jaxrl.serve --model.name DIR [--config X.toml] [--inference.server.port 8123]``

Serves a Hugging Face model directory with the embedded engine over the HTTP API of DESIGN
contract 6 (``/inference/v1/generate``, OpenAI ``/v1/chat/completions`` and ``/v1/completions``,
``/v1/models``, ``/update_weights``, ``/health``) until SIGINT/SIGTERM, then shuts down
gracefully. Reads the same config tree as training: ``[model] name / tokenizer / dtype`` and
``[inference]`` (sizes, the engine's settings in ``[inference.backend]``, ``[inference.server]
host / port``, port 8000 unless set). vLLM's spellings of the same settings are accepted
(``--model``, ``--port``, ``--host``, ``--max-model-len``, ``--tensor-parallel-size``,
``--served-model-name``, ...: ``VLLM_FLAGS``); its flags with no exact equivalent fail naming
the jaxrl setting (``VLLM_REFUSED``). ``--dry-run``
prints the resolved ``[model]`` and ``[inference]`` sections as TOML and exits.
"""

from __future__ import annotations

import json
import sys

from jaxrl.cli import load_config, to_toml
from jaxrl.config import RunConfig

SERVE_FIELDS = ("model", "inference")
"""The config sections jaxrl.serve reads (its --help and overrides are limited to them)."""
SERVE_HIDDEN = {"model.scratch": "jaxrl.serve serves a model directory or hub id (--model.name), not a scratch model"}
"""Fields of those sections jaxrl.serve refuses: not in its --help; an override names the reason."""
SERVE_PORT = 8000
"""jaxrl.serve's port unless [inference.server] port is set (training runs default to a free port)."""

VLLM_FLAGS = {
    "model": "model.name",
    "tokenizer": "model.tokenizer",
    "port": "inference.server.port",
    "host": "inference.server.host",
    "served-model-name": "inference.server.served_model_name",
    "max-model-len": "inference.max_model_len",
    "max-num-seqs": "inference.max_seqs",
    "tensor-parallel-size": "inference.backend.tensor_parallel",
}
"""vLLM's ``vllm serve`` flags that mean exactly a jaxrl field: accepted as that field, so a
vLLM command line (or a launcher written for one) starts jaxrl.serve unchanged."""

VLLM_REFUSED = {
    "gpu-memory-utilization": "the KV cache is sized by rows: set --inference.max_seqs and --inference.max_model_len",
    "pipeline-parallel-size": "jaxrl serves with tensor and expert parallelism only: "
    "--inference.backend.tensor_parallel, --inference.backend.expert_parallel",
    "data-parallel-size": "run one jaxrl.serve per replica (a server is one engine)",
    "dtype": "set --model.dtype (float32 or bfloat16)",
    "quantization": "jaxrl.serve serves the model's own weights in --model.dtype",
}
"""vLLM flags with no exact jaxrl equivalent: refused with the jaxrl spelling nearest to them,
never accepted and ignored."""


def vllm_flags(argv: list[str]) -> list[str]:
    """``argv`` with vLLM's flag spellings (``VLLM_FLAGS``, kebab or snake case, ``--flag value``
    or ``--flag=value``) as the jaxrl overrides they mean; a ``VLLM_REFUSED`` flag raises
    ValueError naming the jaxrl setting to use."""
    out = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        name = flag.removeprefix("--").replace("_", "-") if flag.startswith("--") else None
        if name in VLLM_REFUSED:
            raise ValueError(f"--{name} (vLLM's flag) has no jaxrl.serve equivalent: {VLLM_REFUSED[name]}")
        given = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
        if name == "model" and given.lstrip().startswith("{"):  # jaxrl's --model '{"name": ...}' (the section)
            name = None
        out.append(f"--{VLLM_FLAGS[name]}{eq}{value}" if name in VLLM_FLAGS else arg)
    return out


def build_server(cfg: RunConfig):  # type: ignore[no-untyped-def]
    """The engine and its (not yet started) HTTP server for ``cfg``."""
    from transformers import AutoTokenizer

    from jaxrl.engine.engine import Engine
    from jaxrl.models.hub import resolve_model_dir
    from jaxrl.models.renderer import model_renderer
    from jaxrl.serving.http_thread import check_port_free
    from jaxrl.serving.server import build_engine_server

    if cfg.model.name is None:
        raise ValueError("model.name: set --model.name (or [model] name) to a Hugging Face model directory or hub id")
    if cfg.inference.backend.type != "embedded":
        raise ValueError(
            f'inference.backend = "{cfg.inference.backend.type}": jaxrl.serve runs the embedded engine; that backend '
            "names a server that runs elsewhere"
        )
    check_port_free(cfg.inference.server.host, cfg.inference.server.port)  # before the model loads
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.revision)
    tokenizer_dir = cfg.model.tokenizer or model_dir
    hf_config = json.loads((model_dir / "config.json").read_text())
    engine = Engine.from_pretrained(model_dir, cfg.inference.engine_config(), dtype=cfg.model.dtype)
    renderer = model_renderer(cfg.model, hf_config, AutoTokenizer.from_pretrained(tokenizer_dir))
    return build_engine_server(
        engine, cfg.inference.server, tokenizer_dir=tokenizer_dir, model_dir=model_dir, model_name=cfg.model.name,
        renderer=renderer,
    )  # fmt: skip


def _print_progress(line: str) -> None:
    """A warm-up line (one per program compiled: minutes on a big model) on stderr."""
    print(f"[jaxrl.serve] {line}", file=sys.stderr, flush=True)


def _print_ready(server, url: str) -> None:  # type: ignore[no-untyped-def]
    warm = server.engine.metrics()
    if warm.warmup_s is not None:
        print(f"jaxrl.serve: warm-up compiled {warm.compiles} programs in {warm.warmup_s:.1f} s", flush=True)
    print(f"jaxrl.serve: serving {server.model_name} at {url}", flush=True)


def check_one_process(cfg: RunConfig) -> None:
    """jaxrl.serve is one process: the colocated engine's settings (a multi-process trainer's)
    would be accepted and never read; refused instead, naming the first one set."""
    backend = cfg.inference.backend
    fields = type(backend).model_fields
    colocated = sorted(f for f in fields if f.startswith("colocated_") and getattr(backend, f) != fields[f].default)
    if colocated:
        raise ValueError(
            f"inference.backend.{colocated[0]}: a setting of the engine colocated over a multi-process trainer; "
            "jaxrl.serve runs one process and never reads it: delete it"
        )


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 after a clean stop, 2 for a config error (one message, before any work),
    1 when the engine failed beyond recovery (a supervisor should restart the process)."""
    try:
        argv = vllm_flags(list(sys.argv[1:] if argv is None else argv))
        cfg, flags = load_config(
            argv, prog="python -m jaxrl.serve", fields=SERVE_FIELDS, hidden=SERVE_HIDDEN,
            defaults={"inference": {"server": {"port": SERVE_PORT}}},  # a server people point clients at
        )  # fmt: skip
        check_one_process(cfg)
        if flags.dry_run:
            print(to_toml(cfg, include=set(SERVE_FIELDS)), end="")
            return 0
        server = build_server(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        server.serve_forever(on_ready=lambda url: _print_ready(server, url), progress=_print_progress)
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
