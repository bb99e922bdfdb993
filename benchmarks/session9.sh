#!/usr/bin/env bash
# The ninth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session9.sh ncutf32  # the TF32 direct-conv GPU tests, then ncu (full set) on
#                                        # workload 5's TF32 kernel: warp states, memory
#   (the phase-2 lag sweep in NOTES.md ran with a temporary FUSEDEPI_EXPERIMENT_LAG_IMAGES
#   override in the launcher, since removed: the lag is now a rule, see render.py)
#   bash benchmarks/session9.sh tf32     # direct-conv, W5, W3, fuzz and InstanceNorm GPU tests, then W5
#                                        # at TF32 and fp32-highest against Inductor (one run)
set -uo pipefail
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
ncu_summary() {  # $1: report name under $OUT
  /usr/local/cuda/bin/ncu --import "$OUT/$1.ncu-rep" --page details >"$OUT/$1.details.txt" 2>&1
  grep -E "Duration|Throughput|Occupancy|Registers|Issue Slots|Issued Ipc|Eligible|Active Warps|No Eligible|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|Warp Cycles|Shared Memory Configuration|Bank" \
    "$OUT/$1.details.txt" | head -60
  /usr/local/cuda/bin/ncu --import "$OUT/$1.ncu-rep" --page raw --csv 2>/dev/null \
    | python3 -c "import csv,sys; r=list(csv.reader(sys.stdin)); h,v=r[0],r[2]; [print(a,b) for a,b in zip(h,v) if 'pcsamp_warps_issue_stalled' in a and not a.endswith('not_issued') and b not in ('0','')]"
}
case ${1:-tf32} in
  ncutf32)
    bash benchmarks/device_run.sh tests -k "${TESTS:-tf32}" 2>&1 | tail -4
    FUSEDEPI_CACHE_DIR=/tmp/fusedepi-cache /usr/local/cuda/bin/ncu --kernel-name regex:_sm[0-9]+_ --launch-skip 2 \
      --launch-count 1 --set full --import-source yes -f -o "$OUT/w5tf32" python3 -m benchmarks.once 5_conv_groupnorm fp32-tf32 \
      >"$OUT/ncu_run.log" 2>&1
    ncu_summary w5tf32
    python3 -m benchmarks.ncu_hot "$OUT/w5tf32.ncu-rep" 45
    rm -f "$OUT/w5tf32.ncu-rep"
    ;;
  tf32)
    bash benchmarks/device_run.sh tests -k "${TESTS:-direct or 5_conv or 3_linear or fuzz or instance}" 2>&1 | tail -4
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm --precisions fp32-tf32 fp32-highest \
      --providers inductor inductor-max-autotune fusedepi --profile 2>&1 | grep -v "^\s*[0-9.]* ms  x" | tail -14
    ;;
esac
