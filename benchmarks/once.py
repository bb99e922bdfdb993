"""Compiles workload 5 with fusedepi and runs it three times: a short target for ncu.

    ncu --kernel-name regex:directconv --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight python -m benchmarks.w5_once bf16
"""

from __future__ import annotations

import argparse

import torch

from .compare import PRECISIONS, _set_precision
from .workloads import WORKLOADS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("precision", choices=list(PRECISIONS))
    args = parser.parse_args(argv)
    workload = WORKLOADS["5_conv_groupnorm"]
    dtype = _set_precision(args.precision)
    model = workload.make_model().cuda().to(dtype)
    x = torch.rand(workload.input_shape, device="cuda", dtype=dtype)
    with torch.no_grad():
        fn = torch.compile(model, backend="fusedepi")
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
