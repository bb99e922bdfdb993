"""Device code for each vocabulary step: one C++ statement that updates `x`.

Keys match `lowering.vocabulary.VOCABULARY` (a test keeps the two in step). A
snippet runs once per element `j` of a W-wide vector; tensor operands come from
`Operands`, which turns each into a register array loaded once per vector before
the element loop. Channel indices `c[W]` come from the vector's position in its
row; `e0` (its flat index) is only used by residual loads. Reductions (group/layer
norm statistics, logsumexp, BatchNorm batch statistics) are written by the
templates; their entries here give the per-element normalize statement, with the
reduction's two statistics `s0` and `s1` in scope (see `templates.TEAM_STATISTICS`).
"""

from __future__ import annotations

import math
import re

from lowering.spec import (BROADCAST, CHANNEL, CHANNEL_REDUCTIONS, EARLIER, FULL, ONE, POOLS, REDUCTIONS, ROW_REDUCTIONS,
                           SCALAR, SEGMENT, SELF, SPATIAL_REDUCTIONS, Step, broadcast_terms, to_float32)


def cfloat(value: float) -> str:
    """A C++ float constant equal to torch's double -> float conversion of `value`."""
    value = float(value)
    if math.isnan(value):
        return "NAN"
    if math.isinf(value):
        return "INFINITY" if value > 0 else "(-INFINITY)"
    return f"static_cast<float>({value.hex()})"


_OPERAND_AT_J = re.compile(r"(pv[0-9]+)\[j\]")  # a per-channel operand's element j, in a derived value
_FIELD = r"k.\1"  # ... that operand's field of the channel struct `k`


class Operands:
    """Collects the loads a stage needs; renders them ahead of its element loop.

    Args are fields p0, p1, ... of the kernel's Args; the vector is `v[W]`
    starting at flat element `e0`, with channel indices `c[W]`.
    """

    def __init__(self):
        self._loads: dict[str, str] = {}
        self._channel: dict[str, str] = {}  # per-channel operand -> its pointer
        self._derived: dict[str, str] = {}  # per-channel value -> its expression of operands

    def _per_channel(self, name: str, pointer: str) -> str:
        self._channel[name] = pointer
        self._loads[name] = f"float {name}[W];\n  fusedepi::load_channel<W, kInner, kWrap>({pointer}, c, {name});"
        return f"{name}[j]"

    def param(self, index: int, kind: str = CHANNEL, default: str = "1.f") -> str:
        if index < 0:
            return default
        name = f"pv{index}"
        if kind == CHANNEL:
            return self._per_channel(name, f"a.p{index}")
        if kind == FULL:
            self._loads[name] = f"float {name}[W];\n  fusedepi::load_full<W>(a.p{index}, e0, {name});"
            return f"{name}[j]"
        if kind == SEGMENT:  # e0 % kL: the vector's place in its segment (rows are whole segments)
            self._loads[name] = f"float {name}[W];\n  fusedepi::load_full<W>(a.p{index}, e0 % kL, {name});"
            return f"{name}[j]"
        assert kind == ONE
        self._loads[name] = f"const float {name} = fusedepi::to_float(a.p{index}[0]);"
        return name

    def gathered(self, index: int, consts: tuple) -> str:
        """A BROADCAST operand: element j of the vector reads the operand at
        `broadcast_index(consts, e0 + j)`. Where the vector starts at a multiple of W and
        every term keeps its elements together (a quotient by a multiple of W: the same
        for all of them; a remainder by a multiple of W: consecutive), the index is
        computed once and steps by a constant; else once an element."""
        name = f"pv{index}_{'_'.join(map(str, consts))}"
        terms = broadcast_terms(consts)
        index_of, whole, step = [], [], 0
        for div, mod, stride in terms:
            term = "e" if div == 1 else f"(e / {div}LL)"
            term = f"({term} % {mod}LL)" if mod else term
            index_of.append(term if stride == 1 else f"{term} * {stride}LL")
            if div == 1:
                whole.append(f"{mod} % W == 0" if mod else "true")
                step += stride
            else:
                whole.append(f"{div} % W == 0")
        at = " + ".join(index_of)
        self._loads[name] = (
            f"float {name}[W];\n"
            f"  if (W > 1 && {' && '.join(whole)} && e0 % W == 0) {{  // one index a vector\n"
            f"    const long long e = e0, i = {at};\n"
            f"#pragma unroll\n"
            f"    for (int j = 0; j < W; ++j) {name}[j] = fusedepi::to_float(a.p{index}[i + j * {step}LL]);\n"
            f"  }} else {{\n"
            f"#pragma unroll\n"
            f"    for (int j = 0; j < W; ++j) {{\n"
            f"      const long long e = e0 + j;\n"
            f"      {name}[j] = fusedepi::to_float(a.p{index}[{at}]);\n"
            f"    }}\n"
            f"  }}")
        return f"{name}[j]"

    def derived(self, name: str, expr: str) -> str:
        """A value computed from per-channel operands (`pvN[j]` in `expr`): once per
        vector element here, once per channel where the caller knows the channels."""
        self._derived[name] = expr
        self._loads[name] = f"float {name}[W];\n#pragma unroll\n  for (int j = 0; j < W; ++j) {name}[j] = {expr};"
        return f"{name}[j]"

    def batch_stats(self) -> tuple[str, str]:
        """BatchNorm (training) scale and shift, left per channel in the workspace."""
        return self._per_channel("bn_scale", "a.ws"), self._per_channel("bn_shift", "a.ws + kChannels")

    def operand(self, step: Step) -> str:
        if step.operand == SCALAR:
            return cfloat(step.consts[0])
        if step.operand == SELF:
            return "x"
        if step.operand == EARLIER:  # held by render_stage
            return f"h{int(step.consts[0])}"
        if step.operand == BROADCAST:
            return self.gathered(step.inputs[0], step.consts)
        return self.param(step.inputs[0], step.operand)

    def render_loads(self, indent: str = "  ") -> str:
        return "\n".join(indent + load for load in self._loads.values())

    def render_channel(self, indent: str = "  ") -> dict[str, str]:
        """For callers that know the channels: `chan_fields` (the fields of a struct `k`
        holding one channel's operands and derived values), `chan_fill` (their loads into
        `k` for channel `c`), `chan_loads` (the stage's loads, every element of the vector
        in channel `k`) and `cols_loads` (element j in channel `k[j]`)."""
        per_channel = list(self._channel) + list(self._derived)
        fields = "\n".join(f"{indent}float {name};" for name in per_channel)
        fill = [f"{indent}k.{name} = fusedepi::to_float(({pointer})[c]);" for name, pointer in self._channel.items()]
        fill += [f"{indent}k.{name} = {_OPERAND_AT_J.sub(_FIELD, expr)};" for name, expr in self._derived.items()]
        one, cols = [], []
        for name, load in self._loads.items():
            if name in per_channel:
                one.append(f"float {name}[W];\n{indent}fusedepi::fill<W>({name}, k.{name});")
                cols.append(f"float {name}[W];\n#pragma unroll\n{indent}for (int j = 0; j < W; ++j) {name}[j] = k[j].{name};")
            else:
                one.append(load)
                cols.append(load)
        return {
            "chan_fields": fields,
            "chan_fill": "\n".join(fill),
            "chan_loads": "\n".join(indent + line for line in one),
            "cols_loads": "\n".join(indent + line for line in cols),
        }


