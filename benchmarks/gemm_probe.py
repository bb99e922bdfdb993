"""The in-kernel GEMM (issue 5) against the library GEMM path, Inductor and cuBLAS alone, on
workloads 1 (eval; also at workloads 2-4's shape), 2, 3 and 4 at 16-bit precision, or float32
under TF32. Needs an sm_90 GPU and nvcc.

    python -m benchmarks.gemm_probe                  # bf16, the workloads' shapes
    python -m benchmarks.gemm_probe --dtype float16
    python -m benchmarks.gemm_probe --dtype tf32     # float32, matmul precision "high"

For each workload it compiles the module with fusedepi and with Inductor, checks both
against a float64 reference and that fusedepi fused it, and prints the kernel it chose (the
in-kernel GEMM, or cuBLAS and then the fused epilogue kernel, as FUSEDEPI_IN_KERNEL_GEMM
and `gemm_plan` decide); then times them with `torch.addmm` (the library GEMM alone) in
interleaved rounds and prints medians and ratios to the library GEMM. Run it once with
FUSEDEPI_IN_KERNEL_GEMM=1 and once with =0 to compare the two paths (Dynamo reuses one
process's graph). `benchmarks/session13.sh gemm` does both.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

from benchmarks.workloads import WORKLOADS, relative_error
from fusion_backend.backend import collect_reports

ROUNDS = 7  # timing rounds (interleaved_ms)
CASES = {  # name: (workload, eval mode, (in_features, out_features, rows) where not the workload's)
    "w1_eval": ("1_linear_bn_gelu_relu", True, None),
    "w2": ("2_linear_logsumexp", False, None),
    "w3": ("3_linear_groupnorm_leaky", False, None),
    "w4": ("4_linear_groupnorm_swish", False, None),
    # Workload 1's eval chain at workloads 2-4's shape: two tiles a CTA, so the consumers run it.
    "w1_eval_1024": ("1_linear_bn_gelu_relu", True, (8192, 8192, 1024)),
}


def interleaved_ms(fns: dict, rounds: int = ROUNDS) -> dict:
    """Median ms of each callable over `rounds` rounds that time them all in turn (the
    order rotating), so that a drift of the GPU's clocks during the run (2-5% between
    back-to-back timings of one kernel) falls on every callable alike."""
    from triton.testing import do_bench

    names = list(fns)
    times: dict = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(do_bench(fns[name], warmup=10, rep=60))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _compiled(model, x, backend: str):
    """(callable, its first output, fusedepi's kernel names) of `model` compiled by `backend`."""
    compiled = torch.compile(model, backend=backend)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        out = compiled(x)

    def call():
        with torch.no_grad():
            return compiled(x)

    kernels = [r.kernel for rep in reports for r in rep.records if r.status == "fused"]
    return call, out, kernels


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "tf32"])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args(argv)
    dtype = torch.float32 if args.dtype == "tf32" else getattr(torch, args.dtype)
    if args.dtype == "tf32":
        torch.set_float32_matmul_precision("high")
    torch.manual_seed(0)
    ok = True
    for case in args.cases:
        workload_name, eval_mode, shape = CASES[case]
        workload = WORKLOADS[workload_name]
        model = (workload.make_model(*shape[:2]) if shape else workload.make_model()).cuda().to(dtype)
        model.train(not eval_mode)
        if eval_mode:
            with torch.no_grad():
                model.bn.running_mean.uniform_(-0.5, 0.5)
                model.bn.running_var.uniform_(0.5, 2)
        x = torch.rand((shape[2], shape[0]) if shape else workload.input_shape, device="cuda", dtype=dtype)
        with torch.no_grad():
            ref = copy.deepcopy(model).double()(x.double())
        lin = model.linear
        fns = {"library GEMM (addmm)": lambda: torch.addmm(lin.bias, x, lin.weight.t())}
        if args.dtype == "tf32":  # float32 chains under TF32 run `mm` and add the bias in the epilogue
            fns["library mm (no bias)"] = lambda: torch.mm(x, lin.weight.t())
        lines = {}
        torch._dynamo.reset()
        setting = os.environ.get("FUSEDEPI_IN_KERNEL_GEMM", "") or "auto"
        for backend in ("fusedepi", "inductor"):
            call, out, kernels = _compiled(model, x, backend)
            chosen = "in-kernel" if kernels and kernels[0].startswith("wgmma") and "library GEMM first" not in kernels[0] \
                else "library"
            what = backend if backend == "inductor" else f"fusedepi {chosen} GEMM"
            err = relative_error(out, ref)
            good = err <= 1e-2
            if backend == "fusedepi":  # FUSEDEPI_IN_KERNEL_GEMM=0: never the in-kernel GEMM
                good &= len(kernels) == 1 and (setting not in ("0", "off") or chosen == "library")
            ok &= good
            fns[what] = call
            lines[what] = (f"{case} {args.dtype} {what:26s} rel err {err:.2e} {'ok' if good else 'MISMATCH'}"
                           f" {kernels[0] if kernels else ''}")
        ms = interleaved_ms(fns)
        lib = ms["library GEMM (addmm)"]
        m, k = x.shape
        print(f"{case} {m}x{lin.out_features}x{k} {args.dtype} library GEMM (addmm) {lib:.4f} ms "
              f"(medians of {ROUNDS} interleaved rounds)", flush=True)
        if "library mm (no bias)" in ms:
            print(f"    library mm (no bias) {ms['library mm (no bias)']:.4f} ms  ratio {ms['library mm (no bias)'] / lib:.3f}")
        for what, line in lines.items():
            print(f"{line}\n    {ms[what]:.4f} ms  ratio to the library GEMM {ms[what] / lib:.3f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
