"""Whether a chain's library GEMM runs on operands padded to aligned K and N.

cuBLAS's fast Hopper kernels read and write through the tensor memory accelerator,
which needs 16-byte aligned rows. A 16-bit x[M, K] @ w[N, K]^T whose K or N is not a
multiple of 8 gets older kernels instead, 2-3x slower at large M (on an H200, bf16
808512 x 151 x 513 took 2.07 ms in cuBLAS, against 0.64 ms for the same product padded
to 152 x 520, plus 0.17 ms to pad x). Inductor pads such
GEMMs where its timing says so; this does the same for the GEMMs inside fused chains.

The padded form (`Anchor.pad`, run by `ops.padded_gemm`) copies x into a zeroed
[M, k_to] buffer when K is misaligned, and w and the bias into zeroed [n_to, k_to] and
[n_to] ones; the epilogue kernels then read the product's rows n_to elements apart.
FUSEDEPI_PAD_GEMM chooses: "auto" times both forms at the graph's shapes at compile
time (on the GPU, cached on disk per device and shape), "on" pads every candidate,
"off" none. The decision is in the spec, so `explain` shows it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

import cuda_templates
from lowering import linear_form

from . import timings
from .config import Config
from .ops import arch_of, run_anchor

ALIGN = 8  # elements: 16 bytes of a 16-bit type
PADDED_DTYPES = ("float16", "bfloat16")
CACHE_FILE = "gemm_padding.json"


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def candidate(chain) -> tuple[int, int, int, int, int] | None:
    """(M, K, N, k_to, n_to) when `chain`'s anchor may run padded, else None.

    Candidates: a 16-bit addmm/mm of a Linear's form (`lowering.linear_form`) on the
    library path whose K or N is not a multiple of 8. N stays as it is when the chain
    saves values for backward (one of them may be the GEMM's output itself, which the
    launcher hands out as a contiguous tensor).
    """
    spec = chain.spec
    if spec.anchor.kind not in ("addmm", "mm") or spec.dtype not in PADDED_DTYPES or spec.anchor.pad:
        return None
    bias = chain.operands[0] if spec.anchor.kind == "addmm" else None
    x, wt = chain.operands[-2], chain.operands[-1]
    if not linear_form(x, wt, bias):
        return None
    xv = x.meta["val"]
    if xv.device.type == "cuda" and isinstance(cuda_templates.gemm_plan(spec, arch_of(xv.device)),
                                               cuda_templates.GemmPlan):
        return None  # the in-kernel GEMM computes it (it needs K and N aligned anyway)
    k, n = int(xv.shape[1]), int(wt.meta["val"].shape[1])
    shape = timings.example_shape(xv)
    m = shape[0] if shape is not None else None
    k_to = _round_up(k, ALIGN)
    n_to = n if spec.saves else _round_up(n, ALIGN)
    if m is None or (k_to, n_to) == (k, n):
        return None
    return m, k, n, k_to, n_to


def decide(chain, cfg: Config):
    """`chain.spec` with `Anchor.pad` set where FUSEDEPI_PAD_GEMM and, under "auto", a
    timing of both forms say so; else `chain.spec` itself."""
    if cfg.pad_gemm == "off":
        return chain.spec
    found = candidate(chain)
    if found is None:
        return chain.spec
    m, k, n, k_to, n_to = found
    device = chain.operands[-2].meta["val"].device
    if not timings.takes_other_form(
            cfg.pad_gemm, device, cfg.strict,
            lambda: timed(chain.spec.anchor.kind, chain.spec.dtype, m, k, n, k_to, n_to, device, cfg.cache_dir),
            f"the library GEMM {m}x{k}x{n} ({chain.spec.dtype}) padded to K={k_to}, N={n_to}"):
        return chain.spec
    return replace(chain.spec, anchor=replace(chain.spec.anchor, pad=(k_to, n_to), gemm=()))


def timed(kind: str, dtype: str, m: int, k: int, n: int, k_to: int, n_to: int, device: torch.device,
          cache_dir: Path) -> tuple[float, float]:
    """(ms as the graph has it, ms padded) of one GEMM call with its padding copies,
    from the disk cache or measured now (`timings.best_ms`)."""
    key = "|".join(str(part) for part in (torch.cuda.get_device_name(device), torch.__version__, kind, dtype,
                                          m, k, n, k_to, n_to))
    return timings.cached(Path(cache_dir) / CACHE_FILE, key,
                          lambda: _measure(kind, getattr(torch, dtype), m, k, n, k_to, n_to, device))


def _measure(kind, dtype, m, k, n, k_to, n_to, device) -> tuple[float, float]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from lowering.spec import Anchor

    # Real tensors, even where the compile runs under a fake mode.
    with unset_fake_temporarily(), torch.cuda.device(device), torch.no_grad():
        x = torch.randn(m, k, device=device, dtype=dtype)
        wt = torch.randn(n, k, device=device, dtype=dtype).t()
        operands = ([torch.randn(n, device=device, dtype=dtype)] if kind == "addmm" else []) + [x, wt]
        plain, padded = Anchor(kind), Anchor(kind, pad=(k_to, n_to))
        return (timings.best_ms(lambda: run_anchor(plain, operands)),
                timings.best_ms(lambda: run_anchor(padded, operands, for_kernels=True)))
