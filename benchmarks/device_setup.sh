# Sourced by the session scripts (benchmarks/session12.sh, session13.sh) on the device
# machine: install the working tree, name the GPU, and the workload/test lists they use.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
export FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
W14=(1_linear_bn_gelu_relu 2_linear_logsumexp 3_linear_groupnorm_leaky 4_linear_groupnorm_swish)
TESTS=(tests/test_gpu.py tests/test_gpu_production.py tests/test_training.py tests/test_multi_gpu.py)

# The whole GPU test tier (about 8.5 minutes on a warm H200).
gpu_tier() {
  timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q -m gpu "${TESTS[@]}" -p no:cacheprovider -rs 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -40
}

# benchmarks.compare on workloads 1-4 at bf16, Inductor against fusedepi.
bench_w14_bf16() {
  timeout ${BENCH_TIMEOUT:-560} python3 -m benchmarks.compare --workloads "${W14[@]}" --precisions bf16 \
    --providers inductor fusedepi --profile --json "$OUT/bench.json" 2>&1 | grep -v "^-- " | tee "$OUT/bench.log"
}

# tests/test_gpu.py with -k "$TESTS_K" (the tier's longest file).
gpu_tests_k() {
  timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q -m gpu tests/test_gpu.py -k "${TESTS_K:-not nothing}" \
    -p no:cacheprovider -rfs --tb=short 2>&1 | tee "$OUT/gpu_tests.log" | tail -30
}

# The tier's other files.
gpu_rest() {
  timeout 330 python3 -m pytest -q -m gpu tests/test_gpu_production.py tests/test_training.py tests/test_multi_gpu.py \
    -p no:cacheprovider -rfs --tb=short 2>&1 | tee "$OUT/gpu_rest.log" | tail -25
}

# The GPU fuzzer on the in-kernel GEMM's shapes (FUSEDEPI_IN_KERNEL_GEMM=1), $MODELS models.
fuzz_gemm() {
  timeout ${FUZZ_TIMEOUT:-500} python3 tests/fuzzer.py --device cuda --in-kernel-gemm --models ${MODELS:-400} \
    --workers 14 --time-limit ${FUZZ_LIMIT:-420} --json "$OUT/fuzz_gemm.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/fuzz_gemm.log" | tail -45
}

# The GPU fuzzer: $MODELS models of seed $SEED, with --grad when GRAD=1.
fuzz_random() {
  local g=(); [ "${GRAD:-0}" = 1 ] && g=(--grad)
  timeout ${FUZZ_TIMEOUT:-500} python3 tests/fuzzer.py --device cuda --models ${MODELS:-400} --seed ${SEED:-0} \
    "${g[@]}" --workers 14 --time-limit ${FUZZ_LIMIT:-420} --json "$OUT/fuzz.json" 2>&1 | grep -v -i warn \
    | grep -v "^\[fuzz\] [0-9]" | tee "$OUT/fuzz.log" | tail -40
}

# The fuzzer benchmark's models $PICK one by one, with each one's kernels profiled.
pick_models() {
  for i in $PICK; do
    timeout ${MODEL_TIMEOUT:-100} python3 tests/fuzzer.py --bench 1 --first "$i" --seed ${SEED:-0} --profile \
      --json "$OUT/model$i.json" 2>&1 | grep -v -i warn | grep -E "^\[bench\]|^    (fusedepi|inductor)"
  done
}
