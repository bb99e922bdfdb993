"""The C++ launcher (`csrc/launcher.cpp`): builds it, loads it, and hands it the plans.

Loaded, it is `fusedepi::chain`'s CUDA implementation: a call of a fused op makes the
anchor call, the allocations and the launch in C++, without the trip through the
dispatcher to Python, the launcher's Python and ctypes. `ops.Launcher` still decides
everything once per spec and device, and `register` passes those decisions on; a call
the C++ side has no plan for goes to the Python implementation (`fusedepi::chain_py`).

Built by torch.utils.cpp_extension (ninja) into `<cache>/native/<key>/`, keyed by the
source and the versions of torch, CUDA and Python, so a machine builds it once per
torch version (tens of seconds); `ops.enable_native` loads it at the first compile of a
CUDA chain.
"""

from __future__ import annotations

import hashlib
import logging
import shlex
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("fusedepi")

SOURCE = Path(__file__).resolve().parent / "csrc" / "launcher.cpp"

# The dtype codes of `fusedepi_native.plan`'s saves (launcher.cpp: dtype_of).
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
# Launcher paths (launcher.cpp: Path) and anchors (Anchor).
LIBRARY_ANCHOR, GEMM, DIRECT_CONV = 0, 1, 2
ANCHOR_CODES = {"addmm": 0, "mm": 1, "conv": 2}


class BuildError(RuntimeError):
    """The C++ launcher could not be built or loaded; the message says why."""


@lru_cache(maxsize=1)
def cuda_include_dirs() -> list[str]:
    """The CUDA include directories nvcc itself uses (c10/cuda's headers include
    cuda_runtime_api.h), from `nvcc --dryrun`: nvcc may be a wrapper script, whose
    location says nothing about the toolkit's.

    Raises:
        BuildError: nvcc is missing or names no include directory.
    """
    from cuda_templates.compiler import CompileError, find_nvcc

    try:
        result = subprocess.run([find_nvcc(), "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
                                capture_output=True, text=True, check=False)
    except (CompileError, OSError) as err:
        raise BuildError(f"no CUDA include directory: {err}") from err
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("#$ INCLUDES="):
            words = shlex.split(line.split("=", 1)[1])
            dirs = [w[2:] for w in words if w.startswith("-I") and len(w) > 2]
            if dirs:
                return dirs
    raise BuildError("no CUDA include directory: `nvcc --dryrun` names none")


def build_key() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, str(torch.version.cuda), sys.version):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def build_and_load(cache_dir: Path) -> None:
    """Builds the launcher into the cache (unless there) and loads it into the process,
    which registers it as `fusedepi::chain`'s CUDA kernel.

    Raises:
        BuildError: the compiler, torch's headers or the load failed.
    """
    from torch.utils import cpp_extension

    directory = Path(cache_dir) / "native" / build_key()[:16]
    start = time.perf_counter()
    log.info("fusedepi: loading the C++ launcher from %s (built there first if missing: once per torch version)",
             directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Plain C++ linked to c10_cuda (the current stream): no CUDA runtime call, so
        # neither nvcc nor cpp_extension's guess of the toolkit's home is needed.
        cpp_extension.load(
            name="fusedepi_native",
            sources=[str(SOURCE)],
            extra_cflags=["-O2"],
            extra_include_paths=cuda_include_dirs(),
            extra_ldflags=["-lc10_cuda"],
            build_directory=str(directory),
            with_cuda=False,
            is_python_module=False,
            verbose=False,
        )
    except BuildError:
        raise
    except Exception as err:  # compiler, headers, linker, loader: all end the same way
        raise BuildError(f"{type(err).__name__}: {err}") from err
    log.info("fusedepi: C++ launcher ready in %.1f s", time.perf_counter() - start)


def covers(launcher) -> bool:
    """Whether the C++ side can run `launcher`'s spec by itself. Not: the variants that
    read a TF32 setting at every call (float32 in the in-kernel GEMM, float32 direct conv),
    which Python keeps."""
    return not launcher.gemm_tf32 and not launcher.reads_conv_tf32


def _layout(launcher) -> list[int]:
    spec = launcher.spec
    if launcher.gemm:
        path = GEMM
    elif launcher.lib.anchor_inside:
        path = DIRECT_CONV
    else:
        path = LIBRARY_ANCHOR
    out_h, out_w = spec.anchor.direct_out_hw() if path == DIRECT_CONV else (0, 0)
    return [path, ANCHOR_CODES[spec.anchor.kind], launcher.n_operands, int(launcher.gemm_auto),
            int(launcher.row_output), int(launcher.keepdim), spec.channels, out_h, out_w,
            int(launcher.stores_pre_norm), int(spec.anchor.has_bias)]


def _conv(anchor) -> list[int]:
    if anchor.kind != "conv":
        return []
    stride, padding, dilation, transposed, output_padding, groups = anchor.conv
    nd = len(stride)
    if not all(len(v) == nd for v in (padding, dilation, output_padding)):
        raise ValueError(f"conv parameters of unequal lengths: {anchor.conv}")
    return [nd, *stride, *padding, *dilation, int(transposed), *output_padding, groups]


def _saves(launcher) -> list[int]:
    flat = []
    for save, _ in launcher.saves:
        flat += [int(save.what == "value" and save.at == 0), DTYPE_CODES[save.dtype], save.per_row,
                 len(save.shape), *save.shape]
    return flat


def register(launcher, spec: str, device_index: int) -> None:
    """Hands the C++ launcher the plan of `spec` on `device_index`, as `launcher` runs it."""
    torch.ops.fusedepi_native.plan(
        spec, device_index, str(launcher.lib.path), launcher.lib.path.parent.name[:12], _layout(launcher),
        list(launcher.running_stats), _conv(launcher.spec.anchor), _saves(launcher))


def register_rows(spec: str, device_index: int, rows: int, in_kernel: bool) -> None:
    """Tells the C++ launcher whether calls of `rows` rows compute the GEMM in the kernel."""
    torch.ops.fusedepi_native.plan_rows(spec, device_index, rows, in_kernel)


def forget() -> None:
    torch.ops.fusedepi_native.forget()


def plan_count() -> int:
    return int(torch.ops.fusedepi_native.plan_count())
