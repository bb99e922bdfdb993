#!/usr/bin/env bash
# The fifteenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session15.sh tf32    # the in-kernel GEMM's GPU tests (float32/TF32 among them), then
#                                        # benchmarks.gemm_probe --dtype tf32 on $PROBE_CASES with FUSEDEPI_IN_KERNEL_GEMM=1
#   bash benchmarks/session15.sh probe   # benchmarks.gemm_probe --dtype tf32 with $SETTINGS (default: 0, auto)
#   bash benchmarks/session15.sh compare # benchmarks.compare, workloads 1-4 at $PRECISIONS, Inductor and fusedepi
#   bash benchmarks/session15.sh tests   # tests/test_gpu.py -k "$TESTS_K"
#   bash benchmarks/session15.sh rest    # the tier's other files
#   bash benchmarks/session15.sh fuzz    # the GPU fuzzer on the in-kernel GEMM's shapes (a third float32 in TF32)
#   bash benchmarks/session15.sh hang    # the same with a time limit, then the first $ALONE (6) unfinished models alone (timeout 45 s)
source "$(dirname "$0")/device_setup.sh"
CASES=(${PROBE_CASES:-w2 w3 w4})
case ${1:-tf32} in
  tf32)
    # A wrong barrier protocol hangs rather than fails: bound everything.
    timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu tests/test_gpu.py -k "${TESTS_K:-gemm or row_reductions}" \
      -p no:cacheprovider -rfs --tb=short 2>&1 | tee "$OUT/gemm_tests.log" | tail -30
    FUSEDEPI_IN_KERNEL_GEMM=1 timeout ${PROBE_TIMEOUT:-220} python3 -m benchmarks.gemm_probe --dtype tf32 \
      --cases "${CASES[@]}" 2>&1 | grep -v Warning | tee "$OUT/probe_1.log"
    ;;
  probe)
    for setting in ${SETTINGS:-0 auto}; do
      FUSEDEPI_IN_KERNEL_GEMM=$setting timeout ${PROBE_TIMEOUT:-200} python3 -m benchmarks.gemm_probe \
        --dtype ${PROBE_DTYPE:-tf32} --cases "${CASES[@]}" 2>&1 | grep -v Warning | tee "$OUT/probe_$setting.log"
    done
    ;;
  compare)
    timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.compare --workloads "${W14[@]}" \
      --precisions ${PRECISIONS:-fp32-tf32} --providers inductor fusedepi --profile --json "$OUT/bench.json" 2>&1 \
      | grep -v "^-- " | tee "$OUT/bench.log"
    ;;
  tests) gpu_tests_k ;;
  fuzz) fuzz_gemm ;;
  hang)
    timeout 300 python3 tests/fuzzer.py --device cuda --in-kernel-gemm --models ${MODELS:-400} --workers 14 \
      --time-limit ${FUZZ_LIMIT:-200} --json "$OUT/fuzz_gemm.json" 2>&1 | grep -v -i warn | tee "$OUT/fuzz_gemm.log" \
      | grep -v "^\[fuzz\] [0-9]" | tail -12
    left=$(grep -o "unfinished (running or not started): \[[0-9, ]*\]" "$OUT/fuzz_gemm.log" | grep -o "[0-9][0-9, ]*" | tr -d ,)
    for i in $(echo $left | tr ' ' '\n' | head -${ALONE:-6}); do
      timeout ${ALONE_TIMEOUT:-45} python3 tests/fuzzer.py --device cuda --in-kernel-gemm --only $i 2>&1 | grep -v -i warn \
        > "$OUT/only_$i.log"; rc=$?
      echo "model $i: rc $rc $(head -c 600 "$OUT/only_$i.log" | head -1)"
    done
    ;;
  rest) gpu_rest ;;
esac
