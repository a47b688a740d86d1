"""scripts/wheelhouse.py's selection logic on hand-made freeze files (no network): what a target
image already has at a version jaxrl accepts is never carried; markers are evaluated for the
target's Python, not this interpreter's; bad input is refused with one line naming the flag."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "scripts" / "wheelhouse.py")
wh = importlib.util.module_from_spec(_spec)
sys.modules["wheelhouse"] = wh  # dataclasses look their module up there
_spec.loader.exec_module(wh)
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

IMAGE = """\
# a comment
jax==0.11.2
jax-cuda13-plugin==0.11.2
Flax==0.12.10
transformers==5.10.0
torch @ file:///build/torch-2.11.0-cp312-linux_x86_64.whl
-e git+https://example.invalid/jaxrl.git#egg=jaxrl
jaxrl==0.0.9
numpy==2.5.5
"""


def test_parse_freeze_reads_pins_and_direct_references() -> None:
    have = wh.parse_freeze(IMAGE)
    assert have == {"jax": "0.11.2", "jax-cuda13-plugin": "0.11.2", "flax": "0.12.10", "transformers": "5.10.0",
                    "torch": None, "numpy": "2.5.5"}  # names canonical; jaxrl itself and -e lines left out
    with pytest.raises(wh.WheelhouseError, match=r"--have line 2: 'jax>=0.11' is not"):
        wh.parse_freeze("numpy==2.5.5\njax>=0.11\n")


def test_markers_are_evaluated_for_the_target_python() -> None:
    """The test extra's torch pin is for Python < 3.12: a 3.12 target gets none, a 3.11 one gets it,
    whatever Python runs the script."""
    def names(python: str, extras: list[str]) -> set[str]:
        env = wh.target_environment(python, "x86_64-manylinux_2_28")
        return {r.name for r in wh.direct_requirements(PYPROJECT, extras, env)}

    assert "torch" not in names("3.12", ["test"]) and "torch" in names("3.11", ["test"])
    cuda = wh.direct_requirements(PYPROJECT, ["cuda"], wh.target_environment("3.12", "x86_64-manylinux_2_28"))
    assert any(r.name == "jax" and "cuda13" in r.extras for r in cuda)
    with pytest.raises(wh.WheelhouseError, match="--extra: unknown cuda14; jaxrl has cuda, cuda12"):
        wh.direct_requirements(PYPROJECT, ["cuda14"], {})


def test_rejected_names_the_image_packages_jaxrl_refuses() -> None:
    env = wh.target_environment("3.12", "x86_64-manylinux_2_28")
    reqs = wh.direct_requirements(PYPROJECT, ["cuda"], env)
    out = wh.rejected(wh.parse_freeze(IMAGE), reqs)
    assert set(out) == {"transformers"}  # 5.10.0 < 5.16.1; jax 0.11.2, flax 0.12.10, numpy 2.5.5 accepted
    assert out["transformers"] == "target has 5.10.0, jaxrl needs transformers<6,>=5.16.1"


def test_plan_carries_only_what_the_image_lacks_or_has_at_another_version() -> None:
    have = wh.parse_freeze(IMAGE)
    resolved = {"jax": "0.11.2", "jax-cuda13-plugin": "0.11.2", "flax": "0.12.10", "transformers": "5.17.0",
                "torch": "2.11.0", "numpy": "2.5.5", "pydantic": "2.14.4", "jaxrl": "0.1.0"}
    p = wh.plan(resolved, have)
    assert p.carry == {"pydantic": "2.14.4", "transformers": "5.17.0"}
    assert p.kept == ["flax", "jax", "jax-cuda13-plugin", "numpy", "torch"]  # torch: the image's own build
    assert p.upgraded == {"transformers": "5.10.0 -> 5.17.0"}


def test_skip_leaves_out_carried_packages_and_refuses_a_name_it_does_not_carry() -> None:
    p = wh.Plan({"llvmlite": "0.50.0", "numba": "0.68.1", "grain": "0.2.15"}, ["jax"], {})
    left, skipped = wh.leave_out(p, ["Numba", "llvmlite"])
    assert left.carry == {"grain": "0.2.15"} and skipped == ["llvmlite", "numba"] and left.kept == ["jax"]
    with pytest.raises(wh.WheelhouseError, match="--skip numpa: not in the wheelhouse"):
        wh.leave_out(p, ["numpa"])


def test_platform_tags_cover_older_manylinux() -> None:
    tags = wh.pip_platform_tags("x86_64-manylinux_2_28")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_27_x86_64" in tags and "manylinux_2_17_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags and tags[-3:] == ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                  "manylinux1_x86_64"]
    assert wh.pip_platform_tags("aarch64-manylinux_2_17") == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    with pytest.raises(wh.WheelhouseError, match="--platform 'linux_x86_64': use ARCH-manylinux_2_GLIBC"):
        wh.pip_platform_tags("linux_x86_64")


@pytest.mark.parametrize(("args", "message"), [
    (["--python-version", "3.12.3"], "--python-version '3.12.3': give major.minor"),
    (["--python-version", "3.10"], "--python-version 3.10: jaxrl requires Python >=3.11"),
    (["--have", "missing.txt"], "--have missing.txt: no such file"),
    (["-o", "{full}"], "exists and is not empty"),
])
def test_bad_arguments_are_refused_with_one_line(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.5.5\n")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x.whl").write_text("")
    base = {"--have": str(freeze), "--python-version": "3.12", "-o": str(tmp_path / "new")}
    base |= dict(zip(args[::2], (a.format(full=full) for a in args[1::2])))
    with pytest.raises(SystemExit) as exc:
        wh.main([x for kv in base.items() for x in kv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists() and (full / "x.whl").exists()
