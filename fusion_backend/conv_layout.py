"""Whether a chain's library conv runs on channels-last operands.

cuDNN's fast kernels for many convs read and write channels-last memory; given the
graph's contiguous operands it runs older kernels or transposes on both sides
(on an H200, a bf16 transposed conv spent 1.68 ms in cuDNN's nhwcToNchw after a 3.3 ms
conv, and a legacy fp16 kernel took 6.48 ms where the channels-last one took 3.24). Inductor switches a graph's convs to channels-last by a
heuristic; here both forms are timed at the graph's shapes while compiling (the
channels-last one with its copies of x and the weight), and the faster one runs. The
epilogue kernel then reads the channels-last output and writes the graph's contiguous
layout, one image at a time through shared memory (`Anchor.channels_last`,
`cuda_templates.staged_plan`), so the transpose costs no pass of its own.
FUSEDEPI_CONV_CHANNELS_LAST chooses: "auto" times both forms (cached on disk per GPU
and shape), "on" takes every candidate, "off" none. The decision is in the spec, so
`explain` shows it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

import cuda_templates

from . import timings
from .config import Config
from .ops import arch_of, channels_last_format, conv_allows_tf32, run_anchor

CACHE_FILE = "conv_layout.json"


def candidate(chain) -> tuple[tuple, tuple, bool] | None:
    """(x's shape, the weight's shape, whether x is channels-last already) when `chain`'s
    anchor may run channels-last, else None.

    Candidates: a 2-D or 3-D library conv (not one the direct conv kernel computes)
    whose epilogue has a channels-last mapping (`cuda_templates.staged_plan`).
    """
    spec = chain.spec
    if spec.anchor.kind != "conv" or spec.anchor.channels_last:
        return None
    xv, wv = chain.operands[0].meta["val"], chain.operands[1].meta["val"]
    if xv.dim() not in (4, 5):
        return None
    if xv.device.type == "cuda" and isinstance(cuda_templates.direct_plan(spec, arch_of(xv.device)),
                                               cuda_templates.DirectPlan):
        return None
    staged = replace(spec, anchor=replace(spec.anchor, channels_last=True))
    if isinstance(cuda_templates.staged_plan(staged), str):
        return None
    x_shape, w_shape = timings.example_shape(xv), timings.example_shape(wv)
    if x_shape is None or w_shape is None:
        return None
    return x_shape, w_shape, xv.is_contiguous(memory_format=channels_last_format(xv))


def decide(chain, cfg: Config):
    """`chain.spec` with `Anchor.channels_last` set where FUSEDEPI_CONV_CHANNELS_LAST and,
    under "auto", a timing of both forms say so; else `chain.spec` itself."""
    if cfg.conv_channels_last == "off":
        return chain.spec
    found = candidate(chain)
    if found is None:
        return chain.spec
    anchor = chain.spec.anchor
    device = chain.operands[0].meta["val"].device
    if not timings.takes_other_form(
            cfg.conv_channels_last, device, cfg.strict,
            lambda: timed(anchor, chain.spec.dtype, *found, device, cfg.cache_dir),
            f"the library conv at {chain.anchor.name} ({chain.spec.dtype}, input {list(found[0])}) on channels-last "
            "operands"):
        return chain.spec
    return replace(chain.spec, anchor=replace(anchor, channels_last=True))


def timed(anchor, dtype: str, x_shape: tuple, w_shape: tuple, x_channels_last: bool, device: torch.device,
          cache_dir: Path) -> tuple[float, float]:
    """(ms as the graph has it, ms channels-last) of one conv call with its copies, from
    the disk cache or measured now (`timings.best_ms`). The key holds what cuDNN's
    choice of kernel depends on: the GPU, torch, the shapes, the conv's parameters,
    and the TF32 and benchmark settings."""
    tf32 = dtype == "float32" and conv_allows_tf32()
    key = "|".join(str(part) for part in (
        torch.cuda.get_device_name(device), torch.__version__, dtype, x_shape, x_channels_last, w_shape,
        anchor.has_bias, anchor.conv, tf32, torch.backends.cudnn.benchmark))
    return timings.cached(Path(cache_dir) / CACHE_FILE, key,
                          lambda: _measure(anchor, getattr(torch, dtype), x_shape, w_shape, x_channels_last, device))


def _measure(anchor, dtype, x_shape, w_shape, x_channels_last, device) -> tuple[float, float]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # Real tensors, even where the compile runs under a fake mode.
    with unset_fake_temporarily(), torch.cuda.device(device), torch.no_grad():
        x = torch.randn(x_shape, device=device, dtype=dtype)
        if x_channels_last:
            x = x.contiguous(memory_format=channels_last_format(x))
        operands = [x, torch.randn(w_shape, device=device, dtype=dtype)]
        if anchor.has_bias:
            out_channels = w_shape[1] * anchor.conv[5] if anchor.conv[3] else w_shape[0]  # transposed: [in, out / groups, ...]
            operands.append(torch.randn(out_channels, device=device, dtype=dtype))
        plain, staged = replace(anchor, channels_last=False), replace(anchor, channels_last=True)
        return (timings.best_ms(lambda: run_anchor(plain, operands, for_kernels=True).contiguous()),
                timings.best_ms(lambda: run_anchor(staged, operands, for_kernels=True)))
