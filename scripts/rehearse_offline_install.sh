#!/usr/bin/env bash
# Rehearse docs/accelerator.md's offline install, CPU-sized, exactly as the document says it:
#
#   1. "the image": a Python 3.12 venv with the CUDA image's jax set from the registry
#      (jax 0.11.2, flax 0.12.10, optax, orbax-checkpoint, tensorstore, transformers 5.17.0; CPU
#      jax, no torch), and its `pip freeze`;
#   2. "here": scripts/wheelhouse.py --have that freeze -> a wheel folder (printed size);
#   3. "the target, no network": pip install --no-index --no-deps DIR/*.whl, pip check, then
#      python -m jaxrl.devicecheck --smoke (its checks and one measure of each kind) from outside
#      the checkout, under a hard timeout.
#      Step 3 runs in a network namespace with no network at all (unshare -n, loopback only)
#      where this host allows it, and with no pip configuration (no find-links, no index).
#
#   bash scripts/rehearse_offline_install.sh [WORKDIR] [PHASE]
#
# WORKDIR: default .ci-venvs/rehearsal. PHASE: "all" (the default), "install" (1-3's installs:
# WORKDIR is emptied first; network and disk, so CI runs it in the background beside other work)
# or "smoke" (3's smoke run, on what "install" left in WORKDIR; CPU, so CI runs it alone).
#
# CI runs it (.ci/run); it keeps the document true. Times on this 2-core host: see docs/accelerator.md.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${1:-$ROOT/.ci-venvs/rehearsal}
PHASE=${2:-all}
case $PHASE in all|install|smoke) ;; *) echo "PHASE: all, install or smoke (got $PHASE)" >&2; exit 2;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1

py312() {
  if command -v pyenv >/dev/null && pyenv prefix 3.12 >/dev/null 2>&1; then echo "$(pyenv prefix 3.12)/bin/python"
  elif command -v python3.12 >/dev/null; then command -v python3.12
  else echo "no Python 3.12 on this machine (pyenv or python3.12 on PATH)" >&2; return 1; fi
}
quiet_pip() {  # quiet_pip PYTHON ARGS...: without the warnings about this host's local indexes
  local py=$1; shift
  "$py" -m pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
stamp() { echo "[$(( SECONDS ))s] $*"; }
NO_NET=()  # the target's commands run with no network where this host allows a namespace
if unshare -n true 2>/dev/null; then
  NO_NET=(unshare -n sh -c 'ip link set lo up 2>/dev/null || true; exec "$@"' sh)
else
  echo "   (unshare -n is not allowed here: the install runs with --no-index only)"
fi

if [ "$PHASE" != smoke ]; then  # 1-3: the installs
rm -rf "$WORK"
mkdir -p "$WORK"
PY=$(py312)

stamp "0. here: a builder venv with the wheelhouse script's tools (uv, packaging, setuptools)"
"$PY" -m venv "$WORK/builder"
quiet_pip "$WORK/builder/bin/python" "uv>=0.5" "packaging>=24" "setuptools>=70.1"
UV=$WORK/builder/bin/uv

stamp "1. the image: Python 3.12 + jax 0.11.2, flax 0.12.10, optax, orbax-checkpoint, tensorstore, transformers 5.17.0"
"$PY" -m venv "$WORK/image"
IMG=$WORK/image/bin/python
# uv installs it (what pip would, in a fraction of the time); the image's own pip freezes it.
"$UV" pip install --quiet --python "$IMG" "jax==0.11.2" "jaxlib==0.11.2" "flax==0.12.10" optax orbax-checkpoint \
  tensorstore "transformers==5.17.0"
"$IMG" -m pip freeze > "$WORK/image-freeze.txt"
stamp "   $(wc -l < "$WORK/image-freeze.txt") packages in the image"

stamp "2. here: the wheelhouse"
"$WORK/builder/bin/python" scripts/wheelhouse.py --have "$WORK/image-freeze.txt" --python-version 3.12 \
  -o "$WORK/wheels"

stamp "3. the target, without network: one install command, then the smoke run"
cd "$WORK"  # no checkout on sys.path: jaxrl comes from the installed wheel
env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL PIP_CONFIG_FILE=/dev/null \
  "${NO_NET[@]}" "$IMG" -m pip install --quiet --no-index --no-deps "$WORK"/wheels/*.whl
"$IMG" -m pip check
stamp "   installed; jaxrl from $("$IMG" -c 'import jaxrl, os; print(os.path.dirname(jaxrl.__file__))')"
fi
[ "$PHASE" = install ] && { stamp "installed (the smoke run: PHASE smoke)"; exit 0; }
IMG=$WORK/image/bin/python
[ -x "$IMG" ] || { echo "$WORK/image: no install to run the smoke on (run PHASE install first)" >&2; exit 1; }
cd "$WORK"
stamp "4. the smoke run, without network"
# Every check and one measure of each kind (each imports and runs its path in the image; the others
# repeat a path on other settings, and the slow tier's tests/test_devicecheck.py runs them all).
ONLY=logits_vs_transformers,engine_vs_trainer,bf16_loss_grads,kernel_training_attention,kernel_cached_attention
ONLY=$ONLY,kernel_logprobs,logprob_mismatch_int8,train_remat_none,decode,rl_run
env -u XLA_FLAGS JAX_PLATFORMS=cpu "${NO_NET[@]}" timeout -k 10 900 \
  "$IMG" -m jaxrl.devicecheck --smoke --only "$ONLY" --out "$WORK/devicecheck-out" > "$WORK/smoke.log"
cat "$WORK"/devicecheck-out/lines-*.jsonl | "$IMG" -c '
import json, sys
lines = [json.loads(x) for x in sys.stdin if x.strip()]
checks = [x for x in lines if "check" in x]
bad = [x for x in lines if x.get("error") or x.get("timed_out") or ("check" in x and x["ok"] is not True)]
versions = lines[0]["versions"]
print(f"   {len(lines)} lines, {len(checks)} checks passed; versions {versions}")
sys.exit(f"not all measures passed: {bad}" if bad or len(checks) != 6 else 0)'
stamp "rehearsal passed"
