"""CUDA templates: `EpilogueSpec` -> source -> compiled, cached library. No FX in here."""

from .compiler import CompileError, Library, build, load
from .render import DirectPlan, NotRenderable, Plan, direct_plan, kernel_name, plan, render

__all__ = [
    "CompileError",
    "DirectPlan",
    "Library",
    "NotRenderable",
    "Plan",
    "build",
    "direct_plan",
    "kernel_name",
    "load",
    "plan",
    "render",
]
