"""Where a warm start spends its time: a new process compiles one workload with warm
caches under cProfile, and the top entries by cumulative time are printed.

    python -m benchmarks.warm_profile 3_linear_groupnorm_leaky fp32-tf32 fusedepi

The parent compiles once first (in its own process) so that the kernel and Inductor
caches are warm, then starts the child; both use the caches named by
FUSEDEPI_CACHE_DIR / TORCHINDUCTOR_CACHE_DIR, or fresh ones.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def child(workload_name, precision, backend, top):
    import cProfile
    import pstats
    import time

    import torch

    from .compare import _set_precision
    from .workloads import WORKLOADS

    w = WORKLOADS[workload_name]
    dtype = _set_precision(precision)
    model = w.make_model().cuda().to(dtype)
    x = torch.rand(w.input_shape, device="cuda", dtype=dtype)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    torch.cuda.synchronize()
    prof.disable()
    print(f"warm start {workload_name} {precision} {backend}: {time.perf_counter() - start:.2f} s (under cProfile)")
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top // 2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload")
    parser.add_argument("precision")
    parser.add_argument("backend", choices=["fusedepi", "inductor"])
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.workload, args.precision, args.backend, args.top)
        return
    env = os.environ.copy()
    env.setdefault("FUSEDEPI_CACHE_DIR", tempfile.mkdtemp(prefix="fusedepi-warm-"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-warm-"))
    env.setdefault("PYTHONPYCACHEPREFIX", tempfile.mkdtemp(prefix="pycache-"))  # as an installed torch has
    cmd = [sys.executable, "-m", "benchmarks.warm_profile", args.workload, args.precision, args.backend,
           "--top", str(args.top), "--child"]
    subprocess.run(cmd, env=env, check=True, capture_output=True)  # warms the caches
    subprocess.run(cmd, env=env, check=True)


if __name__ == "__main__":
    main()
