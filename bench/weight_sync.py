"""Trainer -> engine weight hand-off: in-process vs a train step vs writing and reloading files.

    python bench/weight_sync.py [--hidden 384] [--layers 6] [--vocab 16384]

A random Qwen3-shaped model (~17M parameters) is trained by jaxrl's ``Trainer`` (SFT samples,
8 rows x 256 tokens per step) and served by an ``Engine``. Three timings (median of
``--repeats``): one train step; ``engine.update_weights_from_state(trainer.params)`` (one
batched device_put to the engine's shardings + the swap); and the file path, ``export_hf`` to a
temporary directory followed by ``engine.update_weights_from_path``. Prints one JSON line.
Targets: in-process sync <= 5% of a train step and >= 10x faster than the file path.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from tiny_qwen3 import save_tiny_qwen3  # bench/ is on sys.path when run as a script


def make_model(out: Path, args: argparse.Namespace) -> int:
    return save_tiny_qwen3(out, vocab=args.vocab, hidden=args.hidden, layers=args.layers, max_len=1024)


def median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    import jax

    from jaxrl.engine.config import EngineConfig
    from jaxrl.engine.engine import Engine
    from jaxrl.models.hf_io import export_hf, load_decoder
    from jaxrl.parallel.mesh import MeshConfig, make_mesh
    from jaxrl.trainer.config import TrainerConfig
    from jaxrl.trainer.step import Trainer
    from jaxrl.training_sample import TrainingSample

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        n_params = make_model(model_dir, args)
        hf_config = json.loads((model_dir / "config.json").read_text())
        tcfg = TrainerConfig(seq_len=args.seq_len, seq_len_buckets=[args.seq_len], micro_batch_rows=args.rows)
        mesh = make_mesh(MeshConfig())
        trainer = Trainer(load_decoder(model_dir), tcfg, mesh, peak_flops=1.0)
        rng = np.random.default_rng(0)
        samples = [
            TrainingSample.sft(rng.integers(0, args.vocab, args.seq_len), np.ones(args.seq_len, np.float32))
            for _ in range(args.rows)
        ]
        trainer.train_step(samples)  # compile
        step_s = median_time(lambda: trainer.train_step(samples), args.repeats)

        engine = Engine.from_pretrained(model_dir, EngineConfig(max_model_len=256, max_seqs=4))

        def in_process() -> None:
            engine.update_weights_from_state(trainer.params)
            jax.block_until_ready(engine.params)  # the copy is dispatched asynchronously

        def via_files() -> None:
            out = export_hf(trainer.model(), Path(tmp) / f"export{engine.policy_version}", hf_config)
            engine.update_weights_from_path(out)
            jax.block_until_ready(engine.params)

        in_process()  # warm up
        sync_s = median_time(in_process, args.repeats)

        files_s = median_time(via_files, args.repeats)
    print(
        json.dumps(
            {
                "params": n_params,
                "param_mb": round(n_params * 4 / 2**20, 1),
                "train_step_s": round(step_s, 4),
                "sync_in_process_s": round(sync_s, 5),
                "sync_fraction_of_step": round(sync_s / step_s, 4),
                "sync_via_files_s": round(files_s, 4),
                "in_process_speedup_vs_files": round(files_s / sync_s, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
