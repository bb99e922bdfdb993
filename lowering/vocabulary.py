"""The epilogue vocabulary: every step the project can fuse, with its plain-torch reference.

One entry per step name. The matcher (`lowering/matcher.py`) turns aten nodes into
these names; `cuda_templates/snippets.py` holds the device code for the same names
(a test keeps the two tables in step). The references define what a fused op must
compute, and are what the op runs on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from .spec import BROADCAST, CHANNEL, EARLIER, FULL, ONE, SCALAR, SELF, Step, broadcast_index


class Refuse(Exception):
    """A step (or anchor) that exists but cannot be fused exactly; the message says why."""


# Reads argument (index, name, default) of the graph node being matched.
ArgReader = Callable[[int, str, object], object]


@dataclass(frozen=True)
class StepKind:
    """One vocabulary entry.

    Attributes:
        name: the step name used in specs, kernels and `FUSEDEPI_DISABLE`.
        reference: computes the step in plain torch:
            (x, step, params) -> x, where params are the op's tensors after the
            anchor operands. Steps with extra outputs return (x, [extra, ...]).
        forms: for one-node pointwise steps, the aten ops that read as this step
            (the chain's value is argument 0), each with a function that builds the
            Step from the node's arguments (raising Refuse where it cannot be exact).
            Multi-node forms, binary steps, norms and reductions need the graph
            around them and are matched in `matcher.py`.
        statistics: for a norm whose statistics backward may keep, computes them:
            (x, step, params) -> (mean, rstd).
        holds: aten ops (packets) the matcher reads as this step besides `forms`,
            whose Inductor decompositions must wait until after matching
            (`held_back_ops`).
        cheap: a few float32 operations an element (no transcendental function, no
            division, at most per-column loads): the steps a GroupNorm chain may hold
            inside the in-kernel GEMM (`cuda_templates.gemm_sm90`).
    """

    name: str
    reference: Callable
    forms: tuple = ()
    statistics: Callable | None = None
    holds: tuple = ()
    cheap: bool = False


def _param(params, index):
    return None if index < 0 else params[index]


def _operand(x, step: Step, params):
    if step.operand == SCALAR:
        return step.consts[0]
    if step.operand == SELF:
        return x
    t = params[step.inputs[0]]
    if step.operand == FULL:
        # The chain may have passed through views (3-D linear); the fused op
        # works on the 2-D anchor output, so residuals are read flat.
        return t.reshape(x.shape)
    if step.operand == BROADCAST:  # element e of x reads the operand's broadcast_index(e)
        e = torch.arange(x.numel(), device=x.device)
        return t.reshape(-1)[broadcast_index(step.consts, e)].reshape(x.shape)
    if step.operand == CHANNEL:
        # Per-channel operands broadcast on the channel axis (dim 1), whatever their
        # own shape ([C], [C, 1, 1], ...): a folded conv bias is [C].
        return t.reshape([1, -1] + [1] * (x.dim() - 2))
    assert step.operand == ONE
    # Of x's dims at most: a [1, 1, 1] operand of a 3-D Linear's chain must not add a dim
    # to the 2-D x (0-dim stays 0-dim: eager's type promotion tells the two apart).
    return t if t.dim() <= x.dim() else t.reshape([1] * x.dim())


def _binary(fn):
    def ref(x, step, params):
        other = _operand(x, step, params)
        return fn(other, x) if step.reverse else fn(x, other)

    return ref


def _extremum(fn):
    """torch.maximum / torch.minimum, whose operand is always a tensor: a number (a 0-dim
    CPU tensor the matcher read, `matcher._cpu_scalar_constant`) becomes a 0-dim tensor
    of x's dtype, as ATen's kernel reads the scalar in x's dtype."""

    def ref(x, step, params):
        other = _operand(x, step, params)
        if not isinstance(other, torch.Tensor):
            other = torch.full((), other, dtype=x.dtype, device=x.device)
        return fn(other, x) if step.reverse else fn(x, other)

    return ref


def _batchnorm_train(x, step, params):
    w, b, rm, rv = (_param(params, i) for i in step.inputs)
    momentum, eps = step.consts
    new_rm, new_rv = rm.clone(), rv.clone()
    out = F.batch_norm(x, new_rm, new_rv, w, b, training=True, momentum=momentum, eps=eps)
    return out, [new_rm, new_rv]


def _batchnorm_statistics(x, step, params):
    w, b, rm, rv = (_param(params, i) for i in step.inputs)
    out = torch.ops.aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, *step.consts)
    return out[1], out[2]


