"""Compiles one workload with fusedepi and runs it three times: a short target for ncu.

    ncu --kernel-name regex:_sm[0-9]+_ --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight python -m benchmarks.once 5_conv_groupnorm bf16

(`_sm[0-9]+_` matches fusedepi's own kernels, whose names end in the arch and a role.)
"""

from __future__ import annotations

import argparse

import torch

from .compare import PRECISIONS, _set_precision
from .workloads import WORKLOADS


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=list(WORKLOADS))
    parser.add_argument("precision", choices=list(PRECISIONS))
    parser.add_argument("--eval", action="store_true", help="module in eval mode (default: train)")
    args = parser.parse_args(argv)
    workload = WORKLOADS[args.workload]
    dtype = _set_precision(args.precision)
    model = workload.make_model().cuda().to(dtype).train(not args.eval)
    x = torch.rand(workload.input_shape, device="cuda", dtype=dtype)
    with torch.no_grad():
        fn = torch.compile(model, backend="fusedepi")
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
