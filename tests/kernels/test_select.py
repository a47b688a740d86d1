"""Platform selection, and our top-level ``kernels`` package staying invisible to transformers.

transformers 5 probes for Hugging Face's ``kernels`` package (DESIGN 9): it must find ours
unusable (version below its minimum) without importing jax; then its hub-kernels integration
never runs ``from jaxrl_kernels import ...``. Checked in a fresh interpreter, since this one has jax
loaded already.
"""

import subprocess
import sys
import textwrap

import jax
from jaxrl_kernels.select import use_pallas

PROBE = textwrap.dedent(
    """
    import sys
    import jaxrl_kernels
    assert "jax" not in sys.modules, "kernels/__init__.py imported jax"
    from transformers.utils.import_utils import is_kernels_available
    assert not is_kernels_available(), "transformers takes jaxrl's kernels for Hugging Face's"
    assert "jax" not in sys.modules, "transformers' probe imported jax through kernels"
    print("ok")
    """
)


def test_use_pallas_only_on_tpu():
    assert use_pallas("tpu") and use_pallas("TPU")
    assert not use_pallas("cpu")
    assert not use_pallas("gpu")
    assert use_pallas() == (jax.default_backend() == "tpu")


def test_transformers_does_not_take_our_kernels_package():
    result = subprocess.run(
        [sys.executable, "-c", PROBE], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"
