"""The fused op `fusedepi::chain`: anchor + epilogue in one call.

A `torch.library` op with three implementations: the plain-torch reference (CPU, and
the definition of what the op computes, here), a fake one (shapes only, for tracing,
here) and the CUDA one (library GEMM/conv, then the rendered epilogue kernels), which
`launcher.py` registers. Also here: how the anchor runs (`run_anchor`) and the
precision settings it obeys.
"""

from __future__ import annotations

import logging

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from lowering import EpilogueSpec, run_reference
from lowering.spec import Anchor

aten = torch.ops.aten
log = logging.getLogger("fusedepi")


def run_anchor(anchor: Anchor, operands: list[torch.Tensor], for_kernels: bool = False, pad_x=None) -> torch.Tensor:
    """The anchor op exactly as the graph had it (so matmul precision settings apply).
    An anchor with `pad` runs its GEMM on zero-padded operands (`padded_gemm`, which
    `pad_x` passes on), one with `channels_last` its conv on channels-last operands: the
    result is the product either way. A `permuted` conv's result is [N x spatial, C], its
    output's channels moved last (a 2-D or 3-D conv runs channels-last, so that this is a
    view). `for_kernels` returns it as the epilogue kernels read it: in its padded rows,
    or in channels-last memory; else contiguous."""
    if anchor.pad:
        y = padded_gemm(anchor, operands, pad_x)
        return y if for_kernels else y[:, : operands[-1].shape[1]].contiguous()
    if anchor.kind == "addmm":
        return aten.addmm.default(*operands)
    if anchor.kind == "mm":
        return aten.mm.default(*operands)
    if anchor.is_baddbmm:  # input + alpha * (b1 @ b2), rounded once
        return aten.baddbmm.default(operands[2], operands[0], operands[1], alpha=anchor.alpha)
    if anchor.kind == "bmm":
        return aten.bmm.default(*operands)
    x, w = operands[:2]
    b = operands[2] if anchor.has_bias else None
    channels_last = anchor_reads_channels_last(anchor, x)
    if channels_last:
        layout = channels_last_format(x)
        x, w = x.contiguous(memory_format=layout), w.contiguous(memory_format=layout)
    y = aten.convolution.default(x, w, b, *anchor.conv)
    if anchor.as_2d:  # the Conv1d's output [N, C, L_out]: a view
        y = y.squeeze(2)
    if anchor.permuted:
        return y.movedim(1, -1).reshape(-1, y.shape[1])
    if channels_last:
        return y.contiguous(memory_format=layout) if for_kernels else y.contiguous()
    return y


def anchor_reads_channels_last(anchor: Anchor, x: torch.Tensor) -> bool:
    """Whether `run_anchor` runs the conv on channels-last copies of x and the weight."""
    return anchor.kind == "conv" and (anchor.channels_last or anchor.permuted) and x.dim() in (4, 5)


def input_layouts(spec: str, inputs: list) -> tuple | None:
    """The layouts `fusedepi::chain` asks of its inputs in a graph that Inductor compiles,
    in the form of a node's `eager_input_vals` meta (`(args, kwargs)` of fake values,
    whose strides Inductor's lowering of a custom op holds its inputs to; None leaves one
    free): a library conv that runs channels-last takes x and its weight channels-last,
    the in-kernel conv x (`runs_in_kernel_conv`; and its weight where the graph rounds
    both to TF32, `Anchor.rounded`), so Inductor writes them so (in the
    kernel that makes x, or in a copy of its own) and the op's own copies (`run_anchor`,
    `launch.channels_last_operands`) are no-ops. None where no input is constrained.

    Args:
        spec: the op's spec argument (JSON).
        inputs: the op's input values (fake tensors) as the graph has them.
    """
    if len(inputs) < 2 or not isinstance(inputs[0], torch.Tensor):
        return None
    parsed = _parse(spec)
    library = anchor_reads_channels_last(parsed.anchor, inputs[0])
    if not library and not runs_in_kernel_conv(parsed, inputs[0], channels_last=True):
        return None
    layout = channels_last_format(inputs[0])
    wanted: list = [None] * len(inputs)
    # x channels-last; not where the in-kernel conv pads its pixels to 16 bytes
    # (launch.padded_pixels copies x from any layout: a channels-last copy before it
    # would be a second pass over x).
    if library or not _pads_pixels(parsed, inputs[0]):
        wanted[0] = torch.empty_like(inputs[0], memory_format=layout)
    # The in-kernel conv lays its weight out itself (launch.channels_last_operands), where
    # the graph's rounding of it to TF32 can write it as the kernel reads it: channels-last.
    if library or parsed.anchor.rounded:
        wanted[1] = torch.empty_like(inputs[1], memory_format=layout)
    return ((wanted, spec), {}) if any(w is not None for w in wanted) else None


