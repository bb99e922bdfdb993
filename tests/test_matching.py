"""GPU-free: what the matcher fuses and refuses, on real graphs through the real backend.

Chains on CPU tensors are fused through the plain-torch reference
(FUSEDEPI_CPU_REFERENCE=1), so every test also checks the rewritten graph
against eager. (About 1,120 lines: one file per step of the data flow, this one the
matcher's.)
"""

import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import (SMALL_WORKLOADS, Chain, close_to_float64, compile_records, sigmoid_times_x, silu_spelled,
                     steps_of)

pytestmark = pytest.mark.usefixtures("cpu_reference")


@pytest.mark.parametrize("name", list(SMALL_WORKLOADS))
def test_workload_fuses_and_matches_eager(name):
    factory, shape, fusion = SMALL_WORKLOADS[name]
    torch.manual_seed(0)
    model = factory()
    eager = copy.deepcopy(model)
    x = torch.rand(shape)
    out, fused, refused = compile_records(model, x)
    assert [r.fusion for r in fused] == [fusion], refused
    torch.testing.assert_close(out, eager(x), atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(model.buffers(), eager.buffers()):  # BatchNorm running stats
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_workload_chain_covers_every_epilogue_node():
    factory, shape, _ = SMALL_WORKLOADS["4"]
    _, fused, _ = compile_records(factory(), torch.rand(shape))
    assert steps_of(fused[0]) == ["groupnorm", "silu", "mul", "silu"]
    assert {"addmm", "native_group_norm", "sigmoid", "mul", "mul_1", "sigmoid_1", "mul_2"} <= set(fused[0].nodes)


@pytest.mark.parametrize(
    "fn, steps",
    [
        (F.gelu, ["gelu"]),
        (lambda x: F.gelu(x, approximate="tanh"), ["gelu_tanh"]),
        (F.silu, ["silu"]),
        (silu_spelled, ["silu"]),
        (sigmoid_times_x, ["silu"]),
        (lambda x: F.leaky_relu(x, 0.2), ["leaky_relu"]),
        (lambda x: torch.tanh(x) - 1.5, ["tanh", "sub"]),
        (lambda x: 1.5 - torch.tanh(x), ["tanh", "sub"]),
        (lambda x: torch.sigmoid(x) / 3.0, ["sigmoid", "div"]),
        (lambda x: x + x, ["add"]),  # the chain's own value
    ],
    ids=["gelu_erf", "gelu_tanh", "silu", "x_sigmoid_x", "sigmoid_x_x", "leaky_0.2", "tanh_sub", "rsub", "div", "self_add"],
)
def test_activation_forms(fn, steps):
    model = Chain(fn, bias=False)
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert steps_of(fused[0]) == steps
    torch.testing.assert_close(out, model(x))


def test_gelu_forms_are_distinct_kernels():
    _, erf, _ = compile_records(Chain(F.gelu), torch.randn(4, 16))
    _, tanh, _ = compile_records(Chain(lambda x: F.gelu(x, approximate="tanh")), torch.randn(4, 16))
    assert erf[0].spec != tanh[0].spec


def test_leaky_relu_slope_is_exact():
    import json

    _, fused, _ = compile_records(Chain(lambda x: F.leaky_relu(x, 0.013), bias=False), torch.randn(4, 16))
    assert json.loads(fused[0].spec)["steps"][0]["consts"] == [0.013]
    _, default, _ = compile_records(Chain(F.leaky_relu, bias=False), torch.randn(4, 16))
    assert json.loads(default[0].spec)["steps"][0]["consts"] == [0.01]


class _ConvPReLU(nn.Module):
    """Conv2d -> nn.PReLU (one slope, or one a channel) -> + 1."""

    def __init__(self, slopes):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.act = nn.PReLU(slopes)

    def forward(self, x):
        return self.act(self.conv(x)) + 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model, steps, operand", [
    (lambda: Chain(nn.PReLU(), bias=True), ["prelu"], "one"),
    (lambda: Chain(nn.PReLU(32), bias=True), ["prelu"], "channel"),
    (lambda: _ConvPReLU(1), ["prelu", "add"], "one"),  # after the conv's bias, where that is a step
    (lambda: _ConvPReLU(8), ["prelu", "add"], "channel"),
], ids=["linear_one", "linear_per_feature", "conv_one", "conv_per_channel"])
def test_prelu_is_a_step_with_its_slopes_an_operand(model, steps, operand, dtype):
    # where(x > 0, x, w * x), nn.PReLU's form: its weight read as mul's operands are.
    torch.manual_seed(0)
    m = model().to(dtype)
    with torch.no_grad():
        m.act.weight.uniform_(-0.5, 0.5) if hasattr(m, "act") else m.fn.weight.uniform_(-0.5, 0.5)
    x = torch.randn(2, 3, 9, 9) if isinstance(m, _ConvPReLU) else torch.randn(4, 16)
    x = x.to(dtype)
    x.view(-1)[:3] = torch.tensor([float("nan"), 0.0, -0.0])
    out, fused, refused = compile_records(m, x)
    assert len(fused) == 1 and steps_of(fused[0])[-len(steps):] == steps, refused
    prelu = next(s for s in json.loads(fused[0].spec)["steps"] if s["name"] == "prelu")
    assert prelu["operand"] == operand
    # bf16 within a rounding (the conv's bias is a step of the chain, so its sum is rounded
    # once more than eager's, as with any step after it); float32 Linear bit for bit, a
    # float32 conv within a few of its roundings: CPU eager's conv (oneDNN) adds its bias
    # as the chain does on some CPUs, not on others (an AMD EPYC with AVX2 alone: 3.6e-7
    # off at most, 1 - 2 ulps of values about 1).
    conv = isinstance(m, _ConvPReLU)
    tol = (1e-6 if conv else 0) if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, m(x), equal_nan=True, atol=tol, rtol=tol)


def test_prelu_spelled_with_a_number_is_leaky_relu_and_other_wheres_are_not_prelu():
    x = torch.randn(4, 16)
    _, fused, _ = compile_records(Chain(lambda y: torch.where(y > 0, y, 0.25 * y), bias=False), x)
    assert steps_of(fused[0]) == ["leaky_relu"] and json.loads(fused[0].spec)["steps"][0]["consts"] == [0.25]
    w = nn.Parameter(torch.rand(32))
    for fn in (lambda y: torch.where(y >= 0, y, w * y),  # another comparison
               lambda y: torch.where(y > 0, y * w, y),  # the product on the other side
               lambda y: torch.where(y > 0.5, y, w * y)):  # another threshold
        model = Chain(fn, bias=False)
        out, fused, _ = compile_records(model, x)
        assert not fused or "prelu" not in steps_of(fused[0]), steps_of(fused[0])
        with torch.no_grad():
            torch.testing.assert_close(out, model(x))


