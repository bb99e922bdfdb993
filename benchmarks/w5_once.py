"""Runs workload 5 three times under fusedepi, for a profiler: python -m benchmarks.w5_once bf16"""
import sys, torch
from benchmarks.workloads import WORKLOADS
from benchmarks.compare import _set_precision
prec = sys.argv[1]
w = WORKLOADS["5_conv_groupnorm"]; d = _set_precision(prec)
m = w.make_model().cuda().to(d); x = torch.rand(w.input_shape, device="cuda", dtype=d)
with torch.no_grad():
    f = torch.compile(m, backend="fusedepi")
    for _ in range(3): f(x)
    torch.cuda.synchronize()
