"""Finds anchor + epilogue chains in a post-AOTAutograd aten graph.

Matching happens at one level: the aten graph that Inductor's AOTAutograd pass
produces with the decomposition table from `lowering/__init__.py`, which keeps
the ops below intact. Each anchor (addmm, mm, bmm, convolution) starts a chain; the
chain grows one step at a time through `STEP_MATCHERS`. Where it stops, and why,
is recorded. A value the graph also uses elsewhere (in a training graph, what
backward needs: the matmul output, a norm's statistics, an activation's input)
does not stop the chain: the fused op returns it as well (`Save`).

Priority rule of the step table: multi-node forms come before the single-node
forms they contain (`x * sigmoid(x)` is tried before `sigmoid` and `mul`), so the
longest reading of the graph wins. Chains never overlap: a node belongs to one chain
at most, and chains whose inputs depend on each other's values are dropped
(`_drop_cycles`).

One file of about 2,130 lines: the step matchers share the chain's state (`_State`),
its snapshots and the save logic, and their order in `STEP_MATCHERS` is the priority
rule above; split by file they would only import each other.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from torch.fx import Node

from .spec import (
    BROADCAST,
    CHANNEL,
    CHANNEL_REDUCTIONS,
    EARLIER,
    FULL,
    NAMED_STEPS,
    NORMS_BEFORE_A_REDUCTION,
    ONE,
    POOLS,
    REDUCTIONS,
    REDUCTIONS_AFTER_A_NORM,
    ROW_REDUCTIONS,
    SCALAR,
    SECOND_REDUCTION_MAX_CHANNELS,
    SELF,
    SPATIAL_REDUCTIONS,
    Anchor,
    EpilogueSpec,
    Save,
    Step,
    to_float32,
)
from .vocabulary import POINTWISE_FORMS, Refuse

aten = torch.ops.aten
prims = torch.ops.prims

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass
class Chain:
    """A matched chain, ready to be rewritten into one fused op call.

    Attributes:
        anchor: the anchor node.
        operands: the anchor's tensor operands (nodes), in the anchor op's order.
        params: tensor inputs of the epilogue (nodes), indexed by `Step.inputs`.
        steps: the epilogue steps.
        nodes: every node the fused op replaces, anchor first.
        final: the node whose value the fused op's first output replaces.
        extra: nodes replaced by BatchNorm's running-stat outputs, in order.
        saved: nodes replaced by the outputs that `saves` describe, in order.
        saves: the `Save` of each node in `saved`.
        same_as_result: nodes used elsewhere that hold the result itself (before a
            trailing view): replaced by the fused op's first output.
        views_of_saved: (node, saved node, shape): a node that holds the same value as an
            earlier saved node under another shape; replaced by a view of that output
            (the op returns each value once: its outputs never share memory).
        view: the last view node the chain went through (its shape is re-applied).
        stop: why the chain ended where it did.
    """

    anchor: Node
    operands: list
    params: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    final: Node | None = None
    extra: list = field(default_factory=list)
    saved: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    same_as_result: list = field(default_factory=list)
    views_of_saved: list = field(default_factory=list)
    view: Node | None = None
    stop: str = ""
    spec: EpilogueSpec | None = None

    def outputs(self) -> list:
        """The nodes whose values the fused op returns, in its output order: the result,
        BatchNorm's new running statistics, the saved values."""
        return [self.final] + list(self.extra) + list(self.saved)

    def stand_ins(self, graph: torch.fx.Graph, outs: list) -> list[tuple]:
        """(node, its stand-in) for every node whose value the fused op's outputs `outs`
        (nodes of `graph`, in `outputs()` order) now hold: the result (re-viewed through
        the chain's last view), nodes holding the result itself, the other outputs, and
        views of saved values. The views are new nodes at `graph`'s insertion point."""
        result = outs[0]
        if self.view is not None:
            result = graph.call_function(aten.view.default, (outs[0], view_shape(self.view)))
            result.meta["val"] = self.final.meta["val"]
        pairs = [(self.final, result)] + [(node, outs[0]) for node in self.same_as_result]
        pairs += list(zip(self.outputs()[1:], outs[1:]))
        held = dict(pairs)
        for node, saved, shape in self.views_of_saved:
            view = graph.call_function(aten.view.default, (held[saved], list(shape)))
            view.meta["val"] = node.meta["val"]
            pairs.append((node, view))
        return pairs


@dataclass
class Refusal:
    """A candidate chain that was not fused."""

    anchor: str
    nodes: list
    reason: str


@dataclass
class _State:
    """What the walk knows about the chain's current value."""

    node: Node
    chain: Chain
    channels: int
    inner: int
    conv: bool
    channel_axis: int = 1
    reduced: bool = False  # a row reduction has shrunk the value to one per row
    pooled: bool = False  # a spatial reduction has shrunk a conv's value to one per (row, channel)
    pixels: bool = False  # a reduction over a conv's channels has shrunk its value to one per (row, pixel)
    windows: int = 0  # after a pooling window: the pooled elements per channel (0: none)
    # A view has regrouped a conv or bmm value's rows ([B*H, M, N] -> [B, H, M, N]) or
    # flattened its spatial dims ([N, C, H, W] -> [N, C, H*W]): its channels at
    # `channel_axis`, each channel's elements in the dims after it; the fused op's output
    # is viewed back, so no step may change the shape (but global pooling of the flattened).
    regrouped: bool = False
    dtype: torch.dtype | None = None  # the value's dtype: the chain's, or float32 while widened
    widened_at: tuple | None = None  # the walk's state where a bf16/fp16 value went to float32
    order: dict = field(default_factory=dict)  # node -> position in the graph
    backward: frozenset = frozenset()  # a joint graph's backward nodes: users, never steps
    # A training forward graph's nodes that compute only values saved for backward
    # (`for_backward_only`): readers of chain values (which are then saved), never a step.
    not_steps: frozenset = frozenset()
    claimed: set = field(default_factory=set)  # nodes of the chains matched before this one
    held: dict = field(default_factory=dict)  # node -> k: it holds the chain's value after k steps
    permuted: bool = False  # a conv's output with its channels moved last (`Anchor.permuted`)
    # Inside a branch (a `branch` step): the nodes the walk must take next, in order, the
    # binary node where the branch meets the value it left last; and the walk's state
    # before the branch step, restored should the branch not fuse whole.
    route: list = field(default_factory=list)
    before_branch: tuple | None = None

    @property
    def reduced_any(self) -> bool:
        """A reduction has shrunk the value: to one per row, per (row, channel) or per (row, pixel)."""
        return self.reduced or self.pooled or self.pixels


@dataclass
class _Match:
    step: Step
    consumed: list  # nodes of this step, in graph order
    result: Node  # the node holding the step's value
    extra: list = field(default_factory=list)
    dtype: torch.dtype | None = None  # a dtype conversion (no step): the value's new dtype
    # Values of the step used elsewhere besides its result: a norm's "mean"/"rstd",
    # silu's "sigmoid" of its input -> the node.
    stats: dict = field(default_factory=dict)
    # Nodes of the step that hold its input under another shape and that the graph saves
    # for backward, or reads in nodes computing only saved values: returned as the input's value.
    inputs_kept: list = field(default_factory=list)
    route: list = field(default_factory=list)  # a branch: the nodes it walks, then the binary node


def _arg(node: Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _val(node):
    return node.meta.get("val") if isinstance(node, Node) else None


def _add_param(state: _State, node: Node | None) -> int:
    if node is None:
        return -1
    if _derived_from_chain(state, node):
        raise Refuse(f"operand {node.name} is computed from the chain's own values")
    val, chain_val = _val(node), _val(state.node)
    if isinstance(val, torch.Tensor) and val.device != chain_val.device:
        raise Refuse(f"operand {node.name} is on {val.device}, the chain on {chain_val.device}")
    state.chain.params.append(node)
    return len(state.chain.params) - 1


def _forward_users(state: _State, node: Node) -> list:
    """The users of `node` in the forward (in a joint graph, not backward's)."""
    return [u for u in node.users if u not in state.backward]


def _step_users(state: _State, node: Node) -> list:
    """The users of `node` that may start the chain's next step: the forward's, but those
    that compute only values saved for backward (`_State.not_steps`)."""
    return [u for u in _forward_users(state, node) if u not in state.not_steps]


def _depends_on(node: Node, targets: set, order: dict, start: int) -> bool:
    """Whether `node` is one of `targets` or computed from one; nodes at or before
    graph position `start` (the earliest target) are not followed."""
    seen, stack = set(), [node]
    while stack:
        top = stack.pop()
        if top in targets:
            return True
        if top in seen or order.get(top, start + 1) <= start:
            continue
        seen.add(top)
        stack.extend(top.all_input_nodes)
    return False


def _derived_from_chain(state: _State, node: Node) -> bool:
    """Whether `node` depends on a node of the chain (it cannot then be an input of
    the fused op, which would feed its own input)."""
    return _depends_on(node, set(state.chain.nodes), state.order, state.order.get(state.chain.anchor, -1))


def _check_dtype(state: _State, node: Node):
    val = _val(node)
    if isinstance(val, torch.Tensor) and val.dtype != state.dtype:
        raise Refuse(f"{_name(node)}: result dtype {val.dtype} differs from the chain's {state.dtype}")


# Matrix ops: a chain never continues into one (it starts chains, or is left to the
# library, and nothing fuses into a library call).
MATRIX_OPS = frozenset({aten.addmm.default, aten.mm.default, aten.bmm.default, aten.baddbmm.default,
                        aten.convolution.default})


def _name(node: Node) -> str:
    target = node.target
    return getattr(target, "__name__", str(target)) if not isinstance(target, str) else target


# ---------------------------------------------------------------- unary steps


def _match_unary(state: _State, user: Node):
    """One-node pointwise steps: the forms listed in the vocabulary table."""
    build = POINTWISE_FORMS.get(user.target)
    if build is None:
        return None
    if user.args[0] is not state.node:
        raise Refuse(f"{_name(user)}: the chain's value is not its input")
    step = build(lambda index, name, default=None: _arg(user, index, name, default))
    return _Match(step, [user], user)


def _match_silu_pair(state: _State, _user: Node):
    """x * sigmoid(x), in either operand order: two of the current value's users.
    A sigmoid also used elsewhere (saved for backward) is returned as well."""
    x = state.node
    for sig in _step_users(state, x):
        if sig.target is not aten.sigmoid.default:
            continue
        mul = next((u for u in _forward_users(state, sig)
                    if u.target is aten.mul.Tensor and set(u.args[:2]) == {x, sig}), None)
        if mul is not None and len(mul.args) == 2:
            stats = {"sigmoid": sig} if len(sig.users) > 1 else {}
            return _Match(Step("silu"), [sig, mul], mul, stats=stats)
    return None


def _match_prelu(state: _State, _user: Node):
    """where(x > 0, x, w * x), in either operand order of the product: what nn.PReLU and
    F.prelu decompose to, three of the current value's users. A tensor w (one slope, or
    one a channel) is a `prelu` step's operand; a number is leaky_relu's slope. Not
    matched where the comparison or the product is used elsewhere (a training graph
    keeping the mask for backward: the kernels write no boolean values)."""
    x = state.node
    for gt in _step_users(state, x):
        if gt.target is not aten.gt.Scalar or gt.args[0] is not x or len(gt.args) != 2 or gt.args[1] != 0 \
                or isinstance(gt.args[1], bool):
            continue
        where = _only(gt, aten.where.self)
        if where is None or where.args[0] is not gt or where.args[1] is not x:
            continue
        mul = where.args[2]
        if not isinstance(mul, Node) or mul.target is not aten.mul.Tensor or len(mul.users) != 1 \
                or len(mul.args) != 2 or x not in mul.args:
            continue
        w = mul.args[1] if mul.args[0] is x else mul.args[0]
        if w is x or (isinstance(w, Node) and _derived_from_chain(state, w)):
            continue
        consumed = sorted([gt, mul, where], key=lambda n: state.order.get(n, 0))
        w, kind = _classified(state, w)
        if kind == SCALAR:
            return _Match(Step("leaky_relu", consts=(float(w),)), consumed, where)
        return _Match(_tensor_operand_step(state, "prelu", w, kind, False), consumed, where)
    return None


def _only(node: Node, target) -> Node | None:
    """The single user of `node` if it calls `target`."""
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].target == target else None


