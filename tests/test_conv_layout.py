"""Channels-last library convs (`Anchor.channels_last`, fusion_backend/forms/conv_layout.py)
without a GPU: the conv on channels-last operands, which chains are candidates,
FUSEDEPI_CONV_CHANNELS_LAST, and the rewrite through the reference implementation
(FUSEDEPI_CPU_REFERENCE=1)."""

import copy

import pytest
import torch
import torch.nn as nn

from fusion_backend import ops
from helpers import compile_records
from lowering.spec import SCALAR, Anchor, EpilogueSpec, Step

CONV2D = ((1, 1), (1, 1), (1, 1), False, (0, 0), 1)


@pytest.mark.parametrize("x_shape, w_shape, conv", [
    ((3, 5, 9, 18), (16, 5, 3, 3), CONV2D),
    ((2, 4, 6, 7, 5), (8, 4, 2, 3, 2), ((1, 2, 1), (0, 1, 1), (1, 1, 2), False, (0, 0, 0), 1)),
    ((3, 5, 6, 6), (5, 16, 3, 3), ((2, 2), (1, 1), (1, 1), True, (1, 0), 1)),  # transposed: [in, out, kh, kw]
])
def test_channels_last_conv_is_the_conv(x_shape, w_shape, conv):
    torch.manual_seed(0)
    x, w = torch.randn(x_shape, dtype=torch.float64), torch.randn(w_shape, dtype=torch.float64)
    b = torch.randn(w_shape[1] if conv[3] else w_shape[0], dtype=torch.float64)
    plain, staged = Anchor("conv", True, conv), Anchor("conv", True, conv, channels_last=True)
    expected = ops.run_anchor(plain, [x, w, b])
    raw = ops.run_anchor(staged, [x, w, b], for_kernels=True)
    assert raw.is_contiguous(memory_format=ops.channels_last_format(x)) and not raw.is_contiguous()
    torch.testing.assert_close(raw, expected)
    graph_layout = ops.run_anchor(staged, [x, w, b])  # the reference (and so the fake) is contiguous
    assert graph_layout.is_contiguous()
    torch.testing.assert_close(graph_layout, expected)


def test_spec_json_keeps_the_layout():
    spec = EpilogueSpec(Anchor("conv", True, CONV2D, channels_last=True), (Step("relu"),), "bfloat16", (), 16, 162,
                        "conv_pointwise")
    back = EpilogueSpec.from_json(spec.to_json())
    assert back == spec and back.anchor.channels_last


class _ConvChain(nn.Module):
    def __init__(self, conv, tail):
        super().__init__()
        self.conv = conv
        self.tail = tail

    def forward(self, x):
        return self.tail(self.conv(x))


class _Softmax1(nn.Module):
    def forward(self, y):
        return torch.softmax(y, dim=1) * 2.0


class _Amax1(nn.Module):
    def forward(self, y):
        return torch.tanh(torch.amax(y, dim=1, keepdim=True))


def _compiled(monkeypatch, setting, conv, tail, x_shape):
    """(output, eager output, the fused record's kernel string) with FUSEDEPI_CONV_CHANNELS_LAST=setting."""
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    monkeypatch.setenv("FUSEDEPI_CONV_CHANNELS_LAST", setting)
    torch.manual_seed(1)
    model = _ConvChain(conv, tail).eval()
    x = torch.randn(x_shape)
    eager = copy.deepcopy(model)(x)
    out, fused, refused = compile_records(model, x)
    assert len(fused) == 1 and not refused, refused
    return out, eager, fused[0].kernel


