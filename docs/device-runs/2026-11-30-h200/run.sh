#!/bin/bash
# One device call: install the wheelhouse's missing packages, then the device check in two passes (priority first).
set -o pipefail; export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/devout}; mkdir -p $OUT
PY=${PY:-python3}
T0=$(date +%s)
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
[ -n "$NOINSTALL" ] || $PY -m pip install -q --no-index --find-links wheels "$(ls wheels/jaxrl-*.whl)[cuda]" 2>&1 | tail -5 \
  || [ -n "$NOINSTALL" ] || $PY -m pip install -q --no-index --no-deps wheels/*.whl 2>&1 | tail -5
$PY -m pip check 2>&1 | tail -5
$PY -c "import jax, jaxrl; print(jax.__version__, jax.devices(), jaxrl.__file__)"
echo "install took $(( $(date +%s) - T0 )) s"
} 2>&1 | tee $OUT/install.log
DC=/tmp/dc
P1=logits_vs_transformers,engine_vs_trainer,bf16_loss_grads,kernel_training_attention,kernel_cached_attention,kernel_logprobs,logprob_mismatch_bf16,train_remat_full,decode
P2=rl_run,train_remat_none,logprob_mismatch_int8,decode_quantized,train_remat_dots,logprob_mismatch_fp8
B1=${B1:-300}; B2=${B2:-190}
timeout -k 15 $((B1+20)) $PY -m jaxrl.devicecheck --out $DC --budget-s $B1 --only $P1 $SMOKE 2>&1 | tee $OUT/pass1.log
timeout 60 $PY wheels/hostlink.py 2>&1 | tee $OUT/hostlink.log
LEFT=$(( ${TOTAL:-560} - ($(date +%s) - T0) ))
echo "pass 2 budget $LEFT s"
timeout -k 15 $((LEFT-5)) $PY -m jaxrl.devicecheck --out $DC --budget-s $((LEFT-25)) --only $P2 $SMOKE 2>&1 | tee $OUT/pass2.log
cp $DC/lines-*.jsonl $OUT/ 2>/dev/null
ls $OUT
