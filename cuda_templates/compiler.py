"""Compiles rendered CUDA sources into shared libraries, cached on disk by content.

Key = sha256(source, headers, nvcc command, nvcc version, arch, package version).
Entries live in `<cache>/<key[:2]>/<key>/`; a build happens in a private temp
directory through ninja and is installed with an atomic rename, under a per-key
file lock that is re-checked once taken, so concurrent processes build once.
Each library is installed with the sha256 of its bytes beside it (`kernel.so.sha256`,
written last): an entry whose library is missing, truncated or altered fails that
check and is rebuilt. A cache directory that cannot be written (read-only, full)
gives one warning and a private temporary cache for the rest of the process.
Loaded libraries are memoized per process.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("fusedepi")

INCLUDE_DIR = Path(__file__).resolve().parent / "include"
LIBRARY = "kernel.so"


class CompileError(RuntimeError):
    """nvcc or ninja failed, or is missing; the message carries the compiler's output."""


def package_version() -> str:
    try:
        from importlib.metadata import version

        return version("fusedepi")
    except Exception:  # running from a source tree that was not installed
        return "0+source"


def find_nvcc() -> str:
    """nvcc from $CUDA_HOME/bin, else from PATH."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if not found:
        raise CompileError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    return found


def find_ninja() -> str:
    try:
        import ninja

        path = Path(ninja.BIN_DIR) / "ninja"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("ninja")
    if not found:
        raise CompileError("ninja not found (pip install ninja)")
    return found


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[-1] if out.stdout else "unknown"


def nvcc_flags(arch: str, line_info: bool = False) -> list[str]:
    """Flags for `arch` like "sm90", "sm90a" or "sm80". No fast-math: results must match eager.
    `line_info`: source lines in the binary (-lineinfo: for ncu and compute-sanitizer; the
    code is the same)."""
    number = arch[2:]
    return (["-lineinfo"] if line_info else []) + [
        "-O3",
        "-std=c++17",
        "-shared",
        "-Xcompiler",
        "-fPIC",
        f"-gencode=arch=compute_{number},code=sm_{number}",
        "-I",
        str(INCLUDE_DIR),
    ]


def _headers_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(INCLUDE_DIR.rglob("*.cuh")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(source: str, arch: str, nvcc: str, line_info: bool = False) -> str:
    h = hashlib.sha256()
    for part in (source, _headers_digest(), " ".join(nvcc_flags(arch, line_info)), nvcc_version(nvcc), arch,
                 package_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@contextmanager
def file_lock(path: Path):
    """An exclusive flock on `path`: the kernel drops it if the holder dies, so a killed
    build never leaves the next one waiting."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ninja_build(source: str, arch: str, nvcc: str, workdir: Path, line_info: bool = False) -> Path:
    (workdir / "kernel.cu").write_text(source)
    flags = " ".join(nvcc_flags(arch, line_info))
    (workdir / "build.ninja").write_text(
        "ninja_required_version = 1.3\n"
        f"rule nvcc\n  command = {nvcc} {flags} -o $out $in\n  description = nvcc $out\n"
        f"build {LIBRARY}: nvcc kernel.cu\n"
    )
    result = subprocess.run(
        [find_ninja(), "-C", str(workdir)], capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise CompileError(f"nvcc failed for {workdir / 'kernel.cu'}:\n{result.stdout[-4000:]}{result.stderr[-2000:]}")
    return workdir / LIBRARY


def _keep_failed(workdir: Path, keep: Path, message: str) -> str:
    """Moves a failed build's source and ninja file to `keep` (the build directory is
    removed); returns `message` naming them there."""
    keep.mkdir(parents=True, exist_ok=True)
    for name in ("kernel.cu", "build.ninja"):
        if (workdir / name).exists():
            shutil.copy(workdir / name, keep / name)
    return message.replace(str(workdir / "kernel.cu"), str(keep / "kernel.cu")) + (
        f"\n(the source and its nvcc command are kept in {keep})")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(library: Path) -> bool:
    """The library exists and matches the digest written when it was installed."""
    manifest = library.with_name(LIBRARY + ".sha256")
    try:
        return manifest.read_text().strip() == _digest(library)
    except OSError:
        return False


def _build_into(source: str, name: str, arch: str, nvcc: str, key: str, cache_dir: Path,
                line_info: bool = False) -> Path:
    entry = Path(cache_dir) / key[:2] / key
    library = entry / LIBRARY
    if _intact(library):
        return library
    with file_lock(entry.parent / f"{key}.lock"):
        if _intact(library):  # another process built it while we waited
            return library
        if library.exists():
            log.warning("fusedepi: cache entry %s is damaged (missing or wrong checksum); rebuilding", entry)
        entry.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        log.info("fusedepi: compiling %s (%s)", name, key[:12])
        with tempfile.TemporaryDirectory(dir=entry, prefix="build-") as tmp:
            try:
                built = _ninja_build(source, arch, nvcc, Path(tmp), line_info)
            except CompileError as err:
                raise CompileError(_keep_failed(Path(tmp), entry / "failed", str(err))) from None
            digest = _digest(built)
            shutil.copy(Path(tmp) / "kernel.cu", entry / "kernel.cu")
            os.replace(built, library)
            (Path(tmp) / "digest").write_text(digest)
            os.replace(Path(tmp) / "digest", library.with_name(LIBRARY + ".sha256"))
        log.info("fusedepi: compiled %s in %.1f s", name, time.perf_counter() - start)
    return library


_private_cache: Path | None = None
_private_lock = threading.Lock()


def _private_cache_dir(cache_dir: Path, err: OSError) -> Path:
    """A temporary cache for this process, once the configured one failed to take a write."""
    global _private_cache
    with _private_lock:
        if _private_cache is None:
            _private_cache = Path(tempfile.mkdtemp(prefix="fusedepi-cache-"))
            log.warning(
                "fusedepi: cannot write the kernel cache %s (%s); using %s for this process, "
                "so kernels are rebuilt in each new process. Set FUSEDEPI_CACHE_DIR to a writable directory.",
                cache_dir, err, _private_cache,
            )
        return _private_cache


def build(source: str, name: str, arch: str, cache_dir: Path, line_info: bool = False) -> Path:
    """Returns the path of the compiled library for `source`, building it if needed.

    Args:
        source: complete .cu text.
        name: readable kernel name, for logs.
        arch: target like "sm90".
        cache_dir: root of the on-disk cache. If it cannot be written, the build goes
            to a private temporary cache (one warning per process).
        line_info: build with -lineinfo (FUSEDEPI_DEBUG); a cache entry of its own.

    Raises:
        CompileError: nvcc/ninja missing or failing.
    """
    nvcc = find_nvcc()
    key = cache_key(source, arch, nvcc, line_info)
    try:
        return _build_into(source, name, arch, nvcc, key, cache_dir, line_info)
    except OSError as err:  # read-only or full cache directory
        private = _private_cache_dir(Path(cache_dir), err)
        if Path(cache_dir) == private:
            raise CompileError(f"cannot write the temporary kernel cache {private}: {err}") from err
        try:
            return _build_into(source, name, arch, nvcc, key, private, line_info)
        except OSError as again:
            raise CompileError(f"cannot write the kernel cache {cache_dir} nor {private}: {again}") from again


class Library:
    """A loaded kernel library: `run` launches the spec's kernels on a stream."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._lib.fusedepi_run.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_longlong,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        self._lib.fusedepi_run.restype = ctypes.c_int
        self._lib.fusedepi_workspace_floats.argtypes = [ctypes.c_longlong]
        self._lib.fusedepi_workspace_floats.restype = ctypes.c_longlong
        self._lib.fusedepi_error_string.argtypes = [ctypes.c_int]
        self._lib.fusedepi_error_string.restype = ctypes.c_char_p
        self._lib.fusedepi_anchor_inside.restype = ctypes.c_int
        self._lib.fusedepi_pad_rows.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p,
        ]
        self._lib.fusedepi_pad_rows.restype = ctypes.c_int
        # True: the library computes the anchor itself (direct conv); `run` takes the
        # anchor's operands after the workspace instead of an anchor output.
        self.anchor_inside = bool(self._lib.fusedepi_anchor_inside())

    def workspace_floats(self, rows: int) -> int:
        return int(self._lib.fusedepi_workspace_floats(rows))

    def pad_rows(self, x: int, xp: int, rows: int, k: int, device: int, stream: int) -> None:
        """Copies x's rows of k elements into xp's padded rows (the spec's Anchor.pad K),
        zeros after them: the operand of a padded library GEMM."""
        self._check(self._lib.fusedepi_pad_rows(x, xp, rows, k, device, ctypes.c_void_p(stream)))

    def _check(self, code: int) -> None:
        if code != 0:
            message = self._lib.fusedepi_error_string(code).decode()
            raise RuntimeError(f"fusedepi kernel {self.path.parent.name[:12]} failed: {message}")

    def run(self, pointers: list[int], rows: int, device: int, stream: int) -> None:
        """Launches the kernels. pointers: y, out, extra outputs, tensor inputs, workspace,
        then the anchor's operands when `anchor_inside`."""
        array = (ctypes.c_void_p * len(pointers))(*pointers)
        self._check(self._lib.fusedepi_run(array, rows, device, ctypes.c_void_p(stream)))


_loaded: dict[Path, Library] = {}
_lock = threading.Lock()


def load(source: str, name: str, arch: str, cache_dir: Path, line_info: bool = False) -> Library:
    """Builds (or finds) and loads the library for `source`; memoized per process."""
    path = build(source, name, arch, cache_dir, line_info)
    with _lock:
        lib = _loaded.get(path)
        if lib is None:
            lib = _loaded[path] = Library(path)
    return lib
