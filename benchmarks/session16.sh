#!/usr/bin/env bash
# The sixteenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session16.sh native     # the C++ launcher: build + load (timed), its GPU tests, then
#                                           # benchmarks.call_profile (Inductor, Python launcher, C++ launcher)
#   bash benchmarks/session16.sh tests      # tests/test_gpu.py -k "$TESTS_K"
#   bash benchmarks/session16.sh rest       # the tier's other files
#   bash benchmarks/session16.sh fuzz       # the GPU fuzzer: $MODELS models of seed $SEED, with --grad when GRAD=1
#   bash benchmarks/session16.sh fuzzgemm   # the GPU fuzzer on the in-kernel GEMM's shapes
#   bash benchmarks/session16.sh fuzzbench  # $BENCH random fused models against Inductor (default mode)
source "$(dirname "$0")/device_setup.sh"
case ${1:-native} in
  native)
    FUSEDEPI_LOG_LEVEL=INFO timeout 300 python3 - <<'PY' 2>&1 | grep -v -i "warn" | tail -8
import time, torch
from fusion_backend import fusedepi, ops
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()).cuda()
x = torch.rand(64, 256, device="cuda")
start = time.perf_counter()
with torch.no_grad():
    torch.compile(model, backend=fusedepi)(x)
print(f"first compile and call: {time.perf_counter() - start:.1f} s; fused op served by: {ops.native_launcher()}")
PY
    timeout 300 python3 -m pytest -q -m gpu tests/test_native.py -p no:cacheprovider -rfs --tb=short 2>&1 \
      | tee "$OUT/native_tests.log" | tail -15
    timeout 200 python3 -m benchmarks.call_profile --top 25 2>&1 | grep -v -i warn | tee "$OUT/callprof.log" | head -45
    ;;
  tests) gpu_tests_k ;;
  rest) gpu_rest ;;
  fuzz) fuzz_random ;;
  fuzzgemm) fuzz_gemm ;;
  fuzzbench)
    timeout ${BENCH_TIMEOUT:-560} python3 tests/fuzzer.py --bench ${BENCH:-50} --seed ${SEED:-0} \
      --json "$OUT/fuzzbench.json" 2>&1 | grep -v -i warn | tee "$OUT/fuzzbench.log" | tail -30
    ;;
esac
