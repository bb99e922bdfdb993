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
from lowering.spec import Anchor, EpilogueSpec, Step

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