def test_prelu_in_training_keeps_eagers_gradients():
    # Backward reads the step's input (saved) and the slopes, not the comparison: the
    # step fuses, and the gradients are eager's.
    torch.manual_seed(0)
    model = _ConvPReLU(8)
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, 9, 9)
    out, fused, refused = compile_records(model, x, grad=True)
    assert len(fused) == 1 and "prelu" in steps_of(fused[0]), refused
    out.sum().backward()
    eager(x).sum().backward()
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-5)


def _softmax_amax(y, dim=-1):
    e = torch.exp(y - y.amax(dim, keepdim=True))
    return e / e.sum(dim, keepdim=True)


def _softmax_max(y, dim=1):
    from benchmarks.zoo import softmax_spelled  # the maximum by max(...)[0]

    return softmax_spelled(y, dim)


def _log_softmax_lse(z):
    return z - torch.logsumexp(z, dim=1, keepdim=True)


class _ConvThen(nn.Module):
    """Conv2d (no bias) -> `fn`."""

    def __init__(self, fn):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=False)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.conv(x))


@pytest.mark.parametrize("model, step", [
    (lambda: Chain(_softmax_amax), "softmax"),
    (lambda: Chain(_softmax_max), "softmax"),
    (lambda: _ConvThen(lambda y: _softmax_max(y, 1)), "channel_softmax"),
    # after steps (not a multiply by a number: Inductor's joint-graph passes rewrite
    # exp(c * y - max(c * y)) into another form before matching)
    (lambda: Chain(lambda y: _softmax_amax(torch.tanh(y) + 0.5)), "softmax"),
], ids=["amax", "max_values", "conv_channels", "after_steps"])
def test_softmax_written_out_is_the_softmax_step(model, step):
    # exp(y - max) / sum(...): the chain runs through it, and the step is softmax's (one
    # rounding, where eager rounds each op: float32 within 1e-6).
    torch.manual_seed(0)
    m = model()
    x = torch.randn(2, 3, 9, 9) if isinstance(m, _ConvThen) else torch.randn(4, 16)
    out, fused, refused = compile_records(m, x * 30.0)  # large values: only the maximum keeps exp finite
    assert len(fused) == 1 and steps_of(fused[0])[-1] == step, (steps_of(fused[0]) if fused else refused)
    assert fused[0].stop == "end of the graph"
    with torch.no_grad():
        ref = m(x * 30.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def test_softmax_written_out_otherwise_is_not_the_softmax_step():
    # Without the maximum (exp(y) / sum(exp(y)) overflows where softmax does not), the
    # maximum and the sum over different dims, the shifted value read elsewhere too, or
    # y - logsumexp(y) (on a row holding +inf: -inf and NaN where log_softmax is NaN
    # throughout): no softmax step, and the results are eager's, inf and NaN included.
    def read_twice(y):
        s = y - y.amax(-1, keepdim=True)
        e = torch.exp(s)
        return e / e.sum(-1, keepdim=True) + s

    x = torch.randn(4, 16)
    for fn in (lambda y: _log_softmax_lse(y / torch.relu(y[:, :1])),  # +inf and -inf in rows
               lambda y: torch.exp(y) / torch.exp(y).sum(-1, keepdim=True),
               lambda y: torch.exp(y - y.amax(0, keepdim=True)) / torch.exp(y - y.amax(0, keepdim=True)).sum(
                   1, keepdim=True),
               read_twice):
        model = Chain(fn)
        out, fused, refused = compile_records(model, x)
        assert not any(s in ("softmax", "log_softmax") for r in fused for s in steps_of(r)), \
            [steps_of(r) for r in fused]
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), atol=1e-6, rtol=1e-5, equal_nan=True)


def _BertLayerNorm(n):
    """The zoo's LayerNorm as older BERT code writes it (x - mean written twice, the
    variance by pow and mean, then a weight and a bias), its weight and bias drawn."""
    from benchmarks.zoo import BertLayerNorm

    norm = BertLayerNorm(n)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    return norm


def _layer_norm_var_rsqrt(y):
    return (y - y.mean(-1, keepdim=True)) * torch.rsqrt(y.var(-1, keepdim=True, unbiased=False) + 1e-5)


def _layer_norm_once(y):
    d = y - y.mean(dim=1, keepdim=True)
    return d / torch.sqrt((d * d).mean(dim=1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("fn, steps, eps", [
    (lambda: _BertLayerNorm(32), ["layernorm", "mul", "add"], 1e-12),
    (lambda: _layer_norm_var_rsqrt, ["layernorm"], 1e-5),
    (lambda: _layer_norm_once, ["layernorm"], 1e-6),
], ids=["bert", "var_rsqrt", "centred_once"])
def test_layer_norm_written_out_is_the_layernorm_step(fn, steps, eps):
    # (x - mean) / sqrt(var + eps) over a Linear's features, the variance as pow/mul and
    # mean or as var(unbiased=False): the layernorm step without weight and bias, its eps
    # the written one (float32 within a rounding of eager's ops).
    torch.manual_seed(0)
    model = Chain(fn())
    x = torch.randn(4, 16) * 3.0
    out, fused, refused = compile_records(model, x)
    assert len(fused) == 1 and steps_of(fused[0]) == steps, (steps_of(fused[0]) if fused else refused)
    assert fused[0].stop == "end of the graph"
    norm = json.loads(fused[0].spec)["steps"][0]
    assert norm["consts"] == [eps] and norm["inputs"] == [-1, -1]
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), atol=2e-6, rtol=1e-5)


def test_layer_norm_written_out_otherwise_is_not_the_layernorm_step():
    # The unbiased variance, a centring read elsewhere, the mean over another dim, or no
    # eps: no layernorm step, and the results are eager's.
    x = torch.randn(4, 16)

    def reads_centred(y):
        d = y - y.mean(-1, keepdim=True)
        return d / torch.sqrt(d.pow(2).mean(-1, keepdim=True) + 1e-5) + d

    for fn in (lambda y: (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, keepdim=True) + 1e-5),
               reads_centred,
               lambda y: (y - y.mean(0, keepdim=True)) / torch.sqrt(y.var(0, keepdim=True, unbiased=False) + 1e-5),
               lambda y: (y - y.mean(-1, keepdim=True)) / torch.sqrt(y.var(-1, keepdim=True, unbiased=False))):
        model = Chain(fn)
        out, fused, refused = compile_records(model, x)
        assert not any("layernorm" in steps_of(r) for r in fused), [steps_of(r) for r in fused]
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), atol=1e-6, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("fn, step", [(lambda: _softmax_amax, "softmax"), (lambda: _BertLayerNorm(32), "layernorm")],
                         ids=["softmax", "layernorm"])
