"""A 16-bit in-kernel GEMM whose consumer warps run the pointwise chain on every tile.

The in-kernel GEMM (`cuda_templates.gemm_sm90`) hands each tile but a CTA's last to the
producer warpgroup's three spare warps where every CTA has several tiles, so that the
chain runs under the next tile's `wgmma`. Three warps are few for a chain of
transcendental steps: on an H100 at bf16 (8192 rows, `FUSEDEPI_AUTOTUNE=off`, kernel
alone), `tanh(Linear(768, 3072)(x)) * 2` took 129 us with the spare warps and 80 us
with the consumers (cuBLAS alone 59 us), GPT-2's `gelu_new` 139 against 86 us, and
`gelu(Linear(1024, 4096)(x))` 145 against 135 us. Where the mainloop is long, the spare
warps hide the chain: workload 1's eval chain (K = 4096, BatchNorm, erf GELU, ReLU) ran
at 1.09-1.10x the library GEMM alone in them on an H200. Which wins depends on the
chain's cost against the mainloop's, so this row is timed as the whole chain both ways
(`Form.timed_as_chain`): where the measured choice times the chain, it takes the
faster kernel; elsewhere the spare warps run it as before.
FUSEDEPI_GEMM_CONSUMERS switches it ("on": the consumers always).
"""

from __future__ import annotations

from dataclasses import replace

import torch

import cuda_templates
from cuda_templates import gemm_sm90
from lowering.spec import EpilogueSpec

from .. import timings
from ..ops import arch_of
from .base import Form


class GemmConsumers(Form):
    name = "gemm_consumers"
    setting = "gemm_consumers"
    env = "FUSEDEPI_GEMM_CONSUMERS"
    chain_decides = True
    timed_as_chain = True

    def candidate(self, chain) -> tuple | None:
        """(rows, K, N, dtype) where the chain runs as a 16-bit in-kernel GEMM with a
        pointwise chain, and its rows (a dynamic size's hint) give every CTA enough
        tiles for the spare warps to take the chain (`gemm_sm90.spare_warps_run`)."""
        spec = chain.spec
        if spec.anchor.kind not in ("addmm", "mm") or not spec.anchor.gemm or spec.anchor.gemm_consumers:
            return None
        if spec.dtype not in ("bfloat16", "float16"):
            return None  # float32 tiles are staged in two rounds: the consumers run the chain already
        x = chain.operands[-2].meta["val"]
        if x.device.type != "cuda":
            return None
        plan = cuda_templates.gemm_plan(spec, arch_of(x.device))
        if not isinstance(plan, cuda_templates.GemmPlan) or plan.group or plan.reduce:
            return None
        shape = timings.example_shape(x)
        if shape is None or len(shape) != 2:
            return None
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
        rows, every_call = shape[0], spec.anchor.gemm[1]
        if not every_call and not gemm_sm90.fills_gpu(rows, spec.channels, sms):
            return None  # the library GEMM runs first at these rows
        if not gemm_sm90.spare_warps_run(rows, spec.channels, sms):
            return None
        return rows, spec.anchor.gemm[0], spec.channels, spec.dtype

    def describe(self, found) -> str:
        return "the in-kernel GEMM ({3}, {0}x{1}x{2}) with its chain in the consumer warps".format(*found)

    def key(self, found) -> tuple:
        return found

    def measure(self, found, device) -> tuple[float, float]:
        raise NotImplementedError("timed as the whole chain both ways (timed_as_chain)")

    def apply(self, chain, found) -> EpilogueSpec:
        return replace(chain.spec, anchor=replace(chain.spec.anchor, gemm_consumers=True))

    def applied(self, spec: EpilogueSpec) -> bool:
        return spec.anchor.gemm_consumers
