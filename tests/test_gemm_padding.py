"""The padded library GEMM (`Anchor.pad`, fusion_backend/forms/gemm_padding.py) without a GPU:
the padded product, which chains are candidates, FUSEDEPI_PAD_GEMM,
and the rewrite through the reference implementation (FUSEDEPI_CPU_REFERENCE=1)."""

import copy

import pytest
import torch
import torch.nn as nn

from fusion_backend import ops
from helpers import compile_records
from lowering.spec import Anchor, EpilogueSpec, Step


@pytest.mark.parametrize("kind", ["addmm", "mm"])
@pytest.mark.parametrize("k, n, pad", [(151, 513, (152, 520)), (201, 4096, (208, 4096)), (64, 33, (64, 40))])
def test_padded_gemm_is_the_product(kind, k, n, pad):
    torch.manual_seed(0)
    x, w, b = torch.randn(37, k, dtype=torch.float64), torch.randn(n, k, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    operands = ([b] if kind == "addmm" else []) + [x, w.t()]
    y = ops.padded_gemm(Anchor(kind, pad=pad), operands)
    assert y.shape == (37, pad[1]) and y.is_contiguous()
    expected = torch.addmm(b, x, w.t()) if kind == "addmm" else x @ w.t()
    torch.testing.assert_close(y[:, :n], expected)
    # run_anchor hands out the product alone unless asked for the padded rows
    torch.testing.assert_close(ops.run_anchor(Anchor(kind, pad=pad), operands), expected)
    assert ops.run_anchor(Anchor(kind, pad=pad), operands, for_kernels=True).shape == (37, pad[1])


def test_spec_json_keeps_the_padding():
    spec = EpilogueSpec(Anchor("addmm", pad=(152, 520)), (Step("relu"),), "bfloat16", (), 513, 1, "linear_pointwise")
    back = EpilogueSpec.from_json(spec.to_json())
    assert back == spec and back.anchor.pad == (152, 520) and back.y_row == 520
    assert EpilogueSpec(Anchor("addmm"), (), "bfloat16", (), 513, 1).y_row == 513


class _Tail(nn.Module):
    def __init__(self, k, n, tail):
        super().__init__()
        self.linear = nn.Linear(k, n)
        self.tail = tail

    def forward(self, x):
        y = self.linear(x)
        return torch.softmax(y, dim=-1) if self.tail == "softmax" else torch.nn.functional.gelu(y)


def _fused_padding(monkeypatch, setting, k, n, dtype=torch.bfloat16, grad=False, tail="gelu", rows=16):
    """(output, eager output, the fused record's kernel string) with FUSEDEPI_PAD_GEMM=setting."""
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    monkeypatch.setenv("FUSEDEPI_PAD_GEMM", setting)
    torch.manual_seed(1)
    model = _Tail(k, n, tail).to(dtype)
    x = torch.randn(rows, k, dtype=dtype, requires_grad=grad)
    eager = copy.deepcopy(model)(x)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert len(fused) == 1 and not refused, refused
    return out, eager, fused[0].kernel


@pytest.mark.parametrize("tail", ["gelu", "softmax"])
def test_on_pads_a_misaligned_16_bit_gemm(monkeypatch, tail):
    out, eager, kernel = _fused_padding(monkeypatch, "1", 151, 513, tail=tail)
    assert "padded to K=152, N=520" in kernel
    torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("setting, k, n, dtype", [
    ("0", 151, 513, torch.bfloat16),    # off
    ("auto", 151, 513, torch.bfloat16),  # auto times on CUDA only
    ("1", 152, 520, torch.bfloat16),    # aligned already
    ("1", 151, 513, torch.float32),     # float32 is not padded
])
def test_no_padding(monkeypatch, setting, k, n, dtype):
    _, _, kernel = _fused_padding(monkeypatch, setting, k, n, dtype)
    assert "padded" not in kernel


def test_a_chain_that_saves_for_backward_keeps_its_n(monkeypatch):
    out, eager, kernel = _fused_padding(monkeypatch, "1", 151, 513, grad=True)
    assert "padded to K=152, N=513" in kernel
    torch.testing.assert_close(out, eager, atol=1e-2, rtol=1e-2)