def test_written_out_norms_in_training_keep_eagers_gradients(fn, step):
    # Backward reads values in between (exp and its sum; x - mean and the root), which
    # the kernels do not return: the written-out form is not taken there, and the
    # gradients are eager's.
    torch.manual_seed(0)
    model = Chain(fn())
    eager = copy.deepcopy(model)
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x, grad=True)
    assert not any(step in steps_of(r) for r in fused)
    weights = torch.randn(4, 32)
    (out * weights).sum().backward()
    (eager(x) * weights).sum().backward()
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 4, 32])
def test_group_norm_group_counts(groups):
    import json

    model = Chain(nn.GroupNorm(groups, 32))
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert json.loads(fused[0].spec)["steps"][0]["groups"] == groups
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keepdim", [True, False])
def test_logsumexp_keepdim(keepdim):
    model = Chain(lambda x: F.relu(torch.logsumexp(x, dim=1, keepdim=keepdim)))
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert steps_of(fused[0]) == ["logsumexp", "relu"]
    assert out.shape == ((4, 1) if keepdim else (4,))
    torch.testing.assert_close(out, model(x))


def test_batchnorm_train_and_eval_are_different_fusions():
    model = Chain(nn.BatchNorm1d(32))
    _, train, _ = compile_records(model.train(), torch.randn(8, 16))
    _, evl, _ = compile_records(model.eval(), torch.randn(8, 16))
    assert steps_of(train[0]) == ["batchnorm_train"] and steps_of(evl[0]) == ["batchnorm_eval"]


@pytest.mark.parametrize("dims", [1, 2, 3])
def test_conv_batchnorm_train_is_fused_with_running_stats_as_eager(dims):
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](3, 8, 3)
    norm = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}[dims](8, momentum=0.3)
    model = nn.Sequential(conv, norm, nn.ReLU()).train()
    eager = copy.deepcopy(model)
    x = torch.randn((3, 3) + (7,) * dims)
    out, fused, refused = compile_records(model, x)
    assert [r.fusion for r in fused] == ["conv_batchnorm_train"] and not refused
    assert steps_of(fused[0]) == ["add", "batchnorm_train", "relu"]  # the conv bias folded
    torch.testing.assert_close(out, eager(x))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(model[1], name), getattr(eager[1], name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_instance_norm_is_groupnorm_with_a_channel_per_group(dims, affine, dtype):
    torch.manual_seed(dims)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](3, 8, 3)
    norm = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims](8, eps=1e-3, affine=affine)
    model = nn.Sequential(conv, norm, nn.GELU()).to(dtype)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-1.0, 1.0)
    x = torch.rand((2, 3) + (6, 7, 5)[:dims], dtype=dtype)
    out, fused, refused = compile_records(model, x)
    assert [r.fusion for r in fused] == ["conv_groupnorm"] and not refused
    assert steps_of(fused[0]) == ["add", "groupnorm", "gelu"]
    step = json.loads(fused[0].spec)["steps"][1]
    assert step["groups"] == 8 and step["consts"] == [1e-3] and (min(step["inputs"]) >= 0) == affine
    # bf16: eager rounds the conv output before its bias, the fused chain adds it in float32.
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    ref = copy.deepcopy(model).double()(x.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("running_stats", [False, True], ids=["input_stats", "running_stats_eval"])
def test_instance_norm_of_one_image(running_stats):
    # With one image the decomposition's views are identities and are left out
    # (CPU fuzzer, generation 2, model 307).
    torch.manual_seed(0)
    norm = nn.InstanceNorm1d(4, eps=1e-3, track_running_stats=running_stats)
    model = nn.Sequential(nn.Conv1d(8, 4, 1, stride=2, padding=1, bias=False), norm).eval()
    x = torch.rand(1, 8, 39)
    out, fused, refused = compile_records(model, x)
    assert not refused and steps_of(fused[0]) == ["batchnorm_eval" if running_stats else "groupnorm"]
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_instance_norm_of_one_image_keeps_its_affine_and_widening(dtype):
    # One image: no repeat of the weight and bias either, and a bf16 graph widens the
    # conv output itself (whose two users are then the widening and the normalize).
    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(8, affine=True)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.GELU()).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1.0, 1.0)
    x = torch.rand(1, 3, 9, 9, dtype=dtype)
    out, fused, refused = compile_records(model, x)
    assert not refused and steps_of(fused[0])[-2:] == ["groupnorm", "gelu"]
    assert min(json.loads(fused[0].spec)["steps"][-2]["inputs"]) >= 0  # the affine folded into the norm
    ref = copy.deepcopy(model).double()(x.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol


class _AroundInstanceNorm(nn.Module):
    """conv -> a step before -> InstanceNorm2d -> a step after, with a residual input."""

    def __init__(self, before, after):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.InstanceNorm2d(8, affine=True)
        self.scale = nn.Parameter(torch.rand(8, 1, 1) + 0.5)
        self.before, self.after = before, after

    def forward(self, x, residual):
        y = self.conv(x)
        y = {"none": y, "relu": torch.relu(y), "mul_channel": y * self.scale, "sigmoid": torch.sigmoid(y)}[self.before]
        y = self.norm(y)
        return {"none": y, "gelu": F.gelu(y), "add_residual": y + residual, "mul_scalar": y * 3.0}[self.after]


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("after", ["none", "gelu", "add_residual", "mul_scalar"])
@pytest.mark.parametrize("before", ["none", "relu", "mul_channel", "sigmoid"])
def test_instance_norm_inside_a_longer_chain(before, after, grad):
    torch.manual_seed(0)
    model = _AroundInstanceNorm(before, after)
    eager = copy.deepcopy(model)
    x, residual = torch.rand(2, 3, 6, 5), torch.rand(2, 8, 6, 5)
    xs = x.clone().requires_grad_(grad)
    out, fused, refused = compile_records(model, xs, residual, grad=grad)
    assert [r.fusion for r in fused] == ["conv_groupnorm"] and not refused
    want = ["add"] + {"none": [], "relu": ["relu"], "mul_channel": ["mul"], "sigmoid": ["sigmoid"]}[before]
    want += ["groupnorm"] + {"none": [], "gelu": ["gelu"], "add_residual": ["add"], "mul_scalar": ["mul"]}[after]
    # The norm reads the conv's output itself, up to a scale a channel.
    norm_reads_the_conv = before in ("none", "mul_channel")
    if grad and norm_reads_the_conv:
        # Backward keeps the conv output itself (the norm's input; the product's factor
        # for the scale's gradient), so its bias stays in the conv. After relu or sigmoid
        # it reads their values (saved: `KeepChainValues`), which the fused op returns.
        want = want[1:]
    assert steps_of(fused[0]) == want
    exact = copy.deepcopy(eager).double()
    xe, x64 = x.clone().requires_grad_(grad), x.double().requires_grad_(grad)
    ref = eager(xe, residual)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if grad:
        for y in (out, ref, exact(x64, residual.double())):
            y.square().sum().backward()
        for (name, ours), theirs, want in zip([("x", xs), *model.named_parameters()], [xe, *eager.parameters()],
                                              [x64, *exact.parameters()]):
            if want.grad is None:  # (the scale of the steps not drawn has none)
                continue
            # Where the norm reads the conv's output up to a scale a channel, the conv
            # bias's gradient is 0 (the norm subtracts the mean): what float32 gives is
            # the rounding of sums of terms the size of the norm weight's gradient.
            zero = name == "conv.bias" and norm_reads_the_conv
            floor = 1e-6 * exact.norm.weight.grad.norm().item() if zero else 0.0
            close_to_float64(ours.grad, theirs.grad, want.grad, f"grad of {name}", floor=floor)


@pytest.mark.parametrize("dims", [1, 2])
def test_instance_norm_in_a_bf16_training_graph_is_refused_with_the_reason(dims):
    conv = {1: nn.Conv1d, 2: nn.Conv2d}[dims](3, 8, 3)
    norm = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d}[dims](8, affine=True)
    model = nn.Sequential(conv, norm, nn.ReLU()).to(torch.bfloat16)
    x = torch.rand((2, 3) + (9, 9)[:dims], dtype=torch.bfloat16, requires_grad=True)
    out, fused, refused = compile_records(model, x, grad=True)
    assert not fused and "InstanceNorm on bf16/fp16 in a training graph" in refused[0].reason
    out.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "affine"])
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_instance_norm_with_running_stats_in_eval_is_batchnorm_eval(dims, affine, grad):
    # With gradients (fine-tuning with frozen statistics) the graph keeps InstanceNorm's
    # view of its input for an affine norm's weight: the fused op returns it.
    torch.manual_seed(dims)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](3, 8, 3)
    norm_cls = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims]
    norm = norm_cls(8, eps=1e-3, affine=affine, track_running_stats=True)
    with torch.no_grad():
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 1.5)
        if affine:
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    model = nn.Sequential(conv, norm, nn.SiLU()).eval()
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.rand((2, 3) + (6, 7, 5)[:dims], requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert [r.fusion for r in fused] == ["conv_batchnorm_eval"] and not refused, [r.reason for r in refused]
    step = json.loads(fused[0].spec)["steps"][1]
    assert step["name"] == "batchnorm_eval" and step["consts"] == [1e-3]
    assert (min(step["inputs"][:2]) >= 0) == affine and min(step["inputs"][2:]) >= 0
    torch.testing.assert_close(out, eager(x))
    if grad:
        xe, xr = x.detach().clone().requires_grad_(True), x.detach().double().requires_grad_(True)
        out.sum().backward()
        eager(xe).sum().backward()
        ref(xr).sum().backward()
        close_to_float64(x.grad, xe.grad, xr.grad, "x")
        for (name, p), pe, pr in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
            close_to_float64(p.grad, pe.grad, pr.grad, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_instance_norm_with_running_stats_in_eval_keeps_its_16_bit_input_for_backward(dtype):
    # The view the fused op returns for backward holds the conv output + bias as the
    # fused op rounds it; gradients stay within 4x eager's error off float64.
    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(8, affine=True, track_running_stats=True)
    with torch.no_grad():
        norm.running_mean.uniform_(-0.5, 0.5)
        norm.running_var.uniform_(0.5, 1.5)
        norm.weight.uniform_(0.5, 1.5)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.SiLU()).eval().to(dtype)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.rand(2, 3, 9, 8, dtype=dtype, requires_grad=True)
    out, fused, refused = compile_records(model, x, grad=True)
    assert [steps_of(r) for r in fused] == [["add", "batchnorm_eval", "silu"]], [r.reason for r in refused]
    xe, xr = x.detach().clone().requires_grad_(True), x.detach().double().requires_grad_(True)
    out.double().sum().backward()
    eager(xe).double().sum().backward()
    ref(xr).sum().backward()
    close_to_float64(x.grad, xe.grad, xr.grad, "x")
    for (name, p), pe, pr in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        close_to_float64(p.grad, pe.grad, pr.grad, name)


def test_instance_norm_with_running_stats_in_training_is_refused_and_runs_as_eager():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.InstanceNorm2d(8, track_running_stats=True), nn.ReLU())
    eager = copy.deepcopy(model)
    x = torch.rand(2, 3, 9, 9)
    out, fused, refused = compile_records(model, x)
    assert not fused and "InstanceNorm" in refused[0].reason
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(model[1].running_mean, eager[1].running_mean)