def _pads_pixels(spec: EpilogueSpec, x: torch.Tensor) -> bool:
    """Whether the in-kernel conv of `spec` reads a channels-last x whose pixels it pads
    to 16 bytes (`conv_sm90.x_pitch`: C_in not a whole 16 bytes)."""
    import cuda_templates

    cin = spec.anchor.direct[0]
    return cuda_templates.conv_sm90.x_pitch(cin, x.element_size()) != cin


def ask_input_layouts(node) -> None:
    """Puts on a `fusedepi::chain` call node of an FX graph the layouts its inputs must
    have (`input_layouts`, from its inputs' fake values), where Inductor reads them (the
    node's `eager_input_vals` meta). A graph traced again (AOTAutograd) loses them: mark it
    after the trace."""
    inputs, spec = node.args
    vals = [n.meta["val"] if isinstance(n, torch.fx.Node) else n for n in inputs]
    layouts = input_layouts(spec, vals)
    if layouts is None:
        return
    (wanted, _), _ = layouts
    if wanted[0] is not None and _parse(spec).anchor.rounded and _made_for(inputs, node):
        # x itself (passed last but one, for a call whose TF32 is off: the library conv)
        # in the layout of its rounded copy, so that the kernel that computes x writes
        # both alike: asked in NCHW beside a channels-last copy, Inductor wrote the two
        # from one untiled kernel whose channels-last stores were strided (117 us
        # against 17 for the one copy, 32 x 64 x 64 x 64 float32 on an H200).
        wanted[-2] = torch.empty_like(vals[-2], memory_format=channels_last_format(vals[-2]))
    node.meta["eager_input_vals"] = layouts


def ask_graph_input_layouts(graph: torch.fx.Graph) -> None:
    """`ask_input_layouts` for every `fusedepi::chain` call of `graph`, once the rewrite
    has taken out the nodes the calls replace: while the replaced conv still reads x,
    x is not made for the call alone (`_made_for`)."""
    for node in graph.find_nodes(op="call_function", target=torch.ops.fusedepi.chain.default):
        ask_input_layouts(node)


def _made_for(inputs: list, node) -> bool:
    """Whether the graph computes the in-kernel conv's x (the call's input last but one,
    `insert_chain`) for `node` and its rounding to TF32 (the call's first input) alone: an
    op's output, not a graph input, whose users lead only to `node`."""
    original, rounded = inputs[-2], inputs[0]
    if not isinstance(original, torch.fx.Node) or original.op != "call_function" or not isinstance(rounded,
                                                                                                      torch.fx.Node):
        return False
    rounding, frontier = set(), [rounded]
    while frontier:  # the rounding's ops: from its result back to x
        n = frontier.pop()
        if n is original or n in rounding:
            continue
        rounding.add(n)
        frontier.extend(a for a in n.all_input_nodes)
        if len(rounding) > 64:  # not the rounding's few ops
            return False
    return all(user is node or user in rounding for user in original.users)


