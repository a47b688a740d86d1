"""What every training run shares, SFT or RL: mesh, model, trainer, checkpoints, metrics,
preemption handling and the final HF export."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

import jax

from jaxrl.config import RunConfig
from jaxrl.metrics import MetricsLogger, truncate_jsonl
from jaxrl.models.hf_io import export_hf
from jaxrl.models.renderer import RendererSpec, model_renderer
from jaxrl.models.setup import prepare_model
from jaxrl.parallel.distributed import barrier, initialize, is_main_process, meet_over
from jaxrl.parallel.mesh import make_mesh
from jaxrl.preemption import RunAborted, StopRequest
from jaxrl.trainer.checkpoint import Checkpointer
from jaxrl.trainer.flops import measure_matmul_peak
from jaxrl.trainer.peft_export import export_peft_adapter
from jaxrl.trainer.step import Trainer


class TrainingRun:
    def __init__(self, cfg: RunConfig, *, plot_keys: tuple[str, ...]):
        initialize(cfg.distributed)
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if is_main_process():
            (self.out / "config.json").write_text(cfg.model_dump_json(indent=2))
        self.mesh = make_mesh(cfg.trainer.mesh)
        meet_over(self.mesh)  # every process connected over the whole mesh before any train step
        model, self.tokenizer_dir, self.hf_config = prepare_model(cfg.model, self.mesh, self.out)
        from transformers import AutoTokenizer

        self.renderer: RendererSpec = model_renderer(cfg.model, self.hf_config, AutoTokenizer.from_pretrained(self.tokenizer_dir))
        peak = cfg.trainer.peak_tflops * 1e12 if cfg.trainer.peak_tflops else None
        if peak is None and jax.default_backend() == "cpu":
            peak = measure_matmul_peak()
        self.trainer = Trainer(model, cfg.trainer, self.mesh, peak_flops=peak)
        self.ckpt = Checkpointer(cfg.ckpt.dir or self.out / "checkpoints", cfg.ckpt)
        self.plot_keys = plot_keys
        self.logger: MetricsLogger | None = None
        self._stop = StopRequest()
        self._first_step_s: float | None = None

    def maybe_resume(self, resume: bool) -> dict[str, Any]:
        """Restore the latest checkpoint when ``resume``; returns its meta ({} when fresh)."""
        meta: dict[str, Any] = {}
        if resume:
            step = self.ckpt.latest_step()
            if step is None:
                raise FileNotFoundError(f"--resume: no checkpoint in {self.ckpt.dir}")
            self._check_lora(self.ckpt.meta(step), step)
            state, meta = self._restore(step)
            self.trainer.restore(state, step)
            if is_main_process():  # records past the checkpoint are written again by this run
                for name in ("metrics.jsonl", "rollouts.jsonl"):
                    if dropped := truncate_jsonl(self.out / name, step):
                        print(f"[jaxrl] --resume from step {step}: dropped {dropped} later records of {name}")
        log = self.cfg.log
        self.logger = MetricsLogger(
            self.out, self.cfg.trainer.steps, start_step=self.trainer.step, progress=log.progress,
            plot_keys=self.plot_keys if log.plot else (), interval=log.interval, wandb=log.wandb,
            wandb_run_id=meta.get("wandb_run_id"),
            tensorboard=log.tensorboard, run_config=self.cfg.model_dump(),
            title=f"{self.cfg.mode.upper()} {self.out.name}",
        )
        return meta

    def _lora_meta(self) -> dict[str, Any] | None:
        lora = self.cfg.trainer.lora
        return None if lora is None else lora.model_dump(mode="json")

    def _check_lora(self, meta: dict[str, Any], step: int) -> None:
        """A checkpoint holds full weights or one LoRA shape: resuming it under another
        ``[trainer.lora]`` would fail deep in orbax with a shape error (or, full vs LoRA, restore
        nothing that fits), so it is refused up front, naming both settings."""
        saved, now = meta.get("lora"), self._lora_meta()
        if "lora" in meta and saved != now:
            raise RunAborted(
                f"--resume: the checkpoint at step {step} in {self.ckpt.dir} was trained with "
                f"[trainer.lora] = {saved or 'off (full fine-tuning)'}, this config has "
                f"{now or 'off (full fine-tuning)'}; resume with the same [trainer.lora], or start a new output_dir"
            )

    def _restore(self, step: int) -> tuple[Any, dict[str, Any]]:
        """The checkpoint of ``step``; an unreadable one names its directory and the way back."""
        try:
            return self.ckpt.restore(step, self.trainer.state_for_checkpoint())
        except Exception as e:  # orbax / tensorstore raise many kinds for a damaged checkpoint
            path = Path(self.ckpt.dir) / str(step)
            earlier = [s for s in self.ckpt.all_steps() if s < step]
            hint = (
                f"move {path} out of {self.ckpt.dir} and rerun with --resume to continue from step {max(earlier)}"
                if earlier
                else "there is no earlier checkpoint: rerun without --resume to start over"
            )
            log = self.out / "logs" / "resume_error.log"  # the whole error (orbax / TensorStore dumps run long)
            if is_main_process():
                log.parent.mkdir(parents=True, exist_ok=True)
                log.write_text("".join(traceback.format_exception(e)))
            first = (str(e).strip().splitlines() or [""])[0]
            cause = f"{type(e).__name__}: {first[:200]}"
            raise RunAborted(
                f"--resume: checkpoint {path} cannot be restored ({cause}; details in {log}); {hint}"
            ) from e

    def train_step(self, samples: Any, *, unused: tuple[str, ...] = ()) -> dict[str, Any]:
        """One optimizer step; its metrics less those starting with an ``unused`` prefix (zero by
        construction in this run). The first step says when it starts compiling and how long
        it took (off a terminal this is all there is to see for minutes on a large model)."""
        first = self._first_step_s is None
        if first and is_main_process():
            print(f"[jaxrl] step {self.trainer.step + 1}: compiling the train step (first call)", flush=True)
        t0 = time.perf_counter()
        metrics = self.trainer.train_step(samples)
        if first:
            self._first_step_s = time.perf_counter() - t0
            if is_main_process():
                print(f"[jaxrl] first train step, compile included: {self._first_step_s:.1f} s", flush=True)
        return {k: v for k, v in metrics.items() if not k.startswith(unused)} if unused else metrics

    def stop_request(self) -> StopRequest:
        return self._stop

    def should_checkpoint(self, step: int) -> bool:
        return bool(self.cfg.ckpt.interval) and step % self.cfg.ckpt.interval == 0

    def save(self, meta: dict[str, Any]) -> None:
        step = self.trainer.step
        if step in self.ckpt.all_steps():
            return
        wandb_id = self.logger.wandb_run_id if self.logger is not None else None
        meta = meta | ({"wandb_run_id": wandb_id} if wandb_id else {})  # --resume continues the same W&B run
        meta = meta | {"lora": self._lora_meta()}  # --resume refuses another [trainer.lora]
        self.ckpt.save(step, self.trainer.state_for_checkpoint(), {"step": step, **meta})

    def export(self) -> Path:
        """HF weights + tokenizer at ``<output_dir>/hf`` (loadable by transformers and jaxrl)."""
        path = export_hf(self.trainer.model(), self.out / "hf", self.hf_config)
        if is_main_process():
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(self.tokenizer_dir).save_pretrained(path)
        return path

    def export_adapter(self) -> Path | None:
        """With ``[trainer.lora]``, the adapters in PEFT format at ``<output_dir>/hf_adapter``
        (``peft.PeftModel.from_pretrained(base, dir)``; the base is the run's ``[model]``)."""
        lora, model = self.cfg.trainer.lora, self.cfg.model
        if lora is None:
            return None
        base = model.name
        if base is not None and Path(base).expanduser().is_dir():  # a local base: found from anywhere
            base = str(Path(base).expanduser().resolve())
        return export_peft_adapter(
            self.trainer.trainable, lora, self.trainer.arch, self.out / "hf_adapter",
            base_model_name_or_path=base, revision=model.revision,
        )  # fmt: skip

    def finish(self, *, title: str, export: bool, error: str | None = None) -> dict[str, Any]:
        self.ckpt.close()
        result: dict[str, Any] = {"steps": self.trainer.step, "stopped_by": self._stop.signal_name}
        if error is not None:
            result["error"] = error
        if export:
            result["export"] = str(self.export())
            if (adapter := self.export_adapter()) is not None:
                result["export_adapter"] = str(adapter)
        if self.logger is not None:
            plot = self.logger.close(title)
            result["plot"] = str(plot) if plot else None
        if is_main_process():
            (self.out / "result.json").write_text(json.dumps(result, indent=2))
        barrier("jaxrl-run-finished")  # process 0's files (e.g. a warm start's export) exist for all
        return result