@pytest.mark.parametrize("running_stats", [False, True], ids=["input_stats", "running_stats_eval"])
def test_instance_norm_with_a_dynamic_batch_keeps_one_spec(running_stats):
    """After a second batch size Dynamo compiles a graph whose batch is symbolic (in
    InstanceNorm's views and repeats too); it fuses into the same spec, one kernel."""
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    torch.manual_seed(0)
    norm = nn.InstanceNorm2d(8, affine=True, track_running_stats=running_stats)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), norm, nn.ReLU()).eval()
    torch._dynamo.reset()
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        compiled = torch.compile(model, backend=fusedepi)
        for batch in (2, 3, 5):
            x = torch.rand(batch, 3, 9, 9)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    records = [r for report in reports for r in report.records]
    assert len(reports) == 2  # the first size, then a graph for every other size
    assert [r.status for r in records] == ["fused", "fused"] and len({r.spec for r in records}) == 1


def test_batchnorm_train_after_a_row_reduction_is_refused():
    class SumThenBatchNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.bn = nn.Linear(16, 32), nn.BatchNorm1d(1)

        def forward(self, x):
            return self.bn(self.linear(x).sum(1, keepdim=True))

    model = SumThenBatchNorm().train()
    eager = copy.deepcopy(model)
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert [steps_of(r) for r in fused] == [["sum"]] and "BatchNorm (training): only on" in fused[0].stop
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(model.bn.running_var, eager.bn.running_var)


def test_batchnorm_momentum_none_runs_as_eager():
    # The cumulative average reads num_batches_tracked as a Python number: Dynamo
    # breaks the graph there, so the BatchNorm runs outside any fused chain.
    model = Chain(nn.BatchNorm1d(32, momentum=None))
    eager = copy.deepcopy(model)
    x = torch.randn(8, 16)
    out, fused, _ = compile_records(model, x)
    assert not fused
    torch.testing.assert_close(out, eager(x))
    torch.testing.assert_close(model.fn.running_var, eager.fn.running_var)


