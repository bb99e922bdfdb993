"""Measures workload 5's convolution in NCHW and channels-last, per precision.

    python -m benchmarks.conv_layouts

Decides how the fused op runs a convolution anchor (see fusion_backend/ops.py).
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
        b = torch.randn(32, device="cuda", dtype=dtype)
        xc, wc = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        nchw = _bench(lambda: F.conv2d(x, w, b))
        nhwc = _bench(lambda: F.conv2d(xc, wc, b))
        to_cl = _bench(lambda: x.contiguous(memory_format=torch.channels_last))
        y = F.conv2d(xc, wc, b)
        back = _bench(lambda: y.contiguous())
        full = _bench(lambda: F.conv2d(x.contiguous(memory_format=torch.channels_last), wc, b).contiguous())
        print(f"{name:13s} nchw {nchw:.3f}  nhwc {nhwc:.3f}  x->cl {to_cl:.3f}  y->nchw {back:.3f}  cl path total {full:.3f} ms")


if __name__ == "__main__":
    main()
