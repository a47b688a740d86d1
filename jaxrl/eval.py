"""``python -m jaxrl.eval --config X.toml [--model.name DIR] [--section.field value ...] [--overwrite]``

Evaluates a model directory on the config's eval envs (``[orchestrator.eval]``: its
``[[orchestrator.eval.env]]`` entries, or each train env on its eval split), as an RL run's
evals do (avg@k, pass@k and their standard errors; the same sampling seeds), without training:
the embedded engine serves the model on a free port of 127.0.0.1, the env servers sample
from it. prime-rl has the same entry point; `vf-eval` against ``jaxrl.serve`` is the other way.

Writes ``<output_dir>/eval/results.json`` (the model and the metrics) and
``<output_dir>/eval/rollouts.jsonl`` (one record per rollout, as an RL run's eval records).
Results already there are refused (exit 2) unless ``--overwrite``: an eval never replaces
another's files silently. Config errors exit 2 with one line, before the model loads.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from jaxrl.cli import load_config, to_toml
from jaxrl.config import ConfigError, RunConfig
from jaxrl.serving.http_thread import PortInUse

EVAL_DIR = "eval"
# The train flags an eval has no use for: not offered by --help, refused (exit 2) when given.
REFUSED_FLAGS = {
    "resume": "continues a training run from its checkpoint; jaxrl.eval trains nothing and has nothing to resume "
    "(--overwrite replaces an earlier eval's results)",
}


def eval_dir(cfg: RunConfig, *, overwrite: bool) -> Path:
    """Where the results go; refused when an earlier eval's results are there (unless ``overwrite``)."""
    out = Path(cfg.output_dir) / EVAL_DIR
    held = [p.name for p in (out / "results.json", out / "rollouts.jsonl") if p.exists()]
    if held and not overwrite:
        raise ConfigError(
            f"{out} already holds an eval ({', '.join(held)}): rerun with --overwrite to replace it, "
            "or set --output_dir to a new directory"
        )
    return out


def check(cfg: RunConfig) -> None:
    """What only an eval needs of the config, each refused with one line naming the fix."""
    if cfg.orchestrator is None or cfg.orchestrator.eval is None:
        raise ConfigError(
            "[orchestrator.eval] is not set: jaxrl.eval runs the config's eval envs; add [orchestrator.eval] "
            "(and [[orchestrator.eval.env]] entries, or train envs with an eval split)"
        )
    if cfg.inference.backend.type != "embedded":
        raise ConfigError(
            f'inference.backend = "{cfg.inference.backend.type}": jaxrl.eval serves the model with the embedded engine; '
            "set --inference.backend embedded"
        )
    if cfg.model.name is None:
        raise ConfigError("model.name: not set; set --model.name to the model directory (or hub id) to evaluate")
    export = cfg.warmstart_export()
    if export is not None and not (export / "config.json").exists():
        raise ConfigError(f"model.name: {cfg.model.name} has no weights yet; train it first, or set --model.name")


def evaluate(cfg: RunConfig, out: Path) -> dict[str, Any]:
    """Serve the model, run every eval env once, write the results; returns the metrics."""
    from transformers import AutoTokenizer

    from jaxrl.endpoint import ModelEndpoint
    from jaxrl.models.hub import resolve_model_dir
    from jaxrl.models.renderer import model_renderer
    from jaxrl.orchestrator.orchestrator import Orchestrator, check_envs
    from jaxrl.serve import build_server

    assert cfg.orchestrator is not None and cfg.orchestrator.eval is not None
    ocfg = cfg.orchestrator
    try:
        check_envs(ocfg.model_copy(update={"eval": ocfg.eval.model_copy(update={"interval": max(ocfg.eval.interval, 1)})}))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.revision)
    tokenizer_dir = str(cfg.model.tokenizer or model_dir)
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    renderer = model_renderer(cfg.model, hf_config, AutoTokenizer.from_pretrained(tokenizer_dir))
    print("[jaxrl] eval: starting the engine (compiling its programs) ...", flush=True)
    t0 = time.perf_counter()
    server = build_server(cfg)
    server.start()
    orch = None
    try:
        endpoint = ModelEndpoint.at(server.url, server.model_name, tokenizer_dir, renderer)
        orch = Orchestrator(ocfg, endpoint, output_dir=out, seed=cfg.seed, policy_version=lambda: 0)
        orch.start_eval_only()
        envs = ", ".join(e.name or e.id for e in ocfg.eval.env) if ocfg.eval.env else "the train envs"
        print(f"[jaxrl] eval: engine ready in {time.perf_counter() - t0:.0f} s; sampling {ocfg.eval.num_tasks} tasks "
              f"x {ocfg.eval.k} of {envs} ...", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        metrics, rollouts = orch.evaluate()
        print(f"[jaxrl] eval: {len(rollouts)} rollouts in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if orch is not None:
            orch.close()
        server.stop()
    out.mkdir(parents=True, exist_ok=True)
    with (out / "rollouts.jsonl").open("w") as f:
        for r in rollouts:
            f.write(json.dumps({"split": "eval", "fate": "eval", **r.to_record()}) + "\n")
    (out / "results.json").write_text(json.dumps({"model": cfg.model.name, "metrics": metrics}, indent=2))
    return metrics


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, flags = load_config(argv, prog="python -m jaxrl.eval", refused_flags=REFUSED_FLAGS)
        check(cfg)
        if flags.dry_run:
            print(to_toml(cfg), end="")
            return 0
        out = eval_dir(cfg, overwrite=flags.overwrite)
        metrics = evaluate(cfg, out)
    except (ValueError, FileNotFoundError, PortInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key, value in sorted(metrics.items()):
        print(f"{key} = {value:.4g}")
    print(f"[jaxrl] eval done: {out / 'results.json'}, {out / 'rollouts.jsonl'}")
    return 0


def cli() -> None:
    """The ``jaxrl-eval`` console script."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