def _group_norm_statistics(x, step, params):
    inner = math.prod(x.shape[2:])
    w, b = (_param(params, i) for i in step.inputs)
    out = torch.ops.aten.native_group_norm(x, w, b, x.shape[0], x.shape[1], inner, step.groups, step.consts[0])
    return out[1], out[2]


def _layer_norm_statistics(x, step, params):
    w, b = (_param(params, i) for i in step.inputs)
    out = torch.ops.aten.native_layer_norm(x, list(step.normalized or x.shape[-1:]), w, b, step.consts[0])
    return out[1], out[2]


def _rmsnorm_statistics(x, step, params):
    xf = x.float()
    return None, torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + step.consts[0])


def _rmsnorm(x, step, params):
    # The form nn.RMSNorm / F.rms_norm decompose to (weight, if any, is a `mul` step
    # after), in float32 as they compute it for bf16/fp16 inputs.
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + step.consts[0])).to(x.dtype)


def _l2normalize(x, step, params):
    # F.normalize(p=2) over the features: the norm in x's dtype (rounded once, as
    # linalg_vector_norm's kernel returns it), clamped to eps, then the division.
    norm = torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True)
    return x / torch.clamp(norm, min=step.consts[0])


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refuse(f"{what} {value!r} is not a constant number")
    return float(value)


def _gelu_form(arg: ArgReader) -> Step:
    approximate = arg(1, "approximate", "none")
    name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    if name is None:
        raise Refuse(f"gelu: unknown approximate={approximate!r}")
    return Step(name)


def _clamp_form(names: tuple, defaults: tuple):
    """clamp(x, min, max), hardtanh(x, min_val, max_val): a bound that is None is infinite."""

    def build(arg: ArgReader) -> Step:
        lo = arg(1, names[0], defaults[0])
        hi = arg(2, names[1], defaults[1])
        lo = -math.inf if lo is None else _number(lo, "clamp: min")
        hi = math.inf if hi is None else _number(hi, "clamp: max")
        return Step("clamp", consts=(lo, hi))

    return build


def _one_bound(which: str):
    def build(arg: ArgReader) -> Step:
        bound = _number(arg(1, which, None), f"clamp_{which}")
        return Step("clamp", consts=(bound, math.inf) if which == "min" else (-math.inf, bound))

    return build


def _plain(name: str, fn: Callable, op, cheap: bool = False) -> StepKind:
    """A step without constants: torch's `fn` of x, read from the aten op `op`."""
    return StepKind(name, lambda x, s, p: fn(x), ((op, lambda arg: Step(name)),), cheap=cheap)


def _elu_consts(x_alpha, x_scale, x_input_scale) -> tuple:
    return tuple(_number(v, "elu: parameter") for v in (x_alpha, x_scale, x_input_scale))


def _elu(x, step, params):
    alpha, scale, input_scale = step.consts
    return torch.ops.aten.elu(x, alpha, scale, input_scale)


def _spatial(x: torch.Tensor) -> tuple:
    """The spatial dims of a conv output [rows, C, *spatial]."""
    return tuple(range(2, x.dim()))


def _pool(x, step, params):
    """MaxPool / AvgPool over the spatial dims of x [rows, C, *spatial], as the graph computes
    it: a 1-D window as the 2-D op over a unit dim (PyTorch's own 1-D pools take that path).
    A Linear output [rows, N] is pooled over its features as [rows, 1, N]."""
    if x.dim() == 2:
        out = _pool(x.unsqueeze(1), replace(step, keepdim=False), params)
        return out if step.keepdim else out.squeeze(1)
    _, _, kernel, stride, padding, dilation = step.window
    nd = len(kernel)
    one = nd == 1
    if one:
        x = x.unsqueeze(-2)
        kernel, stride, padding, dilation = ((1,) + tuple(kernel), (1,) + tuple(stride), (0,) + tuple(padding),
                                             (1,) + tuple(dilation))
    dims = len(kernel)
    if step.name == "maxpool":
        op = F.max_pool2d if dims == 2 else F.max_pool3d
        out = op(x, kernel, stride, padding, dilation, ceil_mode=bool(step.consts[0]))
    else:
        ceil_mode, count_include_pad, divisor = step.consts
        op = F.avg_pool2d if dims == 2 else F.avg_pool3d
        out = op(x, kernel, stride, padding, ceil_mode=bool(ceil_mode), count_include_pad=bool(count_include_pad),
                 divisor_override=int(divisor) or None)
    return out.squeeze(-2) if one else out


