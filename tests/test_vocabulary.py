"""GPU-free: every vocabulary step in each form a model can spell it, fused and
checked against eager through the plain-torch reference (FUSEDEPI_CPU_REFERENCE=1).
"""

import copy
from dataclasses import replace
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.backend import collect_reports
from helpers import Chain, compile_records, random_layer_norm, steps_of
from lowering import EpilogueSpec
from lowering.spec import BROADCAST

pytestmark = pytest.mark.usefixtures("cpu_reference")

SELU_ALPHA = 1.6732632423543772848170429916717
SELU_SCALE = 1.0507009873554804934193349852946


def _like_eager(model, x, out, grad: bool, tol: float) -> None:
    """`out` (the compiled model's on `x`) is eager's; with `grad`, so are the gradients
    of x and the parameters for one random upstream gradient."""
    with torch.set_grad_enabled(grad):
        expected = model(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if grad:
        upstream = torch.randn_like(out)
        ours = torch.autograd.grad(out, [x] + list(model.parameters()), upstream)
        eager = torch.autograd.grad(expected, [x] + list(model.parameters()), upstream)
        for a, b in zip(ours, eager):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# (id, fn on the linear's output, expected steps, expected constants of the last step or None)
POINTWISE = [
    ("mish", F.mish, ["mish"], None),
    ("hardswish", F.hardswish, ["hardswish"], None),
    ("hardsigmoid", F.hardsigmoid, ["hardsigmoid"], None),
    ("hardtanh", lambda x: F.hardtanh(x, -0.5, 2.0), ["clamp"], [-0.5, 2.0]),
    ("hardtanh_default", F.hardtanh, ["clamp"], [-1.0, 1.0]),
    ("relu6", F.relu6, ["clamp"], [0.0, 6.0]),
    ("clamp", lambda x: torch.clamp(x, -0.3, 0.4), ["clamp"], [-0.3, 0.4]),
    ("clamp_min", lambda x: torch.clamp(x, min=0.1), ["clamp"], [0.1, float("inf")]),
    ("clamp_max", lambda x: x.clamp(max=0.2), ["clamp"], [float("-inf"), 0.2]),
    ("elu", lambda x: F.elu(x, 0.7), ["elu"], [0.7, 1.0, 1.0]),
    ("selu", F.selu, ["elu"], [SELU_ALPHA, SELU_SCALE, 1.0]),
    ("celu", lambda x: F.celu(x, 1.3), ["elu"], [1.3, 1.0, 1.0 / 1.3]),
    ("softplus", lambda x: F.softplus(x, 2.0, 1.5), ["softplus"], [2.0, 1.5]),
    ("softplus_default", F.softplus, ["softplus"], [1.0, 20.0]),
    ("abs", torch.abs, ["abs"], None),
    ("exp", lambda x: torch.exp(x * 0.1), ["mul", "exp"], None),
    ("log", lambda x: torch.log(torch.sigmoid(x)), ["sigmoid", "log"], None),
    ("neg", lambda x: -torch.tanh(x), ["tanh", "neg"], None),
    ("erf", torch.erf, ["erf"], None),
    ("log1p_exp", lambda x: torch.log1p(torch.exp(x * 0.1)), ["mul", "exp", "log1p"], None),  # softplus spelled out
    ("expm1", lambda x: torch.expm1(torch.tanh(x)), ["tanh", "expm1"], None),
    ("sin", lambda x: torch.sin(30.0 * x), ["mul", "sin"], None),
    ("cos", torch.cos, ["cos"], None),
    ("sqrt", lambda x: torch.sqrt(torch.sigmoid(x)), ["sigmoid", "sqrt"], None),
    ("rsqrt", lambda x: torch.rsqrt(torch.sigmoid(x)), ["sigmoid", "rsqrt"], None),
    ("reciprocal", lambda x: torch.reciprocal(torch.sigmoid(x)), ["sigmoid", "reciprocal"], None),
    ("one_over", lambda x: 1.0 / torch.sigmoid(x), ["sigmoid", "reciprocal", "mul"], None),  # eager: reciprocal, then * 1.0
    ("square", torch.square, ["pow"], [2.0]),
    ("pow_3", lambda x: x ** 3, ["pow"], [3.0]),
    ("pow_minus_2", lambda x: torch.pow(torch.sigmoid(x), -2), ["sigmoid", "pow"], [-2.0]),
    ("pow_half", lambda x: torch.sigmoid(x).pow(0.5), ["sigmoid", "pow"], [0.5]),
    ("pow_1_5", lambda x: torch.sigmoid(x) ** 1.5, ["sigmoid", "pow"], [1.5]),
    ("maximum_scalar", lambda x: torch.maximum(x, torch.tensor(0.1)), ["maximum"], None),
    ("minimum_scalar", lambda x: torch.minimum(torch.tensor(-0.1), x), ["minimum"], None),
    ("prelu_one", lambda x: F.prelu(x, torch.tensor([0.25])), ["prelu"], None),
    ("prelu_per_feature", lambda x: F.prelu(x, torch.linspace(-1.0, 2.0, 32)), ["prelu"], None),
    ("prelu_spelled_with_a_number", lambda x: torch.where(x > 0, x, x * -0.3), ["leaky_relu"], [-0.3]),
]


@pytest.mark.parametrize("fn, steps, consts", [c[1:] for c in POINTWISE], ids=[c[0] for c in POINTWISE])
def test_pointwise_forms(fn, steps, consts):
    model = Chain(fn, bias=False)
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    assert steps_of(fused[0]) == steps
    if consts is not None:
        assert json.loads(fused[0].spec)["steps"][-1]["consts"] == pytest.approx(consts)
    torch.testing.assert_close(out, model(x))


def test_pow_with_a_tensor_exponent_stops_the_chain():
    model = Chain(lambda x: torch.relu(x) ** torch.full((32,), 2.0))
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert all("pow" not in steps_of(r) for r in fused)
    torch.testing.assert_close(out, model(x))


def test_maximum_with_a_per_channel_tensor():
    floor = torch.randn(32)
    model = Chain(lambda x: torch.maximum(x, floor))
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert json.loads(fused[0].spec)["steps"][-1]["operand"] == "channel"
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn, steps, bias", [
    (lambda y: F.normalize(y, dim=-1), ["l2normalize"], 0.1),
    (lambda y: F.normalize(y, dim=1, eps=1e-6) * 14.3, ["l2normalize", "mul"], 0.1),  # CLIP's scaled cosine
    (lambda y: F.normalize(torch.relu(y), dim=-1), ["relu", "l2normalize"], -50.0),  # rows of zeros: the eps
], ids=["last_dim", "dim_1_scaled", "zero_rows"])
def test_l2_normalize_over_the_features(fn, steps, bias, dtype):
    model = Chain(fn).to(dtype)
    with torch.no_grad():
        model.linear.bias.fill_(bias)
    x = torch.randn(6, 16).to(dtype)
    out, fused, refused = compile_records(model, x)
    assert fused and steps_of(fused[0]) == steps, refused
    assert fused[0].fusion == "linear_l2normalize"
    with torch.no_grad():
        tol = 0 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out, model(x), atol=tol, rtol=tol)


class _ConvThen(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.conv, self.fn = nn.Conv2d(3, 8, 3), fn

    def forward(self, x):
        return self.fn(self.conv(x))


def test_l2_normalize_of_a_3d_linear_and_refused_over_a_convs_channels():
    model = Chain(lambda y: F.normalize(y, dim=-1))
    x = torch.randn(2, 5, 16)
    out, fused, refused = compile_records(model, x)
    assert fused and steps_of(fused[0]) == ["l2normalize"], refused
    torch.testing.assert_close(out, model(x))
    conv = _ConvThen(lambda y: F.normalize(y, dim=1))  # over a conv's channels: not the features
    x = torch.randn(2, 3, 9, 9)
    out, fused, refused = compile_records(conv, x)
    assert not any("l2normalize" in steps_of(r) for r in fused)
    torch.testing.assert_close(out, conv(x))


def test_l2_normalize_in_training_keeps_eagers_gradients():
    model = Chain(lambda y: F.normalize(y, dim=-1) * 2.0)
    eager = copy.deepcopy(model)
    x = torch.randn(6, 16)
    out, fused, refused = compile_records(model, x, grad=True)
    # backward reads the norm: refused with that reason, the gradients eager's
    assert not fused and "F.normalize whose norm is read elsewhere" in refused[0].reason, refused
    out.sum().backward()
    eager(x).sum().backward()
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-5)


REDUCTIONS = [
    ("sum", lambda x: x.sum(1, keepdim=True), "sum", (4, 1)),
    ("sum_neg_dim", lambda x: x.sum(-1), "sum", (4,)),
    ("mean", lambda x: x.mean(-1), "mean", (4,)),
    ("amax", lambda x: x.amax(1, keepdim=True), "amax", (4, 1)),
    ("amin", lambda x: x.amin(1), "amin", (4,)),
    ("max_dim", lambda x: x.max(dim=1)[0], "amax", (4,)),
    ("min_dim_keepdim", lambda x: torch.min(x, 1, keepdim=True).values, "amin", (4, 1)),
    ("logsumexp", lambda x: torch.logsumexp(x, -1), "logsumexp", (4,)),
]


@pytest.mark.parametrize("fn, step, shape", [c[1:] for c in REDUCTIONS], ids=[c[0] for c in REDUCTIONS])
def test_row_reductions_then_pointwise(fn, step, shape):
    model = Chain(lambda x: torch.sigmoid(fn(F.gelu(x)) * 2.0))
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    assert steps_of(fused[0]) == ["gelu", step, "mul", "sigmoid"]
    assert fused[0].fusion == f"linear_{step}"
    assert out.shape == shape
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_max_with_indices_used_is_refused(grad):
    # The model's own use of the indices, or backward's (which scatters the gradient to
    # them); the kernel writes only the values.
    fn = (lambda x: torch.max(x, dim=1).values * 2.0) if grad else (lambda x: torch.max(x, dim=1).indices.float())
    model = Chain(fn)
    x = torch.randn(4, 16, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert not fused and "amax (max.dim): the graph also uses its indices" in refused[0].reason, refused
    torch.testing.assert_close(out, model(x))


def test_sum_with_dtype_is_refused():
    model = Chain(lambda x: x.sum(1, dtype=torch.float64))
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert not fused and "dtype" in refused[0].reason
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [1, -1])
def test_softmax_over_features(name, dim):
    fn = getattr(F, name)
    model = Chain(lambda x: fn(x, dim=dim) * 3.0)
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert steps_of(fused[0]) == [name, "mul"] and fused[0].fusion == f"linear_{name}"
    torch.testing.assert_close(out, model(x))


