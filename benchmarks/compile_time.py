"""Cold and warm compiles of zoo models with fusedepi, each in a new process.

    python -m benchmarks.compile_time conv2d_wide_relu_bias linear_ln_relu
    python -m benchmarks.compile_time conv2d_relu_bias --dtypes float32 bfloat16 --json compile.json
    python -m benchmarks.compile_time conv2d_wide_relu_bias --profile 25   # and where each start's time went

Per model and dtype, two new Python processes run `torch.compile(model,
backend="fusedepi")` and its first call, at the defaults a user has (the measured choice
on, `FUSEDEPI_AUTOTUNE=auto`): the first with empty kernel, timing, Inductor and Triton
caches of its own (cold), the second with the caches the first left (warm). Each says
the seconds from the compile's start to the first call's result on the device (Dynamo,
the matcher, nvcc, the measured choice's timings, Inductor), the kernel builds it ran
(`cuda_templates.compiler._ninja_build`) and the timings it measured (a chain against
Inductor, `choice._measure`; a whole graph, `choice._measure_graphs`) and Inductor's FX
graph cache's hits, misses and bypasses (Dynamo's counters). A warm start
should build nothing and time nothing. `import torch` and building the model are not
counted. Without a GPU the models run on the CPU at a batch of 2 (the fused op's
reference: nothing built, nothing timed).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import zoo

# The folders whose functions the profile lists by cumulative time.
PROJECT_FOLDERS = ("fusion_backend", "cuda_templates", "lowering")
# The caches a cold start begins without: fusedepi's kernels and timings, Inductor's and
# Triton's compiled code.
CACHE_VARIABLES = {"FUSEDEPI_CACHE_DIR": "fusedepi", "TORCHINDUCTOR_CACHE_DIR": "inductor",
                   "TRITON_CACHE_DIR": "triton"}


def _child(model_name: str, dtype_name: str, profile: int = 0) -> dict:
    """One compile and first call of `model_name` in this process, with its counts
    (`profile`: and the functions of most cumulative time under cProfile, that many)."""
    from cuda_templates import compiler
    from fusion_backend import choice, fusedepi
    from fusion_backend.backend import collect_reports

    counts = {"builds": 0, "timed_chains": 0, "timed_graphs": 0}

    def counting(fn, key):
        def wrapped(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    compiler._ninja_build = counting(compiler._ninja_build, "builds")
    choice._measure = counting(choice._measure, "timed_chains")
    choice._measure_graphs = counting(choice._measure_graphs, "timed_graphs")
    cuda = torch.cuda.is_available()
    zoo._settings()
    model, x = zoo._model_and_input(zoo.BY_NAME[model_name], getattr(torch, dtype_name),
                                    "cuda" if cuda else "cpu", None if cuda else 2)
    reports: list = []
    profiler = cProfile.Profile() if profile else None
    with torch.no_grad(), collect_reports(reports):
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        torch.compile(model, backend=fusedepi)(x)
        if cuda:
            torch.cuda.synchronize()
        if profiler:
            profiler.disable()
        seconds = time.perf_counter() - started
    from torch._dynamo.utils import counters

    records = [r for report in reports for r in report.records]
    fx_cache = {k.removeprefix("fxgraph_cache_"): v for k, v in counters["inductor"].items()
                if k.startswith("fxgraph_cache_")}
    row = {"seconds": round(seconds, 2), **counts, "inductor_fx_cache": fx_cache,
           "fused": [r.fusion for r in records if r.status == "fused"],
           "refused": [f"{r.anchor}: {r.reason}" for r in records if r.status == "refused"]}
    if profiler:
        row["profile"] = _profile_lines(pstats.Stats(profiler).stats, profile)
    return row


def _profile_lines(stats: dict, count: int) -> list[str]:
    """This project's `count` functions of most cumulative time, then any `count` of most
    time in themselves (where the time went: nvcc waits, Inductor's codegen)."""
    def where(path: str, line: int, name: str) -> str:
        return f"{'/'.join(Path(path).parts[-2:])}:{line} {name}"

    ours = [(key, value) for key, value in stats.items()
            if any(f"/{folder}/" in key[0] for folder in PROJECT_FOLDERS)]
    lines = [f"{value[3]:8.2f} s cumulative  {where(*key)}"
             for key, value in sorted(ours, key=lambda item: item[1][3], reverse=True)[:count]]
    return lines + [f"{value[2]:8.2f} s itself      {where(*key)}"
                    for key, value in sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:count]]


def measure(model_name: str, dtype_name: str, starts: int = 2, profile: int = 0) -> dict:
    """Cold and then warm (`starts` new processes in all, sharing fresh caches):
    a row of each start's `_child` result (`profile`: as `_child`'s)."""
    with tempfile.TemporaryDirectory(prefix="fusedepi-compile-") as root:
        env = dict(os.environ, FUSEDEPI_AUTOTUNE=os.environ.get("FUSEDEPI_AUTOTUNE", "auto"),
                   **{var: str(Path(root) / sub) for var, sub in CACHE_VARIABLES.items()})
        row = {"model": model_name, "dtype": dtype_name, "starts": []}
        for _ in range(starts):
            run = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--child", model_name, dtype_name,
                                  "--profile", str(profile)],
                                 capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parent.parent)
            if run.returncode != 0:
                raise RuntimeError(f"{model_name} {dtype_name}: the compile's process failed:\n{run.stderr[-3000:]}")
            row["starts"].append(json.loads(run.stdout.strip().splitlines()[-1]))
    return row


def _counts(counts: dict) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "unused"


def describe(row: dict) -> str:
    parts = [f"{row['model']:<34} {row['dtype']:<9}"]
    for label, start in zip(("cold", "warm", "warm again"), row["starts"]):
        parts.append(f"{label} {start['seconds']:6.2f} s ({start['builds']} builds, "
                     f"{start['timed_chains']} chains and {start['timed_graphs']} graphs timed; Inductor's "
                     f"FX cache {_counts(start['inductor_fx_cache'])})")
    fused = row["starts"][0]["fused"]
    text = "  ".join(parts) + f"  fused: {', '.join(fused) if fused else 'nothing'}"
    for label, start in zip(("cold", "warm", "warm again"), row["starts"]):
        if start.get("profile"):
            text += f"\n  {label} (cProfile):\n" + "\n".join(f"    {line}" for line in start["profile"])
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", help="zoo model names (python -m benchmarks.zoo --list)")
    parser.add_argument("--dtypes", nargs="*", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also print each start's N functions of most cumulative time (cProfile)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child, profile=args.profile)))
        return 0
    unknown = [m for m in args.models if m not in zoo.BY_NAME]
    if unknown or not args.models:
        parser.error(f"unknown zoo models: {unknown}" if unknown else "name at least one zoo model")
    rows = []
    for model in args.models:
        for dtype in args.dtypes:
            rows.append(measure(model, dtype, profile=args.profile))
            print(describe(rows[-1]), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