aten = torch.ops.aten

VOCABULARY: dict[str, StepKind] = {
    kind.name: kind
    for kind in [
        # ------------------------------------------------------------ pointwise
        _plain("relu", torch.relu, aten.relu.default, cheap=True),
        StepKind("gelu", lambda x, s, p: F.gelu(x), ((aten.gelu.default, _gelu_form),)),
        StepKind("gelu_tanh", lambda x, s, p: F.gelu(x, approximate="tanh")),  # a form of gelu
        StepKind(
            "leaky_relu",
            lambda x, s, p: F.leaky_relu(x, s.consts[0]),
            ((aten.leaky_relu.default,
              lambda arg: Step("leaky_relu", consts=(_number(arg(1, "negative_slope", 0.01), "leaky_relu: slope"),))),),
            cheap=True,
        ),
        _plain("silu", F.silu, aten.silu.default),  # and x * sigmoid(x)
        _plain("sigmoid", torch.sigmoid, aten.sigmoid.default),
        _plain("tanh", torch.tanh, aten.tanh.default),
        _plain("mish", F.mish, aten.mish.default),
        _plain("hardswish", F.hardswish, aten.hardswish.default),
        _plain("hardsigmoid", F.hardsigmoid, aten.hardsigmoid.default),
        StepKind(
            "clamp",  # also hardtanh, relu6, clamp_min/clamp_max (min/max against a scalar)
            lambda x, s, p: torch.clamp(x, s.consts[0], s.consts[1]),
            (
                (aten.clamp.default, _clamp_form(("min", "max"), (None, None))),
                (aten.hardtanh.default, _clamp_form(("min_val", "max_val"), (-1.0, 1.0))),
                (aten.clamp_min.default, _one_bound("min")),
                (aten.clamp_max.default, _one_bound("max")),
            ),
            cheap=True,
        ),
        StepKind(
            "elu",  # also selu (its constants) and celu (input_scale = 1 / alpha)
            _elu,
            (
                (aten.elu.default, lambda arg: Step("elu", consts=_elu_consts(
                    arg(1, "alpha", 1.0), arg(2, "scale", 1.0), arg(3, "input_scale", 1.0)))),
                (aten.celu.default, lambda arg: Step("elu", consts=_elu_consts(
                    arg(1, "alpha", 1.0), 1.0, 1.0 / _number(arg(1, "alpha", 1.0), "celu: alpha")))),
            ),
        ),
        StepKind(
            "softplus",
            lambda x, s, p: F.softplus(x, s.consts[0], s.consts[1]),
            ((aten.softplus.default, lambda arg: Step("softplus", consts=(
                _number(arg(1, "beta", 1.0), "softplus: beta"), _number(arg(2, "threshold", 20.0), "softplus: threshold")))),),
        ),
        _plain("abs", torch.abs, aten.abs.default, cheap=True),
        _plain("exp", torch.exp, aten.exp.default),
        _plain("log", torch.log, aten.log.default),
        _plain("neg", torch.neg, aten.neg.default, cheap=True),
        _plain("erf", torch.erf, aten.erf.default),
        _plain("log1p", torch.log1p, aten.log1p.default),
        _plain("expm1", torch.expm1, aten.expm1.default),
        _plain("sin", torch.sin, aten.sin.default),
        _plain("cos", torch.cos, aten.cos.default),
        _plain("sqrt", torch.sqrt, aten.sqrt.default),
        _plain("rsqrt", torch.rsqrt, aten.rsqrt.default),
        _plain("reciprocal", torch.reciprocal, aten.reciprocal.default),
        StepKind(
            "pow",  # x ** c for a constant c (also torch.square: c = 2)
            lambda x, s, p: torch.pow(x, s.consts[0]),
            ((aten.pow.Tensor_Scalar, lambda arg: Step("pow", consts=(_number(arg(1, "exponent", None), "pow: exponent"),))),),
        ),
        # --------------------------------- binary: operand kinds in spec.py, matched in matcher.py
        StepKind("add", _binary(torch.add), cheap=True),
        StepKind("sub", _binary(torch.sub), cheap=True),
        StepKind("mul", _binary(torch.mul), cheap=True),
        StepKind("div", _binary(torch.div)),
        # where(x > 0, x, w * x): nn.PReLU / F.prelu's form (w one slope or one a channel;
        # a number is leaky_relu), matched in matcher.py
        StepKind("prelu", _binary(lambda x, w: torch.where(x > 0, x, w * x)), cheap=True),
        StepKind("maximum", _extremum(torch.maximum), cheap=True),
        StepKind("minimum", _extremum(torch.minimum), cheap=True),
        # The chain goes on from an earlier value of its own (operand EARLIER, consts (k,)),
        # the current value held for a later binary step: `f(x) * g(x)` runs as f, then
        # branch back to x, g, then `*` with the value f left (matched in matcher.py).
        StepKind("branch", lambda x, s, p: _operand(x, s, p), cheap=True),
        # ---------------------------------------------------------- normalizations
        StepKind(
            "groupnorm",
            lambda x, s, p: F.group_norm(
                x, s.groups, _param(p, s.inputs[0]), _param(p, s.inputs[1]), s.consts[0]
            ),
            statistics=_group_norm_statistics,
            holds=(aten.native_group_norm,),
            cheap=True,  # its statistics come from the accumulators (`gemm_sm90`)
        ),
        StepKind(
            "layernorm",
            lambda x, s, p: F.layer_norm(  # over the features, or a conv output's trailing dims
                x, tuple(s.normalized or x.shape[-1:]), _param(p, s.inputs[0]), _param(p, s.inputs[1]), s.consts[0]
            ),
            statistics=_layer_norm_statistics,
            holds=(aten.native_layer_norm,),
        ),
        StepKind("rmsnorm", _rmsnorm, statistics=_rmsnorm_statistics),
        StepKind("l2normalize", _l2normalize, holds=(aten.linalg_vector_norm,)),
        StepKind(
            "batchnorm_eval",
            lambda x, s, p: F.batch_norm(
                x,
                _param(p, s.inputs[2]),
                _param(p, s.inputs[3]),
                _param(p, s.inputs[0]),
                _param(p, s.inputs[1]),
                training=False,
                eps=s.consts[0],
            ),
            holds=(aten._native_batch_norm_legit_no_training,),
        ),
        StepKind("batchnorm_train", _batchnorm_train, statistics=_batchnorm_statistics,
                 holds=(aten._native_batch_norm_legit_functional,)),
        StepKind("softmax", lambda x, s, p: torch.softmax(x, dim=-1), holds=(aten._softmax,)),
        StepKind("log_softmax", lambda x, s, p: torch.log_softmax(x, dim=-1), holds=(aten._log_softmax,)),
        # ----------------------------------------- row reductions (feature dim of 2-D)
        StepKind("logsumexp", lambda x, s, p: torch.logsumexp(x, dim=1, keepdim=s.keepdim), holds=(aten.logsumexp,)),
        StepKind("sum", lambda x, s, p: torch.sum(x, dim=1, keepdim=s.keepdim)),
        StepKind("mean", lambda x, s, p: torch.mean(x, dim=1, keepdim=s.keepdim)),
        StepKind("amax", lambda x, s, p: torch.amax(x, dim=1, keepdim=s.keepdim), holds=(aten.amax,)),
        StepKind("amin", lambda x, s, p: torch.amin(x, dim=1, keepdim=s.keepdim), holds=(aten.amin,)),
        # --------------------- spatial reductions (every dim after a conv output's channels)
        StepKind("spatial_sum", lambda x, s, p: torch.sum(x, dim=_spatial(x), keepdim=s.keepdim)),
        StepKind("spatial_mean", lambda x, s, p: torch.mean(x, dim=_spatial(x), keepdim=s.keepdim)),
        StepKind("spatial_amax", lambda x, s, p: torch.amax(x, dim=_spatial(x), keepdim=s.keepdim)),
        StepKind("spatial_amin", lambda x, s, p: torch.amin(x, dim=_spatial(x), keepdim=s.keepdim)),
        # ------------------- softmax over each (row, channel) plane of a conv or bmm output
        StepKind("spatial_softmax", lambda x, s, p: torch.softmax(x.flatten(2), dim=-1).view_as(x)),
        StepKind("spatial_log_softmax", lambda x, s, p: torch.log_softmax(x.flatten(2), dim=-1).view_as(x)),
        # -------------------------- over a conv output's channels (dim 1), per pixel
        StepKind("channel_softmax", lambda x, s, p: torch.softmax(x, dim=1)),
        StepKind("channel_log_softmax", lambda x, s, p: torch.log_softmax(x, dim=1)),
        StepKind("channel_logsumexp", lambda x, s, p: torch.logsumexp(x, dim=1, keepdim=s.keepdim)),
        StepKind("channel_sum", lambda x, s, p: torch.sum(x, dim=1, keepdim=s.keepdim)),
        StepKind("channel_mean", lambda x, s, p: torch.mean(x, dim=1, keepdim=s.keepdim)),
        StepKind("channel_amax", lambda x, s, p: torch.amax(x, dim=1, keepdim=s.keepdim)),
        StepKind("channel_amin", lambda x, s, p: torch.amin(x, dim=1, keepdim=s.keepdim)),
        # ------------------------ pooling windows over a conv output's spatial dims
        StepKind("maxpool", _pool, holds=(aten.max_pool2d_with_indices, aten.max_pool3d_with_indices)),
        StepKind("avgpool", _pool),
    ]
}

