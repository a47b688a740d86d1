"""The RL loop: trainer + rollout backend + env servers.

    orchestrator thread: env servers run rollouts against the backend's HTTP API
    main thread:         batch for step n -> samples -> train step -> weights -> backend

The rollout backend (``jaxrl.rollout``) is the embedded engine (weights
handed over in memory), a vLLM server, or external ``jaxrl.serve`` servers (weights through
files); after every optimizer step it serves the new parameters as policy version n.
Timings per step are split into rollout wait, scoring, train and weight sync
(``bench/rl_step.py`` reads them).

Multi-host (``[distributed]``): the trainer spans every process; the orchestrator, env
servers, rollout log and metrics live on process 0, which sends each step's samples to all
processes; all run the same train step and weight export. Rollouts come from external servers
or from the embedded engine colocated over every process (``jaxrl.rollout.colocated``), whose
processes meet the loop only in ``backend.collective()`` sections.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports: a script checking exit codes learns at once
    from jaxrl.library_module import refuse_main

    refuse_main("jaxrl.rl", "orchestrator")

import json
import time
from pathlib import Path
from typing import Any

import jax

from jaxrl.config import ConfigError, RunConfig, check_multihost_rl
from jaxrl.metrics import MetricsLogger
from jaxrl.orchestrator.batch import BatchFailed, collect_batch
from jaxrl.orchestrator.env_process import EnvServerDead
from jaxrl.orchestrator.orchestrator import Orchestrator, check_envs
from jaxrl.parallel.distributed import broadcast_from_main, initialize, is_main_process
from jaxrl.preemption import RunAborted
from jaxrl.rollout.base import RolloutBackend, RolloutServerDead
from jaxrl.rollout.factory import start_rollout_backend
from jaxrl.run_common import TrainingRun
from jaxrl.serving.http_thread import check_port_free
from jaxrl.trainer.loss import component_metrics
from jaxrl.trainer.teacher import Teacher
from jaxrl.training_sample import COMPONENTS

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


STOPPING = (EnvServerDead, RolloutServerDead, BatchFailed)  # the run checkpoints, writes result.json and exits 1


class LeaderStopped(RuntimeError):
    """On processes other than 0: process 0 stopped the run (its reason is the message)."""


def run_rl(cfg: RunConfig, *, resume: bool = False) -> dict[str, Any]:
    assert cfg.orchestrator is not None
    ocfg = cfg.orchestrator
    initialize(cfg.distributed)
    if cfg.distributed.expected_processes() == 1 and jax.process_count() > 1:
        # Checked at load when the count was known then; a TPU slice outside GKE (no num_processes,
        # no TPU_WORKER_HOSTNAMES) learns it only now, from jax.distributed's own discovery.
        check_multihost_rl(cfg.inference.backend.type)
    if is_main_process():  # the engine's server, vLLM's proxy or the external balancer listens here
        check_port_free(cfg.inference.server.host, cfg.inference.server.port)  # before the model loads
        try:
            check_envs(ocfg)  # an env that cannot load fails now, not after the engine's warm-up
        except ValueError as e:
            raise ConfigError(str(e)) from None
    run = TrainingRun(cfg, plot_keys=PLOT_KEYS)
    meta = run.maybe_resume(resume)
    # An MoE model on the embedded backend replays routing (its server returns the experts:
    # jaxrl.rollout.factory); elsewhere, unless the config asked for replay, the trainer recomputes it.
    recomputes = cfg.trainer.moe_routing is None and cfg.inference.backend.type != "embedded"
    if run.trainer.arch.is_moe and is_main_process() and recomputes:
        print(f"[jaxrl] MoE policy on the {cfg.inference.backend.type} backend: the trainer recomputes routing "
              "(samples carry no routed_experts); routing_changed_frac is not measured", flush=True)  # fmt: skip
    leader = is_main_process()  # runs the orchestrator and env servers; every process trains
    if leader:  # the engine compiles every program before it serves: say so, or minutes pass silently
        print(f"[jaxrl] starting the rollout server ({cfg.inference.backend}): compiling its programs ...", flush=True)
    t0 = time.perf_counter()
    backend = start_rollout_backend(
        run.trainer.model(), run.trainer.params, version=run.trainer.step, hf_config=run.hf_config,
        inference=cfg.inference, model_config=cfg.model, output_dir=run.out,
        tokenizer_dir=run.tokenizer_dir, renderer=run.renderer, moe_routing=cfg.trainer.moe_routing,
    )  # fmt: skip
    if leader:  # a free port by default: say which
        print(f"[jaxrl] rollout server at {backend.endpoint.base_url} (ready in {time.perf_counter() - t0:.1f} s)", flush=True)
    orch = (
        Orchestrator(
            ocfg,
            backend.endpoint,
            output_dir=run.out,
            seed=cfg.seed,
            policy_version=lambda: backend.policy_version,
            token_versions=backend.token_versions,
        )
        if leader
        else None
    )
    teachers = load_teachers(ocfg, run.trainer)
    rollouts = RolloutLog(run.out / "rollouts.jsonl", append=bool(meta), episodes=cfg.log.rollout_episodes, logger=run.logger)
    assert run.logger is not None
    last: dict[str, Any] = {}
    aborted: Exception | None = None
    try:
        if orch is not None:
            orch.start(first_step=run.trainer.step + 1, sampler_state=meta.get("orchestrator", {}).get("sampler"))
        eval_every = ocfg.eval.interval if ocfg.eval else 0
        if orch is not None and eval_every and not meta:
            run.logger.log(run.trainer.step, _evaluate(orch, rollouts, run.trainer.step))
        stepper = _Stepper(run, orch, backend, rollouts, teachers, ocfg.max_resample)
        with run.stop_request() as stop:
            while run.trainer.step < cfg.trainer.steps:
                step = run.trainer.step + 1
                metrics = stepper.step(step, stop_requested=stop.requested)
                if metrics is None:  # a stop request (SIGTERM/SIGINT), decided by process 0
                    break
                last = metrics
                if orch is not None and eval_every and (step % eval_every == 0 or step == cfg.trainer.steps):
                    last |= _evaluate(orch, rollouts, step)
                last = run.logger.log(step, last)  # written by process 0 only
                if run.should_checkpoint(step):
                    with backend.collective():
                        run.save(_orch_meta(orch, step))
        with backend.collective():
            run.save(_orch_meta(orch, run.trainer.step))
    except (*STOPPING, LeaderStopped) as e:  # keep what was learnt: checkpoint, result.json, then stop with the cause
        aborted = e
        with backend.collective():
            run.save(_orch_meta(orch, run.trainer.step))
    finally:
        if orch is not None:
            orch.close()
        backend.stop()
    if aborted is not None:
        run.finish(title=f"RL {Path(cfg.output_dir).name}", export=False, error=str(aborted))
        fix = "restart that server" if isinstance(aborted, RolloutServerDead) else "fix the cause"
        raise RunAborted(
            f"{aborted}\nA checkpoint of step {run.trainer.step} is in {run.ckpt.dir}: {fix}, then rerun with --resume"
        ) from aborted
    # Export (a collective) when every step ran: the same answer on every process, whichever got a signal.
    result = run.finish(title=f"RL {Path(cfg.output_dir).name}", export=run.trainer.step >= cfg.trainer.steps)
    return result | {"last": last}


def unused_metrics(ocfg: Any) -> tuple[str, ...]:
    """Prefixes of the trainer's metrics that are zero by construction in this run: the CE
    component's when no env's algorithm declares it (echo, sft do), ref-KL's likewise (opd)."""
    used = frozenset().union(*(e.algo.loss_components for e in ocfg.train.env))
    # An RL run always logs its RL metrics.
    return tuple(p for c in COMPONENTS if c != "rl" and c not in used for p in component_metrics(c))


