"""The C++ launcher (`csrc/launcher.cpp`): builds it, loads it, and hands it the plans.

Loaded, it is `fusedepi::chain`'s CUDA implementation: a call of a fused op makes the
anchor call, the allocations and the launch in C++, without the trip through the
dispatcher to Python, the launcher's Python and ctypes. `launch.Launcher` still decides
everything once per spec and device, and `register` passes those decisions on; a call
the C++ side has no plan for goes to the Python implementation (`fusedepi::chain_py`).

Built with the C++ compiler and torch's include and library paths into
`<cache>/native/<key>/`, keyed by the source, the command, the compiler and torch's
version, so a machine builds it once per torch version (a compiler's build and test
about 16 s on the H200 host, where the first compiler's library is refused and the
second's taken: `build`; a refusal is recorded in the cache, `FAILED`). As with the
kernels, the build runs in a private directory under a file lock that dies with its
process, and is installed by an atomic rename. The rewrite of a graph with a CUDA chain
starts it in a thread (`launch.start_native`), beside the chains' kernel builds and
timings, and `launch.enable_native` loads it once the chains are decided (a process
that ends before, its chains all refused, waits for the build to end, once a machine).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("fusedepi")

SOURCE = Path(__file__).resolve().parent / "csrc" / "launcher.cpp"
LIBRARY = "fusedepi_native.so"

# The dtype codes of `fusedepi_native.plan`'s saves (launcher.cpp: dtype_of).
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3}
# Launcher.anchor_path (launcher.cpp: Path) and the anchors (Anchor).
PATH_CODES = {"library anchor": 0, "in-kernel GEMM": 1, "direct conv": 2, "in-kernel conv": 3}
ANCHOR_CODES = {"addmm": 0, "mm": 1, "conv": 2, "bmm": 3}


class BuildError(RuntimeError):
    """The C++ launcher could not be built or loaded; the message says why."""


class _Untested(BuildError):
    """The built library's test did not finish: the machine's failure, not the library's."""


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


_NO_COMPILER = "no C++ compiler (set CXX or put c++ on PATH)"


def find_cxx() -> str:
    """The C++ compiler: $CXX, else c++ or g++ from PATH (the first of `compilers()`).

    Raises:
        BuildError: none is found.
    """
    found = compilers()
    if not found:
        raise BuildError(_NO_COMPILER)
    return found[0]


def compilers() -> list[str]:
    """The C++ compilers to try, in order: $CXX, then c++ and g++ from PATH."""
    found = []
    for name in (os.environ.get("CXX"), "c++", "g++"):
        path = shutil.which(name) if name else None
        if path and os.path.realpath(path) not in {os.path.realpath(f) for f in found}:
            found.append(path)
    return found


@lru_cache(maxsize=4)
def _compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"


