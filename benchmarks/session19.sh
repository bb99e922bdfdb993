#!/usr/bin/env bash
# The nineteenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session19.sh check   # the channels-last tests (GPU tier and launchers), then the benchmark's
#                                        # models $PICK (default: 4 26 34 50) one by one
#   bash benchmarks/session19.sh bench   # $BENCH random fused models against Inductor, --profile (per-kernel times)
#   bash benchmarks/session19.sh ncu     # Nsight Compute on model $PICK's apply kernel (ours, then Inductor's, the
#                                        # kernel names matching $OURS and $THEIRS)
#   bash benchmarks/session19.sh tests   # tests/test_gpu.py -k "$TESTS_K"
#   bash benchmarks/session19.sh fuzz    # the GPU fuzzer: $MODELS models of seed $SEED, with --grad when GRAD=1
source "$(dirname "$0")/device_setup.sh"
PICK=${PICK:-4 26 34 50}
case ${1:-bench} in
  check)
    timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu tests/test_native.py tests/test_gpu.py -p no:cacheprovider \
      -rfs --tb=short -k "${TESTS_K:-channels_last}" 2>&1 | tee "$OUT/check_tests.log" | tail -30
    pick_models
    ;;
  bench)
    timeout ${BENCH_TIMEOUT:-560} python3 tests/fuzzer.py --bench ${BENCH:-50} --seed ${SEED:-0} --profile \
      --json "$OUT/fuzzbench.json" 2>&1 | grep -v -i warn | tee "$OUT/fuzzbench.log" | tail -${TAIL:-40}
    ;;
  models) pick_models ;;
  ncu)
    for who in "${OURS:-_apply}" "${THEIRS:-triton_poi_fused__native}"; do
      timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k "regex:$who" --launch-skip 3 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        python3 tests/fuzzer.py --bench 1 --first ${PICK:-50} --seed ${SEED:-0} 2>&1 | grep -v -i warn \
        | grep -v "^\[bench\]" | tee -a "$OUT/ncu${PICK:-50}.log" | grep -E "^  [a-zA-Z_(]|Duration|Throughput|Registers|Achieved Occ|Theoretical Occ|Block Size|Issued Ipc|Executed Ipc|Stall|Shared Memory Config|One or More|L1/TEX Hit|L2 Hit" | head -40
    done
    ;;
  tests) gpu_tests_k ;;
  fuzz) fuzz_random ;;
esac