OVER_ROWS = [
    ("softmax", lambda x: F.softmax(x, dim=0)),
    ("logsumexp", lambda x: torch.logsumexp(x, dim=0)),
    ("sum", lambda x: x.sum(0)),
    ("amax", lambda x: x.amax(0, keepdim=True)),
]


@pytest.mark.parametrize("name, fn", OVER_ROWS, ids=[c[0] for c in OVER_ROWS])
def test_reductions_over_rows_are_refused(name, fn):
    model = Chain(fn)
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert not fused and f"{name} over dims [0]" in refused[0].reason
    torch.testing.assert_close(out, model(x))


ND_ROW_REDUCTIONS = [
    # (id, fn on a Linear(16 -> 32) output of a [3, 5, 16] input, steps after it, output shape)
    ("logsumexp", lambda y: torch.logsumexp(y, -1), ["logsumexp"], (3, 5)),
    ("mean_keepdim_then_steps", lambda y: torch.tanh(y.mean(-1, keepdim=True)) * 2, ["mean", "tanh", "mul"], (3, 5, 1)),
    ("amax", lambda y: F.relu(y).amax(dim=2), ["relu", "amax"], (3, 5)),
]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("fn, steps, out_shape", [c[1:] for c in ND_ROW_REDUCTIONS], ids=[c[0] for c in ND_ROW_REDUCTIONS])
def test_row_reductions_of_an_nd_linear_output(fn, steps, out_shape, grad):
    """A reduction over the features of a Linear applied to [B, T, K]: one value per
    (b, t) row of the product, the fused op's [rows] output viewed to [B, T] (keepdim:
    [B, T, 1])."""
    torch.manual_seed(0)
    model = Chain(fn)
    x = torch.randn(3, 5, 16, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert fused and steps_of(fused[0]) == steps, (fused, refused)
    assert out.shape == out_shape
    _like_eager(model, x, out, grad, 1e-5)


def test_a_reduction_over_an_nd_linear_outputs_rows_is_refused():
    model = Chain(lambda y: y.sum(1))
    out, fused, refused = compile_records(model, torch.randn(3, 5, 16))
    assert not fused and "sum over dims [1] of a 3-D linear output: only over its features" in refused[0].reason


def test_softmax_on_3d_linear_output():
    model = Chain(lambda x: F.softmax(x, dim=-1))
    x = torch.randn(2, 3, 16)
    out, fused, _ = compile_records(model, x)
    assert steps_of(fused[0]) == ["softmax"]
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("eps", [None, 1e-5])
def test_rmsnorm(affine, eps):
    norm = nn.RMSNorm(32, eps=eps, elementwise_affine=affine)
    if affine:
        nn.init.uniform_(norm.weight, 0.5, 1.5)
    model = Chain(nn.Sequential(norm, nn.SiLU()))
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    assert steps_of(fused[0]) == ["rmsnorm"] + (["mul"] if affine else []) + ["silu"]
    expected_eps = torch.finfo(torch.float32).eps if eps is None else eps
    assert json.loads(fused[0].spec)["steps"][0]["consts"] == pytest.approx([expected_eps])
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_functional_rms_norm():
    model = Chain(lambda x: F.rms_norm(x, (32,), eps=1e-6))
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert steps_of(fused[0]) == ["rmsnorm"]
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_two_reductions_stop_the_chain():
    model = Chain(lambda x: F.softmax(F.layer_norm(x, (32,)), dim=-1))
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert steps_of(fused[0]) == ["layernorm"]
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_dropout_eval_is_identity_and_training_is_refused():
    model = Chain(nn.Sequential(nn.Dropout(0.5), nn.ReLU()))
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model.eval(), x)
    assert steps_of(fused[0]) == ["relu"]
    torch.testing.assert_close(out, model(x))
    # Training dropout decomposes to a random mask (rand > p, bool) times the value,
    # which the kernels do not draw: refused there, and a chain stops before it.
    _, fused, refused = compile_records(model.train(), x)
    assert not fused and "operand gt is a random mask (dropout in training)" in refused[0].reason, refused
    out, fused, refused = compile_records(Chain(nn.Sequential(nn.GELU(), nn.Dropout(0.1), nn.ReLU())), x)
    assert [steps_of(r) for r in fused] == [["gelu"]], refused
    assert "operand gt is a random mask (dropout in training)" in fused[0].stop, fused[0].stop


class ConvChain(nn.Module):
    def __init__(self, conv, fn):
        super().__init__()
        self.conv, self.fn = conv, fn

    def forward(self, x):
        return self.fn(self.conv(x))


CONVS = [
    ("conv1d", lambda: nn.Conv1d(3, 8, 3, padding=1), (2, 3, 20)),
    ("conv1d_stride2", lambda: nn.Conv1d(3, 8, 5, stride=2), (2, 3, 21)),
    ("conv3d", lambda: nn.Conv3d(3, 8, 3), (2, 3, 6, 7, 8)),
    ("conv2d_dilated", lambda: nn.Conv2d(3, 8, 3, dilation=2, padding=1), (2, 3, 11, 9)),
    ("conv_transpose2d", lambda: nn.ConvTranspose2d(3, 8, 3, stride=2), (2, 3, 5, 6)),
    ("conv_transpose3d", lambda: nn.ConvTranspose3d(3, 8, 2), (2, 3, 3, 4, 5)),
]


@pytest.mark.parametrize("make, shape", [c[1:] for c in CONVS], ids=[c[0] for c in CONVS])
def test_conv_anchors_with_groupnorm(make, shape):
    torch.manual_seed(0)
    model = ConvChain(make(), nn.Sequential(nn.GroupNorm(4, 8), nn.Hardswish()))
    x = torch.randn(shape)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    assert steps_of(fused[0]) == ["add", "groupnorm", "hardswish"]  # the conv bias moves into the epilogue
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def _as_eager(model, x, out, grad):
    """`out` (the compiled model's output on `x`) is eager's; with `grad`, so are the
    gradients of x and the parameters of the same loss through each."""
    eager_x = x.detach().clone().requires_grad_(grad)
    eager = model(eager_x)
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    if grad:
        model.zero_grad()
        eager.square().sum().backward()
        expected = [p.grad.clone() for p in model.parameters()] + [eager_x.grad]
        model.zero_grad()
        out.square().sum().backward()
        for got, want in zip([p.grad for p in model.parameters()] + [x.grad], expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("make, cin, flipped", [
    (lambda: nn.ConvTranspose2d(3, 8, 3, padding=1), 3, True),
    (lambda: nn.ConvTranspose2d(3, 8, 3), 3, True),  # the conv's padding 2
    (lambda: nn.ConvTranspose2d(3, 8, (2, 3), padding=(1, 0), dilation=(2, 1)), 3, True),
    (lambda: nn.ConvTranspose2d(3, 8, 3, padding=3), 3, False),  # padding past the kernel's reach
    (lambda: nn.ConvTranspose2d(3, 8, 3, stride=2), 3, False),
    (lambda: nn.ConvTranspose2d(3, 8, 3, stride=2, output_padding=1), 3, False),
    (lambda: nn.ConvTranspose2d(4, 8, 3, groups=2), 4, False),
    (lambda: nn.ConvTranspose3d(3, 8, 3, padding=1), 3, True),  # a 3-D one (Anchor.depth)
    (lambda: nn.ConvTranspose3d(3, 8, (2, 3, 1), padding=(1, 0, 0), dilation=(1, 2, 1)), 3, True),
    (lambda: nn.ConvTranspose3d(3, 8, 3, stride=2), 3, False),
], ids=["padding1", "padding0", "dilated_rectangular", "padding_past_reach", "stride2", "output_padding", "groups2",
        "3d_padding1", "3d_dilated_rectangular", "3d_stride2"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_stride_1_conv_transpose_runs_as_the_conv_it_equals(make, cin, flipped, grad):
    # Anchor.flipped: the fused op takes the ConvTranspose's weight transposed and flipped
    # (graph ops before it) and computes the conv it equals, which the direct and the
    # in-kernel conv may take; the others stay ConvTransposes. Results and gradients are
    # eager's (the sums in another order).
    torch.manual_seed(0)
    model = ConvChain(make(), nn.Sequential(nn.GroupNorm(4, 8), nn.Hardswish()))
    three_d = isinstance(model.conv, nn.ConvTranspose3d)
    x = torch.randn(2, cin, *((4,) if three_d else ()), 7, 9, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    (record,) = fused
    anchor = json.loads(record.spec)["anchor"]
    assert anchor["flipped"] == flipped and anchor["conv"][3] == (not flipped) and bool(anchor["direct"]) == flipped
    assert bool(anchor["depth"]) == (flipped and three_d)  # (the in-kernel conv's alone)
    assert ("a ConvTranspose of stride 1 as the conv it equals" in record.kernel) == flipped  # explain's kernel column
    if flipped:
        reach = [d * (k - 1) for d, k in zip(model.conv.dilation, model.conv.kernel_size)]
        assert anchor["conv"][1] == [r - p for r, p in zip(reach, model.conv.padding)]
    _as_eager(model, x, out, grad)


@pytest.mark.parametrize("make, shape, fn, as_2d", [
    (lambda: nn.Conv1d(3, 8, 3, padding=1), (2, 3, 20), lambda y: F.hardswish(y), True),
    (lambda: nn.Conv1d(3, 8, 5, stride=2, dilation=2), (2, 3, 31), lambda y: torch.sigmoid(y) * 2.0, True),
    (lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), lambda y: F.gelu(nn.functional.group_norm(y, 4)), True),
    (lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), lambda y: torch.relu(y).mean(dim=2), True),
    (lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), lambda y: torch.amin(-y, dim=2, keepdim=True), True),
    (lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), lambda y: torch.relu(y).mean(dim=1), True),
    (lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), lambda y: torch.logsumexp(y, dim=1, keepdim=True), True),
    (lambda: nn.Conv1d(4, 8, 3, groups=2), (2, 4, 20), lambda y: F.hardswish(y), False),
], ids=["padding1", "stride2_dilation2", "groupnorm", "spatial_mean", "spatial_amin_keepdim", "channel_mean",
        "channel_logsumexp_keepdim", "groups2"])
