"""Compiles one workload or zoo model with fusedepi and runs it three times: a short
target for ncu.

    ncu --kernel-name regex:_sm[0-9]+a?_ --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight python -m benchmarks.once 5_conv_groupnorm bf16
    FUSEDEPI_IN_KERNEL_CONV=1 bash benchmarks/device_run.sh ncu 1 1 conv2d_wide_relu_bias bf16

(`_sm[0-9]+a?_` matches fusedepi's own kernels, whose names end in the arch, `a` for
the sm_90a kernels, and a role.)

`--wall` then times the caller's wall-clock ms a call (fusedepi and Inductor, alternating
rounds in this process) and prints where fusedepi's CPU time goes (cProfile of its calls):
for a model whose wall time is far from its GPU time.

    python -m benchmarks.once conv3d_scale_sigmoid_bias fp32-tf32 --wall [--plan PAD_PIXELS=False]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from .compare import PRECISIONS, _set_precision, _wall_ms
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
    parser.add_argument("--wall", action="store_true",
                        help="then wall-clock ms a call against Inductor, and a cProfile of fusedepi's calls")
    parser.add_argument("--plan", action="append", metavar="NAME=VALUE",
                        help="set a cuda_templates.conv_sm90 constant first (as benchmarks.zoo --plan)")
    args = parser.parse_args(argv)
    if args.plan:
        from .kernel_variants import parse_plan, set_plan

        set_plan(parse_plan(args.plan))
    dtype = _set_precision(args.precision)
    model, x = model_and_input(args.workload, dtype, not args.eval)
    with torch.no_grad():
        fn = torch.compile(model, backend="fusedepi")
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        if args.wall:
            wall(model, x, fn)


def wall(model, x, fused, rounds: int = 5, calls: int = 300):
    """Prints each backend's wall-clock ms a call (rounds alternate, best shown with all),
    then cProfile's top entries by own time over `calls` fused calls."""
    inductor = torch.compile(model)
    inductor(x)
    times = {"fusedepi": [], "inductor": []}
    for _ in range(rounds):
        times["fusedepi"].append(_wall_ms(lambda: fused(x), calls))
        times["inductor"].append(_wall_ms(lambda: inductor(x), calls))
    for name, ms in times.items():
        print(f"{name:9s} wall {min(ms):.4f} ms a call (rounds: {' '.join(f'{t:.4f}' for t in ms)})")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fused(x)
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
