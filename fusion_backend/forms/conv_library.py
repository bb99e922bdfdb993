"""The library conv, and the epilogue kernel after it, for a conv that the file's direct
conv would compute.

The matcher marks a conv the direct conv may take (`Anchor.direct`), and where its plan
applies (`cuda_templates.direct_plan`: stride 1, few input channels, FMA or mma tiles)
the direct conv computes it in the chain's kernel, the conv's output never written. That
wins by several times where the library conv is slow for the shape (an RGB stem:
`conv2d_relu` bf16, 0.063 against Inductor's 0.329 ms on an H200), and can lose where it
is not: a Conv1d(32, 64, 3) over 2048 columns with ReLU and GroupNorm (bf16, batch 64,
H200) took 0.073 ms in the direct conv where the library conv and the epilogue kernel
had taken 0.062 (with this row: 0.061, the library conv taken). Which wins depends on
the library conv's speed at the shape, so this
row is timed as the whole chain both ways (`Form.timed_as_chain`): where the measured
choice times the chain, it keeps the faster; elsewhere the direct conv runs as before.
It comes before the layout and in-kernel conv rows, which then see a library conv
(`Anchor.library`) and may take their forms from it: each spec a row took is timed and
the fastest kept. FUSEDEPI_LIBRARY_CONV switches it ("on": the library conv always).
"""

from __future__ import annotations

from dataclasses import replace

import cuda_templates
from lowering.spec import EpilogueSpec

from .base import Form, conv_found, conv_in_words


class ConvLibrary(Form):
    name = "library_conv"
    setting = "library_conv"
    env = "FUSEDEPI_LIBRARY_CONV"
    chain_decides = True
    timed_as_chain = True

    def candidate(self, chain) -> tuple | None:
        """(dtype, x's shape, the weight's shape, TF32) as the fused op takes them, where
        the direct conv would compute the chain's conv on its GPU."""
        spec = chain.spec
        anchor = spec.anchor
        if anchor.kind != "conv" or not anchor.direct or anchor.implicit or anchor.library:
            return None
        return conv_found(chain, lambda arch, tf32: isinstance(cuda_templates.direct_plan(spec, arch, tf32),
                                                                cuda_templates.DirectPlan))

    def describe(self, found) -> str:
        return f"the library conv ({conv_in_words(found)}) and the epilogue kernel instead of the direct conv"

    def key(self, found) -> tuple:
        return found

    def apply(self, chain, found) -> EpilogueSpec:
        return replace(chain.spec, anchor=replace(chain.spec.anchor, library=True))

    def applied(self, spec: EpilogueSpec) -> bool:
        return spec.anchor.library