@pytest.mark.parametrize("grad", [False, True])
def test_a_conv1d_runs_as_the_2d_conv_of_one_row(make, shape, fn, as_2d, grad):
    # Anchor.as_2d: x and the weight reach the fused op as [N, C, 1, L] and [O, C, 1, k]
    # (graph views), a 2-D conv's, which the direct and the in-kernel conv may take;
    # grouped and permuted ones stay Conv1d. Results and gradients are eager's.
    torch.manual_seed(0)
    model = ConvChain(make(), fn)
    x = torch.randn(shape, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    (record,) = fused
    anchor = json.loads(record.spec)["anchor"]
    assert anchor["as_2d"] == as_2d and len(anchor["conv"][0]) == 1 + as_2d and bool(anchor["direct"]) == as_2d
    if as_2d:
        assert anchor["direct"][1] == 1 and anchor["direct"][3] == 1  # kh, h: one row
        assert "a Conv1d as a 2-D conv of one row" in record.kernel
        # The launchers shape the op's output from the spec: the graph's 1-D one.
        spec = EpilogueSpec.from_json(record.spec)
        spatial = spec.anchor.direct_out_spatial()
        planned = ((shape[0],) + spec.reduced_tail() + (spatial if spec.keeps_spatial else ()) if spec.row_output
                   else (shape[0], spec.channels, *spatial))
        assert planned == tuple(out.shape) and spatial == (model.conv(x).shape[2],)
    _as_eager(model, x, out, grad)


def test_a_conv1d_pooling_window_is_its_rows_window_in_the_in_kernel_conv():
    # After a Conv1d run as one row (Anchor.as_2d), avg_pool1d(4) is the row's 1 x 4
    # window, which the in-kernel conv's tiles pool (render.conv_pool); as a Conv1d's it
    # would be refused there as 1-D.
    import cuda_templates
    from cuda_templates.render import conv_pool

    model = ConvChain(nn.Conv1d(64, 128, 5, padding=2), lambda y: F.avg_pool1d(F.gelu(y), 4) * 2.0).to(torch.bfloat16)
    x = torch.randn(2, 64, 1030, dtype=torch.bfloat16)
    out, fused, _ = compile_records(model, x)
    spec = EpilogueSpec.from_json(fused[0].spec)
    assert spec.anchor.as_2d and conv_pool(spec) == (1, 4)
    plan = cuda_templates.conv_gemm_plan(spec.with_in_kernel_conv(), "sm90")
    assert plan.pool == (1, 4) and (plan.tile_h, plan.tile_w) == (1, 128), plan
    assert "1-D avgpool" in conv_pool(replace(spec, anchor=spec.anchor.as_1d()))
    torch.testing.assert_close(out, model(x), atol=2e-2, rtol=2e-2)  # bf16: the bias added after the conv's rounding


def test_a_permuted_conv1d_stays_a_conv1d():
    # A LayerNorm over the channels after a permute: the library conv runs it, channels-last
    # (Anchor.permuted), as a Conv1d.
    torch.manual_seed(0)
    model = ConvChain(nn.Conv1d(3, 8, 3), lambda y: F.layer_norm(y.permute(0, 2, 1), (8,)))
    x = torch.randn(2, 3, 20)
    out, fused, refused = compile_records(model, x)
    (record,) = fused
    anchor = json.loads(record.spec)["anchor"]
    assert anchor["permuted"] and not anchor["as_2d"] and anchor["conv"][0] == [1] and not anchor["direct"]
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


SPATIAL = [
    # (id, conv, input shape, fn on the conv's output, expected steps after the folded bias, output shape)
    ("mean_2d", lambda: nn.Conv2d(3, 8, 3), (2, 3, 9, 10), lambda y: F.relu(y).mean(dim=[2, 3]),
     ["relu", "spatial_mean"], (2, 8)),
    ("adaptive_avg_pool_flatten", lambda: nn.Conv2d(3, 8, 3, padding=1), (2, 3, 7, 7),
     lambda y: torch.sigmoid(F.adaptive_avg_pool2d(F.silu(y), 1).flatten(1) * 2.0),
     ["silu", "spatial_mean", "mul", "sigmoid"], (2, 8)),
    ("sum_keepdim_channel_operand", lambda: nn.Conv2d(3, 8, 3), (2, 3, 8, 8),
     lambda y: y.sum(dim=(-1, -2), keepdim=True) * torch.linspace(0.5, 1.5, 8).view(8, 1, 1),
     ["spatial_sum", "mul"], (2, 8, 1, 1)),
    ("amax_3d", lambda: nn.Conv3d(3, 8, 2), (2, 3, 4, 5, 6), lambda y: torch.amax(F.gelu(y), dim=(2, 3, 4)),
     ["gelu", "spatial_amax"], (2, 8)),
    ("max_values_1d", lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), lambda y: torch.tanh(torch.max(y, dim=2).values),
     ["spatial_amax", "tanh"], (2, 8)),
    ("amin_transposed", lambda: nn.ConvTranspose2d(3, 8, 3, stride=2), (2, 3, 5, 6),
     lambda y: torch.amin(y, dim=[2, 3], keepdim=True) + 1.0, ["spatial_amin", "add"], (2, 8, 1, 1)),
]


CHANNEL = [
    # (id, conv, input shape, fn on the conv's output, expected steps after the folded bias, output shape)
    ("softmax_2d", lambda: nn.Conv2d(3, 8, 3), (2, 3, 9, 10), lambda y: F.softmax(F.relu(y), dim=1) * 2.0,
     ["relu", "channel_softmax", "mul"], (2, 8, 7, 8)),
    ("log_softmax_3d_channel_operand", lambda: nn.Conv3d(3, 8, 2), (2, 3, 4, 5, 6),
     lambda y: F.log_softmax(y, dim=1) * torch.linspace(0.5, 1.5, 8).view(8, 1, 1, 1),
     ["channel_log_softmax", "mul"], (2, 8, 3, 4, 5)),
    ("logsumexp_keepdim", lambda: nn.Conv2d(3, 8, 3), (2, 3, 9, 10), lambda y: torch.logsumexp(y, dim=1, keepdim=True),
     ["channel_logsumexp"], (2, 1, 7, 8)),
    ("sum_1d", lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), lambda y: torch.tanh(F.gelu(y).sum(1)),
     ["gelu", "channel_sum", "tanh"], (2, 18)),
    ("mean_neg_dim", lambda: nn.Conv2d(3, 8, 3), (2, 3, 9, 10), lambda y: y.mean(dim=-3), ["channel_mean"], (2, 7, 8)),
    ("min_values_keepdim", lambda: nn.Conv2d(3, 8, 3), (2, 3, 9, 10),
     lambda y: torch.tanh(torch.min(y, dim=1, keepdim=True)[0]), ["channel_amin", "tanh"], (2, 1, 7, 8)),
    ("amax_transposed", lambda: nn.ConvTranspose2d(3, 8, 3, stride=2), (2, 3, 5, 6),
     lambda y: torch.amax(y, dim=1) + 1.0, ["channel_amax", "add"], (2, 11, 13)),
]


def test_a_per_channel_operand_after_a_channel_reduction_is_refused():
    model = ConvChain(nn.Conv2d(3, 8, 3), lambda y: y.sum(1, keepdim=True) * torch.ones(8, 1, 1))
    x = torch.randn(2, 3, 9, 10)
    out, fused, refused = compile_records(model, x)
    assert steps_of(fused[0]) == ["add", "channel_sum"]
    assert "of shape [8, 1, 1] broadcasts the chain's shape [2, 1, 7, 8] up" in fused[0].stop
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class Operands(nn.Module):
    """An anchor, then `fn(y, *operands)` with the operands as inputs of the model."""

    def __init__(self, anchor, fn):
        super().__init__()
        self.anchor, self.fn = anchor, fn

    def forward(self, x, *operands):
        return self.fn(self.anchor(x), *operands)


class _Bmm(nn.Module):
    def __init__(self, batch, k, n):
        super().__init__()
        self.w = nn.Parameter(torch.randn(batch, k, n))

    def forward(self, x):
        return torch.bmm(x, self.w)


