#!/usr/bin/env bash
# The twelfth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session12.sh gemm    # the in-kernel GEMM's GPU tests, then benchmarks.gemm_probe (bf16)
#   bash benchmarks/session12.sh probe   # benchmarks.gemm_probe with FUSEDEPI_IN_KERNEL_GEMM=1, then without
#   bash benchmarks/session12.sh tests   # the whole GPU test tier
#   bash benchmarks/session12.sh bench   # benchmarks.compare: workloads 1-4 at bf16, Inductor vs fusedepi
source "$(dirname "$0")/device_setup.sh"
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
  tests) gpu_tier ;;
  bench) bench_w14_bf16 ;;
esac