def build_command(cxx: str, output: str) -> list[str]:
    """Compiles and links the launcher against this process's torch (not loaded yet:
    torch's libraries are, when `torch.ops.load_library` opens it)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in include_paths() + cuda_include_dirs()]
    libraries = [f"-L{p}" for p in library_paths()]
    return [cxx, "-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
            str(SOURCE), "-o", output, *libraries, "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch"]


def build_key(cxx: str = "c++") -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(build_command(cxx, "OUT")), _compiler_version(cxx), torch.__version__,
                 str(torch.version.cuda)):
        h.update(b"\0" + part.encode())
    return h.hexdigest()


def build(cache_dir: Path) -> Path:
    """The launcher library in the cache, built first if it is not there: by the first
    compiler (`compilers()`) whose library passes `_errors_reach_python`. The compilers
    before the first one with a library in the cache, and without a failure recorded
    there (`FAILED`), build side by side, each in its own thread: where the first one's
    library crashes on errors (a compiler whose C++ runtime is not Python's), the next
    one's is ready as soon as its own build ends, not after both.

    Raises:
        BuildError: no compiler, no CUDA headers, a compile or link error, a library
            whose errors would crash the process, or an unwritable cache.
    """
    candidates = compilers()
    if not candidates:
        raise BuildError(_NO_COMPILER)
    entries = {cxx: _entry(cxx, cache_dir) for cxx in candidates}
    to_build = []
    for cxx in candidates:
        if (entries[cxx] / LIBRARY).exists():
            break
        if not (entries[cxx] / FAILED).exists():
            to_build.append(cxx)
    builds = {cxx: _COMPILERS.submit(_build_with, cxx, cache_dir) for cxx in to_build[1:]}
    failures = []
    for cxx in candidates:
        try:
            return builds[cxx].result() if cxx in builds else _build_with(cxx, cache_dir)
        except BuildError as err:
            log.info("fusedepi: %s", str(err).splitlines()[0])
            failures.append(str(err))
    raise BuildError("\n".join(failures))


# `build`'s builds beside the first compiler's (g++ runs in a child process): a build
# the first compiler's success leaves unneeded ends in the cache all the same.
_COMPILERS = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="fusedepi-native")

# The file in a compiler's cache entry that records why its library was refused (a
# compile or link error, or errors that do not reach Python): the same source, command,
# compiler and torch fail the same way, so later processes read the reason instead of
# building again. Removing the entry tries again.
FAILED = "failed.txt"


def _entry(cxx: str, cache_dir: Path) -> Path:
    return Path(cache_dir) / "native" / build_key(cxx)[:16]


def _build_with(cxx: str, cache_dir: Path) -> Path:
    from cuda_templates.compiler import file_lock

    entry = _entry(cxx, cache_dir)
    library, failed = entry / LIBRARY, entry / FAILED
    if library.exists():
        return library
    try:
        with file_lock(entry.parent / f"{entry.name}.lock"):
            if library.exists():  # another process built it while we waited
                return library
            if failed.exists():
                raise BuildError(f"{failed.read_text().strip()} (recorded in {failed}; remove {entry} to build "
                                 "again)")
            entry.mkdir(parents=True, exist_ok=True)
            start = time.perf_counter()
            log.info("fusedepi: building the C++ launcher into %s with %s (once per torch version)", entry, cxx)
            with tempfile.TemporaryDirectory(dir=entry, prefix="build-") as tmp:
                built = Path(tmp) / LIBRARY
                result = subprocess.run(build_command(cxx, str(built)), capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    error = BuildError(f"{cxx} failed on {SOURCE.name}:\n{result.stderr[-4000:]}")
                    if result.returncode > 0:  # not killed by a signal (out of memory, say): for good
                        _record(failed, str(error))
                    raise error
                try:
                    _errors_reach_python(built, cxx)
                except _Untested:
                    raise
                except BuildError as err:
                    _record(failed, str(err))
                    raise
                os.replace(built, library)
            log.info("fusedepi: built the C++ launcher in %.1f s", time.perf_counter() - start)
    except OSError as err:
        raise BuildError(f"cannot write {entry}: {err}") from err
    return library


def _record(failed: Path, reason: str) -> None:
    """Writes `reason` to `failed` whole or not at all (a temporary file renamed)."""
    part = failed.with_name(f"{failed.name}.{os.getpid()}")
    part.write_text(reason + "\n")
    os.replace(part, failed)


# A new process loads the library and has it raise as `plan` raises on bad arguments:
# the error must reach Python as a RuntimeError. A library built by a compiler whose C++
# runtime is not the one this process loaded can crash instead (seen on an H100 host with
# g++ from /opt/gcc beside the system's libstdc++: a segfault at an error raised by an op
# with arguments, not by one without), and a crash takes the user's process with it.
_RAISE_TEST = """
import sys, torch
torch.ops.load_library(sys.argv[1])
try:
    torch.ops.fusedepi_native.raises("layout", [1, 2, 3])
except RuntimeError as err:
    print("raised" if "fusedepi_native: a test error" in str(err) else "wrong message")
"""


def _errors_reach_python(library: Path, cxx: str) -> None:
    """Raises BuildError unless `library`'s errors reach Python (run in a new process)."""
    try:
        result = subprocess.run([sys.executable, "-c", _RAISE_TEST, str(library)], capture_output=True, text=True,
                                check=False, timeout=300)
    except subprocess.TimeoutExpired as err:  # a busy machine, not the library: not recorded as its failure
        raise _Untested(f"the launcher built by {cxx} was not tried: its test process ran past {err.timeout} s") \
            from err
    if result.returncode != 0 or result.stdout.strip() != "raised":
        raise BuildError(f"the launcher built by {cxx} does not raise its errors into Python (exit "
                         f"{result.returncode}: {(result.stderr or result.stdout).strip()[-300:]}); set CXX to "
                         "the compiler whose C++ runtime this Python loads")


def load(library: Path) -> None:
    """Loads the launcher library: defines the `fusedepi_native` ops (not yet the kernel
    of `fusedepi::chain`: `install`).

    Raises:
        BuildError: the library does not load (a torch it was not built for, say).
    """
    try:
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError) as err:
        raise BuildError(f"cannot load {library}: {err}") from err


