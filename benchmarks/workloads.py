"""The five workloads the backend is measured on (and a sixth on request), as modules, shared by
the GPU tests and the benchmark."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class LinearBnGeluRelu(nn.Module):
    """1. Linear -> BatchNorm1d -> GELU -> ReLU."""

    def __init__(self, k=4096, n=4096):
        super().__init__()
        self.linear = nn.Linear(k, n)
        self.bn = nn.BatchNorm1d(n)

    def forward(self, x):
        return F.relu(F.gelu(self.bn(self.linear(x))))


class LinearLogsumexpActs(nn.Module):
    """2. Linear -> logsumexp(dim=1, keepdim) -> LeakyReLU x2 -> GELU x2."""

    def __init__(self, k=8192, n=8192):
        super().__init__()
        self.linear = nn.Linear(k, n)

    def forward(self, x):
        x = torch.logsumexp(self.linear(x), dim=1, keepdim=True)
        x = F.leaky_relu(x, 0.01)
        x = F.leaky_relu(x, 0.01)
        x = F.gelu(x)
        return F.gelu(x)


class LinearGroupNormLeakyDouble(nn.Module):
    """3. Linear -> GroupNorm(512) -> LeakyReLU(0.01) -> x + x."""

    def __init__(self, k=8192, n=8192, groups=512):
        super().__init__()
        self.linear = nn.Linear(k, n)
        self.gn = nn.GroupNorm(groups, n)

    def forward(self, x):
        x = F.leaky_relu(self.gn(self.linear(x)), 0.01)
        return x + x


class LinearGroupNormSwishScale(nn.Module):
    """4. Linear -> GroupNorm(256) -> x*sigmoid(x) -> * weight -> x*sigmoid(x)."""

    def __init__(self, k=8192, n=8192, groups=256):
        super().__init__()
        self.linear = nn.Linear(k, n)
        self.gn = nn.GroupNorm(groups, n)
        self.weight = nn.Parameter(torch.randn(n))

    def forward(self, x):
        x = self.gn(self.linear(x))
        x = x * torch.sigmoid(x)
        x = x * self.weight
        return x * torch.sigmoid(x)


class ConvBiasScaleSigmoidGroupNorm(nn.Module):
    """5. Conv2d(8->32, k3) -> + bias[32,1,1] -> * scale[32,1,1] -> sigmoid -> GroupNorm(8)."""

    def __init__(self, cin=8, cout=32, groups=8):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3)
        self.bias = nn.Parameter(torch.randn(cout, 1, 1))
        self.scale = nn.Parameter(torch.randn(cout, 1, 1))
        self.gn = nn.GroupNorm(groups, cout)

    def forward(self, x):
        x = (self.conv(x) + self.bias) * self.scale
        return self.gn(torch.sigmoid(x))


class ConvBnRelu(nn.Module):
    """6. Conv2d(64->64, k3, pad 1) -> BatchNorm2d -> ReLU (a ResNet block's start)."""

    def __init__(self, c=64):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


@dataclass(frozen=True)
class Workload:
    """A workload: how to build its model and its input, and the fusion it should get."""

    name: str
    make_model: Callable[[], nn.Module]
    input_shape: tuple
    fusion: str
    has_batchnorm: bool = False
    computes_anchor: bool = False  # fusedepi computes the conv itself (the direct conv)


WORKLOADS = {
    w.name: w
    for w in [
        Workload("1_linear_bn_gelu_relu", LinearBnGeluRelu, (16384, 4096), "linear_batchnorm_train", True),
        Workload("2_linear_logsumexp", LinearLogsumexpActs, (1024, 8192), "linear_logsumexp"),
        Workload("3_linear_groupnorm_leaky", LinearGroupNormLeakyDouble, (1024, 8192), "linear_groupnorm"),
        Workload("4_linear_groupnorm_swish", LinearGroupNormSwishScale, (1024, 8192), "linear_groupnorm"),
        Workload("5_conv_groupnorm", ConvBiasScaleSigmoidGroupNorm, (128, 8, 256, 256), "conv_groupnorm",
                 computes_anchor=True),
    ]
}

# Benchmarked on request (`compare --workloads ...`), not part of the definition of done.
EXTRA_WORKLOADS = {
    w.name: w
    for w in [
        Workload("6_conv_bn_relu", ConvBnRelu, (32, 64, 56, 56), "conv_batchnorm_train", True),
    ]
}


def expected_fusion(workload: Workload, training: bool) -> str:
    if workload.has_batchnorm and not training:
        return workload.fusion.replace("_train", "_eval")
    return workload.fusion


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64; NaN anywhere gives inf."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()