def _match_rms_norm(state: _State, _user: Node):
    """x * rsqrt(mean(x ** 2, dim=-1, keepdim=True) + eps): what nn.RMSNorm and
    F.rms_norm decompose to (a weight is a `mul` step after it). An rsqrt also used
    elsewhere (saved for backward) is returned as the step's "rstd"."""
    users = _step_users(state, state.node)
    pow_ = next((u for u in users if u.target is aten.pow.Tensor_Scalar and u.args[1] == 2), None)
    mean = pow_ and _only(pow_, aten.mean.dim)
    add = mean and (_only(mean, aten.add.Scalar) or _only(mean, aten.add.Tensor))
    rsqrt = add and _only(add, aten.rsqrt.default)
    mul = rsqrt and next((u for u in rsqrt.users if u.target is aten.mul.Tensor and u in users), None)
    if mul is None or set(mul.args[:2]) != {state.node, rsqrt} or not _arg(mean, 2, "keepdim", False):
        return None
    eps = add.args[1]
    if isinstance(eps, Node) or _arg(mean, 3, "dtype") is not None:
        return None
    _require_features(state, "RMSNorm", mean.args[1])
    stats = {"rstd": rsqrt} if len(rsqrt.users) > 1 else {}
    return _Match(Step("rmsnorm", consts=(float(eps),)), [pow_, mean, add, rsqrt, mul], mul, stats=stats)


def _match_l2_normalize(state: _State, user: Node):
    """x / clamp(linalg_vector_norm(x, 2, features, keepdim=True), min=eps).expand(x's
    shape): what F.normalize(x, dim=-1) is (its vector norm held back from Inductor's
    decomposition until matching). Not matched where the norm or its clamp is read
    elsewhere (a training graph keeps them for backward; the kernels return neither)."""
    if user.target is not aten.linalg_vector_norm.default or user.args[0] is not state.node:
        return None
    ord_, dims = _arg(user, 1, "ord", 2), _arg(user, 2, "dim", None)
    if ord_ != 2 or dims is None or not _arg(user, 3, "keepdim", False) or _arg(user, 4, "dtype") is not None:
        return None
    clamp = next((u for u in user.users if u.target in (aten.clamp.default, aten.clamp_min.default)), None)
    if clamp is None or _arg(clamp, 2, "max") is not None:
        return None
    eps = _arg(clamp, 1, "min")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    expand = next((u for u in clamp.users if u.target is aten.expand.default), None)
    div = expand and next((u for u in expand.users if u.target is aten.div.Tensor), None)
    if div is None or div.args[0] is not state.node or div.args[1] is not expand or div.kwargs:
        return None
    _require_features(state, "F.normalize", dims)
    if len(user.users) > 1 or len(clamp.users) > 1 or len(expand.users) > 1:
        raise Refuse("F.normalize whose norm is read elsewhere (a training graph keeps it for backward): the "
                     "kernels do not return it")
    return _Match(Step("l2normalize", consts=(float(eps),)), [user, clamp, expand, div], div)


def _match_instance_norm(state: _State, _user: Node):
    """InstanceNorm without running statistics, as AOTAutograd decomposes it (with
    running statistics in eval mode: `_instance_norm_eval`): the conv
    output [N, C, *spatial] viewed as [1, N*C, *spatial], var_mean over every dim but 1
    (biased), (x - mean) * rsqrt(var + eps), then for `affine` a mul and an add by the
    weight and bias repeated N times and unsqueezed, and a view back. 16-bit values are
    widened to float32 for the statistics and rounded once before the view back. This is
    GroupNorm with one channel per group, and becomes that step."""
    x = state.node
    xval = _val(x)
    if not state.conv or state.reduced or state.channel_axis != 1 or xval.dim() < 3:
        return None
    n = xval.shape[0]  # an int, or the symbolic batch size after Dynamo made it dynamic
    view = next((u for u in _forward_users(state, x) if u.target in _VIEWS and _instance_view(_val(u), xval)), None)
    if view is None:
        if not _same_size(n, 1):
            return None
        view = x  # one image: the views are identities, which the decomposition leaves out
    bn = next((u for u in view.users if u.target is aten._native_batch_norm_legit_no_training.default), None)
    if bn is not None:  # (with one image, `_match_batch_norm` reads it as it is)
        return _instance_norm_eval(state, xval, view, bn, n) if view is not x else None
    widened = xval.dtype != torch.float32
    stats_in = view
    if widened:  # the statistics read a float32 copy; the normalize promotes
        stats_in = next((u for u in view.users if u.target is prims.convert_element_type.default
                         and u.args[1] == torch.float32), None)
        if stats_in is None:
            return None
    var_mean = next((u for u in stats_in.users if u.target is aten.var_mean.correction), None)
    sub = next((u for u in view.users if u.target is aten.sub.Tensor and u.args[0] is view), None)
    if var_mean is None or sub is None:
        return None
    ndim = xval.dim()
    dims = _arg(var_mean, 1, "dim")
    if (dims is None or sorted(d % ndim for d in dims) != [0, *range(2, ndim)]
            or var_mean.kwargs.get("correction") != 0 or not var_mean.kwargs.get("keepdim", False)):
        return None
    items = _getitems(var_mean)
    var, mean = items.get(0), items.get(1)
    add = var is not None and (_only(var, aten.add.Tensor) or _only(var, aten.add.Scalar))
    rsqrt = add and _only(add, aten.rsqrt.default)
    mul = _only(sub, aten.mul.Tensor)
    if not rsqrt or mul is None or sub.args[1] is not mean or set(mul.args[:2]) != {sub, rsqrt}:
        return None
    eps = add.args[1]
    if isinstance(eps, Node):
        return None
    # A training graph's forward saves the mean and the rsqrt for backward, as they are
    # ([1, N*C, 1, ...]) or squeezed to [N*C]: GroupNorm's per-(image, group)
    # statistics in the same order, which the fused op returns.
    stats = {}
    for what, node, inside in (("mean", mean, sub), ("rstd", rsqrt, mul)):
        others = [u for u in _forward_users(state, node) if u is not inside]
        if not others:
            continue
        if all(u.op == "output" for u in others):
            stats[what] = node
            continue
        squeeze = others[0]
        if (len(others) > 1 or squeeze.target is not aten.squeeze.dims
                or sorted(d % ndim for d in squeeze.args[1]) != [0, *range(2, ndim)]):
            raise Refuse(f"InstanceNorm: its {what} is used elsewhere other than squeezed for backward")
        stats[what] = squeeze
    in_backward = any(u in state.backward for node in (x, view, mean, rsqrt) for u in node.users)
    x_elsewhere = [u for u in _forward_users(state, x) if u not in (view, stats_in, sub)]
    if widened and (stats or in_backward or x_elsewhere):
        # A training graph (its joint graph, or a forward that keeps the input or the
        # statistics for backward). Backward would recompute the 16-bit chain's values
        # in float32 where the fused op rounded them, and KeepChainValues cannot keep
        # InstanceNorm's float32 intermediates, which the fused op does not return.
        raise Refuse("InstanceNorm on bf16/fp16 in a training graph (its input or statistics "
                     "are kept for backward)")
    # The view: the statistics' input (or its widening) and sub. Without a view, other
    # users of the chain's value are the walk's to handle (it returns the value too).
    # The forward graph may save the view for backward, or compute backward's x - mean
    # from it and save that: the fused op then returns the view's value (x, viewed).
    expected_users = {sub: 1, mul: 1} if view is x else {view: 2, sub: 1, mul: 1}
    if widened:
        expected_users[stats_in] = 1
    kept = [] if view is x or widened else _backward_readers(state, view)
    if any(len([u for u in _forward_users(state, node) if u not in kept]) != count
           for node, count in expected_users.items()):
        raise Refuse("InstanceNorm: an intermediate value is used elsewhere")
    consumed = ([] if view is x else [view]) + ([stats_in] if widened else [])
    consumed += [var_mean, var, mean, add, rsqrt, sub, mul]
    consumed += [node for node in stats.values() if node not in consumed]
    value, bias = mul, None
    scaled = _only(value, aten.mul.Tensor)
    weight = scaled is not None and _repeated_channel_param(scaled, value, n, state.channels, ndim)
    if weight:
        shifted = _only(scaled, aten.add.Tensor)
        bias = shifted is not None and _repeated_channel_param(shifted, scaled, n, state.channels, ndim)
        if bias:  # the affine: else the mul is the walk's next step, not part of the norm
            consumed += [scaled, shifted]
            value = shifted
        else:
            weight = None
    if widened:
        value = _only(value, prims.convert_element_type.default)
        if value is None or value.args[1] != xval.dtype:
            return None
        consumed.append(value)
    if view is x:
        back = value
    else:
        back = next((u for u in value.users if u.target in _VIEWS), None)
        if back is None or len(value.users) != 1 or not _same_shape(_val(back).shape, xval.shape):
            return None
        consumed.append(back)
    inputs = (_add_param(state, weight or None), _add_param(state, bias or None))
    step = Step("groupnorm", consts=(float(eps),), inputs=inputs, groups=state.channels)
    return _Match(step, consumed, back, stats=stats, inputs_kept=[view] if kept else [])


def _instance_norm_eval(state: _State, xval, view: Node, bn: Node, n):
    """InstanceNorm with running statistics, in eval mode: a BatchNorm (eval) of the
    [1, N*C, ...] view whose parameters are the [C] ones repeated N times. Per channel
    it is BatchNorm's eval affine, and becomes the `batchnorm_eval` step. With gradients
    (an affine one's weight needs the normalized input), the graph keeps the view for
    backward: the fused op returns it (x, viewed)."""
    items = _getitems(bn)
    kept = _backward_readers(state, view)
    if (len(view.users) != 1 + len(kept) or any(node.users for i, node in items.items() if i != 0)
            or 0 not in items):
        raise Refuse("InstanceNorm (eval): its input or statistics are used elsewhere")
    value = items[0]
    back = next(iter(value.users), None)
    if len(value.users) != 1 or back.target not in _VIEWS or not _same_shape(_val(back).shape, xval.shape):
        return None
    params = [None if arg is None else _unrepeated(arg, n, state.channels) for arg in bn.args[1:5]]
    if any(p is None for p, arg in zip(params, bn.args[1:5]) if arg is not None):
        return None
    eps = bn.args[6]
    inputs = tuple(_add_param(state, p) for p in params)
    consumed = [view, bn] + sorted(items.values(), key=lambda node: node.args[1]) + [back]
    return _Match(Step("batchnorm_eval", consts=(float(eps),), inputs=inputs), consumed, back,
                  inputs_kept=[view] if kept else [])


def _unrepeated(node: Node, n, channels: int):
    """p when `node` is repeat(p, [n]) of a [C] parameter p (p itself for one image,
    whose repeat the decomposition leaves out), else None."""
    if not isinstance(node, Node):
        return None
    if node.target is aten.repeat.default and len(node.args[1]) == 1:
        times = node.args[1][0]
        if not _same_size(_val(times) if isinstance(times, Node) else times, n):
            return None
        param = node.args[0]
    elif _same_size(n, 1):
        param = node
    else:
        return None
    val = _val(param)
    return param if isinstance(val, torch.Tensor) and list(val.shape) == [channels] else None


def _same_size(a, b) -> bool:
    """a == b for sizes that may be symbolic (the batch size), without adding a guard:
    symbolic sizes are equal when they print the same expression."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return not isinstance(a, int) and not isinstance(b, int) and str(a) == str(b)


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same_size(x, y) for x, y in zip(a, b))


def _instance_view(val, xval) -> bool:
    """Whether `val` is `xval` [N, C, *spatial] viewed as [1, N*C, *spatial]."""
    if val is None or val.dim() != xval.dim() or not _same_size(val.shape[0], 1):
        return False
    return _same_shape(val.shape[2:], xval.shape[2:]) and _same_size(val.shape[1], xval.shape[0] * xval.shape[1])


def _repeated_channel_param(node: Node, value: Node, n, channels: int, ndim: int):
    """The [C] parameter p when `node` is value (op) unsqueeze^k(repeat(p, [n])), the
    per-(image, channel) operand of InstanceNorm's decomposition; else None."""
    if len(node.args) != 2 or node.args[0] is not value or not isinstance(node.args[1], Node):
        return None
    operand = node.args[1]
    for _ in range(ndim - 2):
        if operand.target is not aten.unsqueeze.default or operand.args[1] != -1:
            return None
        operand = operand.args[0]
    return _unrepeated(operand, n, channels)


# --------------------------------------------------------------- binary steps

_BINARY = {
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    aten.sub.Tensor: "sub",
    aten.sub.Scalar: "sub",
    aten.mul.Tensor: "mul",
    aten.mul.Scalar: "mul",
    aten.div.Tensor: "div",
    aten.div.Scalar: "div",
    aten.maximum.default: "maximum",
    aten.minimum.default: "minimum",
}


# Ops that draw random numbers, by name (Inductor's replace_random pass turns rand into
# prims.inductor_random, which exists only once Inductor is imported).
_RANDOM_OPS = {"inductor_random", "rand", "rand_like", "bernoulli", "native_dropout"}


def _drawn_at_random(node: Node, depth: int = 3) -> bool:
    """Whether `node` or an input of it up to `depth` ops back draws random numbers."""
    seen, frontier = set(), [node]
    for _ in range(depth + 1):
        nxt = []
        for n in frontier:
            if n in seen or n.op != "call_function":
                continue
            seen.add(n)
            parts = str(n.target).split(".")  # "aten.rand.default", "prims.inductor_random.default"
            if len(parts) > 1 and parts[1] in _RANDOM_OPS:
                return True
            nxt += [a for a in n.all_input_nodes]
        frontier = nxt
    return False


