"""Where one call of a compiled model spends CPU time: wall-clock microseconds per call
for Inductor and fusedepi on a model small enough that the GPU is never the limit, then
cProfile over fusedepi's calls (top entries by own time).

fusedepi runs twice: with its Python launcher (FUSEDEPI_NATIVE_LAUNCHER=0), then with the
C++ launcher, which the second compile loads (and builds, if the cache lacks it). That
order matters: once loaded, the C++ launcher serves every fused call of the process.

    python -m benchmarks.call_profile [--calls 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import os
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
    from fusion_backend import fusedepi, ops

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    runs = (("inductor", "inductor", None), ("fusedepi, Python launcher", fusedepi, "0"),
            ("fusedepi, C++ launcher", fusedepi, "1"))
    with torch.no_grad():
        for name, backend, native in runs:
            if native is not None:
                os.environ["FUSEDEPI_NATIVE_LAUNCHER"] = native
            torch._dynamo.reset()
            model = Small().cuda().to(torch.bfloat16)
            compiled = torch.compile(model, backend=backend)
            compiled(x)  # compiles (and loads the C++ launcher on the second fusedepi run)
            print(f"{name}: {per_call_us(compiled, x, args.calls):.1f} us per call (wall); "
                  f"fused op served by: {ops.native_launcher()}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        per_call_us(compiled, x, args.calls)
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
