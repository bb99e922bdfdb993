#!/usr/bin/env bash
# The seventeenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session17.sh fuzzprof   # $BENCH random fused models against Inductor, with each model's
#                                           # GPU time, launches and CPU time a call per backend (--profile)
#   bash benchmarks/session17.sh probe      # benchmarks.gemm_align_probe (library GEMM forms at misaligned K), then fuzzprof
#   bash benchmarks/session17.sh pad        # GPU tests -k "$TESTS_K" (default: the padded library GEMM's)
#   bash benchmarks/session17.sh padbench   # the same, then fuzzprof
#   bash benchmarks/session17.sh tests      # tests/test_gpu.py -k "$TESTS_K"
#   bash benchmarks/session17.sh rest       # the tier's other files
#   bash benchmarks/session17.sh fuzz       # the GPU fuzzer: $MODELS models of seed $SEED, with --grad when GRAD=1
source "$(dirname "$0")/device_setup.sh"
case ${1:-fuzzprof} in
  probe|fuzzprof)
    [ "$1" = probe ] && timeout 200 python3 -m benchmarks.gemm_align_probe 2>&1 | tee "$OUT/probe.log"
    timeout ${BENCH_TIMEOUT:-560} python3 tests/fuzzer.py --bench ${BENCH:-50} --seed ${SEED:-0} --profile \
      --json "$OUT/fuzzbench.json" 2>&1 | grep -v -i warn | tee "$OUT/fuzzbench.log" | tail -${TAIL:-40}
    ;;
  pad|padbench)
    timeout ${TEST_TIMEOUT:-170} python3 -m pytest -v -m gpu tests/test_native.py tests/test_gpu.py -p no:cacheprovider \
      -rfs --tb=short -k "${TESTS_K:-padded}" 2>&1 | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed|Error|assert" \
      | tee "$OUT/pad_tests.log" | tail -40
    if [ "$1" = padbench ]; then timeout ${BENCH_TIMEOUT:-400} python3 tests/fuzzer.py --bench ${BENCH:-50} --seed 0 \
      --profile --json "$OUT/fuzzbench.json" 2>&1 | grep -v -i warn | tee "$OUT/fuzzbench.log" | tail -${TAIL:-40}; fi
    ;;
  tests) gpu_tests_k ;;
  rest) gpu_rest ;;
  fuzz) fuzz_random ;;
esac
