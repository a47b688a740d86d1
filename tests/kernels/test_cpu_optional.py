"""The CPU serving kernels are a platform backend, not part of the model: the trainer's import
path never loads them, and a project without ``kernels/cpu_*`` runs the references (the engine
with ``kernels = "auto"`` on CPU gives the reference's tokens)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU_KERNEL_PREFIX = "jaxrl_kernels.cpu_"


def _run(code: str, root: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, cwd=root, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_the_trainers_import_path_loads_no_cpu_kernel() -> None:
    """Config, model, trainer step and kernel choice ("auto" on CPU) without ``jaxrl_kernels.cpu_*``;
    the engine's choice loads them only once it packs weights."""
    code = (
        "import sys\n"
        "import jaxrl.config, jaxrl.models.decoder, jaxrl.trainer.step\n"
        "from jaxrl.kernel_dispatch import Kernels\n"
        "k = Kernels.create('auto', field='trainer.kernels')\n"
        "assert k.cpu and k.token_logprobs() is None\n"
        f"print(sorted(m for m in sys.modules if m.startswith({CPU_KERNEL_PREFIX!r})))\n"
    )
    assert _run(code, ROOT).strip() == "[]"


def _copy_without_cpu_kernels(dst: Path) -> Path:
    """The project's Python packages, with ``kernels/cpu_*`` deleted."""
    shutil.copytree(ROOT / "jaxrl", dst / "jaxrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels", dst / "jaxrl_kernels", ignore=shutil.ignore_patterns("__pycache__", "cpu_*"))
    shutil.copytree(ROOT / "tests", dst / "tests", ignore=shutil.ignore_patterns("__pycache__", "fixtures"))
    assert not list((dst / "jaxrl_kernels").glob("cpu_*"))
    # kernels/ has no __init__.py (from the repo root it must not shadow Hugging Face's
    # `kernels`), so `jaxrl_kernels` is a namespace package that an editable install's path hook
    # would extend with the checkout's folder; a regular package keeps the copy's modules alone.
    (dst / "jaxrl_kernels" / "__init__.py").write_text("")
    return dst


@pytest.mark.slow  # a fresh interpreter and engine: the slow tier
def test_without_the_cpu_kernels_the_engine_runs_the_references(tmp_path: Path) -> None:
    root = _copy_without_cpu_kernels(tmp_path)
    code = (
        "import sys\n"
        # An editable install of the checkout maps any `jaxrl_kernels.*` name the copy lacks to
        # the checkout's kernels/ (setuptools' editable finder); without it the copy is all there is.
        "sys.meta_path[:] = [f for f in sys.meta_path if not f.__module__.startswith('__editable__')]\n"
        "sys.path.insert(0, 'tests')\n"
        "from helpers import tiny_model\n"
        "from jaxrl.engine.config import EngineConfig\n"
        "from jaxrl.engine.engine import Engine\n"
        "from jaxrl.engine.token_sampling import SamplingParams\n"
        "from jaxrl.engine.requests import Request\n"
        "model = tiny_model(seed=3, vocab=70)\n"
        "outs = {}\n"
        "for kernels in ('auto', 'reference'):\n"
        "    cfg = EngineConfig(max_model_len=64, max_seqs=4, max_batched_tokens=64, kernels=kernels, decode_batch_buckets=[4])\n"
        "    engine = Engine(model, cfg)\n"
        "    reqs = [Request(p, SamplingParams(max_tokens=8, temperature=0.0)) for p in ([1, 2, 3], [7, 8, 9, 10])]\n"
        "    outs[kernels] = [o.token_ids for o in engine.generate(reqs)]\n"
        "assert outs['auto'] == outs['reference'], outs\n"
        f"print(sorted(m for m in sys.modules if m.startswith({CPU_KERNEL_PREFIX!r})))\n"
    )
    assert _run(code, root).strip() == "[]"
