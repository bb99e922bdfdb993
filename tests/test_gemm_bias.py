"""The float32 GEMM bias moved into the epilogue (fusion_backend/gemm_bias.py) without
a GPU: which chains are candidates, FUSEDEPI_FOLD_GEMM_BIAS, the decision by timing, and
the rewrite through the reference implementation (FUSEDEPI_CPU_REFERENCE=1)."""

import copy
import json
from types import SimpleNamespace

import pytest
import torch

from fusion_backend import gemm_bias
from fusion_backend.config import load_config
from helpers import LinearLogSoftmax, compile_records
from lowering.spec import Anchor, EpilogueSpec, Step


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


def _chain():
    """A stand-in for a matched chain, enough for `fold` once `candidate` is patched."""
    spec = EpilogueSpec(Anchor("addmm"), (Step("relu"),), "float32", ("float32",), 127, 1, "linear_pointwise")
    val = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.float32)
    node = SimpleNamespace(meta={"val": val})
    return SimpleNamespace(spec=spec, operands=[node, node, node], params=[node])


@pytest.mark.parametrize("addmm, mm, folds", [(1.15, 0.96, True), (1.0, 0.95, False), (1.0, 1.2, False)])
def test_auto_folds_where_the_timing_says_so(monkeypatch, tmp_path, addmm, mm, folds):
    monkeypatch.setattr(gemm_bias, "candidate", lambda chain: (818368, 201, 127))
    monkeypatch.setattr(gemm_bias, "timed", lambda *args: (addmm, mm))
    chain = _chain()
    spec = gemm_bias.fold(chain, load_config({"FUSEDEPI_CACHE_DIR": str(tmp_path)}))
    assert (spec.anchor.kind == "mm") == folds
    assert (len(chain.operands), len(chain.params), len(spec.param_dtypes)) == ((2, 2, 2) if folds else (3, 1, 1))
    assert spec.steps[0] == (Step("add", inputs=(1,), operand="channel", reverse=True) if folds else Step("relu"))


def test_a_failed_timing_keeps_addmm_or_raises_under_strict(monkeypatch, tmp_path):
    def fail(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(gemm_bias, "candidate", lambda chain: (818368, 201, 127))
    monkeypatch.setattr(gemm_bias, "timed", fail)
    assert gemm_bias.fold(_chain(), load_config({"FUSEDEPI_CACHE_DIR": str(tmp_path)})).anchor.kind == "addmm"
    with pytest.raises(RuntimeError, match="out of memory"):
        gemm_bias.fold(_chain(), load_config({"FUSEDEPI_CACHE_DIR": str(tmp_path), "FUSEDEPI_STRICT": "1"}))
