"""Speed on the device: each measure yields JSON-able lines ``{"bench": name, ...}`` as soon as
each number is taken (the runner writes each line at once, so a later failure loses nothing).

Torch runs before jax within each measure and hands its cached memory back afterwards
(``torch_free``): jax runs without preallocation and keeps what it grew, so torch gets the
device first.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.devicecheck.common import (
    TARGETS,
    Device,
    Shapes,
    decode_bytes_per_step,
    one_device_mesh,
    random_decoder,
    torch_dtype,
    torch_free,
    torch_sync,
    train_flops_per_token,
    utilization,
)

Lines = Iterator[dict[str, Any]]
REMATS = {"none": "none", "dots": "save_dots", "full": "full"}  # measure suffix -> TrainerConfig.remat


def _dtype(dev: Device) -> str:
    """bfloat16 on accelerators; float32 on the CPU (bf16 dots are slower there, DESIGN 9)."""
    return "float32" if dev.platform == "cpu" else "bfloat16"


def _target(dev: Device, key: str, value: float | None) -> dict[str, Any]:
    goal = TARGETS[key]
    met = None if value is None or not dev.judged else value >= goal
    return {"target": f">= {goal}", "meets_target": met}


def torch_train_step(
    hf_config: dict[str, Any], tokens: np.ndarray, device: str, *, checkpointing: bool = False, lr: float = 1e-5
) -> tuple[Any, Any]:
    """transformers + torch, the side jaxrl's train step is measured against (here and in
    ``bench/train_step.py``): AdamW (as jaxrl's optimizer), bf16 autocast on float32 weights off
    the CPU, gradient checkpointing on or off. Returns ``(step, free)``: ``step()`` runs one
    optimizer step and returns its seconds; ``free()`` hands torch's memory back."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config.from_dict(hf_config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().to(device).train()
    if checkpointing:  # transformers 5.24 renamed it; the CUDA image's 5.17 has the old name only
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable()
        else:
            model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    ids = torch.as_tensor(tokens, dtype=torch.long, device=device)
    amp = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device != "cpu")
    held = {"model": model, "opt": opt}

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = held["model"](input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(held["model"].parameters(), 1.0)
        held["opt"].step()
        torch_sync(device)
        return time.perf_counter() - t0

    def free() -> None:
        held.clear()  # drop torch's references before handing its memory back
        torch_free(device)

    return step, free


def _torch_train(dev: Device, shapes: Shapes, tokens: np.ndarray, checkpointing: bool) -> dict[str, Any]:
    """Best of the timed steps of ``torch_train_step`` on the train model."""
    assert dev.torch_device is not None
    step, free = torch_train_step(shapes.train, tokens, dev.torch_device, checkpointing=checkpointing)
    try:
        step()  # warm-up
        times = [step() for _ in range(shapes.train_steps)]
    finally:
        free()
    return {"step_s": min(times), "tokens_per_s": tokens.size / min(times), "gradient_checkpointing": checkpointing}


def jaxrl_trainer(hf_config: dict[str, Any], *, rows: int, seq: int, steps: int, dtype: str, remat: str) -> Any:
    """``jaxrl.trainer.step.Trainer`` on a random-weight model of ``hf_config`` on one device
    (float32 parameters, ``dtype`` compute), ``rows x seq`` micro-batches: the side measured."""
    from jaxrl.trainer.config import TrainerConfig
    from jaxrl.trainer.step import Trainer

    cfg = TrainerConfig(seq_len=seq, seq_len_buckets=[seq], micro_batch_rows=rows, steps=steps, remat=remat)
    model = random_decoder(hf_config, param_dtype=jnp.float32, dtype=jnp.dtype(dtype))
    return Trainer(model, cfg, one_device_mesh())


def train_step(dev: Device, shapes: Shapes, *, remat: str, profile_dir: Path | None = None) -> Lines:
    """Optimizer steps of ``jaxrl.trainer.step.Trainer`` on ``rows x seq`` tokens of the train
    model (random weights) with this ``remat`` policy, after transformers + torch at the same
    setting (gradient checkpointing for "full", none for "none"; torch has no save-dots policy).

    ``mfu`` counts model FLOPs (6N + attention), ``hfu`` adds what the policy recomputes
    (``common.train_flops_per_token``): the two differ by the price of recomputation."""
    from jaxrl.models.arch import arch_from_hf_config
    from jaxrl.training_sample import TrainingSample

    policy = REMATS[remat]
    name = f"train_remat_{remat}"
    arch = arch_from_hf_config(shapes.train)
    dtype = _dtype(dev)
    tokens = np.random.default_rng(0).integers(0, arch.vocab_size, (shapes.train_rows, shapes.train_seq))
    samples = [TrainingSample.sft(t, np.ones(len(t))) for t in tokens]

    torch_line: dict[str, Any] = {"bench": name, "impl": "transformers", "remat": policy}
    torch_tok_s = None
    if policy == "save_dots":
        torch_line["skipped"] = "transformers has no save-the-matmuls checkpointing policy to match"
    elif not dev.torch_same_device:
        torch_line["skipped"] = dev.torch_note if dev.torch_device is None else f"torch does not see the {dev.platform}"
    else:
        try:
            result = _torch_train(dev, shapes, tokens, checkpointing=policy == "full")
            torch_line |= result
            torch_tok_s = result["tokens_per_s"]
        except Exception as e:
            torch_line["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    yield torch_line

    trainer = jaxrl_trainer(shapes.train, rows=shapes.train_rows, seq=shapes.train_seq,
                            steps=shapes.train_steps + 2, dtype=dtype, remat=policy)
    first = trainer.train_step(samples)  # compile + warm-up
    steps = [trainer.train_step(samples) for _ in range(shapes.train_steps)]
    best = min(steps, key=lambda m: m["time/train_s"])
    seconds = best["time/train_s"]
    n_tok = float(tokens.size)
    model_flops, hw_flops = train_flops_per_token(arch, shapes.train_seq, policy)
    value = utilization(model_flops * n_tok, seconds, dev.peak)
    line = {"bench": name, "impl": "jaxrl", "remat": policy, "tokens_per_s": n_tok / seconds, "step_s": seconds,
            "step_s_median": statistics.median(m["time/train_s"] for m in steps), "first_step_s": first["time/train_s"],
            "mfu": value, "hfu": utilization(hw_flops * n_tok, seconds, dev.peak),
            "model_tflops_per_step": model_flops * n_tok / 1e12, "hw_tflops_per_step": hw_flops * n_tok / 1e12,
            "params": arch.num_params(), "layers": arch.num_layers, "rows": shapes.train_rows,
            "seq": shapes.train_seq, "dtype": dtype, "param_dtype": "float32", "kernels": trainer.kernels.impl,
            "loss": best["ce_loss"], **_target(dev, "train_step_mfu", value)}
    if torch_tok_s is not None:
        ratio = line["tokens_per_s"] / torch_tok_s
        line |= {"over_transformers": ratio, "vs_transformers": _target(dev, "train_step_vs_transformers", ratio)}
    yield line
    if profile_dir is not None:
        with jax.profiler.trace(str(profile_dir)):
            trainer.train_step(samples)
        yield {"bench": name, "impl": "jaxrl", "profile_dir": str(profile_dir),
               "note": "one train step under jax.profiler.trace (TensorBoard / xprof)"}


def hf_generate_tok_s(model: Any, prompts: np.ndarray, new_tokens: int, repeats: int, device: str = "cpu") -> float:
    """Output tokens/s of transformers ``generate`` on ``model`` (greedy, exactly ``new_tokens``
    tokens per prompt; the median of ``repeats`` after a short warm-up): the side the engine's
    decode is measured against, here and in ``bench/decode.py``."""
    import torch

    ids = torch.as_tensor(prompts, device=device)
    kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
        times = []
        for _ in range(repeats):
            torch_sync(device)
            t0 = time.perf_counter()
            out = model.generate(ids, **kw)
            torch_sync(device)
            times.append(time.perf_counter() - t0)
    assert out.shape[1] == prompts.shape[1] + new_tokens
    return len(prompts) * new_tokens / statistics.median(times)


def engine_decode_s(engine: Any, prompts: np.ndarray, new_tokens: int, repeats: int) -> float:
    """Median seconds for the engine to generate exactly ``new_tokens`` greedy tokens for every
    prompt at once (prefill included), after one untimed run of the shapes and with the prefix
    cache of no use to the timed runs."""
    from jaxrl.engine.requests import Request
    from jaxrl.engine.token_sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)

    def run() -> float:
        reqs = [Request(p.tolist(), params) for p in prompts]
        t0 = time.perf_counter()
        outs = engine.generate(reqs)
        dt = time.perf_counter() - t0
        assert all(len(o.token_ids) == new_tokens for o in outs)
        return dt

    run()  # the first call of each shape
    engine.generate([Request([1, 2], SamplingParams(max_tokens=1))])  # no prefix-cache hits on the timed runs
    return statistics.median(run() for _ in range(repeats))


def _hf_generate(dev: Device, shapes: Shapes, dtype: str, prompts: np.ndarray) -> float:
    """``hf_generate_tok_s`` on a random model of the decode shapes on the device."""
    import transformers

    device = dev.torch_device
    assert device is not None
    cfg = transformers.Qwen3Config.from_dict(shapes.decode)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype(dtype)).to(device).eval()
    try:
        return hf_generate_tok_s(model, prompts, shapes.decode_new, shapes.repeats, device)
    finally:
        del model
        torch_free(device)