def _operand_kind(state: _State, other) -> str:
    """Classifies the non-chain operand of a binary step."""
    if isinstance(other, bool) or not isinstance(other, (int, float, Node)):
        raise Refuse(f"operand {other!r} is not a number or a tensor")
    if not isinstance(other, Node):
        return SCALAR
    val = _val(other)
    if not isinstance(val, torch.Tensor):
        raise Refuse(f"operand {other.name} is not a tensor")
    if val.dtype not in DTYPES:
        if _drawn_at_random(other):
            raise Refuse(f"operand {other.name} is a random mask (dropout in training): the kernels draw no random "
                         "numbers")
        raise Refuse(f"operand {other.name} has dtype {val.dtype}")
    shape = list(val.shape)
    out_shape = list(_val(state.node).shape)
    if len(shape) > len(out_shape):
        raise Refuse(f"operand {other.name} of shape {shape} broadcasts the chain up")
    if shape == out_shape:
        if not _is_contiguous(val):
            raise Refuse(f"residual operand {other.name} is not contiguous")
        return FULL
    aligned = [1] * (len(out_shape) - len(shape)) + shape
    if all(s == 1 for s in aligned):
        return ONE
    axis = state.channel_axis if not (state.reduced or state.pixels) else None
    if axis is not None and all(s == 1 or (i == axis and s == out_shape[i]) for i, s in enumerate(aligned)):
        return CHANNEL
    if not all(_same_size(s, 1) or _same_size(s, o) for s, o in zip(aligned, out_shape)):
        raise Refuse(f"operand {other.name} of shape {shape} broadcasts the chain's shape {out_shape} up")
    return BROADCAST


def _broadcast_consts(state: _State, other: Node) -> tuple:
    """The BROADCAST operand's (div, mod, stride) triples (`spec.broadcast_terms`) for
    `other`, which has the chain's sizes in some dims and 1 in the others: one triple
    a run of dims where it has the chain's sizes, in the graph's (contiguous) order.

    Raises Refuse where the kernels could not index it: after a reduction or a pooling
    window (its elements are no longer the anchor output's), with a symbolic size
    beyond the batch, or where its leading dims neither split into whole anchor rows nor
    span whole groups of them (a [B, 1, D] operand of a Linear's [B, T, D] spans T rows
    an element of its leading dim: `spec.broadcast_sizes`)."""
    val, out = _val(other), list(_val(state.node).shape)
    if state.reduced_any or state.windows:
        raise Refuse(f"operand {other.name} of shape {list(val.shape)}: a broadcast operand after a reduction "
                     "or a pooling window")
    if any(not isinstance(o, int) for o in out[1:]):
        raise Refuse(f"operand {other.name} of shape {list(val.shape)}: the chain's shape {out} has a "
                     "symbolic size beyond the batch")
    aligned = [1] * (len(out) - val.dim()) + list(val.shape)
    full = [not _same_size(o, 1) and not _same_size(a, 1) for a, o in zip(aligned, out)]
    consts, d = [], 0
    while d < len(out):
        if not full[d]:
            d += 1
            continue
        b = next((i for i in range(d, len(out)) if not full[i]), len(out))
        div, stride = math.prod(out[b:]), math.prod(aligned[b:])
        consts += [div, 0 if d == 0 else math.prod(out[d:b]), stride]
        d = b
    per_row = state.channels * state.inner
    if full[0] and per_row % consts[0] and consts[0] % per_row:
        raise Refuse(f"operand {other.name} of shape {list(val.shape)}: its leading dims neither split "
                     f"into whole rows of the anchor output nor span whole groups of them")
    return tuple(consts)


# 0-dim tensors made in `forward` (`torch.tensor(0.5)`) reach the graph as one of these.
_SCALAR_TENSORS = (aten.full.default, aten.scalar_tensor.default)


def _cpu_scalar_constant(state: _State, other):
    """The number a 0-dim CPU tensor of fixed value holds, where the chain is not on the
    CPU; else None. A CUDA kernel reads such an operand as eager does, as a number:
    ATen's CUDA binary kernels read a CPU scalar's value, converted to float32 (the
    float32 product or sum of the value as its tensor stores it)."""
    val, chain_val = _val(other), _val(state.node)
    if not isinstance(val, torch.Tensor) or val.device.type != "cpu" or chain_val.device.type == "cpu":
        return None
    if val.dim() != 0 or val.dtype not in (torch.float32, torch.float64) or other.op != "call_function":
        return None
    if other.target not in _SCALAR_TENSORS:
        return None
    fill = other.args[1 if other.target is aten.full.default else 0]
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        return None
    return to_float32(float(fill)) if val.dtype == torch.float32 else float(fill)


def _classified(state: _State, other) -> tuple:
    """(the non-chain operand of a binary step as the kernels read it: a 0-dim CPU
    tensor of fixed value as its number; its operand kind, `_operand_kind`)."""
    constant = _cpu_scalar_constant(state, other)
    if constant is not None:
        other = constant
    return other, _operand_kind(state, other)


def _is_contiguous(val: torch.Tensor) -> bool:
    try:
        return bool(val.is_contiguous())
    except Exception:  # symbolic strides that cannot be decided: treat as not contiguous
        return False


def _earlier(state: _State, other: Node) -> int:
    """k where `other` holds the chain's value after k steps, which the kernel can hold
    in a register until this step: the same shape as the current value, no reduction
    in between (the kernel's stages split there), and no dtype conversion since."""
    k = state.held[other]
    between = state.chain.steps[k:]
    reduction = next((s for s in between if s.name in REDUCTIONS), None)
    if reduction is not None:
        raise Refuse(f"operand {other.name} is the chain's value from before its {reduction.name}: a reduction "
                     "lies between")
    if state.widened_at is not None or not _same_shape(_val(other).shape, _val(state.node).shape):
        raise Refuse(f"operand {other.name} is an earlier value of the chain of another shape or dtype")
    return k


def _match_binary(state: _State, user: Node):
    name = _BINARY.get(user.target)
    if name is None:
        return None
    if user.kwargs.get("alpha", 1) != 1 or (len(user.args) > 2 and user.args[2] != 1):
        raise Refuse(f"{name} with alpha != 1")
    if user.kwargs.get("rounding_mode") is not None:
        raise Refuse("div with a rounding mode")
    a, b = user.args[:2]
    if a is state.node and b is state.node:
        return _Match(Step(name, operand=SELF), [user], user)
    reverse = b is state.node
    other = a if reverse else b
    if isinstance(other, Node) and other in state.held:
        return _Match(Step(name, consts=(_earlier(state, other),), operand=EARLIER, reverse=reverse), [user], user)
    if isinstance(other, Node) and _derived_from_chain(state, other):
        return _match_branch(state, user, other)
    other, kind = _classified(state, other)
    if kind == SCALAR:
        return _Match(Step(name, consts=(float(other),), operand=SCALAR, reverse=reverse), [user], user)
    return _Match(_tensor_operand_step(state, name, other, kind, reverse), [user], user)


# Nodes a branch may walk before it meets the chain's value again.
BRANCH_MAX_NODES = 16


def _match_branch(state: _State, user: Node, other: Node) -> _Match:
    """`user` combines the chain's value with `other`, computed from an earlier value h
    of the chain by nodes of its own (`f(x) * g(x)`: at f(x), other = g(x)): a `branch`
    step back to h, whose route walks other's nodes as steps and then `user`, which
    reads the value the chain left as an EARLIER operand. Raises Refuse where `other`
    is not one such path (a node that combines two values computed from the chain's
    outside the chain's held ones takes the first and branches again for the second)."""
    path, node = [], other
    while node not in state.held:
        if len(path) == BRANCH_MAX_NODES or node.op != "call_function" or node in state.claimed \
                or node in state.backward or node in state.not_steps or node in state.chain.nodes:
            raise Refuse(f"operand {other.name} is computed from the chain's own values, not by a path of at most "
                         f"{BRANCH_MAX_NODES} steps from one of its values")
        path.append(node)
        inputs = [n for n in node.all_input_nodes if n in state.held or _derived_from_chain(state, n)]
        free = [n for n in inputs if n not in state.held]
        node = free[0] if free else max(inputs, key=lambda n: state.held[n])
    k = _earlier(state, node)
    path.reverse()
    return _Match(Step("branch", consts=(k,), operand=EARLIER), [], node, route=path + [user])


def _tensor_operand_step(state: _State, name: str, other: Node, kind: str, reverse: bool) -> Step:
    """The binary step `name` whose other operand is the tensor `other`, of operand kind
    `kind` (`_operand_kind`): the tensor becomes one of the fused op's inputs."""
    consts = _broadcast_consts(state, other) if kind == BROADCAST else ()
    return Step(name, consts=consts, inputs=(_add_param(state, other),), operand=kind, reverse=reverse)


# ------------------------------------------------------------ normalizations


def _getitems(node: Node) -> dict[int, Node]:
    items = {}
    for user in node.users:
        if user.target is not operator.getitem:
            raise Refuse(f"{node.name}: result used as a tuple by {user.name}")
        items[user.args[1]] = user
    return items


def _normalized(user: Node, what: str):
    """The getitem users of a norm node: (items by index, nodes the step consumes,
    statistics used elsewhere as {"mean": node, "rstd": node}).

    Raises Refuse unless output 0 is used.
    """
    items = _getitems(user)
    if 0 not in items:
        raise Refuse(f"{what}: normalized output unused")
    stats = {name: items[i] for i, name in ((1, "mean"), (2, "rstd")) if i in items and items[i].users}
    return items, [user] + sorted(items.values(), key=lambda n: n.args[1]), stats


def _require_features(state: _State, what: str, dims):
    """Refuses unless `dims` is exactly the feature (last) dim of a linear output."""
    ndim = _val(state.node).dim()
    dims = [dims] if isinstance(dims, int) else list(dims)
    if state.conv or state.reduced or [d % ndim for d in dims] != [ndim - 1] or state.channel_axis != ndim - 1:
        raise Refuse(f"{what} over dims {dims} of a {ndim}-D {'conv' if state.conv else 'linear'} output: "
                     "only the feature dim of a linear output")


def _match_group_norm(state: _State, user: Node):
    if user.target is not aten.native_group_norm.default:
        return None
    weight, bias = user.args[1], user.args[2]
    channels, groups, eps = user.args[4], user.args[6], user.args[7]
    if state.channel_axis != 1:
        raise Refuse("GroupNorm: channels are not the matmul's feature dim")
    if channels != state.channels:
        raise Refuse(f"GroupNorm: expects {channels} channels, chain has {state.channels}")
    if not isinstance(groups, int) or channels % groups:
        raise Refuse(f"GroupNorm: {groups} groups do not divide {channels} channels")
    items, consumed, stats = _normalized(user, "GroupNorm")
    inputs = (_add_param(state, weight), _add_param(state, bias))
    step = Step("groupnorm", consts=(float(eps),), inputs=inputs, groups=groups)
    return _Match(step, consumed, items[0], stats=stats)


def _match_layer_norm(state: _State, user: Node):
    if user.target is not aten.native_layer_norm.default:
        return None
    shape, weight, bias, eps = user.args[1], user.args[2], user.args[3], user.args[4]
    if state.conv:
        return _conv_layer_norm(state, user, list(shape), weight, bias, eps)
    if list(shape) != [state.channels] or state.channel_axis != _val(state.node).dim() - 1:
        raise Refuse(f"LayerNorm: normalized_shape {list(shape)} is not the feature dim alone")
    items, consumed, stats = _normalized(user, "LayerNorm")
    inputs = (_add_param(state, weight), _add_param(state, bias))
    return _Match(Step("layernorm", consts=(float(eps),), inputs=inputs), consumed, items[0], stats=stats)


def _conv_layer_norm(state: _State, user: Node, shape: list, weight, bias, eps):
    """LayerNorm over trailing dims of a conv output [rows, C, *spatial] (its last k dims,
    k >= 1, the channels included or not): a segment norm whose segments are the
    contiguous runs of those dims, with a weight and bias of their shape (`SEGMENT`)."""
    val = _val(state.node)
    tail = list(val.shape[val.dim() - len(shape):]) if 0 < len(shape) < val.dim() else None
    if tail is None or not all(_same_size(a, b) for a, b in zip(tail, shape)):
        raise Refuse(f"LayerNorm: normalized_shape {shape} is not trailing dims of the conv output's "
                     f"{list(val.shape)} (the batch excluded)")
    if state.channel_axis != 1 or state.reduced_any or state.windows:
        raise Refuse("LayerNorm: only over the trailing dims of a conv output itself (not a reduced or pooled one)")
    segment = math.prod(shape)
    items, consumed, stats = _normalized(user, "LayerNorm")
    inputs = (_add_param(state, weight), _add_param(state, bias))
    step = Step("layernorm", consts=(float(eps),), inputs=inputs, groups=state.channels * state.inner // segment,
                normalized=tuple(int(d) for d in shape))
    return _Match(step, consumed, items[0], stats=stats)


