"""Compare eager, Inductor, Inductor max-autotune and fusedepi on the workloads (below).

    python -m benchmarks.compare            # every workload x precision x mode
    python -m benchmarks.compare --quick    # a small subset, under two minutes
    python -m benchmarks.compare --json results.json --warm-start
    python -m benchmarks.compare --backward  # training steps: forward + backward

Forward passes under torch.no_grad(); "train" means the module is in training
mode (BatchNorm uses batch statistics and updates its running stats). Times are
medians of `triton.testing.do_bench`. "floor" is the larger of the library GEMM
alone and the model's minimum bytes over the measured copy bandwidth (for the conv
workload, the bytes alone). "epilogue ms" is the device time of fusedepi's own
kernels; "epilogue GB/s" counts the bytes they must read (the anchor output, or for
a direct conv its input) and write, once each.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from .workloads import EXTRA_WORKLOADS, WORKLOADS, relative_error

ALL_WORKLOADS = {**WORKLOADS, **EXTRA_WORKLOADS}

PRECISIONS = {
    # name: (dtype, float32 matmul precision, cuDNN TF32)
    "fp32-highest": (torch.float32, "highest", False),
    "fp32-tf32": (torch.float32, "high", True),
    "bf16": (torch.bfloat16, "highest", False),
}
PROVIDERS = ["eager", "inductor", "inductor-max-autotune", "fusedepi"]


def _set_precision(name):
    dtype, matmul, cudnn_tf32 = PRECISIONS[name]
    torch.set_float32_matmul_precision(matmul)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    return dtype


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus written."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def _library_ms(model, x) -> float:
    """The anchor alone through the library (cuBLAS addmm / cuDNN conv)."""
    if hasattr(model, "linear"):
        lin = model.linear
        return _bench(lambda: torch.addmm(lin.bias, x, lin.weight.t()))
    conv = model.conv
    return _bench(lambda: conv(x))


def _floor_ms(workload, library_ms: float, bytes_ms: float) -> float:
    """The hardware floor: the larger of the library GEMM/conv and the minimum bytes
    over copy bandwidth; only the bytes where fusedepi computes the conv itself
    (workload 5's direct conv), so that cuDNN's time is no floor."""
    return bytes_ms if workload.computes_anchor else max(library_ms, bytes_ms)


def _min_bytes(model, x, out) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return x.numel() * x.element_size() + params + out.numel() * out.element_size()


def _device_us(event) -> float:
    return getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)


def kernel_times(fn, iters: int) -> list[tuple[float, int, str]]:
    """(ms per call, launches per call, name) of every CUDA kernel `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return [
        (_device_us(e) / iters / 1000, e.count // iters, e.key) for e in prof.key_averages() if _device_us(e)
    ]


def _epilogue_ms(fn, kernel: str, iters: int = 20) -> float | None:
    """Device time per call of the kernels whose names contain `kernel`."""
    total = sum(ms for ms, _, name in kernel_times(fn, iters) if kernel in name)
    return total or None


def kernel_table(fn, iters: int = 10, top: int = 8) -> str:
    """The `top` CUDA kernels of `fn` by device time per call."""
    rows = sorted(kernel_times(fn, iters), reverse=True)[:top]
    return "\n".join(f"    {ms:8.4f} ms  x{n}  {name[:110]}" for ms, n, name in rows)


def _compile(provider, model):
    if provider == "eager":
        return model
    if provider == "inductor":
        return torch.compile(model)
    if provider == "inductor-max-autotune":
        return torch.compile(model, mode="max-autotune-no-cudagraphs")
    return torch.compile(model, backend="fusedepi")


def run_cell(workload, precision, training, providers, copy_gbs, profile=False):
    from fusion_backend.backend import collect_reports
    from fusion_backend import launch

    dtype = _set_precision(precision)
    base = workload.make_model().cuda().to(dtype).train(training)
    x = torch.rand(workload.input_shape, device="cuda", dtype=dtype)
    with torch.no_grad():
        ref = copy.deepcopy(base).double()(x.double())
        lib_ms = _library_ms(base, x)
        rows = []
        for provider in providers:
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            reports: list = []
            start = time.perf_counter()
            with collect_reports(reports):
                fn = _compile(provider, model)
                out = fn(x)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start if provider != "eager" else 0.0
            err = relative_error(out, ref)
            ms = _bench(lambda: fn(x))
            if profile:
                print(f"  {provider} {ms:.3f} ms\n{kernel_table(lambda: fn(x))}", flush=True)
            row = dict(
                workload=workload.name,
                precision=precision,
                mode="train" if training else "eval",
                provider=provider,
                ms=ms,
                library_ms=lib_ms,
                floor_ms=_floor_ms(workload, lib_ms, _min_bytes(base, x, out) / copy_gbs / 1e6),
                compile_s=compile_s,
                rel_err=err,
            )
            if provider == "fusedepi":
                fused = [r for rep in reports for r in rep.records if r.status == "fused"]
                row["fused"] = ",".join(r.fusion for r in fused)
                if fused:
                    kernel = fused[0].kernel.split(" (")[0]  # the name without explain's note
                    # The in-kernel GEMM's file: its epilogue kernel runs alone only after
                    # the library GEMM; the GEMM kernel has no epilogue pass to time.
                    epi = _epilogue_ms(lambda: fn(x), kernel + "_apply" if kernel.startswith("wgmma") else kernel)
                    if epi:
                        # A direct conv reads x and computes the anchor itself; else the
                        # kernels read the library's anchor output.
                        if kernel.startswith("directconv"):
                            in_bytes = x.numel() * x.element_size()
                        else:
                            in_bytes = workload_output_bytes(base, x)
                        row["epilogue_ms"] = epi
                        row["epilogue_gbs"] = (in_bytes + out.numel() * out.element_size()) / epi / 1e6
                # Warm compile: Dynamo cold, kernels from the on-disk cache.
                torch._dynamo.reset()
                launch.forget_loaded()
                start = time.perf_counter()
                torch.compile(copy.deepcopy(base), backend="fusedepi")(x)
                torch.cuda.synchronize()
                row["warm_compile_s"] = time.perf_counter() - start
            rows.append(row)
            fn = model = out = None  # free the GPU memory before the next provider
            torch.cuda.empty_cache()
    eager = next((r["ms"] for r in rows if r["provider"] == "eager"), None)
    inductor = [r["ms"] for r in rows if r["provider"].startswith("inductor")]
    for r in rows:
        r["vs_eager"] = eager / r["ms"] if eager else None
        r["vs_inductor"] = min(inductor) / r["ms"] if inductor else None
        r["pct_floor"] = 100 * r["floor_ms"] / r["ms"]
    return rows


def workload_output_bytes(model, x) -> int:
    """Bytes of the anchor's output (what the epilogue reads)."""
    with torch.no_grad():
        y = model.linear(x) if hasattr(model, "linear") else model.conv(x)
    return y.numel() * y.element_size()


def warm_start(workload_name, precision, training, backend) -> tuple[float, float]:
    """Seconds for a new process to compile and run a workload once, caches warm.

    Returns (first, second): two new processes in turn, sharing a fresh Python
    bytecode cache (PYTHONPYCACHEPREFIX), so that the second reads bytecode for every
    module it imports even where the installed torch has no .pyc files (on the H200
    used for RESULTS.md the two differ by 0.3 s at most). The second is reported.
    Both include what any first call pays (CUDA context, cuBLAS/cuDNN handles);
    compare fusedepi's figure with Inductor's, measured the same way.
    """
    code = (
        "import time, torch; t = time.perf_counter();"
        "from benchmarks.compare import ALL_WORKLOADS as WORKLOADS, _set_precision;"
        f"w = WORKLOADS[{workload_name!r}]; d = _set_precision({precision!r});"
        f"m = w.make_model().cuda().to(d).train({training}); x = torch.rand(w.input_shape, device='cuda', dtype=d);"
        "t = time.perf_counter();"
        f"torch.no_grad().__enter__(); torch.compile(m, backend={backend!r})(x); torch.cuda.synchronize();"
        "print(time.perf_counter() - t)"
    )
    env = os.environ.copy()
    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="pycache-")
    times = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        if out.returncode:
            raise RuntimeError(out.stderr[-2000:])
        times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def _wall_ms(fn, calls: int = 500) -> float:
    """Wall-clock ms per call of `calls` back-to-back calls: what the caller waits for when
    the CPU side (guards, wrappers, launches) is the bottleneck, which CUDA graphs remove."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / calls


def cuda_graph_rows(batch: int, precisions) -> list[dict]:
    """Small batches, where launch overhead matters: fusedepi and Inductor with and
    without `mode="reduce-overhead"` (CUDA graphs) on workloads 2-4 at `batch` rows.
    "GPU ms" is do_bench's device time per call; "wall ms" the caller's time per call
    in a loop, which includes the CPU side that CUDA graphs remove."""
    rows = []
    for name in ("2_linear_logsumexp", "3_linear_groupnorm_leaky", "4_linear_groupnorm_swish"):
        workload = WORKLOADS[name]
        for precision in precisions:
            dtype = _set_precision(precision)
            base = workload.make_model().cuda().to(dtype)
            x = torch.rand((batch, *workload.input_shape[1:]), device="cuda", dtype=dtype)
            row = dict(workload=name, precision=precision, batch=batch)
            with torch.no_grad():
                for backend in ("inductor", "fusedepi"):
                    for mode in (None, "reduce-overhead"):
                        torch._dynamo.reset()
                        fn = torch.compile(copy.deepcopy(base), backend=backend, mode=mode)
                        for _ in range(3):  # CUDA graph warm-up and recording
                            fn(x)
                        label = f"{backend}{'-cudagraphs' if mode else ''}"
                        row[f"{label} GPU ms"] = _bench(lambda: fn(x))
                        row[f"{label} wall ms"] = _wall_ms(lambda: fn(x))
            rows.append(row)
    return rows


def backward_rows(workloads, precisions, providers) -> list[dict]:
    """Training steps (forward + backward with a fixed upstream gradient) per provider,
    modules in training mode; errors of the output and of the anchor's weight gradient
    against float64."""
    from fusion_backend.backend import collect_reports

    rows = []
    for name in workloads:
        workload = ALL_WORKLOADS[name]
        for precision in precisions:
            print(f"-- backward {name} {precision}", flush=True)
            dtype = _set_precision(precision)
            base = workload.make_model().cuda().to(dtype).train()
            x = torch.rand(workload.input_shape, device="cuda", dtype=dtype)
            ref = copy.deepcopy(base).double()
            ref_out = ref(x.double())
            upstream = torch.randn_like(ref_out)
            ref_out.backward(upstream)
            ref_grad = next(ref.parameters()).grad
            ref_out, ref = ref_out.detach(), None
            grad_in = upstream.to(dtype)
            for provider in providers:
                torch._dynamo.reset()
                model = copy.deepcopy(base)
                reports: list = []
                with collect_reports(reports):
                    fn = _compile(provider, model)
                    out = fn(x)
                    out.backward(grad_in)
                row = dict(workload=name, precision=precision, provider=provider,
                           rel_err=relative_error(out.detach(), ref_out),
                           grad_rel_err=relative_error(next(model.parameters()).grad, ref_grad))
                out = None

                def step():
                    model.zero_grad(set_to_none=True)
                    fn(x).backward(grad_in)

                row["ms"] = _bench(step)
                if provider == "fusedepi":
                    row["fused"] = ",".join(r.fusion for rep in reports for r in rep.records if r.status == "fused")
                rows.append(row)
                print(f"--   {provider:<10} {row['ms']:.3f} ms", flush=True)
                fn = model = None
                torch.cuda.empty_cache()
    for r in rows:
        inductor = [q["ms"] for q in rows if q["provider"] == "inductor" and q["workload"] == r["workload"]
                    and q["precision"] == r["precision"]]
        r["vs_inductor"] = inductor[0] / r["ms"] if inductor else None
    return rows


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def print_table(rows):
    from tabulate import tabulate

    table = [
        (
            r["workload"],
            r["precision"],
            r["mode"],
            r["provider"],
            _fmt(r["ms"], ".3f"),
            _fmt(r["vs_eager"], ".2f"),
            _fmt(r["vs_inductor"], ".2f"),
            _fmt(r["library_ms"], ".3f"),
            _fmt(r["pct_floor"], ".0f"),
            _fmt(r.get("compile_s"), ".1f"),
            _fmt(r.get("warm_compile_s"), ".1f"),
            _fmt(r["rel_err"], ".1e"),
            _fmt(r.get("epilogue_ms"), ".3f"),
            _fmt(r.get("epilogue_gbs"), ".0f"),
        )
        for r in rows
    ]
    headers = ["workload", "precision", "mode", "provider", "median ms", "x eager", "x inductor",
               "library ms", "% floor", "compile s", "warm s", "rel err", "epilogue ms", "epilogue GB/s"]
    print(tabulate(table, headers=headers))


def _doc_line(workload) -> str:
    """The first line of a workload model's docstring, without its number."""
    line = (workload.make_model.__doc__ or workload.name).strip().splitlines()[0]
    return line.split(". ", 1)[-1].rstrip(".")


def main(argv=None):
    listing = "\n".join(f"  {w.name:26s} {_doc_line(w)}, input {'x'.join(map(str, w.input_shape))}"
                        for w in ALL_WORKLOADS.values())
    epilog = f"workloads (the first five by default; the sixth on request):\n{listing}"
    parser = argparse.ArgumentParser(description=__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="workloads 3 and 5, bf16, train: under two minutes")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(ALL_WORKLOADS))
    parser.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--modes", nargs="*", default=["train", "eval"], choices=["train", "eval"])
    parser.add_argument("--providers", nargs="*", default=PROVIDERS, choices=PROVIDERS)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--profile", action="store_true", help="print each provider's top CUDA kernels")
    parser.add_argument("--warm-start", action="store_true", help="time a new process with a warm kernel cache")
    parser.add_argument("--backward", action="store_true",
                        help="only time training steps (forward + backward) of eager, Inductor and fusedepi")
    parser.add_argument("--cuda-graphs", type=int, metavar="BATCH",
                        help="only time workloads 2-4 at this batch size with and without mode='reduce-overhead'")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the benchmark needs a CUDA GPU")
    if args.quick:
        args.workloads = ["3_linear_groupnorm_leaky", "5_conv_groupnorm"]
        args.precisions, args.modes = ["bf16"], ["train"]
    # Fresh caches unless the caller set them: the first compile of each cell is cold.
    os.environ.setdefault("FUSEDEPI_CACHE_DIR", tempfile.mkdtemp(prefix="fusedepi-bench-"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-bench-"))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  caches "
          f"{os.environ['FUSEDEPI_CACHE_DIR']} {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
    if args.cuda_graphs or args.backward:
        from tabulate import tabulate

        if args.backward:
            providers = [p for p in args.providers if p != "inductor-max-autotune"]
            rows = backward_rows(args.workloads, args.precisions, providers)
        else:
            rows = cuda_graph_rows(args.cuda_graphs, args.precisions)
        print(tabulate(rows, headers="keys", floatfmt=".4f"))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, handle, indent=1)
        return
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    rows = []
    for name in args.workloads:
        workload = ALL_WORKLOADS[name]
        for precision in args.precisions:
            for mode in args.modes:
                if mode == "eval" and not workload.has_batchnorm and "train" in args.modes:
                    continue  # no mode-dependent op: the eval graph is the train graph
                print(f"-- {name} {precision} {mode}", flush=True)
                cell = run_cell(workload, precision, mode == "train", args.providers, copy_gbs, args.profile)
                if args.warm_start:
                    for row in cell:
                        if row["provider"] in ("inductor", "fusedepi"):
                            backend = "inductor" if row["provider"] == "inductor" else "fusedepi"
                            first, second = warm_start(name, precision, mode == "train", backend)
                            row["warm_start_s"], row["warm_start_no_pyc_s"] = second, first
                for row in cell:  # progress: the full table comes at the end
                    warm = f"  warm start {row['warm_start_s']:.1f} s" if "warm_start_s" in row else ""
                    print(f"--   {row['provider']:<22} {row['ms']:.3f} ms{warm}", flush=True)
                rows.extend(cell)
    print_table(rows)
    if args.warm_start:
        for r in rows:
            if "warm_start_s" in r:
                print(f"warm start (new process) {r['workload']} {r['precision']} {r['mode']} {r['provider']}: "
                      f"{r['warm_start_s']:.1f} s ({r['warm_start_no_pyc_s']:.1f} s while writing bytecode)")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_gbs": copy_gbs, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
