"""The float32 GEMM bias moved into the epilogue (fusion_backend/forms/gemm_bias.py) without
a GPU: which chains are candidates, FUSEDEPI_FOLD_GEMM_BIAS,
the rewrite through the reference implementation (FUSEDEPI_CPU_REFERENCE=1)."""

import copy
import json

import pytest
import torch

from helpers import LinearLogSoftmax, compile_records


def _fused(monkeypatch, setting, dtype=torch.float32, grad=False):
    """(output, eager output, the fused record's spec) with FUSEDEPI_FOLD_GEMM_BIAS=setting."""
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    monkeypatch.setenv("FUSEDEPI_FOLD_GEMM_BIAS", setting)
    torch.manual_seed(2)
    model = LinearLogSoftmax(201, 127).to(dtype)
    x = torch.randn(33, 201, dtype=dtype, requires_grad=grad)
    eager = copy.deepcopy(model)(x)
    out, fused, refused = compile_records(model, x, grad=grad)
    assert len(fused) == 1 and not refused, refused
    return out, eager, json.loads(fused[0].spec)


def test_on_moves_the_bias_into_the_epilogue(monkeypatch):
    out, eager, spec = _fused(monkeypatch, "1")
    assert spec["anchor"]["kind"] == "mm"
    first = spec["steps"][0]
    assert (first["name"], first["operand"], first["reverse"]) == ("add", "channel", True)
    assert first["inputs"] == [len(spec["param_dtypes"]) - 1]  # the bias, appended to the tensor inputs
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


class _LinearResidualOfItself(torch.nn.Module):
    """relu(y + sigmoid(y) * 0.5) after a Linear: a step reads the chain's value after
    0 steps (the GEMM's output with its bias) and one after 1 step."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(201, 127)

    def forward(self, x):
        y = self.linear(x)
        z = y + torch.sigmoid(y) * 0.5
        return torch.relu(z * torch.tanh(z))


def test_a_moved_bias_moves_the_earlier_values_steps_read(monkeypatch):
    """With the bias as the first step, the GEMM's output is no longer the value the chain
    called "after 0 steps": every earlier value a step reads is one step later."""
    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")
    torch.manual_seed(3)
    model, x = _LinearResidualOfItself(), torch.randn(33, 201)
    eager = copy.deepcopy(model)(x)
    for setting in ("0", "1"):
        monkeypatch.setenv("FUSEDEPI_FOLD_GEMM_BIAS", setting)
        out, fused, refused = compile_records(model, x)
        assert len(fused) == 1 and not refused, refused
        spec = json.loads(fused[0].spec)
        earlier = [s["consts"][0] for s in spec["steps"] if s["operand"] == "earlier"]
        assert earlier == ([0, 3] if setting == "0" else [1, 4]), spec["steps"]
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("setting, dtype, grad", [
    ("0", torch.float32, False),      # off
    ("auto", torch.float32, False),   # auto times on CUDA only
    ("1", torch.bfloat16, False),     # 16-bit: mm would round the product before the bias
    ("1", torch.float32, True),       # saves values for backward
])
def test_the_gemm_keeps_its_bias(monkeypatch, setting, dtype, grad):
    _, _, spec = _fused(monkeypatch, setting, dtype, grad)
    assert spec["anchor"]["kind"] == "addmm"