# Operands that broadcast over some of the chain's dims: (anchor, input shapes, fn, the
# steps after a folded bias, the (div, mod, stride) terms of the first broadcast operand).
BROADCASTS = [
    ("time_embedding_groupnorm_film", lambda: nn.Conv2d(3, 8, 3, padding=1), [(2, 3, 5, 6)] + [(2, 8, 1, 1)] * 3,
     lambda y, t, s, b: F.silu(F.group_norm(y + t, 4)) * (1 + s) + b,
     ["add", "groupnorm", "silu", "mul", "add"], (30, 0, 1)),
    ("position_channel_softmax", lambda: nn.Conv2d(3, 8, 3), [(2, 3, 7, 8), (8, 5, 6)],
     lambda y, p: F.softmax(y + p, dim=1), ["add", "channel_softmax"], (1, 240, 1)),
    ("pixel_mask_maxpool", lambda: nn.Conv2d(3, 8, 3), [(2, 3, 7, 8), (2, 1, 5, 6)],
     lambda y, k: F.max_pool2d(y * k, 2), ["mul", "maxpool"], (240, 0, 30, 1, 30, 1)),
    ("image_scale_3d", lambda: nn.Conv3d(3, 4, 2), [(2, 3, 4, 5, 6), (2, 1, 1, 1, 1)],
     lambda y, s: torch.tanh(y * s), ["mul", "tanh"], (240, 0, 1)),
    ("linear_rows", lambda: nn.Linear(6, 10), [(7, 6), (7, 1)], lambda y, r: torch.tanh(y - r), ["sub", "tanh"],
     (10, 0, 1)),
    ("linear_3d_position_layernorm", lambda: nn.Linear(6, 10), [(3, 4, 6), (4, 10)],
     lambda y, p: F.layer_norm(y + p, (10,)), ["add", "layernorm"], (1, 40, 1)),
    ("linear_3d_rows", lambda: nn.Linear(6, 10), [(3, 4, 6), (3, 4, 1)], lambda y, r: y * r, ["mul"], (10, 0, 1)),
    # per sample over a sequence's 4 rows: a value, and a DiT block's adaLN gate before its residual
    ("linear_3d_per_sample", lambda: nn.Linear(6, 10), [(3, 4, 6), (3, 1, 1)], lambda y, s: y * s, ["mul"],
     (40, 0, 1)),
    ("linear_3d_sample_gate_residual", lambda: nn.Linear(6, 10), [(3, 4, 6), (3, 1, 10), (3, 4, 10)],
     lambda y, g, x: x + g * y, ["mul", "add"], (40, 0, 10, 1, 10, 1)),
    ("bmm_attention_bias_softmax", lambda: _Bmm(3, 5, 9), [(3, 9, 5), (9, 9)],
     lambda y, b: F.softmax(y + b, dim=-1), ["add", "spatial_softmax"], (1, 81, 1)),
    ("bmm_batch_channel_instance_norm", lambda: _Bmm(2, 5, 7), [(2, 4, 5), (2, 4, 1)],
     lambda y, s: F.instance_norm(y * s), ["mul", "groupnorm"], (7, 0, 1)),
]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("name, anchor, shapes, fn, steps, terms", BROADCASTS, ids=[b[0] for b in BROADCASTS])
def test_operands_that_broadcast_over_some_dims(name, anchor, shapes, fn, steps, terms, grad, cpu_reference):
    """Per (image, channel), per position, per pixel, per image, per row: each a step of
    the chain (BROADCAST, its terms index the operand from the element's place), and the
    model computes what eager computes, gradients included."""
    torch.manual_seed(0)
    model = Operands(anchor(), fn)
    inputs = [torch.randn(s, requires_grad=grad) for s in shapes]
    out, fused, refused = compile_records(model, *inputs, grad=grad)
    assert len(fused) == 1 and not refused, [r.reason for r in refused]
    spec = EpilogueSpec.from_json(fused[0].spec)
    names = [s.name for s in spec.steps]
    if grad and steps[-1] == "maxpool":  # a training graph keeps the pool out (backward reads its input)
        steps = steps[:-1]
    else:
        assert fused[0].stop.startswith("end of the graph"), fused[0].stop
    assert names[len(names) - len(steps):] == steps
    assert next(s.consts for s in spec.steps if s.operand == BROADCAST) == terms
    expected = model(*inputs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if grad:
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, inputs + list(model.parameters()), g)
        want = torch.autograd.grad(expected, inputs + list(model.parameters()), g)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [[], [1], [1, 1, 1]], ids=["0-dim", "1-dim", "3-dim"])
