#!/usr/bin/env bash
# The twentieth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session20.sh check   # GPU tests -k "$TESTS_K" (the changed kernels), then the benchmark's
#                                        # models $PICK one by one, with per-kernel times
#   bash benchmarks/session20.sh bench   # $BENCH random fused models against Inductor, --profile
#   bash benchmarks/session20.sh models  # just the models $PICK
#   bash benchmarks/session20.sh tests   # tests/test_gpu.py -k "$TESTS_K"
source "$(dirname "$0")/device_setup.sh"
PICK=${PICK:-23 37 40 12}
case ${1:-check} in
  check)
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider -rfs --tb=short \
      -k "${TESTS_K:-narrow_batchnorm or hard_activations or batchnorm or awkward or fuzz}" 2>&1 \
      | tee "$OUT/check_tests.log" | tail -30
    pick_models
    ;;
  bench)
    timeout ${BENCH_TIMEOUT:-560} python3 tests/fuzzer.py --bench ${BENCH:-50} --seed ${SEED:-0} --profile \
      --json "$OUT/fuzzbench.json" 2>&1 | grep -v -i warn | tee "$OUT/fuzzbench.log" | tail -${TAIL:-40}
    ;;
  models) pick_models ;;
  tests) gpu_tests_k ;;
esac