def _call(fn):
    return lambda step, ops: f"x = {fn}(x);"


def _binary(name):
    """add, sub, mul as `fusedepi::step_<name>`: rounded alone in float32 chains, as eager
    rounds each op (no FMA with a neighbouring step)."""

    def render(step: Step, ops: Operands) -> str:
        other = ops.operand(step)
        a, b = (other, "x") if step.reverse else ("x", other)
        return f"x = fusedepi::step_{name}<kFastMath>({a}, {b});"

    return render


def _divide(step: Step, ops: Operands) -> str:
    """x / scalar as eager computes it on CUDA: x times the float reciprocal of the
    float scalar (ATen's div_true_kernel_cuda, for a CPU scalar divisor). Any other
    division through `fusedepi::divide`: IEEE in float32 chains, div.full in 16-bit ones."""
    if step.operand == SCALAR and not step.reverse:
        return f"x = fusedepi::step_mul<kFastMath>(x, {cfloat(_float32_reciprocal(step.consts[0]))});"
    other = ops.operand(step)
    a, b = (other, "x") if step.reverse else ("x", other)
    return f"x = fusedepi::divide<kFastMath>({a}, {b});"


def _power(step: Step, ops: Operands) -> str:
    """x ** c as eager computes it on CUDA (ATen's pow_tensor_scalar_kernel): c = 0.5,
    -0.5 and -1 as sqrt, rsqrt and reciprocal; 2, 3 and -2 as products (-2: one over
    x * x); 0 as 1 and 1 as x (`pow`'s own shortcuts); any other c through powf."""
    c = step.consts[0]
    special = {
        0.0: "x = 1.0f;",
        1.0: "",
        2.0: "x = x * x;",
        3.0: "x = x * x * x;",
        -2.0: "x = fusedepi::divide<kFastMath>(1.0f, x * x);",
        0.5: "x = sqrtf(x);",
        -0.5: "x = rsqrtf(x);",
        -1.0: "x = fusedepi::divide<kFastMath>(1.0f, x);",
    }
    return special.get(c, f"x = powf(x, {cfloat(c)});")


