"""Small models and a compile helper shared by the GPU-free tests."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.workloads import (
    ConvBiasScaleSigmoidGroupNorm,
    LinearBnGeluRelu,
    LinearGroupNormLeakyDouble,
    LinearGroupNormSwishScale,
    LinearLogsumexpActs,
)
from fusion_backend import fusedepi
from fusion_backend.backend import collect_reports

# The five workloads at sizes a CPU compiles in seconds: (model factory, input shape, fusion).
SMALL_WORKLOADS = {
    "1_train": (lambda: LinearBnGeluRelu(24, 32).train(), (16, 24), "linear_batchnorm_train"),
    "1_eval": (lambda: LinearBnGeluRelu(24, 32).eval(), (16, 24), "linear_batchnorm_eval"),
    "2": (lambda: LinearLogsumexpActs(24, 40), (8, 24), "linear_logsumexp"),
    "3": (lambda: LinearGroupNormLeakyDouble(24, 64, 16), (8, 24), "linear_groupnorm"),
    "4": (lambda: LinearGroupNormSwishScale(24, 64, 8), (8, 24), "linear_groupnorm"),
    "5": (lambda: ConvBiasScaleSigmoidGroupNorm(3, 16, 4), (2, 3, 12, 12), "conv_groupnorm"),
}


def compile_records(model, *inputs, grad=False):
    """Compiles `model` with fusedepi, runs it once; returns (output, fused, refused) records."""
    torch._dynamo.reset()
    reports: list = []
    with torch.set_grad_enabled(grad), collect_reports(reports):
        out = torch.compile(model, backend=fusedepi)(*inputs)
    records = [r for report in reports for r in report.records]
    return out, [r for r in records if r.status == "fused"], [r for r in records if r.status == "refused"]


def close_to_float64(got, eager, ref, what, floor: float = 0.0):
    """`got` is as close to the float64 `ref` as eager float32 is (4x), or within 1e-5 of its
    norm, or within `floor` (for a value that rounding alone makes: 0 in exact arithmetic)."""
    d_got = (got.double() - ref).norm().item()
    d_eager = (eager.double() - ref).norm().item()
    norm = ref.norm().item()
    assert d_got <= max(1e-5 * norm, 4 * d_eager, floor), (
        f"{what}: error {d_got:.3g}, eager's {d_eager:.3g}, norm {norm:.3g}, floor {floor:.3g}")


def steps_of(record):
    import json

    return [s["name"] for s in json.loads(record.spec)["steps"]]


class Chain(nn.Module):
    """Linear (or conv) followed by `fn`."""

    def __init__(self, fn, k=16, n=32, bias=True):
        super().__init__()
        self.linear = nn.Linear(k, n, bias=bias)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.linear(x))


class LinearLogSoftmax(nn.Module):
    """Linear, a scale, log_softmax over the features, a clamp: a float32 chain whose GEMM
    may lose its bias to the epilogue (fusion_backend/forms/gemm_bias.py)."""

    def __init__(self, k, n):
        super().__init__()
        self.linear = nn.Linear(k, n)

    def forward(self, x):
        return torch.log_softmax(self.linear(x) * 0.5, dim=-1).clamp_min(-5)


def silu_spelled(x):
    return x * torch.sigmoid(x)


def sigmoid_times_x(x):
    return torch.sigmoid(x) * x


__all__ = ["Chain", "F", "LinearLogSoftmax", "SMALL_WORKLOADS", "compile_records", "silu_spelled", "sigmoid_times_x", "steps_of"]


def random_layer_norm(normalized) -> nn.LayerNorm:
    """nn.LayerNorm over `normalized` with a random affine (weight in [0.5, 1.5), bias normal)."""
    ln = nn.LayerNorm(normalized)
    with torch.no_grad():
        ln.weight.copy_(torch.rand(normalized) + 0.5)
        ln.bias.copy_(torch.randn(normalized))
    return ln
