"""Compiles one workload or zoo model with fusedepi and runs it three times: a short
target for ncu.

    ncu --kernel-name regex:_sm[0-9]+a?_ --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight python -m benchmarks.once 5_conv_groupnorm bf16
    FUSEDEPI_IN_KERNEL_CONV=1 bash benchmarks/device_run.sh ncu 1 1 conv2d_wide_relu_bias bf16

(`_sm[0-9]+a?_` matches fusedepi's own kernels, whose names end in the arch, `a` for
the sm_90a kernels, and a role.)
"""

from __future__ import annotations

import argparse

import torch

from .compare import PRECISIONS, _set_precision
from .workloads import WORKLOADS
from .zoo import BY_NAME as ZOO


def model_and_input(name: str, dtype: torch.dtype, train: bool, device: str = "cuda"):
    """The workload's or zoo model's module (fresh, in `dtype`, training mode unless
    `train` is False) and an input of its shape."""
    torch.manual_seed(0)
    if name in WORKLOADS:
        model, shape = WORKLOADS[name].make_model(), WORKLOADS[name].input_shape
    else:
        model, shape = ZOO[name].make(), ZOO[name].shape
    return model.to(device, dtype).train(train), torch.rand(shape, device=device, dtype=dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=list(WORKLOADS) + list(ZOO), metavar="NAME",
                        help="a workload (benchmarks.workloads) or a zoo model (benchmarks.zoo --list)")
    parser.add_argument("precision", choices=list(PRECISIONS))
    parser.add_argument("--eval", action="store_true", help="module in eval mode (default: train)")
    args = parser.parse_args(argv)
    dtype = _set_precision(args.precision)
    model, x = model_and_input(args.workload, dtype, not args.eval)
    with torch.no_grad():
        fn = torch.compile(model, backend="fusedepi")
        for _ in range(3):
            fn(x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