def install() -> None:
    """Makes the loaded launcher `fusedepi::chain`'s CUDA kernel."""
    torch.ops.fusedepi_native.install()


def covers(launcher) -> bool:
    """Whether the C++ side can run `launcher`'s spec by itself: every path (the in-kernel
    conv's operands change layout there as in `launch.channels_last_operands`). The
    variants that depend on a TF32 setting read it at every call there, through the
    getters Python's launcher reads (a float32 in-kernel GEMM file: the matmul precision;
    a float32 conv the file may compute: cuDNN's TF32 flag, one plan for each of its
    values)."""
    return launcher.anchor_path in PATH_CODES


def alpha_bits(alpha: float) -> int:
    """A double as the signed 64-bit integer of its bits (a layout's entries are int64;
    csrc/launcher.cpp's `double_of` reads it back exactly)."""
    return struct.unpack("<q", struct.pack("<d", alpha))[0]


@dataclass(frozen=True)
class LaunchLayout:
    """How a `launch.Launcher` runs its spec, by name: what `fusedepi_native.plan`'s
    `layout` carries. `encode` lists the fields in this order and `decode` reads them
    back; csrc/launcher.cpp's `set_plan` reads the same fields in the same order
    (tests/test_native.py compares the two sources)."""

    path: int  # PATH_CODES
    anchor: int  # ANCHOR_CODES
    n_operands: int
    gemm_auto: bool  # the in-kernel GEMM or the library one, by rows (FUSEDEPI_IN_KERNEL_GEMM=auto)
    row_output: bool  # a reduction shrinks the output: [rows, *reduced tail] out
    out_rank: int  # the reduced output's dims after the rows (its tail, `EpilogueSpec.reduced_tail`), up to 4
    out_d0: int  # the tail's dims, 0 past out_rank: a spatial reduction's (C, 1, ...), a pool's (C, *pooled)
    out_d1: int
    out_d2: int
    out_d3: int
    out_spatial: bool  # then the anchor output's spatial dims (a reduction over a conv's channels)
    channels: int
    out_h: int  # a direct conv's output plane, else 0
    out_w: int
    stores_pre_norm: bool
    has_bias: bool
    pad_k: int  # a padded library GEMM's K and N, else 0
    pad_n: int
    channels_last: bool
    permuted: bool  # a library conv's output read as [N x spatial, C] rows
    gemm_tf32: bool  # a float32 in-kernel GEMM file: the GEMM in it only while matmuls may use TF32
    reads_conv_tf32: bool  # a float32 conv the file may compute: its variants follow cuDNN's TF32 flag
    conv_tf32: bool  # ... and this plan is the variant for the flag on
    # The in-kernel conv's x [rows, in_c, in_h, in_w] and weight [channels, in_c, k_h, k_w]
    # (each call's shapes are checked against them), and in_c padded with zeros to whole
    # k-steps in the weight it reads (`launch.channels_last_operands`); else 0.
    in_c: int
    in_h: int
    in_w: int
    k_h: int
    k_w: int
    in_c_pad: int
    # The call's first two inputs are x and the weight rounded to TF32 and its last two
    # themselves (`Anchor.rounded`): the in-kernel conv reads the first, a library conv the last.
    rounded: bool
    # The in-kernel conv reads x in its NCHW layout (`ConvGemmPlan.nchw`), not channels-last.
    in_nchw: bool
    # A Conv1d as the 2-D conv of one row (`Anchor.as_2d`), on any path: its output
    # [rows, channels, L_out], as the graph has it (the library conv's squeezed).
    one_row: bool
    # The in-kernel conv of a 3-D conv (`Anchor.depth`): x's depth, the weight's, the
    # output's (x [rows, in_c, in_d, in_h, in_w], the output [rows, channels, out_d,
    # out_h, out_w]); else 0.
    in_d: int
    k_d: int
    out_d: int
    # The in-kernel conv: the elements between two pixels of the channels-last x it reads
    # (`conv_sm90.x_pitch`, `launch.padded_pixels`; in_c where it reads x NCHW); else 0.
    in_pitch: int
    # A baddbmm's alpha (`Anchor.alpha`) as the 64 bits of the double (`alpha_bits`); else 0.
    alpha: int

    @classmethod
    def of(cls, launcher) -> "LaunchLayout":
        spec = launcher.spec
        conv_in = launcher.anchor_path in ("direct conv", "in-kernel conv")
        out_h, out_w = spec.anchor.direct_out_hw() if conv_in else (0, 0)
        in_c = in_h = in_w = k_h = k_w = in_c_pad = in_d = k_d = out_d = in_pitch = 0
        if launcher.anchor_path == "in-kernel conv":
            from cuda_templates import conv_sm90

            in_c, k_h, k_w, in_h, in_w = spec.anchor.direct
            in_c_pad = conv_sm90.padded_in_channels(in_c, spec.dtype)
            itemsize = getattr(torch, spec.dtype).itemsize
            in_pitch = in_c if launcher.in_kernel_nchw else conv_sm90.x_pitch(in_c, itemsize)
            if spec.anchor.depth:
                (k_d, in_d), out_d = spec.anchor.depth, spec.anchor.direct_out_d()
        pad_k, pad_n = spec.anchor.pad or (0, 0)
        baddbmm_alpha = alpha_bits(spec.anchor.alpha) if spec.anchor.is_baddbmm else 0
        tail = tuple(launcher.reduced_tail)
        if len(tail) > 4:
            raise ValueError(f"a reduced output's tail {tail} has more than 4 dims")
        dims = tail + (0,) * (4 - len(tail))
        return cls(PATH_CODES[launcher.anchor_path], ANCHOR_CODES[spec.anchor.kind], launcher.n_operands,
                   launcher.gemm_auto, launcher.row_output, len(tail), *dims, launcher.keeps_spatial,
                   spec.channels, out_h, out_w, launcher.stores_pre_norm, spec.anchor.has_bias, pad_k, pad_n,
                   spec.anchor.channels_last, spec.anchor.permuted, launcher.gemm_tf32,
                   launcher.reads_conv_tf32, launcher.conv_tf32, in_c, in_h, in_w, k_h, k_w, in_c_pad,
                   spec.anchor.rounded, launcher.anchor_path == "in-kernel conv" and launcher.in_kernel_nchw,
                   spec.anchor.as_2d, in_d, k_d, out_d, in_pitch, baddbmm_alpha)

    def encode(self) -> list[int]:
        return [int(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def decode(cls, layout: list[int]) -> "LaunchLayout":
        if len(layout) != len(fields(cls)):
            raise ValueError(f"a layout has {len(fields(cls))} entries, not {len(layout)}")
        return cls(*(bool(v) if f.type == "bool" else int(v) for f, v in zip(fields(cls), layout)))


def _layout(launcher) -> list[int]:
    return LaunchLayout.of(launcher).encode()


def _conv(anchor) -> list[int]:
    if anchor.kind != "conv":
        return []
    stride, padding, dilation, transposed, output_padding, groups = anchor.conv
    nd = len(stride)
    if not all(len(v) == nd for v in (padding, dilation, output_padding)):
        raise ValueError(f"conv parameters of unequal lengths: {anchor.conv}")
    return [nd, *stride, *padding, *dilation, int(transposed), *output_padding, groups]


@dataclass(frozen=True)
class SaveLayout:
    """One value a chain saves for backward, as `fusedepi_native.plan`'s `saves` carries
    it (launcher.cpp's `Save`): `encode` lists anchor_value, dtype, per_row, then the
    shape's length and dims."""

    anchor_value: bool  # the anchor's own output, handed out as it is (no buffer of its own)
    dtype: int  # DTYPE_CODES
    per_row: int  # elements a row (0: a whole tensor, not per row)
    shape: tuple[int, ...]  # -1 for the rows

    @classmethod
    def of(cls, save) -> "SaveLayout":
        return cls(save.what == "value" and save.at == 0, DTYPE_CODES[save.dtype], save.per_row, tuple(save.shape))

    def encode(self) -> list[int]:
        return [int(self.anchor_value), self.dtype, self.per_row, len(self.shape), *self.shape]

    @classmethod
    def decode_all(cls, flat: list[int]) -> list["SaveLayout"]:
        records, at = [], 0
        while at < len(flat):
            if at + 4 > len(flat) or at + 4 + flat[at + 3] > len(flat):
                raise ValueError("a save is cut short")
            ndim = flat[at + 3]
            records.append(cls(bool(flat[at]), flat[at + 1], flat[at + 2], tuple(flat[at + 4:at + 4 + ndim])))
            at += 4 + ndim
        return records


@dataclass(frozen=True)
class CheckLayout:
    """What every call's inputs are checked against (`launch.check_*`), as
    `fusedepi_native.plan`'s `checks` carries it (launcher.cpp: set_plan): `encode` lists
    dtype, y_row, the anchor sizes' count and pairs, the params' count and triples."""

    dtype: int  # DTYPE_CODES of the chain
    y_row: int  # elements between rows of the anchor's output
    anchor_sizes: tuple[tuple[int, int], ...]  # (elements a row, whole) of each anchor operand a kernel reads
    # (dtype code, whole, elements a group of rows, rows a group) of each epilogue operand
    params: tuple[tuple[int, int, int, int], ...]

    @classmethod
    def of(cls, launcher) -> "CheckLayout":
        spec = launcher.spec
        return cls(DTYPE_CODES[spec.dtype], spec.y_row, tuple(tuple(sizes) for sizes in launcher.anchor_sizes),
                   tuple((DTYPE_CODES[dtype], *sizes) for dtype, sizes in zip(spec.param_dtypes, spec.param_sizes())))

    def encode(self) -> list[int]:
        flat = [self.dtype, self.y_row, len(self.anchor_sizes)]
        for sizes in self.anchor_sizes:
            flat += sizes
        flat.append(len(self.params))
        for param in self.params:
            flat += param
        return flat

    @classmethod
    def decode(cls, flat: list[int]) -> "CheckLayout":
        n = flat[2] if len(flat) > 2 else -1
        m_at = 3 + 2 * n
        if n < 0 or len(flat) <= m_at or len(flat) != m_at + 1 + 4 * flat[m_at]:
            raise ValueError(f"checks of {len(flat)} entries do not hold their counts' sizes")
        pairs = tuple(tuple(flat[3 + 2 * i:5 + 2 * i]) for i in range(n))
        params = tuple(tuple(flat[m_at + 1 + 4 * i:m_at + 5 + 4 * i]) for i in range(flat[m_at]))
        return cls(flat[0], flat[1], pairs, params)


def _saves(launcher) -> list[int]:
    return [v for save, _ in launcher.saves for v in SaveLayout.of(save).encode()]


def _checks(launcher) -> list[int]:
    return CheckLayout.of(launcher).encode()


def register(launcher, spec: str, device_index: int) -> None:
    """Hands the C++ launcher the plan of `spec` on `device_index`, as `launcher` runs it."""
    torch.ops.fusedepi_native.plan(
        spec, device_index, str(launcher.lib.path), launcher.lib.path.parent.name[:12], _layout(launcher),
        list(launcher.running_stats), _conv(launcher.spec.anchor), _saves(launcher), _checks(launcher))


def register_rows(spec: str, device_index: int, rows: int, in_kernel: bool) -> None:
    """Tells the C++ launcher whether calls of `rows` rows compute the GEMM in the kernel."""
    torch.ops.fusedepi_native.plan_rows(spec, device_index, rows, in_kernel)


def forget() -> None:
    torch.ops.fusedepi_native.forget()


def plan_count() -> int:
    return int(torch.ops.fusedepi_native.plan_count())
