"""A/B of the GEMM bias fold: the benchmark with the bias of 16-bit linear chains moved
into the epilogue (anchor `mm`), which `lowering.matcher.folds_gemm_bias` does for
float32 under TF32 only.

    python -m benchmarks.fold_ab [compare's arguments]

Results go in benchmarks/NOTES.md; the policy changes only on what this measures.
"""

import sys

import torch

from lowering import matcher

from . import compare


def main(argv=None):
    matcher.folds_gemm_bias = lambda dtype, tf32: dtype in (torch.bfloat16, torch.float16) or (
        dtype == torch.float32 and tf32)
    print("GEMM bias folded for 16-bit chains too (benchmarks/fold_ab.py)")
    compare.main(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
