#!/usr/bin/env bash
# The eighth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session8.sh ab    # workload 5 at bf16 on main, then on a checkout of branch
#                                     # w5-occupancy exported to ./wt_occ (git archive), and that
#                                     # branch's direct-conv GPU tests
#   bash benchmarks/session8.sh w5f32 # direct-conv GPU tests, then workload 5 at float32, fusedepi alone
#   bash benchmarks/session8.sh ncuf32 # ncu (full set) on workload 5's float32 kernel: warp states, memory
#   bash benchmarks/session8.sh tests  # the whole GPU tier (tests/*, -m gpu)
#   bash benchmarks/session8.sh table  # workload 5, every precision, against eager and Inductor
#   bash benchmarks/session8.sh twophase # direct-conv + W5 GPU tests, W5 fusedepi at bf16 and fp32
#   bash benchmarks/session8.sh tf32   # the TF32 direct conv's first GPU run (ran in the ninth session on
#                                      # branch w5-tf32, since merged; benchmarks/session9.sh tf32 is current)
set -uo pipefail
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
case ${1:-ab} in
  ab)
    echo "== main"
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm --precisions bf16 --providers fusedepi --profile 2>&1 | tail -8
    echo "== w5-occupancy"
    (cd wt_occ && OUT="$OUT/occ" bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm --precisions bf16 \
      --providers fusedepi --profile 2>&1 | tail -8
     OUT="$OUT/occ" bash benchmarks/device_run.sh tests -k "direct" 2>&1 | tail -6)
    ;;
  w5f32)
    bash benchmarks/device_run.sh tests -k "direct or 5_conv" 2>&1 | tail -8
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm --precisions fp32-highest --providers fusedepi \
      --profile 2>&1 | tail -8
    ;;
  ncuf32)
    python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
    FUSEDEPI_CACHE_DIR=/tmp/fusedepi-cache /usr/local/cuda/bin/ncu --kernel-name regex:_sm[0-9]+_ --launch-skip 2 \
      --launch-count 1 --set full -f -o "$OUT/w5f32" python3 -m benchmarks.once 5_conv_groupnorm fp32-highest \
      >"$OUT/ncu_run.log" 2>&1
    /usr/local/cuda/bin/ncu --import "$OUT/w5f32.ncu-rep" --page details >"$OUT/w5f32.details.txt" 2>&1
    grep -E "Duration|Throughput|Occupancy|Registers|Issue Slots|Issued Ipc|Eligible|Active Warps|No Eligible|Stall|L2 Hit|L1/TEX Hit|Mem Busy|Max Bandwidth|Warp Cycles" \
      "$OUT/w5f32.details.txt" | head -60
    /usr/local/cuda/bin/ncu --import "$OUT/w5f32.ncu-rep" --page raw --csv 2>/dev/null \
      | python3 -c "import csv,sys; r=list(csv.reader(sys.stdin)); h,v=r[0],r[2]; [print(a,b) for a,b in zip(h,v) if 'pcsamp_warps_issue_stalled' in a and not a.endswith('not_issued') and b not in ('0','')]"
    ;;
  tests)
    bash benchmarks/device_run.sh tests 2>&1 | tail -15
    ;;
  table)
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm \
      --providers eager inductor inductor-max-autotune fusedepi --profile 2>&1 | grep -v "^\s*[0-9.]* ms  x" | tail -22
    ;;
  twophase)
    bash benchmarks/device_run.sh tests -k "direct or 5_conv" 2>&1 | tail -4
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm --precisions bf16 fp32-highest \
      --providers fusedepi --profile 2>&1 | tail -12
    ;;
  tf32)
    bash benchmarks/device_run.sh tests -k "tf32 or direct or 5_conv" 2>&1 | tail -6
    bash benchmarks/device_run.sh bench --workloads 5_conv_groupnorm --precisions fp32-tf32 fp32-highest \
      --providers inductor inductor-max-autotune fusedepi --profile 2>&1 | grep -v "^\s*[0-9.]* ms  x" | tail -14
    ;;
esac
