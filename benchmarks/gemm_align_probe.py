"""Library GEMM forms at the fuzzer benchmark's misaligned shapes (K not a multiple of
16 bytes): addmm as the graph has it, against K padded with zeros to a multiple of 8
elements (the pad copies timed with it, and alone), and mm with the bias left out.

    python -m benchmarks.gemm_align_probe
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

# (fuzzer model, rows, K, N, dtype): the shapes of `tests/fuzzer.py --bench` (seed 0)
SHAPES = [
    (10, 808512, 151, 513, torch.bfloat16),
    (32, 834944, 130, 513, torch.bfloat16),
    (3, 235648, 230, 2048, torch.float16),
    (46, 1009152, 277, 255, torch.float16),
    (0, 124800, 201, 4100, torch.bfloat16),
    (5, 3103296, 140, 33, torch.bfloat16),
    (23, 818368, 201, 127, torch.float32),
    (12, 123904, 118, 2048, torch.float32),
    (2, 1597824, 135, 33, torch.float32),
]


def pad_k(x: torch.Tensor, to: int) -> torch.Tensor:
    return F.pad(x, (0, to - x.shape[-1]))


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"{torch.cuda.get_device_name()}; ms, median of do_bench, best of 3 rounds")
    for model, m, k, n, dtype in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        w = torch.randn(n, k, device="cuda", dtype=dtype)
        b = torch.randn(n, device="cuda", dtype=dtype)
        k8 = (k + 7) // 8 * 8
        xp, wp = pad_k(x, k8), pad_k(w, k8)
        forms = {
            "addmm": lambda: torch.addmm(b, x, w.t()),
            "mm": lambda: torch.mm(x, w.t()),
            "pad+addmm": lambda: torch.addmm(b, pad_k(x, k8), pad_k(w, k8).t()),
            "addmm(padded)": lambda: torch.addmm(b, xp, wp.t()),
            "mm(padded)": lambda: torch.mm(xp, wp.t()),
            "pad x": lambda: pad_k(x, k8),
        }
        best = {name: min(do_bench(fn, warmup=10, rep=50, return_mode="median") for _ in range(3))
                for name, fn in forms.items()}
        print(f"model {model:2d} {str(dtype)[6:]:8s} M={m} K={k} N={n}: "
              + ", ".join(f"{name} {ms:.3f}" for name, ms in best.items()), flush=True)
        del x, w, xp, wp


if __name__ == "__main__":
    main()
