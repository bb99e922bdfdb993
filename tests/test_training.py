"""Training through fused chains: gradients and optimizer steps against eager.

A forward graph that requires gradients keeps values for backward (the matmul
output, normalization statistics, activation inputs); the fused op returns them
as extra outputs, and Inductor compiles the backward graph. Each check runs on
the CPU (the fused op's torch reference: the graph surgery and the partition) and,
with the `gpu` marker, on CUDA (the kernels).
"""

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend import backend, fusedepi
from helpers import SMALL_WORKLOADS, close_to_float64

aten = torch.ops.aten
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def on_device(request, monkeypatch):
    """Sets up `device` for a test: CPU graphs fuse through the reference; CUDA runs strict float32."""
    device = request.param
    if device == "cpu":
        monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    torch._dynamo.reset()
    yield device
    torch.set_float32_matmul_precision(old)
    torch._dynamo.reset()


@pytest.fixture
def inner_graphs(monkeypatch):
    """(is_backward, [node targets]) of every graph handed to Inductor after the rewrite."""
    graphs = []
    real = backend.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        graphs.append((kwargs.get("is_backward", False), [n.target for n in gm.graph.nodes]))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend, "compile_fx_inner", spy)
    return graphs


def _three(name, device):
    """The workload three ways: to compile, eager float32 and eager float64."""
    factory, shape, fusion = SMALL_WORKLOADS[name]
    torch.manual_seed(0)
    model = factory().to(device)
    return model, copy.deepcopy(model), copy.deepcopy(model).double(), shape, fusion


