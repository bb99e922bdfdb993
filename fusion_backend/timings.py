"""The one timing path and the one cache of compile-time measurements.

Every choice the backend makes by measurement (the library anchor's forms in
`forms.FORMS`, fused or Inductor in `choice`) times its candidates side by side with
`compare_ms` (replays of a CUDA graph of one call each, in turns; the whole graph also
with `host_ms`, the CPU's time to launch a call) and keeps the times
in one JSON file in the cache directory (`CACHE_FILE`), each entry keyed by what it
depends on (GPU, torch version, shapes, dtypes, settings, fusedepi's sources), so that
later processes and other graphs with the same shapes reuse them: a warm start times
nothing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

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


# A round of `compare_ms` lasts at least this long on the GPU (more calls of a short
# function), and the functions run in turns for at least WARM_MS before the rounds: ten
# calls of a 20 us graph made rounds of 0.2 ms, the whole timing of two graphs 16 ms,
# short against a GPU's clock settling after the idle of a compile.
MIN_ROUND_MS = 1.0
WARM_MS = 20.0
MAX_CALLS = 2000


def compare_ms(fns: Sequence[Callable[[], object]], device: torch.device, capture: bool = True,
               calls: int = 10, rounds: int = 4) -> tuple[float, ...]:
    """GPU milliseconds of a call of each of `fns`, timed side by side.

    Each is captured as a CUDA graph of one call and timed by its replays, so that the
    CPU's cost of a call (which a compiled model's other launches hide) does not decide;
    one that cannot be captured, and all where `capture` is False (a function that
    replays CUDA graphs of its own, a user's loop), is called as is. After a call of each
    to warm up, a round of `calls` calls of each sizes the rounds (`calls_a_round`: at
    least MIN_ROUND_MS of the shortest) and the functions take turns for WARM_MS; then
    `rounds` rounds, in each of which every function is timed over that many calls back
    to back (CUDA events), the order reversed from round to round (`in_turns`); each
    function's median round. On the CPU: wall time, in the same turns.
    """
    if device.type != "cuda":  # the reference ops: fewer calls a round
        for fn in fns:
            fn()
        return in_turns([functools.partial(_wall_round_ms, fn, min(calls, 5)) for fn in fns], rounds)
    with torch.cuda.device(device), gpu_lock(device):
        timed = [_captured(fn) if capture else fn for fn in fns]
        for fn in timed:  # warm up: a graph's first replay uploads it
            fn()
        torch.cuda.synchronize()
        probe = [cuda_round_ms(fn, calls) for fn in timed]
        n = calls_a_round(min(probe), calls)
        busy = sum(probe) * calls
        while busy < WARM_MS:
            busy += sum(cuda_round_ms(fn, n) for fn in timed) * n
        return in_turns([functools.partial(cuda_round_ms, fn, n) for fn in timed], rounds)


def calls_a_round(ms_a_call: float, calls: int) -> int:
    """Calls a round of `compare_ms` makes of functions whose shortest call takes
    `ms_a_call`: `calls`, or as many more as make MIN_ROUND_MS (MAX_CALLS at most)."""
    if ms_a_call <= 0:
        return MAX_CALLS
    return max(calls, min(MAX_CALLS, -int(-MIN_ROUND_MS // ms_a_call)))


def in_turns(time_a_round: Sequence[Callable[[], float]], rounds: int) -> tuple[float, ...]:
    """Each timer's median over `rounds` rounds, the timers taking turns in an order
    reversed from round to round (A B, B A, A B, B A). A drift of the device's speed
    over the measurement (a GPU's clock under a long float32 GEMM, a busy host) then
    reaches every timer alike: with an even number of rounds a steady drift cancels in
    the medians, where timed one after the other it reaches the one timed last alone."""
    times: list[list[float]] = [[] for _ in time_a_round]
    for r in range(rounds):
        for i in (range(len(times)) if r % 2 == 0 else reversed(range(len(times)))):
            times[i].append(time_a_round[i]())
    return tuple(statistics.median(t) for t in times)


def cuda_round_ms(fn: Callable[[], object], calls: int) -> float:
    """Milliseconds a call of `fn`: CUDA events around `calls` calls back to back."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def host_ms(fns: Sequence[Callable[[], object]], device: torch.device, calls: int = 10,
            rounds: int = 6) -> tuple[float, ...]:
    """The CPU's milliseconds a call of each of `fns` (none captured: as a user's loop
    calls them), timed side by side in turns as `compare_ms`: `calls` calls back to back,
    from an idle device until the last call returns. A CUDA launch returns once it is
    queued, so where the host queues a call faster than the GPU runs it this is the
    host's share alone, and where it is slower the loop runs at this pace, whatever the
    GPU time. On the CPU: the wall time, as `compare_ms`'s."""
    for fn in fns:  # warm up: the first call of a compiled graph may still compile
        fn()
    with gpu_lock(device):
        return in_turns([functools.partial(_host_round_ms, fn, calls, device) for fn in fns], rounds)


# Where the GPU is shared, a timing's CUDA events also count the time slices that other
# processes' kernels take. The zoo compiles in 14 processes on one GPU: there the fused
# form of conv2d_dilated_gelu (bf16, H200) was timed at 0.082 ms against Inductor's
# 0.086, and read 0.095 against 0.087 in the zoo's timed pass after, one process alone.
# fusedepi's timings on one GPU take turns across processes (other work on the GPU is
# not held back).
def gpu_lock_path(device: torch.device) -> Path:
    """The lock file of `device`'s timings: one a GPU (its UUID), in the temp directory."""
    props = torch.cuda.get_device_properties(device)
    name = str(getattr(props, "uuid", "") or "") or props.name.replace(" ", "_")
    return Path(tempfile.gettempdir()) / f"fusedepi-timing-{name}.lock"


_held = threading.local()  # the GPU timing locks this thread holds: a nested timing takes none again


@contextlib.contextmanager
def gpu_lock(device: torch.device):
    """Holds `device`'s timing lock (`gpu_lock_path`) while fusedepi times on it (none
    on the CPU); a timing inside another on the same thread (a timed call that compiles
    and times) holds it already (an flock taken twice by one process would wait for
    itself)."""
    from cuda_templates.compiler import file_lock

    if device.type != "cuda":
        yield
        return
    path = gpu_lock_path(device)
    held = _held.__dict__.setdefault("paths", set())
    if path in held:
        yield
        return
    started = time.perf_counter()
    with file_lock(path):
        waited = time.perf_counter() - started
        if waited > 1.0:
            log.debug("fusedepi: waited %.1f s for another process's timing on %s", waited, device)
        held.add(path)
        try:
            yield
        finally:
            held.discard(path)


def _host_round_ms(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    if device.type == "cuda":  # from an idle device (each round starts so: no sync after it)
        torch.cuda.synchronize(device)
    return _wall_round_ms(fn, calls)


def _wall_round_ms(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _captured(fn: Callable[[], object]) -> Callable[[], object]:
    """A replay of a CUDA graph of one call of `fn`, or `fn` where it cannot be captured."""
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
        return fn
    return graph.replay


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
