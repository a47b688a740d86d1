"""Rollout throughput behind real verifiers env servers: episodes/s of the embedded engine (and of
a vLLM server when ``JAXRL_VLLM`` names a vLLM venv's python), cold and warm.

    python bench/rollout.py [--envs reverse_text lookup] [--concurrency 32] [--episodes 64]
                            [--new-tokens 64] [--no-vllm] [--no-pin] [--decode-buckets 1 8 16 32]

A random Qwen3-shaped model (byte tokenizer with the Qwen special tokens, ~3M parameters) is
written to a temporary HF directory and served over HTTP on 127.0.0.1 (the engine with
``jaxrl.serving.server``, vLLM through jaxrl's vLLM backend). For each env, one real verifiers
env server process (``jaxrl.orchestrator.env_child``: the built-in taskset, verifiers' train
client, the Qwen3 renderer) runs ``episodes`` rollouts, ``concurrency`` at a time, sampling
at temperature 1 with ``new_tokens`` tokens at most per model turn.

Both servers are up at once and their passes interleave (per env: each backend's cold pass,
then ``warm_passes`` rounds of one warm pass per backend, the order alternating round by round),
so a shared host's load falls on both sides alike; the ratio is the median of the rounds'
engine / vLLM ratios. (Run one after the other, minutes apart on a 2-core host shared with
other jobs, a load swing between the halves moves the ratio: issue 31's two such runs gave
0.83x and 0.99x on reverse_text where the compiled decode program had not changed.)
"cold" is a backend's first pass after its server reports healthy (compiles not done by the
engine's warm-up land here), "warm" the median of its later passes. With pinning (the default
on a host with >= 2 cores) the model servers run on core 0 and the env side (env servers and
the client driving them, a child process) on core 1, for every backend alike. Prints one JSON
line per (backend, env) with episodes/s and the engine's ``GET /metrics.json`` view after the warm
passes, and, with both backends, one ``rollout_ratio`` line per env (with the host's 1-minute
load average).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tiny_qwen3 import save_tiny_qwen3  # bench/ is on sys.path when run as a script


def make_model(out: Path, vocab: int, args: argparse.Namespace) -> None:
    save_tiny_qwen3(out, vocab=vocab, hidden=args.hidden, layers=args.layers, max_len=args.max_model_len, tied=False)


def pin(pid: int, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(pid, {core})


async def run_episodes(server: Any, endpoint: Any, tasks: list[dict], args: argparse.Namespace) -> dict:
    """``len(tasks)`` rollouts, ``args.concurrency`` at a time; episodes/s and error count."""
    sem = asyncio.Semaphore(args.concurrency)
    sampling = {"max_tokens": args.new_tokens, "temperature": 1.0}

    async def one(i: int, task: dict) -> Any:
        async with sem:
            return await server.run(task, endpoint, {**sampling, "seed": i})

    t0 = time.perf_counter()
    rollouts = await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks)))
    dt = time.perf_counter() - t0
    errors = [r.error for r in rollouts if r.error]
    return {"episodes_s": round(len(tasks) / dt, 2), "seconds": round(dt, 2), "errors": len(errors),
            "first_error": errors[0] if errors else None}


async def drive(args: argparse.Namespace) -> None:
    """The env side (run in a child process, pinned apart from the model servers): env servers
    plus the client that runs episodes through them against each of ``args.targets``
    (``backend=base_url``), the backends' passes interleaved."""
    from jaxrl.endpoint import ModelEndpoint
    from jaxrl.orchestrator.config import EnvConfig
    from jaxrl.orchestrator.env_server import start_env_servers
    from jaxrl.orchestrator.env_tasks import task_data

    targets = dict(t.split("=", 1) for t in args.targets)
    endpoints = {b: ModelEndpoint(base_url=url, model="bench", tokenizer_dir=args.tokenizer_dir) for b, url in targets.items()}
    configs = [EnvConfig(id=e, args={"num_tasks": args.episodes, "seed": 0}) for e in args.envs]
    servers = await start_env_servers(configs, output_dir=args.out, kind="train")
    try:
        for s in servers:
            tasks = [task_data(t) for t in s.taskset().take(args.episodes)]
            order = list(targets)
            cold = {b: await run_episodes(s, endpoints[b], tasks, args) for b in order}
            passes: dict[str, list[dict]] = {b: [] for b in order}
            for round_ in range(args.warm_passes):
                for b in order if round_ % 2 == 0 else order[::-1]:
                    passes[b].append(await run_episodes(s, endpoints[b], tasks, args))
            for b in order:
                warm = sorted(passes[b], key=lambda r: r["episodes_s"])[len(passes[b]) // 2]  # the median pass
                errors = cold[b]["errors"] + sum(r["errors"] for r in passes[b])
                first_error = next((r["first_error"] for r in [cold[b], *passes[b]] if r["first_error"]), None)
                row = {"bench": "rollout", "backend": b, "env": s.name, "concurrency": args.concurrency,
                       "episodes": len(tasks), "new_tokens": args.new_tokens,
                       "cold_episodes_s": cold[b]["episodes_s"], "warm_episodes_s": warm["episodes_s"],
                       "warm_passes": [r["episodes_s"] for r in passes[b]], "errors": errors, "first_error": first_error}
                if b == "engine":
                    async with httpx.AsyncClient() as client:
                        row["engine_metrics"] = (await client.get(targets[b].removesuffix("/v1") + "/metrics.json")).json()
                print(json.dumps(row), flush=True)
            if {"engine", "vllm"} <= set(order):
                ratios = sorted(e["episodes_s"] / v["episodes_s"] for e, v in zip(passes["engine"], passes["vllm"]))
                print(json.dumps({"bench": "rollout_ratio", "env": s.name, "engine_over_vllm": round(ratios[len(ratios) // 2], 2),
                                  "rounds": [round(r, 2) for r in ratios], "load_avg_1m": round(os.getloadavg()[0], 1)}),
                      flush=True)
    finally:
        await asyncio.gather(*(s.aclose() for s in servers))


def run_driver(targets: dict[str, str], tok_dir: Path, out: Path, args: argparse.Namespace, env_core: int | None) -> None:
    """Run the env side in a child process on ``env_core``; its JSON lines go to our stdout."""
    cmd = [sys.executable, __file__, "--drive", "--targets", *(f"{b}={url}" for b, url in targets.items()),
           "--tokenizer-dir", str(tok_dir), "--out", str(out / "envs"), "--envs", *args.envs,
           "--concurrency", str(args.concurrency), "--episodes", str(args.episodes),
           "--new-tokens", str(args.new_tokens), "--warm-passes", str(args.warm_passes)]
    proc = subprocess.Popen(cmd)
    pin(proc.pid, env_core)  # before it spawns its env servers (they inherit the affinity)
    if proc.wait():
        raise RuntimeError(f"the env-side process failed with exit code {proc.returncode}")


def start_engine(model_dir: Path, tokenizer_dir: Path, args: argparse.Namespace) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from jaxrl.engine.config import EngineConfig
    from jaxrl.engine.engine import Engine
    from jaxrl.serving.server import EngineServer

    cfg = EngineConfig(max_model_len=args.max_model_len, max_seqs=args.concurrency,
                       decode_batch_buckets=args.decode_buckets)
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(model_dir, cfg)
    server = EngineServer(engine, AutoTokenizer.from_pretrained(tokenizer_dir), model_name="bench")
    server.start()  # returns once warmed up and healthy
    print(json.dumps({"bench": "rollout_startup", "backend": "engine", "startup_s": round(time.perf_counter() - t0, 1),
                      "programs": engine.compiled_programs(), "program_bound": cfg.program_bound()}), flush=True)
    return engine, server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--envs", nargs="+", default=["reverse_text", "lookup"])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--decode-buckets", type=int, nargs="+", help="inference.backend.decode_batch_buckets (engine)")
    ap.add_argument("--warm-passes", type=int, default=3, help="warm passes; the median is reported")
    ap.add_argument("--backends", nargs="+", choices=["engine", "vllm"], default=["engine", "vllm"],
                    help="vllm runs only when JAXRL_VLLM is set")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)  # the env-side child process
    ap.add_argument("--targets", nargs="+", help=argparse.SUPPRESS)  # backend=base_url, for --drive
    ap.add_argument("--tokenizer-dir", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        asyncio.run(drive(args))
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pinned = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    model_core, env_core = (0, 1) if pinned else (None, None)

    from transformers import AutoTokenizer

    from jaxrl.models.tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tok_dir = build_tokenizer(tmp_path / "tokenizer")
        model_dir = tmp_path / "model"
        make_model(model_dir, len(AutoTokenizer.from_pretrained(tok_dir)), args)

        pin(0, model_core)  # this process serves the engine; the env side gets the other core
        with contextlib.ExitStack() as stack:
            targets = {}
            if "engine" in args.backends:
                engine, server = start_engine(model_dir, tok_dir, args)
                stack.callback(engine.stop)
                stack.callback(server.stop)
                targets["engine"] = f"{server.url}/v1"
            if "vllm" in args.backends and os.environ.get("JAXRL_VLLM") and not args.no_vllm:
                targets["vllm"] = start_vllm(model_dir, tok_dir, args, tmp_path, stack)
            run_driver(targets, tok_dir, tmp_path, args, env_core)


def start_vllm(model_dir: Path, tok_dir: Path, args: argparse.Namespace, tmp: Path, stack: contextlib.ExitStack) -> str:
    """A vLLM server on the same model (jaxrl's vLLM backend: loopback proxy in front), stopped by
    ``stack``; its base URL. The vLLM process inherits this process's core (pinned in ``main``)."""
    from jaxrl.models.hf_io import load_decoder
    from jaxrl.rollout.config import InferenceConfig
    from jaxrl.rollout.vllm import VLLMBackend

    cfg = InferenceConfig(backend="vllm", max_model_len=args.max_model_len, max_seqs=args.concurrency,
                          server={"port": 0})
    backend = VLLMBackend(load_decoder(model_dir), json.loads((model_dir / "config.json").read_text()), cfg,
                          output_dir=tmp / "vllm", tokenizer_dir=tok_dir, model_name="bench")
    stack.callback(backend.stop)
    backend.start()
    print(json.dumps({"bench": "rollout_startup", "backend": "vllm", "startup_s": round(backend.startup_s, 1)}), flush=True)
    return backend.endpoint.base_url


if __name__ == "__main__":
    main()
