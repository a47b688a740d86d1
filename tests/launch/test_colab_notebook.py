"""The Colab notebook runs top to bottom on a CPU kernel at its "tiny" budget: install check,
device detection, SFT with an inline plot, RL from the SFT export with an inline plot, and the
rollout listing. Executed with nbclient in a real IPython kernel (test deps: nbclient,
nbformat, ipykernel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from xla_flags import cpu_devices

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "launch" / "colab" / "jaxrl_colab.ipynb"


def outputs_of(nb, marker: str) -> list[dict]:
    """Outputs of the code cell whose source contains ``marker``."""
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    return cell.outputs


def has_png(outputs: list[dict]) -> bool:
    return any("image/png" in o.get("data", {}) for o in outputs)


def install_script(nb) -> str:
    """The parameters and install cells, as one script: the notebook's own clone-and-install code path."""
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    (install,) = [c for c in nb.cells if c.cell_type == "code" and "def installed_from" in c.source]
    return params.source + "\n" + install.source + "\n"


def test_outside_a_checkout_without_repo_url_fails_naming_the_fix(tmp_path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {k: v for k, v in os.environ.items() if k != "JAXRL_REPO_URL"}
    r = subprocess.run(
        [sys.executable, "-c", install_script(nb)], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert r.returncode != 0 and "set REPO_URL" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "jaxrl").exists()


@pytest.mark.slow
def test_opened_outside_a_checkout_clones_and_installs(tmp_path) -> None:
    """As in Colab: no checkout around the kernel and jaxrl not installed from one, so the install cell
    clones REPO_URL and pip-installs the clone. Runs in a venv layered on this environment (its
    dependencies are there; the shared editable install is not touched), cloning this repository
    from a file:// URL. A folder named `jaxrl` in the working directory (the clone) must not pass
    for an installation."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    work = tmp_path / "colab"
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = {**os.environ, "JAXRL_REPO_URL": ROOT.as_uri(), "PYTHONPATH": ""}
    check = "\nimport jaxrl, jaxrl.train\nprint('IMPORTED', jaxrl.train.__file__)\n"
    r = subprocess.run(
        [str(python), "-c", install_script(nb) + check], cwd=work, env=env, capture_output=True, text=True, check=False, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    clone = work / "jaxrl"
    assert (clone / "jaxrl" / "train.py").exists()
    assert f"IMPORTED {clone / 'jaxrl' / 'train.py'}" in r.stdout
    assert f"installed from: {clone}" in r.stdout
    # Re-running the cell (now inside the clone) neither clones nor installs again.
    r2 = subprocess.run(
        [str(python), "-c", install_script(nb) + "\nprint('PIP' if 'pip' in sys.modules else 'NOPIP')"],
        cwd=clone, env=env, capture_output=True, text=True, check=False, timeout=120,
    )
    assert r2.returncode == 0 and f"jaxrl checkout: {clone} | installed from: {clone}" in r2.stdout, r2.stderr[-2000:]


def test_readme_badge_opens_this_notebook() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    target = "colab.research.google.com/github/"
    suffix = "/blob/main/launch/colab/jaxrl_colab.ipynb"
    for text in (nb.cells[0].source, (ROOT / "README.md").read_text()):
        assert "colab-badge.svg" in text and target in text and suffix in text


def test_parameters_cell_is_tagged_for_papermill() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and "BUDGET" in tagged[0].source
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "commit the notebook without outputs"
    )


@pytest.mark.slow
def test_notebook_runs_top_to_bottom_on_cpu(tmp_path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv("JAXRL_NOTEBOOK_BUDGET", "tiny")
    monkeypatch.setenv("JAXRL_NOTEBOOK_WORKDIR", str(runs))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", cpu_devices(1))  # the kernel inherits these
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    )
    client.execute()  # raises CellExecutionError (with the cell and traceback) on any failure

    assert any("cpu" in o.get("text", "") for o in outputs_of(nb, "jax.devices()"))
    assert has_png(outputs_of(nb, "sft = run(")), "SFT plot not shown inline"
    sft_rows = [json.loads(x) for x in (runs / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in sft_rows] == [1, 2, 3, 4]
    assert (runs / "sft" / "hf" / "model.safetensors").exists()

    assert has_png(outputs_of(nb, "rl = run(")), "RL plot not shown inline"
    rl_rows = [json.loads(x) for x in (runs / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rl_rows if "train/reward_mean" in r] == [1, 2]
    listing = "".join(o.get("text", "") for o in outputs_of(nb, "rollouts[-4:]"))
    assert listing.count("reward") == 4
