"""CUDA templates: `EpilogueSpec` -> source -> compiled, cached library. No FX in here."""

from .compiler import CompileError, Library, build, load
from .render import NotRenderable, Plan, plan, render

__all__ = ["CompileError", "Library", "NotRenderable", "Plan", "build", "load", "plan", "render"]