def decode(dev: Device, shapes: Shapes) -> Lines:
    """Greedy decode throughput of the engine (``jaxrl.engine.engine.Engine``, random weights
    of the decode model) at each batch size, vs transformers ``generate`` on the same device.
    Times include prefill; ``decode_new`` tokens per sequence, no stop token.

    ``hbm_share``: the HBM bandwidth the decode steps reach over the device's peak, counting the
    bytes each step must read (``common.decode_bytes_per_step``: the weights once, the KV cache
    at the mean context). Prefill is in the time, so it is a lower bound."""
    from jaxrl.engine.config import EngineConfig
    from jaxrl.engine.engine import Engine
    from jaxrl.models.arch import arch_from_hf_config

    dtype = _dtype(dev)
    vocab = shapes.decode["vocab_size"]
    rng = np.random.default_rng(0)
    batches = {b: rng.integers(0, vocab, (b, shapes.decode_prompt)) for b in shapes.decode_batches}
    hf: dict[int, float | str] = {}
    for b, prompts in batches.items():  # torch first: it hands its memory back, jax keeps what it grows
        if not dev.torch_same_device:
            hf[b] = dev.torch_note if dev.torch_device is None else f"torch does not see the {dev.platform}"
            continue
        try:
            hf[b] = _hf_generate(dev, shapes, dtype, prompts)
        except Exception as e:
            hf[b] = f"error {type(e).__name__}: {str(e)[:200]}"

    top = max(shapes.decode_batches)
    cfg = EngineConfig(
        max_model_len=shapes.decode_prompt + shapes.decode_new + 8, max_seqs=top,
        max_batched_tokens=top * shapes.decode_prompt, decode_steps=4, decode_steps_idle=shapes.decode_steps_idle,
        decode_batch_buckets=list(shapes.decode_batches), prefill_len_buckets=[shapes.decode_prompt],
        prefill_batch_buckets=list(shapes.decode_prefill_batches),
    )
    model = random_decoder(shapes.decode, param_dtype=jnp.dtype(dtype), dtype=jnp.dtype(dtype))
    engine = Engine(model, cfg)
    del model
    warmup_s = engine.warmup()
    arch = arch_from_hf_config(shapes.decode)
    width = jnp.dtype(dtype).itemsize
    for b, prompts in batches.items():
        seconds = engine_decode_s(engine, prompts, shapes.decode_new, shapes.repeats)
        tok_s = b * shapes.decode_new / seconds
        step_bytes = decode_bytes_per_step(arch, b, shapes.decode_prompt + shapes.decode_new / 2, width, width)
        gbps = step_bytes * (tok_s / b) / 1e9
        line = {"bench": "decode", "batch": b, "engine_tok_s": tok_s, "engine_s": seconds, "dtype": dtype,
                "hbm_gbps": gbps, "hbm_share": None if dev.bandwidth is None else gbps * 1e9 / dev.bandwidth,
                "prompt": shapes.decode_prompt, "new_tokens": shapes.decode_new, "kernels": engine.kernels.impl,
                "warmup_s": warmup_s, "layers": shapes.decode["num_hidden_layers"]}
        if isinstance(hf[b], float):
            ratio = tok_s / hf[b]
            line |= {"hf_generate_tok_s": hf[b], "engine_over_generate": ratio}
            if b == 32:
                line |= _target(dev, "decode_b32_vs_generate", ratio)
        else:
            line["hf_generate_skipped"] = hf[b]
        yield line