def _forward_backward(model, eager, ref, x):
    """Runs `model` compiled, `eager` and the float64 `ref` on copies of `x` that
    require gradients, then backward with one random upstream gradient; checks the
    outputs and every gradient. Returns the fused records."""
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_(), x.double().requires_grad_()]
    reports: list = []
    with backend.collect_reports(reports):
        out = torch.compile(model, backend=fusedepi)(inputs[0])
    outs = [out, eager(inputs[1]), ref(inputs[2])]
    upstream = torch.randn_like(outs[2])
    for o in outs:
        o.backward(upstream.to(o.dtype))
    close_to_float64(*outs, "output")
    close_to_float64(*(t.grad for t in inputs), "input grad")
    for (pname, p), pe, pr in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        close_to_float64(p.grad, pe.grad, pr.grad, f"grad of {pname}")
    return [r for report in reports for r in report.records if r.status == "fused"]


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("name", list(SMALL_WORKLOADS))
def test_gradients_match_eager(name, on_device, inner_graphs):
    model, eager, ref, shape, fusion = _three(name, on_device)
    fused = _forward_backward(model, eager, ref, torch.rand(shape, device=on_device))
    assert [r.fusion for r in fused] == [fusion]
    assert '"saves":[{' in fused[0].spec  # the chain returns what backward needs
    assert on_device == "cpu" or fused[0].kernel != "reference (cpu)"
    for (bname, b), be, br in zip(model.named_buffers(), eager.buffers(), ref.buffers()):
        if b.is_floating_point():
            close_to_float64(b, be, br, bname)
        else:
            assert torch.equal(b, be), bname

    # Backward does not recompute the matrix op: a linear's backward holds exactly its
    # two gradient GEMMs (input and weight), a conv's no forward convolution.
    (forward,) = [targets for is_bwd, targets in inner_graphs if not is_bwd]
    (backward_,) = [targets for is_bwd, targets in inner_graphs if is_bwd]
    assert torch.ops.fusedepi.chain.default in forward
    assert aten.addmm.default not in backward_ and aten.convolution.default not in backward_
    if fusion.startswith("linear"):
        assert backward_.count(aten.mm.default) == 2


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_gradients(dtype, on_device):
    # RMSNorm decomposes to float32 math between two conversions for bf16: the
    # anchor output and the normalized value are saved widened, its rsqrt per row.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 256), nn.RMSNorm(256), nn.GELU()).to(on_device, dtype)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = _forward_backward(model, eager, ref, torch.rand(16, 48, device=on_device, dtype=dtype))
    assert [r.fusion for r in fused] == ["linear_rmsnorm"] and '"what":"rstd"' in fused[0].spec


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [20, 300], ids=["planes_of_324", "planes_of_88804"])
def test_conv_batchnorm_train_gradients(size, dtype, on_device):
    # The conv's BatchNorm saves its batch mean and invstd per channel for backward
    # (planes of 324 elements: a warp each; of 88804: several blocks a plane).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.SiLU()).to(on_device, dtype)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = _forward_backward(model, eager, ref, torch.rand(2, 3, size, size, device=on_device, dtype=dtype))
    assert [r.fusion for r in fused] == ["conv_batchnorm_train"]
    assert '"what":"mean"' in fused[0].spec and '"what":"rstd"' in fused[0].spec
    for name in ("running_mean", "running_var"):
        close_to_float64(getattr(model[1], name), getattr(eager[1], name), getattr(ref[1], name), name)


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_instance_norm_gradients(dims, on_device):
    # InstanceNorm is GroupNorm with a channel per group: where the partitioner keeps
    # its mean and rsqrt for backward ([1, N*C, 1, ...]), the fused op returns them.
    torch.manual_seed(dims)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](3, 8, 3)
    norm = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[dims](8, affine=True)
    model = nn.Sequential(conv, norm, nn.SiLU()).to(on_device)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-1.0, 1.0)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.rand((2, 3) + (9, 8, 7)[:dims], device=on_device)
    fused = _forward_backward(model, eager, ref, x)
    assert [r.fusion for r in fused] == ["conv_groupnorm"]
    if dims > 1:  # the 1-D graph recomputes the statistics in backward
        assert '"what":"mean"' in fused[0].spec and '"what":"rstd"' in fused[0].spec


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("norm", ["instancenorm", "groupnorm"])
def test_training_at_a_symbolic_batch_saves_statistics_sized_by_it(norm, on_device):
    """A training step at batch 3, then at batch 2 (Dynamo's graph of a symbolic batch):
    the chain's saved statistics are sized by the batch at run time, InstanceNorm's in
    their second dim ([1, N * C, 1, 1]), GroupNorm's in their first ([N, G]); the chain
    fuses and the output and the gradients are eager's."""
    torch.manual_seed(0)
    norm_layer = (nn.InstanceNorm2d(8, affine=True) if norm == "instancenorm"
                  else nn.GroupNorm(4, 8))
    model = nn.Sequential(nn.Conv2d(4, 8, 3), norm_layer, nn.LeakyReLU(0.1)).to(on_device)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    compiled = torch.compile(model, backend=fusedepi)
    compiled(torch.rand(3, 4, 10, 12, device=on_device)).sum().backward()
    model.load_state_dict(eager.state_dict())
    model.zero_grad(set_to_none=True)
    x, upstream = torch.rand(2, 4, 10, 12, device=on_device), torch.rand(2, 8, 8, 10, device=on_device)
    reports: list = []
    with backend.collect_reports(reports):
        out = compiled(x)
    out.backward(upstream)
    eager_out = eager(x)
    eager_out.backward(upstream)
    ref_out = ref(x.double())
    ref_out.backward(upstream.double())
    fused = [r for report in reports for r in report.records if r.status == "fused"]
    assert len(fused) == 1, [r.reason for report in reports for r in report.records]
    saves = json.loads(fused[0].spec)["saves"]
    stats = [s["shape"] for s in saves if s["what"] in ("mean", "rstd")]
    assert stats and all(shape == ([1, -1, 1, 1] if norm == "instancenorm" else [-1, 4]) for shape in stats), saves
    close_to_float64(out, eager_out, ref_out, "output")
    for (name, p), e, r in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        close_to_float64(p.grad, e.grad, r.grad, name)