def insert_chain(graph: torch.fx.Graph, inputs: list, spec: str, value: bool = True) -> torch.fx.Node:
    """Puts a `fusedepi::chain` call of `spec` on `inputs` (the chain's operands and
    parameters, nodes with fake values) into `graph` at its insertion point, as every
    graph takes it: with the layouts it asks of its inputs (`ask_input_layouts`); where
    `spec.anchor.flipped`, after graph ops that make the weight the conv's
    (`flip_transposed_weight`); where `spec.anchor.as_2d`, after views of x and the
    weight as a 2-D conv's (`one_row`); and where `spec.anchor.rounded`, after graph ops
    that round x and the weight to the nearest TF32 value, passed first (x itself where
    the kernel rounds it, `rounds_x_itself`), x and the weight themselves last. `value`:
    the call's fake value as its meta too (a graph that Inductor lowers as it is).
    Returns the call."""
    example = [n.meta["val"] for n in inputs]
    anchor = _parse(spec).anchor
    rounds = anchor.rounded
    vals = None
    if rounds or value or anchor.flipped or anchor.as_2d:
        with detect_fake_mode(example):
            if anchor.flipped:  # the ConvTranspose's weight as the conv it equals takes it
                flipped = _traced_into(graph, flip_transposed_weight, inputs[1], decompose=True)
                inputs = [inputs[0], flipped] + list(inputs[2:])
            if anchor.as_2d:  # a Conv1d's x and weight as one row of a 2-D conv's
                inputs = [_traced_into(graph, one_row, n) for n in inputs[:2]] + list(inputs[2:])
            if rounds:  # (x itself where the in-kernel conv reads and rounds it, `rounds_x_itself`)
                x = inputs[0]
                x = x if rounds_x_itself(_parse(spec), x.meta["val"]) else _rounded_to_tf32(graph, x)
                inputs = [x, _rounded_to_tf32(graph, inputs[1])] + list(inputs[2:]) + list(inputs[:2])
            if value:
                vals = reference([n.meta["val"] for n in inputs], spec)
    call = graph.call_function(torch.ops.fusedepi.chain.default, (inputs, spec))
    if value:
        call.meta["val"] = vals
    ask_input_layouts(call)
    return call


def one_row(t: torch.Tensor) -> torch.Tensor:
    """A Conv1d's x [N, C, L] or weight [C_out, C_in, k] as a 2-D conv's, of one row
    (`Anchor.as_2d`): a view [N, C, 1, L] / [C_out, C_in, 1, k]."""
    return t.unsqueeze(2)


def flip_transposed_weight(w: torch.Tensor) -> torch.Tensor:
    """A ConvTranspose's weight [C_in, C_out, kh, kw] (a 3-D one's [C_in, C_out, kd, kh,
    kw]) as the conv it equals takes it (`Anchor.flipped`): [C_out, C_in, kh, kw], flipped
    along every kernel dim, contiguous."""
    kernel_dims = tuple(range(2, w.dim()))
    return w.permute(1, 0, *kernel_dims).flip(kernel_dims).contiguous()


