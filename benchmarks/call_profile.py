"""Where one call of a compiled model spends CPU time: wall-clock microseconds per call
for fusedepi and Inductor on a model small enough that the GPU is never the limit,
then cProfile over fusedepi's calls (top entries by own time).

    python -m benchmarks.call_profile [--calls 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn as nn


class Small(nn.Module):
    """Linear(256 -> 256) -> clamp: one tiny GEMM and one pointwise step."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(256, 256)

    def forward(self, x):
        return torch.clamp(self.linear(x), -0.5, 0.5)


def per_call_us(fn, x, calls: int) -> float:
    for _ in range(50):
        fn(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    from fusion_backend import fusedepi

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    compiled = {}
    with torch.no_grad():
        for name, backend in (("inductor", "inductor"), ("fusedepi", fusedepi)):
            torch._dynamo.reset()
            model = Small().cuda().to(torch.bfloat16)
            compiled[name] = torch.compile(model, backend=backend)
            print(f"{name}: {per_call_us(compiled[name], x, args.calls):.1f} us per call (wall)", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        per_call_us(compiled["fusedepi"], x, args.calls)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
