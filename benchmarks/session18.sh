#!/usr/bin/env bash
# The eighteenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session18.sh check   # GPU tests -k "$TESTS_K" (default: awkward shapes, padded GEMMs, the
#                                        # fuzz regressions) + test_native.py, then the GPU fuzzer ($MODELS models)
#   bash benchmarks/session18.sh bench   # $BENCH random fused models against Inductor, --profile (per-kernel times)
#   bash benchmarks/session18.sh models  # the benchmark's models $PICK (default: 5 10 32) one by one, then check's tests
#   bash benchmarks/session18.sh tests   # tests/test_gpu.py -k "$TESTS_K"
#   bash benchmarks/session18.sh fuzz    # the GPU fuzzer: $MODELS models of seed $SEED, with --grad when GRAD=1
source "$(dirname "$0")/device_setup.sh"
check_tests() {
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_native.py tests/test_gpu.py -p no:cacheprovider \
    -rfs --tb=short -k "${TESTS_K:-native or awkward or padded or fuzz_regressions}" 2>&1 \
    | tee "$OUT/check_tests.log" | tail -30
}
case ${1:-bench} in
  check)
    check_tests
    MODELS=${MODELS:-300} FUZZ_TIMEOUT=${FUZZ_TIMEOUT:-250} FUZZ_LIMIT=${FUZZ_LIMIT:-200} fuzz_random
    ;;
  bench)
    timeout ${BENCH_TIMEOUT:-560} python3 tests/fuzzer.py --bench ${BENCH:-50} --seed ${SEED:-0} --profile \
      --json "$OUT/fuzzbench.json" 2>&1 | grep -v -i warn | tee "$OUT/fuzzbench.log" | tail -${TAIL:-40}
    ;;
  models)
    for i in ${PICK:-5 10 32}; do
      timeout 120 python3 tests/fuzzer.py --bench 1 --first "$i" --seed ${SEED:-0} --profile \
        --json "$OUT/model$i.json" 2>&1 | grep -v -i warn | grep -E "^\[bench\]|^    (fusedepi|inductor)"
    done
    TEST_TIMEOUT=${TEST_TIMEOUT:-420} check_tests
    ;;
  tests) gpu_tests_k ;;
  fuzz) fuzz_random ;;
esac