def load_teachers(ocfg: Any, trainer: Any) -> dict[str, Teacher]:
    """The OPD teachers the train envs name, each loaded once on the trainer's mesh."""
    configs = {t.name: t for e in ocfg.train.env if (t := e.algo.teacher_config()) is not None}
    return {name: Teacher.load(name, trainer, c.dtype) for name, c in configs.items()}


def score_references(samples: list[Any], teachers: dict[str, Teacher]) -> None:
    """Fill `logr` of every ref-KL sample with its teacher's log-probs."""
    for name, teacher in teachers.items():
        teacher.score([s for s in samples if s.needs_reference and s.metadata.get("teacher") == name])


def _orch_meta(orch: Orchestrator | None, step: int) -> dict[str, Any]:
    return {"orchestrator": {"sampler": orch.sampler_state_for(step + 1)}} if orch is not None else {}


class _Stepper:
    """One RL step on every process: process 0 collects the batch (orchestrator, resampling,
    rollout log) and hands its samples to all processes; all score, train and export weights
    together; process 0 pushes them to the rollout servers. With one process nothing is sent.

    A stop (a signal, a dead env or rollout server, a crash) is decided by process 0 and sent
    in place of a batch, so every process leaves the loop at the same collective."""

    def __init__(self, run: TrainingRun, orch: Orchestrator | None, backend: RolloutBackend, rollouts: RolloutLog,
                 teachers: dict[str, Teacher], max_resample: int):  # fmt: skip
        self.run, self.orch, self.backend, self.rollouts = run, orch, backend, rollouts
        self.teachers, self.max_resample = teachers, max_resample
        self.unused = unused_metrics(run.cfg.orchestrator)
        self._pending: Exception | None = None  # a weight push that failed: stops the next step

    def step(self, step: int, *, stop_requested: bool) -> dict[str, Any] | None:
        """This step's metrics (full on process 0), or None when the run stops on request."""
        t0 = time.perf_counter()
        failure: BaseException | None = None
        message: dict[str, Any] = {}
        if self.orch is not None:
            try:
                if self._pending is not None:
                    raise self._pending
                message = {"kind": "stop"} if stop_requested else self._collect(step)
            except BaseException as e:  # noqa: BLE001 - sent to every process, then raised here
                failure = e
                message = {"kind": "abort" if isinstance(e, STOPPING) else "crash", "error": str(e)}
        with self.backend.collective():  # the colocated engine's processes meet here
            message = broadcast_from_main(message)
            if failure is not None:
                raise failure
            if message["kind"] == "stop":
                return None
            if message["kind"] != "batch":
                cls = LeaderStopped if message["kind"] == "abort" else RuntimeError
                raise cls(f"process 0 stopped the run: {message['error']}")
            t_rollout = time.perf_counter() - t0
            samples = message["samples"]
            score_references(samples, self.teachers)
            t_score = time.perf_counter() - t0 - t_rollout
            train = self.run.train_step(samples, unused=self.unused)
            t_train = time.perf_counter() - t0 - t_rollout - t_score
            try:
                self.backend.update_weights(self.run.trainer.params, version=self.run.trainer.step)
            except STOPPING as e:  # logged with this step; the next step stops the run on every process
                self._pending = e
        t_sync = time.perf_counter() - t0 - t_rollout - t_score - t_train
        if self.orch is None:
            return train
        self.rollouts.write(message["records"])
        metrics = message["metrics"] | train | {
            "policy_version": float(self.backend.policy_version),
            "time/rollout_wait_s": t_rollout,  # on process 0 (more processes: also the hand-off of the batch)
            "time/scoring_s": t_score,
            "time/train_s": t_train,  # the whole train_step call (the trainer's own time/train_s, plus the host hand-off)
            "time/weight_sync_s": t_sync,
            "time/step_s": time.perf_counter() - t0,
        }
        return metrics | self.backend.weight_metrics() | engine_metrics(self.backend)

    def _collect(self, step: int) -> dict[str, Any]:
        """Process 0: a batch with learning signal for ``step`` (resampling up to max_resample)."""
        assert self.orch is not None
        orch = self.orch
        batch = collect_batch(
            lambda n=None: self._next_batch(step, n), lambda n=None: orch.request_more(step, n), orch.algorithms,
            step, max_resample=self.max_resample, write=self.rollouts.write, env_logs=orch.env_logs(),
            dynamic=orch.cfg.dynamic_sampling,
        )  # fmt: skip
        return {"kind": "batch", "samples": batch.samples, "records": batch.records, "metrics": batch.metrics}

    def _next_batch(self, step: int, n: int | None = None) -> list[Any]:
        assert self.orch is not None
        groups = self.orch.next_batch(step, n=n)
        self.backend.check()  # rollouts a server failed must not be trained on
        return groups


ENGINE_KEYS = ("waiting", "running", "tokens_per_s", "prefix_hit_rate", "cached_prompt_tokens", "prompt_tokens",
               "generated_tokens", "compiles", "step_s", "device_s", "prefill_s", "decode_s")


def engine_metrics(backend: RolloutBackend) -> dict[str, float]:
    """The rollout backend's own view (``GET /metrics.json`` of the embedded engine) as ``engine/...`` keys."""
    snapshot = backend.metrics()
    if snapshot is None:
        return {}
    return {f"engine/{k}": float(v) for k, v in snapshot.model_dump(include=set(ENGINE_KEYS)).items()}


def _evaluate(orch: Orchestrator, rollouts: RolloutLog, step: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    metrics, evals = orch.evaluate()
    rollouts.write([{"step": step, "split": "eval", "fate": "eval", **r.to_record()} for r in evals])
    metrics["time/eval_s"] = time.perf_counter() - t0
    return metrics
