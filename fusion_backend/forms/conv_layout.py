"""A library conv on channels-last operands.

cuDNN's fast kernels for many convs read and write channels-last memory; given the
graph's contiguous operands it runs older kernels or transposes on both sides (on an
H200, a bf16 transposed conv spent 1.68 ms in cuDNN's nhwcToNchw after a 3.3 ms conv,
and a legacy fp16 kernel took 6.48 ms where the channels-last one took 3.24). Inductor
switches a graph's convs to channels-last by a heuristic; this row times both forms at
the graph's shapes (the conv alone: the fused op asks Inductor for channels-last x and
weight, `ops.input_layouts`, and the measured choice times the chain with the copies
Inductor then makes, where the kernel that makes x does not write it so). The
epilogue kernel then reads the channels-last output and writes the graph's contiguous
layout, one image at a time through shared memory (`Anchor.channels_last`,
`cuda_templates.staged_plan`), a pixel a thread for a reduction over the channels
(`cuda_templates.channels_last_plan`), or, where images do not fit there, a pixel's
channels of a GroupNorm's group as one vector (`render.pixel_group_plan`), or tiles of
pixels x channels for a pointwise or BatchNorm chain (`render.tiled_plan`), so the
transpose costs no pass of its own.
FUSEDEPI_CONV_CHANNELS_LAST switches it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

import cuda_templates
from lowering.spec import EpilogueSpec

from .. import timings
from ..ops import arch_of, channels_last_format, conv_allows_tf32, run_anchor
from .base import Form, conv_op_shapes


class ConvLayout(Form):
    name = "conv_layout"
    setting = "conv_channels_last"
    env = "FUSEDEPI_CONV_CHANNELS_LAST"
    # The epilogue reads the channels-last output in another kernel (staged, pixel
    # groups, tiles), and x and the weight are copied where the graph does not write
    # them so: the conv alone does not decide (`forms.FormChoice.alternative`).
    chain_decides = True

    def candidate(self, chain) -> tuple | None:
        """(anchor, dtype, x's shape, the weight's shape, whether x is channels-last
        already) where the chain's anchor may run channels-last: a 2-D or 3-D library
        conv (not one the direct or the in-kernel conv computes) whose epilogue has a
        channels-last mapping (`cuda_templates.channels_last_plan`)."""
        spec = chain.spec
        if spec.anchor.kind != "conv" or spec.anchor.channels_last or spec.anchor.permuted:
            return None
        xv = chain.operands[0].meta["val"]
        if xv.dim() not in (4, 5):
            return None
        tf32 = spec.dtype == "float32" and conv_allows_tf32()
        if xv.device.type == "cuda" and cuda_templates.anchor_plan(spec, arch_of(xv.device), tf32) is not None:
            return None  # the direct or the in-kernel conv computes it
        staged = replace(spec, anchor=replace(spec.anchor, channels_last=True))
        if isinstance(cuda_templates.channels_last_plan(staged), str):
            return None
        shapes = conv_op_shapes(chain)  # as the fused op takes them
        if shapes is None:
            return None
        return spec.anchor, spec.dtype, *shapes, xv.is_contiguous(memory_format=channels_last_format(xv))

    def describe(self, found) -> str:
        anchor, dtype, x_shape, *_ = found
        return f"the library conv ({dtype}, input {list(x_shape)}) on channels-last operands"

    def key(self, found) -> tuple:
        """What cuDNN's choice of kernel depends on: the shapes, the conv's parameters,
        and the TF32 and benchmark settings."""
        anchor, dtype, x_shape, w_shape, x_channels_last = found
        tf32 = dtype == "float32" and conv_allows_tf32()
        return (dtype, x_shape, x_channels_last, w_shape, anchor.has_bias, anchor.conv, tf32,
                torch.backends.cudnn.benchmark)

    def measure(self, found, device) -> tuple[float, float]:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        anchor, dtype, x_shape, w_shape, x_channels_last = found
        dtype = getattr(torch, dtype)
        # Real tensors, even where the compile runs under a fake mode.
        with unset_fake_temporarily(), torch.cuda.device(device), torch.no_grad():
            x = torch.randn(x_shape, device=device, dtype=dtype)
            if x_channels_last:
                x = x.contiguous(memory_format=channels_last_format(x))
            operands = [x, torch.randn(w_shape, device=device, dtype=dtype)]
            if anchor.has_bias:
                # transposed: the weight is [in, out / groups, ...]
                out_channels = w_shape[1] * anchor.conv[5] if anchor.conv[3] else w_shape[0]
                operands.append(torch.randn(out_channels, device=device, dtype=dtype))
            plain, staged = replace(anchor, channels_last=False), replace(anchor, channels_last=True)
            # The fused op asks Inductor for channels-last x and weight (`ops.input_layouts`),
            # which writes them in the kernel that makes x, or copies them with a kernel of
            # its own that the measured choice times with the chain; this times the conv.
            layout = channels_last_format(operands[0])
            last = [t.contiguous(memory_format=layout) if t.dim() == operands[0].dim() else t for t in operands]
            return timings.compare_ms([lambda: run_anchor(plain, operands, for_kernels=True).contiguous(),
                                       lambda: run_anchor(staged, last, for_kernels=True)], device)

    def apply(self, chain, found: tuple) -> EpilogueSpec:
        return replace(chain.spec, anchor=replace(chain.spec.anchor, channels_last=True))

    def applied(self, spec: EpilogueSpec) -> bool:
        return spec.anchor.channels_last
