"""An in-kernel conv with a norm, run twice: the tiles' moments first, then the conv again
with the norm applied in its tiles, so that the conv's value is never written.

With a norm (BatchNorm in training, a GroupNorm, InstanceNorm or LayerNorm over whole
channels) the in-kernel conv's tiles write the conv's value and their moments, and the
file's apply kernel normalizes the output in place: the conv's output is written, read
and written again. Recomputed (`Anchor.recompute`), the first launch writes only the
moments, a kernel merges them into the norm's statistics, and the second launch
computes the conv again and writes the chain's result once: x is read twice and the
conv's mainloop runs twice instead. That pays where the conv's output is the larger
tensor and its mainloop is short (few input channels, a small kernel), and costs where
the mainloop dominates, so under "auto" this row is timed as the whole chain both ways
(`Form.timed_as_chain`) wherever the measured choice times the chain. On an H200 it
measured slower on every zoo chain it was timed on (1.08-1.62x the stored form's time:
the moments pass alone takes nearly the stored pass's time on those small convs,
benchmarks/NOTES.md), so FUSEDEPI_CONV_RECOMPUTE is "0" (never) unless set ("auto";
"1": every candidate).
"""

from __future__ import annotations

import cuda_templates
from lowering.spec import EpilogueSpec

from .base import Form, conv_found, conv_in_words


class ConvRecompute(Form):
    name = "conv_recompute"
    setting = "conv_recompute"
    env = "FUSEDEPI_CONV_RECOMPUTE"
    chain_decides = True
    timed_as_chain = True

    def candidate(self, chain) -> tuple | None:
        """(dtype, x's shape, the weight's shape, TF32) where the chain runs in the
        in-kernel conv (an earlier row's form, or FUSEDEPI_IN_KERNEL_CONV=1) with a norm
        whose statistics its tiles take, on its GPU."""
        spec = chain.spec
        if (spec.anchor.kind != "conv" or not spec.anchor.implicit or spec.anchor.recompute
                or spec.reduction is None):
            return None
        recomputed = spec.with_norm_recomputed()
        return conv_found(chain, lambda arch, tf32: isinstance(cuda_templates.conv_gemm_plan(recomputed, arch, tf32),
                                                                cuda_templates.ConvGemmPlan))

    def describe(self, found) -> str:
        return f"the in-kernel conv with its norm recomputed ({conv_in_words(found)})"

    def key(self, found) -> tuple:
        return found

    def measure(self, found, device) -> tuple[float, float]:
        raise NotImplementedError("timed as the whole chain both ways (timed_as_chain)")

    def apply(self, chain, found) -> EpilogueSpec:
        return chain.spec.with_norm_recomputed()

    def applied(self, spec: EpilogueSpec) -> bool:
        return spec.anchor.recompute
