"""Graph surgery: replaces each matched chain with one `fusedepi::chain` call.

This is the one boundary where lowering and compile failures are caught: a chain
that fails is left to Inductor with one warning (or raises under FUSEDEPI_STRICT).
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import math
import operator
from dataclasses import dataclass, field, replace

import torch
from torch.fx import GraphModule

import cuda_templates
from lowering import Chain, match_graph
from lowering.spec import operand_numel, operand_size_words

from . import choice, forms, launch, native, ops, timings
from .config import Config
from .plan import ExecutionPlan

log = logging.getLogger("fusedepi")
aten = torch.ops.aten


class FusionError(RuntimeError):
    """Raised under FUSEDEPI_STRICT=1 when a chain cannot be lowered or compiled."""


@dataclass
class Record:
    """One line of the fusion report: a fused chain or a refused candidate."""

    status: str  # "fused" or "refused"
    anchor: str
    nodes: list
    fusion: str = ""
    kernel: str = ""
    reason: str = ""
    stop: str = ""
    spec: str = ""
    plan: ExecutionPlan | None = None  # how a chain that got as far as a measurement runs, or would run
    graph: str = ""  # the whole graph's timing, where it was timed (`choice.whole_graph`)

    @property
    def measured(self) -> str:
        """The measurements behind the decision (`ExecutionPlan.describe`, then the whole
        graph's), or nothing."""
        parts = [self.plan.describe() if self.plan is not None else "", self.graph]
        return "; ".join(p for p in parts if p)


@dataclass
class Report:
    """What one graph's rewrite did."""

    records: list = field(default_factory=list)


def _replace(graph: torch.fx.Graph, chain: Chain, spec: str, renamed: dict) -> None:
    """Puts one fused op in place of `chain`'s nodes.

    `renamed` maps each node that an earlier replacement took out to the node that now
    stands for it; it is read for this chain's inputs (one chain's output may be the
    next chain's anchor input) and extended with this chain's own outputs.
    """
    inputs = [renamed.get(n, n) for n in list(chain.operands) + list(chain.params)]
    with graph.inserting_before(chain.final):
        call = ops.insert_chain(graph, inputs, spec)
        outs = []
        for i, val in enumerate(call.meta["val"]):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta["val"] = val
            outs.append(item)
        stand_ins = chain.stand_ins(graph, outs)
    for node, new in stand_ins:
        node.replace_all_uses_with(new)
        renamed[node] = new
    for node in reversed(chain.nodes):
        graph.erase_node(node)


def _stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Moves producers up to their first use, keeping every other node where it is.

    The fused op is inserted at the chain's last node, but users of its extra
    outputs (BatchNorm running stats, values saved for backward) may sit earlier;
    this pulls the op and its not-yet-defined inputs ahead of them. Nodes with side
    effects (`copy_` into buffers) are never referenced, so they do not move; a
    random op computing an input may now draw before another random op, which
    Inductor's own random numbers do not follow eager's order either.

    Raises:
        RuntimeError: the graph has a cycle (fused ops waiting for each other).
    """
    placed: set = set()
    waiting: set = set()  # nodes whose inputs are being placed: met again unplaced, a cycle
    cursor = next(iter(graph.nodes))
    for node in list(graph.nodes):
        stack = [node]
        while stack:
            top = stack[-1]
            if top in placed:
                stack.pop()
                continue
            missing = [i for i in top.all_input_nodes if i not in placed]
            if missing:
                if top in waiting:
                    raise RuntimeError(f"the rewritten graph has a cycle through {top.name}")
                waiting.add(top)
                stack.extend(missing)
                continue
            stack.pop()
            placed.add(top)
            if top is not cursor:
                cursor.append(top)
            cursor = top


class OperandMismatch(ValueError):
    """The graph's operands disagree with what the spec says the kernels read."""


def _check_operands(chain: Chain) -> None:
    """The graph's example operands against the sizes and dtypes the launchers will check
    at every call (`EpilogueSpec.param_sizes`), and its conv output against the shape
    they give the fused op's: a chain they would refuse or misshape is not fused.

    Raises:
        OperandMismatch: an operand of another size, dtype or device, or a conv output
            of other spatial dims than the launchers allocate (`Anchor.direct_out_spatial`).
    """
    spec = chain.spec
    anchor_val = chain.anchor.meta["val"]
    shape = timings.example_shape(anchor_val)  # rows: the anchor output's elements over a row's
    rows = math.prod(shape) // (spec.channels * spec.inner) if shape else None
    for node, dtype, sizes in zip(chain.params, spec.param_dtypes, spec.param_sizes()):
        val = node.meta["val"]
        numel = timings.example_shape(val)
        numel = None if numel is None else math.prod(numel)
        want = operand_numel(sizes, rows) if rows is not None else sizes[0] or None
        if val.device != anchor_val.device or str(val.dtype) != f"torch.{dtype}" or (
                rows is not None and want is None) or (want is not None and numel is not None and numel != want):
            raise OperandMismatch(f"operand {node.name} ({tuple(val.shape)} {val.dtype} on {val.device}) is not "
                                  f"what the kernels would read: {operand_size_words(sizes, rows, dtype)}")
    anchor = spec.anchor
    if anchor.kind == "conv" and not anchor.permuted and shape is not None:
        # The launchers shape the output from the spec: the kernels' conv output plane,
        # and the spatial dims a reduction keeps, must be the graph's.
        if anchor.spatial_dims != len(shape) - 2 or (anchor.direct and anchor.direct_out_spatial() != tuple(shape[2:])):
            planned = anchor.direct_out_spatial() if anchor.direct else f"{anchor.spatial_dims} spatial dims"
            raise OperandMismatch(f"the conv's output {tuple(shape)} is not the one the kernels would write "
                                  f"({planned} after the channels)")


def _prepare(chain: Chain, spec: str, cfg: Config) -> str:
    """Compiles the chain's kernel ahead of the first call; returns the kernel name."""
    _check_operands(chain)
    device = chain.anchor.meta["val"].device
    padded = ""
    if chain.spec.anchor.pad:
        padded = " (library GEMM on operands padded to K={}, N={}: aligned rows)".format(*chain.spec.anchor.pad)
    elif chain.spec.anchor.channels_last:
        padded = " (library conv on channels-last operands)"
    if chain.spec.anchor.flipped:
        padded += " (a ConvTranspose of stride 1 as the conv it equals: its weight transposed and flipped by the graph)"
    if chain.spec.anchor.as_2d:
        padded += " (a Conv1d as a 2-D conv of one row)"
    if device.type != "cuda":
        return "reference (cpu)" + padded
    in_kernel_conv = ops.runs_in_kernel_conv(chain.spec, chain.operands[0].meta["val"])
    if chain.spec.anchor.depth and in_kernel_conv:
        padded += " (a Conv3d by its output's depth planes)"
    if chain.spec.anchor.recompute and in_kernel_conv:
        padded += " (run twice: its tiles' moments, then the chain with the norm applied in its tiles)"
    if chain.spec.anchor.rounded and in_kernel_conv:
        padded += " (x and the weight rounded to the nearest TF32 value by the graph first, as cuDNN's TF32 convs round)"
    tf32 = _build(spec, device, cfg)
    arch = ops.arch_of(device)
    name = cuda_templates.kernel_name(chain.spec, arch, tf32) + padded
    gemm = cuda_templates.gemm_plan(chain.spec, arch)
    every_call = chain.spec.anchor.gemm[1] if chain.spec.anchor.gemm else 0
    if isinstance(gemm, str):
        if every_call:  # asked for (FUSEDEPI_IN_KERNEL_GEMM=1), not taken
            name += f" (library GEMM first: {gemm})"
    elif chain.spec.dtype == "float32" and not ops.matmul_allows_tf32():  # the launcher reads it at every call
        name += " (library GEMM first while float32 matmul precision is 'highest': the in-kernel GEMM is TF32)"
    elif not every_call:  # auto, chosen per call: say what this graph's rows get
        rows = chain.anchor.meta["val"].shape[0]
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if not isinstance(rows, int):
            name += " (per call: the library GEMM first where the rows give too few tiles for the GPU)"
        elif not cuda_templates.fills_gpu(rows, chain.spec.channels, sms):
            name += f" (library GEMM first at {rows} rows: too few {gemm.block_m}x{gemm.block_n} tiles for {sms} SMs)"
    return name


def _build(spec: str, device: torch.device, cfg: Config) -> bool:
    """Builds (or finds) the kernel of `spec` for `device`; returns whether it is the
    variant for float32 convs that may use TF32."""
    tf32 = launch.reads_conv_tf32(spec) and ops.conv_allows_tf32()
    launch.kernel_for(spec, device, cfg.cache_dir, tf32, cfg.debug)
    return tf32


# Builds of the specs a chain is also timed in (`_prebuild_alternatives`): nvcc runs in
# child processes, so a thread a build.
_BUILDS = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fusedepi-build")


def _prepare_taken(chain: Chain, rows: tuple, cfg: Config) -> tuple[str, tuple]:
    """Builds the chain's kernel in the forms taken (`_prepare`). Where that fails and a
    row took its form only for the chain's timing (`FormChoice.by_chain`: the in-kernel
    conv, the consumer warps), the spec before that row is built instead, the row not
    taken with the reason: a form the measured choice would only try never costs the
    chain its fusion. Under strict mode the failure raises. Returns (kernel, rows)."""
    try:
        return _prepare(chain, chain.spec.to_json(), cfg), rows
    except Exception as err:
        last = next((i for i in reversed(range(len(rows))) if rows[i].by_chain and rows[i].alternative is not None),
                    None)
        if last is None or cfg.strict or isinstance(err, OperandMismatch):
            raise
        first = launch.first_line(err)
        log.warning("fusedepi: %s at %s: the kernel with %s failed to build (%s); the chain is built without it",
                    chain.spec.fusion, chain.anchor.name, rows[last].form, first)
        chain.spec = rows[last].alternative
        rows = rows[:last] + (replace(rows[last], taken=False, alternative=None,
                                      chains=f"its kernel failed to build: {first}"),) + rows[last + 1:]
        return _prepare_taken(chain, rows, cfg)


def _prebuild_alternatives(chain: Chain, rows: tuple, cfg: Config) -> list:
    """Where the measured choice will time `chain` and a form taken keeps the spec
    without it (`forms.FormChoice.alternative`, timed too by `_without_forms`), starts
    building that spec's kernel beside the chain's own build, so that the two nvcc
    runs overlap. Returns the builds' futures; a build that fails here fails again
    where it is needed, and says so there."""
    device = chain.anchor.meta["val"].device
    if device.type != "cuda" or not choice.timed_on(device, cfg):
        return []
    return [_BUILDS.submit(_build, row.alternative.to_json(), device, cfg) for row in rows
            if row.alternative is not None]


def _without_forms(chain: Chain, plan: ExecutionPlan, cfg: Config, claimed: frozenset) -> ExecutionPlan:
    """Where a form was taken by its library call's time alone and the rest of the chain
    may pay for it, or for the chain's timing alone (`forms.FormChoice.alternative`),
    and the measured choice timed the chain: the chain is built and timed in the spec
    each such row started from too, and the fastest fused form is the plan (each row's
    times in its `explain`, and taken where the fastest spec holds its form). With two
    rows (a conv: channels-last, then the in-kernel conv) that is three forms. A result
    that differs from Inductor's (`Choice.difference`) never wins; a spec that cannot be
    built is left out. A row taken for the chain's timing alone (`Form.timed_as_chain`)
    where the chain was not timed after all goes back to the spec before it."""
    if not plan.choice.inductor_ms:
        return _untimed(chain, plan, cfg)
    found = {plan.spec: (chain.spec, plan.kernel, plan.choice)}
    taken = chain.spec
    for row in plan.forms:
        spec = row.alternative.to_json() if row.alternative is not None else None
        if spec is None or spec in found:
            continue
        chain.spec = row.alternative
        try:
            found[spec] = (row.alternative, _prepare(chain, spec, cfg), choice.decide(chain, spec, cfg, claimed))
        except Exception as err:  # noqa: BLE001 - left out of the comparison
            if cfg.strict and not isinstance(err, (cuda_templates.NotRenderable, OperandMismatch)):
                raise
            log.info("fusedepi: %s at %s without %s: %s", chain.spec.fusion, chain.anchor.name, row.form, err)
        finally:
            chain.spec = taken
    if len(found) == 1:
        return plan
    best = plan.spec
    for spec, (_, _, other) in found.items():
        now = found[best][2]
        if other.inductor_ms and not other.difference and (now.difference or other.fused_ms < now.fused_ms):
            best = spec
    chain.spec, kernel, decided = found[best]

    def ms(spec: str) -> str:
        if spec not in found:
            return "not built"
        timed = found[spec][2]
        return f"{timed.fused_ms:.4g} ms" if timed.inductor_ms else timed.note or "not timed"

    def chains(made: str, start: str) -> str:
        with_it, without = ms(made), ms(start)
        if without.endswith(" ms") and with_it.endswith(" ms"):
            return f"the chain {with_it} in it, {without} without"
        return f"the chain in it: {with_it}; without it: {without}"

    rows, made = list(plan.forms), plan.spec  # made: the spec a row's form made (the next row's start)
    for i in reversed(range(len(rows))):
        row = rows[i]
        if row.alternative is None:
            continue
        start = row.alternative.to_json()
        rows[i] = replace(row, taken=forms.BY_NAME[row.form].applied(chain.spec), alternative=None,
                          chains=chains(made, start))
        made = start
    return ExecutionPlan(best, kernel, tuple(rows), decided)


def _untimed(chain: Chain, plan: ExecutionPlan, cfg: Config) -> ExecutionPlan:
    """`_without_forms` where the measured choice did not time the chain: each row taken
    for that timing alone (`FormChoice.by_chain`) goes back to the spec before it, where
    that spec builds. (A later row whose form an earlier one's return took away is left
    as that return marked it: the rows are read from the plan as it stands.)"""
    for i in range(len(plan.forms)):
        row = plan.forms[i]
        if row.alternative is None or not row.by_chain:
            continue
        taken = chain.spec
        chain.spec = row.alternative
        spec = chain.spec.to_json()
        try:
            kernel = _prepare(chain, spec, cfg)
        except Exception as err:  # noqa: BLE001 - the plan as it was
            if cfg.strict and not isinstance(err, (cuda_templates.NotRenderable, OperandMismatch)):
                raise
            chain.spec = taken
            log.info("fusedepi: %s at %s without %s: %s", chain.spec.fusion, chain.anchor.name, row.form, err)
            continue
        rows = list(plan.forms)
        rows[i] = replace(row, taken=False, alternative=None, chains="the chain not timed")
        for j in range(i + 1, len(rows)):  # a later row's form, taken from this row's, is gone with it
            later = forms.BY_NAME[rows[j].form]
            if rows[j].taken and later.chain_decides and not later.applied(chain.spec):
                rows[j] = replace(rows[j], taken=False, alternative=None, chains="the chain not timed")
        plan = ExecutionPlan(spec, kernel, tuple(rows), plan.choice)
    return plan


def _enable_native(cfg: Config) -> None:
    """Loads the C++ launcher (building it the first time). Without it the fused ops
    launch from Python: correct, with more CPU time a call, so a failure only warns."""
    try:
        launch.enable_native(cfg.cache_dir)
    except native.BuildError as err:
        if cfg.strict:
            raise FusionError(f"fusedepi: the C++ launcher failed to build: {err}") from err
        first = launch.first_line(err)
        log.warning("fusedepi: the C++ launcher failed to build (%s); fused ops launch from Python, with more "
                    "CPU time a call. FUSEDEPI_NATIVE_LAUNCHER=0 skips it; FUSEDEPI_STRICT=1 raises instead.", first)


def rewrite(gm: GraphModule, cfg: Config, skip: dict | None = None) -> Report:
    """Fuses every chain it can in `gm`, in place.

    Args:
        skip: anchor node names of chains to leave to Inductor, each with the reason for
            the report (the whole graph ran slower with them: `backend.fusedepi`).

    Raises:
        FusionError: under strict mode, for any chain that fails to lower or compile.
    """
    report = Report()
    try:
        tf32 = ops.matmul_allows_tf32()
        chains, refusals = match_graph(gm.graph, cfg.disabled, cfg.cpu_reference, matmul_tf32=tf32,
                                       in_kernel_gemm=cfg.in_kernel_gemm,
                                       in_kernel_conv=cfg.in_kernel_conv == "on")
    except Exception as err:  # a matcher bug must not stop the user's model
        if cfg.strict:
            raise FusionError(f"fusedepi: matching failed: {err}") from err
        log.warning("fusedepi: pattern matching failed (%s: %s); the graph goes to Inductor unfused", type(err).__name__, err)
        return report
    for refusal in refusals:
        log.info("fusedepi: not fused at %s: %s", refusal.anchor, refusal.reason)
        report.records.append(Record("refused", refusal.anchor, refusal.nodes, reason=refusal.reason))
    if cfg.native_launcher and any(chain.anchor.meta["val"].device.type == "cuda" for chain in chains):
        launch.start_native(cfg.cache_dir)  # built beside the kernels; `_enable_native` waits for it
    fused, builds = [], []
    for chain in chains:
        names = [n.name for n in chain.nodes]
        claimed = frozenset(n for other in chains if other is not chain for n in other.nodes)
        if skip and chain.anchor.name in skip:
            report.records.append(Record("refused", chain.anchor.name, names, chain.spec.fusion,
                                         reason=skip[chain.anchor.name]))
            log.info("fusedepi: not fused at %s: %s", chain.anchor.name, skip[chain.anchor.name])
            continue
        try:
            form_rows = forms.choose(chain, cfg)
            builds += _prebuild_alternatives(chain, form_rows, cfg)
            kernel, form_rows = _prepare_taken(chain, form_rows, cfg)
            spec = chain.spec.to_json()
        except (cuda_templates.NotRenderable, OperandMismatch) as err:
            report.records.append(Record("refused", chain.anchor.name, names, chain.spec.fusion, reason=str(err)))
            log.info("fusedepi: not fused at %s: %s", chain.anchor.name, err)
            if cfg.strict:
                raise FusionError(f"fusedepi: {chain.spec.fusion} at {chain.anchor.name}: {err}") from err
            continue
        except Exception as err:  # compile failures and anything unexpected: Inductor runs the chain
            if cfg.strict:
                raise FusionError(f"fusedepi: {chain.spec.fusion} at {chain.anchor.name}: {err}") from err
            first = launch.first_line(err)
            log.warning(
                "fusedepi: could not build %s at %s (%s); Inductor runs this chain. "
                "Set FUSEDEPI_STRICT=1 to raise instead.",
                chain.spec.fusion,
                chain.anchor.name,
                first,
            )
            report.records.append(
                Record("refused", chain.anchor.name, names, chain.spec.fusion, reason=f"kernel build failed: {first}")
            )
            continue
        plan = _without_forms(chain, ExecutionPlan(spec, kernel, form_rows, choice.decide(chain, spec, cfg, claimed)),
                              cfg, claimed)
        spec, kernel = plan.spec, plan.kernel
        if not plan.fused:
            if plan.choice.difference:
                why = (f"its result differs from Inductor's by {plan.choice.difference:.3g} (relative, on random "
                       "inputs)")
            elif plan.choice.fused_ms > plan.choice.inductor_ms:
                why = "Inductor is faster here"
            else:  # within `choice.WIN` of Inductor's time: a tie
                why = f"not {1 - choice.WIN:.0%} faster than Inductor here"
            reason = f"{why}: {plan.choice.describe()}" + "".join(
                f"; {row.describe()}" for row in plan.forms)  # the forms it was timed in
            log.info("fusedepi: not fused at %s: %s", chain.anchor.name, reason)
            report.records.append(Record("refused", chain.anchor.name, names, chain.spec.fusion, reason=reason,
                                         plan=plan))
            continue
        report.records.append(
            Record("fused", chain.anchor.name, names, chain.spec.fusion, kernel=kernel, stop=chain.stop, spec=spec,
                   plan=plan)
        )
        fused.append((chain, spec, kernel))
    concurrent.futures.wait(builds)  # none outlives the compile that started it
    if cfg.native_launcher and any(chain.anchor.meta["val"].device.type == "cuda" for chain, _, _ in fused):
        _enable_native(cfg)
    if fused:
        backup = copy.deepcopy(gm.graph)  # the surgery below is undone as a whole on failure
        try:
            renamed: dict = {}
            for chain, spec, kernel in fused:
                _replace(gm.graph, chain, spec, renamed)
                log.info("fusedepi: fused %s at %s (%s)", chain.spec.fusion, chain.anchor.name, kernel)
            _stable_topological_sort(gm.graph)
            ops.ask_graph_input_layouts(gm.graph)  # the replaced nodes gone, x's readers are final
            gm.graph.lint()
        except Exception as err:  # a surgery bug must not stop the user's model: undo it all
            if cfg.strict:
                raise FusionError(f"fusedepi: rewriting the graph failed: {err}") from err
            log.warning("fusedepi: rewriting the graph failed (%s: %s); it goes to Inductor unfused",
                        type(err).__name__, err)
            gm.graph = backup
            report.records = [
                r if r.status != "fused" else Record("refused", r.anchor, r.nodes, r.fusion,
                                                     reason=f"graph rewrite failed: {err}")
                for r in report.records
            ]
        gm.recompile()
    return report
