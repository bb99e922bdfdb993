#!/usr/bin/env bash
# The eleventh session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session11.sh survey   # anchor forms (mm vs addmm), workloads 1-4 at bf16 and TF32
#                                         # against Inductor with kernel profiles, and the bias-fold A/B
#   bash benchmarks/session11.sh gemm     # issue 5's GEMM prototype (python -m benchmarks.gemm_probe):
#                                         # workloads 3 and 1-eval chains in registers or in the spare warps
#   bash benchmarks/session11.sh w4       # workload 4 (bf16, TF32) against Inductor, three times in a row
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
W14=(1_linear_bn_gelu_relu 2_linear_logsumexp 3_linear_groupnorm_leaky 4_linear_groupnorm_swish)
case ${1:-survey} in
  survey)
    python3 -m benchmarks.anchor_forms 2>&1 | tee "$OUT/anchor_forms.log"
    python3 -m benchmarks.compare --workloads "${W14[@]}" --precisions bf16 fp32-tf32 --providers inductor fusedepi \
      --profile --json "$OUT/survey.json" 2>&1 | grep -v "^-- " | tee "$OUT/survey.log"
    python3 -m benchmarks.fold_ab --workloads "${W14[@]:1}" --precisions bf16 --providers inductor fusedepi \
      --profile --json "$OUT/fold_ab.json" 2>&1 | grep -v "^-- " | tee "$OUT/fold_ab.log"
    ;;
  w4)
    for run in 1 2 3; do
      python3 -m benchmarks.compare --workloads 4_linear_groupnorm_swish --precisions bf16 fp32-tf32 \
        --providers inductor fusedepi --profile 2>&1 | grep -v "^-- " | tee "$OUT/w4_$run.log"
    done
    ;;
  gemm)
    # A wrong barrier protocol hangs rather than fails: bound it.
    FUSEDEPI_CACHE_DIR=/tmp/fusedepi-cache timeout ${PROBE_TIMEOUT:-300} python3 -m benchmarks.gemm_probe 2>&1 \
      | grep -v Warning | tee "$OUT/gemm_probe.log"
    ;;
esac
