"""Measures the library forms an anchor can take, per precision.

    python -m benchmarks.anchor_forms

- workload 5's convolution in NCHW and channels-last (with the layout conversions);
- the linear workloads' GEMM as `addmm` (bias in cuBLAS's epilogue) and as `mm`
  (bias left to our epilogue, as the conv bias is).
Decides how fusion_backend/ops.py runs an anchor; results go in benchmarks/NOTES.md.
"""

import torch
import torch.nn.functional as F

from .compare import PRECISIONS, _bench, _set_precision


def main():
    print(f"device: {torch.cuda.get_device_name()}")
    for name in PRECISIONS:
        dtype = _set_precision(name)
        x = torch.rand(128, 8, 256, 256, device="cuda", dtype=dtype)
        w = torch.randn(32, 8, 3, 3, device="cuda", dtype=dtype)
        xc, wc = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        nchw = _bench(lambda: F.conv2d(x, w))
        nhwc = _bench(lambda: F.conv2d(xc, wc))
        to_cl = _bench(lambda: x.contiguous(memory_format=torch.channels_last))
        y = F.conv2d(xc, wc)
        back = _bench(lambda: y.contiguous())
        print(f"{name:13s} conv (no bias): nchw {nchw:.3f}  nhwc {nhwc:.3f}  x->cl {to_cl:.3f}  y->nchw {back:.3f} ms")
        for m, k, n in [(16384, 4096, 4096), (1024, 8192, 8192)]:
            a = torch.rand(m, k, device="cuda", dtype=dtype)
            wt = torch.randn(n, k, device="cuda", dtype=dtype).t()
            b = torch.randn(n, device="cuda", dtype=dtype)
            addmm = _bench(lambda: torch.addmm(b, a, wt))
            mm = _bench(lambda: torch.mm(a, wt))
            print(f"{name:13s} gemm {m}x{k}x{n}: addmm {addmm:.3f}  mm {mm:.3f} ms")


if __name__ == "__main__":
    main()
