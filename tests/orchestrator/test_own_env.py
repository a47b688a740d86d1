"""Your own verifiers env, loaded by id the way an installed env package is (a package on the
env server's path), with no change to jaxrl: it exports only a `Taskset`, has no `split` field,
and no harness. It gets the offline in-process harness (verifiers' default `bash` harness
installs a program over the network: every rollout failed with "Could not resolve host"); a run
with eval off builds no eval env (it used to pass `split = "eval"`, which this taskset's config
refuses); a broken env fails in seconds, naming itself, before any server spawns."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from jaxrl.envs.reverse_text import SYSTEM_PROMPT
from jaxrl.orchestrator.batch import build_batch
from jaxrl.orchestrator.config import OrchestratorConfig
from jaxrl.orchestrator.orchestrator import Orchestrator, check_envs

MODULE = textwrap.dedent('''
    """A user's env package: a Taskset and nothing else."""
    import verifiers.v1 as vf

    WORDS = ["apple", "river", "stone", "cloud", "green", "tiger", "music", "paper"]

    class WordData(vf.TaskData):
        answer: str

    class WordTask(vf.Task[WordData]):
        @vf.reward(weight=1.0)
        async def exact(self, trace: vf.Trace) -> float:
            return float(trace.last_reply.strip() == self.data.answer)

    class WordConfig(vf.TasksetConfig):
        broken: bool = False

    class WordTaskset(vf.Taskset[WordTask, WordConfig]):
        def load(self):
            if self.config.broken:
                raise RuntimeError("my data file is missing")
            return [WordTask(WordData(prompt=w, system_prompt=%r, answer=w[::-1]), self.config.task) for w in WORDS]

    __all__ = ["WordTaskset"]
''' % SYSTEM_PROMPT)


@pytest.fixture
def my_env(tmp_path, monkeypatch) -> str:
    """`my_words_env` installed the way `pip install --target site/` lays it out, on the path of
    this process and of the env servers it spawns."""
    site = tmp_path / "site"
    (site / "my_words_env").mkdir(parents=True)
    (site / "my_words_env" / "__init__.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(site))
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    yield "my_words_env"
    sys.modules.pop("my_words_env", None)


@pytest.mark.slow  # an env server per test: the slow tier
def test_an_env_that_exports_only_a_taskset_runs_offline(my_env, endpoint, tmp_path) -> None:
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_async_level=0, train={"env": [{"id": my_env}]},
                             eval={"interval": 0})  # fmt: skip
    check_envs(cfg)
    orch = Orchestrator(cfg, endpoint, output_dir=tmp_path, seed=0, policy_version=lambda: 0)
    try:
        orch.start()
        assert orch.eval_servers == [] and orch.eval_tasks == {}  # eval off: nothing built
        batch = build_batch(orch.next_batch(1, timeout=120), orch.algorithms, 1)
    finally:
        orch.close()
    errors = [r["error"] for r in batch.records if r["error"]]
    assert not errors, errors[:2]
    assert batch.metrics["reward_mean"] == 1.0  # the scripted model reverses: the harness ran every turn


def test_eval_on_an_env_without_splits_and_a_broken_env_fail_before_any_spawn(my_env) -> None:
    with_eval = OrchestratorConfig(batch_size=4, group_size=2, train={"env": [{"id": my_env}]}, eval={"interval": 5})
    with pytest.raises(ValueError, match=r"env 'my_words_env'.*no `split` field.*\[\[orchestrator.eval.env\]\]"):
        check_envs(with_eval)
    broken = OrchestratorConfig(batch_size=4, group_size=2, train={"env": [{"id": my_env, "args": {"broken": True}}]})
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"env 'my_words_env' \(id 'my_words_env'\): my data file is missing"):
        check_envs(broken)
    assert time.perf_counter() - t0 < 30


def test_an_env_whose_own_import_fails_names_the_missing_module(tmp_path, monkeypatch) -> None:
    """It said "taskset 'my_broken_env' not found", hiding the ModuleNotFoundError inside."""
    site = tmp_path / "site"
    (site / "my_broken_env").mkdir(parents=True)
    (site / "my_broken_env" / "__init__.py").write_text("import a_package_nobody_installed\n")
    monkeypatch.syspath_prepend(str(site))
    cfg = OrchestratorConfig(batch_size=4, group_size=2, train={"env": [{"id": "my_broken_env"}]}, eval={"interval": 0})
    try:
        with pytest.raises(ValueError) as e:
            check_envs(cfg)
    finally:
        sys.modules.pop("my_broken_env", None)
    assert str(e.value).startswith("env 'my_broken_env' (id 'my_broken_env'): "
                                   "ModuleNotFoundError: No module named 'a_package_nobody_installed'"), e.value


RAISING = MODULE.replace(
    "return float(trace.last_reply.strip() == self.data.answer)",
    'raise ValueError(f"my reward broke on {self.data.answer!r}")',
).replace("my_words_env", "my_raising_env")


@pytest.mark.slow  # an env server per test: the slow tier
def test_a_reward_that_raises_is_logged_with_its_traceback(tmp_path, monkeypatch, endpoint) -> None:
    """The message reached the record but no traceback went anywhere, and the env log it pointed
    to held only shutdown noise."""
    site = tmp_path / "site"
    (site / "my_raising_env").mkdir(parents=True)
    (site / "my_raising_env" / "__init__.py").write_text(RAISING)
    monkeypatch.syspath_prepend(str(site))
    import os

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    cfg = OrchestratorConfig(batch_size=4, group_size=2, max_async_level=0,
                             train={"env": [{"id": "my_raising_env"}]}, eval={"interval": 0})  # fmt: skip
    orch = Orchestrator(cfg, endpoint, output_dir=tmp_path / "run", seed=0, policy_version=lambda: 0)
    try:
        orch.start()
        log = orch.train_servers[0].log_path
        records = [r.to_record() for g in orch.next_batch(1, timeout=120) for r in g.rollouts]
    finally:
        orch.close()
        sys.modules.pop("my_raising_env", None)
    assert records and all("my reward broke on" in r["error"] for r in records), records[0]["error"]
    tb = records[0]["traceback"]
    assert tb.startswith("Traceback") and 'raise ValueError(f"my reward broke' in tb, tb
    text = log.read_text()
    assert "failed: " in text and 'raise ValueError(f"my reward broke' in text, text[-2000:]
