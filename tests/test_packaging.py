"""Packaging: what `pip install jaxrl` puts on disk.

The top-level ``kernels/`` folder installs as ``jaxrl_kernels`` so that it can sit beside Hugging
Face's ``kernels`` (a dependency of many HF stacks): two distributions that both install a
``kernels`` package would write into one directory and uninstalling either would break the other.
The package list in pyproject.toml is explicit (setuptools' finder cannot map a folder to another
name), so a fast test checks it against the tree, and a slow one builds the real wheel and installs
it beside HF's ``kernels`` in a fresh virtual environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
HF_KERNELS = "kernels==0.17.2"  # Hugging Face's kernel hub client (a binary wheel, no torch needed to import)


def test_every_jaxrl_package_is_listed_and_kernels_install_as_jaxrl_kernels() -> None:
    setup = PYPROJECT["tool"]["setuptools"]
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "jaxrl").rglob("__init__.py")
    }
    assert on_disk and on_disk <= set(setup["packages"]), f"add {sorted(on_disk - set(setup['packages']))}"
    assert set(setup["packages"]) - on_disk == {"jaxrl_kernels"}  # nothing listed that is not there
    # vf_envs/: the top-level jaxrl_<env> modules verifiers' CLI imports (tests/envs/test_verifiers_ids.py)
    assert setup["package-dir"] == {"": "vf_envs", "jaxrl": "jaxrl", "jaxrl_kernels": "kernels"}
    assert not (ROOT / "kernels" / "__init__.py").exists()  # run from the repo root, never shadows HF's
    cc = sorted(p.name for p in (ROOT / "kernels").glob("*.cc"))
    assert cc and PYPROJECT["tool"]["setuptools"]["package-data"]["jaxrl_kernels"] == ["*.cc"]


CLEAN_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
"""The tests' PYTHONPATH (the repository) would make the repo's jaxrl look installed."""


def _pip(*args: str, python: Path | None = None) -> None:
    """This interpreter's pip, acting on ``python``'s environment (pip --python)."""
    target = ["--python", str(python)] if python else []
    subprocess.run([sys.executable, "-m", "pip", *target, *args, "--disable-pip-version-check", "-q"],
                   check=True, capture_output=True, text=True, env=CLEAN_ENV)  # fmt: skip


CHECK = """
import importlib, importlib.util, json
out = {}
for name in ("jaxrl_kernels.select", "kernels"):
    try:
        m = importlib.import_module(name)
        out[name] = m.__file__
    except ModuleNotFoundError as e:
        if not name.startswith(e.name):
            raise
        out[name] = None
if out["kernels"]:
    import kernels
    out["kernels.__version__"] = kernels.__version__
    out["kernels.get_kernel"] = callable(getattr(kernels, "get_kernel", None))
if out["jaxrl_kernels.select"]:
    import jaxrl_kernels
    out["jaxrl_kernels.get_kernel"] = hasattr(jaxrl_kernels, "get_kernel")
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_wheel_installs_beside_hugging_faces_kernels(tmp_path: Path) -> None:
    """Build jaxrl's wheel, install it and HF's ``kernels`` (no deps) into a fresh venv that sees
    this environment's packages after its own (a .pth line), then import, uninstall one, import."""
    src = tmp_path / "src"  # a copy: an in-tree build would leave build/ in the repository
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("jaxrl", "kernels", "vf_envs"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    wheels = tmp_path / "wheels"
    try:
        _pip("download", "--no-deps", "--only-binary=:all:", HF_KERNELS, "-d", str(wheels))
        _pip("wheel", "--no-deps", str(src), "-w", str(wheels))
    except subprocess.CalledProcessError as e:  # no registry: nothing here to test against
        pytest.skip(f"pip could not fetch {HF_KERNELS} / setuptools from the registry: {e.stderr[-300:]}")
    jaxrl_whl = next(wheels.glob("jaxrl-*.whl"))
    names = zipfile.ZipFile(jaxrl_whl).namelist()
    env_ids = {f"{m}.py" for m in PYPROJECT["tool"]["setuptools"]["py-modules"]}  # jaxrl_<env>.py
    top_level = {n.split("/")[0] for n in names if not n.startswith("jaxrl-")}
    assert top_level == {"jaxrl", "jaxrl_kernels"} | env_ids, top_level
    assert {Path(n).name for n in names if n.endswith(".cc")} == {p.name for p in (ROOT / "kernels").glob("*.cc")}

    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    _pip("install", "--no-deps", "--no-index", *map(str, wheels.glob("*.whl")), python=python)
    site = next(env_dir.glob("lib/python*/site-packages"))
    # jax & co. from this environment, after the venv's own packages (a path line: this
    # environment's own .pth files, e.g. an editable jaxrl, stay inactive).
    (site / "zz_deps.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")

    def check() -> dict:
        run = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, env=CLEAN_ENV, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.splitlines()[-1])

    both = check()
    ours, theirs = Path(both["jaxrl_kernels.select"]).parent, Path(both["kernels"]).parent
    assert ours.parent == theirs.parent == site and ours != theirs, both
    assert both["kernels.__version__"] == HF_KERNELS.split("==")[1] and both["kernels.get_kernel"], both
    assert both["jaxrl_kernels.get_kernel"] is False  # ours is not theirs

    _pip("uninstall", "-y", "kernels", python=python)
    assert check()["kernels"] is None and Path(check()["jaxrl_kernels.select"]).parent == ours
    _pip("install", "--no-deps", "--no-index", str(next(wheels.glob("kernels-*.whl"))), python=python)
    _pip("uninstall", "-y", "jaxrl", python=python)
    after = check()
    assert after["jaxrl_kernels.select"] is None, after
    assert Path(after["kernels"]).parent == theirs and after["kernels.get_kernel"], after