def test_linear_3d_input_with_layernorm():
    model = Chain(nn.Sequential(nn.GELU(), nn.LayerNorm(32)))
    x = torch.randn(2, 5, 16)
    out, fused, _ = compile_records(model, x)
    assert [r.fusion for r in fused] == ["linear_layernorm"]
    assert out.shape == (2, 5, 32)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_group_norm_on_3d_linear_output_is_refused():
    # GroupNorm on [B, T, N] normalizes over T's channels, not the matmul's features.
    model = Chain(nn.GroupNorm(5, 5))
    x = torch.randn(2, 5, 16)
    out, fused, refused = compile_records(model, x)
    assert not fused and any("not the matmul's feature dim" in r.reason for r in refused)
    torch.testing.assert_close(out, model(x))


def test_residual_and_per_channel_operands():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 32, bias=False)
            self.scale = nn.Parameter(torch.randn(32))

        def forward(self, x, r):
            return torch.relu(self.linear(x) * self.scale + r)

    model = Residual()
    x, r = torch.randn(4, 16), torch.randn(4, 32)
    out, fused, _ = compile_records(model, x, r)
    assert steps_of(fused[0]) == ["mul", "add", "relu"]
    torch.testing.assert_close(out, model(x, r))


def test_value_used_elsewhere_is_returned_too():
    # The linear output also feeds sigmoid().sum(): the fused op returns it as well.
    # That sum, computed from the chain's own value, is a branch through a reduction over
    # all dims (no step), so the chain ends before the branch.
    model = Chain(lambda x: torch.relu(x) + torch.sigmoid(x).sum())
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x)
    assert steps_of(fused[0]) == ["relu"] and "sum.default" in fused[0].stop and "inside a branch" in fused[0].stop
    assert json.loads(fused[0].spec)["saves"][0]["at"] == 0  # the library's own GEMM output
    torch.testing.assert_close(out, model(x))


class TwoChainsMeet(nn.Module):
    """Two matmuls whose chains meet: SwiGLU's silu(gate) * up, and
    tanh(relu(a) + b) with b also used elsewhere."""

    def __init__(self, form):
        super().__init__()
        self.form = form
        self.a, self.b, self.down = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        if self.form == "swiglu":
            return self.down(F.silu(self.a(x)) * self.b(x))
        b = self.b(x)
        return torch.tanh(torch.relu(self.a(x)) + b), b.sum()


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("form", ["swiglu", "residual"])
def test_chains_never_share_a_node(form, grad):
    torch.manual_seed(0)
    model = TwoChainsMeet(form)
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x, grad=grad)
    names = [name for r in fused for name in r.nodes]
    assert fused and len(names) == len(set(names))  # no node in two fused ops
    assert any("belongs to another fused chain" in (r.stop or r.reason) for r in fused + refused)
    for got, want in zip(out if isinstance(out, tuple) else [out], model(x) if form != "swiglu" else [model(x)]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chains_that_would_wait_for_each_other_are_not_both_fused():
    # relu(a) + atan(relu(b)) and relu(b) * atan(-relu(a)): each chain's operand is
    # computed from the other chain's value (atan is outside the vocabulary).
    torch.manual_seed(0)
    lin_a, lin_b = nn.Linear(16, 32), nn.Linear(16, 32)

    def f(x):
        ra, rb = torch.relu(lin_a(x)), torch.relu(lin_b(x))
        return ra + torch.atan(rb), rb * torch.atan(-ra)

    x = torch.randn(4, 16)
    out, fused, refused = compile_records(f, x)
    assert len(fused) == 1
    assert any("depend on each other's values" in r.reason for r in refused)
    for got, want in zip(out, f(x)):
        torch.testing.assert_close(got, want)


class ChainIntoChain(nn.Module):
    """A chain whose result is the next chain's anchor input (and, with `saved`, is
    also used after it): Linear -> sigmoid -> Linear -> logsumexp."""

    def __init__(self, saved=False):
        super().__init__()
        self.saved = saved
        self.first, self.second = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        hidden = torch.sigmoid(self.first(x))
        out = torch.logsumexp(self.second(hidden), dim=1)
        return (out, hidden.sum(dim=0)) if self.saved else out


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("saved", [False, True], ids=["result", "result_used_again"])
def test_a_chain_whose_anchor_input_is_another_chains_result(saved, grad):
    torch.manual_seed(0)
    model = ChainIntoChain(saved)
    x = torch.randn(6, 16)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert sorted(r.fusion for r in fused) == ["linear_logsumexp", "linear_pointwise"], refused
    assert not any("rewrite failed" in r.reason for r in refused)
    for got, want in zip(out if saved else [out], model(x) if saved else [model(x)]):
        torch.testing.assert_close(got, want)


EARLIER_FORMS = {  # y: the anchor output; the chain reads an earlier value of its own
    "hardswish_spelled": (lambda y: y * torch.clamp((y + 3) / 6, 0, 1), ["add", "div", "clamp", "mul"]),
    "mish_spelled": (lambda y: y * torch.tanh(F.softplus(y)), ["softplus", "tanh", "mul"]),
    "residual_of_itself": (lambda y: torch.relu(y + torch.sigmoid(y) * 0.5), ["sigmoid", "mul", "add", "relu"]),
    "value_after_a_step": (lambda y: (lambda g: g - torch.tanh(g))(F.gelu(y)), ["gelu", "tanh", "sub"]),
}


def _one_chain(fn, grad):
    """(output, eager's output, the one fused record, its spec) of Linear(16, 32) -> fn."""
    torch.manual_seed(0)
    model = Chain(fn, k=16, n=32)
    x = torch.randn(8, 16)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert len(fused) == 1, (fused, refused)
    return out, model(x), fused[0], json.loads(fused[0].spec)


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("form", list(EARLIER_FORMS))
def test_a_step_may_read_an_earlier_value_of_its_own_chain(form, grad):
    fn, steps = EARLIER_FORMS[form]
    out, eager, record, spec = _one_chain(fn, grad)
    assert steps_of(record)[-len(steps):] == steps, record
    assert any(s["operand"] == "earlier" for s in spec["steps"])
    if not grad:  # the value the later step reads is held in the kernel, not returned
        assert spec["saves"] == []
    torch.testing.assert_close(out, eager)


BRANCH_FORMS = {  # y: the anchor output; two values computed from one earlier value meet
    "gelu_erf_spelled": (lambda y: y * 0.5 * (1.0 + torch.erf(y / math.sqrt(2.0))),
                         ["mul", "branch", "div", "erf", "add", "mul"]),
    "gelu_new": (lambda y: 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0)))),
                 ["mul", "branch", "pow", "mul", "add", "mul", "tanh", "add", "mul"]),
    "after_a_step": (lambda y: (lambda r: torch.sigmoid(r * 2) * torch.tanh(r + 1))(torch.relu(y)),
                     ["relu", "mul", "sigmoid", "branch", "add", "tanh", "mul"]),
    "branch_in_a_branch": (lambda y: (y * 2) * (torch.sin(y) + torch.cos(y)),
                           ["mul", "branch", "sin", "branch", "cos", "add", "mul"]),
    # Hugging Face's FastGELUActivation: both factors of the tanh's argument from y
    "fast_gelu": (lambda y: 0.5 * y * (1.0 + torch.tanh(y * 0.7978845608 * (1.0 + 0.044715 * y * y))),
                  ["mul", "branch", "mul", "branch", "mul", "mul", "add", "mul", "tanh", "add", "mul"]),
    "after_a_norm": (lambda y: (lambda g: g * 0.5 * (1.0 + torch.erf(g * 0.7)))(F.group_norm(y, 4)),
                     ["groupnorm", "mul", "branch", "mul", "erf", "add", "mul"]),
}


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("form", list(BRANCH_FORMS))
def test_a_chain_goes_on_through_a_branch_of_its_own(form, grad):
    # f(y) * g(y): the chain runs f, a `branch` step back to y, g, then the product with
    # the held f(y); nothing but the result is written where no backward reads it.
    fn, steps = BRANCH_FORMS[form]
    out, eager, record, spec = _one_chain(fn, grad)
    assert steps_of(record) == steps and record.stop == "end of the graph", record
    saves = spec["saves"]
    if not grad:
        assert saves == []
    else:  # each value backward reads, once
        assert len({(s["what"], s["at"]) for s in saves}) == len(saves)
    assert torch.equal(out, eager)  # the reference runs eager's ops in eager's order


