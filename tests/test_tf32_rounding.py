"""The in-kernel conv's float32 operands rounded to TF32 by the graph (`Anchor.rounded`):
the rounding itself against float64, the graph ops the rewrite puts before the fused op,
the layouts it asks, and which operands each path of a call reads. CPU only (the
graph's values are fake CUDA tensors; the GPU tests run the conv)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fusion_backend import ops, rewrite
from lowering import match_graph


def _nearest_tf32(v: float) -> float:
    """v rounded to 10 mantissa bits, ties away from zero, in float64 arithmetic."""
    if math.isnan(v) or math.isinf(v) or v == 0.0:
        return v
    step = 2.0 ** (max(math.frexp(abs(v))[1], -125) - 11)  # a TF32 unit in v's binade (denormals: 2^-136)
    q = abs(v) / step
    r = math.floor(q + 0.5) * step
    return math.copysign(r, v)


def test_round_to_tf32_is_the_nearest_value_ties_away():
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (200000,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = x[torch.isfinite(x) & (x.abs() < 3.0e38)]  # every binade, denormals included
    got = ops.round_to_tf32(x)
    want = torch.tensor([_nearest_tf32(v) for v in x.double().tolist()], dtype=torch.float64)
    assert torch.equal(got.double(), want)
    assert torch.equal(got.view(torch.int32) & 0x1FFF, torch.zeros_like(bits[: len(x)]))


@pytest.mark.parametrize("value, expected", [
    (0x3F801000, 0x3F802000),  # 1 + half a TF32 unit: a tie, away from zero
    (0xBF801000, 0xBF802000),  # its negative
    (0x3F800FFF, 0x3F800000),  # just under the tie: down
    (0x3F801001, 0x3F802000),  # just over: up
    (0x3FFFF000, 0x40000000),  # a carry into the exponent
    (0x00001000, 0x00002000),  # the smallest denormals
    (0x80000000, 0x80000000),  # -0
    (0x7F800000, 0x7F800000),  # inf
    (0xFF800000, 0xFF800000),  # -inf
    (0x7F7FFFFF, 0x7F800000),  # float32's largest: past TF32's by more than half a unit, inf
])
def test_round_to_tf32_at_the_edges(value, expected):
    x = torch.tensor([value], dtype=torch.int64).to(torch.int32).view(torch.float32)
    got = ops.round_to_tf32(x).view(torch.int32).item() & 0xFFFFFFFF
    assert got == expected


def test_round_to_tf32_keeps_nan():
    x = torch.tensor([0x7FFFFFFF, 0xFFFFFFFF, 0x7FC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    assert ops.round_to_tf32(x).isnan().all()


def _conv_graph(dtype=torch.float32, bias=False, width=70):
    """A fake-CUDA graph of Conv2d(64 -> 128, k3) -> relu -> * 2 on x [2, 64, 20, width]
    and its one chain, marked for the in-kernel conv (as FUSEDEPI_IN_KERNEL_CONV=1 marks it)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(2, 64, 20, width, device="cuda", dtype=dtype)
        w = torch.empty(128, 64, 3, 3, device="cuda", dtype=dtype)
        b = torch.empty(128, device="cuda", dtype=dtype)

        def f(x, w, b):
            y = torch.ops.aten.convolution.default(x, w, b if bias else None, [1, 1], [0, 0], [1, 1], False,
                                                   [0, 0], 1)
            return torch.relu(y) * 2.0

        gm = make_fx(f)(x, w, b)
    chains, _ = match_graph(gm.graph, in_kernel_conv=True)
    return gm, chains


@pytest.fixture
def sm90_tf32(monkeypatch):
    monkeypatch.setattr(ops, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)


def _chain_call(gm):
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.fusedepi.chain.default]
    return call


def test_the_in_kernel_conv_in_float32_reads_rounded_operands():
    """Wherever the in-kernel conv is taken (`EpilogueSpec.with_in_kernel_conv`: the
    measured choice's form, or the matcher under FUSEDEPI_IN_KERNEL_CONV=1), float32
    means operands rounded by the graph; 16-bit, or a conv that keeps its bias, not."""
    _, (chain,) = _conv_graph()
    assert chain.spec.anchor.implicit and chain.spec.anchor.rounded
    _, (half,) = _conv_graph(torch.bfloat16)
    assert half.spec.anchor.implicit and not half.spec.anchor.rounded
    plain = replace(chain.spec, anchor=replace(chain.spec.anchor, implicit=False, rounded=False))
    assert plain.with_in_kernel_conv() == chain.spec
    biased = replace(plain, anchor=replace(plain.anchor, has_bias=True))
    assert not biased.with_in_kernel_conv().anchor.rounded


def test_the_graph_rounds_the_in_kernel_convs_operands(sm90_tf32):
    gm, (chain,) = _conv_graph()
    x, w = chain.operands[:2]
    spec = chain.spec.to_json()
    rewrite._replace(gm.graph, chain, spec, {})
    gm.graph.lint()
    call = _chain_call(gm)
    inputs, called = call.args
    assert called == spec
    assert inputs[2:] == [x, w] and inputs[0] is not x and inputs[1] is not w
    # Inductor is asked for the rounded x and weight channels-last (as the kernel reads
    # both), the unrounded ones in any layout
    (wanted, _), _ = call.meta["eager_input_vals"]
    assert wanted[0].is_contiguous(memory_format=torch.channels_last)
    assert wanted[1].is_contiguous(memory_format=torch.channels_last) and wanted[1].shape == (128, 64, 3, 3)
    assert wanted[2:] == [None, None]
    # The inserted ops compute ops.round_to_tf32, on real tensors
    ops_before = torch.fx.GraphModule(gm, _graph_of(gm.graph, inputs[:2]))
    xr, wr = torch.randn(2, 64, 20, 70), torch.randn(128, 64, 3, 3)
    got = ops_before(xr, wr, torch.randn(128))
    assert torch.equal(got[0], ops.round_to_tf32(xr)) and torch.equal(got[1], ops.round_to_tf32(wr))
    assert not torch.equal(got[0], xr)


