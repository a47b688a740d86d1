"""The README's worked example of your own environment runs as written: its module loads and
every rollout through the offline harness scores, and its TOML merged over the reverse_text
recipe is a valid RL config that trains that env."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from jaxrl.cli import load_config
from jaxrl.orchestrator.batch import build_batch
from jaxrl.orchestrator.orchestrator import Orchestrator, check_envs

ROOT = Path(__file__).resolve().parents[2]


def readme_block(lang: str, after: str) -> str:
    """The first ```lang block after the line containing ``after`` in README.md."""
    text = (ROOT / "README.md").read_text()
    start = text.index(after)
    return re.search(rf"```{lang}\n(.*?)```", text[start:], re.DOTALL).group(1)


@pytest.fixture
def readme_env(tmp_path, monkeypatch) -> str:
    pkg = tmp_path / "my_words_env"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(readme_block("python", "Put this in `my_words_env/__init__.py`"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    yield "my_words_env"
    sys.modules.pop("my_words_env", None)


@pytest.mark.slow  # an env server: test_orchestrator keeps one in the fast tier
def test_the_readme_own_env_example_runs(readme_env, endpoint, tmp_path) -> None:
    mine = tmp_path / "my_rl.toml"
    mine.write_text(readme_block("toml", "and this in `my_rl.toml`"))
    cfg, _ = load_config(["--config", str(ROOT / "configs" / "reverse_text" / "rl.toml"), "--config", str(mine)])
    assert [e.id for e in cfg.orchestrator.train.env] == [readme_env] and cfg.orchestrator.eval.interval == 0
    ocfg = cfg.orchestrator.model_copy(update={"batch_size": 4, "group_size": 2, "max_async_level": 0})
    check_envs(ocfg)
    orch = Orchestrator(ocfg, endpoint, output_dir=tmp_path, seed=0, policy_version=lambda: 0)
    try:
        orch.start()
        batch = build_batch(orch.next_batch(1, timeout=120), orch.algorithms, 1)
    finally:
        orch.close()
    assert not [r["error"] for r in batch.records if r["error"]]
    assert batch.metrics["reward_mean"] == 1.0  # the scripted model reverses: the reward ran on every rollout