def _rounded_to_tf32(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    """Graph ops that compute `round_to_tf32` of `node` (a float32 tensor), traced on
    its fake value (in the graph's fake mode), each node with its own; Inductor fuses them
    into the kernel that writes the operand in the layout the fused op asks
    (`input_layouts`). Returns the rounded value's node."""
    return _traced_into(graph, round_to_tf32, node)


def _traced_into(graph: torch.fx.Graph, fn, node: torch.fx.Node, decompose: bool = False) -> torch.fx.Node:
    """Graph ops that compute `fn` of `node`, traced on its fake value (in the graph's
    fake mode), each node with its own value, put into `graph` at its insertion point;
    `decompose`: into the ops Inductor lowers (its decompositions: a graph after
    AOTAutograd holds no `flip`). Returns the result's node."""
    table = None
    if decompose:
        from torch._inductor.decomposition import select_decomp_table

        table = select_decomp_table()
    traced = make_fx(fn, decomposition_table=table)(node.meta["val"])
    for n in list(traced.graph.nodes):  # the trace's detach after each view: no-ops here
        if n.target is aten.detach.default:
            n.replace_all_uses_with(n.args[0])
            traced.graph.erase_node(n)
    (placeholder,) = [n for n in traced.graph.nodes if n.op == "placeholder"]
    return graph.graph_copy(traced.graph, {placeholder: node})


def runs_in_kernel_conv(spec: EpilogueSpec, x: torch.Tensor, channels_last: bool = False) -> bool:
    """Whether the CUDA op computes the conv as the in-kernel conv (an implicit GEMM) on
    x's device, at the cuDNN TF32 setting of now (a float32 chain whose TF32 is switched
    off later runs the library conv, on a channels-last x as well); with `channels_last`,
    over a channels-last copy of x (not x in its NCHW layout, `ConvGemmPlan.nchw`)."""
    plan = _in_kernel_conv_plan(spec, x)
    return plan is not None and not (channels_last and plan.nchw)


def rounds_x_itself(spec: EpilogueSpec, x: torch.Tensor) -> bool:
    """Whether the in-kernel conv of `spec` reads a float32 x in its NCHW layout
    (`ConvGemmPlan.nchw`, conv_sm90.READS_NCHW_TF32), rounding it to TF32 as it loads it:
    the graph then passes x itself where it passes the other convs' rounded copy (a pass
    over x fewer), and rounds the weight alone."""
    plan = _in_kernel_conv_plan(spec, x) if x.dtype == torch.float32 else None
    return plan is not None and plan.nchw


def _in_kernel_conv_plan(spec: EpilogueSpec, x: torch.Tensor):
    """The in-kernel conv's plan (`cuda_templates.ConvGemmPlan`) where the CUDA op computes
    the conv of `spec` so on x's device at the cuDNN TF32 setting of now
    (`runs_in_kernel_conv`), else None."""
    if (spec.anchor.kind != "conv" or not spec.anchor.implicit or x.dim() != (5 if spec.anchor.depth else 4)
            or x.device.type != "cuda"):
        return None
    import cuda_templates

    plan = cuda_templates.conv_gemm_plan(spec, arch_of(x.device), conv_allows_tf32())
    return plan if isinstance(plan, cuda_templates.ConvGemmPlan) else None


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 `t` rounded to the nearest TF32 value (10 mantissa bits), ties away from
    zero, as `cvt.rna.tf32.f32` rounds: 2^12 added to the bits, the 13 low bits cleared
    (a carry moves into the exponent as it should). NaN stays NaN, inf stays inf; a value
    half a TF32 unit or more past TF32's largest finite one (float32's largest among them)
    becomes inf. The tensor cores read such a value exactly; given a float32 value they
    drop its low bits."""
    bits = t.view(torch.int32)
    rounded = ((bits + 0x1000) & -0x2000).view(torch.float32)
    return torch.where(torch.isnan(t), t, rounded)


def anchor_inputs(inputs: list, spec: EpilogueSpec, rounded_now: bool) -> list:
    """The inputs of a call of `spec` as its kernels and library calls take them: where
    `spec.anchor.rounded`, x and the weight rounded to TF32 (rounded_now: the in-kernel
    conv runs, in TF32) or x and the weight themselves (the library conv, or the
    reference), then the chain's other inputs; else `inputs` as they are.

    Raises:
        RuntimeError: a rounded spec's call without the two unrounded operands at its end.
    """
    if not spec.anchor.rounded:
        return inputs
    if len(inputs) < spec.anchor.n_operands + 2:
        raise RuntimeError(f"fusedepi::chain ({spec.fusion}): {len(inputs)} inputs; a chain on operands rounded to "
                           f"TF32 takes them, its other inputs, then x and the weight unrounded")
    inputs = list(inputs)
    return (inputs[:-2] if rounded_now else inputs[-2:] + inputs[2:-2])


def channels_last_format(x: torch.Tensor) -> torch.memory_format:
    """The channels-last memory format of a 2-D (4-dim x) or 3-D (5-dim x) conv's input."""
    if x.dim() not in (4, 5):
        raise ValueError(f"channels-last convs are 2-D or 3-D; the input has {x.dim()} dims")
    return torch.channels_last if x.dim() == 4 else torch.channels_last_3d