def test_a_branch_that_does_not_fuse_whole_ends_the_chain_before_it():
    # The branch's second node is outside the vocabulary: the chain ends at y * 0.5,
    # with the reason, and the branch's nodes are left to Inductor.
    model = Chain(lambda y: y * 0.5 * (1.0 + torch.atan(y / 3.0)), k=16, n=32)
    x = torch.randn(8, 16)
    out, fused, refused = compile_records(model, x)
    assert steps_of(fused[0]) == ["mul"], fused
    assert "atan" in fused[0].stop and "inside a branch" in fused[0].stop
    assert json.loads(fused[0].spec)["saves"]  # the anchor output, which the branch reads outside
    torch.testing.assert_close(out, model(x))


def test_an_earlier_value_across_a_reduction_ends_the_chain_with_the_reason():
    model = Chain(lambda y: F.layer_norm(y, (32,)) * y, k=16, n=32)
    x = torch.randn(8, 16)
    out, fused, refused = compile_records(model, x)
    assert "a reduction lies between" in fused[0].stop
    torch.testing.assert_close(out, model(x))


def test_result_before_a_trailing_view_is_not_saved_twice():
    model = Chain(lambda y: torch.relu(y).view(-1, 2, 32), k=16, n=64)
    x = torch.randn(8, 16)
    out, fused, _ = compile_records(model, x, grad=True)
    assert json.loads(fused[0].spec)["saves"] == []  # backward reads the result itself
    torch.testing.assert_close(out, model(x))


def test_grad_mode_returns_what_backward_needs():
    model = Chain(nn.Sequential(nn.GroupNorm(4, 32), nn.GELU()))
    x = torch.randn(4, 16)
    out, fused, refused = compile_records(model, x, grad=True)
    saves = json.loads(fused[0].spec)["saves"]
    # The GEMM output and the GroupNorm statistics (GroupNorm's backward), GroupNorm's output (GELU's).
    assert sorted((s["what"], s["at"]) for s in saves) == [("mean", 0), ("rstd", 0), ("value", 0), ("value", 1)]
    torch.testing.assert_close(out, model(x))


def test_float64_is_refused():
    model = Chain(F.gelu).double()
    x = torch.randn(4, 16, dtype=torch.float64)
    out, fused, refused = compile_records(model, x)
    assert not fused and "float64" in refused[0].reason
    torch.testing.assert_close(out, model(x))


def test_channels_last_conv_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU()).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 10, 10).to(memory_format=torch.channels_last)
    out, fused, refused = compile_records(model, x)
    assert not fused and "not contiguous" in refused[0].reason
    torch.testing.assert_close(out, model(x))


def test_conv_bias_is_folded_into_the_epilogue():
    import json

    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8).eval(), nn.SiLU())
    x = torch.randn(2, 3, 10, 10)
    out, fused, _ = compile_records(model, x)
    spec = json.loads(fused[0].spec)
    assert spec["anchor"]["has_bias"] is False
    assert [s["name"] for s in spec["steps"]] == ["add", "batchnorm_eval", "silu"]
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class _SelfResidual(nn.Module):
    """A conv whose output the chain reads twice: relu(y + s * y)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.scale = nn.Parameter(torch.rand(8, 1, 1) + 0.5)

    def forward(self, x):
        y = self.conv(x)
        return F.leaky_relu(y + self.scale * y, 0.1)


@pytest.mark.parametrize("grad", [False, True])
def test_conv_bias_is_folded_where_only_the_chain_reads_the_conv(grad):
    """The conv's value read again by a later step is held in the kernel, after the bias
    step: the bias folds. Saved for backward (a training graph), the value is the
    library's own output, bias added there, as eager rounds it."""
    import json

    model = _SelfResidual()
    x = torch.randn(2, 3, 10, 10, requires_grad=grad)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert len(fused) == 1, refused
    spec = json.loads(fused[0].spec)
    assert spec["anchor"]["has_bias"] is grad
    assert steps_of(fused[0]) == (["mul", "add", "leaky_relu"] if grad else ["add", "mul", "add", "leaky_relu"])
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    if grad:
        out.sum().backward()
        got = x.grad.clone()
        x.grad = None
        model(x).sum().backward()
        torch.testing.assert_close(got, x.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model, shape", [(nn.Conv2d(3, 8, 3), (2, 3, 10, 10)), (nn.Linear(16, 8), (4, 16))])
def test_bare_anchor_with_bias_is_not_a_fusion(model, shape):
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # the GEMM bias would move too
    try:
        out, fused, refused = compile_records(model, torch.randn(shape))
    finally:
        torch.set_float32_matmul_precision(old)
    assert not fused and "no epilogue" in refused[0].reason


@pytest.mark.parametrize("precision, dtype, folded", [
    ("high", torch.float32, True),
    ("highest", torch.float32, False),
    ("high", torch.bfloat16, False),
    ("tf32", torch.float32, True),  # torch.backends.cuda.matmul.fp32_precision, the newer API
    ("ieee", torch.float32, False),
])
def test_gemm_bias_moves_into_the_epilogue_only_under_tf32(precision, dtype, folded):
    import json

    newer = precision in ("tf32", "ieee")
    old = torch.backends.cuda.matmul.fp32_precision if newer else torch.get_float32_matmul_precision()
    if newer:
        torch.backends.cuda.matmul.fp32_precision = precision
    else:
        torch.set_float32_matmul_precision(precision)
    try:
        model = Chain(torch.relu).to(dtype)
        x = torch.randn(4, 16, dtype=dtype)
        out, fused, _ = compile_records(model, x)
    finally:
        if newer:
            torch.backends.cuda.matmul.fp32_precision = old
        else:
            torch.set_float32_matmul_precision(old)
    spec = json.loads(fused[0].spec)
    assert spec["anchor"]["kind"] == ("mm" if folded else "addmm")
    assert steps_of(fused[0]) == (["add", "relu"] if folded else ["relu"])
    torch.testing.assert_close(out, model(x))


def test_dtype_change_inside_chain_stops_it():
    model = Chain(lambda x: torch.relu(x).to(torch.float64) * 2)
    x = torch.randn(4, 16)
    out, fused, _ = compile_records(model, x)
    assert [steps_of(r) for r in fused] == [["relu"]]
    torch.testing.assert_close(out, model(x))


def test_stride_one_conv_is_a_direct_conv_candidate():
    import json

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Sigmoid())
    x = torch.randn(2, 3, 10, 12)
    out, fused, _ = compile_records(model, x)
    anchor = json.loads(fused[0].spec)["anchor"]
    assert anchor["direct"] == [3, 3, 3, 10, 12]  # in_channels, kh, kw, in_h, in_w
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("conv, direct", [(nn.Conv2d(3, 8, 3, stride=2), [3, 3, 3, 12, 12]),
                                          (nn.Conv2d(3, 8, 3, dilation=2, padding=2), [3, 3, 3, 12, 12])])
