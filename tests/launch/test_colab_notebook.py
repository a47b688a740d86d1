"""The Colab notebook runs top to bottom on a CPU kernel at its "tiny" budget: install check,
device detection, SFT with an inline plot, RL from the SFT export with an inline plot, and the
rollout listing. Executed with nbclient in a real IPython kernel (test deps: nbclient,
nbformat, ipykernel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")  # the kernel inherits these
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
    assert [r["step"] for r in rl_rows if "reward_mean" in r] == [1, 2]
    listing = "".join(o.get("text", "") for o in outputs_of(nb, "rollouts[-4:]"))
    assert listing.count("reward") == 4