def _match_batch_norm(state: _State, user: Node):
    if user.target is aten._native_batch_norm_legit_no_training.default:
        x, weight, bias, rmean, rvar, momentum, eps = user.args[:7]
        training = False
    elif user.target is aten._native_batch_norm_legit_functional.default:
        x, weight, bias, rmean, rvar, training, momentum, eps = user.args[:8]
    else:
        return None
    if state.channel_axis != 1:
        raise Refuse("BatchNorm: channels are not the matmul's feature dim")
    items, consumed, stats = _normalized(user, "BatchNorm")
    if not training:
        if stats:
            raise Refuse("BatchNorm (eval): statistics outputs used elsewhere")
        inputs = tuple(_add_param(state, n) for n in (weight, bias, rmean, rvar))
        return _Match(Step("batchnorm_eval", consts=(float(eps),), inputs=inputs), consumed, items[0])
    # Statistics per channel over the rows (and a conv's spatial positions).
    if state.reduced or (not state.conv and _val(state.node).dim() != 2):
        raise Refuse("BatchNorm (training): only on a 2-D [rows, features] matmul output or a conv output")
    if _val(rmean).shape[0] != state.channels:
        raise Refuse(f"BatchNorm: expects {_val(rmean).shape[0]} channels, chain has {state.channels}")
    if not isinstance(momentum, float):
        raise Refuse(f"BatchNorm: unsupported momentum={momentum!r} (only a constant float)")
    if 3 not in items or 4 not in items:
        raise Refuse("BatchNorm (training): running statistics are not written back")
    inputs = tuple(_add_param(state, n) for n in (weight, bias, rmean, rvar))
    step = Step("batchnorm_train", consts=(float(momentum), float(eps)), inputs=inputs)
    return _Match(step, consumed, items[0], extra=[items[3], items[4]], stats=stats)


def _match_softmax(state: _State, user: Node):
    """Softmax over a linear output's features, over a conv output's channels (per pixel),
    or over the last dim of a conv or bmm value where it holds each channel's whole plane
    (`_over_the_plane`)."""
    name = {aten._softmax.default: "softmax", aten._log_softmax.default: "log_softmax"}.get(user.target)
    if name is None:
        return None
    if user.args[2]:
        raise Refuse(f"{name}: half_to_float")
    return _Match(_softmax_step(state, name, user.args[1]), [user], user)


def _softmax_step(state: _State, name: str, dim) -> Step:
    """The step of softmax or log_softmax (`name`) over `dim` of the current value.

    Raises:
        Refuse: no kernel normalizes over that dim.
    """
    if state.conv and _over_channels(state, dim):
        return Step(f"channel_{name}")
    if state.conv and _over_the_plane(state, dim):
        return Step(f"spatial_{name}")
    if state.conv:
        raise Refuse(f"{name} over dims [{dim}] of a {_val(state.node).dim()}-D conv output: only over its "
                     "channels (dim 1), or over its last dim where that holds the whole plane (a Conv1d's or "
                     "bmm's output; a view that flattened the spatial dims)")
    _require_features(state, name, dim)
    return Step(name)


def _match_softmax_spelled(state: _State, _user: Node):
    """Softmax written out over one dim d: exp(x - m) / sum(exp(x - m), d, keepdim=True)
    with m = amax(x, d, keepdim=True) or max(x, d, keepdim=True)[0]; the `softmax` step
    (computed in float32 and rounded once, where eager rounds each op's result; the same
    ops on inf and NaN). Not matched where an intermediate value is read elsewhere (a
    training graph keeping it for backward), over a dim no kernel normalizes over, or
    without the maximum (exp(x) / sum(exp(x)) is not softmax where exp(x) overflows).
    x - logsumexp(x, d, keepdim=True) is not log_softmax: on a row holding +inf it is -inf
    and NaN where log_softmax is NaN throughout."""
    x = state.node
    for red in _step_users(state, x):
        dim = _spelled_reduction_dim(red, x) if red.target in (aten.amax.default, aten.max.dim) else None
        if dim is None:
            continue
        top = red
        if red.target is aten.max.dim:  # its values, the indices unread
            top = _only(red, operator.getitem)
            if top is None or top.args[1] != 0:
                continue
        sub = _only(top, aten.sub.Tensor)
        if sub is None or not _is_difference(sub, x, top):
            continue
        exp = _only(sub, aten.exp.default)
        total = exp and next((u for u in exp.users if u.target is aten.sum.dim_IntList), None)
        div = total and _only(total, aten.div.Tensor)
        if div is None or len(exp.users) != 2 or div not in exp.users or div.args[:2] != (exp, total) \
                or len(div.args) > 2 or div.kwargs or _spelled_reduction_dim(total, exp) != dim:
            continue
        try:
            step = _softmax_step(state, "softmax", dim)
        except Refuse:
            return None  # the chain stops at the reduction, with that reduction's reason
        consumed = sorted({red, top, sub, exp, total, div}, key=lambda n: state.order.get(n, 0))
        return _Match(step, consumed, div)
    return None


def _match_layer_norm_spelled(state: _State, _user: Node):
    """LayerNorm without affine written out over a Linear output's features: d / sqrt(v +
    eps) or d * rsqrt(v + eps), with d = x - x.mean(-1, keepdim=True) and v =
    d.pow(2).mean(-1, keepdim=True) or x.var(-1, unbiased=False, keepdim=True) (the
    LayerNorm of older BERT code and of many repositories); the `layernorm` step without
    weight and bias (a weight and a bias after it are steps of their own). Not matched
    where a value in between is read elsewhere (a training graph keeping it for backward)."""
    if state.conv:
        return None
    x = state.node
    users = _step_users(state, x)
    for mean in users:
        dim = _spelled_reduction_dim(mean, x) if mean.target is aten.mean.dim else None
        subs = list(mean.users)  # x - mean, once or written twice (numerator and variance)
        if dim is None or not 0 < len(subs) <= 2 or not all(_is_difference(s, x, mean) for s in subs):
            continue
        var = next((u for u in users if u.target is aten.var.correction and _spelled_reduction_dim(u, x) == dim), None)
        squares = [u for s in subs for u in s.users if (u.target is aten.pow.Tensor_Scalar and u.args[1:] == (2,))
                   or (u.target is aten.mul.Tensor and u.args[:2] == (s, s))]
        if var is not None and not squares:
            variance, source = [var], var
        elif var is None and len(squares) == 1:
            mean2 = _only(squares[0], aten.mean.dim)
            if mean2 is None or _spelled_reduction_dim(mean2, squares[0]) != dim:
                continue
            variance, source = [squares[0], mean2], mean2
        else:
            continue
        add = _only(source, aten.add.Tensor) or _only(source, aten.add.Scalar)
        eps = add and _arg(add, 1, "other")
        if add is None or add.args[0] is not source or isinstance(eps, (bool, Node)) \
                or not isinstance(eps, (int, float)) or _arg(add, 2, "alpha", 1) != 1:
            continue
        root = _only(add, aten.sqrt.default) or _only(add, aten.rsqrt.default)
        if root is None:
            continue
        norm = _only(root, aten.div.Tensor if root.target is aten.sqrt.default else aten.mul.Tensor)
        if norm is None or len(norm.args) > 2 or norm.kwargs:
            continue
        if root.target is aten.sqrt.default:  # (x - mean) / sqrt(...)
            divides, centred = norm.args[1] is root, norm.args[0]
        else:  # (x - mean) * rsqrt(...), either order
            divides, centred = root in norm.args[:2], norm.args[0] if norm.args[1] is root else norm.args[1]
        if not divides or centred not in subs:
            continue
        # every use of x - mean is the square or the normalization
        if sorted(id(u) for s in subs for u in s.users) != sorted(id(u) for u in squares + [norm]):
            continue
        try:
            _require_features(state, "LayerNorm", dim)
        except Refuse:
            return None  # the chain stops at the mean, with its reason
        consumed = sorted([mean, *subs, *variance, add, root, norm], key=lambda n: state.order.get(n, 0))
        return _Match(Step("layernorm", consts=(float(eps),), inputs=(-1, -1)), consumed, norm)
    return None


def _is_difference(node: Node, a: Node, b: Node) -> bool:
    """Whether `node` computes a - b (sub.Tensor, alpha 1)."""
    return (node.target is aten.sub.Tensor and node.args[:2] == (a, b) and len(node.args) == 2
            and node.kwargs.get("alpha", 1) == 1)


def _spelled_reduction_dim(node: Node, x: Node) -> int | None:
    """The one dim that `node` reduces `x` over, keeping it (amax, max(...) values, sum
    or mean with keepdim=True and no dtype, var with no correction), else None."""
    if node.args[:1] != (x,):
        return None
    if node.target is aten.max.dim:
        dims, keepdim = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
    elif node.target in (aten.amax.default, aten.sum.dim_IntList, aten.mean.dim):
        dims, keepdim = _arg(node, 1, "dim"), _arg(node, 2, "keepdim", False)
        if node.target in (aten.sum.dim_IntList, aten.mean.dim) and _arg(node, 3, "dtype") is not None:
            return None
    elif node.target is aten.var.correction:
        dims, keepdim = _arg(node, 1, "dim"), node.kwargs.get("keepdim", False)
        if len(node.args) > 2 or node.kwargs.get("correction") != 0:
            return None
    else:
        return None
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if len(dims) != 1 or not isinstance(dims[0], int) or keepdim is not True:
        return None
    return dims[0] % _val(x).dim()


def _over_channels(state: _State, dims) -> bool:
    """Whether `dims` is exactly a conv output's channel dim (1), with the channels still there."""
    ndim = _val(state.node).dim()
    dims = [dims] if isinstance(dims, int) else list(dims)
    return (ndim > 2 and [d % ndim for d in dims] == [1] and state.channel_axis == 1
            and not state.reduced_any)


def _flattened(state: _State) -> bool:
    """Whether the value is a conv output [N, C, *spatial] viewed as [N, C, prod(spatial)]."""
    val, anchor = _val(state.node), _val(state.chain.anchor)
    return state.regrouped and val.dim() == 3 and _same_size(val.shape[0], anchor.shape[0])


def _over_the_plane(state: _State, dim) -> bool:
    """Whether `dim` is the last dim of a conv or bmm value that holds each channel's
    whole plane after its channel dim (and dims of 1): a Conv1d's or bmm's output, or a
    view that flattened a conv's spatial dims or regrouped the rows (`_State.regrouped`)."""
    val = _val(state.node)
    ndim = val.dim()
    return (ndim >= 3 and isinstance(dim, int) and dim % ndim == ndim - 1 and state.channel_axis < ndim - 1
            and _same_size(val.shape[-1], state.inner) and not state.reduced_any and not state.windows)


# ----------------------------------------------------------------- reductions

# aten op -> step; each takes (value, dims, keepdim, ...).
_ROW_REDUCTIONS = {
    aten.logsumexp.default: "logsumexp",
    aten.sum.dim_IntList: "sum",
    aten.mean.dim: "mean",
    aten.amax.default: "amax",
    aten.amin.default: "amin",
}
# Reductions that also return indices: fused when only the values are used.
_VALUE_AND_INDEX = {aten.max.dim: "amax", aten.min.dim: "amin"}


def _match_row_reduction(state: _State, user: Node):
    """A reduction along the features of a 2-D linear output (one value per row), or
    over every spatial dim of a conv output (one value per row and channel)."""
    if user.target in _VALUE_AND_INDEX:
        name = _VALUE_AND_INDEX[user.target]
        items = _getitems(user)
        if 1 in items and items[1].users:
            raise Refuse(f"{name} ({user.target.__name__}): the graph also uses its indices "
                         "(in training, for backward; or the model itself), which the kernel does not write")
        if 0 not in items:
            raise Refuse(f"{name}: values unused")
        consumed, result = [user, items[0]], items[0]
    elif user.target in _ROW_REDUCTIONS:
        name = _ROW_REDUCTIONS[user.target]
        consumed, result = [user], user
        if name in ("sum", "mean") and _arg(user, 3, "dtype") is not None:
            raise Refuse(f"{name} with dtype={_arg(user, 3, 'dtype')}")
    else:
        return None
    dims = _arg(user, 1, "dim", [])
    keepdim = bool(_arg(user, 2, "keepdim", False))
    if isinstance(dims, int):
        dims = [dims]
    val = _val(state.node)
    ndim = val.dim()
    axes = sorted(d % ndim for d in dims) if ndim else []
    if state.conv:
        spatial = list(range(2, ndim))
        if state.pooled or state.pixels:
            raise Refuse(f"{name}: only one reduction per fused kernel (the chain's value is reduced already)")
        if _over_channels(state, dims):
            return _Match(Step(f"channel_{name}", keepdim=keepdim), consumed, result)
        if state.regrouped and not _flattened(state):
            raise Refuse(f"{name} after a view to {list(val.shape)} that regroups the rows of a conv or bmm output: "
                         "only steps that keep its shape follow")
        if state.channel_axis != 1 or not spatial or axes != spatial:
            raise Refuse(f"{name} over dims {list(dims)} of a {ndim}-D conv output: only over its channels "
                         f"(dim 1) or over all its spatial dims {spatial}")
        if f"spatial_{name}" not in SPATIAL_REDUCTIONS:
            raise Refuse(f"{name} over a conv output's spatial dims is not implemented (sum, mean, amax, amin are)")
        return _Match(Step(f"spatial_{name}", keepdim=keepdim), consumed, result)
    if axes != [ndim - 1] or state.channel_axis != ndim - 1 or ndim < 2:
        raise Refuse(f"{name} over dims {list(dims)} of a {ndim}-D linear output: only over its features (the last dim)")
    if sum(not isinstance(d, int) for d in _val(result).shape) > 1:
        raise Refuse(f"{name} of a {ndim}-D linear output: its result {list(_val(result).shape)} has more than one "
                     "dynamic size (the fused op's [rows] output is viewed to it with one -1)")
    return _Match(Step(name, keepdim=keepdim), consumed, result)


