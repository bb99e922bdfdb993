#!/usr/bin/env bash
# The fourteenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session14.sh gemm    # the in-kernel GEMM's GPU tests (row reductions among them), then
#                                        # benchmarks.gemm_probe on $PROBE_CASES with FUSEDEPI_IN_KERNEL_GEMM=1 and =0
#   bash benchmarks/session14.sh final   # benchmarks.compare on workload 2 (bf16), the probe with the default
#   bash benchmarks/session14.sh check   # the GEMM tests, then benchmarks.compare on workload 2 (bf16)
#   bash benchmarks/session14.sh tests   # tests/test_gpu.py (the tier's longest file), -k "$TESTS_K"
#   bash benchmarks/session14.sh rest    # the tier's other files
#   bash benchmarks/session14.sh fuzz    # the GPU fuzzer on the in-kernel GEMM's shapes (FUSEDEPI_IN_KERNEL_GEMM=1)
source "$(dirname "$0")/device_setup.sh"
CASES=(${PROBE_CASES:-w2 w1_eval_1024})
case ${1:-gemm} in
  gemm)
    # A wrong barrier protocol hangs rather than fails: bound everything.
    timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -m gpu tests/test_gpu.py -k "gemm or row_reductions" \
      -p no:cacheprovider -rfs --tb=short 2>&1 | tee "$OUT/gemm_tests.log" | tail -30
    for setting in 1 0; do
      FUSEDEPI_IN_KERNEL_GEMM=$setting timeout ${PROBE_TIMEOUT:-150} python3 -m benchmarks.gemm_probe \
        --cases "${CASES[@]}" 2>&1 | grep -v Warning | tee "$OUT/probe_$setting.log"
    done
    ;;
  final)
    timeout 100 python3 -m pytest -q -m gpu tests/test_gpu.py -k "leaky_amax" -p no:cacheprovider -rfs --tb=short \
      2>&1 | tail -3
    timeout 200 python3 -m benchmarks.compare --workloads 2_linear_logsumexp --precisions bf16 \
      --providers inductor fusedepi --profile --json "$OUT/bench.json" 2>&1 | grep -v "^-- " | tee "$OUT/bench.log"
    # the library path (cuBLAS, then the epilogue kernel), its kernels
    FUSEDEPI_IN_KERNEL_GEMM=0 timeout 150 python3 -m benchmarks.compare --workloads 2_linear_logsumexp \
      --precisions bf16 --providers fusedepi --profile 2>&1 | grep -v "^-- " | tee "$OUT/bench_library.log"
    timeout 200 python3 -m benchmarks.gemm_probe --cases w2 2>&1 | grep -v Warning | tee "$OUT/probe_auto.log"
    timeout 150 python3 -m benchmarks.gemm_probe --cases w2 --dtype float16 2>&1 | grep -v Warning \
      | tee "$OUT/probe_auto_fp16.log"
    ;;
  check)  # the GEMM tests, then workload 2 against Inductor
    timeout 240 python3 -m pytest -q -m gpu tests/test_gpu.py -k "gemm or row_reductions" \
      -p no:cacheprovider -rfs --tb=short 2>&1 | tee "$OUT/gemm_tests.log" | tail -8
    timeout 200 python3 -m benchmarks.compare --workloads 2_linear_logsumexp --precisions bf16 \
      --providers inductor fusedepi --profile --json "$OUT/bench.json" 2>&1 | grep -v "^-- " | tee "$OUT/bench.log"
    ;;
  tests) gpu_tests_k ;;
  fuzz) fuzz_gemm ;;
  rest) gpu_rest ;;
esac