@pytest.mark.parametrize("conv, tail, x_shape", [
    (nn.Conv2d(5, 16, 3, padding=1), nn.Sequential(nn.BatchNorm2d(16), nn.ELU()), (3, 5, 9, 18)),
    (nn.ConvTranspose2d(4, 8, 3, stride=2), nn.Sequential(nn.GroupNorm(4, 8), nn.Sigmoid()), (2, 4, 5, 6)),
    (nn.Conv3d(2, 4, 2), nn.GELU(), (2, 2, 4, 5, 3)),
    # Reductions over the channels read a channels-last y a pixel a thread, at any image size.
    (nn.Conv2d(64, 64, 3, padding=1), _Softmax1(), (1, 64, 32, 32)),
    (nn.Conv3d(2, 8, 2), _Amax1(), (2, 2, 4, 5, 3)),
    # Pointwise and BatchNorm chains of images larger than a block stages: tiles.
    (nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), (1, 64, 32, 32)),
    (nn.Conv2d(8, 64, 3, padding=1), nn.Sequential(nn.BatchNorm2d(64), nn.SiLU()), (2, 8, 32, 32)),
])
def test_on_runs_the_conv_channels_last(monkeypatch, conv, tail, x_shape):
    out, eager, kernel = _compiled(monkeypatch, "1", conv, tail, x_shape)
    assert kernel.endswith("(library conv on channels-last operands)")
    assert out.is_contiguous()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting, conv, tail, x_shape", [
    ("0", nn.Conv2d(5, 16, 3, padding=1), nn.ReLU(), (3, 5, 9, 18)),     # off
    ("auto", nn.Conv2d(5, 16, 3, padding=1), nn.ReLU(), (3, 5, 9, 18)),  # auto times on CUDA only
    ("1", nn.Conv1d(5, 16, 3), nn.ReLU(), (3, 5, 40)),                   # 1-D: no channels-last format
    # a GroupNorm group of 64 x 1024 elements: no block stages the image, holds the group's
    # pixel vectors (16,384 of 4 channels), nor do tiles take a GroupNorm
    ("1", nn.Conv2d(64, 64, 3, padding=1), nn.GroupNorm(1, 64), (1, 64, 32, 32)),
])
def test_not_channels_last(monkeypatch, setting, conv, tail, x_shape):
    _, _, kernel = _compiled(monkeypatch, setting, conv, tail, x_shape)
    assert "channels-last" not in kernel


class _ScaledInput(nn.Module):
    """A pointwise op makes the conv's input (Inductor's kernel, which can write it in
    any layout), or not (`scale` None: the graph's own contiguous input)."""

    def __init__(self, conv, scale):
        super().__init__()
        self.conv, self.scale = conv, scale

    def forward(self, x):
        if self.scale is not None:
            x = x * self.scale
        return torch.relu(self.conv(x))


@pytest.mark.parametrize("scale", [None, 2.0])
@pytest.mark.parametrize("conv, x_shape", [
    (nn.Conv2d(5, 16, 3, padding=1), (3, 5, 9, 18)),
    (nn.Conv3d(2, 4, 2), (2, 2, 4, 5, 3)),
])
def test_inductor_hands_the_op_channels_last_operands(monkeypatch, conv, x_shape, scale):
    """The fused op asks for channels-last x and weight (`ops.input_layouts`): Inductor
    writes them so, and the op's own copies (`run_anchor`) have nothing to do."""
    seen = []
    reference = ops.reference

    def recording(inputs, spec):
        if not isinstance(inputs[0], torch._subclasses.FakeTensor):
            layout = ops.channels_last_format(inputs[0])
            seen.append([t.is_contiguous(memory_format=layout) for t in inputs[:2]])
        return reference(inputs, spec)

    monkeypatch.setattr(ops, "reference", recording)
    # Compiled, not read from Inductor's FX graph cache (a run with the ask patched out would be served).
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    out, eager, kernel = _compiled(monkeypatch, "1", _ScaledInput(conv, scale), nn.Identity(), x_shape)
    assert kernel.endswith("(library conv on channels-last operands)")
    assert seen == [[True, True]]
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


def test_a_contiguous_conv_asks_no_layout():
    x, w = torch.empty(2, 3, 8, 8), torch.empty(4, 3, 3, 3)
    plain = EpilogueSpec(Anchor("conv", False, CONV2D), (Step("relu"),), "float32", (), 4, 36, "conv_pointwise")
    assert ops.input_layouts(plain.to_json(), [x, w]) is None
    staged = EpilogueSpec(Anchor("conv", False, CONV2D, channels_last=True), (Step("relu"),), "float32", (), 4, 36,
                          "conv_pointwise")
    (asked, spec), kwargs = ops.input_layouts(staged.to_json(), [x, w])
    assert spec == staged.to_json() and kwargs == {}
    assert asked[0].shape == x.shape and asked[0].is_contiguous(memory_format=torch.channels_last)
    assert asked[1].shape == w.shape and asked[1].is_contiguous(memory_format=torch.channels_last)


def test_a_dynamic_batch_asks_the_same_layouts(monkeypatch):
    """A batch that varies (marked dynamic): the layouts asked are symbolic in it, and two
    batch sizes run through one compile as eager computes them."""
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    monkeypatch.setenv("FUSEDEPI_CONV_CHANNELS_LAST", "1")
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    seen = []
    reference = ops.reference

    def recording(inputs, spec):
        if not isinstance(inputs[0], torch._subclasses.FakeTensor):
            seen.append((inputs[0].shape[0], inputs[0].is_contiguous(memory_format=torch.channels_last)))
        return reference(inputs, spec)

    monkeypatch.setattr(ops, "reference", recording)
    torch.manual_seed(0)
    model = _ScaledInput(nn.Conv2d(5, 16, 3, padding=1), 2.0).eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fusedepi)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        for batch in (3, 5):
            x = torch.randn(batch, 5, 9, 18)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    fused = [r for report in reports for r in report.records if r.status == "fused"]
    assert len(fused) == 1 and fused[0].kernel.endswith("(library conv on channels-last operands)")
    assert seen == [(3, True), (5, True)]