def test_a_one_element_operand_of_a_3d_linear_chain_keeps_its_shape(shape, cpu_reference):
    # The fused op works on the 2-D product: a [1, 1, 1] operand must not make it 3-D
    # (the row reduction then reduced the wrong dim; GPU fuzzer, generation 9, model 23).
    model = Operands(nn.Linear(5, 7), lambda y, o: torch.sigmoid((y / o).mean(-1, keepdim=True)))
    inputs = [torch.randn(3, 2, 5), torch.rand(shape) + 0.5]
    out, fused, refused = compile_records(model, *inputs)
    assert [r.stop for r in fused] == ["end of the graph"] and steps_of(fused[0])[-3:] == ["div", "mean", "sigmoid"]
    torch.testing.assert_close(out, model(*inputs), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("anchor, shapes, fn, why", [
    (lambda: nn.Conv2d(3, 8, 3, padding=1), [(2, 3, 5, 6), (1, 1, 5, 6)], lambda y, s: y.amax(1, keepdim=True) * s,
     "a broadcast operand after a reduction"),
], ids=["after_a_reduction"])
def test_broadcast_operands_the_kernels_cannot_index_are_refused(anchor, shapes, fn, why, cpu_reference):
    model = Operands(anchor(), fn)
    inputs = [torch.randn(s) for s in shapes]
    out, fused, refused = compile_records(model, *inputs)
    assert any(why in r.stop for r in fused) or any(why in r.reason for r in refused), (
        [r.stop for r in fused], [r.reason for r in refused])
    torch.testing.assert_close(out, model(*inputs), atol=1e-5, rtol=1e-5)


class ChannelsLastNorm(nn.Module):
    """conv, its channels moved last (`permute`), then `fn`: ConvNeXt's LayerNorm, timm's
    LayerNorm2d (which permutes back after it)."""

    def __init__(self, conv, fn, channels):
        super().__init__()
        self.conv, self.fn, self.ln = conv, fn, nn.LayerNorm(channels)

    def forward(self, x):
        y = self.conv(x)
        return self.fn(self, y.permute(0, *range(2, y.dim()), 1))


# (conv, input shape, fn on the permuted output, the fused steps, why the chain stops)
PERMUTED = [
    ("layernorm2d", lambda: nn.Conv2d(3, 8, 3), (2, 3, 7, 9), lambda m, y: m.ln(y).permute(0, 3, 1, 2),
     ["add", "layernorm"], "permute.default is not in the vocabulary"),
    ("convnext_depthwise", lambda: nn.Conv2d(8, 8, 7, padding=3, groups=8), (2, 8, 9, 10),
     lambda m, y: F.gelu(m.ln(y)) * 2.0, ["add", "layernorm", "gelu", "mul"], "end of the graph"),
    ("conv3d_tanh", lambda: nn.Conv3d(3, 8, 2), (2, 3, 4, 5, 6),
     lambda m, y: torch.tanh(m.ln(y)), ["add", "layernorm", "tanh"], "end of the graph"),
    ("conv1d_no_bias", lambda: nn.Conv1d(3, 8, 3, bias=False), (2, 3, 12),
     lambda m, y: m.ln(y) + 1.0, ["layernorm", "add"], "end of the graph"),
]


@pytest.mark.parametrize("name, conv, shape, fn, steps, stop", PERMUTED, ids=[p[0] for p in PERMUTED])
def test_chains_after_a_permute_of_the_conv_channels(name, conv, shape, fn, steps, stop, cpu_reference):
    """A conv whose output's channels move last (`y.permute(0, 2, 3, 1)`) is read as a
    Linear's rows: norms over the channels fuse (`Anchor.permuted`), the result is the
    contiguous [N, *spatial, C] the graph expects."""
    torch.manual_seed(0)
    model = ChannelsLastNorm(conv(), fn, 8)
    x = torch.randn(shape)
    out, fused, refused = compile_records(model, x)
    assert len(fused) == 1 and not refused, [r.reason for r in refused]
    spec = EpilogueSpec.from_json(fused[0].spec)
    assert spec.anchor.permuted and not spec.anchor.conv_view and spec.inner == 1 and spec.channels == 8
    assert [s.name for s in spec.steps] == steps and fused[0].stop.startswith(stop)
    expected = model(x)
    assert out.shape == expected.shape and out.stride() == expected.stride()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_after_a_permute_of_the_conv_channels_a_strided_result_or_saved_value_is_refused(cpu_reference):
    # Pointwise steps keep the permuted (strided) layout in eager: the fused op's rows
    # would be contiguous. In training, the values backward reads are not returned.
    model = ChannelsLastNorm(nn.Conv2d(3, 8, 3), lambda m, y: F.gelu(y), 8)
    x = torch.randn(2, 3, 7, 9)
    out, fused, refused = compile_records(model, x)
    assert not fused and "is not contiguous (the fused op returns contiguous rows)" in refused[0].reason
    torch.testing.assert_close(out, model(x))
    model = ChannelsLastNorm(nn.Conv2d(3, 8, 3), lambda m, y: F.gelu(m.ln(y)), 8)
    x.requires_grad_(True)
    out, fused, refused = compile_records(model, x, grad=True)
    assert not fused and "a chain after a permute of the conv's channels returns its result only" in refused[0].reason
    out.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    model(x).sum().backward()
    torch.testing.assert_close(grad, x.grad, atol=1e-5, rtol=1e-5)


SPATIAL_REFUSED = [
    ("mean_one_spatial_dim", lambda y: y.mean(dim=3),
     "mean over dims [3] of a 4-D conv output: only over its channels (dim 1) or over all its spatial dims [2, 3]"),
    ("softmax_over_width", lambda y: F.softmax(y, dim=3),
     "softmax over dims [3] of a 4-D conv output: only over its channels (dim 1), or over its last dim where"),
    ("sum_with_channels", lambda y: y.sum(dim=[1, 2, 3]), "sum over dims [1, 2, 3] of a 4-D conv output"),
    ("logsumexp_spatial", lambda y: torch.logsumexp(y, dim=(2, 3)), "logsumexp over a conv output's spatial dims is not implemented"),
    ("two_poolings", lambda y: y.mean(dim=[2, 3], keepdim=True).amax(dim=[2, 3]), "only one reduction per fused kernel"),
]


@pytest.mark.parametrize("fn, reason", [c[1:] for c in SPATIAL_REFUSED], ids=[c[0] for c in SPATIAL_REFUSED])
def test_spatial_reductions_that_do_not_fit_say_why(fn, reason):
    model = ConvChain(nn.Conv2d(3, 8, 3), fn)
    x = torch.randn(2, 3, 9, 10)
    out, fused, refused = compile_records(model, x)
    stops = [r.reason for r in refused] + [r.stop for r in fused]
    assert any(reason in why for why in stops), stops
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class _NormThenReduce(nn.Module):
    """An anchor (conv or Linear), a norm, then `fn` on the normalized value."""

    def __init__(self, anchor, norm, fn):
        super().__init__()
        self.anchor, self.norm, self.fn = anchor, norm, fn

    def forward(self, x):
        return self.fn(self.norm(self.anchor(x)))


# A reduction after the norm: (id, anchor, norm, input shape, fn, the fused steps after the norm).
NORM_THEN_REDUCE = [
    ("groupnorm_gelu_mean", lambda: nn.Conv2d(3, 16, 3), lambda: nn.GroupNorm(4, 16), (2, 3, 9, 10),
     lambda y: F.gelu(y).mean(dim=(2, 3)) * 2.0, ["gelu", "spatial_mean", "mul"]),
    ("instancenorm_amax_keepdim", lambda: nn.Conv3d(3, 4, 2), lambda: nn.InstanceNorm3d(4, affine=True),
     (2, 3, 5, 6, 7), lambda y: torch.amax(F.silu(y), dim=(2, 3, 4), keepdim=True), ["silu", "spatial_amax"]),
    ("batchnorm_relu_adaptive_avgpool", lambda: nn.Conv2d(3, 8, 3, padding=1), lambda: nn.BatchNorm2d(8),
     (4, 3, 7, 9), lambda y: F.adaptive_avg_pool2d(F.relu(y), 1).flatten(1), ["relu", "spatial_mean"]),
    ("layernorm_chw_sum", lambda: nn.Conv2d(3, 8, 3), lambda: nn.LayerNorm((8, 7, 8)), (2, 3, 9, 10),
     lambda y: torch.sum(y, dim=(2, 3)), ["spatial_sum"]),
    ("linear_layernorm_amin", lambda: nn.Linear(16, 40), lambda: nn.LayerNorm(40), (5, 16),
     lambda y: torch.amin(F.relu(y), dim=1), ["relu", "amin"]),
    ("linear_batchnorm_mean_keepdim", lambda: nn.Linear(16, 40), lambda: nn.BatchNorm1d(40), (6, 16),
     lambda y: torch.tanh(F.gelu(y).mean(dim=-1, keepdim=True)), ["gelu", "mean", "tanh"]),
]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("anchor, norm, shape, fn, after", [c[1:] for c in NORM_THEN_REDUCE],
                         ids=[c[0] for c in NORM_THEN_REDUCE])
def test_a_reduction_after_the_norm_fuses_into_its_chain(anchor, norm, shape, fn, after, grad, cpu_reference):
    """Global pooling after a conv's GroupNorm, InstanceNorm, BatchNorm (training) or
    LayerNorm over whole channels, and a row reduction after a Linear's LayerNorm or
    BatchNorm1d: one chain to the end of the graph, with the values backward reads."""
    torch.manual_seed(0)
    model = _NormThenReduce(anchor(), norm(), fn)
    expected_model = copy.deepcopy(model)
    x = torch.randn(shape, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert len(fused) == 1 and not refused, [r.reason for r in refused]
    steps = steps_of(fused[0])
    norm_at = next(i for i, s in enumerate(steps) if s in ("groupnorm", "layernorm", "batchnorm_train"))
    assert steps[norm_at + 1:] == after
    assert grad or fused[0].stop.startswith("end of the graph")  # (backward may read the reduced value)
    expected = expected_model(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for name, buffer in expected_model.norm.named_buffers():  # BatchNorm's running statistics
        torch.testing.assert_close(getattr(model.norm, name), buffer, atol=1e-6, rtol=1e-5)
    if grad:
        out.sum().backward()
        got = x.grad.clone()
        x.grad = None
        expected.sum().backward()
        torch.testing.assert_close(got, x.grad, atol=1e-5, rtol=1e-5)


REDUCTION_AFTER_NORM_REFUSED = [
    ("groupnorm_of_32_channels", lambda: nn.Conv2d(3, 64, 3), lambda: nn.GroupNorm(2, 64),
     lambda y: y.mean(dim=(2, 3)), "spatial_mean after groupnorm of 32 channels a segment: the kernel reduces at most 16"),
    ("linear_groupnorm", lambda: nn.Linear(16, 32), lambda: nn.GroupNorm(4, 32),
     lambda y: y.sum(dim=1), "sum after a Linear's GroupNorm: the row spans 4 of its groups"),
    ("layernorm_over_the_width", lambda: nn.Conv2d(3, 8, 3), lambda: nn.LayerNorm(8),
     lambda y: y.mean(dim=(2, 3)), "its segments split a conv output's channels"),
    ("over_the_channels", lambda: nn.Conv2d(3, 8, 3), lambda: nn.GroupNorm(4, 8),
     lambda y: y.sum(dim=1), "channel_sum: only one reduction per fused kernel"),
    ("logsumexp", lambda: nn.Linear(16, 32), lambda: nn.LayerNorm(32),
     lambda y: torch.logsumexp(y, dim=1), "only one reduction per fused kernel, or a sum, mean, amax or amin after"),
    ("softmax_then_sum", lambda: nn.Linear(16, 32), lambda: nn.Softmax(dim=1),
     lambda y: y.sum(dim=1), "(here after softmax)"),
]


@pytest.mark.parametrize("anchor, norm, fn, reason", [c[1:] for c in REDUCTION_AFTER_NORM_REFUSED],
                         ids=[c[0] for c in REDUCTION_AFTER_NORM_REFUSED])
def test_a_reduction_after_the_norm_that_does_not_fit_says_why(anchor, norm, fn, reason, cpu_reference):
    torch.manual_seed(0)
    model = _NormThenReduce(anchor(), norm(), fn)
    x = torch.randn((2, 3, 10, 10) if isinstance(model.anchor, nn.Conv2d) else (4, 16))
    out, fused, refused = compile_records(model, x)
    stops = [r.reason for r in refused] + [r.stop for r in fused]
    assert any(reason in why for why in stops), stops
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class _ConvLayerNorm(nn.Module):
    """A conv, x 2, LayerNorm over `normalized` trailing dims (random affine), GELU."""

    def __init__(self, conv, normalized):
        super().__init__()
        self.conv, self.ln = conv, random_layer_norm(normalized)

    def forward(self, x):
        return F.gelu(self.ln(self.conv(x) * 2.0))


CONV_LAYERNORMS = [
    # (id, conv, input shape, normalized_shape)
    ("last_dim_2d", lambda: nn.Conv2d(3, 8, 3), (2, 3, 10, 11), [9]),
    ("plane_2d", lambda: nn.Conv2d(3, 8, 3), (2, 3, 10, 11), [8, 9]),
    ("whole_image_2d", lambda: nn.Conv2d(3, 8, 3), (2, 3, 10, 11), [8, 8, 9]),
    ("last_dim_3d", lambda: nn.Conv3d(3, 4, 2), (2, 3, 5, 6, 7), [6]),
    ("transposed_3d_three_dims", lambda: nn.ConvTranspose3d(3, 4, 2), (2, 3, 5, 6, 7), [6, 7, 8]),
    ("conv1d_whole", lambda: nn.Conv1d(3, 8, 3), (2, 3, 20), [8, 18]),
]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("make, shape, normalized", [c[1:] for c in CONV_LAYERNORMS], ids=[c[0] for c in CONV_LAYERNORMS])
def test_layer_norm_over_trailing_dims_of_a_conv_output(make, shape, normalized, grad):
    """LayerNorm over the last k dims of a conv output: a segment norm (segments of those
    dims' size) with a weight and bias of their shape; in training it also returns the
    statistics backward reads."""
    torch.manual_seed(0)
    model = _ConvLayerNorm(make(), normalized)
    x = torch.randn(shape, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert fused, refused
    assert steps_of(fused[0]) == ["add", "mul", "layernorm", "gelu"] and fused[0].fusion == "conv_layernorm"
    step = json.loads(fused[0].spec)["steps"][2]
    assert step["normalized"] == normalized and step["groups"] * math.prod(normalized) == math.prod(out.shape[1:])
    _like_eager(model, x, out, grad, 1e-4)


def test_layer_norm_over_the_batch_too_is_refused():
    model = ConvChain(nn.Conv2d(3, 8, 3), lambda y: F.layer_norm(y, y.shape))
    x = torch.randn(2, 3, 10, 11)
    out, fused, refused = compile_records(model, x)
    stops = [r.reason for r in refused] + [r.stop for r in fused]
    assert any("is not trailing dims of the conv output's [2, 8, 8, 9] (the batch excluded)" in why for why in stops), stops
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


POOLS = [
    # (id, conv, input shape, fn on the conv's output, expected steps after the folded bias, output shape)
    ("maxpool_2d", lambda: nn.Conv2d(3, 8, 3), (2, 3, 10, 11), lambda y: torch.sigmoid(F.max_pool2d(F.relu(y), 2) + 1.0),
     ["relu", "maxpool", "add", "sigmoid"], (2, 8, 4, 4)),
    ("maxpool_ceil_padding_channel_operand", lambda: nn.Conv2d(3, 8, 3, padding=1), (2, 3, 9, 10),
     lambda y: F.max_pool2d(y, 3, 2, 1, ceil_mode=True) * torch.linspace(0.5, 1.5, 8).view(8, 1, 1), ["maxpool", "mul"],
     (2, 8, 5, 6)),
    ("maxpool_3d_dilated", lambda: nn.Conv3d(3, 8, 2), (2, 3, 6, 7, 8),
     lambda y: F.max_pool3d(F.gelu(y), 2, dilation=(1, 2, 1)), ["gelu", "maxpool"], (2, 8, 2, 2, 3)),
    ("maxpool_transposed", lambda: nn.ConvTranspose2d(3, 8, 3, stride=2), (2, 3, 5, 6), nn.MaxPool2d(2), ["maxpool"],
     (2, 8, 5, 6)),
    ("maxpool_1d", lambda: nn.Conv1d(3, 8, 3), (2, 3, 21), lambda y: F.max_pool1d(torch.tanh(y), 3, 2) - 0.5,
     ["tanh", "maxpool", "sub"], (2, 8, 9)),
    ("avgpool_padding_not_counted", lambda: nn.Conv2d(3, 8, 3), (2, 3, 10, 11),
     lambda y: F.avg_pool2d(torch.tanh(y), 3, 2, 1, ceil_mode=True, count_include_pad=False), ["tanh", "avgpool"],
     (2, 8, 5, 5)),
    ("avgpool_divisor_override", lambda: nn.Conv2d(3, 8, 3), (2, 3, 10, 11),
     lambda y: F.avg_pool2d(y, 2, divisor_override=3) + 1.0, ["avgpool", "add"], (2, 8, 4, 4)),
    ("avgpool_3d", lambda: nn.Conv3d(3, 8, 2), (2, 3, 5, 7, 6), nn.AvgPool3d((2, 3, 2), padding=(1, 1, 0)), ["avgpool"],
     (2, 8, 3, 2, 2)),
    ("avgpool_1d_full_operand", lambda: nn.Conv1d(3, 8, 3), (2, 3, 21),
     lambda y: F.avg_pool1d(F.relu(y), 4, padding=2) + torch.linspace(0.0, 1.0, 2 * 8 * 5).view(2, 8, 5),
     ["relu", "avgpool", "add"], (2, 8, 5)),
]


@pytest.mark.parametrize("make, shape, fn, steps, out_shape", [c[1:] for c in SPATIAL + CHANNEL + POOLS],
                         ids=[c[0] for c in SPATIAL + CHANNEL + POOLS])
def test_reductions_of_a_conv_output(make, shape, fn, steps, out_shape):
    """Global pooling (a reduction over every spatial dim: one value per (row, channel),
    then per-channel and scalar operands and views to [rows, C] or [rows, C, 1, ...]);
    softmax, log_softmax and the reductions over the channels (dim 1), per pixel;
    MaxPool and AvgPool 1d/2d/3d (kernel, stride, padding, dilation, ceil_mode,
    count_include_pad, divisor_override); then more steps (per-channel, full and scalar
    operands)."""
    torch.manual_seed(0)
    model = ConvChain(make(), fn)
    x = torch.randn(shape)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    reduction = next(s for s in steps if s.startswith(("spatial_", "channel_")) or s.endswith("pool"))
    assert steps_of(fused[0]) == ["add"] + steps and fused[0].fusion == f"conv_{reduction}"
    assert out.shape == out_shape
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class BmmChain(nn.Module):
    """torch.bmm(x, w) (or the 3-D matmul `x @ w`) of x[B, 6, 8] and a weight w[B, 8, 12],
    then `fn` on the [B, 6, 12] product: rows B, channels 6, a plane of 12 (a Conv1d's)."""

    def __init__(self, fn, batch=4, matmul=False):
        super().__init__()
        self.w = nn.Parameter(torch.randn(batch, 8, 12) / 3)
        self.fn, self.matmul = fn, matmul

    def forward(self, x):
        return self.fn(x @ self.w if self.matmul else torch.bmm(x, self.w))


BMMS = [
    # (id, fn on the bmm's [4, 6, 12] output, through matmul, expected steps, output shape)
    ("instance_norm_relu", lambda y: F.relu(F.instance_norm(y)), False, ["groupnorm", "relu"], (4, 6, 12)),
    ("instance_norm_affine", nn.InstanceNorm1d(6, affine=True), True, ["groupnorm"], (4, 6, 12)),
    ("group_norm_silu", lambda y: F.silu(F.group_norm(y, 2)), True, ["groupnorm", "silu"], (4, 6, 12)),
    ("layer_norm_over_the_plane", lambda y: F.gelu(F.layer_norm(y, (12,))), False, ["layernorm", "gelu"], (4, 6, 12)),
    ("scaled_softmax", lambda y: F.softmax(y * 0.3, dim=-1), False, ["mul", "spatial_softmax"], (4, 6, 12)),
    ("log_softmax_channel_operand", lambda y: F.log_softmax(y, dim=2) * torch.linspace(0.5, 1.5, 6).view(6, 1),
     True, ["spatial_log_softmax", "mul"], (4, 6, 12)),
    ("softmax_over_channels", lambda y: F.softmax(y, dim=1) + 1.0, False, ["channel_softmax", "add"], (4, 6, 12)),
    ("mean_over_the_plane", lambda y: torch.tanh(y.mean(-1)), False, ["spatial_mean", "tanh"], (4, 6)),
    ("maxpool1d", lambda y: F.max_pool1d(F.relu(y), 2), False, ["relu", "maxpool"], (4, 6, 6)),
    ("channel_scale_residual", lambda y: F.relu(y * torch.linspace(0.5, 1.5, 6).view(6, 1)
                                                + torch.linspace(-1.0, 1.0, 288).view(4, 6, 12)),
     False, ["mul", "add", "relu"], (4, 6, 12)),
]


@pytest.mark.parametrize("fn, matmul, steps, out_shape", [c[1:] for c in BMMS], ids=[c[0] for c in BMMS])
def test_bmm_chains(fn, matmul, steps, out_shape):
    """A batched matmul starts a chain: its [B, M, N] product is read as a Conv1d's output
    (channels M, a plane of N), so InstanceNorm, GroupNorm, LayerNorm over N, softmax over
    N (per plane) or over M (per column), global and windowed pooling and per-channel
    operands mean what they mean after a Conv1d."""
    torch.manual_seed(0)
    model = BmmChain(fn, matmul=matmul)
    x = torch.randn(4, 6, 8)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    named = next((s for s in steps if s not in ("relu", "silu", "gelu", "tanh", "mul", "add")), "pointwise")
    assert steps_of(fused[0]) == steps and fused[0].fusion == f"bmm_{named}"
    assert out.shape == out_shape
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class _Baddbmm(nn.Module):
    """torch.baddbmm(input, x, w, alpha=alpha) with an input of `input_shape`, then `fn`."""

    def __init__(self, input_shape, fn, alpha=1.0, beta=1.0):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 12))
        self.input = nn.Parameter(torch.randn(input_shape))
        self.fn, self.alpha, self.beta = fn, alpha, beta

    def forward(self, x):
        return self.fn(torch.baddbmm(self.input, x, self.w, beta=self.beta, alpha=self.alpha))


# (id, input shape, alpha, fn, the steps its chain fuses)
BADDBMMS = [
    ("full_input_softmax", (4, 6, 12), 1.0, lambda y: F.softmax(y, dim=-1), ["spatial_softmax"]),
    ("attention_bias_scaled", (6, 12), 0.125, lambda y: F.softmax(y, dim=-1), ["spatial_softmax"]),
    ("per_channel_instance_norm", (6, 1), 1.0, lambda y: F.relu(F.instance_norm(y)), ["groupnorm", "relu"]),
    ("one_element_gelu", (1,), 2.0, F.gelu, ["gelu"]),
    # In training the forward graph computes backward's mask (of the minimum, the
    # leaky_relu, the amax) from the baddbmm's value: work for backward only, which reads
    # the fused op's value as backward would read it saved.
    ("minimum_mish_mean", (4, 6, 12), 0.5, lambda y: F.mish(torch.minimum(y, torch.tensor(0.3))).mean(-1),
     ["minimum", "mish", "spatial_mean"]),
    ("per_channel_leaky_relu_sum", (6, 1), 1.0, lambda y: F.leaky_relu(y, 0.1).sum(-1), ["leaky_relu", "spatial_sum"]),
    ("attention_bias_amax", (6, 12), 0.125, lambda y: y.amax(-1), ["spatial_amax"]),
]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("input_shape, alpha, fn, steps", [c[1:] for c in BADDBMMS], ids=[c[0] for c in BADDBMMS])
def test_baddbmm_is_a_bmm_anchor_with_its_input_added(input_shape, alpha, fn, steps, grad, cpu_reference):
    """baddbmm(input, x, w, alpha=a) is a bmm anchor whose library call adds the input
    (full, per position, per channel or one value) and alpha, rounding once as eager
    does; the chain starts after it, in forward and training graphs."""
    torch.manual_seed(0)
    model = _Baddbmm(input_shape, fn, alpha)
    x = torch.randn(4, 6, 8, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert len(fused) == 1 and not refused, [r.reason for r in refused]
    assert steps_of(fused[0]) == steps and fused[0].fusion.startswith("bmm_")
    anchor = json.loads(fused[0].spec)["anchor"]
    assert (anchor["kind"], anchor["has_bias"], anchor["alpha"]) == ("bmm", True, alpha)
    expected = model(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if grad:
        out.sum().backward()
        got = [x.grad.clone(), model.input.grad.clone(), model.w.grad.clone()]
        x.grad = model.input.grad = model.w.grad = None
        expected.sum().backward()
        for a, b in zip(got, [x.grad, model.input.grad, model.w.grad]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("beta, alpha, fn, reason", [
    (0.5, 1.0, torch.tanh, "baddbmm with beta != 1"),
    (1.0, 0.0, torch.tanh, "baddbmm with alpha == 0"),
    (1.0, 1.0, lambda y: y, "no epilogue to fuse"),
], ids=["beta", "alpha_zero", "nothing_after"])
def test_baddbmm_that_does_not_fit_says_why(beta, alpha, fn, reason, cpu_reference):
    model = _Baddbmm((4, 6, 12), fn, alpha, beta)
    x = torch.randn(4, 6, 8)
    out, fused, refused = compile_records(model, x)
    assert not fused and any(reason in r.reason for r in refused), [r.reason for r in refused]
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_baddbmm_read_outside_its_chain_is_eagers_value(cpu_reference):
    """The library call computes the baddbmm's value as eager does (rounded once), so
    the graph may read it outside the chain: `sin` of it after the softmax that stops
    the chain, the value returned beside the chain's result, an earlier value's operand
    inside the chain, or saved for backward."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 8)
    for fn in (lambda y: F.softmax(y, dim=-1) / torch.sin(y), lambda y: (y, F.softmax(y, dim=-1)),
               lambda y: F.gelu(y) * y, lambda y: y + torch.tanh(y)):
        model = _Baddbmm((4, 6, 12), fn, alpha=-0.5)
        out, fused, refused = compile_records(model, x)
        assert len(fused) == 1 and not refused, [r.reason for r in refused]
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)  # (a tuple where fn returns one)
    model = _Baddbmm((4, 6, 12), F.gelu, alpha=-0.5)
    _, fused, refused = compile_records(model, torch.randn(4, 6, 8, requires_grad=True), grad=True)
    assert len(fused) == 1 and not refused, [r.reason for r in refused]


class _BatchOfOneAsMm(nn.Module):
    """A bmm of a batch of one as Inductor's joint-graph pass `bmm_to_mm` leaves it on
    CUDA tensors: mm(x.squeeze(0), w.squeeze(0)).unsqueeze(0), then `fn`."""

    def __init__(self, fn):
        super().__init__()
        self.w = nn.Parameter(torch.randn(1, 8, 12) / 3)
        self.fn = fn

    def forward(self, x):
        return self.fn(torch.mm(x.squeeze(0), self.w.squeeze(0)).unsqueeze(0))


@pytest.mark.parametrize("fn, steps", [
    (lambda y: F.softmax(y * 0.125, dim=-1), ["mul", "spatial_softmax"]),
    (lambda y: F.relu(F.instance_norm(y)), ["groupnorm", "relu"]),
], ids=["softmax", "instance_norm"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_a_bmm_of_a_batch_of_one_spelled_as_mm(fn, steps, grad):
    """The mm + unsqueeze(0) spelling of a batch-one bmm fuses as the bmm it is: softmax
    over the last dim is per plane, InstanceNorm per channel, as for any bmm; in training
    (the joint graph restored too) the gradients are eager's."""
    torch.manual_seed(0)
    model = _BatchOfOneAsMm(fn)
    x = torch.randn(1, 6, 8, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert [r.fusion for r in fused] == [f"bmm_{steps[-2] if steps[-1] == 'relu' else steps[-1]}"], refused
    assert steps_of(fused[0]) == steps
    want = model(x)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if grad:
        g = torch.randn_like(want)
        ours = torch.autograd.grad(out, [x, model.w], g)
        theirs = torch.autograd.grad(want, [x, model.w], g)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_softmax_over_the_plane_of_a_conv1d_output():
    model = ConvChain(nn.Conv1d(3, 8, 3), lambda y: F.log_softmax(F.relu(y), dim=-1) * 2.0)
    x = torch.randn(2, 3, 20)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    assert steps_of(fused[0]) == ["add", "relu", "spatial_log_softmax", "mul"]
    assert fused[0].fusion == "conv_spatial_log_softmax"
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class _HeadsAttention(nn.Module):
    """Multi-head self-attention: q @ k^T of [B, heads, L, d] (a bmm of [B*heads, L, d]
    viewed back to 4-D), / 2, softmax over the keys, @ v."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, 4, 4).permute(2, 0, 3, 1, 4)
        attention = F.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)
        return (attention @ v).transpose(1, 2).reshape(b, length, 16)


class _EinsumHeads(nn.Module):
    """The scores of _HeadsAttention written with einsum ("bhid,bhjd->bhij": a bmm whose
    product einsum views with a unit dim, permutes and views back), softmax, then einsum
    with v and a batched weight ("bij,bjk->bik") and GELU."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.w = nn.Parameter(torch.randn(8, 4, 5) / 2)

    def forward(self, x):
        b, length, _ = x.shape
        q, k, v = self.qkv(x).view(b, length, 3, 4, 4).permute(2, 0, 3, 1, 4)
        attention = F.softmax(torch.einsum("bhid,bhjd->bhij", q, k) * 0.5, dim=-1)
        out = (attention @ v).reshape(b * 4, length, 4)
        return F.gelu(torch.einsum("bij,bjk->bik", out, self.w))


REGROUPED = [
    # (id, model, input shape, fusions, the first one's steps, output shape)
    ("attention_heads", _HeadsAttention, (2, 6, 16), "bmm_spatial_softmax", ["div", "spatial_softmax"], (2, 6, 16)),
    ("einsum_heads", _EinsumHeads, (2, 6, 16), "bmm_spatial_softmax bmm_pointwise", ["mul", "spatial_softmax"],
     (8, 6, 5)),
    ("conv_softmax_over_pixels", lambda: ConvChain(nn.Conv2d(3, 4, 3), lambda y: F.softmax(y.flatten(2), -1).view_as(y) * 2.0),
     (2, 3, 9, 9), "conv_spatial_softmax", ["add", "spatial_softmax", "mul"], (2, 4, 7, 7)),
    ("conv_flatten_mean", lambda: ConvChain(nn.Conv2d(3, 4, 3), lambda y: torch.tanh(F.relu(y).view(2, 4, -1).mean(2))),
     (2, 3, 9, 9), "conv_spatial_mean", ["add", "relu", "spatial_mean", "tanh"], (2, 4)),
]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("make, shape, fusion, steps, out_shape", [c[1:] for c in REGROUPED], ids=[c[0] for c in REGROUPED])
def test_views_that_regroup_a_conv_or_bmm_output(make, shape, fusion, steps, out_shape, grad):
    """A view that keeps the channels as one dim, each channel's elements in the dims
    after it (the rows regrouped: 4-D attention scores, einsum's views; the spatial dims
    flattened), continues the chain: softmax over the last dim is then over each plane, a mean over it global
    pooling; the fused op's output is viewed back."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(shape, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert [r.fusion for r in fused] == fusion.split() and steps_of(fused[0]) == steps
    assert out.shape == out_shape
    _like_eager(model, x, out, grad, 1e-4)


SQUEEZED = [
    # (id, fn on a Conv2d(3 -> 8, k3) output of 2 x 3 x 9 x 9, steps after the folded bias, output shape)
    ("pooled_squeezed_twice", lambda y: torch.sigmoid(F.adaptive_avg_pool2d(F.relu(y), 1).squeeze(-1).squeeze(-1)) * 2,
     ["relu", "spatial_mean", "sigmoid", "mul"], (2, 8)),
    ("pooled_squeezed_whole", lambda y: torch.sigmoid(F.adaptive_avg_pool2d(y, 1).squeeze()), ["spatial_mean", "sigmoid"],
     (2, 8)),
    ("pooled_unsqueezed_back", lambda y: torch.tanh(y.mean((2, 3)).unsqueeze(-1)) * torch.linspace(0.5, 1.5, 8).view(8, 1),
     ["spatial_mean", "tanh", "mul"], (2, 8, 1)),
    ("channels_reduced_squeezed", lambda y: torch.tanh(y.amax(1, keepdim=True).squeeze(1)), ["channel_amax", "tanh"],
     (2, 7, 7)),
]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic_batch"])
@pytest.mark.parametrize("fn, steps, out_shape", [c[1:] for c in SQUEEZED], ids=[c[0] for c in SQUEEZED])
def test_squeezes_of_a_reduced_conv_output(fn, steps, out_shape, dynamic):
    """squeeze and unsqueeze continue a chain like the views they are: the unit dims of a
    pooled [N, C, 1, 1] or of a [N, 1, H, W] reduced over the channels come and go; the
    fused op's output is viewed to the last one's shape (a dynamic batch as -1)."""
    torch.manual_seed(0)
    model = ConvChain(nn.Conv2d(3, 8, 3), fn)
    x = torch.randn(2, 3, 9, 9)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 0)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    assert steps_of(fused[0]) == ["add"] + steps and fused[0].stop == "end of the graph"
    assert out.shape == out_shape
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


REGROUPED_REFUSED = [
    ("mean_keepdim", lambda: ConvChain(nn.Conv2d(3, 4, 3), lambda y: F.relu(y).flatten(2).mean(-1, keepdim=True)),
     (2, 3, 9, 9), "or a reduction over the flattened spatial dims without keepdim"),
    ("amax_of_4d_scores", lambda: BmmChain(lambda y: y.view(2, 2, 6, 12).amax(-1) * 2.0, batch=4), (4, 6, 8),
     "amax after a view to [2, 2, 6, 12] that regroups the rows of a conv or bmm output"),
    ("mean_of_4d_scores", lambda: BmmChain(lambda y: y.view(2, 2, 6, 12).mean((2, 3)), batch=4), (4, 6, 8),
     "mean after a view to [2, 2, 6, 12] that regroups the rows"),
]


@pytest.mark.parametrize("make, shape, reason", [c[1:] for c in REGROUPED_REFUSED], ids=[c[0] for c in REGROUPED_REFUSED])
def test_shape_changing_steps_after_a_regrouping_view_are_refused(make, shape, reason):
    model = make()
    x = torch.randn(shape)
    out, fused, refused = compile_records(model, x)
    stops = [r.reason for r in refused] + [r.stop for r in fused]
    assert any(reason in why for why in stops), stops
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


FEATURE_POOLS = [
    # (id, fn on a Linear(16 -> 32) output (addmm keeps its bias), expected steps, output shape)
    ("avgpool_module", lambda y: F.gelu(nn.AvgPool1d(4)(y.unsqueeze(1)).squeeze(1)) * 2.0,
     ["avgpool", "gelu", "mul"], (5, 8)),
    ("maxpool_padded_overlapping", lambda y: torch.sigmoid(F.max_pool1d(F.relu(y).unsqueeze(1), 3, 2, 1).squeeze(1)),
     ["relu", "maxpool", "sigmoid"], (5, 16)),
    ("maxpool_keeps_the_unit_dim", lambda y: F.max_pool1d(y.unsqueeze(1), 2) - 1.0, ["maxpool", "sub"], (5, 1, 16)),
    ("avgpool_ceil_uncounted_full_operand",
     lambda y: F.avg_pool1d(y.unsqueeze(1), 3, 2, 1, ceil_mode=True, count_include_pad=False).squeeze(1)
     + torch.linspace(0.0, 1.0, 5 * 17).view(5, 17), ["avgpool", "add"], (5, 17)),
]


@pytest.mark.parametrize("fn, steps, out_shape", [c[1:] for c in FEATURE_POOLS], ids=[c[0] for c in FEATURE_POOLS])
def test_pooling_windows_over_a_linear_outputs_features(fn, steps, out_shape):
    """Linear -> unsqueeze(1) -> MaxPool1d / AvgPool1d -> squeeze(1) (or not), then more steps."""
    torch.manual_seed(0)
    model = Chain(fn)
    x = torch.randn(5, 16)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    pool = next(s for s in steps if s.endswith("pool"))
    assert steps_of(fused[0]) == steps and fused[0].fusion == f"linear_{pool}"
    assert out.shape == out_shape
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_a_per_feature_operand_after_pooling_the_features_is_refused():
    model = Chain(lambda y: F.avg_pool1d(y.unsqueeze(1), 2).squeeze(1) * torch.linspace(0.5, 1.5, 16))
    x = torch.randn(5, 16)
    out, fused, refused = compile_records(model, x)
    assert steps_of(fused[0]) == ["avgpool"]
    assert "mul: a per-feature operand after pooling the features" in fused[0].stop
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


POOLS_REFUSED = [
    # (id, fn on the conv's output, grad, reason)
    ("maxpool_training", lambda y: F.max_pool2d(y, 2), True,
     "maxpool: the graph also uses its indices (in training, for backward), which the pool kernel does not write"),
    ("avgpool_training", lambda y: F.avg_pool2d(torch.tanh(y), 2), True,
     "avgpool: the graph also uses tanh (before the pool; in training, saved for backward)"),
    ("pool_after_pool", lambda y: F.max_pool2d(F.avg_pool2d(y, 2), 2), False, "only one reduction per fused kernel"),
    ("unpooled_value_used_after_the_pool", lambda y: F.max_pool2d(y, 1) * y, False,
     "maxpool: the graph also uses convolution (before the pool"),
]


@pytest.mark.parametrize("fn, grad, reason", [c[1:] for c in POOLS_REFUSED], ids=[c[0] for c in POOLS_REFUSED])
def test_pooling_windows_that_do_not_fit_say_why(fn, grad, reason):
    model = ConvChain(nn.Conv2d(3, 8, 3), fn)
    x = torch.randn(2, 3, 10, 11, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    stops = [r.reason for r in refused] + [r.stop for r in fused]
    assert any(reason in why for why in stops), stops
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_matmul_with_nd_input_and_no_bias():
    w = torch.randn(16, 32)
    model = Chain(lambda x: F.mish(x @ w))
    model.linear = nn.Identity()
    x = torch.randn(2, 3, 16)
    out, fused, refused = compile_records(model, x)
    assert fused and steps_of(fused[0]) == ["mish"], refused
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_in_half_precision_reads_through_the_float32_conversions(dtype):
    model = Chain(nn.Sequential(nn.RMSNorm(32), nn.GELU())).to(dtype)
    x = torch.randn(4, 16, dtype=dtype)
    out, fused, refused = compile_records(model, x)
    assert fused, refused
    assert steps_of(fused[0]) == ["rmsnorm", "mul", "gelu"]
    assert out.dtype == dtype
    torch.testing.assert_close(out, model(x), atol=2e-2, rtol=2e-2)


def test_chain_ending_in_float32_is_cut_back_before_the_conversion():
    # The graph's result is float32: the fused op returns bf16, so the chain ends at the relu.
    model = Chain(lambda x: torch.sigmoid(torch.relu(x).float())).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    out, fused, refused = compile_records(model, x)
    assert steps_of(fused[0]) == ["relu"]
    assert "while widened to float32" in fused[0].stop
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, model(x))


def test_narrowing_inside_a_float32_chain_is_refused():
    model = Chain(lambda x: torch.relu(x).to(torch.bfloat16).float() * 2.0)
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert steps_of(fused[0]) == ["relu"] and "would round inside the chain" in fused[0].stop
    # Inductor, which runs the rest, drops the bf16 round trip (it does not emulate
    # precision casts by default): equal to eager within bf16 rounding only.
    torch.testing.assert_close(out, model(x), atol=1e-2, rtol=1e-2)


# ------------------------------------------------------- one row per step


def test_the_fuzzer_draws_every_step_of_the_vocabulary():
    import fuzzer

    from lowering import VOCABULARY

    assert fuzzer.drawn_steps() == set(VOCABULARY), fuzzer.drawn_steps() ^ set(VOCABULARY)


def test_the_readme_table_names_every_step():
    import pathlib
    import re

    from lowering import VOCABULARY

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("| kind | steps |"):readme.index("One reduction or normalization")]
    named = set(re.findall(r"`([a-z_][a-z0-9_]*)", table))
    assert set(VOCABULARY) <= named, sorted(set(VOCABULARY) - named)


def test_every_op_the_matcher_reads_is_held_back_from_decomposition():
    # The table AOTAutograd decomposes with holds no overload of an op a vocabulary row
    # reads (else the matcher would only ever see its decomposition).
    from fusion_backend import backend

    from lowering import HELD_BACK_OPS, VOCABULARY

    table, _ = backend._tables()
    read = {op.overloadpacket for kind in VOCABULARY.values() for op, _ in kind.forms}
    read |= {op for kind in VOCABULARY.values() for op in kind.holds}
    assert read <= set(HELD_BACK_OPS)
    assert not [op for packet in read for op in backend._overloads([packet]) if op in table]


def test_a_chain_that_reaches_the_next_linear_says_so():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    _, fused, _ = compile_records(model, torch.randn(4, 16))
    assert fused[0].stop.endswith("is the next matrix op (addmm.default), an anchor of its own"), fused[0].stop



class _NormThenLinear(nn.Module):
    """A GroupNorm with no anchor before it (held back, never fused), then a Linear chain."""

    def __init__(self):
        super().__init__()
        self.gn, self.linear = nn.GroupNorm(4, 16), nn.Linear(16, 8)

    def forward(self, x):
        return torch.relu(self.linear(self.gn(x)))


def test_held_back_ops_that_did_not_fuse_reach_inductor_with_their_metadata(monkeypatch):
    # Inductor names and groups its kernels by the nodes' `original_aten` and source
    # metadata; a decomposition that drops them changes Inductor's code for the graph.
    from fusion_backend import backend

    graphs = []
    real = backend.compile_fx_inner
    monkeypatch.setattr(backend, "compile_fx_inner", lambda gm, *a, **k: (graphs.append(gm), real(gm, *a, **k))[1])
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    torch.manual_seed(0)
    model, x = _NormThenLinear(), torch.randn(32, 16)
    torch._dynamo.reset()
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        out = torch.compile(model, backend="fusedepi")(x)
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert [r.status for rep in reports for r in rep.records] == ["fused"]
    nodes = [n for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert not any(n.target is torch.ops.aten.native_group_norm.default for n in nodes)
    norm = [n for n in nodes if str(n.meta.get("original_aten")) == "aten.native_group_norm.default"]
    assert norm and all(n.meta.get("original_aten") for n in nodes), [(n.name, n.meta.get("original_aten")) for n in nodes]
    # The output keeps what compile_fx put there: Inductor keeps the strides of the
    # outputs `user_visible_output_idxs` lists, and chooses the others' layout itself.
    output = next(n for n in graphs[0].graph.nodes if n.op == "output")
    assert output.meta.get("user_visible_output_idxs") == [0], output.meta


def test_a_graph_where_nothing_fuses_is_compiled_by_inductor_as_it_stands(monkeypatch):
    # Nothing of fusedepi's is left in such a graph: Inductor gets Dynamo's graph and
    # its own decompositions, as under torch.compile(m).
    from fusion_backend import backend

    calls = []
    real = backend.compile_fx
    metas = []
    monkeypatch.setattr(backend, "compile_fx",
                        lambda gm, ex, **k: (calls.append(sorted(k)), metas.append(dict(gm.meta)), real(gm, ex, **k))[2])
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "0")  # a CPU graph: no chain fuses
    model, x = nn.Sequential(nn.Linear(16, 32), nn.GroupNorm(4, 32), nn.Tanh()), torch.randn(8, 16)
    torch._dynamo.reset()
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        out = torch.compile(model, backend="fusedepi")(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert calls == [["decompositions", "inner_compile"], []], calls
    assert metas[0] == metas[1] and metas[1], metas  # the first attempt had Dynamo's record too
    # In training too: the forward's compile hands over before the backward's, which is Inductor's.
    calls.clear()
    torch._dynamo.reset()
    x.requires_grad_(True)
    out = torch.compile(model, backend="fusedepi")(x)
    out.sum().backward()
    grad, x.grad = x.grad, None
    model(x).sum().backward()
    torch.testing.assert_close(grad, x.grad, atol=1e-5, rtol=1e-5)
    assert calls == [["decompositions", "inner_compile"], []], calls


@pytest.mark.parametrize("make, fn", [
    (lambda: nn.Linear(16, 32), lambda y: F.gelu(F.avg_pool1d(y.unsqueeze(1), 4).squeeze(1))),
    (lambda: nn.Conv1d(3, 8, 3), lambda y: torch.sigmoid(F.avg_pool1d(y * 2.0, 2))),
], ids=["linear_features", "conv1d"])
def test_a_1d_pool_whose_input_view_is_saved_says_why(make, fn):
    # A 1-D pool runs as a 2-D one between unsqueeze and squeeze; in training its
    # backward keeps the unsqueezed input, which the pool kernel does not write.
    torch.manual_seed(0)
    model = ConvChain(make(), fn)
    x = torch.randn(5, 16, requires_grad=True) if isinstance(model.conv, nn.Linear) else \
        torch.randn(2, 3, 12, requires_grad=True)
    out, fused, refused = compile_records(model, x, grad=True)
    stops = [r.reason for r in refused] + [r.stop for r in fused]
    assert any("avgpool: the graph also uses unsqueeze" in why and "a view of the values before the pool" in why
               for why in stops), stops
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
