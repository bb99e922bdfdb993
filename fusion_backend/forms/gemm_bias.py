"""A float32 Linear chain's library GEMM as `mm`, its bias added in the epilogue.

cuBLAS picks its kernel per call form, and at some shapes its `mm` kernel is much faster
than its `addmm` one (on an H200, float32 818368 x 201 x 127: `addmm` 1.153 ms with a
256 x 64 tile, `mm` 0.965 ms with 128 x 128). Inductor's graphs run `mm`
there and add the bias in their Triton epilogue. The matcher already moves a float32 bias
into the epilogue under TF32, where `mm` was measured faster (`lowering.matcher._fold_bias`);
in exact float32 this row times both forms at the graph's shapes. Both forms round the
float32 sum of product and bias once, so the result differs only by the kernels'
summation order, as between any two cuBLAS kernels. 16-bit chains keep `addmm` (`mm`
would round the product before the bias is added). FUSEDEPI_FOLD_GEMM_BIAS switches it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import cuda_templates
from lowering import linear_form
from lowering.spec import CHANNEL, Anchor, EpilogueSpec, Step

from .. import timings
from ..ops import arch_of, matmul_allows_tf32, run_anchor
from .base import Form


class GemmBias(Form):
    name = "gemm_bias"
    setting = "fold_gemm_bias"
    env = "FUSEDEPI_FOLD_GEMM_BIAS"

    def candidate(self, chain) -> tuple[int, int, int] | None:
        """(M, K, N) where the chain's float32 `addmm` may run as `mm` with the bias in
        the epilogue: a Linear's form (`lowering.linear_form`) on the library path, and
        no values saved for backward (one may be the GEMM's output with its bias)."""
        spec = chain.spec
        if spec.anchor.kind != "addmm" or spec.dtype != "float32" or spec.saves or spec.anchor.pad:
            return None
        bias, x, wt = chain.operands
        if not linear_form(x, wt, bias):
            return None
        xv = x.meta["val"]
        if xv.device.type == "cuda" and isinstance(cuda_templates.gemm_plan(spec, arch_of(xv.device)),
                                                   cuda_templates.GemmPlan):
            return None  # the in-kernel GEMM takes it while TF32 is allowed, and the launcher decides per call
        shape = timings.example_shape(xv)
        if shape is None:
            return None
        return shape[0], shape[1], int(wt.meta["val"].shape[1])

    def describe(self, found) -> str:
        return "the float32 GEMM {}x{}x{} as mm, its bias added in the epilogue".format(*found)

    def key(self, found) -> tuple:
        return (*found, matmul_allows_tf32())

    def measure(self, found, device) -> tuple[float, float]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        m, k, n = found
        # Real tensors, even where the compile runs under a fake mode.
        with unset_fake_temporarily(), torch.cuda.device(device), torch.no_grad():
            x = torch.randn(m, k, device=device)
            wt = torch.randn(n, k, device=device).t()
            bias = torch.randn(n, device=device)
            return timings.compare_ms([lambda: run_anchor(Anchor("addmm"), [bias, x, wt]),
                                       lambda: run_anchor(Anchor("mm"), [x, wt])], device)

    def apply(self, chain, found: tuple) -> EpilogueSpec:
        """The anchor becomes `mm` and the chain's first step adds the bias, which moves
        from `chain.operands` to the end of `chain.params`."""
        spec = chain.spec
        bias = chain.operands.pop(0)
        chain.params.append(bias)
        add = Step("add", inputs=(len(spec.param_dtypes),), operand=CHANNEL, reverse=True)
        folded = spec.with_first_step(add, str(bias.meta["val"].dtype).removeprefix("torch."))
        return replace(folded, anchor=replace(spec.anchor, kind="mm"))
