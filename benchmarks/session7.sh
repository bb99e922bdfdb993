#!/usr/bin/env bash
# The seventh session's device calls (kept so that RESULTS.md's numbers can be rerun).
# (Kernel names as of that session: the eighth session renamed the mma kernels to *_twophase / *_onephase.)
#   bash benchmarks/session7.sh profile   # the sixth session's unrun GPU tests and fuzz (generation 2),
#                                         # then ncu (full set) on workload 5's kernels, bf16 and float32
#   bash benchmarks/session7.sh w5        # the GPU tests of convs and sigmoids, then workload 5 against Inductor
set -uo pipefail
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
NCU=/usr/local/cuda/bin/ncu
ncu_w5() {  # precision: full ncu report of one call's three kernels, as text pages
  local p=$1
  FUSEDEPI_CACHE_DIR=/tmp/fusedepi-cache $NCU --kernel-name regex:_sm[0-9]+_ --launch-skip 3 --launch-count 3 \
    --set full -f -o "$OUT/w5_$p" python3 -m benchmarks.once 5_conv_groupnorm "$p" >"$OUT/ncu_run_$p.log" 2>&1
  $NCU --import "$OUT/w5_$p.ncu-rep" --page details >"$OUT/w5_$p.details.txt" 2>&1
  $NCU --import "$OUT/w5_$p.ncu-rep" --page source --csv --print-source sass >"$OUT/w5_$p.sass.csv" 2>&1
  grep -E "_sm[0-9]+_|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Executed Ipc A" \
    "$OUT/w5_$p.details.txt" | head -40
}
case ${1:-profile} in
  profile)
    bash benchmarks/device_run.sh tests -k "instancenorm or instance_norm" 2>&1 | tail -8
    bash benchmarks/device_run.sh fuzz 1200 0 16 200 0 2 2>&1 | tail -30  # generation 2: with InstanceNorm
    ncu_w5 bf16
    ncu_w5 fp32-highest
    ;;
  stalls)  # why workload 5's bf16 passes wait: warp states, pipes and memory of one call's kernels
    FUSEDEPI_CACHE_DIR=/tmp/fusedepi-cache python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
    FUSEDEPI_CACHE_DIR=/tmp/fusedepi-cache $NCU --kernel-name regex:_mma --launch-skip 2 --launch-count 2 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_membar,smsp__pcsamp_warps_issue_stalled_drain,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_sleeping,smsp__pcsamp_warps_issue_stalled_tex_throttle,smsp__pcsamp_warps_issue_stalled_imc_miss,smsp__pcsamp_warps_issue_stalled_branch_resolving \
      python3 -m benchmarks.once 5_conv_groupnorm bf16 >"$OUT/stalls.txt" 2>&1
    grep -E "_mma<|Duration|Throughput|pcsamp|Pipe|Eligible|Issued Warp|L2 Hit|Mem Busy|Max Bandwidth|Mem Pipes" "$OUT/stalls.txt" | head -90
    ;;
  w5bf16)  # workload 5 at bf16, fusedepi alone, kernel by kernel
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm --precisions bf16 --providers fusedepi --profile 2>&1 | tail -8
    ;;
  w5)
    bash benchmarks/device_run.sh tests -k "direct or conv or swish or sigmoid or silu" 2>&1 | tail -12
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm \
      --providers inductor inductor-max-autotune fusedepi --profile 2>&1 | tail -40
    ;;
esac
