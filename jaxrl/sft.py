"""The SFT loop: grain batches of rendered conversations -> Trainer steps -> checkpoints ->
HF export (``<output_dir>/hf``, with the tokenizer: the warm start RL recipes load)."""

from __future__ import annotations

if __name__ == "__main__":  # before the heavy imports: a script checking exit codes learns at once
    from jaxrl.library_module import refuse_main

    refuse_main("jaxrl.sft", "data")

import random
import time
from pathlib import Path
from typing import Any

from jaxrl.config import ConfigError, DataConfig, RunConfig
from jaxrl.data.conversations import load_conversations
from jaxrl.data.sft import READ_OPTIONS, RenderConversation, reference_conversations, sft_dataset
from jaxrl.models.renderer import RendererSpec
from jaxrl.run_common import TrainingRun
from jaxrl.training_sample import TrainingSample

# Loss metrics of the RL and ref-KL components, always 0 in SFT: left out of SFT rows (prefixes).
RL_ONLY = ("rl_", "ref_kl_", "teacher_kl", "mismatch_kl", "masked_high_frac", "masked_low_frac")


def run_sft(cfg: RunConfig, *, resume: bool = False) -> dict[str, Any]:
    data_cfg = cfg.data or DataConfig()
    run = TrainingRun(cfg, plot_keys=("train/ce_loss", "train/ce_nll_max", "train/grad_norm", "train/tokens_per_s"))  # eval shares ce_loss's panel
    skipped = 0
    held_out: list[TrainingSample] = []  # scored for eval/ce_loss, never trained on
    if data_cfg.path is not None:
        render = RenderConversation(run.tokenizer_dir, run.renderer, data_cfg.content_roles)

        def check(example: Any) -> None:  # a row that cannot train fails (or is skipped) up front
            n = len(render.map(example))
            if n > cfg.trainer.seq_len:
                raise ValueError(f"{n} tokens rendered, more than trainer.seq_len = {cfg.trainer.seq_len}")

        try:  # a bad row is the user's to fix: one line, exit 2 (jaxrl.train), not a traceback
            loaded = load_conversations(
                data_cfg.path, revision=data_cfg.revision, skip_bad_rows=data_cfg.skip_bad_rows, check=check
            )  # fmt: skip
            rows, held = hold_out(loaded.examples, data_cfg.eval_fraction, data_cfg.seed)
            if data_cfg.eval_path is not None:
                held = load_conversations(
                    data_cfg.eval_path, skip_bad_rows=data_cfg.skip_bad_rows, check=check, field="data.eval_path"
                ).examples
        except (ValueError, FileNotFoundError, ImportError) as e:
            raise ConfigError(str(e)) from None
        conversations, skipped = rows[: data_cfg.num_examples], loaded.skipped
        held_out = [render.map(c) for c in held[: data_cfg.eval_examples]] if data_cfg.eval_interval else []
    else:
        conversations = reference_conversations(
            data_cfg.taskset or "reverse_text", data_cfg.taskset_args, data_cfg.num_examples or 4096, data_cfg.seed
        )
    dataset = sft_dataset(
        conversations, run.tokenizer_dir, run.renderer, data_cfg.batch_size, data_cfg.seed,
        content_roles=data_cfg.content_roles,
    )  # fmt: skip
    batches = iter(dataset.to_iter_dataset(READ_OPTIONS))
    if data_cfg.eval_interval and data_cfg.path is None:
        held_out = heldout_samples(data_cfg, run.tokenizer_dir, run.renderer)
    elif data_cfg.eval_interval and not held_out:
        print(f"[jaxrl] data.path = {data_cfg.path!r}: no held-out eval (set data.eval_fraction or data.eval_path)")
    meta = run.maybe_resume(resume)
    if meta:
        batches.set_state(meta["data"])
    last: dict[str, Any] = {}
    with run.stop_request() as stop:
        for step in range(run.trainer.step + 1, cfg.trainer.steps + 1):
            last = run.train_step(next(batches), unused=RL_ONLY)
            if held_out and (step % data_cfg.eval_interval == 0 or step == cfg.trainer.steps):
                last |= evaluate(run, held_out)
            last = run.logger.log(step, last)
            if run.should_checkpoint(step) or stop.requested:
                run.save({"data": batches.get_state()})
            if stop.requested:
                break
    if not stop.requested:
        run.save({"data": batches.get_state()})
    result = run.finish(title=f"SFT {Path(cfg.output_dir).name}", export=not stop.requested)
    return result | {"last": last, "examples": len(conversations), "skipped_rows": skipped}


def hold_out(rows: list[Any], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, held out): a seeded random ``fraction`` of ``rows`` (at least one row when > 0)
    held out; train keeps the file order of the rest."""
    if not fraction:
        return rows, []
    n = max(1, round(len(rows) * fraction))
    if n >= len(rows):
        raise ValueError(f"data.eval_fraction = {fraction} holds out all {len(rows)} rows of data.path; lower it")
    held = set(random.Random(seed).sample(range(len(rows)), n))
    return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]


def heldout_samples(data_cfg: DataConfig, tokenizer_dir: str, renderer: RendererSpec) -> list[TrainingSample]:
    """The taskset's eval-split reference conversations, rendered once: tasks SFT never trains on."""
    conversations = reference_conversations(
        data_cfg.taskset or "reverse_text", data_cfg.taskset_args, data_cfg.eval_examples, data_cfg.seed, split="eval"
    )
    render = RenderConversation(tokenizer_dir, renderer, data_cfg.content_roles)
    return [render.map(c) for c in conversations]


def evaluate(run: TrainingRun, held_out: list[TrainingSample]) -> dict[str, float]:
    """``eval/ce_loss`` (NLL per assistant token) and ``eval/ce_tokens`` on the held-out set."""
    t0 = time.perf_counter()
    metrics = {f"eval/{k}": v for k, v in run.trainer.eval_loss(held_out).items()}
    return metrics | {"time/eval_s": time.perf_counter() - t0}
