"""The measured choice: a matched chain is fused only where it runs faster than Inductor.

While compiling, two forms of the chain's neighbourhood are timed on random inputs of
the graph's shapes, strides, dtypes and devices, under the precision settings in force:
Inductor's compile of the chain's nodes together with their consumers up to the next
matrix op (`consumers`: Inductor may fuse the chain's last steps into what follows,
and write less than the fused op must), and the fused op (in the form the backend chose
for it: library or in-kernel anchor, padding, layout) followed by Inductor's compile of
those same consumers. The fused op is kept where its form takes at most `WIN` (99%) of
Inductor's GPU time, a tie being no win; otherwise the chain is left to Inductor, with
both times in `explain`. Times are cached
on disk beside the kernels (`choices.json`), keyed by spec, the neighbourhood, shapes,
settings, GPU and torch version: a warm start times nothing.

Timing never touches the model's state: inputs are fresh tensors (BatchNorm's running
statistics included), and no random op is part of a chain.

The chains' choices are made one at a time, but a fused op also changes what Inductor
makes of the rest of the graph (which kernels it fuses across the chain's ends, which
layouts it picks for the next conv). So where any chain of a graph was fused, the whole
graph is timed too (`whole_graph`): its compile with the fused ops against Inductor's
compile of the graph as Dynamo gave it, on random inputs of the graph's shapes, in the
time a call takes in a user's loop: its GPU time or the CPU's time to launch it and
the caller's part of the call (`CALLER_MS`), whichever is longer (a small graph's calls
run at the pace the host launches them, and a library call inside a fused op can cost
the host more than Inductor's graph does);
where the fused graph is not faster by the margin (`WIN`; where the CPU's launches set
the pace, it must lose neither in GPU time nor a call, and win one by `WIN` or
`WIN_HOST`: `GraphTimes.refusal`), Inductor's is run and every chain of the graph is
reported as left to Inductor, with the times (the backend then tries a graph of several
chains again without its weakest one: `backend.GRAPH_ATTEMPTS`). Forward only: a
training graph's backward is compiled alongside and not timed.

The two forms' results on those inputs are compared too: a fused op whose result differs
from Inductor's by more than `AGREEMENT` (norm of the difference over the norm of
Inductor's result, per output) is not taken, whatever the times, and a warning says so.
The bound is loose (the forms may round the anchor differently: a conv in another
layout, TF32): it catches a kernel that computes something else, not a rounding.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import operator
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import Graph, GraphModule, Node

from lowering import MATRIX_OPS, Chain

from . import ops, timings
from .config import Config
from .ops import conv_allows_tf32, matmul_allows_tf32

log = logging.getLogger("fusedepi")

# The largest relative difference (per output, in norm) between the fused form's result
# and Inductor's on the timing's random inputs for which the fused op is still taken.
AGREEMENT = 0.05
# A fused form (a chain's, or the whole graph with its fused ops) is kept only where it
# takes at most WIN of Inductor's time, a tie being no win: GPU times (CUDA graph
# replays, both forms in turns) of the same work agree to about 1% (the zoo's rows where
# both backends run Inductor's graph read 0.99-1.01x in GPU time on an H200). Where the
# CPU's time to launch a call decides a whole graph's time (`GraphTimes.cpu_decides`),
# WIN_HOST: host timings spread more (those rows read 0.96-1.05x in a loop's wall time).
WIN = 0.99
WIN_HOST = 0.97
# A call in a user's loop also spends host time outside the compiled graph (the module's
# __call__, Dynamo's frame and guards), which the whole graph's timing cannot see. It
# adds in full to a graph whose launches set the pace, and to one that the GPU paces only
# past its slack: a fused graph whose launches took 0.089 ms against Inductor's 0.070 ms
# of launches and 0.092 ms of GPU time ran 0.135 against 0.116 ms a call in a loop (bf16
# `convtranspose3d_residual` of the zoo, H100). The zoo's launches of a call through the
# compiled module, timed as the check times them after the compile, exceeded the check's
# launches of the same graph by 0.031 / 0.040 / 0.054 ms (quartiles over 93 fused graphs;
# Inductor's graphs 0.034 / 0.046 / 0.069 over 106) on an H100 host. CALLER_MS is the
# fused graphs' median (`GraphTimes.caller_ms`): at 0.03 the check kept bf16
# `convnext_stem_layernorm2d` (launches 0.097 against 0.091 ms, Inductor's GPU time
# 0.125 ms), which ran 0.195 against 0.172 ms a call in a loop.
CALLER_MS = 0.04


@dataclass(frozen=True)
class Choice:
    """What the measurement found: milliseconds a call of each form (0 where nothing was
    timed), and whether the fused op is kept."""

    fused_ms: float
    inductor_ms: float
    fuse: bool
    note: str = ""
    difference: float = 0.0  # the results' relative difference, where it exceeded AGREEMENT

    def describe(self) -> str:
        if not self.inductor_ms:
            return self.note
        return f"fused {self.fused_ms:.4g} ms, Inductor {self.inductor_ms:.4g} ms{self.note}"


def decide(chain: Chain, spec: str, cfg: Config, claimed: frozenset = frozenset()) -> Choice:
    """Whether `chain` (its kernel already built) is fused, by FUSEDEPI_AUTOTUNE:
    "off": always; "auto": timed where the chain runs on a GPU; "on": timed on the CPU
    too (the reference against Inductor's CPU code: for testing the mechanism).

    `claimed`: the nodes of the graph's other chains (their own fused ops end this
    chain's consumers). A timing that fails keeps the fused op with a warning (raises
    under strict mode).
    """
    device = chain.anchor.meta["val"].device
    if not timed_on(device, cfg):
        return Choice(0.0, 0.0, True, "not timed (FUSEDEPI_AUTOTUNE)" if cfg.autotune == "off" else "")
    try:
        inductor_form, fused_form, inputs = subgraphs(chain, spec, claimed)
    except Exception as err:  # noqa: BLE001 - a neighbourhood we cannot cut out: fused as matched
        if cfg.strict:
            raise
        log.warning("fusedepi: cannot cut out %s at %s to time it (%s: %s); it is fused untimed",
                    chain.spec.fusion, chain.anchor.name, type(err).__name__, err)
        return Choice(0.0, 0.0, True, f"not timed: {type(err).__name__}")
    vals = [n.meta["val"] for n in inputs]
    anchor = set(chain.operands)
    # A tensor's shape; a size (a symbolic int: the neighbourhood views a value by the
    # batch) as (its hint,), which `_measure` passes as the int itself.
    tensors = [isinstance(v, torch.Tensor) for v in vals]
    shapes = [timings.example_shape(v) if t else timings.hinted([v]) for v, t in zip(vals, tensors)]
    strides = [timings.hinted(v.stride()) if t else () for v, t in zip(vals, tensors)]
    if any(s is None for s in shapes):
        return Choice(0.0, 0.0, True, "not timed: a size without a hint")
    dynamic = any(not isinstance(d, int) for v, t in zip(vals, tensors) for d in (v.shape if t else [v]))
    key = "|".join(str(part) for part in (
        _device_name(device), torch.__version__, fused_form.code, inductor_form.code, shapes, strides,
        [str(v.dtype) if t else type(v).__name__ for v, t in zip(vals, tensors)], matmul_allows_tf32(),
        conv_allows_tf32()))
    try:
        fused_ms, inductor_ms, difference = timings.cached(
            Path(cfg.cache_dir) / timings.CACHE_FILE, key + "|compared",
            lambda: _measure(chain, inductor_form, fused_form, vals, shapes, device, [n in anchor for n in inputs]))
    except Exception as err:  # noqa: BLE001 - the chain is fused as matched
        if cfg.strict:
            raise
        log.warning("fusedepi: timing %s at %s against Inductor failed (%s: %s); it is fused untimed",
                    chain.spec.fusion, chain.anchor.name, type(err).__name__, err)
        return Choice(0.0, 0.0, True, f"not timed: {type(err).__name__}")
    note = " (at the size hints of a dynamic shape)" if dynamic else ""
    if difference > AGREEMENT:
        message = (f"the fused result differs from Inductor's by {difference:.3g} (relative, on random inputs of "
                   f"the graph's shapes): {chain.spec.fusion} at {chain.anchor.name} is left to Inductor")
        if cfg.strict:
            raise RuntimeError(f"fusedepi: {message}")
        log.warning("fusedepi: %s", message)
        return Choice(fused_ms, inductor_ms, False, note, difference)
    return Choice(fused_ms, inductor_ms, fused_ms <= WIN * inductor_ms, note)


def timed_on(device: torch.device, cfg: Config) -> bool:
    """Whether work on `device` is timed, by FUSEDEPI_AUTOTUNE (see `decide`)."""
    return cfg.autotune == "on" or (cfg.autotune == "auto" and device.type == "cuda")


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


_MAX_CONSUMERS = 64


def consumers(chain: Chain, claimed: frozenset = frozenset()) -> list[Node]:
    """The nodes after the chain that Inductor could fuse with its last steps, in graph
    order: users of its values, then of theirs, up to a matrix op, a node of another
    chain (`claimed`), a node with side effects (a buffer's copy_, a random op) or the
    graph's output; at most _MAX_CONSUMERS."""
    inside = set(chain.nodes)
    found: dict[Node, None] = {}
    frontier = list(chain.nodes)
    while frontier and len(found) < _MAX_CONSUMERS:
        node = frontier.pop(0)
        for user in node.users:
            if user in inside or user in found or user in claimed or user.op != "call_function":
                continue
            if user.target in MATRIX_OPS or user.is_impure() or _is_random(user):
                continue
            found[user] = None
            frontier.append(user)
    order = {n: i for i, n in enumerate(chain.final.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def _is_random(node: Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags


def _external_inputs(nodes: list[Node]) -> list[Node]:
    """The nodes outside `nodes` whose values they read, in first-use order."""
    inside = set(nodes)
    seen: dict[Node, None] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in inside:
                seen[arg] = None
    return list(seen)


def _escaping(nodes: list[Node]) -> list[Node]:
    """The nodes of `nodes` whose values something outside them reads."""
    inside = set(nodes)
    return [n for n in nodes if any(u not in inside for u in n.users)]


def subgraphs(chain: Chain, spec: str, claimed: frozenset = frozenset()):
    """The two forms of the chain's neighbourhood as graphs of their own, with the same
    placeholders (the neighbourhood's external inputs) and the same outputs (its values
    read elsewhere): (Inductor's form, the fused form, the external input nodes).

    The fused form calls `fusedepi::chain` in place of the chain's nodes and keeps the
    consumers as they are."""
    after = consumers(chain, claimed)
    nodes = list(chain.nodes) + after
    inputs = _external_inputs(nodes)
    outputs = _escaping(nodes)
    forms = []
    for fused in (False, True):
        graph = Graph()
        env: dict[Node, Node] = {}
        for i, node in enumerate(inputs):
            env[node] = graph.placeholder(f"input_{i}")
            env[node].meta["val"] = node.meta["val"]
        if fused:
            operands = list(chain.operands) + list(chain.params)
            # as the rewrite puts it in (`_inductor_compile` asks the layouts again)
            call = ops.insert_chain(graph, [env[n] for n in operands], spec, value=False)
            items = [graph.call_function(operator.getitem, (call, i)) for i in range(len(chain.outputs()))]
            env.update(chain.stand_ins(graph, items))  # as the rewrite puts them in
            copied = after
        else:
            copied = nodes
        for node in copied:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in outputs))
        forms.append(GraphModule(torch.nn.Module(), graph))
    return forms[0], forms[1], inputs


def _random_like(val: torch.Tensor, shape: tuple, centered: bool = False) -> torch.Tensor:
    """A real tensor of val's dtype, device, shape and strides (a transposed weight stays
    transposed, a channels-last activation channels-last; symbolic sizes at their hints):
    values in [0.5, 1.5) (a valid variance, a divisor away from zero), integers zero.
    `centered`: in [-1, 1) (the anchor's operands: a product of mean 0, whose rounding
    a normalization after it does not magnify, as it would that of a mean far from 0)."""
    low, high = (-1.0, 1.0) if centered else (0.5, 1.5)
    strides = timings.hinted(val.stride())
    if strides is None:  # contiguous
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    # Filled through the storage the strides span: an expanded operand (a stride of 0, a
    # weight shared by a bmm's batch) has elements that share memory, and may not be written.
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(n > 0 for n in shape) else 0
    base = torch.empty(span, dtype=val.dtype, device=val.device)
    base = base.uniform_(low, high) if base.is_floating_point() else base.zero_()
    return base.as_strided(shape, strides)


def _measure(chain: Chain, inductor_form: GraphModule, fused_form: GraphModule, vals: list, shapes: list,
             device: torch.device, centered: list) -> tuple[float, float, float]:
    """(ms of the fused form, ms of Inductor's form, each compiled by Inductor; the
    relative difference of their results, `difference`). `centered`: which inputs are
    the anchor's operands (`_random_like`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    started = time.perf_counter()
    with unset_fake_temporarily(), torch.no_grad():
        example = [_random_like(v, s, c) if isinstance(v, torch.Tensor) else s[0]
                   for v, s, c in zip(vals, shapes, centered)]
        # A clean thread: the compile around us holds its fake mode and tracing context
        # in thread-local state, which Inductor's own compiles must not see.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fused = pool.submit(_inductor_compile, fused_form, example).result()
            inductor = pool.submit(_inductor_compile, inductor_form, example).result()
        times = timings.compare_ms([lambda: fused(*example), lambda: inductor(*example)], device)
        apart = difference(fused(*example), inductor(*example))
    log.info("fusedepi: %s at %s: fused %.4f ms, Inductor %.4f ms, results %.3g apart (measured in %.1f s)",
             chain.spec.fusion, chain.anchor.name, times[0], times[1], apart, time.perf_counter() - started)
    return times + (apart,)


def difference(ours, theirs) -> float:
    """The largest relative difference between two forms' outputs: per floating output,
    the norm of the difference over the norm of `theirs` (float64), over the elements
    both hold finite; infinity where the outputs' shapes differ or where more than 1% of
    the elements are finite in one and not the other."""
    ours, theirs = list(ours), list(theirs)
    if len(ours) != len(theirs):
        return float("inf")
    worst = 0.0
    for a, b in zip(ours, theirs):
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or not b.is_floating_point():
            continue
        if a.shape != b.shape:
            return float("inf")
        a, b = a.detach().double(), b.detach().double()
        both = torch.isfinite(a) & torch.isfinite(b)
        if (torch.isfinite(a) != torch.isfinite(b)).sum().item() > 0.01 * max(a.numel(), 1):
            return float("inf")
        gap = torch.linalg.vector_norm(torch.where(both, a - b, 0.0)).item()
        scale = torch.linalg.vector_norm(torch.where(both, b, 0.0)).item()
        worst = max(worst, gap / scale if scale > 0 else (0.0 if gap == 0 else float("inf")))
    return worst


def _inductor_compile(gm: GraphModule, example: list[torch.Tensor]):
    """Inductor's compile of a form. AOTAutograd traces the form again, which drops the
    layouts the fused op asks of its inputs; they are put back on the traced graph, so
    that the fused form is timed with Inductor's copies into those layouts, as it runs in
    the rewritten graph (not with the op's own slower copies)."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(traced: GraphModule, inputs, **kwargs):
        for node in traced.graph.find_nodes(op="call_function", target=torch.ops.fusedepi.chain.default):
            ops.ask_input_layouts(node)
        return compile_fx_inner(traced, inputs, **kwargs)

    with torch.no_grad():
        return compile_fx(gm, example, inner_compile=inner)


@dataclass(frozen=True)
class GraphTimes:
    """The whole graph's times, ms a call: GPU time (`compare_ms`) and the CPU's time to
    launch it (`timings.host_ms`), the graph with its fused ops and Inductor's."""

    fused_ms: float
    inductor_ms: float
    fused_cpu_ms: float
    inductor_cpu_ms: float
    # The host's time a call spends outside either graph (`CALLER_MS` on a GPU; 0 on the
    # CPU, where the times are wall times already).
    caller_ms: float = 0.0

    @property
    def fused_host(self) -> float:
        """The host's time a call: the graph's launches and the caller's part."""
        return self.fused_cpu_ms + self.caller_ms

    @property
    def inductor_host(self) -> float:
        return self.inductor_cpu_ms + self.caller_ms

    @property
    def fused_call(self) -> float:
        """A call in a loop: as long as the GPU runs it or the host's part takes."""
        return max(self.fused_ms, self.fused_host)

    @property
    def inductor_call(self) -> float:
        return max(self.inductor_ms, self.inductor_host)

    def refusal(self) -> str | None:
        """Why Inductor's graph is run instead, or None where the fused graph is kept.

        Where the GPU's time sets both graphs' pace (no `cpu_decides`): kept where the
        fused graph takes at most WIN of Inductor's GPU time. Where the CPU's launches
        set either graph's pace (its launches and the caller's part of a call,
        `caller_ms`, against its GPU time), a call in a user's loop runs at that pace,
        but the same graph inside a larger one, or replayed as a CUDA graph, runs at the
        GPU's:
        kept where it loses on neither measure beyond its spread (GPU time by 1 / WIN, a
        call by 1 / WIN_HOST) and wins on one by its margin (WIN, WIN_HOST). So a graph
        whose calls are faster only because Inductor's launches are slower, while its
        GPU time is longer, is refused (a ReLU before a float32 in-kernel conv: 0.193
        against 0.118 ms of GPU time, 0.180 against 0.256 ms of launches, H200), and one
        1.7x faster on the GPU whose calls tie within the host's spread is kept."""
        if not self.cpu_decides:
            if self.fused_ms <= WIN * self.inductor_ms:
                return None
            slower = "slower than" if self.fused_ms > self.inductor_ms else f"not {1 - WIN:.0%} faster than"
            return (f"the graph with its fused ops is {slower} Inductor's: {self.fused_ms:.4g} ms against "
                    f"{self.inductor_ms:.4g} ms a call for the whole graph")
        if self.fused_ms * WIN > self.inductor_ms:
            return (f"the graph with its fused ops takes more GPU time than Inductor's: {self.fused_ms:.4g} ms "
                    f"against {self.inductor_ms:.4g} ms for the whole graph (a call {self.fused_call:.4g} against "
                    f"{self.inductor_call:.4g} ms, {self.launches()})")
        if self.fused_call * WIN_HOST > self.inductor_call:
            return (f"the graph with its fused ops is slower than Inductor's: {self.fused_call:.4g} ms against "
                    f"{self.inductor_call:.4g} ms a call for the whole graph{self.cpu_note()}")
        if self.fused_ms <= WIN * self.inductor_ms or self.fused_call <= WIN_HOST * self.inductor_call:
            return None
        return (f"the graph with its fused ops is not faster than Inductor's by {1 - WIN_HOST:.0%} a call or "
                f"{1 - WIN:.0%} of GPU time: {self.fused_call:.4g} ms against {self.inductor_call:.4g} ms a call "
                f"for the whole graph{self.cpu_note()}")

    @property
    def cpu_decides(self) -> bool:
        """The host's time (the caller's part included) is the longer of the two for
        either graph."""
        return self.fused_host > self.fused_ms or self.inductor_host > self.inductor_ms

    def launches(self) -> str:
        """The CPU's launches of both graphs, and the caller's part where it is counted."""
        caller = f", and {self.caller_ms:.4g} ms of the caller's" if self.caller_ms else ""
        return f"the CPU's launches {self.fused_cpu_ms:.4g} against {self.inductor_cpu_ms:.4g} ms{caller}"

    def cpu_note(self) -> str:
        if not self.cpu_decides:
            return ""
        return f" (GPU {self.fused_ms:.4g} against {self.inductor_ms:.4g} ms, {self.launches()})"

    def describe(self) -> str:
        if not self.cpu_decides:
            # On a GPU the launches too, though the GPU's time set both paces: where a
            # loop's call still runs slower, they show by how much they were short.
            launches = f" ({self.launches()})" if self.caller_ms else ""
            return f"fused {self.fused_ms:.4g} ms, Inductor {self.inductor_ms:.4g} ms{launches}"
        return (f"fused {self.fused_call:.4g} ms, Inductor {self.inductor_call:.4g} ms a call{self.cpu_note()}")


def whole_graph(gm: GraphModule, example_inputs: list, ours, fused: list, cfg: Config, inductor,
                cuda_graphs: bool = False):
    """The compiled graph to run: `ours` (the graph with its fused ops), or Inductor's
    compile of Dynamo's graph `gm` (`inductor()`, compiled only where needed) where
    `GraphTimes.refusal` says so (GPU time, and a call's time where the CPU's launches
    are longer). `fused`: the graph's records of fused chains; each gets the times
    (`Record.graph`), and becomes a refusal where Inductor's graph is taken.

    Timed where the chains are (`timed_on`), on random
    inputs of the example inputs' shapes, strides, dtypes and devices (memory for a
    second copy of the inputs is needed: where the GPU lacks it, `ours` is kept), and
    cached like the chains' times. A failure keeps `ours` with a warning (raises under
    strict mode). `cuda_graphs`: both compiles replay CUDA graphs of their own
    (mode="reduce-overhead"), so they are timed as called rather than captured again.
    """
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    device = next((x.device for x in tensors if x.device.type == "cuda"), torch.device("cpu"))
    if not fused or not timed_on(device, cfg):
        return ours
    theirs = []  # Inductor's compile, once it is made

    def compiled():
        if not theirs:
            theirs.append(inductor())
        return theirs[0]

    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else repr(x) for x in example_inputs]
    key = "|".join(str(part) for part in (
        "graph", _device_name(device), torch.__version__, gm.code, shapes,
        [tuple(x.stride()) for x in tensors], [str(x.dtype) for x in tensors], matmul_allows_tf32(),
        conv_allows_tf32(), sorted(r.spec for r in fused)))
    try:
        times = GraphTimes(*timings.cached(Path(cfg.cache_dir) / timings.CACHE_FILE, key,
                                           lambda: _measure_graphs(ours, compiled(), example_inputs, device,
                                                                   cuda_graphs)),
                           caller_ms=CALLER_MS if device.type == "cuda" else 0.0)
        for record in fused:
            record.graph = f"whole graph: {times.describe()}"
        refusal = times.refusal()
        if refusal is None:
            return ours
        chosen = compiled()
    except Exception as err:  # noqa: BLE001 - the fused graph as compiled
        if cfg.strict:
            raise
        log.warning("fusedepi: timing the whole graph against Inductor's failed (%s: %s); its fused chains are "
                    "kept", type(err).__name__, err)
        return ours
    reason = f"{refusal}, which Inductor then compiles as it stands"
    log.info("fusedepi: %s", reason)
    for record in fused:
        record.status, record.reason = "refused", reason
    return chosen


def _hint(value):
    """A graph input that is no tensor, as a call passes it: a symbolic size at its hint."""
    if isinstance(value, torch.SymInt):
        hinted = timings.hinted([value])
        if hinted is None:
            raise RuntimeError(f"the size {value} has no hint to time at")
        return hinted[0]
    return value


def _measure_graphs(ours, theirs, example_inputs: list, device: torch.device,
                    cuda_graphs: bool = False) -> tuple[float, float, float, float]:
    """`GraphTimes`' fields: GPU ms of a call of `ours`, of `theirs`, then the CPU's ms
    to launch a call of each, on random inputs like `example_inputs`, without grad,
    leaving the RNG as it was; `cuda_graphs` as in `whole_graph`."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    started = time.perf_counter()
    with unset_fake_temporarily(), torch.no_grad(), torch.random.fork_rng(
            devices=[device] if device.type == "cuda" else []):
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        if device.type == "cuda":
            need = sum(x.untyped_storage().nbytes() for x in tensors if x.device == device)
            free, _ = torch.cuda.mem_get_info(device)
            if need > free // 2:
                raise RuntimeError(f"a copy of the graph's inputs ({need / 2**30:.1f} GiB) would not fit beside them")
        inputs = [_random_like(x, timings.example_shape(x)) if isinstance(x, torch.Tensor)
                  else _hint(x) for x in example_inputs]
        # Called as Dynamo calls a backend's result: one argument an input.
        calls = [lambda: ours(*inputs), lambda: theirs(*inputs)]
        times = timings.compare_ms(calls, device, capture=not cuda_graphs)
        # On the CPU those are wall times already: the host's own (`host_ms`) would be the same.
        times += timings.host_ms(calls, device) if device.type == "cuda" else times
    log.info("fusedepi: the whole graph: fused %.4f ms, Inductor %.4f ms; the CPU's launches %.4f and %.4f ms "
             "(measured in %.1f s)", *times, time.perf_counter() - started)
    return times
