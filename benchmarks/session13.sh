#!/usr/bin/env bash
# The thirteenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session13.sh gemm    # the in-kernel GEMM's GPU tests, then benchmarks.gemm_probe on
#                                        # $PROBE_CASES with FUSEDEPI_IN_KERNEL_GEMM=1 and =0
#   bash benchmarks/session13.sh tests   # the whole GPU test tier
#   bash benchmarks/session13.sh bench   # benchmarks.compare: workloads 1-4 at bf16, Inductor vs fusedepi
#   bash benchmarks/session13.sh rest    # the GEMM tests and the tier's files after tests/test_gpu.py
#   bash benchmarks/session13.sh final   # compare on workloads 1 and 3 (bf16), the probe with the default
source "$(dirname "$0")/device_setup.sh"
CASES=(${PROBE_CASES:-w1_eval w1_eval_1024})
case ${1:-gemm} in
  gemm)
    # A wrong barrier protocol hangs rather than fails: bound everything.
    FUSEDEPI_IN_KERNEL_GEMM=1 timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_gpu.py -k "gemm" \
      -p no:cacheprovider -rs 2>&1 | tee "$OUT/gemm_tests.log" | tail -30
    FUSEDEPI_IN_KERNEL_GEMM=1 timeout ${PROBE_TIMEOUT:-170} python3 -m benchmarks.gemm_probe --cases "${CASES[@]}" \
      2>&1 | grep -v Warning | tee "$OUT/probe_in_kernel.log"
    FUSEDEPI_IN_KERNEL_GEMM=0 timeout ${PROBE_TIMEOUT:-170} python3 -m benchmarks.gemm_probe --cases "${CASES[@]}" 2>&1 | grep -v Warning \
      | tee "$OUT/probe_library.log"
    ;;
  tests) gpu_tier ;;
  bench) bench_w14_bf16 ;;
esac
# (appended) the GEMM tests and the tier's last files, after a fix of the tier's one failure;
# the benchmark of workloads 1 and 3 at bf16 with the default (auto), and the probe with it
case ${1:-} in
  final)
    timeout 330 python3 -m benchmarks.compare --workloads 1_linear_bn_gelu_relu 3_linear_groupnorm_leaky \
      --precisions bf16 --providers inductor fusedepi --json "$OUT/bench.json" 2>&1 | grep -v "^-- " \
      | tee "$OUT/bench.log"
    timeout 200 python3 -m benchmarks.gemm_probe --cases w1_eval w1_eval_1024 2>&1 | grep -v Warning \
      | tee "$OUT/probe_auto.log"
    ;;
  rest)
    timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -k "gemm" -p no:cacheprovider -rfs --tb=short 2>&1 \
      | tee "$OUT/gpu_gemm.log" | tail -25
    timeout 330 python3 -m pytest -q -m gpu tests/test_gpu_production.py tests/test_training.py tests/test_multi_gpu.py \
      -p no:cacheprovider -rfs --tb=short 2>&1 | tee "$OUT/gpu_rest.log" | tail -25
    ;;
esac