def _float32_reciprocal(value: float) -> float:
    """RN(1 / RN(value)) in float32, as the host computes `1.f / float(value)`.

    Plain Python, no tensors: kernels are rendered while Dynamo's fake mode is active.
    The division runs in double and is rounded once more to float32; for operands that
    are float32 values this is the correctly rounded float32 quotient (53 >= 2 * 24 + 2).
    """
    divisor = to_float32(float(value))
    if divisor == 0.0:
        return math.copysign(math.inf, divisor)
    return to_float32(1.0 / divisor)


def _affine_norm(step: Step, ops: Operands) -> str:
    """Normalize with the group or layer statistics s0 = mean, s1 = rstd in scope; the
    affine per channel, or (a LayerNorm over a conv output's trailing dims) per place in
    the segment."""
    kind = SEGMENT if step.normalized else CHANNEL
    w = ops.param(step.inputs[0], kind, "1.f")
    b = ops.param(step.inputs[1], kind, "0.f")
    return f"x = (x - s0) * s1 * {w} + {b};"


def _elu(step: Step, ops: Operands) -> str:
    alpha, scale, input_scale = (cfloat(v) for v in step.consts)
    # As ATen: the negative branch's coefficient is alpha * scale rounded to float.
    return f"x = fusedepi::elu(x, {alpha} * {scale}, {scale}, {input_scale});"


def _batchnorm_eval(step: Step, ops: Operands) -> str:
    w = ops.param(step.inputs[0], CHANNEL, "1.f")
    b = ops.param(step.inputs[1], CHANNEL, "0.f")
    rm, rv = ops.param(step.inputs[2]), ops.param(step.inputs[3])
    # rsqrtf (2 ulp), as eager's GroupNorm kernels use: an IEEE sqrt and divide per
    # element made this the slowest step of the chain. Once per channel where the caller
    # knows the channels (the same value: the statement is unchanged).
    rstd = ops.derived(f"bnrs{step.inputs[3]}", f"rsqrtf({rv} + {cfloat(step.consts[0])})")
    return f"x = (x - {rm}) * {rstd} * {w} + {b};"


def _batchnorm_train(step: Step, ops: Operands) -> str:
    """Normalize with the scale/shift the column kernels derived from the batch statistics."""
    scale, shift = ops.batch_stats()
    return f"x = fmaf(x, {scale}, {shift});"


SNIPPETS = {
    "relu": _call("fusedepi::relu"),
    "gelu": _call("fusedepi::gelu"),
    "gelu_tanh": _call("fusedepi::gelu_tanh"),
    "leaky_relu": lambda s, ops: f"x = fusedepi::leaky_relu(x, {cfloat(s.consts[0])});",
    "silu": _call("fusedepi::silu<kFastMath>"),
    "sigmoid": _call("fusedepi::sigmoid<kFastMath>"),
    "tanh": _call("tanhf"),
    "mish": _call("fusedepi::mish<kFastMath>"),
    "hardswish": _call("fusedepi::hardswish"),
    "hardsigmoid": _call("fusedepi::hardsigmoid"),
    "clamp": lambda s, ops: f"x = fusedepi::clamp(x, {cfloat(s.consts[0])}, {cfloat(s.consts[1])});",
    "elu": _elu,
    "softplus": lambda s, ops: f"x = fusedepi::softplus<kFastMath>(x, {cfloat(s.consts[0])}, {cfloat(s.consts[1])});",
    "abs": _call("fabsf"),
    "exp": _call("fusedepi::exponential<kFastMath>"),
    "log": _call("logf"),
    "neg": lambda s, ops: "x = -x;",
    "erf": _call("erff"),
    "log1p": _call("log1pf"),
    "expm1": _call("expm1f"),
    "sin": _call("sinf"),
    "cos": _call("cosf"),
    "sqrt": _call("sqrtf"),
    "rsqrt": _call("rsqrtf"),
    # 1 / x: IEEE in float32 chains, div.full in 16-bit ones, as every division here
    "reciprocal": lambda s, ops: "x = fusedepi::divide<kFastMath>(1.0f, x);",
    "pow": _power,
    "add": _binary("add"),
    "sub": _binary("sub"),
    "mul": _binary("mul"),
    "div": _divide,
    "branch": lambda s, ops: f"x = {ops.operand(s)};",  # an earlier value, held by render_stage
    "prelu": lambda s, ops: f"x = fusedepi::leaky_relu(x, {ops.operand(s)});",  # its slope an operand
    "maximum": lambda s, ops: f"x = fusedepi::maximum(x, {ops.operand(s)});",
    "minimum": lambda s, ops: f"x = fusedepi::minimum(x, {ops.operand(s)});",
    "groupnorm": _affine_norm,
    "layernorm": _affine_norm,
    "rmsnorm": lambda s, ops: "x = x * s1;",  # s1 = rsqrt(mean(x^2) + eps)
    "l2normalize": lambda s, ops: "x = fusedepi::divide<kFastMath>(x, s1);",  # s1 = max(||x||, eps)
    "softmax": lambda s, ops: "x = expf(x - s0) / s1;",  # s0 = row max, s1 = sum of exp(x - s0)
    "log_softmax": lambda s, ops: "x = x - s0 - s1;",  # s1 = log of that sum
    "channel_softmax": lambda s, ops: "x = expf(x - s0) / s1;",  # the same over a pixel's channels
    "channel_log_softmax": lambda s, ops: "x = x - s0 - s1;",
    "spatial_softmax": lambda s, ops: "x = expf(x - s0) / s1;",  # the same over a (row, channel) plane
    "spatial_log_softmax": lambda s, ops: "x = x - s0 - s1;",
    "batchnorm_eval": _batchnorm_eval,
    "batchnorm_train": _batchnorm_train,
    # Reductions are computed by their kernels (templates.ROW_REDUCE, channel_reduce.cuh,
    # pool.cuh); the steps after them see the reduced value.
    **{name: (lambda s, ops: "") for name in ROW_REDUCTIONS + SPATIAL_REDUCTIONS + CHANNEL_REDUCTIONS + POOLS},
}