def test_the_ops_output_is_contiguous_for_a_channels_last_input():
    """The op's reference (also its fake) gives its output contiguous, as the CUDA op
    allocates it, where a conv on a channels-last x would give it channels-last:
    Inductor holds the CUDA op's output to the fake's strides."""
    spec = EpilogueSpec(Anchor("conv", False, CONV2D), (Step("relu"), Step("mul", consts=(2.0,), operand=SCALAR)),
                        "float32", (), 4, 36, "conv_pointwise")
    x = torch.rand(2, 3, 8, 8).to(memory_format=torch.channels_last)
    w = torch.rand(4, 3, 3, 3)
    assert not torch.nn.functional.conv2d(x, w, padding=1).is_contiguous()
    (out,) = ops.reference([x, w], spec.to_json())
    assert out.is_contiguous()
    torch.testing.assert_close(out, torch.relu(torch.nn.functional.conv2d(x.contiguous(), w, padding=1)) * 2.0)


def test_the_in_kernel_conv_asks_a_channels_last_input(monkeypatch):
    """A conv that the CUDA op computes as the in-kernel conv (an implicit GEMM over a
    channels-last x) asks Inductor for a channels-last x and leaves a 16-bit weight free
    (the launcher lays it out itself; a float32 one the graph rounds to TF32, written
    channels-last as the kernel reads it); on another arch, or in float32 without TF32,
    nothing."""
    from specs import conv_gemm_specs
    from torch._subclasses.fake_tensor import FakeTensorMode

    arch = ["sm90"]
    monkeypatch.setattr(ops, "arch_of", lambda device: arch[0])
    for dtype in ("bfloat16", "float32"):
        spec = conv_gemm_specs(dtype)["igemm_relu_bias_64_128"]
        cin, kh, kw, h, w = spec.anchor.direct
        with FakeTensorMode():
            x = torch.empty(2, cin, h, w, device="cuda", dtype=getattr(torch, dtype))
            wt = torch.empty(spec.channels, cin, kh, kw, device="cuda", dtype=getattr(torch, dtype))
            for tf32 in (True, False):
                monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
                arch[0] = "sm90"
                layouts = ops.input_layouts(spec.to_json(), [x, wt])
                if dtype == "float32" and not tf32:
                    assert layouts is None
                    continue
                (asked, _), _ = layouts
                assert asked[0].shape == x.shape and asked[0].is_contiguous(memory_format=torch.channels_last)
                if dtype == "float32":  # the graph's rounding of the weight writes it as the kernel reads it
                    assert asked[1].is_contiguous(memory_format=torch.channels_last)
                else:
                    assert asked[1] is None
                arch[0] = "sm80"
                assert ops.input_layouts(spec.to_json(), [x, wt]) is None
    cpu = conv_gemm_specs("bfloat16")["igemm_relu_bias_64_128"]
    cin, kh, kw, h, w = cpu.anchor.direct
    arch[0] = "sm90"
    assert ops.input_layouts(cpu.to_json(), [torch.empty(2, cin, h, w), torch.empty(cpu.channels, cin, kh, kw)]) is None


def test_a_3d_in_kernel_conv_asks_a_channels_last_3d_input(monkeypatch):
    """A Conv3d the in-kernel conv computes (`Anchor.depth`) asks Inductor for x
    channels-last-3d, which its 5-D tensor map reads (else the launcher copies x itself)."""
    from specs import conv_gemm_specs
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(ops, "arch_of", lambda device: "sm90")
    spec = conv_gemm_specs("bfloat16")["igemm3d_gn_silu"]
    cin, kh, kw, h, w = spec.anchor.direct
    kd, d = spec.anchor.depth
    with FakeTensorMode():
        x = torch.empty(2, cin, d, h, w, device="cuda", dtype=torch.bfloat16)
        wt = torch.empty(spec.channels, cin, kd, kh, kw, device="cuda", dtype=torch.bfloat16)
        assert ops.runs_in_kernel_conv(spec, x, channels_last=True)
        (asked, _), _ = ops.input_layouts(spec.to_json(), [x] + [wt])
        assert asked[0].shape == x.shape and asked[0].is_contiguous(memory_format=torch.channels_last_3d)
        flat = torch.empty(2, cin, h, w, device="cuda", dtype=torch.bfloat16)
        assert not ops.runs_in_kernel_conv(spec, flat)  # a 4-D x is not the 3-D conv's


