"""Every environment variable fusedepi reads, read here and nowhere else."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from lowering.spec import ANCHOR_FORMS as _ANCHOR_FORMS
from lowering.spec import FUSION_NAMES as _FUSION_NAMES
from lowering.vocabulary import VOCABULARY

FUSION_NAMES = frozenset(_FUSION_NAMES)
STEP_NAMES = frozenset(VOCABULARY)
ANCHOR_FORMS = frozenset(_ANCHOR_FORMS)

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Config:
    """fusedepi's settings.

    Attributes:
        disabled: fusion names, step names and anchor forms not to use (FUSEDEPI_DISABLE).
        disable_all: FUSEDEPI_DISABLE=all: everything goes to Inductor.
        cache_dir: where compiled kernels live (FUSEDEPI_CACHE_DIR).
        strict: a lowering or compile failure raises (FUSEDEPI_STRICT=1).
        log_level: level of the "fusedepi" logger (FUSEDEPI_LOG_LEVEL).
        cpu_reference: fuse chains on CPU tensors too, running the plain-torch
            reference (FUSEDEPI_CPU_REFERENCE=1); for testing the rewrite.
        in_kernel_gemm: which Linear chains run as one kernel that also computes the
            GEMM, on sm_90 (FUSEDEPI_IN_KERNEL_GEMM, README; float32 in TF32, while the
            matmul precision allows it): "auto" (the default: 16-bit pointwise chains and
            row reductions, float32 row reductions, at the calls whose rows fill the GPU
            with tiles), "on" (every chain the kernel covers, every call) or "off".
        in_kernel_conv: whether a 2-D conv (groups 1, strides up to 8) that the direct conv does not take
            runs, with a pointwise chain, in one kernel that also computes the conv, on
            sm_90 (FUSEDEPI_IN_KERNEL_CONV, README "In-kernel conv"): "auto" (the default:
            where the measured choice times the chain, it is timed with the in-kernel
            conv and with the library conv, and the faster kept), "on" (every candidate,
            untimed) or "off".
        native_launcher: launch fused ops on CUDA from C++ (FUSEDEPI_NATIVE_LAUNCHER,
            default on): built once per torch version at the first compile of a CUDA
            chain, then loaded for the rest of the process.
        pad_gemm: whether a 16-bit library GEMM whose K or N is not a multiple of 8 runs
            on operands padded with zeros (FUSEDEPI_PAD_GEMM): "auto" (the default: where
            timing both forms at compile time says padding is faster), "on" (wherever
            misaligned) or "off".
        fold_gemm_bias: whether a float32 Linear chain's library GEMM runs as `mm` with
            its bias added in the epilogue (FUSEDEPI_FOLD_GEMM_BIAS): "auto" (the default:
            where timing both forms at compile time says `mm` is faster), "on" (every
            candidate) or "off". (Under TF32 the matcher moves the bias anyway.)
        conv_channels_last: whether a 2-D or 3-D library conv runs on channels-last
            operands (FUSEDEPI_CONV_CHANNELS_LAST): "auto" (the default: where timing both
            forms at compile time says channels-last is faster), "on" (every candidate)
            or "off".
        library_conv: whether a conv that the direct conv would compute runs in the library
            conv, the epilogue kernel after it (FUSEDEPI_LIBRARY_CONV): "auto" (the
            default: where the measured choice times the chain, it is timed both ways and
            the faster kept), "on" (always) or "off" (the direct conv, untimed).
        gemm_consumers: whether a 16-bit in-kernel GEMM's consumer warps run its pointwise
            chain on every tile instead of the producer's spare warps
            (FUSEDEPI_GEMM_CONSUMERS): "auto" (the default: where the measured choice
            times the chain, both kernels are timed and the faster kept), "on" (always)
            or "off".
        conv_recompute: whether an in-kernel conv with a norm runs twice, its moments
            first, then the chain with the norm applied in its tiles, writing the conv's
            value never (FUSEDEPI_CONV_RECOMPUTE): "off" (the default: the conv's value
            written and normalized in place; recomputed, every chain of the zoo measured
            slower, `forms.conv_recompute`), "auto" (where the measured choice times the
            chain, it is timed both ways and the faster kept) or "on" (always).
        autotune: whether a matched chain is fused only where it is measured faster
            than Inductor's compile of the same subgraph (FUSEDEPI_AUTOTUNE,
            `fusion_backend.choice`): "auto" (the default: chains on a GPU are timed),
            "on" (CPU chains under FUSEDEPI_CPU_REFERENCE too, to test the mechanism)
            or "off" (every matched chain is fused, untimed).
        debug: build kernels with source line information (FUSEDEPI_DEBUG=1: -lineinfo,
            for ncu and compute-sanitizer; the same code, a cache entry of its own).
    """

    disabled: frozenset
    disable_all: bool
    cache_dir: Path
    strict: bool
    log_level: str
    cpu_reference: bool
    in_kernel_gemm: str = "auto"
    in_kernel_conv: str = "auto"
    native_launcher: bool = True
    pad_gemm: str = "auto"
    conv_channels_last: str = "auto"
    fold_gemm_bias: str = "auto"
    gemm_consumers: str = "auto"
    library_conv: str = "auto"
    conv_recompute: str = "off"
    autotune: str = "auto"
    debug: bool = False


def _default_cache_dir(env) -> Path:
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusedepi"


def load_config(environ=None) -> Config:
    """Reads the settings from `environ` (default: os.environ).

    Raises:
        ValueError: FUSEDEPI_DISABLE names something that is neither a fusion
            nor a step, FUSEDEPI_LOG_LEVEL is not a logging level, or
            FUSEDEPI_IN_KERNEL_GEMM, FUSEDEPI_IN_KERNEL_CONV, FUSEDEPI_PAD_GEMM, FUSEDEPI_CONV_CHANNELS_LAST,
            FUSEDEPI_FOLD_GEMM_BIAS, FUSEDEPI_GEMM_CONSUMERS, FUSEDEPI_LIBRARY_CONV, FUSEDEPI_CONV_RECOMPUTE or
            FUSEDEPI_AUTOTUNE is none
            of auto, 1, 0, or
            FUSEDEPI_NATIVE_LAUNCHER, FUSEDEPI_STRICT, FUSEDEPI_CPU_REFERENCE or
            FUSEDEPI_DEBUG is neither 1 nor 0.
    """
    env = os.environ if environ is None else environ
    names = frozenset(n.strip() for n in env.get("FUSEDEPI_DISABLE", "").split(",") if n.strip())
    unknown = names - FUSION_NAMES - STEP_NAMES - ANCHOR_FORMS - {"all"}
    if unknown:
        raise ValueError(
            f"FUSEDEPI_DISABLE: unknown name(s) {sorted(unknown)}; use 'all', a fusion "
            f"({', '.join(sorted(FUSION_NAMES))}), a step ({', '.join(sorted(STEP_NAMES))}) "
            f"or an anchor form ({', '.join(sorted(ANCHOR_FORMS))})"
        )
    level = env.get("FUSEDEPI_LOG_LEVEL", "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"FUSEDEPI_LOG_LEVEL: {level!r} is not a logging level (DEBUG, INFO, WARNING, ERROR)")
    return Config(
        disabled=names - {"all"},
        disable_all="all" in names,
        cache_dir=Path(env.get("FUSEDEPI_CACHE_DIR") or _default_cache_dir(env)),
        strict=_switch("FUSEDEPI_STRICT", env.get("FUSEDEPI_STRICT", ""), False),
        log_level=level,
        cpu_reference=_switch("FUSEDEPI_CPU_REFERENCE", env.get("FUSEDEPI_CPU_REFERENCE", ""), False),
        in_kernel_gemm=_tristate("FUSEDEPI_IN_KERNEL_GEMM", env.get("FUSEDEPI_IN_KERNEL_GEMM", "")),
        in_kernel_conv=_tristate("FUSEDEPI_IN_KERNEL_CONV", env.get("FUSEDEPI_IN_KERNEL_CONV", "")),
        native_launcher=_switch("FUSEDEPI_NATIVE_LAUNCHER", env.get("FUSEDEPI_NATIVE_LAUNCHER", ""), True),
        pad_gemm=_tristate("FUSEDEPI_PAD_GEMM", env.get("FUSEDEPI_PAD_GEMM", "")),
        conv_channels_last=_tristate("FUSEDEPI_CONV_CHANNELS_LAST", env.get("FUSEDEPI_CONV_CHANNELS_LAST", "")),
        fold_gemm_bias=_tristate("FUSEDEPI_FOLD_GEMM_BIAS", env.get("FUSEDEPI_FOLD_GEMM_BIAS", "")),
        gemm_consumers=_tristate("FUSEDEPI_GEMM_CONSUMERS", env.get("FUSEDEPI_GEMM_CONSUMERS", "")),
        library_conv=_tristate("FUSEDEPI_LIBRARY_CONV", env.get("FUSEDEPI_LIBRARY_CONV", "")),
        conv_recompute=_tristate("FUSEDEPI_CONV_RECOMPUTE", env.get("FUSEDEPI_CONV_RECOMPUTE", ""), "off"),
        autotune=_tristate("FUSEDEPI_AUTOTUNE", env.get("FUSEDEPI_AUTOTUNE", "")),
        debug=_switch("FUSEDEPI_DEBUG", env.get("FUSEDEPI_DEBUG", ""), False),
    )


def _tristate(name: str, value: str, unset: str = "auto") -> str:
    """"auto", "on" (1) or "off" (0); `unset` where the variable is unset or empty."""
    value = value.strip().lower()
    if value == "":
        return unset
    if value == "auto":
        return "auto"
    if value in _TRUE:
        return "on"
    if value in _FALSE:
        return "off"
    raise ValueError(f"{name}: {value!r} is not auto, 1 (on) or 0 (off)")


def _switch(name: str, value: str, default: bool) -> bool:
    value = value.strip().lower()
    if not value:
        return default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}: {value!r} is neither 1 (on) nor 0 (off)")