def test_strided_and_dilated_convs_are_in_kernel_conv_candidates(conv, direct):
    # Candidates for the file's own conv kernels; the direct conv takes stride 1 and
    # dilation 1 only, the in-kernel conv any dilation and strides up to 8.
    import cuda_templates
    from lowering.spec import EpilogueSpec

    model = nn.Sequential(conv, nn.ReLU())
    x = torch.randn(2, 3, 12, 12)
    out, fused, _ = compile_records(model, x)
    spec = EpilogueSpec.from_json(fused[0].spec)
    assert json.loads(fused[0].spec)["anchor"]["direct"] == direct
    assert spec.anchor.direct_out_hw() == tuple(model(x).shape[2:]) and not spec.anchor.unit_stride
    assert "the direct conv takes 1 and 1" in cuda_templates.direct_plan(spec, "sm90")
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("conv", [nn.Conv2d(4, 8, 3, groups=2), nn.Conv1d(4, 8, 3, groups=2)])
def test_other_convs_use_the_library_conv(conv):
    # (a Conv1d of groups 1 is a candidate as a 2-D conv of one row: test_vocabulary)
    import json

    model = nn.Sequential(conv, nn.ReLU())
    shape = (2, conv.in_channels, 12) if isinstance(conv, nn.Conv1d) else (2, conv.in_channels, 12, 12)
    x = torch.randn(shape)
    out, fused, _ = compile_records(model, x)
    assert json.loads(fused[0].spec)["anchor"]["direct"] == []
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("setting, implicit", [(None, False), ("1", True), ("0", False)])
def test_the_matcher_marks_the_in_kernel_conv_only_when_asked(setting, implicit, monkeypatch):
    import json

    if setting is not None:
        monkeypatch.setenv("FUSEDEPI_IN_KERNEL_CONV", setting)
    model = nn.Sequential(nn.Conv2d(8, 64, 3), nn.ReLU())
    x = torch.randn(2, 8, 10, 10)
    out, fused, _ = compile_records(model, x)
    anchor = json.loads(fused[0].spec)["anchor"]
    assert anchor["implicit"] is implicit and anchor["direct"] == [8, 3, 3, 10, 10]
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("conv, shape, after", [
    (nn.Conv3d(8, 16, 3), (2, 8, 6, 10, 12), lambda y: F.silu(F.group_norm(y, 4))),
    (nn.Conv3d(16, 32, (3, 1, 3), stride=(2, 1, 1), padding=(1, 0, 1), dilation=(1, 1, 2)), (2, 16, 7, 9, 11),
     torch.relu),
    # a stride-1 ConvTranspose3d as the Conv3d it equals (Anchor.flipped)
    (nn.ConvTranspose3d(16, 32, 3, padding=1), (2, 16, 5, 9, 11), torch.relu),
])
def test_a_conv3d_is_a_candidate_for_the_in_kernel_conv_by_depth_planes(conv, shape, after, monkeypatch):
    # Anchor.depth: (kd, D) beside the plane's `direct`; the in-kernel conv plans it, its
    # output's spatial dims (D_out, H_out, W_out) as the graph's; the direct conv does not.
    import cuda_templates
    from cuda_templates import conv_sm90
    from lowering.spec import EpilogueSpec

    monkeypatch.setenv("FUSEDEPI_IN_KERNEL_CONV", "1")

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = conv

        def forward(self, x):
            return after(self.conv(x))

    model = Model()
    x = torch.randn(shape)
    out, fused, _ = compile_records(model, x)
    spec = EpilogueSpec.from_json(fused[0].spec)
    anchor = json.loads(fused[0].spec)["anchor"]
    w = conv.weight.shape
    assert anchor["implicit"] and anchor["direct"] == [shape[1], w[3], w[4], shape[3], shape[4]]
    assert anchor["depth"] == [w[2], shape[2]]
    assert spec.anchor.direct_out_spatial() == tuple(model.conv(x).shape[2:])
    assert "3-D" in cuda_templates.direct_plan(spec, "sm90")
    plan = cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True)  # (float32 in TF32 only)
    assert isinstance(plan, conv_sm90.ConvGemmPlan) and not plan.nchw, plan
    source = cuda_templates.render(spec, "sm90", conv_tf32=True)
    assert f"kDo = {spec.anchor.direct_out_d()};" in source and "constexpr bool kDepth = true;" in source
    torch.testing.assert_close(out, model(x))


def test_a_conv3d_pool_in_the_tiles_is_refused_with_its_reason(monkeypatch):
    import cuda_templates
    from cuda_templates import conv_sm90
    from lowering.spec import EpilogueSpec

    monkeypatch.setenv("FUSEDEPI_IN_KERNEL_CONV", "1")
    monkeypatch.setattr(conv_sm90, "POOLS_IN_TILE", True)
    model = nn.Sequential(nn.Conv3d(8, 16, 3), nn.ReLU(), nn.MaxPool3d(2))
    x = torch.randn(2, 8, 6, 10, 10)
    out, fused, _ = compile_records(model, x)
    spec = EpilogueSpec.from_json(fused[0].spec)
    plan = cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True)
    assert isinstance(plan, str) and "3-D" in plan, plan
    assert json.loads(fused[0].spec)["anchor"]["depth"] == [3, 6]
    torch.testing.assert_close(out, model(x))


