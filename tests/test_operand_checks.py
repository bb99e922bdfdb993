"""GPU-free: no kernel reads an operand it has not checked.

Graphs of CUDA tensors are traced with fake tensors (no GPU needed) and matched; the
launchers' per-call checks are plain torch and run on CPU tensors here.
"""

import struct
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusion_backend import launch, native, ops
from lowering import match_graph
from lowering.spec import BROADCAST, CHANNEL, FULL, ONE, SCALAR, Anchor, EpilogueSpec, Step, operand_numel

aten = torch.ops.aten


def _cuda_graph(fn, *shapes, cpu_inputs=()):
    """fn traced on fake CUDA tensors of `shapes` (and fake CPU tensors of `cpu_inputs`)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [torch.empty(s, device="cuda") for s in shapes] + [torch.empty(s) for s in cpu_inputs]
        return make_fx(fn)(*inputs).graph


def _conv(x, w):
    return aten.convolution.default(x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


def _float32(value):
    return struct.unpack("f", struct.pack("f", value))[0]


@pytest.mark.parametrize("dtype, value, baked", [
    (torch.float32, 0.5, 0.5),
    (torch.float32, 0.1, _float32(0.1)),  # the tensor stores float32(0.1)
    (torch.float64, 0.1, 0.1),  # ATen's kernel converts the double to float32, as the kernel's literal does
])
def test_a_cpu_zero_dim_constant_on_a_cuda_chain_is_a_number(dtype, value, baked):
    """`torch.min(conv(x), torch.tensor(0.5))` made an illegal memory access when the
    CPU tensor reached the kernel as a one-element operand."""

    def f(x, w, b):
        y = aten.minimum.default(_conv(x, w), aten.full.default([], value, dtype=dtype, device="cpu"))
        return (y + b) * 2.0

    chains, refusals = match_graph(_cuda_graph(f, (2, 4, 10, 10), (8, 4, 3, 3), (8, 1, 1)))
    assert not refusals and len(chains) == 1
    minimum, add, mul = chains[0].spec.steps
    assert (minimum.name, minimum.operand, minimum.consts) == ("minimum", SCALAR, (baked,))
    assert (add.operand, mul.consts) == (CHANNEL, (2.0,))
    assert all(p.meta["val"].device.type == "cuda" for p in chains[0].params)
    # The fused op's reference (its fake implementation while the graph is rewritten) takes the number.
    example = [n.meta["val"] for n in chains[0].operands + chains[0].params]
    with detect_fake_mode(example):
        (out,) = ops.reference(example, chains[0].spec.to_json())
    assert out.shape == (2, 8, 8, 8) and out.device.type == "cuda"


def test_the_reference_reads_a_scalar_extremum_as_eager_does():
    x = torch.tensor([0.25, 0.75, -1.0])
    for name, fn in (("minimum", torch.minimum), ("maximum", torch.maximum)):
        spec = EpilogueSpec(Anchor("mm"), (Step(name, consts=(0.5,), operand=SCALAR),), "float32", (), 3, 1,
                            "linear_pointwise")
        (out,) = ops.reference([x[None], torch.eye(3)], spec.to_json())
        torch.testing.assert_close(out[0], fn(x, torch.tensor(0.5)))


def test_a_cpu_tensor_operand_on_a_cuda_chain_is_refused_with_the_reason():
    def f(x, w, s):  # s: a 0-dim CPU tensor the graph receives (no value known while compiling)
        return torch.relu(_conv(x, w)) * s

    chains, _ = match_graph(_cuda_graph(f, (2, 4, 10, 10), (8, 4, 3, 3), cpu_inputs=[()]))
    assert len(chains) == 1 and [s.name for s in chains[0].spec.steps] == ["relu"]
    assert "is on cpu, the chain on cuda" in chains[0].stop


# A linear chain with one operand of each kind: bias [N] (channel), scale [] (one), a
# residual [M, N] (full), a LayerNorm's weight and bias [N], and a full operand [M] after
# a row reduction.
_SPEC = EpilogueSpec(
    Anchor("addmm"),
    (Step("add", inputs=(0,), operand=CHANNEL), Step("mul", inputs=(1,), operand=ONE),
     Step("add", inputs=(2,), operand=FULL), Step("layernorm", consts=(1e-5,), inputs=(3, 4)),
     Step("logsumexp"), Step("sub", inputs=(5,), operand=FULL)),
    "float32", ("float32",) * 6, 16, 1, "linear_layernorm",
)


def _params(rows):
    return [torch.zeros(16), torch.zeros(()), torch.zeros(rows, 16), torch.ones(16), torch.zeros(16),
            torch.zeros(rows)]


def test_param_sizes_name_every_operand():
    assert _SPEC.param_sizes() == ((16, 0, 1), (1, 0, 1), (0, 16, 1), (16, 0, 1), (16, 0, 1), (0, 1, 1))


def test_the_launcher_checks_pass_operands_of_the_graphs_sizes():
    launch.check_params(_params(5), 5, _SPEC)
    launch.check_anchor_operands([torch.zeros(16), torch.zeros(5, 8), torch.zeros(8, 16)], _SPEC, "library anchor")
    launch.check_anchor_output(torch.zeros(5, 16), 5, _SPEC)


@pytest.mark.parametrize("index, bad", [
    (0, torch.zeros(15)),  # a per-channel operand one short
    (1, torch.zeros(2)),  # "one element" of two
    (2, torch.zeros(4, 16)),  # a residual of other rows
    (3, torch.ones(16, dtype=torch.float64)),  # another dtype
    (5, torch.zeros(6)),  # after the reduction: one a row
])
def test_the_launcher_refuses_an_operand_of_another_size_or_dtype(index, bad):
    params = _params(5)
    params[index] = bad
    with pytest.raises(RuntimeError, match=f"operand {index} is"):
        launch.check_params(params, 5, _SPEC)


# A 3-D Linear's chain [B, 4, 16] times a per-sample gate [B, 1, 16] (a DiT block's):
# 16 elements for every 4 rows of the anchor output.
_GATE = EpilogueSpec(Anchor("addmm"), (Step("mul", inputs=(0,), operand=BROADCAST, consts=(64, 0, 16, 1, 16, 1)),),
                     "float32", ("float32",), 16, 1, "linear_pointwise")


def test_a_per_sample_operand_is_checked_by_groups_of_rows():
    assert _GATE.param_sizes() == ((0, 16, 4),)
    assert (operand_numel((0, 16, 4), 8), operand_numel((0, 16, 4), 6), operand_numel((5, 0, 1), 6)) == (32, None, 5)
    launch.check_params([torch.zeros(2, 1, 16)], 8, _GATE)
    with pytest.raises(RuntimeError, match=r"operand 0 is \(3, 1, 16\).*built for 32 float32 elements"):
        launch.check_params([torch.zeros(3, 1, 16)], 8, _GATE)
    with pytest.raises(RuntimeError, match="16 float32 elements every 4 rows, and 6 rows are no whole number"):
        launch.check_params([torch.zeros(2, 1, 16)], 6, _GATE)
    assert native.CheckLayout.of(SimpleNamespace(spec=_GATE, anchor_sizes=[])).params == ((0, 0, 16, 4),)


def test_the_launcher_refuses_inputs_off_the_chains_gpu_and_wrong_anchor_outputs():
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = [torch.empty(1, device="cuda:0"), torch.empty(1, device="cuda:1")]
    launch.check_devices(on_gpu[:1], 0, "linear_layernorm")
    with pytest.raises(RuntimeError, match="input 1 is on cpu, the chain on cuda:0"):
        launch.check_devices([on_gpu[0], torch.zeros(1)], 0, "linear_layernorm")
    with pytest.raises(RuntimeError, match="input 1 is on cuda:1, the chain on cuda:0"):
        launch.check_devices(on_gpu, 0, "linear_layernorm")
    with pytest.raises(RuntimeError, match="the anchor gave"):
        launch.check_anchor_output(torch.zeros(5, 15), 5, _SPEC)
    with pytest.raises(RuntimeError, match="anchor operand 1 is"):
        launch.check_anchor_operands([torch.zeros(16), torch.zeros(5, 8, dtype=torch.bfloat16), torch.zeros(8, 16)],
                                  _SPEC, "library anchor")


def test_in_kernel_anchors_check_the_sizes_they_were_built_for():
    spec = EpilogueSpec(Anchor("addmm", gemm=(8, 0)), (Step("relu"),), "float32", (), 16, 1, "linear_pointwise")
    launch.check_anchor_operands([torch.zeros(16), torch.zeros(5, 8), torch.zeros(8, 16)], spec, "in-kernel GEMM")
    with pytest.raises(RuntimeError, match="anchor operand 1 is"):
        launch.check_anchor_operands([torch.zeros(16), torch.zeros(5, 9), torch.zeros(9, 16)], spec, "in-kernel GEMM")
    conv = EpilogueSpec(Anchor("conv", conv=((1, 1), (0, 0), (1, 1), False, (0, 0), 1), direct=(4, 3, 3, 10, 10)),
                        (Step("relu"),), "float32", (), 8, 64, "conv_pointwise")
    launch.check_anchor_operands([torch.zeros(2, 4, 10, 10), torch.zeros(8, 4, 3, 3)], conv, "direct conv")
    with pytest.raises(RuntimeError, match="anchor operand 0 is"):
        launch.check_anchor_operands([torch.zeros(2, 4, 10, 11), torch.zeros(8, 4, 3, 3)], conv, "direct conv")


@pytest.mark.parametrize("dtype, cin, padded", [("bfloat16", 20, 32), ("bfloat16", 8, 32), ("float32", 12, 16),
                                                 ("float32", 40, 64), ("float16", 64, 64)])
def test_the_in_kernel_conv_reads_its_operands_in_its_own_layout(dtype, cin, padded):
    """The in-kernel conv's operands, as the launcher hands them to its tensor maps: x
    channels-last, its pixels C_in rounded up to 16 bytes apart (20 bf16 channels: 24;
    `launch.padded_pixels`), the weight [C_out, kh, kw, C_in'] with C_in' padded with zeros
    to whole k-steps (64 bytes where a pixel's C_in fits them, else 128: 32 or 64 16-bit,
    16 or 32 float32 channels), values unchanged; a shape other than the kernel's raises
    before any kernel runs."""
    anchor = Anchor("conv", conv=((1, 1), (1, 1), (1, 1), False, (0, 0), 1), direct=(cin, 3, 3, 6, 7), implicit=True)
    spec = EpilogueSpec(anchor, (Step("relu"),), dtype, (), 16, 42, "conv_pointwise")
    t = getattr(torch, dtype)
    x, w = torch.randn(2, cin, 6, 7).to(t), torch.randn(16, cin, 3, 3).to(t)
    launch.check_anchor_operands([x, w], spec, "in-kernel conv")
    xc, wp = launch.channels_last_operands([x, w], spec)
    pitch = -(-cin * t.itemsize // 16) * 16 // t.itemsize
    assert xc.stride() == (6 * 7 * pitch, 1, 7 * pitch, pitch) and xc.data_ptr() % 16 == 0 and torch.equal(xc, x)
    assert (pitch == cin) == xc.is_contiguous(memory_format=torch.channels_last)
    assert launch.channels_last_operands([xc, w], spec)[0] is xc  # laid out so already: no copy
    assert wp.shape == (16, 3, 3, padded) and wp.is_contiguous()
    assert torch.equal(wp[..., :cin], w.permute(0, 2, 3, 1)) and not wp[..., cin:].any()
    with pytest.raises(RuntimeError, match="the kernel was built for"):
        launch.channels_last_operands([x.transpose(2, 3), w], spec)
    with pytest.raises(RuntimeError, match="the kernel was built for"):
        launch.channels_last_operands([x, w[:8]], spec)
    # A file that reads x in its NCHW layout (`ConvGemmPlan.nchw`): x contiguous, a
    # channels-last x copied so, the weight as above.
    xn, wn = launch.channels_last_operands([x.contiguous(memory_format=torch.channels_last), w], spec, nchw=True)
    assert xn.is_contiguous() and torch.equal(xn, x) and torch.equal(wn, wp)


def test_only_convs_the_file_may_compute_follow_cudnns_tf32_flag():
    # A launcher variant for each cuDNN TF32 flag where the file's own conv kernels may
    # run (the direct conv: stride 1; the in-kernel conv, any stride); a strided library
    # conv's file is one.
    conv = Anchor("conv", conv=((1, 1), (0, 0), (1, 1), False, (0, 0), 1), direct=(4, 3, 3, 10, 10))
    spec = EpilogueSpec(conv, (Step("relu"),), "float32", (), 8, 64, "conv_pointwise")
    assert launch.reads_conv_tf32(spec.to_json())
    strided = replace(spec, anchor=replace(conv, conv=((2, 2),) + conv.conv[1:]), inner=16)
    assert not launch.reads_conv_tf32(strided.to_json())
    assert launch.reads_conv_tf32(strided.with_in_kernel_conv().to_json())
    assert not launch.reads_conv_tf32(replace(spec, dtype="bfloat16").to_json())


def test_a_conv_chain_the_launchers_would_shape_otherwise_than_the_graph_is_refused():
    # The launchers give the op's output the spec's shape (`Anchor.direct_out_spatial`,
    # `reduced_tail` over `Anchor.spatial_dims`): a Conv1d's [2, 8, 18], of 3 x 20 input
    # columns as one row (`Anchor.as_2d`), checks; a spec whose plane or dims differ is
    # refused before a kernel is built.
    from types import SimpleNamespace

    from fusion_backend.rewrite import OperandMismatch, _check_operands

    row = Anchor("conv", conv=((1, 1), (0, 0), (1, 1), False, (0, 0), 1), direct=(3, 1, 3, 1, 20), as_2d=True)
    spec = EpilogueSpec(row, (Step("relu"),), "float32", (), 8, 18, "conv_pointwise")
    anchor = SimpleNamespace(meta={"val": torch.zeros(2, 8, 18)}, name="convolution")
    _check_operands(SimpleNamespace(spec=spec, anchor=anchor, params=[]))
    for bad in (replace(row, as_2d=False), replace(row, direct=(3, 1, 3, 1, 22))):
        with pytest.raises(OperandMismatch, match=r"the conv's output \(2, 8, 18\) is not the one the kernels"):
            _check_operands(SimpleNamespace(spec=replace(spec, anchor=bad), anchor=anchor, params=[]))


def test_a_3d_in_kernel_convs_operands_are_laid_out_and_checked_as_built():
    # `launch.channels_last_operands` for a Conv3d (`Anchor.depth`): x channels-last-3d
    # (its pixels padded to 16 bytes), the weight as [C_out, kd, kh, kw, C_in'] with zeros past C_in (12 bf16 channels: a
    # 64-byte k-step, 32); an x or weight of other sizes raises, naming both; the
    # per-row and whole sizes the launchers check count the depth.
    conv = Anchor("conv", conv=((1, 1, 1), (1, 0, 0), (1, 1, 1), False, (0, 0, 0), 1), direct=(12, 3, 3, 6, 7),
                  depth=(2, 5), implicit=True)
    spec = EpilogueSpec(conv, (Step("relu"),), "bfloat16", (), 16, 6 * 4 * 5, "conv_pointwise")
    assert conv.direct_out_spatial() == (6, 4, 5)
    x = torch.randn(2, 12, 5, 6, 7, dtype=torch.bfloat16)
    w = torch.randn(16, 12, 2, 3, 3, dtype=torch.bfloat16)
    cx, cw = launch.channels_last_operands([x, w], spec)  # (12 bf16 channels: pixels 16 apart)
    assert cx.stride() == (5 * 6 * 7 * 16, 1, 6 * 7 * 16, 7 * 16, 16) and torch.equal(cx, x)
    assert cw.shape == (16, 2, 3, 3, 32) and cw.is_contiguous()
    assert torch.equal(cw[..., :12], w.permute(0, 2, 3, 4, 1)) and not cw[..., 12:].any()
    assert launch.anchor_operand_sizes(spec, "in-kernel conv") == [(12 * 5 * 6 * 7, 0), (0, 16 * 12 * 2 * 3 * 3)]
    for bad_x, bad_w in ((x[:, :, :4], w), (x, w[:, :, :1]), (x[:, :, 0], w)):
        with pytest.raises(RuntimeError, match=r"the kernel was built for \[rows, 12, 5, 6, 7\] and \[16, 12, 2, 3, 3\]"):
            launch.channels_last_operands([bad_x, bad_w], spec)