def test_the_graph_passes_x_itself_where_the_kernel_rounds_it(sm90_tf32, monkeypatch):
    # A float32 x the in-kernel conv reads NCHW (conv_sm90.READS_NCHW_TF32; rows of whole
    # 16 bytes: 72 columns) is rounded by the kernel as it loads it: the call takes x itself
    # first, the rounded weight second, and asks no layout of either.
    from cuda_templates import conv_sm90

    for reads_nchw in (False, True):
        monkeypatch.setattr(conv_sm90, "READS_NCHW_TF32", reads_nchw)
        gm, (chain,) = _conv_graph(width=72)
        x, w = chain.operands[:2]
        assert ops.rounds_x_itself(chain.spec, x.meta["val"]) == reads_nchw
        rewrite._replace(gm.graph, chain, chain.spec.to_json(), {})
        gm.graph.lint()
        call = _chain_call(gm)
        inputs, _ = call.args
        assert inputs[2:] == [x, w] and inputs[1] is not w
        assert (inputs[0] is x) == reads_nchw
        assert ("eager_input_vals" not in call.meta) == reads_nchw
        if reads_nchw:
            ops_before = torch.fx.GraphModule(gm, _graph_of(gm.graph, inputs[1:2]))
            wr = torch.randn(128, 64, 3, 3)
            (got,) = ops_before(torch.randn(2, 64, 20, 72), wr, torch.randn(128))
            assert torch.equal(got, ops.round_to_tf32(wr))
    # a width of other than whole 16 bytes: the channels-last copy, rounded by the graph
    _, (narrow,) = _conv_graph(width=70)
    assert not ops.rounds_x_itself(narrow.spec, narrow.operands[0].meta["val"])


def _graph_of(graph, outputs):
    """A graph of `graph`'s placeholders and the nodes that compute `outputs`."""
    new = torch.fx.Graph()
    env = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = new.placeholder(node.name)
    needed, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n not in needed and n.op != "placeholder":
            needed.add(n)
            stack.extend(n.all_input_nodes)
    for node in graph.nodes:
        if node in needed:
            env[node] = new.node_copy(node, lambda n: env[n])
    new.output(tuple(env[o] for o in outputs))
    return new


@pytest.mark.parametrize("case", ["bf16", "not_implicit"])
def test_nothing_is_rounded_where_the_spec_does_not_say_so(case, sm90_tf32):
    gm, (chain,) = _conv_graph(torch.bfloat16 if case == "bf16" else torch.float32)
    if case == "not_implicit":
        chain.spec = replace(chain.spec, anchor=replace(chain.spec.anchor, implicit=False, rounded=False))
    operands = list(chain.operands)
    rewrite._replace(gm.graph, chain, chain.spec.to_json(), {})
    inputs, spec = _chain_call(gm).args
    assert inputs == operands and not ops._parse(spec).anchor.rounded
    assert not any(n.target is torch.ops.aten.view.dtype for n in gm.graph.nodes)


def test_a_rounded_call_reads_its_operands_by_path():
    _, (chain,) = _conv_graph()
    spec = chain.spec
    unrounded = replace(spec, anchor=replace(spec.anchor, rounded=False))
    xr, wr, x, w, p = (torch.full((1,), float(i)) for i in range(5))
    assert ops.anchor_inputs([xr, wr, p, x, w], spec, rounded_now=True) == [xr, wr, p]
    assert ops.anchor_inputs([xr, wr, p, x, w], spec, rounded_now=False) == [x, w, p]
    assert ops.anchor_inputs([xr, wr, p], unrounded, rounded_now=True) == [xr, wr, p]  # not rounded: as given
    with pytest.raises(RuntimeError, match="unrounded"):
        ops.anchor_inputs([xr, wr, p], spec, rounded_now=True)
    # The reference (CPU, and the op's fake) convolves x itself: exact float32
    xv, wv = torch.randn(2, 64, 20, 70), torch.randn(128, 64, 3, 3)
    (out,) = ops.reference([ops.round_to_tf32(xv), ops.round_to_tf32(wv), xv, wv], spec.to_json())
    (exact,) = ops.reference([xv, wv], unrounded.to_json())
    assert torch.equal(out, exact)


def test_the_rounding_ops_keep_a_dynamic_batch():
    """A graph compiled with a dynamic batch: the rounding's nodes carry x's symbolic shape."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    batch = env.create_symintnode(env.create_symbol(5, source=ConstantSource("batch")), hint=5)
    mode = FakeTensorMode(shape_env=env)
    with mode:
        x = torch.empty(batch, 64, 20, 70)
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["val"] = x
    with mode:
        rounded = ops._rounded_to_tf32(graph, node)
    graph.output(rounded)
    assert str(rounded.meta["val"].shape) == str(x.shape) and not isinstance(x.shape[0], int)
    assert [n.target for n in graph.nodes if n.op == "call_function"] == [
        torch.ops.aten.view.dtype, torch.ops.aten.add.Tensor, torch.ops.aten.bitwise_and.Scalar,
        torch.ops.aten.view.dtype, torch.ops.aten.isnan.default, torch.ops.aten.where.self]