def render_stage(steps, saves_after=None, sigmoids_at=None, first: int = 0) -> dict[str, str]:
    """The parts of a run of steps applied to each element `x`: `loads`, `statements`,
    `stores`, and for a caller that gives the vector's one channel, `chan_fields`,
    `chan_fill` and `chan_loads` (see `Operands.render_channel`).

    Args:
        saves_after: {i: [(slot, C type, round), ...]}: after step i, the value goes
            to the saved output `a.sv<slot>` (collected per vector, written when
            `save`); with `round`, a 16-bit value is also rounded in registers, in
            every kernel that runs the stage.
        sigmoids_at: {i: [(slot, C type), ...]}: the sigmoid of step i's input (a silu)
            goes to `a.sv<slot>`.
        first: the chain's index of `steps[0]`: a value an EARLIER operand reads (the
            chain's value after k steps) is held in `h<k>`, which must lie in this run.
    """
    held = set()
    for i, step in enumerate(steps):
        if step.operand == EARLIER:
            k = int(step.consts[0])
            if not first <= k < first + i or any(s.name in REDUCTIONS for s in steps[k - first:i]):
                raise ValueError(f"step {first + i} reads the earlier value after {k} steps, which this run of "
                                 f"steps {first}..{first + len(steps) - 1} does not hold (or a reduction lies between)")
            held.add(k)
    saves_after = saves_after or {}
    ops = Operands()
    lines, declared, stores = [], [], []

    def keep(slot, ctype, value):
        declared.append(f"  float sv{slot}v[W];")
        lines.append(f"    sv{slot}v[j] = {value};  // saved")
        stores.append(f"  if (save) fusedepi::store_vec<{ctype}, W>(a.sv{slot} + e0, sv{slot}v);")

    for i, step in enumerate(steps):
        if first + i in held:
            lines.append(f"    const float h{first + i} = x;  // held for a later step")
        for slot, ctype in (sigmoids_at or {}).get(i, ()):
            keep(slot, ctype, "fusedepi::sigmoid<kFastMath>(x)")
        statement = SNIPPETS[step.name](step, ops)
        if statement:
            lines.append(f"    {statement}  // {step.name}")
        for slot, ctype, rounded in saves_after.get(i, ()):
            if rounded and ctype != "float":
                # Rounded as eager holds it, for every later step too: backward gets
                # this value with statistics taken from it, as in eager.
                lines.append(f"    x = fusedepi::to_float(fusedepi::from_float<{ctype}>(x));  // saved: rounded")
            keep(slot, ctype, "x")
    chan = ops.render_channel()
    return {
        "loads": "\n".join(filter(None, [ops.render_loads()] + declared)),
        "statements": "\n".join(lines),
        "stores": "\n".join(stores),
        "chan_fields": chan["chan_fields"],
        "chan_fill": chan["chan_fill"],
        "chan_loads": "\n".join(filter(None, [chan["chan_loads"]] + declared)),
        "cols_loads": "\n".join(filter(None, [chan["cols_loads"]] + declared)),
    }