def test_direct_conv_can_be_disabled(monkeypatch):
    import json

    monkeypatch.setenv("FUSEDEPI_DISABLE", "direct_conv")
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    x = torch.randn(2, 3, 10, 10)
    out, fused, _ = compile_records(model, x)
    assert json.loads(fused[0].spec)["anchor"]["direct"] == []
    torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("shape", [(6, 24), (2, 3, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_an_in_kernel_gemm_candidate(shape, bias, monkeypatch):
    import json

    monkeypatch.setenv("FUSEDEPI_IN_KERNEL_GEMM", "1")
    model = Chain(torch.relu, k=24, n=32, bias=bias)
    x = torch.randn(shape)
    out, fused, _ = compile_records(model, x)
    anchor = json.loads(fused[0].spec)["anchor"]
    assert anchor["kind"] == ("addmm" if bias else "mm") and anchor["gemm"] == [24, 1]  # in_features, every call
    torch.testing.assert_close(out, model(x))


def test_products_other_than_x_wt_use_the_library_gemm(monkeypatch):
    import json

    monkeypatch.setenv("FUSEDEPI_IN_KERNEL_GEMM", "1")
    w = torch.randn(24, 32)  # [K, N]: x @ w reads w along its rows, not as a Linear's transposed weight
    bias = torch.randn(6, 32)  # a full [M, N] bias is not the in-kernel GEMM's per-column one
    x = torch.randn(6, 24)
    for fn in (lambda x: torch.relu(x @ w), lambda x: torch.relu(torch.addmm(bias, x, w.t().contiguous().t()))):
        out, fused, _ = compile_records(fn, x)
        assert json.loads(fused[0].spec)["anchor"]["gemm"] == []
        torch.testing.assert_close(out, fn(x))


@pytest.mark.parametrize(
    "setting, pointwise, groupnorm",
    [(None, True, False), ("auto", True, False), ("1", True, True), ("0", False, False), ("off", False, False)],
)
def test_in_kernel_gemm_candidates_by_setting(setting, pointwise, groupnorm, monkeypatch):
    # 16-bit chains. auto (the default): pointwise chains and row reductions (their
    # statistics are per-tile partials); 1: every chain; 0: none.
    if setting is None:
        monkeypatch.delenv("FUSEDEPI_IN_KERNEL_GEMM", raising=False)
    else:
        monkeypatch.setenv("FUSEDEPI_IN_KERNEL_GEMM", setting)
    every_call = 0 if setting in (None, "auto") else 1
    _assert_gemm_candidates(torch.bfloat16, {"relu": pointwise, "logsumexp": pointwise, "groupnorm": groupnorm},
                            every_call)


@pytest.mark.parametrize(
    "precision, setting, expected",
    [("high", "auto", {"relu": False, "logsumexp": True, "groupnorm": False}),
     ("highest", "auto", {"relu": False, "logsumexp": False, "groupnorm": False}),
     ("highest", "1", {"relu": True, "logsumexp": True, "groupnorm": True})],
)
def test_in_kernel_gemm_candidates_in_float32(precision, setting, expected, monkeypatch):
    # float32 runs the in-kernel GEMM in TF32. auto keeps row reductions only, and only
    # while TF32 is allowed (measured: pointwise and GroupNorm chains run faster on the
    # library GEMM in float32). 1 keeps every chain; at "highest" its calls then run the
    # library GEMM (the launcher reads the precision at each call).
    old = torch.get_float32_matmul_precision()
    monkeypatch.setenv("FUSEDEPI_IN_KERNEL_GEMM", setting)
    torch.set_float32_matmul_precision(precision)
    try:
        _assert_gemm_candidates(torch.float32, expected, 0 if setting == "auto" else 1)
    finally:
        torch.set_float32_matmul_precision(old)


def _assert_gemm_candidates(dtype, expected: dict, every_call: int):
    import json

    x = torch.randn(6, 24, dtype=dtype)
    models = {
        "relu": Chain(torch.relu, k=24, n=32),
        "logsumexp": Chain(lambda y: F.leaky_relu(torch.logsumexp(y, dim=1, keepdim=True), 0.01), k=24, n=32),
        "groupnorm": nn.Sequential(nn.Linear(24, 32), nn.GroupNorm(4, 32), nn.ReLU()),
    }
    for name, want in expected.items():
        model = models[name].to(dtype)
        torch._dynamo.reset()
        out, fused, _ = compile_records(model, x)
        assert json.loads(fused[0].spec)["anchor"]["gemm"] == ([24, every_call] if want else []), name
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out, model(x), atol=tol, rtol=tol)


def _graph_with_outputs(visible):
    """x -> relu -> (y: returned first, as a mutated input is), y -> exp -> returned for the
    user, y -> sigmoid -> neg -> returned after (saved for backward); the output node
    marked as Inductor marks a training forward graph (`visible`), or not (None)."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    user = g.call_function(torch.ops.aten.exp.default, (y,))
    s = g.call_function(torch.ops.aten.sigmoid.default, (y,))
    saved = g.call_function(torch.ops.aten.neg.default, (s,))
    out = g.output((y, user, saved))
    if visible is not None:
        out.meta["user_visible_output_idxs"] = visible
    return g, {"sigmoid": s, "neg": saved}


def test_nodes_that_compute_only_values_saved_for_backward():
    from lowering.matcher import for_backward_only

    g, n = _graph_with_outputs([1])
    assert for_backward_only(g) == {n["sigmoid"], n["neg"]}
    # The outputs before the user's (mutated inputs) are the forward's too.
    g, n = _graph_with_outputs([2])
    assert for_backward_only(g) == set()
    # No mark, or an empty one (a joint or an inference graph): nothing is known.
    assert for_backward_only(_graph_with_outputs(None)[0]) == set()
    assert for_backward_only(_graph_with_outputs([])[0]) == set()


def test_backwards_work_moved_into_the_forward_graph_is_not_a_step():
    # Mish's backward reads x * sigmoid(x), softplus(x) and its tanh of mish's input;
    # the partitioner computes them in the forward graph and saves the result. The walk
    # took that x * sigmoid(x) for a SiLU step, went on into the derivative and stopped
    # the chain before the mish ("softplus.default in a branch"). 3-D Linear, minimum by
    # a per-feature operand, mish, mean over the features, as the fuzzer drew it
    # (generation 13, seed 28, model 144).
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(24, 40)
            self.cap = nn.Parameter(torch.rand(40))

        def forward(self, x):
            return F.mish(torch.minimum(self.lin(x), self.cap)).mean(-1).sigmoid()

    torch.manual_seed(0)
    model = Model()
    eager = copy.deepcopy(model)
    x = torch.randn(2, 6, 24, requires_grad=True)
    xe = x.detach().clone().requires_grad_(True)
    out, fused, refused = compile_records(model, x, grad=True)
    assert [steps_of(r) for r in fused] == [["minimum", "mish", "mean", "sigmoid"]], refused
    ref = eager(xe)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, xe.grad, atol=1e-5, rtol=1e-5)
