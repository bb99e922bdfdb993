"""The one timing path and the one cache of compile-time measurements.

Every choice the backend makes by measurement (the library anchor's forms in
`forms.FORMS`, fused or Inductor in `choice`) times GPU work with `gpu_ms` (replays of
a CUDA graph of one call) and keeps the times in one JSON file in the cache directory
(`CACHE_FILE`), each entry keyed by what it depends on (GPU, torch version, shapes,
dtypes, settings, fusedepi's sources), so that later processes and other graphs with the same shapes reuse
them: a warm start times nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("fusedepi")

CACHE_FILE = "choices.json"

_cache: dict[tuple, list] = {}  # (cache file, key) -> times
_read_files: set = set()  # cache files already merged into _cache
_cache_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 of fusedepi's sources (the Python, C++ and CUDA files of fusion_backend,
    lowering and cuda_templates), read once a process: what a stored time or compiled
    graph was made by."""
    import cuda_templates
    import lowering

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(lowering.__file__).parent, Path(cuda_templates.__file__).parent):
        for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".cuh", ".cpp")):
            digest.update(str(path.relative_to(package.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def cached(path: Path, key: str, measure: Callable[[], tuple]) -> tuple:
    """The times stored under `key` in the cache file `path` (read once a process), or
    `measure()`'s, which are then stored there. The stored key ends with fusedepi's
    `source_digest`: a time measured by other kernels or another timing is not reused."""
    key = f"{key}|fusedepi {source_digest()}"
    with _cache_lock:
        if path not in _read_files:
            _read_files.add(path)
            if path.exists():
                _cache.update({(path, k): v for k, v in _read(path).items()})
        if (path, key) in _cache:
            return tuple(_cache[(path, key)])
    times = tuple(measure())
    with _cache_lock:
        _cache[(path, key)] = list(times)
    _store(path, key, times)
    return times


def example_shape(val: torch.Tensor) -> tuple | None:
    """A graph example's shape to time at: a dynamic size's hint; None without one."""
    return hinted(val.shape)


def hinted(sizes) -> tuple | None:
    """Sizes (or strides) as ints, a symbolic one at its hint; None where one has none."""
    dims = []
    for d in sizes:
        if not isinstance(d, int):
            d = getattr(getattr(d, "node", None), "hint", None)
            if d is None:
                return None
        dims.append(int(d))
    return tuple(dims)


def best_ms(fn: Callable[[], object], calls: int = 10, rounds: int = 3) -> float:
    """Milliseconds a call of `fn` takes on the GPU: CUDA events around `calls` calls
    back to back, the best of `rounds`, after one call to warm up."""
    return min(round_ms(fn, calls, rounds))


def round_ms(fn: Callable[[], object], calls: int, rounds: int, warmup: int = 1) -> list[float]:
    """Each of `rounds` rounds' milliseconds a call, timed with CUDA events around
    `calls` calls back to back, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return times


def gpu_ms(fn: Callable[[], object], device: torch.device) -> float:
    """GPU milliseconds of a call of `fn`: replays of a CUDA graph of one call, so that
    the CPU's cost of a call (which a compiled model's other launches hide) does not
    decide; a call that cannot be captured is timed as is. On the CPU: wall time."""
    if device.type != "cuda":
        fn()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(5):
                fn()
            best = min(best, (time.perf_counter() - start) / 5 * 1e3)
        return best
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture, as torch.cuda.graphs asks
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
        except Exception as err:  # noqa: BLE001 - timed without a graph
            log.debug("fusedepi: a timed call could not be captured (%s); timing it as is", err)
            torch.cuda.synchronize()
            return best_ms(fn)
        return best_ms(graph.replay)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # unreadable: measured again, and rewritten


def _store(path: Path, key: str, times: tuple) -> None:
    """Adds one entry to the cache file: read, merged and replaced whole under a lock, so
    that processes timing at once keep each other's entries. A failure only logs."""
    from cuda_templates.compiler import file_lock

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            data = _read(path)
            data[key] = list(times)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
                json.dump(data, handle)
            os.replace(handle.name, path)
    except OSError as err:
        log.info("fusedepi: could not write %s (%s); timings are kept for this process only", path, err)
