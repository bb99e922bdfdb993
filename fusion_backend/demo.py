"""`python -m fusion_backend.demo`: compiles two small sample models and prints what fused
and why, then checks each compiled model against eager.

On a GPU the chains run fusedepi's CUDA kernels (the first run builds them with nvcc).
On a machine without one, the chains are rewritten into the fused op, which runs its
plain-torch reference (`FUSEDEPI_CPU_REFERENCE=1`, set here for this process): that
shows the matching and the graph rewrite, not the kernels' speed.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.nn as nn


class ConvBlock(nn.Module):
    """Conv2d, a per-channel bias and scale, sigmoid, GroupNorm (the shape of workload 5)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 32, 3)
        self.bias = nn.Parameter(torch.randn(32, 1, 1) * 0.1)
        self.scale = nn.Parameter(torch.randn(32, 1, 1) * 0.1 + 1.0)
        self.norm = nn.GroupNorm(8, 32)

    def forward(self, x):
        return self.norm(torch.sigmoid((self.conv(x) + self.bias) * self.scale))


def samples(device: str) -> list[tuple[str, nn.Module, torch.Tensor]]:
    """(name, model, input): a Linear chain and a conv chain, small enough for a CPU."""
    torch.manual_seed(0)
    linear = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.GELU(), nn.ReLU())
    return [
        ("Linear(256->512) -> BatchNorm1d -> GELU -> ReLU, batch 64", linear.to(device),
         torch.rand(64, 256, device=device)),
        ("Conv2d(8->32, k3) -> + bias -> * scale -> sigmoid -> GroupNorm(8), 4x8x32x32", ConvBlock().to(device),
         torch.rand(4, 8, 32, 32, device=device)),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ["FUSEDEPI_CPU_REFERENCE"] = "1"
        print("No GPU in use: the fused op runs its plain-torch reference (FUSEDEPI_CPU_REFERENCE=1).\n")
    from . import explain

    worst = 0.0
    for name, model, x in samples(args.device):
        print(f"== {name}")
        eager_model = copy.deepcopy(model)
        with torch.no_grad():
            report = explain(model, x)
            compiled = torch.compile(model, backend="fusedepi")
            got, want = compiled(x), eager_model(x)
        torch._dynamo.reset()
        error = float((got - want).abs().max())
        worst = max(worst, error)
        print(f"fused {len(report.fused)} chain(s); largest difference from eager: {error:.2e}\n")
    return 0 if worst < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
