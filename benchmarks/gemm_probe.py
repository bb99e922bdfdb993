"""PROTOTYPE probe (issue 5): the hand-written Hopper GEMM of `cuda_templates/gemm_sm90.py`
against cuBLAS, plain and with two chains on its output tile: workload 3's (GroupNorm ->
leaky_relu -> x + x) and workload 1's in eval mode (BatchNorm folded to a per-column
affine -> gelu -> relu). Needs an sm_90 GPU and nvcc.

    python -m benchmarks.gemm_probe            # correctness against float64, then timings

For each shape and variant it prints the relative error against a float64 reference, the
median ms of the kernel and of `torch.mm` (cuBLAS) at bf16, and their ratio. Variants:
`tma` stages results in shared memory and stores them by TMA (`direct`: from registers);
`regs` runs the epilogue in the consumer warps' registers, `warps` in the producer
warpgroup's three spare warps from the staging tile, while the consumers go on to the
next tile. At the two large shapes the workloads' modules (the probe's operands, bf16)
are also compiled by fusedepi (its shipped path: cuBLAS, then the fused epilogue kernel)
and by Inductor and timed in the same run.
"""

from __future__ import annotations

import copy
import ctypes
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import cuda_templates
from benchmarks.workloads import LinearBnGeluRelu, LinearGroupNormLeakyDouble, relative_error
from cuda_templates.gemm_sm90 import render_gemm_probe
from fusion_backend.backend import collect_reports

ROUNDS = 7  # timing rounds (interleaved_ms)
GROUP = 16  # workload 3's GroupNorm: 512 groups of 16 columns at N = 8192
# (chain, GroupNorm columns, cluster, store, offload)
VARIANTS = [
    ("plain", 0, 1, "tma", False),
    ("plain", 0, 1, "tma", True),
    ("groupnorm", GROUP, 1, "tma", False),
    ("groupnorm", GROUP, 1, "tma", True),
    ("affine_gelu_relu", 0, 1, "tma", False),
    ("affine_gelu_relu", 0, 1, "tma", True),
]


def build(chain: str, group: int, cluster: int, store: str, offload: bool, cache: Path) -> ctypes.CDLL:
    """Compiles the prototype for sm_90a through the project's compiler, into its kernel cache."""
    source = render_gemm_probe(group, cluster, store, chain, offload)
    name = f"gemm_probe_{chain}{group or ''}_c{cluster}_{store}{'_warps' if offload else ''}"
    lib = cuda_templates.build(source, name, "sm90a", cache)
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


def reference(a, b, chain, gamma, beta, group=GROUP, eps=1e-5):
    y = a.double() @ b.double().t()
    if chain == "plain":
        return y
    if chain == "affine_gelu_relu":
        return F.relu(F.gelu(y * gamma.double() + beta.double()))
    y = F.group_norm(y, y.shape[1] // group, gamma.double(), beta.double(), eps)
    y = F.leaky_relu(y, 0.01)
    return y + y


def _modules(b, gamma, beta):
    """Workloads 3 and 1 (eval) with the probe's weight, no Linear bias, and parameters that
    give the prototype's gamma and beta: (chain, module)."""
    n, k = b.shape
    w3 = LinearGroupNormLeakyDouble(k, n, n // GROUP).cuda().bfloat16()
    w1 = LinearBnGeluRelu(k, n).cuda().bfloat16().eval()
    with torch.no_grad():
        for model in (w3, w1):
            model.linear.weight.copy_(b)
            model.linear.bias.zero_()
        w3.gn.weight.copy_(gamma)
        w3.gn.bias.copy_(beta)
        # BatchNorm eval: y * w / sqrt(var + eps) + (bias - mean * w / sqrt(var + eps)) = y * gamma + beta
        w1.bn.running_var.fill_(1.0 - w1.bn.eps)
        w1.bn.running_mean.zero_()
        w1.bn.weight.copy_(gamma)
        w1.bn.bias.copy_(beta)
    return [("groupnorm", w3), ("affine_gelu_relu", w1)]


def compiled_chains(a, b, gamma, beta):
    """The workloads' modules with the probe's operands, compiled by fusedepi and by Inductor:
    (chain, backend, a callable running it without autograd, rel err)."""
    rows = []
    # Once a shape, not between the backends: their callables are timed in turn afterwards,
    # and Dynamo keeps one entry a backend (it guards on the backend).
    torch._dynamo.reset()
    for chain, model in _modules(b, gamma, beta):
        with torch.no_grad():
            ref = copy.deepcopy(model).double()(a.double())
        for backend in ("fusedepi", "inductor"):
            compiled = torch.compile(model, backend=backend)

            def call(compiled=compiled):
                with torch.no_grad():
                    return compiled(a)

            reports: list = []
            with collect_reports(reports):
                err = relative_error(call(), ref)
            if backend == "fusedepi" and not any(r.status == "fused" for rep in reports for r in rep.records):
                raise RuntimeError(f"fusedepi did not fuse the {chain} module")
            rows.append((chain, backend, call, err))
    return rows


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


def main() -> int:
    torch.manual_seed(0)
    from fusion_backend.config import load_config

    cache = load_config().cache_dir  # the kernels' cache (FUSEDEPI_CACHE_DIR)
    libs = {v: build(*v, cache) for v in VARIANTS}
    shapes = [(256, 512, 128), (1024, 8192, 8192), (16384, 4096, 4096)]
    ok = True
    for m, n, k in shapes:
        a = torch.rand(m, k, device="cuda", dtype=torch.bfloat16) * 2 - 1
        b = (torch.rand(n, k, device="cuda", dtype=torch.bfloat16) * 2 - 1) / k**0.5
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        gamma = torch.rand(n, device="cuda") + 0.5
        beta = torch.rand(n, device="cuda") - 0.5
        fns = {"cuBLAS mm": lambda: torch.mm(a, b.t())}
        lines = {}
        for (chain, g, cluster, store, offload), dll in libs.items():
            c.fill_(float("nan"))  # a tile the kernel does not write shows
            out = run(dll, a, b, c, gamma, beta)
            torch.cuda.synchronize()
            err = relative_error(out, reference(a, b, chain, gamma, beta))
            good = err < 1e-2
            ok &= good
            what = f"{chain}{g or ''} c{cluster} {store} {'warps' if offload else 'regs'}"
            fns[what] = lambda dll=dll: run(dll, a, b, c, gamma, beta)
            lines[what] = f"{m}x{n}x{k} {what:34s} rel err {err:.2e} {'ok' if good else 'MISMATCH'}"
        if m >= 1024:
            for chain, backend, call, err in compiled_chains(a, b, gamma, beta):
                ok &= err < 1e-2
                what = f"{backend} {chain} module"
                fns[what] = call
                lines[what] = (f"{m}x{n}x{k} {what:34s} rel err {err:.2e} {'ok' if err < 1e-2 else 'MISMATCH'}"
                               f" (Linear without bias)")
        ms = interleaved_ms(fns)
        lib = ms["cuBLAS mm"]
        print(f"{m}x{n}x{k} cuBLAS mm {lib:.4f} ms (medians of {ROUNDS} interleaved rounds)", flush=True)
        for what, line in lines.items():
            print(f"{line}  {ms[what]:.4f} ms  ratio to cuBLAS mm {ms[what] / lib:.3f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
