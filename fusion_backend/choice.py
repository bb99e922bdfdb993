"""The measured choice: a matched chain is fused only where it runs faster than Inductor.

While compiling, each chain's fused op (in the form the backend chose for it: library
or in-kernel anchor, padding, layout) is timed against Inductor's own compile of the
same subgraph (anchor + chain, with the same outputs) on random inputs of the graph's
shapes, dtypes and devices, under the precision settings in force. The fused op is
kept where it is at least as fast; otherwise the chain is left to Inductor, with both
times in `explain`. Times are cached on disk beside the kernels (`choices.json`), keyed
by spec, shapes, settings, GPU and torch version: a warm start times nothing.

Timing never touches the model's state: inputs are fresh tensors (BatchNorm's running
statistics included), and no random op is part of a chain.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import Graph, GraphModule, Node

from lowering import Chain

from . import timings
from .config import Config
from .ops import conv_allows_tf32, matmul_allows_tf32

log = logging.getLogger("fusedepi")

CACHE_FILE = "choices.json"


@dataclass(frozen=True)
class Choice:
    """What the measurement found: milliseconds a call of each form (0 where nothing was
    timed), and whether the fused op is kept."""

    fused_ms: float
    inductor_ms: float
    fuse: bool
    note: str = ""

    def describe(self) -> str:
        if not self.inductor_ms:
            return self.note
        return f"fused {self.fused_ms:.4g} ms, Inductor {self.inductor_ms:.4g} ms{self.note}"


def decide(chain: Chain, spec: str, cfg: Config) -> Choice:
    """Whether `chain` (its kernel already built) is fused, by FUSEDEPI_AUTOTUNE:
    "off": always; "auto": timed where the chain runs on a GPU; "on": timed on the CPU
    too (the reference against Inductor's CPU code: for testing the mechanism).

    A timing that fails keeps the fused op with a warning (raises under strict mode).
    """
    device = chain.anchor.meta["val"].device
    if cfg.autotune == "off" or (cfg.autotune == "auto" and device.type != "cuda"):
        return Choice(0.0, 0.0, True, "not timed (FUSEDEPI_AUTOTUNE)" if cfg.autotune == "off" else "")
    inputs = _external_inputs(chain)
    shapes = [timings.example_shape(n.meta["val"]) for n in inputs]
    if any(s is None for s in shapes):
        return Choice(0.0, 0.0, True, "not timed: a size without a hint")
    dynamic = any(not isinstance(d, int) for n in inputs for d in n.meta["val"].shape)
    key = "|".join(str(part) for part in (
        _device_name(device), torch.__version__, spec, shapes, [str(n.meta["val"].dtype) for n in inputs],
        matmul_allows_tf32(), conv_allows_tf32()))
    try:
        fused_ms, inductor_ms = timings.cached(Path(cfg.cache_dir) / CACHE_FILE, key,
                                               lambda: _measure(chain, spec, inputs, shapes, device))
    except Exception as err:  # noqa: BLE001 - the chain is fused as matched
        if cfg.strict:
            raise
        log.warning("fusedepi: timing %s at %s against Inductor failed (%s: %s); it is fused untimed",
                    chain.spec.fusion, chain.anchor.name, type(err).__name__, err)
        return Choice(0.0, 0.0, True, f"not timed: {type(err).__name__}")
    note = " (at the size hints of a dynamic shape)" if dynamic else ""
    return Choice(fused_ms, inductor_ms, fused_ms <= inductor_ms, note)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _external_inputs(chain: Chain) -> list[Node]:
    """The nodes outside the chain whose values its nodes read, in graph order: the
    anchor's operands, the epilogue's tensors, and whatever else a node reads (a
    constant the matcher took as a number)."""
    inside = set(chain.nodes)
    seen: dict[Node, None] = {}
    for node in chain.nodes:
        for arg in node.all_input_nodes:
            if arg not in inside:
                seen[arg] = None
    return list(seen)


def subgraph(chain: Chain) -> tuple[GraphModule, list[Node]]:
    """The chain as a graph of its own: a placeholder for each external input, the
    chain's nodes, and as outputs every value the fused op would return (its result,
    BatchNorm's running statistics, values saved for backward)."""
    graph = Graph()
    inputs = _external_inputs(chain)
    env: dict[Node, Node] = {}
    for i, node in enumerate(inputs):
        env[node] = graph.placeholder(f"input_{i}")
        env[node].meta["val"] = node.meta["val"]
    for node in chain.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    outputs = [chain.final] + list(chain.extra) + list(chain.saved)
    graph.output(tuple(env[n] for n in outputs))
    return GraphModule(torch.nn.Module(), graph), inputs


def _random_like(val: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A real tensor of val's dtype, device, shape and strides (a transposed weight stays
    transposed, a channels-last activation channels-last; symbolic sizes at their hints):
    values in [0.5, 1.5) (a valid variance, a divisor away from zero), integers zero."""
    strides = timings.hinted(val.stride())
    if strides is None:
        t = torch.empty(shape, dtype=val.dtype, device=val.device)
    else:
        t = torch.empty_strided(shape, strides, dtype=val.dtype, device=val.device)
    return t.uniform_(0.5, 1.5) if t.is_floating_point() else t.zero_()


def _measure(chain: Chain, spec: str, inputs: list[Node], shapes: list, device: torch.device) -> tuple[float, float]:
    """(ms of the fused op, ms of Inductor's compile of the same subgraph)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    gm, _ = subgraph(chain)
    fused_inputs = list(chain.operands) + list(chain.params)
    started = time.perf_counter()
    with unset_fake_temporarily(), torch.no_grad():
        real = {n: _random_like(n.meta["val"], s) for n, s in zip(inputs, shapes)}
        example = [real[n] for n in inputs]
        # A clean thread: the compile around us holds its fake mode and tracing context
        # in thread-local state, which Inductor's own compile of the subgraph must not see.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            compiled = pool.submit(_inductor_compile, gm, example).result()
        fused_args = [real[n] for n in fused_inputs]

        def fused():
            return torch.ops.fusedepi.chain(fused_args, spec)

        def inductor():
            return compiled(*example)

        times = (gpu_ms(fused, device), gpu_ms(inductor, device))
    log.info("fusedepi: %s at %s: fused %.4f ms, Inductor %.4f ms (measured in %.1f s)", chain.spec.fusion,
             chain.anchor.name, times[0], times[1], time.perf_counter() - started)
    return times


def _inductor_compile(gm: GraphModule, example: list[torch.Tensor]):
    from torch._inductor.compile_fx import compile_fx

    with torch.no_grad():
        return compile_fx(gm, example)


def gpu_ms(fn, device: torch.device) -> float:
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
            return timings.best_ms(fn)
        return timings.best_ms(graph.replay)
