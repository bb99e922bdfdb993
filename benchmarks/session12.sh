#!/usr/bin/env bash
# The twelfth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session12.sh gemm    # the in-kernel GEMM's GPU tests, then benchmarks.gemm_probe (bf16)
#   bash benchmarks/session12.sh probe   # benchmarks.gemm_probe with FUSEDEPI_IN_KERNEL_GEMM=1, then without
#   bash benchmarks/session12.sh tests   # the whole GPU test tier
#   bash benchmarks/session12.sh bench   # benchmarks.compare: workloads 1-4 at bf16, Inductor vs fusedepi
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
export FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
W14=(1_linear_bn_gelu_relu 2_linear_logsumexp 3_linear_groupnorm_leaky 4_linear_groupnorm_swish)
TESTS=(tests/test_gpu.py tests/test_gpu_production.py tests/test_training.py tests/test_multi_gpu.py)
case ${1:-gemm} in
  gemm)
    # A wrong barrier protocol hangs rather than fails: bound everything.
    export FUSEDEPI_IN_KERNEL_GEMM=1
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_gpu.py -k "gemm" -x -p no:cacheprovider -rs \
      2>&1 | tee "$OUT/gemm_tests.log" | tail -30
    timeout ${PROBE_TIMEOUT:-240} python3 -m benchmarks.gemm_probe ${PROBE_ARGS:-} 2>&1 | grep -v Warning \
      | tee "$OUT/gemm_probe.log"
    ;;
  probe)  # the probe alone, with the in-kernel GEMM (FUSEDEPI_IN_KERNEL_GEMM=1) and without it
    FUSEDEPI_IN_KERNEL_GEMM=1 timeout 200 python3 -m benchmarks.gemm_probe ${PROBE_ARGS:-} 2>&1 | grep -v Warning \
      | tee "$OUT/probe_in_kernel.log"
    timeout 200 python3 -m benchmarks.gemm_probe ${PROBE_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/probe_library.log"
    ;;
  tests)
    timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q -m gpu "${TESTS[@]}" -p no:cacheprovider -rs 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -40
    ;;
  bench)
    timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.compare --workloads "${W14[@]}" --precisions bf16 \
      --providers inductor fusedepi --profile --json "$OUT/bench.json" 2>&1 | grep -v "^-- " | tee "$OUT/bench.log"
    ;;
esac
