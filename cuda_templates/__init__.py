"""CUDA templates: `EpilogueSpec` -> source -> compiled, cached library. No FX in here."""

from .compiler import CompileError, Library, build, load
from .conv_sm90 import ConvGemmPlan
from .gemm_sm90 import fills_gpu
from .render import (DirectPlan, GemmPlan, NotRenderable, Plan, anchor_plan, build_arch, channels_last_plan,
                     conv_gemm_plan, direct_plan, gemm_plan, kernel_name, plan, render, staged_plan)

__all__ = [
    "CompileError",
    "ConvGemmPlan",
    "DirectPlan",
    "GemmPlan",
    "Library",
    "NotRenderable",
    "Plan",
    "anchor_plan",
    "build",
    "build_arch",
    "channels_last_plan",
    "conv_gemm_plan",
    "direct_plan",
    "fills_gpu",
    "gemm_plan",
    "kernel_name",
    "load",
    "plan",
    "render",
    "staged_plan",
]
