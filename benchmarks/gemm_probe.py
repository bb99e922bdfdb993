"""PROTOTYPE probe (issue 5): the hand-written Hopper GEMM of `cuda_templates/gemm_sm90.py`
against cuBLAS, plain and with workload 3's chain (GroupNorm -> leaky_relu -> x + x) on
its accumulators. Needs an sm_90 GPU and nvcc.

    python -m benchmarks.gemm_probe            # correctness against float64, then timings

For each shape and variant (cluster 1: one CTA a tile; cluster 2: CTA pairs multicasting
the shared B tile; direct: results stored from registers; tma: staged in shared memory and
stored by TMA) it prints the relative error against a float64 reference, the median ms
of the kernel and of `torch.mm` (cuBLAS) at bf16, and their ratio.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import cuda_templates
from benchmarks.workloads import LinearGroupNormLeakyDouble, relative_error
from cuda_templates.gemm_sm90 import render_gemm_probe


def build(group: int, cluster: int, store: str, cache: Path) -> ctypes.CDLL:
    """Compiles the prototype for sm_90a through the project's compiler, into its kernel cache."""
    source = render_gemm_probe(group, cluster, store)
    lib = cuda_templates.build(source, f"gemm_probe_g{group}_c{cluster}_{store}", "sm90a", cache)
    dll = ctypes.CDLL(str(lib))
    dll.gemm_run.restype = ctypes.c_int
    dll.gemm_run.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_float] + [ctypes.c_int] * 3 + [ctypes.c_void_p]
    return dll


def run(dll, a, b, c, gamma, beta, eps=1e-5):
    m, k = a.shape
    n = b.shape[0]
    g = gamma.data_ptr() if gamma is not None else None
    be = beta.data_ptr() if beta is not None else None
    err = dll.gemm_run(a.data_ptr(), b.data_ptr(), c.data_ptr(), g, be, eps, m, n, k,
                       torch.cuda.current_stream().cuda_stream)
    if err:
        raise RuntimeError(f"gemm_run returned {err}")
    return c


def reference(a, b, group, gamma, beta, eps=1e-5):
    y = a.double() @ b.double().t()
    if group == 0:
        return y
    m, n = y.shape
    y = F.group_norm(y, n // group, gamma.double(), beta.double(), eps)
    y = F.leaky_relu(y, 0.01)
    return y + y


def compiled_chain(a, b, gamma, beta, group):
    """Workload 3's module with the probe's operands, compiled by fusedepi (its shipped path:
    cuBLAS, then the fused epilogue kernel) and by Inductor: (backend, median ms, rel err)."""
    from triton.testing import do_bench

    n, k = b.shape
    model = LinearGroupNormLeakyDouble(k, n, n // group).cuda().bfloat16()
    with torch.no_grad():
        model.linear.weight.copy_(b)
        model.linear.bias.zero_()
        model.gn.weight.copy_(gamma)
        model.gn.bias.copy_(beta)
    ref = reference(a, b, group, model.gn.weight.float(), model.gn.bias.float())
    rows = []
    for backend in ("fusedepi", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            err = relative_error(compiled(a), ref)
            rows.append((backend, do_bench(lambda: compiled(a)), err))
    return rows


def main() -> int:
    from triton.testing import do_bench

    torch.manual_seed(0)
    from fusion_backend.config import load_config

    cache = load_config().cache_dir  # the kernels' cache (FUSEDEPI_CACHE_DIR)
    # (GroupNorm columns, cluster size, epilogue store)
    variants = [(0, 1, "direct"), (0, 1, "tma"), (0, 2, "tma"), (16, 1, "direct"), (16, 1, "tma"), (16, 2, "tma"),
                (32, 1, "tma")]
    libs = {v: build(*v, cache) for v in variants}
    shapes = [(256, 512, 128), (1024, 8192, 8192), (16384, 4096, 4096)]
    ok = True
    for m, n, k in shapes:
        a = torch.rand(m, k, device="cuda", dtype=torch.bfloat16) * 2 - 1
        b = (torch.rand(n, k, device="cuda", dtype=torch.bfloat16) * 2 - 1) / k**0.5
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        gamma = torch.rand(n, device="cuda") + 0.5
        beta = torch.rand(n, device="cuda") - 0.5
        lib_ms = do_bench(lambda: torch.mm(a, b.t()))
        for (g, cluster, store), dll in libs.items():
            gm, bt = (gamma, beta) if g else (None, None)
            out = run(dll, a, b, c, gm, bt)
            torch.cuda.synchronize()
            err = relative_error(out, reference(a, b, g, gamma, beta))
            ms = do_bench(lambda: run(dll, a, b, c, gm, bt))
            good = err < 1e-2
            ok &= good
            what = ("GEMM" if g == 0 else f"GEMM+GroupNorm({g} cols)+leaky+x+x") + f" cluster {cluster} {store}"
            print(f"{m}x{n}x{k} {what:51s} rel err {err:.2e} {'ok' if good else 'MISMATCH'}  "
                  f"{ms:.4f} ms  cuBLAS mm {lib_ms:.4f} ms  ratio {ms / lib_ms:.3f}", flush=True)
        if m >= 1024:
            for backend, ms, err in compiled_chain(a, b, gamma, beta, group=16):
                ok &= err < 1e-2
                print(f"  {backend:8s} workload 3 (Linear, bias zeroed, GroupNorm({n // 16}) -> leaky -> x+x, bf16): "
                      f"rel err {err:.2e} {'ok' if err < 1e-2 else 'MISMATCH'}  {ms:.4f} ms  "
                      f"ratio to cuBLAS mm {ms / lib_ms:.3f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