class _ReducedHead(nn.Module):
    """Conv, then a reduction of its output and steps around it:
    - spatial_mean / spatial_amax: GELU, global pooling over H and W, a per-channel
      scale, SiLU (backward reads the GELU's input and, for the max, which elements were
      largest and the pooled value, saved after the reduction: a value per row and channel);
    - channel_softmax: softmax over the channels times a per-channel scale (backward reads
      the softmax's output);
    - channel_amax: a per-channel scale, SiLU, the maximum over the channels, tanh;
    - layernorm: LayerNorm over the last two dims, GELU (backward reads the statistics per
      (row, channel) segment)."""

    def __init__(self, fusion):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8).view(8, 1, 1))
        self.fusion = fusion
        self.ln = nn.LayerNorm([18, 15]) if fusion == "layernorm" else None

    def forward(self, x):
        y = self.conv(x)
        if self.fusion == "spatial_mean":
            return F.silu(F.gelu(y).mean(dim=(2, 3)) * self.scale.view(8))
        if self.fusion == "spatial_amax":
            return F.silu(torch.amax(F.gelu(y), dim=(2, 3)) * self.scale.view(8))
        if self.fusion == "channel_softmax":
            return F.softmax(y, dim=1) * self.scale
        if self.fusion == "layernorm":
            return F.gelu(self.ln(y * self.scale))
        return torch.tanh(torch.amax(F.silu(y * self.scale), dim=1))


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", ["spatial_mean", "spatial_amax", "channel_softmax", "channel_amax", "layernorm"])
def test_conv_reduction_gradients(fusion, dtype, on_device):
    torch.manual_seed(0)
    model = _ReducedHead(fusion).to(on_device, dtype)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = _forward_backward(model, eager, ref, torch.rand(3, 3, 20, 17, device=on_device, dtype=dtype))
    assert [r.fusion for r in fused] == [f"conv_{fusion}"]


class _BmmHead(nn.Module):
    """torch.bmm of x[B, 6, 10] and a weight [B, 10, 12], then by `fusion`:
    - groupnorm: GroupNorm(3, 6) (backward reads its statistics per (row, group)), GELU;
    - spatial_softmax: a scale, softmax over the last dim, a per-channel scale (backward reads
      the softmax's output);
    - batchnorm_train: BatchNorm1d over the 6 channels (batch statistics, running stats
      updated), SiLU."""

    def __init__(self, fusion, batch=3):
        super().__init__()
        self.w = nn.Parameter(torch.randn(batch, 10, 12) / 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6).view(6, 1)) if fusion == "spatial_softmax" else None
        self.norm = {"groupnorm": nn.GroupNorm(3, 6), "batchnorm_train": nn.BatchNorm1d(6)}.get(fusion)
        self.fusion = fusion

    def forward(self, x):
        y = torch.bmm(x, self.w)
        if self.fusion == "spatial_softmax":
            return F.softmax(y * 0.5, dim=-1) * self.scale
        return (F.gelu if self.fusion == "groupnorm" else F.silu)(self.norm(y))


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fusion", ["groupnorm", "spatial_softmax", "batchnorm_train"])
def test_bmm_chain_gradients(fusion, dtype, on_device):
    torch.manual_seed(0)
    model = _BmmHead(fusion).to(on_device, dtype)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = _forward_backward(model, eager, ref, torch.rand(3, 6, 10, device=on_device, dtype=dtype))
    assert [r.fusion for r in fused] == [f"bmm_{fusion}"]
    for b, be, br in zip(model.buffers(), eager.buffers(), ref.buffers()):
        if b.is_floating_point():
            close_to_float64(b, be, br, "running statistics")