def decode_quantized(dev: Device, shapes: Shapes) -> Lines:
    """Greedy decode tokens/s at the largest batch with the engine's projections in int8 and in
    fp8 (``[inference.backend] quantization``), the same shapes and timing as ``decode`` (whose
    line at that batch is the unquantized side of the comparison, from the same run), and the
    bytes the served weights take."""
    from jaxrl.engine.config import EngineConfig
    from jaxrl.engine.engine import Engine

    dtype = _dtype(dev)
    top = max(shapes.decode_batches)
    prompts = np.random.default_rng(0).integers(0, shapes.decode["vocab_size"], (top, shapes.decode_prompt))
    for kind in ("int8", "fp8"):
        cfg = EngineConfig(
            max_model_len=shapes.decode_prompt + shapes.decode_new + 8, max_seqs=top,
            max_batched_tokens=top * shapes.decode_prompt, decode_steps=4, decode_steps_idle=shapes.decode_steps_idle,
            decode_batch_buckets=[top], prefill_len_buckets=[shapes.decode_prompt],
            prefill_batch_buckets=list(shapes.decode_prefill_batches), quantization=kind,
        )  # fmt: skip
        engine = Engine(random_decoder(shapes.decode, param_dtype=jnp.dtype(dtype), dtype=jnp.dtype(dtype)), cfg)
        warmup_s = engine.warmup()
        seconds = engine_decode_s(engine, prompts, shapes.decode_new, shapes.repeats)
        yield {"bench": "decode_quantized", "quantization": kind, "batch": top, "engine_tok_s": top * shapes.decode_new / seconds,
               "engine_s": seconds, "dtype": dtype, "weight_bytes": sum(x.nbytes for x in jax.tree.leaves(engine.params)),
               "warmup_s": warmup_s, "kernels": engine.kernels.impl}  # fmt: skip
        del engine