# ------------------------------------------------------------ pooling windows

# Max pools (the values are output 0; the indices or offsets, output 1, are backward's).
_MAX_POOLS = tuple(op for op in (aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default,
                                 getattr(getattr(prims, "_low_memory_max_pool_with_offsets", None), "default", None))
                   if op is not None)
_AVG_POOLS = (aten.avg_pool2d.default, aten.avg_pool3d.default)
_SQUEEZES = (aten.squeeze.dim, aten.squeeze.dims)


def pool_out_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool) -> int:
    """Pooled elements along one dim, by PyTorch's rule (`pooling_output_shape`): with
    ceil_mode, a last window that would start in the right padding is dropped."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = span // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def _per_dim(value, nd: int, what: str) -> tuple:
    values = [value] if isinstance(value, int) else list(value)
    if len(values) == 1:
        values = values * nd
    if len(values) != nd or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise Refuse(f"{what} {value!r} is not {nd} whole numbers")
    return tuple(values)


def _match_pool(state: _State, user: Node):
    """MaxPool / AvgPool 2-D and 3-D over a conv output's spatial dims; 1-D as PyTorch
    runs it, a 2-D pool of a 1 x k window between `unsqueeze(-2)` and `squeeze(-2)`; and
    that 1-D pool over a Linear output's features: `unsqueeze(1)` first, then
    `squeeze(1)` (else the pooled value keeps its unit dim: `keepdim`)."""
    consumed = []
    pool = user
    features = False  # over a Linear output's features
    shared = None  # a view before the pool that the graph uses too

    def next_of(view, targets):
        """The user of `view` that is one of `targets` (noting `shared` where it has others)."""
        nonlocal shared
        found = [u for u in view.users if u.target in targets]
        if len(found) != 1:
            return None
        if len(view.users) > 1 and shared is None:
            shared = view
        return found[0]

    if user.target is aten.unsqueeze.default:
        val, dim = _val(state.node), _arg(user, 1, "dim")
        if not isinstance(dim, int):
            return None
        if not state.conv and val.dim() == 2 and dim % 3 == 1:  # [rows, N] -> [rows, 1, N]
            consumed.append(user)
            user = next_of(user, (aten.unsqueeze.default,))
            dim = user is not None and _arg(user, 1, "dim")
            if user is None or not isinstance(dim, int) or isinstance(dim, bool):
                return None
            features = True
        elif not state.conv or val.dim() != 3:
            return None
        if dim % 4 != 2:
            return None
        pool = next_of(user, _MAX_POOLS + _AVG_POOLS)
        if pool is None:
            return None
        consumed.append(user)
    elif user.target not in _MAX_POOLS + _AVG_POOLS:
        return None
    name = "maxpool" if pool.target in _MAX_POOLS else "avgpool"
    if shared is not None:
        raise Refuse(f"{name}: the graph also uses {shared.name} (a view of the values before the pool; in "
                     "training, saved for backward), and the pool kernel writes only the pooled values")
    if features and (state.reduced or state.channel_axis != 1):
        raise Refuse(f"{name}: over a Linear output's features, only on the [rows, N] output itself")
    if not features and (not state.conv or state.channel_axis != 1 or state.reduced_any):
        raise Refuse(f"{name}: only over the spatial dims of a conv output, or a Linear output's features")
    nd = _val(pool.args[0]).dim() - 2
    kernel = _per_dim(_arg(pool, 1, "kernel_size"), nd, f"{name}: kernel_size")
    stride = _per_dim(_arg(pool, 2, "stride", None) or kernel, nd, f"{name}: stride")
    padding = _per_dim(_arg(pool, 3, "padding", 0), nd, f"{name}: padding")
    if name == "maxpool":
        dilation = _per_dim(_arg(pool, 4, "dilation", 1), nd, f"{name}: dilation")
        ceil_mode = bool(_arg(pool, 5, "ceil_mode", False))
        items = _getitems(pool)
        if 1 in items and items[1].users:
            raise Refuse(f"{name}: the graph also uses its indices (in training, for backward), which the pool "
                         "kernel does not write")
        if 0 not in items:
            raise Refuse(f"{name}: values unused")
        consumed += [pool, items[0]]
        result = items[0]
        extra = ()
    else:
        dilation = (1,) * nd
        ceil_mode = bool(_arg(pool, 4, "ceil_mode", False))
        divisor = _arg(pool, 6, "divisor_override", None)
        if divisor is not None and (isinstance(divisor, bool) or not isinstance(divisor, int) or divisor <= 0):
            raise Refuse(f"{name}: divisor_override {divisor!r}")
        extra = (int(bool(_arg(pool, 5, "count_include_pad", True))), int(divisor or 0))
        consumed.append(pool)
        result = pool
    if consumed[0] is not pool:  # the 1-D form: squeeze the unit dim back, drop it from the window
        squeeze = _squeeze_of(result, 2)
        if squeeze is None:
            raise Refuse(f"1-D {name}: the pooled value is not squeezed back to 3-D")
        if (kernel[0], stride[0], padding[0], dilation[0]) != (1, 1, 0, 1):
            raise Refuse(f"1-D {name}: a window over the unit dim")
        kernel, stride, padding, dilation = kernel[1:], stride[1:], padding[1:], dilation[1:]
        consumed.append(squeeze)
        result = squeeze
    val = _val(state.node)
    sizes = tuple(val.shape[1:] if features else val.shape[2:])
    pooled = tuple(_val(result).shape[2:])
    want = tuple(pool_out_size(*dims, ceil_mode) for dims in zip(sizes, kernel, stride, padding, dilation))
    if pooled != want or min(pooled, default=0) < 1:
        raise Refuse(f"{name}: pooled sizes {list(pooled)}, not the {list(want)} of its window")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise Refuse(f"{name}: padding {list(padding)} over half the kernel {list(kernel)}")
    keepdim = False
    if features:  # [rows, 1, N'] back to [rows, N'], or kept
        squeeze = _squeeze_of(result, 1)
        if squeeze is not None:
            consumed.append(squeeze)
            result = squeeze
        keepdim = squeeze is None
    window = (sizes, pooled, kernel, stride, padding, dilation)
    step = Step(name, consts=(int(ceil_mode),) + extra, window=window, keepdim=keepdim)
    return _Match(step, consumed, result)


def _squeeze_of(node: Node, dim: int) -> Node | None:
    """The only user of `node` when it squeezes dim `dim` (of a 4-D or 3-D value) alone, else None."""
    if len(node.users) != 1:
        return None
    squeeze = next(iter(node.users))
    dims = squeeze.args[1] if squeeze.target in _SQUEEZES and len(squeeze.args) > 1 else None
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    ndim = _val(node).dim()
    return squeeze if [d % ndim for d in dims] == [dim] else None


# ---------------------------------------------------------------- conversions

_CONVERTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)


def _match_convert(state: _State, user: Node):
    """bf16/fp16 -> float32 and back: decompositions (RMSNorm's, for one) compute in
    float32 between two conversions. The epilogue computes in float32 throughout, so
    both are no-ops for it; a chain that would end in float32 is cut back (`_extend`)."""
    if user.target not in _CONVERTS:
        return None
    val = _val(user)
    if user.target is aten._to_copy.default and set(user.kwargs) - {"dtype"}:
        raise Refuse(f"_to_copy with {sorted(set(user.kwargs) - {'dtype'})}")
    chain_dtype = _val(state.chain.anchor).dtype
    if state.dtype != torch.float32 and val.dtype == torch.float32:
        return _Match(None, [user], user, dtype=torch.float32)
    if state.dtype == torch.float32 and chain_dtype != torch.float32 and val.dtype == chain_dtype:
        return _Match(None, [user], user, dtype=chain_dtype)
    raise Refuse(f"conversion from {state.dtype} to {val.dtype} would round inside the chain")


# ---------------------------------------------------------------------- views

_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
# Views that name dims rather than a shape: taken as views of a conv or bmm value where its
# shape rules below accept them (else they are left to the other matchers: a 1-D pool's
# `unsqueeze`); re-applied as a view to their static shape (`view_shape`).
_SQUEEZE_LIKE = _SQUEEZES + (aten.squeeze.default, aten.unsqueeze.default, aten.permute.default)


def _keeps_order(user: Node) -> bool:
    """A squeeze or unsqueeze; a permute that only moves dims of size 1 (einsum's)."""
    if user.target is not aten.permute.default:
        return True
    sizes, order = _val(user.args[0]).shape, list(user.args[1])
    moved = [d % len(sizes) for d in order if not _same_size(sizes[d], 1)]
    return moved == sorted(moved)


def _channel_axis(val, channels: int, inner: int) -> int | None:
    """The dim of `val` (a view of a conv or bmm value [rows, C, inner]) that holds its
    channels: the first a >= 1 with C elements and `inner` elements in the dims after it
    (the dims before it then hold the rows, the element order being kept); else None."""
    shape = list(val.shape)
    for a in range(1, len(shape)):
        after = shape[a + 1:]
        if _same_size(shape[a], channels) and all(isinstance(d, int) for d in after) and math.prod(after) == inner:
            return a
    return None


def view_shape(node: Node) -> list:
    """The shape a view node gives its value, as a view of the fused op's output takes it:
    a view's own shape argument; a squeeze's or unsqueeze's (or an N-D Linear's row
    reduction's) static shape, -1 for its one symbolic size (the matcher takes none with
    more)."""
    if node.target in _VIEWS:
        return node.args[1]
    return [d if isinstance(d, int) else -1 for d in _val(node).shape]


def _match_view(state: _State, user: Node):
    """A view that only regroups the rows of a linear output (3-D inputs to nn.Linear);
    adds or drops dims of 1 after a pooled conv output's channels (`flatten(1)`, a
    squeeze), or after its channels reduced (keepdim's dim); or keeps a conv or bmm
    value's channels as one dim followed by dims holding each channel's elements,
    regrouping the rows or flattening the spatial dims (`_State.regrouped`; einsum's
    views, unit dims moved by a permute)."""
    if user.target in _SQUEEZE_LIKE:
        val = _val(user)
        if not state.conv or sum(not isinstance(d, int) for d in val.shape) > 1 or not _keeps_order(user):
            return None
        try:
            return _conv_view(state, user, val)
        except Refuse:
            return None
    if user.target not in _VIEWS:
        return None
    val = _val(user)
    if state.conv and not state.reduced_any and _instance_view(val, _val(state.node)):
        raise Refuse(f"view to {list(val.shape)} (InstanceNorm's form) not followed by an InstanceNorm "
                     "that fuses: statistics of its input without running statistics, or running "
                     "statistics in eval mode")
    if state.conv:
        return _conv_view(state, user, val)
    if state.reduced or val.shape[-1] != state.channels or not _is_contiguous(val):
        raise Refuse(f"view to {list(val.shape)} changes the feature layout")
    return _Match(None, [user], user)


def _conv_view(state: _State, user: Node, val) -> _Match:
    """A view of a conv or bmm value (`_match_view`), or Refuse."""
    anchor = _val(state.chain.anchor)
    if state.pooled:
        # [rows, C] <-> [rows, C, 1, ...]: the same values in the same order, channels at dim 1.
        if val.dim() < 2 or not _same_shape(val.shape[:2], _val(state.node).shape[:2]) or \
                any(not _same_size(s, 1) for s in val.shape[2:]):
            raise Refuse(f"view to {list(val.shape)} of a pooled [rows, channels] value: only [rows, channels, 1, ...]")
        return _Match(None, [user], user)
    if state.pixels:
        # [rows, *spatial] <-> [rows, 1, *spatial]: a reduction over the channels, keepdim toggled.
        rows, spatial = list(anchor.shape[:1]), list(anchor.shape[2:])
        if not (_same_shape(val.shape, rows + spatial) or _same_shape(val.shape, rows + [1] + spatial)):
            raise Refuse(f"view to {list(val.shape)} of a value reduced over the channels: only [rows, (1,) *spatial]")
        return _Match(None, [user], user)
    if not state.reduced_any and not state.windows and _is_contiguous(val) and (
            _same_shape(val.shape, anchor.shape) or _channel_axis(val, state.channels, state.inner) is not None):
        return _Match(None, [user], user)
    raise Refuse(f"view to {list(val.shape)} changes the feature layout")


# Ordered: multi-node forms first (see the module docstring).
STEP_MATCHERS: list[Callable] = [
    _match_silu_pair,
    _match_prelu,
    _match_rms_norm,
    _match_instance_norm,
    _match_softmax_spelled,
    _match_layer_norm_spelled,
    _match_pool,  # (a 1-D pool's unsqueeze before the views, which would take it alone)
    _match_view,
    _match_unary,
    _match_binary,
    _match_group_norm,
    _match_layer_norm,
    _match_l2_normalize,
    _match_batch_norm,
    _match_softmax,
    _match_row_reduction,
    _match_convert,
]
# Forms that consume a value with several users (the value feeds more than one of their nodes).
MULTI_NODE = STEP_MATCHERS[:6]


# -------------------------------------------------------------------- anchors


def auto_takes_gemm(steps, dtype: torch.dtype, matmul_tf32: bool) -> bool:
    """Whether FUSEDEPI_IN_KERNEL_GEMM=auto keeps a Linear chain a candidate for the
    in-kernel GEMM (each call then picks by its rows). Measured on an H200, ratio to the
    library GEMM alone:
    - 16-bit: pointwise chains (workload 1 eval 1.09-1.10x in it, 1.17-1.19x on the
      library path) and row reductions (workload 2 level); GroupNorm is not faster in it;
    - float32 in TF32: row reductions only (workload 2 1.00-1.02x in it, 1.03x on the
      library path). There the consumers run a pointwise chain on every tile (no spare
      warps for float32 tiles): workload 1 eval 1.07x in it against 1.03x, and workload 3
      1.06x against 1.05x. At "highest" the kernel could not run (it is TF32), so the
      lighter epilogue-only file is built.
    """
    if any(s.name in REDUCTIONS and s.name not in ROW_REDUCTIONS for s in steps):
        return False
    if dtype == torch.float32:
        return matmul_tf32 and any(s.name in ROW_REDUCTIONS for s in steps)
    return True


def _match_anchor(node: Node, direct_conv: bool = True, direct_gemm: bool = False, implicit_conv: bool = False):
    """Returns (Anchor, operand nodes) for an anchor node, else None.

    direct_conv: mark 2-D convolutions of groups 1 as candidates for the direct conv
        (stride 1, dilation 1) and the in-kernel conv, and 3-D ones for the in-kernel conv.
    direct_gemm: mark x @ w^T products (a Linear's) as candidates for the in-kernel GEMM.
    implicit_conv: mark those convolutions as candidates for the in-kernel conv too.
    """
    if node.op != "call_function":
        return None
    if node.target is aten.addmm.default:
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            raise Refuse("addmm with alpha/beta != 1")
        gemm = linear_form(*node.args[1:3], bias=node.args[0]) if direct_gemm else ()
        return Anchor("addmm", gemm=gemm), list(node.args[:3])
    if node.target is aten.mm.default:
        gemm = linear_form(*node.args[:2]) if direct_gemm else ()
        return Anchor("mm", gemm=gemm), list(node.args[:2])
    if node.target is aten.bmm.default:
        return Anchor("bmm"), list(node.args[:2])
    if node.target is aten.baddbmm.default:  # input + alpha * (b1 @ b2), all in the library call
        if _arg(node, 3, "beta", 1) != 1:
            raise Refuse("baddbmm with beta != 1")
        alpha = _arg(node, 4, "alpha", 1)
        if alpha == 0:
            raise Refuse("baddbmm with alpha == 0")
        return Anchor("bmm", has_bias=True, alpha=float(alpha)), list(node.args[1:3]) + [node.args[0]]
    if node.target is aten.convolution.default:
        x, w, b, stride, padding, dilation, transposed, out_pad, groups = node.args
        conv = (tuple(stride), tuple(padding), tuple(dilation), bool(transposed), tuple(out_pad), groups)
        operands = [x, w] + ([b] if b is not None else [])
        direct, depth, flipped, as_2d = (), (), False, False
        if direct_conv and transposed:  # a stride-1 ConvTranspose2d or 3d as the conv it equals
            equal = _conv_equal_to_transposed(w, conv)
            if equal is not None and len(stride) == 3:
                direct, depth = _direct_conv_3d(x, w, equal)
            elif equal is not None:
                direct = _direct_conv(x, w, equal)
            if direct:
                conv, flipped = equal, True
        elif direct_conv and len(stride) == 3:  # a Conv3d: the in-kernel conv's, by depth planes
            direct, depth = _direct_conv_3d(x, w, conv)
        elif direct_conv:  # a Conv1d as the 2-D conv of one row
            one_row = len(stride) == 1
            candidate = _conv_of_one_row(conv) if one_row else conv
            direct = _direct_conv(x, w, candidate, one_row=one_row)
            if direct and one_row:
                conv, as_2d = candidate, True
        return Anchor("conv", has_bias=b is not None, conv=conv, direct=direct, depth=depth,
                      implicit=bool(direct) and implicit_conv, flipped=flipped, as_2d=as_2d), operands
    return None


def linear_form(x: Node, wt: Node, bias: Node | None = None) -> tuple:
    """(in_features,) for a product x[M, K] @ wt[K, N] whose wt is a contiguous [N, K]
    transposed (a Linear's weight) and whose bias, if any, is [N]; else (). (`match_graph`
    adds the setting's every_call flag once the chain is known.) The in-kernel GEMM and
    the padded library GEMM (`Anchor.pad`) take this form only."""
    xv, wv = _val(x), _val(wt)
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or xv.dim() != 2 or wv.dim() != 2:
        return ()
    k, n = wv.shape
    if not isinstance(k, int) or not isinstance(n, int) or tuple(wv.stride()) != (1, k):
        return ()
    if bias is not None:
        bv = _val(bias)
        if not isinstance(bv, torch.Tensor) or tuple(bv.shape) != (n,):
            return ()
    return (int(k),)


def _conv_equal_to_transposed(w: Node, conv: tuple) -> tuple | None:
    """The parameters of the conv that equals a 2-D or 3-D ConvTranspose of stride 1 and
    groups 1 (`conv`, its parameters) on its weight transposed and flipped
    (`Anchor.flipped`): stride 1, padding dilation x (kernel - 1) - padding, the same
    dilation. None where the ConvTranspose is not such (a stride, groups, an output
    padding, a padding past the kernel's reach, or sizes unknown)."""
    stride, padding, dilation, _, out_pad, groups = conv
    wv = _val(w)
    if groups != 1 or not isinstance(wv, torch.Tensor) or wv.dim() not in (4, 5) or len(stride) != wv.dim() - 2:
        return None
    if any(s != 1 for s in stride) or any(o != 0 for o in out_pad):
        return None
    kernel = tuple(wv.shape[2:])
    if not all(isinstance(k, int) for k in kernel):
        return None
    reach = tuple(d * (k - 1) for d, k in zip(dilation, kernel))
    if any(p > r for p, r in zip(padding, reach)):
        return None
    return (tuple(stride), tuple(r - p for r, p in zip(reach, padding)), tuple(dilation), False,
            tuple(out_pad), 1)


def _conv_of_one_row(conv: tuple) -> tuple:
    """A Conv1d's parameters as the 2-D conv of one row's (`Anchor.as_2d`)."""
    stride, padding, dilation, transposed, out_pad, groups = conv
    return ((1, *stride), (0, *padding), (1, *dilation), transposed, (0, *out_pad), groups)


def _direct_conv(x: Node, w: Node, conv: tuple, one_row: bool = False) -> tuple:
    """(in_channels, kh, kw, in_h, in_w) for a 2-D conv of groups 1 that the file's own
    conv kernels may compute (`Anchor.direct`), else (); `one_row`: a Conv1d's x and
    weight, as the 2-D conv of one row (`Anchor.as_2d`)."""
    groups = conv[5]
    xv, wv = _val(x), _val(w)
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or groups != 1:
        return ()
    xs, ws = tuple(xv.shape), tuple(wv.shape)
    if one_row:
        if len(xs) != 3 or len(ws) != 3:
            return ()
        xs, ws = (*xs[:2], 1, xs[2]), (*ws[:2], 1, ws[2])
    if len(ws) != 4 or len(xs) != 4:
        return ()
    sizes = (xs[1], ws[2], ws[3], xs[2], xs[3])
    if not all(isinstance(s, int) for s in sizes):
        return ()
    return tuple(int(s) for s in sizes)


def _direct_conv_3d(x: Node, w: Node, conv: tuple) -> tuple[tuple, tuple]:
    """(`Anchor.direct`, `Anchor.depth`) of a 3-D conv of groups 1 and static sizes that
    the in-kernel conv may compute (by planes of the output's depth), else ((), ())."""
    xv, wv = _val(x), _val(w)
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor) or conv[5] != 1:
        return (), ()
    xs, ws = tuple(xv.shape), tuple(wv.shape)
    if len(xs) != 5 or len(ws) != 5:
        return (), ()
    sizes = (xs[1], ws[3], ws[4], xs[3], xs[4], ws[2], xs[2])
    if not all(isinstance(s, int) for s in sizes):
        return (), ()
    sizes = tuple(int(s) for s in sizes)
    return sizes[:5], sizes[5:]


def _fusion_name(anchor: Anchor, steps) -> str:
    family = anchor.kind if anchor.conv_view or anchor.permuted else "linear"
    kind = next((s.name for s in steps if s.name in NAMED_STEPS), "pointwise")
    return f"{family}_{kind}"


def _channels_last_permute(node: Node) -> Node | None:
    """The permute that moves a conv output's channels last (dims 0, 2, ..., n - 1, 1:
    ConvNeXt's and timm's LayerNorm2d's `y.permute(0, 2, 3, 1)`), where it is the output's
    only user; else None."""
    users = list(node.users)
    if len(users) != 1 or users[0].target is not aten.permute.default:
        return None
    ndim = _val(node).dim()
    dims = [d % ndim for d in users[0].args[1]]
    return users[0] if ndim >= 3 and dims == [0] + list(range(2, ndim)) + [1] else None


def _start(node: Node, anchor: Anchor, operands, allow_cpu: bool, permute: Node | None = None) -> _State:
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        raise Refuse("anchor has no example value")
    if val.dtype not in DTYPES:
        raise Refuse(f"dtype {val.dtype} is not fused (float32, float16, bfloat16 only)")
    if val.device.type != "cuda" and not allow_cpu:
        raise Refuse(f"tensors on {val.device.type}: fused kernels are CUDA-only (FUSEDEPI_CPU_REFERENCE=1 fuses "
                     "CPU chains through their plain-torch reference, to try the rewrite without a GPU)")
    if not _is_contiguous(val):
        raise Refuse("anchor output is not contiguous (channels_last input?)")
    conv = anchor.conv_view
    shape = list(val.shape)
    static = shape[1:]
    if not all(isinstance(s, int) for s in static):
        raise Refuse(f"feature/spatial sizes {static} are dynamic; only the batch size may vary")
    inner = 1
    for s in shape[2:]:
        inner *= s
    if permute is not None:  # the chain goes on from [N, *spatial, C], read as a Linear's rows
        chain = Chain(anchor=node, operands=operands, nodes=[node, permute], view=permute)
        return _State(node=permute, chain=chain, channels=shape[1], inner=1, conv=False,
                      channel_axis=len(shape) - 1, dtype=val.dtype, permuted=True)
    chain = Chain(anchor=node, operands=operands, nodes=[node])
    return _State(node=node, chain=chain, channels=shape[1], inner=inner, conv=conv, dtype=val.dtype)


def folds_gemm_bias(dtype: torch.dtype, matmul_tf32: bool) -> bool:
    """Whether a GEMM's bias moves into the epilogue (the anchor becomes `mm`): float32
    chains under TF32 only (`_fold_bias` says why)."""
    return dtype == torch.float32 and matmul_tf32


def _keeps_folded_bias(state: _State) -> bool:
    """Whether a chain matched with its anchor's bias moved into the epilogue
    (`_fold_bias`) may keep it so: where only the chain's own steps read the anchor's
    value (an EARLIER operand, `y + f(y)`, reads it inside the kernel, after the bias
    step). Where the graph uses that value too (saved for backward), the library adds
    the bias and the chain is matched again: that value is then the library's own
    output, rounded once as in eager (a folded bias would round the product, then the
    sum, and a backward that branches on its sign, as leaky_relu's does, would see it).
    """
    inside = set(state.chain.nodes)
    return not [user for user in state.chain.anchor.users if user not in inside]


def _fold_bias(state: _State, anchor: Anchor, gemm_bias: bool) -> Anchor | None:
    """Moves the anchor's bias into the epilogue as its first step, where that is faster.

    Returns the anchor without its bias, or None when it keeps it. Measured on an
    H200: cuDNN adds a conv bias in a pass
    of its own over the output, so a conv bias always moves; cuBLAS's `mm` beats
    `addmm` by 7-8% for float32 under TF32 but not in bf16 or strict float32, where
    the extra epilogue load costs more than it saves, so a GEMM bias moves only for
    float32 chains when `gemm_bias` (TF32 allowed) is set, where the product is float32
    before the bias either way. A conv bias is added to the conv's output rounded to its
    dtype, as CUDA eager adds it after cuDNN's conv (CPU eager, oneDNN, adds it before
    rounding: a 16-bit conv whose bias cancels its product can differ there, see
    tests/fuzzer.py `_library_bias_error`). A baddbmm's input and alpha stay in its
    library call (`Anchor.has_bias`, `alpha`), which rounds once as eager does.
    """
    chain = state.chain
    if anchor.kind == "addmm" and folds_gemm_bias(_val(chain.anchor).dtype, gemm_bias):
        try:  # broadcast like any operand: [N] and [1, N] per column, [M, N] in full
            kind = _operand_kind(state, chain.operands[0])
        except Refuse:
            return None
        if kind == BROADCAST:  # ([M, 1]: the library adds it)
            return None
        bias = chain.operands.pop(0)
        folded = replace(anchor, kind="mm")
    elif anchor.kind == "conv" and anchor.has_bias:
        kind = CHANNEL  # a conv bias is [C], applied along dim 1
        bias = chain.operands.pop()
        folded = replace(anchor, has_bias=False)
    else:
        return None
    chain.steps.append(_tensor_operand_step(state, "add", bias, kind, reverse=True))
    return folded


def _extend(state: _State, disabled: frozenset) -> str:
    """Grows the chain until it cannot; returns why it stopped.

    A step that refuses ends the chain before it; the steps before it still fuse.
    """
    while True:
        n_params, n_saved = len(state.chain.params), len(state.chain.saved)
        try:
            stop = _extend_once(state, disabled)
        except Refuse as err:
            stop = str(err)
        if stop is not None:
            del state.chain.params[n_params:], state.chain.saved[n_saved:], state.chain.saves[n_saved:]
            if state.before_branch is not None:  # the chain ends before the branch
                _restore(state, state.before_branch)
                stop = f"{stop} (inside a branch, so the chain ends before it)"
            if state.widened_at is not None:  # the fused op returns the chain's dtype: cut back
                _restore(state, state.widened_at)
                stop = f"{stop} (while widened to float32, so the chain ends before the conversion)"
            return stop


def _snapshot(state: _State) -> tuple:
    c = state.chain
    return (len(c.steps), len(c.nodes), len(c.params), len(c.extra), len(c.saved), c.view, state.node,
            state.channel_axis, state.reduced, state.pooled, state.pixels, state.windows, state.regrouped, state.dtype)


def _restore(state: _State, snap: tuple):
    c = state.chain
    (n_steps, n_nodes, n_params, n_extra, n_saved, c.view, state.node, state.channel_axis, state.reduced,
     state.pooled, state.pixels, state.windows, state.regrouped, state.dtype) = snap
    del c.steps[n_steps:], c.nodes[n_nodes:], c.params[n_params:], c.extra[n_extra:]
    del c.saved[n_saved:], c.saves[n_saved:]
    state.widened_at = None
    state.route, state.before_branch = [], None


def _next_step(state: _State, users: list) -> _Match | str:
    """The step that continues the chain through one of `users` (multi-node forms
    first, then each user in graph order), or why none does."""
    n_params = len(state.chain.params)
    first_refusal = None
    for matchers, candidates in ((MULTI_NODE, users[:1]), (STEP_MATCHERS[len(MULTI_NODE):], users)):
        for user in candidates:
            for matcher in matchers:
                del state.chain.params[n_params:]
                try:
                    match = matcher(state, user)
                except Refuse as err:
                    first_refusal = first_refusal or str(err)
                    break
                if match is not None:
                    return match
    if first_refusal is not None:
        return first_refusal
    if len(users) == 1:
        if users[0].target in MATRIX_OPS:
            return f"{users[0].name} is the next matrix op ({_name(users[0])}), an anchor of its own"
        return f"{_name(users[0])} is not in the vocabulary"
    return f"none of the value's consumers ({', '.join(u.name for u in users)}) is in the vocabulary"


def _reads_for_backward(state: _State, user: Node, node: Node) -> bool:
    """Whether `user` reads `node` for backward only: a backward node (of a joint
    graph), forward work that computes only what backward needs (`state.not_steps`,
    `for_backward_only`), or an output the user does not see (a value saved for
    backward)."""
    return (user in state.backward or user in state.not_steps
            or (user.op == "output" and not _user_sees(user, node)))


def _backward_readers(state: _State, node: Node) -> list:
    """The users of `node` that read it for backward only (`_reads_for_backward`)."""
    return [u for u in node.users if _reads_for_backward(state, u, node)]


def _user_sees(output: Node, node: Node) -> bool:
    """Whether the graph's `output` node returns `node` as an output the user sees (as
    Inductor's compile_fx marks them); without the mark, taken as not seen (a joint
    graph's or a value saved for backward)."""
    visible = output.meta.get("user_visible_output_idxs")
    if visible is None:
        return False
    outs = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    visible = set(visible)
    return any(out is node for i, out in enumerate(outs) if i in visible)


def _save(state: _State, node: Node, what: str, per_row: int) -> str | None:
    """Makes the fused op return `node` too; returns why it cannot, or None."""
    if state.permuted:
        return (f"{node.name} is used elsewhere (in training, saved for backward), and a chain after a permute "
                "of the conv's channels returns its result only")
    val = _val(node)
    shape = list(val.shape)
    # Per row: the one dim that holds the batch (the first, or in a dynamic graph the one
    # symbolic size: InstanceNorm's statistics are [1, N * C, 1, 1]) is sized at run time.
    symbolic = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    if per_row and len(symbolic) > 1:
        return f"{node.name} is used elsewhere and its shape {shape} has more than one dynamic size"
    if val.dtype not in DTYPES:
        return f"{node.name} is used elsewhere and has dtype {val.dtype}"
    at = len(state.chain.steps) if what in ("value", "sigmoid") else 0
    batch_dim = symbolic[0] if symbolic else 0
    shape = [-1 if i == batch_dim else d for i, d in enumerate(shape)] if per_row else shape
    state.chain.saves.append(Save(what, DTYPES[val.dtype], tuple(shape), per_row, at))
    state.chain.saved.append(node)
    return None


def _used_before_pool(state: _State, users: list, consumed: list) -> str | None:
    """Why a pooling window cannot end the values before it, or None: the graph uses one
    of them besides the chain (in a training graph, saved for backward), and the pool
    kernel writes only the pooled values."""
    inside = set(state.chain.nodes) | set(consumed)
    used = [n for n in state.chain.saved if any(u not in inside for u in n.users)]
    if any(u not in consumed for u in users):
        used.append(state.node)
    if used:
        return (f"the graph also uses {used[0].name} (before the pool; in training, saved for backward), and the "
                "pool kernel writes only the pooled values")
    return None


def _values_per_row(state: _State) -> int:
    """Elements a row of the chain's current value holds."""
    if state.reduced:
        return 1
    if state.pixels:
        return state.inner
    if state.windows:  # a conv's channels pooled, or a Linear row's features
        return (state.channels if state.conv else 1) * state.windows
    return state.channels if state.pooled else state.channels * state.inner


def _share_saved_values(chain: Chain) -> None:
    """Returns a value saved under two shapes (a Linear's 2-D product and its 3-D view,
    both used by the backward) once: the later node becomes a view of the earlier output."""
    first: dict = {}
    keep = []
    for i, (node, save) in enumerate(zip(chain.saved, chain.saves)):
        key = (save.what, save.at, save.dtype)
        if save.what in ("value", "sigmoid") and save.per_row and key in first:
            chain.views_of_saved.append((node, chain.saved[first[key]], save.shape))
        else:
            first.setdefault(key, i)
            keep.append(i)
    chain.saved = [chain.saved[i] for i in keep]
    chain.saves = [chain.saves[i] for i in keep]


def _reduction_after(state: _State, step: Step) -> str | None:
    """Why `step`, a reduction, cannot follow the chain's reductions so far, or None.
    One reduction a chain, but a second after a norm (`REDUCTIONS_AFTER_A_NORM`) whose
    segments hold whole channels: a conv's GroupNorm of at most
    SECOND_REDUCTION_MAX_CHANNELS channels a group, its BatchNorm or InstanceNorm, a
    LayerNorm over whole channels, then a spatial reduction; a Linear's LayerNorm or
    BatchNorm1d, then a row reduction."""
    before = [s for s in state.chain.steps if s.name in REDUCTIONS]
    if not before:
        return None
    first = before[0]
    if len(before) > 1 or first.name not in NORMS_BEFORE_A_REDUCTION or step.name not in REDUCTIONS_AFTER_A_NORM:
        return (f"{step.name}: only one reduction per fused kernel, or a sum, mean, amax or amin after a "
                f"GroupNorm, LayerNorm or BatchNorm (here after {first.name})")
    if state.permuted:
        return f"{step.name} after {first.name} of a conv output with its channels moved last is not implemented"
    channels = 1  # channels of one norm segment
    if first.name == "groupnorm":
        if not state.conv:
            return f"{step.name} after a Linear's GroupNorm: the row spans {first.groups} of its groups"
        channels = state.channels // first.groups
    elif first.name == "layernorm" and first.normalized:
        segment = math.prod(first.normalized)
        if segment % state.inner:
            return (f"{step.name} after a LayerNorm over {list(first.normalized)}: its segments split a conv "
                    "output's channels")
        channels = segment // state.inner
    if channels > SECOND_REDUCTION_MAX_CHANNELS:
        return (f"{step.name} after {first.name} of {channels} channels a segment: the kernel reduces at most "
                f"{SECOND_REDUCTION_MAX_CHANNELS} channels of one segment apart")
    return None


def _extend_once(state: _State, disabled: frozenset) -> str | None:
    """Adds one step to the chain; returns why it cannot, or None."""
    users = list(state.node.users)
    if not users:
        return "value is unused"
    # (in graph order: a node's users are listed in the order their uses were made, which
    # a graph with a symbolic batch has otherwise than a static one: `norm(y) * y` lists
    # the conv's users as [mul, group_norm] there, and the multiply taken first would
    # branch through the GroupNorm, which a branch refuses, where the GroupNorm as a step
    # fuses)
    inside = sorted((u for u in _step_users(state, state.node) if u.op != "output"),
                    key=lambda u: state.order.get(u, 0))
    if not inside:
        return "end of the graph"
    if state.route:  # inside a branch: its next node
        inside = [state.route[0]]
    match = _next_step(state, inside)
    if isinstance(match, str):
        return match
    step = match.step
    if match.route:
        state.before_branch = state.before_branch or _snapshot(state)
        state.route = match.route + state.route[1:]  # (in a branch, its next node is `user`)
    elif state.route:
        if match.consumed != state.route[:len(match.consumed)] or step is None or match.dtype is not None \
                or step.name in REDUCTIONS:
            return (f"{_name(state.route[0])} in a branch: a branch holds only pointwise steps of the chain's "
                    "dtype, each its own node")
        del state.route[:len(match.consumed)]
    taken = next((n for n in match.consumed if n in state.claimed), None)
    if taken is not None:
        return f"{taken.name} belongs to another fused chain"
    if step is not None:
        if step.name in disabled:
            return f"step {step.name} disabled by FUSEDEPI_DISABLE"
        if step.name in REDUCTIONS:
            why = _reduction_after(state, step)
            if why is not None:
                return why
        if state.regrouped and step.name in ROW_REDUCTIONS + SPATIAL_REDUCTIONS + CHANNEL_REDUCTIONS + POOLS \
                and not (step.name in SPATIAL_REDUCTIONS and not step.keepdim and _flattened(state)):
            return (f"{step.name} after a view to {list(_val(state.node).shape)}: after a view that regroups a "
                    "conv or bmm output only steps that keep its shape follow, or a reduction over the "
                    "flattened spatial dims without keepdim")
        if state.reduced and step.operand in (CHANNEL, FULL):
            return f"{step.name}: per-channel or full operand after a row reduction"
        if state.windows and not state.conv and step.operand == CHANNEL:
            return f"{step.name}: a per-feature operand after pooling the features"
        _check_dtype(state, match.result)
    if step is not None and step.name in POOLS:
        why = _used_before_pool(state, users, match.consumed)
        if why is not None:
            return f"{step.name}: {why}"
    # (a user the chain took already, or a branch's node still to take, needs no save; nor
    # a value saved already, met again by a branch)
    if state.node not in state.chain.saved and any(
            u not in match.consumed and u not in state.chain.nodes and u not in state.route for u in users):
        why = _save(state, state.node, "value", _values_per_row(state))
        if why is not None:
            return why
    for what, node in match.stats.items():
        # Per (row, group) for GroupNorm, per row for LayerNorm, per channel for BatchNorm;
        # silu's sigmoid is element-wise.
        per_row = {"groupnorm": step.groups, "layernorm": step.groups or 1, "rmsnorm": 1, "silu": _values_per_row(state)}
        why = _save(state, node, what, per_row.get(step.name, 0))
        if why is not None:
            return why
    for node in match.inputs_kept:  # (the value before the step: saved before it is appended)
        why = _save(state, node, "value", _values_per_row(state))
        if why is not None:
            return why
    if match.dtype is not None:  # a conversion: no step, the value's dtype changes
        if match.dtype == torch.float32:
            state.widened_at = _snapshot(state)
        else:
            state.widened_at = None
        state.dtype = match.dtype
    elif step is None:  # a view: regroups rows, re-applied after the fused op
        state.chain.view = match.result
        val = _val(match.result)
        if state.conv and not state.reduced_any:
            state.regrouped = not _same_shape(val.shape, _val(state.chain.anchor).shape)
            state.channel_axis = _channel_axis(val, state.channels, state.inner) if state.regrouped else 1
        else:  # a reduced conv value keeps its channels (if any) at dim 1
            state.channel_axis = 1 if state.conv else val.dim() - 1
    else:
        state.chain.steps.append(step)
        state.chain.extra.extend(match.extra)
        state.reduced = state.reduced or step.name in ROW_REDUCTIONS
        if step.name in ROW_REDUCTIONS and state.chain.view is not None:  # an N-D Linear's [rows] viewed back
            state.chain.view = match.result
        state.pooled = state.pooled or step.name in SPATIAL_REDUCTIONS
        if state.regrouped and step.name in SPATIAL_REDUCTIONS:  # [N, C]: the fused op's own output
            state.chain.view, state.regrouped, state.channel_axis = None, False, 1
        state.pixels = state.pixels or step.name in CHANNEL_REDUCTIONS
        if step.name in POOLS:
            state.windows = math.prod(step.window[1])
    state.chain.nodes.extend(match.consumed)
    state.node = match.result
    if match.dtype is None:  # (a converted value is not the kernel's x)
        state.held[match.result] = len(state.chain.steps)
    if not state.route:  # a branch, if any, is whole
        state.before_branch = None
    return None


def _squeezed_batch_of_one(node) -> Node | None:
    """x where `node` is `x.squeeze(0)` of a 3-D x whose first dim is 1, else None."""
    if not isinstance(node, Node) or node.target not in _SQUEEZES or len(node.args) < 2:
        return None
    dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
    source = node.args[0]
    val = _val(source) if isinstance(source, Node) else None
    # A static 1 only: a symbolic size compared here would add a guard to the graph.
    if list(dims) != [0] or not isinstance(val, torch.Tensor) or val.dim() != 3 or not (
            isinstance(val.shape[0], int) and val.shape[0] == 1):
        return None
    return source


def restore_batch_one_bmm(graph: torch.fx.Graph) -> None:
    """Puts back the bmm of a batch of one that Inductor's joint-graph pass `bmm_to_mm`
    spells `mm(a.squeeze(0), b.squeeze(0)).unsqueeze(0)` on CUDA tensors, so that its
    chain matches as a bmm chain (the [1, M, N] product read as a Conv1d output) on the
    GPU as on the CPU. The same product, in place."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.unsqueeze.default or node.args[1:] != (0,):
            continue
        mm = node.args[0]
        if not isinstance(mm, Node) or mm.target is not aten.mm.default or len(mm.users) != 1:
            continue
        sources = [_squeezed_batch_of_one(arg) for arg in mm.args[:2]]
        if any(s is None for s in sources):
            continue
        with graph.inserting_before(node):
            bmm = graph.call_function(aten.bmm.default, tuple(sources))
        bmm.meta.update(node.meta)  # the [1, M, N] value, contiguous as bmm's
        node.replace_all_uses_with(bmm)
        squeezes = list(mm.args[:2])
        graph.erase_node(node)
        graph.erase_node(mm)
        for squeeze in dict.fromkeys(squeezes):
            if not squeeze.users:
                graph.erase_node(squeeze)


def for_backward_only(graph: torch.fx.Graph) -> frozenset:
    """The nodes of a training forward graph that only compute values saved for backward.

    The partitioner may move backward's work on forward values into the forward graph
    (mish's derivative from its input: a softplus, a tanh, x * sigmoid(x)); those nodes
    read chain values but are no step of the user's chain, and the walk must not take
    them for one (it took the derivative's x * sigmoid(x) for a SiLU and stopped the
    chain inside it). They are the nodes from which no output up to the last one the user
    sees is reached (Inductor's `user_visible_output_idxs`; the outputs before the user's
    are mutated inputs, forward effects too). Empty where the output carries no such
    mark, or marks none (a joint or an inference graph; outputs Inductor does not mark)."""
    output = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    visible = output.meta.get("user_visible_output_idxs") if output is not None else None
    if not visible:
        return frozenset()
    outs = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    stack = [n for n in outs[:max(visible) + 1] if isinstance(n, Node)]
    forward: set = set()
    while stack:
        node = stack.pop()
        if node not in forward:
            forward.add(node)
            stack.extend(node.all_input_nodes)
    return frozenset(n for n in graph.nodes if n.op == "call_function" and n not in forward and n.users)


def match_graph(graph: torch.fx.Graph, disabled=frozenset(), allow_cpu=False, matmul_tf32=False,
                backward=frozenset(), in_kernel_gemm="auto", in_kernel_conv=False):
    """Finds every fusible chain in `graph`.

    Args:
        graph: a post-AOTAutograd aten graph whose nodes carry meta["val"].
        disabled: fusion names, step names and anchor forms ("direct_conv") not to use.
        allow_cpu: also match chains on CPU tensors (their fused op then runs
            the plain-torch reference; used to test the rewrite without a GPU).
        matmul_tf32: float32 matmuls may use TF32 (`torch.get_float32_matmul_precision()`
            is not "highest"); decides whether a GEMM bias moves into the epilogue, and
            whether `auto` keeps a float32 chain for the in-kernel GEMM (which is TF32).
        backward: in a joint forward/backward graph, the backward's nodes: they use
            chain values (which are then saved) but never continue a chain. (In a
            training forward graph, the nodes that compute only values saved for
            backward, `for_backward_only`, never start a step either.)
        in_kernel_gemm: which Linear products to mark as candidates for the in-kernel
            GEMM (FUSEDEPI_IN_KERNEL_GEMM, see the README): "auto", those
            `auto_takes_gemm` keeps (measured faster or level there); "on", all; "off", none.
        in_kernel_conv: mark direct-conv candidates for the in-kernel conv as well
            (FUSEDEPI_IN_KERNEL_CONV=1; `Anchor.implicit`). Under "auto" the backend's
            table of forms marks them where the measured choice will time the chain
            (`fusion_backend.forms.conv_implicit`).

    Returns:
        (chains, refusals): chains to rewrite, and candidates that were refused. The
        graph's batch-one bmms are restored first, in place (`restore_batch_one_bmm`).
    """
    restore_batch_one_bmm(graph)
    not_steps = for_backward_only(graph)
    chains, refusals = [], []
    order = {n: i for i, n in enumerate(graph.nodes)}
    claimed: set = set()
    for node in list(graph.nodes):
        try:
            found = _match_anchor(node, direct_conv="direct_conv" not in disabled,
                                  direct_gemm=in_kernel_gemm != "off", implicit_conv=in_kernel_conv)
        except Refuse as err:
            refusals.append(Refusal(node.name, [node.name], str(err)))
            continue
        if found is None:
            continue
        anchor, operands = found
        permute = _channels_last_permute(node) if anchor.kind == "conv" and node not in backward else None
        if permute is not None:  # (a Conv1d as it is: no kernel of the file's computes a permuted conv)
            anchor = replace(anchor.as_1d(), permuted=True, direct=(), depth=(), implicit=False)
        try:
            # With the anchor's bias moved into the epilogue, then, where the graph reads
            # the anchor's value outside the chain (or the folded match was refused and it
            # has other readers), with the bias left to the library.
            for fold in (True, False):
                state = _start(node, anchor, list(operands), allow_cpu, permute)
                state.order, state.backward, state.claimed = order, backward, claimed
                state.not_steps = not_steps
                folded = _fold_bias(state, anchor, matmul_tf32) if fold else None
                moved = len(state.chain.steps)  # steps the anchor's bias became
                state.held[state.node] = moved
                try:
                    stop = _extend(state, disabled)
                except Refuse:
                    if folded is None or len(node.users) < 2:
                        raise
                    continue
                if folded is None or _keeps_folded_bias(state):
                    break
        except Refuse as err:
            refusals.append(Refusal(node.name, [node.name], str(err)))
            continue
        chain = state.chain
        chain.stop = stop
        names = [n.name for n in chain.nodes]
        if len(chain.steps) == moved:
            refusals.append(Refusal(node.name, names, f"no epilogue to fuse: {stop}"))
            continue
        if anchor.permuted and not _is_contiguous(_val(state.node)):
            refusals.append(Refusal(node.name, names, f"after a permute of the conv's channels the chain's value "
                                    f"{state.node.name} is not contiguous (the fused op returns contiguous rows); "
                                    f"it stops at: {stop}"))
            continue
        # A trailing view carries no step: re-applied after the fused op, it stays in the graph.
        chain.final = state.node
        # A saved value that is the result itself (the final node, the chain cut back to
        # it, or the result before a trailing view) is the fused op's first output.
        val = _val(chain.anchor)
        same = [
            i for i, (n, s) in enumerate(zip(chain.saved, chain.saves))
            if n is chain.final or (s.what == "value" and s.at == len(chain.steps) and _val(n).dtype == val.dtype
                                    and _val(n).dim() == val.dim() and list(_val(n).shape[1:]) == list(val.shape[1:]))
        ]
        # A value saved because a later step of the chain reads it (an EARLIER operand) and
        # nothing else: the kernel holds it, the fused op need not return it.
        inside = set(chain.nodes)
        held_only = {i for i, (n, s) in enumerate(zip(chain.saved, chain.saves))
                     if s.what == "value" and all(u in inside for u in n.users)}
        chain.same_as_result = [chain.saved[i] for i in same if chain.saved[i] is not chain.final and i not in held_only]
        same = set(same) | held_only
        chain.saved = [n for i, n in enumerate(chain.saved) if i not in same]
        chain.saves = [s for i, s in enumerate(chain.saves) if i not in same]
        _share_saved_values(chain)
        fusion = _fusion_name(anchor, chain.steps)
        if fusion in disabled:
            refusals.append(Refusal(node.name, names, f"fusion {fusion} disabled by FUSEDEPI_DISABLE"))
            continue
        anchor = folded or anchor
        if anchor.gemm:
            auto = in_kernel_gemm == "auto"
            keep = not auto or auto_takes_gemm(chain.steps, val.dtype, matmul_tf32)
            anchor = replace(anchor, gemm=(anchor.gemm[0], 0 if auto else 1) if keep else ())
        chain.spec = EpilogueSpec(
            anchor=anchor,
            steps=tuple(chain.steps),
            dtype=DTYPES[val.dtype],
            param_dtypes=tuple(DTYPES.get(_val(p).dtype, str(_val(p).dtype)) for p in chain.params),
            channels=state.channels,
            inner=state.inner,
            fusion=fusion,
            saves=tuple(chain.saves),
        )
        if anchor.implicit:  # FUSEDEPI_IN_KERNEL_CONV=1: in float32 on operands rounded to TF32
            chain.spec = chain.spec.with_in_kernel_conv()
        chains.append(chain)
        claimed.update(chain.nodes)
    return _drop_cycles(chains, refusals, list(order)), refusals


def _drop_cycles(chains: list, refusals: list, nodes: list) -> list:
    """Drops chains until no two depend on each other's values through their inputs
    (two matmuls whose chains meet: each fused op would wait for the other's output).
    The later chain of a cycle goes first. One pass over the graph per round: each
    node gets the set (a bit mask) of chains whose nodes it is or is computed from."""
    while True:
        owner = {n: 1 << i for i, c in enumerate(chains) for n in c.nodes}
        reach: dict = {}
        for node in nodes:
            mask = owner.get(node, 0)
            for source in node.all_input_nodes:
                mask |= reach.get(source, 0)
            reach[node] = mask
        deps = []
        for i, c in enumerate(chains):
            mask = 0
            for source in list(c.operands) + list(c.params):
                mask |= reach.get(source, 0)
            deps.append({j for j in range(len(chains)) if j != i and mask >> j & 1})
        cyclic = [i for i in range(len(chains)) if _reaches(deps, i, i)]
        if not cyclic:
            return chains
        c = chains.pop(max(cyclic))  # chains are in graph order: the later one
        refusals.append(Refusal(c.anchor.name, [n.name for n in c.nodes],
                                "its inputs and another fused chain's depend on each other's values"))


def _reaches(deps: list, start: int, goal: int) -> bool:
    seen, stack = set(), list(deps[start])
    while stack:
        top = stack.pop()
        if top == goal:
            return True
        if top not in seen:
            seen.add(top)
            stack.extend(deps[top])
    return False