class _QuotientByProduct(nn.Module):
    """Linear on a 3-D input, max with a per-feature bound (a buffer), divided by the product: the
    backward reads the Linear's product both as the 2-D addmm output and as its 3-D view."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(24, 64)
        self.register_buffer("bound", torch.rand(64))

    def forward(self, x):
        y = self.linear(x)
        return torch.nn.functional.silu(-(torch.maximum(self.bound, y) / y))


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_value_saved_under_two_shapes_is_returned_once(dtype, on_device):
    torch.manual_seed(0)
    model = _QuotientByProduct().to(on_device, dtype)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = _forward_backward(model, eager, ref, torch.rand(4, 3, 24, device=on_device, dtype=dtype))
    (record,) = fused
    saves = [(s["what"], s["at"]) for s in json.loads(record.spec)["saves"]]
    assert saves.count(("value", 0)) == 1, saves  # its 3-D view is a view of that output


def test_backward_reads_the_saved_input_of_amin(monkeypatch):
    # amin's backward compares its input with the minimum: recomputed by Inductor from
    # the GEMM output, the input would not equal the minimum the fused op found (GPU
    # fuzzer, seed 0, model 2409: gradient inf). The joint-graph pass keeps it saved,
    # though mish's backward holds a sigmoid(x) * x of its own that looks like a silu.
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(32, 64), nn.Mish(), nn.GELU(approximate="tanh"), nn.SiLU())
    reports: list = []
    try:
        with backend.collect_reports(reports):
            out = torch.compile(lambda x: torch.amin(model(x), dim=1), backend=fusedepi)(torch.rand(8, 32))
        out.sum().backward()
    finally:
        torch._dynamo.reset()
    (fused,) = [r for report in reports for r in report.records if r.status == "fused"]
    saves = json.loads(fused.spec)["saves"]
    assert ("value", 3) in [(s["what"], s["at"]) for s in saves]  # silu's output, amin's input


class _ExtremumAfterTheChain(nn.Module):
    """A float32 chain whose value an extremum outside it reads:
    - linear: Linear, erf, * 1.5, then amax over the batch (no chain takes it);
    - linear_median: the same, then the median of all its elements (backward spreads
      the gradient over the elements equal to it);
    - conv_layernorm: Conv3d, LayerNorm over W, GELU, then amin over the spatial dims
      (refused after a LayerNorm whose segments split the channels)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.anchor = nn.Linear(64, 48) if kind.startswith("linear") else nn.Conv3d(7, 6, 3, bias=False)
        self.norm = nn.LayerNorm(7) if kind == "conv_layernorm" else None

    def forward(self, x):
        if self.kind == "linear":
            return torch.amax(torch.erf(self.anchor(x)) * 1.5, dim=0)
        if self.kind == "linear_median":
            return torch.median(torch.erf(self.anchor(x)) * 1.5)
        return torch.amin(F.gelu(self.norm(self.anchor(x))), dim=(2, 3, 4))


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("kind, shape, fusion", [("linear", (32, 64), "linear_pointwise"),
                                                 ("linear_median", (32, 64), "linear_pointwise"),
                                                 ("conv_layernorm", (3, 7, 5, 9, 9), "conv_layernorm")])
def test_an_extremum_after_the_chain_reads_the_chains_own_value(kind, shape, fusion, on_device):
    # The extremum's backward divides by the count of its input's elements equal to the
    # result. Recomputed by Inductor in backward from a saved earlier value of the
    # chain, its input equalled no element of what the fused op gave the forward, and
    # every gradient was NaN (CPU fuzzer, --grad, seed 26, generation 13, model 272).
    # The joint-graph pass keeps such a chain's values saved.
    torch.manual_seed(0)
    model = _ExtremumAfterTheChain(kind).to(on_device)
    eager, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    fused = _forward_backward(model, eager, ref, torch.rand(shape, device=on_device))
    assert [r.fusion for r in fused] == [fusion]


@pytest.mark.parametrize("on_device", DEVICES, indirect=True)
@pytest.mark.parametrize("name", ["1_train", "3", "5"])
def test_twenty_optimizer_steps_track_eager(name, on_device):
    model, eager, ref, shape, _ = _three(name, on_device)
    compiled = torch.compile(model, backend=fusedepi)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.rand(shape, generator=gen) for _ in range(20)]
    runs = []
    for net, fn, dtype in ((model, compiled, torch.float32), (eager, eager, torch.float32), (ref, ref, torch.float64)):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for xb in batches:
            out = fn(xb.to(on_device, dtype))
            loss = (out - 0.5).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs.append(torch.stack(losses))
    close_to_float64(runs[0], runs[1], runs[2], "losses")
    for (pname, p), pe, pr in zip(model.named_parameters(), eager.parameters(), ref.parameters()):
        close_to_float64(p.detach(), pe.detach(), pr.detach(), pname)
    for (bname, b), be, br in zip(model.named_buffers(), eager.buffers(), ref.buffers()):
        if b.is_floating_point():
            close_to_float64(b, be, br, bname)
