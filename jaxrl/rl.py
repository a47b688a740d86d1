"""The RL loop on one machine: trainer + embedded engine (HTTP on loopback) + env servers.

    orchestrator thread: env servers run rollouts against the engine's HTTP API
    main thread:         batch for step n -> samples -> train step -> weights -> engine

After every optimizer step the new parameters go to the engine in-process (one batched
reshard, no files) as policy version n. Timings per step are split into rollout wait,
scoring, train and weight sync (``bench/rl_step.py`` reads them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from jaxrl.config import RunConfig
from jaxrl.endpoint import ModelEndpoint
from jaxrl.inference.http_thread import check_port_free
from jaxrl.metrics import MetricsLogger
from jaxrl.orchestrator.algo import OPDConfig
from jaxrl.orchestrator.batch import build_batch
from jaxrl.orchestrator.env_server import EnvServerDead
from jaxrl.orchestrator.orchestrator import Orchestrator
from jaxrl.parallel.distributed import is_main_process
from jaxrl.preemption import RunAborted
from jaxrl.run_common import TrainingRun
from jaxrl.trainer.teacher import Teacher

PLOT_KEYS = ("train/reward_mean", "train/rl_loss", "train/mismatch_kl", "train/entropy", "time/step_s")  # eval shares reward's panel


class RolloutLog:
    """``<output_dir>/rollouts.jsonl``: every rollout, train and eval, with its fate."""

    def __init__(self, path: Path, *, append: bool, episodes: bool = False, logger: MetricsLogger | None = None):
        self.path = path
        self.episodes = episodes
        self.logger = logger  # W&B sample tables of train and eval rollouts, when [log.wandb] is set
        self.enabled = is_main_process()
        if self.enabled and not append:
            path.write_text("")

    def write(self, records: list[dict]) -> None:
        if not self.enabled or not records:
            return
        with self.path.open("a") as f:
            for r in records:
                if not self.episodes:  # the raw episode is ~8 KB even for a two-word rollout
                    r = {k: v for k, v in r.items() if k != "episode"}
                f.write(json.dumps(r, default=str) + "\n")
        if self.logger is not None:
            for split in ("train", "eval"):
                if picked := [r for r in records if r.get("split") == split]:
                    self.logger.log_samples(picked[0]["step"], split, picked)


def start_engine(run: TrainingRun) -> tuple[Any, Any, ModelEndpoint]:
    """The rollout backend serving the trainer's current weights: the embedded engine + its HTTP
    server on loopback, or (``inference.backend = "vllm"``) a vLLM server behind a loopback proxy."""
    from jaxrl.inference.engine import Engine
    from jaxrl.inference.serving import build_engine_server
    from jaxrl.models.hub import resolve_model_dir

    cfg = run.cfg
    if cfg.inference.backend == "vllm":
        from jaxrl.inference.vllm_backend import start_vllm

        return start_vllm(run)
    if cfg.inference.backend != "embedded":
        raise NotImplementedError(
            f"inference.backend = {cfg.inference.backend!r}: the RL loop drives the embedded engine or a vLLM "
            'server it launches; use backend = "embedded" or "vllm"'
        )
    engine = Engine(run.trainer.model(), cfg.inference)
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.revision) if cfg.model.name else None
    server = build_engine_server(
        engine, cfg.inference, tokenizer_dir=run.tokenizer_dir, model_dir=model_dir,
        model_name=cfg.model.name or "jaxrl", renderer=run.renderer,
    )  # fmt: skip
    server.start()
    endpoint = ModelEndpoint(
        base_url=f"{server.url}/v1", model=server.model_name, tokenizer_dir=run.tokenizer_dir, renderer=run.renderer
    )
    return engine, server, endpoint


def run_rl(cfg: RunConfig, *, resume: bool = False) -> dict[str, Any]:
    assert cfg.orchestrator is not None
    ocfg = cfg.orchestrator
    if cfg.inference.backend in ("embedded", "vllm"):  # before the model loads
        check_port_free(cfg.inference.server.host, cfg.inference.server.port)
    run = TrainingRun(cfg, plot_keys=PLOT_KEYS)
    meta = run.maybe_resume(resume)
    engine, server, endpoint = start_engine(run)
    if run.trainer.step:
        engine.update_weights_from_state(run.trainer.params, version=run.trainer.step)
    orch = Orchestrator(ocfg, endpoint, output_dir=run.out, seed=cfg.seed, policy_version=lambda: engine.policy_version)
    teachers = load_teachers(ocfg, run.trainer)
    rollouts = RolloutLog(run.out / "rollouts.jsonl", append=bool(meta), episodes=cfg.log.rollout_episodes, logger=run.logger)
    assert run.logger is not None
    last: dict[str, Any] = {}
    aborted: EnvServerDead | None = None
    try:
        orch.start(first_step=run.trainer.step + 1, sampler_state=meta.get("orchestrator", {}).get("sampler"))
        eval_every = ocfg.eval.interval if ocfg.eval else 0
        if eval_every and not meta:
            run.logger.log(run.trainer.step, _evaluate(orch, rollouts, run.trainer.step))
        with run.stop_request() as stop:
            while run.trainer.step < cfg.trainer.steps and not stop.requested:
                step = run.trainer.step + 1
                last = _rl_step(run, orch, engine, rollouts, step, ocfg.max_resample, teachers)
                if eval_every and (step % eval_every == 0 or step == cfg.trainer.steps):
                    last |= _evaluate(orch, rollouts, step)
                last = run.logger.log(step, last)
                if run.should_checkpoint(step) or stop.requested:
                    run.save(_orch_meta(orch, step))
        run.save(_orch_meta(orch, run.trainer.step))
    except EnvServerDead as e:  # keep what was learnt: checkpoint, result.json, then stop with the cause
        aborted = e
        run.save(_orch_meta(orch, run.trainer.step))
    finally:
        orch.close()
        server.stop()
        engine.stop()
    if aborted is not None:
        run.finish(title=f"RL {Path(cfg.output_dir).name}", export=False, error=str(aborted))
        raise RunAborted(
            f"{aborted}\nA checkpoint of step {run.trainer.step} is in {run.ckpt.dir}: fix the env, then rerun "
            "with --resume"
        ) from aborted
    result = run.finish(title=f"RL {Path(cfg.output_dir).name}", export=not run.stop_request().requested)
    return result | {"last": last}


def load_teachers(ocfg: Any, trainer: Any) -> dict[str, Teacher]:
    """The OPD teachers the train envs name, each loaded once on the trainer's mesh."""
    configs = {e.algo.teacher.name: e.algo.teacher for e in ocfg.train.env if isinstance(e.algo, OPDConfig)}
    return {name: Teacher.load(name, trainer, c.dtype) for name, c in configs.items()}


