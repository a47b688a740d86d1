"""Held-out NLL of tool-output tokens (echo's CE target) under several models, on one fixed set
of traces: a run's step-0 eval rollouts (``log.rollout_episodes = true``), the tokens echo's
algorithm selects in them. The step-0 evals of two runs with the same run seed are identical
(same warm start, same sampling seeds), so one run's set serves both. Scored at temperature 1.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import jax
import numpy as np
import tomllib
from flax import nnx

from jaxrl.kernel_dispatch import Kernels
from jaxrl.models.hf_io import load_decoder
from jaxrl.orchestrator.algo import EchoConfig, make_algorithm
from jaxrl.orchestrator.traces import Rollout
from jaxrl.trainer.step import packed_logprobs


def heldout_targets(run: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(token ids, tool-output target mask) of every step-0 eval sample of an echo run."""
    cfg = tomllib.loads((run / "bench_config.toml").read_text())
    echo = make_algorithm(EchoConfig.model_validate(cfg["orchestrator"]["train"]["env"][0]["algo"]))
    groups: dict[str, list[Rollout]] = defaultdict(list)
    for line in (run / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["split"] == "eval" and r["step"] == 0 and r["episode"] is not None:
            groups[r["group_id"]].append(Rollout(r["env"], r["group_id"], r["task"], r["episode"], r["error"]))
    out = []
    for group in groups.values():
        for s in echo.samples(group):
            mask = s.ce_w > 0
            mask[0] = False  # the first token has no prediction
            if mask.any():
                out.append((np.asarray(s.token_ids, np.int32), mask))
    if not out:
        raise RuntimeError(f"{run}: no tool-output tokens in the step-0 eval rollouts (no tool calls?)")
    return out


def tool_output_nll(run: Path, models: dict[str, Path], width: int = 1024) -> dict[str, float]:
    """Mean NLL per tool-output token of each model on ``run``'s held-out targets (and their count)."""
    targets = heldout_targets(run)
    out = {}
    for name, model_dir in models.items():
        graphdef, params = nnx.split(load_decoder(model_dir))
        total, count = 0.0, 0
        for tokens, mask in targets:
            n = len(tokens)
            assert n <= width, f"a held-out sample of {n} tokens is longer than {width}"
            pad = lambda x, fill=0: np.concatenate([x, np.full(width - n, fill, x.dtype)])[None]  # noqa: E731
            mb = {"tokens": pad(tokens), "positions": pad(np.arange(n, dtype=np.int32)),
                  "segment_ids": pad(np.ones(n, np.int32)), "temperature": pad(np.ones(n, np.float32), 1)}
            logp = np.asarray(_logprobs(graphdef, params, mb)[0])[: n - 1]
            total -= float(logp[mask[1:]].sum())
            count += int(mask.sum())
        out[name] = total / count
    out["tokens"] = count
    return out


@jax.jit
def _logprobs(graphdef, params, mb):  # type: ignore[no-untyped-def]
    return packed_logprobs(nnx.merge(graphdef, params), mb, Kernels.create("reference", field="k"), 4096)[0]
