"""Device code for each vocabulary step: one C++ statement that updates `x`.

Keys match `lowering.vocabulary.VOCABULARY`. A snippet sees `x` (float), `c`
(channel index), `e` (flat element index) and `a` (the kernel's Args); operand
expressions come from `Operands`. Reductions (groupnorm, layernorm, logsumexp,
batchnorm_train statistics) are written by the templates; their entries here give
the per-element normalize statement.
"""

from __future__ import annotations

import math

from lowering.spec import CHANNEL, FULL, ONE, SCALAR, SELF, Step


def cfloat(value: float) -> str:
    """A C++ float constant equal to torch's double -> float conversion of `value`."""
    value = float(value)
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return f"static_cast<float>({value.hex()})"


class Operands:
    """Renders loads of the fused op's tensor inputs (fields p0, p1, ... of Args)."""

    def param(self, index: int, kind: str = CHANNEL, default: str = "1.f") -> str:
        if index < 0:
            return default
        where = {CHANNEL: "c", ONE: "0", FULL: "e"}[kind]
        return f"fusedepi::to_float(a.p{index}[{where}])"

    def operand(self, step: Step) -> str:
        if step.operand == SCALAR:
            return cfloat(step.consts[0])
        if step.operand == SELF:
            return "x"
        return self.param(step.inputs[0], step.operand)


def _call(fn):
    return lambda step, ops: f"x = {fn}(x);"


def _binary(symbol):
    def render(step: Step, ops: Operands) -> str:
        other = ops.operand(step)
        return f"x = {other} {symbol} x;" if step.reverse else f"x = x {symbol} {other};"

    return render


def _affine_norm(step: Step, ops: Operands) -> str:
    """Normalize with `mean` and `rstd` in scope (group or layer statistics)."""
    w = ops.param(step.inputs[0], CHANNEL, "1.f")
    b = ops.param(step.inputs[1], CHANNEL, "0.f")
    return f"x = (x - mean) * rstd * {w} + {b};"


def _batchnorm_eval(step: Step, ops: Operands) -> str:
    w = ops.param(step.inputs[0], CHANNEL, "1.f")
    b = ops.param(step.inputs[1], CHANNEL, "0.f")
    rm, rv = ops.param(step.inputs[2]), ops.param(step.inputs[3])
    return f"x = (x - {rm}) * (1.f / sqrtf({rv} + {cfloat(step.consts[0])})) * {w} + {b};"


def _batchnorm_train(step: Step, ops: Operands) -> str:
    """Normalize with the batch statistics the column kernels left in the workspace."""
    w = ops.param(step.inputs[0], CHANNEL, "1.f")
    b = ops.param(step.inputs[1], CHANNEL, "0.f")
    return f"x = (x - a.ws[c]) * a.ws[kChannels + c] * {w} + {b};"


SNIPPETS = {
    "relu": _call("fusedepi::relu"),
    "gelu": _call("fusedepi::gelu"),
    "gelu_tanh": _call("fusedepi::gelu_tanh"),
    "leaky_relu": lambda s, ops: f"x = fusedepi::leaky_relu(x, {cfloat(s.consts[0])});",
    "silu": _call("fusedepi::silu"),
    "sigmoid": _call("fusedepi::sigmoid"),
    "tanh": _call("tanhf"),
    "add": _binary("+"),
    "sub": _binary("-"),
    "mul": _binary("*"),
    "div": _binary("/"),
    "groupnorm": _affine_norm,
    "layernorm": _affine_norm,
    "batchnorm_eval": _batchnorm_eval,
    "batchnorm_train": _batchnorm_train,
    "logsumexp": lambda s, ops: "",
}


def render_steps(steps, indent: str = "  ") -> str:
    """The statements for a run of pointwise steps, one per line."""
    ops = Operands()
    lines = [f"{indent}{SNIPPETS[s.name](s, ops)}  // {s.name}" for s in steps]
    return "\n".join(lines)
