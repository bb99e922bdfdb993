#!/usr/bin/env bash
# The sixth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session6.sh tests   # GPU tier + the graph-cache test on the device's torch
#   bash benchmarks/session6.sh bench   # conv BatchNorm workload; warm starts of 3 and 5
#   bash benchmarks/session6.sh prof6   # workload 6 kernel by kernel
#   bash benchmarks/session6.sh unrun   # what this session could not run: the InstanceNorm GPU
#                                       # tests, then the forward fuzzer on the final code (< 600 s)
set -uo pipefail
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
case ${1:-tests} in
  tests)
    bash benchmarks/device_run.sh tests
    s=$?
    python3 -m pytest -q tests/test_compile_modes.py -k graph_cache -p no:cacheprovider 2>&1 | tail -3
    exit $s ;;
  bench)
    bash benchmarks/device_run.sh bench --workloads 6_conv_bn_relu --precisions fp32-tf32 bf16 \
      --providers inductor fusedepi
    python3 -m benchmarks.compare --workloads 3_linear_groupnorm_leaky 5_conv_groupnorm --precisions bf16 \
      --modes train --providers inductor fusedepi --warm-start --json "$OUT/warm.json" 2>&1 | grep -v "^-- " | tee "$OUT/warm.log"
    python3 -m benchmarks.warm_profile 3_linear_groupnorm_leaky bf16 fusedepi --top 40 2>&1 | tee "$OUT/warmprof.log" | head -60
    ;;
  unrun)
    bash benchmarks/device_run.sh tests -k "instancenorm or instance_norm" 2>&1 | tail -8
    bash benchmarks/device_run.sh fuzz 1200 0 16 240 0 2 2>&1 | tail -30  # generation 2: with InstanceNorm
    ;;
  prof6)  # where workload 6's time goes, kernel by kernel
    bash benchmarks/device_run.sh bench --workloads 6_conv_bn_relu --precisions bf16 fp32-tf32 \
      --providers inductor fusedepi --profile
    ;;
esac
