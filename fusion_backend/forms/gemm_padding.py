"""A 16-bit library GEMM on operands padded to aligned K and N.

cuBLAS's fast Hopper kernels read and write through the tensor memory accelerator,
which needs 16-byte aligned rows. A 16-bit x[M, K] @ w[N, K]^T whose K or N is not a
multiple of 8 gets older kernels instead, 2-3x slower at large M (on an H200, bf16
808512 x 151 x 513 took 2.07 ms in cuBLAS, against 0.64 ms for the same product padded
to 152 x 520, plus 0.17 ms to pad x). Inductor pads such GEMMs where its timing says
so; this row does the same for the GEMMs inside fused chains.

The padded form (`Anchor.pad`, run by `ops.padded_gemm`) copies x into a zeroed
[M, k_to] buffer when K is misaligned, and w and the bias into zeroed [n_to, k_to] and
[n_to] ones; the epilogue kernels then read the product's rows n_to elements apart.
FUSEDEPI_PAD_GEMM switches it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import cuda_templates
from lowering import linear_form
from lowering.spec import Anchor, EpilogueSpec

from .. import timings
from ..ops import arch_of, run_anchor
from .base import Form

ALIGN = 8  # elements: 16 bytes of a 16-bit type
PADDED_DTYPES = ("float16", "bfloat16")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class GemmPadding(Form):
    name = "gemm_padding"
    setting = "pad_gemm"
    env = "FUSEDEPI_PAD_GEMM"

    def candidate(self, chain) -> tuple | None:
        """(kind, dtype, M, K, N, k_to, n_to) where the chain's anchor may run padded: a
        16-bit addmm/mm of a Linear's form (`lowering.linear_form`) on the library path
        whose K or N is not a multiple of 8. N stays as it is when the chain saves values
        for backward (one of them may be the GEMM's output itself, which the launcher
        hands out as a contiguous tensor)."""
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
        k_to = _round_up(k, ALIGN)
        n_to = n if spec.saves else _round_up(n, ALIGN)
        if shape is None or (k_to, n_to) == (k, n):
            return None
        return spec.anchor.kind, spec.dtype, shape[0], k, n, k_to, n_to

    def describe(self, found) -> str:
        kind, dtype, m, k, n, k_to, n_to = found
        return f"the library GEMM {m}x{k}x{n} ({dtype}) padded to K={k_to}, N={n_to}"

    def key(self, found) -> tuple:
        return found

    def measure(self, found, device) -> tuple[float, float]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        kind, dtype, m, k, n, k_to, n_to = found
        dtype = getattr(torch, dtype)
        # Real tensors, even where the compile runs under a fake mode.
        with unset_fake_temporarily(), torch.cuda.device(device), torch.no_grad():
            x = torch.randn(m, k, device=device, dtype=dtype)
            wt = torch.randn(n, k, device=device, dtype=dtype).t()
            operands = ([torch.randn(n, device=device, dtype=dtype)] if kind == "addmm" else []) + [x, wt]
            plain, padded = Anchor(kind), Anchor(kind, pad=(k_to, n_to))
            return timings.compare_ms([lambda: run_anchor(plain, operands),
                                       lambda: run_anchor(padded, operands, for_kernels=True)], device)

    def apply(self, chain, found: tuple) -> EpilogueSpec:
        *_, k_to, n_to = found
        return replace(chain.spec, anchor=replace(chain.spec.anchor, pad=(k_to, n_to), gemm=()))
