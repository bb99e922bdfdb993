"""Worst-column error of Linear -> ReLU -> BatchNorm1d (training) in float32 against float64,
for eager and fusedepi, on skewed (mostly zero) columns. Needs a GPU.

    python -m benchmarks.skew_probe [seeds]
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn as nn

from fusion_backend import fusedepi


def worst_columns(seed: int, rows: int = 8192, n: int = 130) -> tuple[float, float]:
    torch.manual_seed(seed)
    torch.set_float32_matmul_precision("highest")
    model = nn.Sequential(nn.Linear(64, n), nn.ReLU(), nn.BatchNorm1d(n)).cuda()
    with torch.no_grad():
        model[0].bias.fill_(-1.0)
    x = torch.rand(rows, 64, device="cuda") * 2 - 1
    ref_model, eager_model = copy.deepcopy(model).double(), copy.deepcopy(model)
    torch._dynamo.reset()
    with torch.no_grad():
        ref = ref_model(x.double())
        eager = eager_model(x)
        ours = torch.compile(model, backend=fusedepi)(x)

    def worst(out):
        return ((out.double() - ref).norm(dim=0) / ref.norm(dim=0).clamp_min(1e-30)).max().item()

    return worst(eager), worst(ours)


if __name__ == "__main__":
    seeds = [int(s) for s in sys.argv[1:]] or [0, 1, 2]
    for seed in seeds:
        e, f = worst_columns(seed)
        print(f"seed {seed}: worst column eager {e:.3g}, fusedepi {f:.3g}", flush=True)
