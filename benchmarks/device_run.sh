#!/usr/bin/env bash
# Everything one device-machine call does: install, GPU tests, benchmark.
#   bash benchmarks/device_run.sh tests          # GPU test tier (WORKERS=8 for 8 pytest-xdist processes)
#   bash benchmarks/device_run.sh tests --shard 1/2   # its first half (every 2nd test), for calls of 10 minutes
#   bash benchmarks/device_run.sh quick          # tests + benchmark --quick
#   bash benchmarks/device_run.sh bench [args]   # benchmark only, args passed on
#   bash benchmarks/device_run.sh all [args]     # GPU test tier, then the benchmark with args
#   bash benchmarks/device_run.sh ncu SKIP COUNT NAME PRECISION [--eval]  # ncu on fusedepi's kernels (a workload or zoo model)
#   bash benchmarks/device_run.sh fuzz MODELS FIRST WORKERS SECONDS [SEED [GENERATION]]  # GPU differential fuzzer
#   bash benchmarks/device_run.sh fuzzgrad MODELS FIRST WORKERS SECONDS [SEED [GENERATION]]  # the same with backward
#   bash benchmarks/device_run.sh backward [args]                            # training-step benchmark
#   bash benchmarks/device_run.sh fuzzbench N SEED [MODE]                    # N fused random models vs Inductor
#   bash benchmarks/device_run.sh zoo [args]                                 # benchmarks.zoo, args passed on
#     (on a kind of several GPUs: zoo --gpus N --warm M, one timed process a GPU; ZOO_TIMEOUT bounds it all)
#   bash benchmarks/device_run.sh variants [args]                            # benchmarks.kernel_variants, args passed on
#   bash benchmarks/device_run.sh compile MODEL... [--dtypes ...]            # benchmarks.compile_time: cold, then warm
#   bash benchmarks/device_run.sh wall NAME PRECISION [--plan ...]           # benchmarks.once --wall: wall ms a call, both backends, and a cProfile
# FUSEDEPI_TEST_CONV_PLAN="NAME=VALUE ..." sets cuda_templates.conv_sm90's constants for tests
# and fuzz (tests/conv_plan.py): e.g. a switch still off, checked before it is switched on.
# The benchmark makes fresh kernel and Inductor caches of its own, so its compile times are cold.
# Logs and JSON go to $OUT (the device tool's output folder) or /tmp/fusedepi-out.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
what=${1:-tests}
shift || true
# No network there: install without build isolation, against the torch already present.
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
status=0
if [ "$what" = tests ] || [ "$what" = quick ] || [ "$what" = all ]; then
  [ "$what" = all ] && targs=() || targs=("$@")
  # WORKERS=N runs the tier in N pytest-xdist processes (kernel builds share a locked cache);
  # by default one process (pyproject's addopts would take one a core).
  targs=(-n "${WORKERS:-0}" "${targs[@]}")
  # -v: each test's outcome in gpu_tests.log as it ends, so that a run its time limit cuts
  # short still says which failed (the failures' text comes only at the end).
  FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache} python3 -m pytest -v -m gpu tests/test_gpu.py tests/test_gpu_production.py tests/test_training.py tests/test_multi_gpu.py tests/test_native.py -p no:cacheprovider -rs "${targs[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | grep -v -E " PASSED | SKIPPED |^DEBUG" | tail -40
  status=${PIPESTATUS[0]}
fi
if [ "$what" = quick ]; then
  python3 -m benchmarks.compare --quick --json "$OUT/bench_quick.json" 2>&1 | tee "$OUT/bench_quick.log" | grep -v "^-- "
fi
if [ "$what" = ncu ]; then
  skip=$1 count=$2; shift 2
  log="$OUT/ncu_$(echo "$*" | tr ' ' '_' | tr -d '-').log"
  /usr/local/cuda/bin/ncu --kernel-name regex:_sm[0-9]+a?_ --launch-skip "$skip" --launch-count "$count" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis --section WarpStateStats python3 -m benchmarks.once "$@" >"$log" 2>&1 || status=1
  grep -E "_sm[0-9]+a?_|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Grid Size|Block Size|Stall|Issue Slots Busy|Waves Per SM" "$log" | grep -v "^==PROF==" | head -80
fi
if [ "$what" = fuzz ] || [ "$what" = fuzzgrad ]; then
  models=$1 first=$2 workers=$3 limit=$4 seed=${5:-0} generation=${6:-1}
  gargs=(); [ "$what" = fuzzgrad ] && gargs=(--grad)
  # FUZZ_ARGS: more fuzzer flags, e.g. FUZZ_ARGS=--in-kernel-conv (or --in-kernel-gemm)
  read -r -a extra <<<"${FUZZ_ARGS:-}"; gargs+=("${extra[@]}")
  FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache} python3 tests/fuzzer.py --device cuda \
    --models "$models" --first "$first" --workers "$workers" --seed "$seed" --time-limit "$limit" "${gargs[@]}" \
    --generation "$generation" \
    --json "$OUT/${what}_${seed}_${first}_${models}.json" 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/${what}_${seed}_${first}.log" | tail -60
  status=${PIPESTATUS[0]}
fi
if [ "$what" = backward ]; then
  python3 -m benchmarks.compare --backward --json "$OUT/backward.json" "$@" 2>&1 | tee "$OUT/backward.log" | grep -v "^-- "
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
if [ "$what" = fuzzbench ]; then
  mode=${3:-default}
  margs=(); [ "$mode" = default ] || margs=(--mode "$mode")
  FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache} python3 tests/fuzzer.py --bench "$1" --seed "$2" \
    "${margs[@]}" --json "$OUT/fuzzbench_$2_$1_$mode.json" 2>&1 | grep --line-buffered -v -i warn | tee "$OUT/fuzzbench_$mode.log" | tail -70
  status=${PIPESTATUS[0]}
fi
if [ "$what" = zoo ]; then
  FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache} timeout ${ZOO_TIMEOUT:-560} python3 -m benchmarks.zoo \
    "$@" 2>&1 | grep --line-buffered -v -i warn | tee -a "$OUT/zoo.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = variants ]; then
  FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache} python3 -m benchmarks.kernel_variants "$@" 2>&1 \
    | grep --line-buffered -v -i warn | tee -a "$OUT/variants.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = compile ]; then
  python3 -m benchmarks.compile_time "$@" --json "$OUT/compile_time.json" 2>&1 | grep --line-buffered -v -i warn \
    | tee -a "$OUT/compile_time.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = wall ]; then
  FUSEDEPI_CACHE_DIR=${FUSEDEPI_CACHE_DIR:-/tmp/fusedepi-cache} python3 -m benchmarks.once "$@" --wall 2>&1 \
    | grep --line-buffered -v -i warn | tee -a "$OUT/wall.log"
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python3 -m benchmarks.compare --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^-- "
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
fi
exit $status
