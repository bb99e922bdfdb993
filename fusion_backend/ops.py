"""The fused op `fusedepi::chain`: anchor + epilogue in one call.

A `torch.library` custom op with three implementations: the plain-torch reference
(CPU, and the definition of what the op computes), a fake one (shapes only, for
tracing) and the CUDA one (library GEMM/conv, then the rendered epilogue kernels).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import cuda_templates
from lowering import EpilogueSpec, run_reference
from lowering.spec import FULL, Anchor

aten = torch.ops.aten


def run_anchor(anchor: Anchor, operands: list[torch.Tensor]) -> torch.Tensor:
    """The anchor op exactly as the graph had it (so matmul precision settings apply)."""
    if anchor.kind == "addmm":
        return aten.addmm.default(*operands)
    if anchor.kind == "mm":
        return aten.mm.default(*operands)
    x, w = operands[:2]
    b = operands[2] if anchor.has_bias else None
    return aten.convolution.default(x, w, b, *anchor.conv)


def reference(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """What `fusedepi::chain` computes, in plain torch."""
    parsed = _parse(spec)
    n = parsed.anchor.n_operands
    y = run_anchor(parsed.anchor, list(inputs[:n]))
    return run_reference(y, parsed.steps, list(inputs[n:]))


@torch.library.custom_op("fusedepi::chain", mutates_args=())
def chain(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """Runs a fused chain; `spec` is an `EpilogueSpec` as JSON. This body serves CPU tensors."""
    return reference(inputs, spec)


@chain.register_fake
def _chain_fake(inputs, spec):
    return reference(inputs, spec)


_specs: dict[str, EpilogueSpec] = {}
_kernels: dict[tuple, cuda_templates.Library] = {}
_kernels_lock = threading.Lock()


def _parse(spec: str) -> EpilogueSpec:
    parsed = _specs.get(spec)
    if parsed is None:
        parsed = _specs[spec] = EpilogueSpec.from_json(spec)
    return parsed


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def kernel_for(spec: str, device: torch.device, cache_dir: Path) -> cuda_templates.Library:
    """Renders, compiles (or finds in the cache) and loads the kernel for `spec`.

    Raises:
        cuda_templates.NotRenderable: no template covers the spec.
        cuda_templates.CompileError: nvcc failed or is missing.
    """
    arch = arch_of(device)
    key = (spec, arch, str(cache_dir))
    lib = _kernels.get(key)
    if lib is None:
        parsed = _parse(spec)
        source = cuda_templates.render(parsed, arch)
        lib = cuda_templates.load(source, parsed.kernel_name(arch), arch, cache_dir)
        with _kernels_lock:
            _kernels[key] = lib
    return lib


def _aligned(t: torch.Tensor) -> torch.Tensor:
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@chain.register_kernel("cuda")
def _chain_cuda(inputs, spec):
    from .config import load_config

    parsed = _parse(spec)
    n = parsed.anchor.n_operands
    y = run_anchor(parsed.anchor, list(inputs[:n])).contiguous()
    device = y.device
    lib = kernel_for(spec, device, load_config().cache_dir)
    params = list(inputs[n:])
    for step in parsed.steps:
        if step.operand == FULL:
            params[step.inputs[0]] = _aligned(params[step.inputs[0]])
    params = [p.contiguous() for p in params]
    rows = y.shape[0]
    if parsed.row_output:
        red = parsed.reduction
        out = torch.empty((rows, 1) if red.keepdim else (rows,), dtype=y.dtype, device=device)
    else:
        out = torch.empty_like(y)
    extras = []
    bn = next((s for s in parsed.steps if s.name == "batchnorm_train"), None)
    if bn is not None:
        extras = [torch.empty_like(params[bn.inputs[2]]), torch.empty_like(params[bn.inputs[3]])]
    ws_floats = lib.workspace_floats(rows)
    ws = torch.empty(max(ws_floats, 1), dtype=torch.float32, device=device)
    pointers = [y.data_ptr(), out.data_ptr()] + [t.data_ptr() for t in extras + params] + [ws.data_ptr()]
    lib.run(pointers, rows, device.index, torch.cuda.current_stream(device).cuda_stream)
    return [out] + extras