def padded_gemm(anchor: Anchor, operands: list[torch.Tensor], pad_x=None) -> torch.Tensor:
    """addmm/mm of x[M, K] and mat2 = w^T ([K, N], w a contiguous [N, K]) on operands
    padded with zeros to K = k_to and N = n_to (`Anchor.pad`): y[M, n_to], whose first N
    columns are the product. The zeros add nothing to any dot product; the padded w
    keeps w's layout, so cuBLAS sees the same transposes with 16-byte aligned rows.

    Args:
        pad_x: fills the padded x in one pass, `pad_x(x, xp)` with x contiguous (the
            chain's kernel file, `Library.pad_rows`); None: two torch ops.
    """
    k_to, n_to = anchor.pad
    x, wt = operands[-2], operands[-1]
    (m, k), n = x.shape, wt.shape[1]
    xp = x
    if k_to != k:
        xp = x.new_empty((m, k_to))
        if pad_x is not None:
            pad_x(x.contiguous(), xp)
        else:
            xp[:, k:].zero_()
            xp[:, :k].copy_(x)
    wp = wt.new_zeros((n_to, k_to))
    wp[:n, :k].copy_(wt.t())
    if anchor.kind == "mm":
        return aten.mm.default(xp, wp.t())
    bp = operands[0].new_zeros((n_to,))
    bp[:n].copy_(operands[0])
    return aten.addmm.default(bp, xp, wp.t())


def reference(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """What `fusedepi::chain` computes, in plain torch. Its output is contiguous whatever
    x's layout, as the CUDA op allocates it (this is also the op's fake: Inductor holds
    the CUDA op's output to the strides it gives, and a conv on a channels-last x gives
    a channels-last output)."""
    parsed = _parse(spec)
    inputs = anchor_inputs(inputs, parsed, rounded_now=False)  # the conv on x itself: exact
    n = parsed.anchor.n_operands
    y = run_anchor(parsed.anchor, list(inputs[:n]))
    outputs = run_reference(y, parsed.steps, list(inputs[n:]), parsed.saves)
    outputs[0] = outputs[0].contiguous()
    return outputs


# A plain `torch.library.Library` op, not `torch.library.custom_op`: the latter's
# per-call wrappers (output aliasing check, autograd wrapper, redispatch) cost about
# 50 us of CPU per call on an H200 host (cProfile of a warm call), more than the
# GPU time of a small chain. Nothing is lost: the outputs never alias the inputs or
# each other, and the op has no autograd formula because it only goes into graphs
# that need none: inference graphs, and the forward half of a training graph, whose
# backward AOTAutograd has already split off (it reads the values the op returns).
_LIB = torch.library.Library("fusedepi", "DEF")
_LIB.define("chain(Tensor[] inputs, str spec) -> Tensor[]")
# The Python CUDA implementation under its own name, for the C++ launcher's calls that
# have no plan yet.
_LIB.define("chain_py(Tensor[] inputs, str spec) -> Tensor[]")


def chain(inputs: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    """Runs a fused chain; `spec` is an `EpilogueSpec` as JSON. This body serves CPU tensors."""
    return reference(inputs, spec)


def _chain_fake(inputs, spec):
    return reference(inputs, spec)


_LIB.impl("chain", chain, "CPU")
torch.library.register_fake("fusedepi::chain", _chain_fake, lib=_LIB)


_specs: dict[str, EpilogueSpec] = {}


def _parse(spec: str) -> EpilogueSpec:
    parsed = _specs.get(spec)
    if parsed is None:
        parsed = _specs[spec] = EpilogueSpec.from_json(spec)
    return parsed


def matmul_allows_tf32() -> bool:
    """Whether float32 matmuls may use TF32: `torch.set_float32_matmul_precision` or the
    newer `torch.backends.cuda.matmul.fp32_precision`. Once the newer one has set TF32,
    torch refuses to answer through the older one's getter."""
    try:
        return torch.get_float32_matmul_precision() != "highest"
    except RuntimeError:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"


def conv_allows_tf32() -> bool:
    """Whether float32 convolutions may use TF32 now, as eager's cuDNN call would read it:
    `torch.backends.cudnn.allow_tf32` (on by default), or the newer
    `torch.backends.cudnn.conv.fp32_precision`; torch refuses the older getter once the
    two APIs were mixed."""
    try:
        return bool(torch.backends.cudnn.allow_tf32)
    except RuntimeError:
        return torch.backends.cudnn.conv.fp32_precision == "tf32"


def arch_of(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"