def score_references(samples: list[Any], teachers: dict[str, Teacher]) -> None:
    """Fill `logr` of every ref-KL sample with its teacher's log-probs."""
    for name, teacher in teachers.items():
        teacher.score([s for s in samples if s.needs_reference and s.metadata.get("teacher") == name])


def _orch_meta(orch: Orchestrator, step: int) -> dict[str, Any]:
    return {"orchestrator": {"sampler": orch.sampler_state_for(step + 1)}}


def _rl_step(run: TrainingRun, orch: Orchestrator, engine: Any, rollouts: RolloutLog, step: int, max_resample: int, teachers: dict[str, Teacher]) -> dict[str, Any]:
    t0 = time.perf_counter()
    groups = orch.next_batch(step)
    t_rollout = time.perf_counter() - t0
    batch = build_batch(groups, orch.algorithms, step)
    for attempt in range(max_resample):
        if batch.has_signal:
            break
        batch.mark_resampled()
        rollouts.write(batch.records)
        orch.request_more(step)
        batch = build_batch(orch.next_batch(step), orch.algorithms, step)
    if not batch.has_signal:
        rollouts.write(batch.records)
        raise RuntimeError(
            f"step {step}: {max_resample + 1} batches in a row had no learning signal (every group's rewards "
            "were identical and no CE tokens were selected); check the env's reward, raise the temperature, "
            "or raise orchestrator.max_resample. Rollouts are in rollouts.jsonl"
        )
    score_references(batch.samples, teachers)
    t_score = time.perf_counter() - t0 - t_rollout
    train = run.trainer.train_step(batch.samples)
    t_train = time.perf_counter() - t0 - t_rollout - t_score
    engine.update_weights_from_state(run.trainer.params, version=run.trainer.step)
    t_sync = time.perf_counter() - t0 - t_rollout - t_score - t_train
    rollouts.write(batch.records)
    metrics = batch.metrics | train | {
        "policy_version": float(engine.policy_version),
        "time/rollout_wait_s": t_rollout,
        "time/scoring_s": t_score,
        "time/train_s": t_train,  # the whole train_step call (the trainer's own time/train_s, plus the host hand-off)
        "time/weight_sync_s": t_sync,
        "time/step_s": time.perf_counter() - t0,
    }
    return metrics | engine_metrics(engine)


ENGINE_KEYS = ("waiting", "running", "tokens_per_s", "prefix_hit_rate", "cached_prompt_tokens", "prompt_tokens",
               "generated_tokens", "compiles")


def engine_metrics(engine: Any) -> dict[str, float]:
    """The rollout backend's own view (``GET /metrics`` of the embedded engine) as ``engine/...`` keys."""
    snapshot = engine.metrics()
    if snapshot is None:
        return {}
    return {f"engine/{k}": float(v) for k, v in snapshot.model_dump(include=set(ENGINE_KEYS)).items()}


def _evaluate(orch: Orchestrator, rollouts: RolloutLog, step: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    metrics, evals = orch.evaluate()
    rollouts.write([{"step": step, "split": "eval", "fate": "eval", **r.to_record()} for r in evals])
    metrics["time/eval_s"] = time.perf_counter() - t0
    return metrics
