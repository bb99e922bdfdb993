"""The `fusedepi` torch.compile backend: Inductor, with our chains rewritten first.

Inductor's `compile_fx` runs AOTAutograd with Inductor's decompositions minus
`lowering.HELD_BACK_OPS`, so the matcher sees those ops whole. Our inner compile
step rewrites matched chains into fused ops, decomposes whatever held-back ops
remain, and hands the graph to Inductor's own inner compile. A graph in which no
chain fuses is compiled again by plain `compile_fx`, so that Inductor sees it exactly
as it would without fusedepi (at the cost of a second AOTAutograd trace); so is a graph
whose fused form runs slower as a whole than Inductor's (`choice.whole_graph`), after
the graph was compiled and timed again without its weakest chains (`GRAPH_ATTEMPTS`). In
training, a pass over the joint graph first marks the chains' nodes so that backward
gets their values from the fused op rather than recomputing them (`KeepChainValues`).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from contextlib import contextmanager

import torch
import torch.fx.traceback as fx_traceback
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from lowering import HELD_BACK_OPS, match_graph
from lowering.spec import REDUCTIONS

from . import choice, timings
from .config import Config, load_config
from .ops import matmul_allows_tf32
from .rewrite import Report, rewrite

log = logging.getLogger("fusedepi")

# Where fusion reports go while `collect_reports` is active. Process-wide, not
# per-thread: Dynamo and Inductor may compile on a thread other than the caller's.
_sinks: list = []
_sinks_lock = threading.Lock()


def _overloads(packets):
    return {getattr(p, name) for p in packets for name in p.overloads()}


@functools.lru_cache(maxsize=1)
def _tables():
    """(Inductor's table without the held-back ops, the held-back decompositions)."""
    table = dict(select_decomp_table())
    held = {op: table.pop(op) for op in _overloads(HELD_BACK_OPS) if op in table}
    return table, held


def _decompose_held_back(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    """Applies Inductor's decompositions to held-back ops that were not fused.

    The whole table, not only the held-back entries: a decomposition may emit ops
    (logsumexp -> masked_fill) that Inductor expects decomposed in turn.
    """
    _, held = _tables()
    if not any(n.op == "call_function" and n.target in held for n in gm.graph.nodes):
        return gm
    fake_mode = detect_fake_mode(example_inputs)

    def run(*args):  # node by node, so that each new node keeps its source node's metadata
        return torch.fx.Interpreter(gm).run(*args)

    with fake_mode, fx_traceback.preserve_node_meta():
        traced = make_fx(run, decomposition_table=select_decomp_table(), tracing_mode="real")(*example_inputs)
    # What Inductor's compile_fx put on the inputs and the output (which outputs the user
    # sees, whose strides must be kept: `user_visible_output_idxs`) carries over too.
    old = [n for n in gm.graph.nodes if n.op in ("placeholder", "output")]
    new = [n for n in traced.graph.nodes if n.op in ("placeholder", "output")]
    if len(old) == len(new):  # one placeholder an input, one output: always, by make_fx
        for before, after in zip(old, new):
            after.meta.update({k: v for k, v in before.meta.items() if k not in after.meta})
    return traced


@contextmanager
def collect_reports(into: list):
    """Collects the `Report` of every graph compiled while active (for `explain`)."""
    with _sinks_lock:
        _sinks.append(into)
    try:
        yield into
    finally:
        with _sinks_lock:
            _sinks.remove(into)


def _backward_nodes(graph: torch.fx.Graph) -> frozenset:
    """The backward's nodes in a joint graph: those that depend on an incoming gradient
    (`tangents_*`), and those only they use (mish's backward takes sigmoid(x) of the
    forward's x, a silu pair to the matcher unless it knows)."""
    seen: set = set()
    stack = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    while stack:
        node = stack.pop()
        if node not in seen and node.op != "output":
            seen.add(node)
            stack.extend(node.users)
    for node in reversed(graph.nodes):
        if node.op == "call_function" and node.users and all(u in seen for u in node.users):
            seen.add(node)
    return frozenset(seen)


# Reductions whose backward compares their input with their result (which elements were largest).
EXTREMA = ("amax", "amin", "spatial_amax", "spatial_amin", "channel_amax", "channel_amin")
# The same, and medians of the whole value, as aten ops of the joint graph outside a
# chain: their backward divides by the count of input elements equal to the result, 0
# where a recomputed input equals none.
_EXTREMUM_OPS = (torch.ops.aten.amax.default, torch.ops.aten.amin.default, torch.ops.aten.max.default,
                 torch.ops.aten.min.default, torch.ops.aten.median.default, torch.ops.aten.nanmedian.default)


def _reaches_an_extremum(chain, backward: frozenset) -> bool:
    """Whether a forward extremum outside `chain` (`_EXTREMUM_OPS`) reads one of its
    values, directly or through views and pointwise ops (which the partitioner may
    recompute in backward from the recomputed value)."""
    inside = set(chain.nodes)
    seen: set = set()
    stack = [u for n in chain.nodes for u in n.users if u not in inside]
    while stack:
        node = stack.pop()
        if node in seen or node in backward or node.op != "call_function":
            continue
        seen.add(node)
        if node.target in _EXTREMUM_OPS:
            return True
        if _pointwise(node) or _view(node):
            stack.extend(node.users)
    return False


def _before_the_first_reduction(chain, order: dict) -> list:
    """The chain's pointwise nodes before the first of its nodes that is neither
    pointwise nor a view (its reduction's, in graph order): the values a norm's input
    is computed from."""
    kept = []
    for node in sorted(chain.nodes[1:], key=order.__getitem__):
        if _pointwise(node):
            kept.append(node)
        elif not _view(node):
            break
    return kept


def _pointwise(node: torch.fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


def _view(node: torch.fx.Node) -> bool:
    return bool(getattr(node.target, "is_view", False))


class KeepChainValues(CustomGraphPass):
    """Joint-graph pass (before the forward/backward partition): marks the nodes of
    the chains the rewrite will fuse MUST_SAVE where a recomputation would not match.

    The partitioner recomputes cheap pointwise values in backward from an earlier
    saved one, in Inductor's code, whose rounding is not the fused kernel's: a
    recomputed input of amax/amin (in the chain, or after it: `_reaches_an_extremum`)
    no longer equals the extremum the fused op, or Inductor from its output, found,
    and a recomputed bf16/fp16 value (Inductor keeps it in float32) no longer matches
    the statistics taken from the fused op's rounded one (seen by the fuzzer:
    gradients off by 20x eager's error, or inf), and a float32 norm's input recomputed
    from steps before it no longer matches the statistics the fused op took (a norm's
    backward cancels terms of the size of its input: 0.3 of the gradient's norm against
    eager's 7e-4, CPU fuzzer --grad, seed 28, generation 13, model 203). Those values
    are marked, and backward reads what the fused op returns, as eager reads what its
    forward saved: all of a chain's in the first two cases, in the third the pointwise
    ones before the norm (`_before_the_first_reduction`). Other float32 values stay
    recomputable: an ulp of difference is harmless there, and saving fewer values moves
    fewer bytes.
    """

    def __init__(self, cfg: Config, then=None):
        self.cfg, self.then = cfg, then

    def __call__(self, graph: torch.fx.Graph) -> None:
        # A pass the user set runs first (torch 2.13 also takes a list of passes).
        for then in self.then if isinstance(self.then, (list, tuple)) else [self.then] if self.then else []:
            then(graph)
        try:
            tf32 = matmul_allows_tf32()
            backward = _backward_nodes(graph)
            chains, _ = match_graph(graph, self.cfg.disabled, self.cfg.cpu_reference, matmul_tf32=tf32,
                                    backward=backward)
        except Exception as err:  # the rewrite will meet and report the same failure
            log.debug("fusedepi: joint-graph matching failed: %s", err)
            return
        order = {node: i for i, node in enumerate(graph.nodes)}
        for chain in chains:
            steps = chain.spec.steps
            exact = (chain.spec.dtype != "float32" or any(s.name in EXTREMA for s in steps)
                     or _reaches_an_extremum(chain, backward))
            if exact:
                keep = chain.nodes[1:]
            elif any(s.name in REDUCTIONS for s in steps[1:]):
                keep = _before_the_first_reduction(chain, order)
            else:
                keep = []
            for node in keep:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE

    def uuid(self):
        """Part of the key of Inductor's FX graph cache, for every graph fusedepi compiles:
        the rewritten graph holds each fused op's spec but not the code that gives the op
        its fake (the reference's shapes) or asks its inputs' layouts, so the key holds a
        digest of fusedepi's sources too (`timings.source_digest`): a changed reference is
        not served output code compiled against the old one."""
        from importlib.metadata import version

        thens = self.then if isinstance(self.then, (list, tuple)) else [self.then]
        then = [t.uuid() if isinstance(t, CustomGraphPass) else repr(t) for t in thens]
        return (f"fusedepi-keep-chain-values-{version('fusedepi')}-{timings.source_digest()}-"
                f"{sorted(self.cfg.disabled)}-{then}")


def _inductor_decompositions():
    """Inductor's table minus the held-back ops, by reference (see `_inner_compile`)."""
    return _tables()[0]


class _NothingFused(Exception):
    """Raised out of the forward's inner compile when its rewrite fused no chain: the
    backend then hands Dynamo's graph to Inductor as it stands (`fusedepi`)."""


def _inner_compile(gm, example_inputs, *, cfg: Config, reports: list, skip: dict, **kwargs):
    # compile_fx hands our table to the inner compile wrapped in an object that
    # Inductor's FX graph cache pickles into its key; the table holds functions that do
    # not pickle, and every compile bypassed the cache (a warm start redid Inductor's
    # codegen). A module-level function pickles by name. Inductor uses it only to check
    # that no op has both a fallback and a decomposition.
    if "get_decomp_fn" in kwargs:
        kwargs["get_decomp_fn"] = _inductor_decompositions
    if not kwargs.get("is_backward", False):
        report = rewrite(gm, cfg, skip)
        reports.append(report)
        if not any(r.status == "fused" for r in report.records):
            raise _NothingFused()
    gm = _decompose_held_back(gm, example_inputs)
    return compile_fx_inner(gm, example_inputs, **kwargs)


def _configure_logging(cfg: Config):
    logger = logging.getLogger("fusedepi")
    logger.setLevel(cfg.log_level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logger.addHandler(handler)


def _inductor_patches(mode, options) -> dict:
    """Inductor config for `torch.compile(..., mode=..., options=...)`, as Inductor reads them.

    Raises:
        RuntimeError: an unknown mode or option name (Inductor's own message).
    """
    from torch._inductor import list_mode_options, list_options

    patches = dict(list_mode_options(mode)) if mode else {}
    if options:
        known = set(list_options())
        unknown = sorted(k for k in options if k not in known)
        if unknown:
            raise RuntimeError(f"fusedepi: unknown Inductor options {unknown} (see torch._inductor.list_options())")
        patches.update(options)
    return patches


def fusedepi(gm: torch.fx.GraphModule, example_inputs, *, mode=None, options=None, **kwargs):
    """The torch.compile backend: `torch.compile(model, backend="fusedepi")`.

    Args:
        gm: the graph Dynamo captured.
        example_inputs: its example inputs.
        mode: `torch.compile`'s mode, applied to Inductor as Inductor applies it
            ("reduce-overhead": CUDA graphs; the fused ops are capturable).
        options: `torch.compile`'s options, Inductor config entries.
        **kwargs: passed to Inductor's `compile_fx` (e.g. `config_patches`).
    """
    cfg = load_config()
    _configure_logging(cfg)
    patches = _inductor_patches(mode, options)
    if patches:
        kwargs["config_patches"] = {**patches, **kwargs.get("config_patches", {})}
    if cfg.disable_all:
        return compile_fx(gm, example_inputs, **kwargs)
    table, _ = _tables()
    # AOTAutograd's cache is keyed on the graph before our rewrite: a hit would hand
    # back whatever plain Inductor compiled for it. Inductor's FX graph cache stays on;
    # its key is the rewritten graph, which carries our specs.
    # Shape padding pads a matmul and slices its output when a microbenchmark says the
    # padded one is faster, so whether a chain starts with a bare addmm would vary
    # from run to run (seen: bf16 [14, 64] x [64, 96] + LayerNorm refused as
    # "slice.Tensor is not in the vocabulary" in one run of three).
    keep = KeepChainValues(cfg, then=inductor_config.joint_custom_post_pass)
    cuda_graphs = bool(kwargs.get("config_patches", {}).get("triton.cudagraphs", inductor_config.triton.cudagraphs))
    theirs: list = []  # Inductor's compile of Dynamo's graph, once it is made

    def inductor():
        if not theirs:
            theirs.append(compile_fx(gm, example_inputs, **kwargs))
        return theirs[0]

    skip: dict = {}  # chains left to Inductor because the whole graph ran slower with them
    for attempt_no in range(1, GRAPH_ATTEMPTS + 1):
        # Inductor's passes edit the graph they are given: each attempt gets a graph of
        # its own (the module's parameters are shared, not copied).
        attempt = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        attempt.meta.update(gm.meta)  # what Dynamo recorded (compile id, parameter names)
        reports: list = []  # this attempt's (its forward's)
        try:
            with functorch_config.patch(enable_autograd_cache=False), inductor_config.patch(
                shape_padding=False, joint_custom_post_pass=keep
            ):
                ours = compile_fx(
                    attempt,
                    example_inputs,
                    inner_compile=functools.partial(_inner_compile, cfg=cfg, reports=reports, skip=skip),
                    decompositions=table,
                    **kwargs,
                )
        except _NothingFused:
            # No chain fused (none matched, or the measured choice kept Inductor's form for
            # all): Inductor compiles the graph exactly as it would without fusedepi. Its
            # held-back ops would otherwise reach it decomposed by `_decompose_held_back`,
            # after Inductor's joint-graph passes, and its kernels differ (a bf16
            # ConvTranspose2d + GroupNorm + tanh tail: 43 against 23 us on an H100).
            log.debug("fusedepi: no chain fused in this graph; Inductor compiles it as it stands")
            _publish(reports)
            return inductor()
        # The chains were chosen one by one; the whole graph with them must not be slower
        # than Inductor's (a fused op changes what Inductor fuses and lays out around it).
        fused = [r for report in reports for r in report.records if r.status == "fused"]
        chosen = choice.whole_graph(gm, example_inputs, ours, fused, cfg, inductor, cuda_graphs)
        least = _least_gain(fused) if chosen is not ours and len(fused) > 1 else None
        if least is None or least.anchor in skip or attempt_no == GRAPH_ATTEMPTS:
            _publish(reports)
            return chosen
        # The graph with all of them ran slower: the chain whose own timing gained least
        # goes to Inductor, and the graph is compiled and timed again with the others.
        skip[least.anchor] = f"left to Inductor after the whole graph was timed with it: {least.reason}"
        log.info("fusedepi: the graph with %d fused chains is slower than Inductor's; trying it without the one "
                 "at %s", len(fused), least.anchor)
    raise AssertionError("unreachable: the last attempt returns")


# Compiles of a graph with fused chains, each timed whole against Inductor's: the first
# with every chain the measured choice kept, each next one without the chain that gained
# least on its own (`fusedepi`).
GRAPH_ATTEMPTS = 3


def _least_gain(fused: list):
    """The record whose own timing gained least over Inductor's form (an untimed one: none)."""
    def gain(record):
        c = record.plan.choice if record.plan is not None else None
        return c.inductor_ms - c.fused_ms if c is not None and c.inductor_ms else 0.0

    return min(fused, key=gain)


def _publish(reports: list) -> None:
    """Hands the graph's final reports to every active `collect_reports`."""
    with _sinks_lock:
        for sink in _sinks:
            sink.extend(reports)


__all__ = ["Report", "collect_reports", "fusedepi"]
