#!/usr/bin/env bash
# The tenth session's device calls (kept so that RESULTS.md's numbers can be rerun).
#   bash benchmarks/session10.sh gemm   # issue 5's GEMM prototype (python -m benchmarks.gemm_probe):
#                                       # float64 checks and timings against cuBLAS, cluster 1 and 2
set -uo pipefail
OUT=${OUT:-/tmp/fusedepi-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case ${1:-gemm} in
  gemm)
    # A wrong barrier protocol hangs rather than fails: bound it.
    FUSEDEPI_CACHE_DIR=/tmp/fusedepi-cache timeout ${PROBE_TIMEOUT:-300} python3 -m benchmarks.gemm_probe 2>&1 | tee "$OUT/gemm_probe.log"
    ;;
esac