def test_an_in_kernel_conv_that_reads_nchw_asks_no_layout(monkeypatch):
    """Where the in-kernel conv reads x in its NCHW layout (`ConvGemmPlan.nchw`), the op
    asks Inductor for no channels-last copy of x: nothing is constrained."""
    from specs import conv_gemm_specs
    from torch._subclasses.fake_tensor import FakeTensorMode

    from cuda_templates import conv_sm90

    monkeypatch.setattr(ops, "arch_of", lambda device: "sm90")
    spec = conv_gemm_specs("bfloat16")["igemm_1x1_nchw_gelu"]
    cin, kh, kw, h, w = spec.anchor.direct
    with FakeTensorMode():
        x = torch.empty(2, cin, h, w, device="cuda", dtype=torch.bfloat16)
        wt = torch.empty(spec.channels, cin, kh, kw, device="cuda", dtype=torch.bfloat16)
        monkeypatch.setattr(conv_sm90, "READS_NCHW", False)
        assert ops.input_layouts(spec.to_json(), [x, wt]) is not None  # READS_NCHW off: channels-last
        monkeypatch.setattr(conv_sm90, "READS_NCHW", True)
        assert ops.runs_in_kernel_conv(spec, x) and not ops.runs_in_kernel_conv(spec, x, channels_last=True)
        assert ops.input_layouts(spec.to_json(), [x, wt]) is None


@pytest.mark.parametrize("x_is", ["computed", "a graph input", "used elsewhere", "computed, the conv it replaces"])
def test_a_computed_x_of_a_tf32_in_kernel_conv_is_asked_channels_last_beside_its_rounding(monkeypatch, x_is):
    """A float32 in-kernel conv takes x rounded to TF32 (first) and x itself (last but
    one, for a call with TF32 off). Where the graph computes x for the op alone, both are
    asked channels-last, so that Inductor's kernel making them stores both alike; a graph
    input, or an x that other ops read as it is, stays free (no copy of it is made)."""
    from specs import conv_gemm_specs
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(ops, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    spec = conv_gemm_specs("float32")["igemm_relu_bias_64_128"]
    assert spec.anchor.rounded
    cin, kh, kw, h, w = spec.anchor.direct
    graph = torch.fx.Graph()
    with FakeTensorMode():
        vals = [torch.empty(2, cin, h, w, device="cuda"), torch.empty(spec.channels, cin, kh, kw, device="cuda")]
        vals += [torch.empty(spec.channels, device="cuda") for _ in spec.param_dtypes]
        nodes = []
        for i, val in enumerate(vals):
            nodes.append(graph.placeholder(f"in{i}"))
            nodes[-1].meta["val"] = val
        if x_is != "a graph input":
            x = graph.call_function(torch.ops.aten.relu.default, (nodes[0],))
            x.meta["val"] = torch.relu(vals[0])
            nodes[0] = x
        if x_is == "computed, the conv it replaces":  # as the rewrite has it: the old conv reads x too
            conv = graph.call_function(torch.ops.aten.convolution.default,
                                       (nodes[0], nodes[1], None, *spec.anchor.conv))
        call = ops.insert_chain(graph, nodes, spec.to_json(), value=False)
        if x_is == "computed, the conv it replaces":
            (asked, _), _ = call.meta["eager_input_vals"]
            assert asked[-2] is None  # the conv still reads x
            graph.erase_node(conv)
            ops.ask_graph_input_layouts(graph)  # rewrite.rewrite, after the surgery
        if x_is == "used elsewhere":
            other = graph.call_function(torch.ops.aten.neg.default, (nodes[0],))
            other.meta["val"] = -vals[0]
            ops.ask_input_layouts(call)  # asked again, as after AOTAutograd's trace
    inputs = call.args[0]
    assert inputs[-2] is nodes[0] and inputs[-1] is nodes[1]
    (asked, _), _ = call.meta["eager_input_vals"]
    assert asked[0].is_contiguous(memory_format=torch.channels_last)
    if x_is.startswith("computed"):
        assert asked[-2].shape == vals[0].shape and asked[-2].is_contiguous(memory_format=torch.channels_last)
    else:
        assert asked[-2] is None
    assert asked[-1] is None
