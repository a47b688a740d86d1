"""verifiers' own CLI finds jaxrl's built-in envs: `vf-eval jaxrl-reverse-text` (or
`jaxrl_reverse_text`) resolves through verifiers' loader, which imports a taskset id as a
top-level module and takes the classes its `__all__` exports. The install provides one such
module per built-in env (vf_envs/, pyproject's py-modules); a bare `reverse_text` would be a
top-level module colliding with the hub's env of that name (and `lookup` / `needle` with PyPI's).
These tests see the installed modules only (vf_envs/ is never on the tests' path)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
from verifiers.v1.env import Env
from verifiers.v1.envs.single_agent import SingleAgentEnv
from verifiers.v1.taskset import Taskset
from verifiers.v1.utils.loaders import default_harness_id, environment_class, harness_class, taskset_class

from jaxrl.envs import BUILTIN_ENVS
from jaxrl.envs.harness import LocalChatHarness

ROOT = Path(__file__).resolve().parents[2]


def _exported(module_path: str, base: type) -> list[type]:
    module = importlib.import_module(module_path)
    return [c for n in module.__all__ if isinstance(c := getattr(module, n), type) and issubclass(c, base)]


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_vf_eval_resolves_each_builtin_env_by_its_jaxrl_id(name: str, monkeypatch) -> None:
    # jaxrl's own runs alias the same name in sys.modules (jaxrl.envs.register_plugin): drop it,
    # so what resolves here is what a fresh `vf-eval` process imports.
    monkeypatch.delitem(sys.modules, f"jaxrl_{name}", raising=False)
    spec = importlib.util.find_spec(f"jaxrl_{name}")
    assert spec is not None, f"jaxrl_{name} is not installed: reinstall jaxrl (pip install -e . --no-deps)"
    assert Path(spec.origin).resolve() == ROOT / "vf_envs" / f"jaxrl_{name}.py", spec.origin
    (taskset,) = _exported(BUILTIN_ENVS[name], Taskset)
    envs = _exported(BUILTIN_ENVS[name], Env)
    for vf_id in (f"jaxrl-{name.replace('_', '-')}", f"jaxrl_{name}"):  # vf-eval's two spellings
        assert taskset_class(vf_id) is taskset, vf_id
        assert environment_class(vf_id) is (envs[0] if envs else SingleAgentEnv), vf_id
        # the harness vf-eval picks is the env's offline one, not verifiers' networked default
        assert harness_class(default_harness_id(vf_id)) is LocalChatHarness, vf_id
    assert sys.modules[f"jaxrl_{name}"].__file__ == spec.origin  # the installed module, imported


def test_the_installed_ids_are_exactly_the_builtin_envs() -> None:
    import tomllib

    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    ids = {f"jaxrl_{name}" for name in BUILTIN_ENVS}
    assert set(setup["py-modules"]) == ids == {p.stem for p in (ROOT / "vf_envs").glob("*.py")}
    assert setup["package-dir"][""] == "vf_envs"