RL_KEYS = ("time/rollout_wait_s", "time/train_s", "time/weight_sync_s", "time/scoring_s", "time/step_s")


# configs/reverse_text/rl.toml without its SFT warm start, evals and checkpoints: written here so
# that the check runs from an installed wheel (no repository checkout on the target).
RL_RECIPE: dict[str, Any] = {
    "trainer": {"seq_len": 256, "micro_batch_rows": 8,
                "optim": {"lr": 5e-4, "warmup_steps": 3, "schedule": "constant", "weight_decay": 0.0}},
    "inference": {"max_model_len": 256, "max_seqs": 64},
    "orchestrator": {"batch_size": 512, "group_size": 16, "max_async_level": 1,
                     "train": {"sampling": {"max_completion_tokens": 24, "temperature": 1.0},
                               "env": [{"id": "reverse_text"}]}},
}


def rl_run(dev: Device, shapes: Shapes) -> Lines:
    """Five GRPO steps of the reverse_text recipe (``RL_RECIPE``: embedded engine, a verifiers env
    server process) on a random model of ``shapes.rl_scratch`` (full: Qwen3-0.6B's layers and
    widths with the byte tokenizer; bfloat16 compute off the CPU), checkpoints off; the step split
    (rollout wait / train / weight sync) comes from the run's metrics.jsonl, one line per step."""
    from jaxrl.cli import build_config, deep_merge
    from jaxrl.metrics import read_metrics
    from jaxrl.rl import run_rl

    steps = 5
    with tempfile.TemporaryDirectory() as out:
        over = {
            "output_dir": out,
            "model": {"scratch": shapes.rl_scratch, "dtype": _dtype(dev)},
            "trainer": {"steps": steps, "mesh": {"num_devices": 1}},
            "inference": {"server": {"port": 0}, "backend": {"type": "embedded", "decode_steps_idle": 4}},
            "ckpt": {"interval": 0},
            "log": {"progress": False},
        }
        cfg = build_config(deep_merge(deep_merge(RL_RECIPE, over), shapes.rl_overrides), [])
        t0 = time.perf_counter()
        run_rl(cfg)
        wall = time.perf_counter() - t0
        rows = [r for r in read_metrics(Path(out) / "metrics.jsonl") if "time/step_s" in r]
    for r in rows:
        yield {"bench": "rl_step", "step": r["step"], **{k.split("/")[1]: r[k] for k in RL_KEYS},
               "reward_mean": r.get("train/reward_mean")}
    steady = rows[1:] or rows  # step 1 includes the train step's compile
    mean = {k.split("/")[1]: statistics.mean(r[k] for r in steady) for k in RL_KEYS}
    model = {k: shapes.rl_scratch[k] for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads")}
    yield {"bench": "rl_run", "steps": len(rows), "steps_averaged": len(steady), **mean,
           **{f"{k}_frac": v / mean["step_s"] for k, v in mean.items() if k != "step_s"},
           "run_wall_s": wall, "model": f"scratch Qwen3-shaped {model}, random init, {_dtype(dev)} compute",
           "batch_size": cfg.orchestrator.batch_size, "group_size": cfg.orchestrator.group_size,
           "max_completion_tokens": cfg.orchestrator.train.sampling.max_completion_tokens}


BENCHES = {
    **{f"train_remat_{r}": functools.partial(train_step, remat=r) for r in REMATS},
    "decode": decode,
    "decode_quantized": decode_quantized,
    "rl_run": rl_run,
}
