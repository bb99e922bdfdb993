"""Compile-time timings of library call forms, cached on disk per GPU and shape.

Some choices the backend makes for a chain depend on which form of a library call is
faster on the GPU at hand: a GEMM on zero-padded operands (`gemm_padding`), a conv on
channels-last ones (`conv_layout`). Each form is timed once while compiling, with CUDA
events, and the times are kept in a JSON file in the cache directory, so that later
processes (and other graphs with the same shapes) reuse them.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

log = logging.getLogger("fusedepi")

_cache: dict[tuple, list] = {}  # (cache file, key) -> times
_read_files: set = set()  # cache files already merged into _cache
_cache_lock = threading.Lock()


def cached(path: Path, key: str, measure: Callable[[], tuple]) -> tuple:
    """The times stored under `key` in the cache file `path` (read once a process), or
    `measure()`'s, which are then stored there."""
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


# The other form must be at least this much faster than the graph's: it costs a little
# that a timing of the library call alone does not see (a padding copy's launches, a
# bias the epilogue loads, the staged epilogue of a channels-last conv).
MIN_GAIN = 0.9


def takes_other_form(setting: str, device: torch.device, strict: bool, timed: Callable[[], tuple],
                     what: str) -> bool:
    """Whether a chain's library call takes its other form under a tristate setting:
    "on" always, "off" never, "auto" on CUDA where `timed()` (ms as the graph has it,
    ms of the other form) finds the other form at least 1 / MIN_GAIN times faster. A
    timing that fails (out of memory, say) keeps the graph's form with a warning, or
    raises under `strict`. `what` names the other form in the log."""
    if setting != "auto":
        return setting == "on"
    if device.type != "cuda":
        return False
    try:
        times = timed()
    except Exception as err:  # noqa: BLE001 - the chain runs as the graph has it
        if strict:
            raise
        log.warning("fusedepi: timing %s failed (%s: %s); it runs as the graph has it", what, type(err).__name__, err)
        return False
    if times[1] >= MIN_GAIN * times[0]:
        return False
    log.info("fusedepi: %s: %.3f ms against %.3f ms", what, times[1], times[0])
    return True


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
