"""The conv computed inside the chain's own kernel (the in-kernel conv, an implicit GEMM
on sm_90: `cuda_templates.conv_sm90`).

A 2-D or 3-D conv (groups 1, any dilation, strides up to 8) that the direct conv does not take,
with a pointwise chain or a norm over whole channels (or, where conv_sm90's switches
allow, a spatial reduction, a softmax or reduction over each pixel's channels, or a
pooling window after a pointwise chain), runs as
one kernel that gathers channels-last x by TMA, multiplies on the tensor cores and
applies the chain to each output tile before writing it once, in the graph's layout.
Whether that beats the library conv (cuDNN, in the graph's layout or channels-last) and
the epilogue kernel depends on the shapes: on an H100 at 128 x 64 x 128 x 128 -> 128
channels, k 3, the in-kernel conv took 0.76 ms (bf16) where cuDNN alone took 0.46, and
its narrower outputs pay more for the finish of each tile. So this row has no library
call to time (`Form.timed_as_chain`): where the measured choice times the chain, it
times the chain with the in-kernel conv and in the form the earlier rows left (the
library conv in the graph's layout, or channels-last where `conv_layout` took it), and
keeps the faster; elsewhere the library conv runs. FUSEDEPI_IN_KERNEL_CONV switches it
("1": the matcher marks every candidate, untimed; "0": never).
"""

from __future__ import annotations

import cuda_templates
from lowering.spec import EpilogueSpec

from .base import Form, conv_found, conv_in_words


class ConvImplicit(Form):
    name = "in_kernel_conv"
    setting = "in_kernel_conv"
    env = "FUSEDEPI_IN_KERNEL_CONV"
    chain_decides = True
    timed_as_chain = True

    def candidate(self, chain) -> tuple | None:
        """(dtype, x's shape, the weight's shape, TF32) where the in-kernel conv covers
        the chain on its GPU (`cuda_templates.conv_gemm_plan`, TF32 as cuDNN's setting
        allows), in the graph's layout or channels-last."""
        spec = chain.spec
        anchor = spec.anchor
        if anchor.kind != "conv" or not anchor.direct or anchor.implicit or anchor.permuted:
            return None
        # (a Conv1d as a 2-D conv's row; a 3-D conv by planes of its output's depth)
        if chain.operands[0].meta["val"].dim() + anchor.as_2d - bool(anchor.depth) != 4:
            return None
        implicit = spec.with_in_kernel_conv()
        return conv_found(chain, lambda arch, tf32: isinstance(cuda_templates.conv_gemm_plan(implicit, arch, tf32),
                                                                cuda_templates.ConvGemmPlan))

    def describe(self, found) -> str:
        return f"the in-kernel conv ({conv_in_words(found)})"

    def key(self, found) -> tuple:
        return found

    def measure(self, found, device) -> tuple[float, float]:
        raise NotImplementedError("timed as the whole chain both ways (timed_as_chain)")

    def apply(self, chain, found) -> EpilogueSpec:
        return chain.spec.with_in_kernel_conv()

    def applied(self, spec: EpilogueSpec) -> bool:
        return spec.anchor.implicit