# aten op -> the builder of its Step, from every entry's `forms`.
POINTWISE_FORMS: dict = {op: build for kind in VOCABULARY.values() for op, build in kind.forms}

# Anchor ops whose decompositions wait until after matching (the matcher reads a
# Linear's bias from `addmm`).
ANCHOR_HOLDS = (aten.addmm,)


def held_back_ops() -> tuple:
    """Every aten op (packet) the matcher must see whole: the anchors', and each step's
    `forms` and `holds`, in table order. The backend takes Inductor's decompositions of
    these out of its table until the rewrite is done (`fusion_backend.backend`)."""
    packets = list(ANCHOR_HOLDS)
    for kind in VOCABULARY.values():
        for op in [op.overloadpacket for op, _ in kind.forms] + list(kind.holds):
            if op not in packets:
                packets.append(op)
    return tuple(packets)


def run_reference(x: torch.Tensor, steps, params, saves=()) -> list[torch.Tensor]:
    """Applies `steps` to the anchor output `x` in plain torch.

    Args:
        saves: `Save`s: intermediates to return as well.

    Returns:
        [out, *BatchNorm's new running stats, *saves].
    """
    rows = x.shape[0]
    extras: list[torch.Tensor] = []
    values, stats = [x], {}
    for step in steps:
        kind = VOCABULARY[step.name]
        if step.operand == EARLIER:  # the held value, read as a full operand of x's shape
            held = values[int(step.consts[0])]
            step = replace(step, operand=FULL, inputs=(len(params),), consts=())
            params = list(params) + [held]
        if kind.statistics is not None and any(s.what in ("mean", "rstd") for s in saves):
            stats["mean"], stats["rstd"] = kind.statistics(x, step, params)
        result = kind.reference(x, step, params)
        if isinstance(result, tuple):
            x, more = result
            extras.extend(more)
        else:
            x = result
        values.append(x)
    saved = []
    # The outputs never share memory (the op's contract): a value returned twice (saved
    # under two shapes, or equal to the result) is copied.
    returned = {id(x)} | {id(t) for t in extras}
    for s in saves:
        if s.what == "value":
            t = values[s.at]
        elif s.what == "sigmoid":
            t = torch.sigmoid(values[s.at])
        else:
            t = stats[s.what]
        # A value saved while widened to float32 (RMSNorm's decomposition) is float32.
        out = t.to(getattr(torch, s.dtype))
        if out is t and id(t) in returned:
            out = t.clone()
        returned.add(id(t))
        saved.append(out.reshape(s.sized(rows)))
    return [x] + extras + saved
