"""Times one workload's epilogue kernels under several thread mappings.

    python -m benchmarks.kernel_variants --workload 5_conv_groupnorm --dtype bfloat16

The epilogue runs alone on a random anchor output with random per-channel
parameters (the kernels' speed does not depend on their values). Used to choose
`cuda_templates.render.plan`; results go in benchmarks/NOTES.md.
"""

import argparse
import dataclasses
import tempfile

import torch

import cuda_templates
from cuda_templates.render import plan
from fusion_backend.backend import collect_reports
from lowering import EpilogueSpec
from lowering.spec import CHANNEL

from .compare import _bench, copy_bandwidth
from .workloads import WORKLOADS


def _spec_of(workload, dtype) -> EpilogueSpec:
    model = workload.make_model().cuda().to(dtype)
    x = torch.rand(workload.input_shape, device="cuda", dtype=dtype)
    reports: list = []
    torch._dynamo.reset()
    with torch.no_grad(), collect_reports(reports):
        torch.compile(model, backend="fusedepi")(x)
    fused = [r for report in reports for r in report.records if r.status == "fused"]
    return EpilogueSpec.from_json(fused[0].spec)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="5_conv_groupnorm", choices=list(WORKLOADS))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    workload = WORKLOADS[args.workload]
    spec = _spec_of(workload, dtype)
    if any(s.operand not in ("", CHANNEL, "scalar", "self") or s.name == "batchnorm_train" for s in spec.steps):
        raise SystemExit("only chains with per-channel operands and no extra outputs are synthesized here")
    rows = workload.input_shape[0]
    side = workload.input_shape[-1] - 2
    shape = (rows, spec.channels, side, side) if spec.inner > 1 else (rows, spec.channels)
    y = torch.randn(shape, device="cuda", dtype=dtype)
    out = torch.empty_like(y)
    params = [torch.rand(spec.channels, device="cuda", dtype=dtype) + 0.5 for _ in spec.param_dtypes]
    copy_gbs = copy_bandwidth()
    base = plan(spec)
    variants = {"planned": base}
    for vec in sorted({base.vec, base.vec // 2, base.vec // 4} - {0}):
        for team, nvec in [(256, 8), (256, 4), (512, 4), (128, 8), (256, 16)]:
            vecs = -(-base.seg_len // vec)
            chunks = -(-vecs // (team * nvec))
            if chunks == 1 and base.chunks > 1:
                continue
            variants[f"vec{vec}_block{team}_nvec{nvec}"] = dataclasses.replace(
                base, vec=vec, team=team, nvec=nvec, block=team, chunks=chunks
            )
    cache = tempfile.mkdtemp(prefix="fusedepi-variants-")
    print(f"{args.workload} {args.dtype} plan {base}  copy {copy_gbs:.0f} GB/s")
    moved = 2 * y.numel() * y.element_size()
    for name, launch in variants.items():
        source = cuda_templates.render(spec, "sm90", launch)
        lib = cuda_templates.load(source, f"{name}", "sm90", cache)
        ws = torch.empty(max(lib.workspace_floats(rows), 1), device="cuda")
        ptrs = [y.data_ptr(), out.data_ptr()] + [p.data_ptr() for p in params] + [ws.data_ptr()]
        stream = torch.cuda.current_stream().cuda_stream
        ms = _bench(lambda: lib.run(ptrs, rows, 0, stream))
        print(f"  {name:28s} {ms:7.3f} ms  {moved / ms / 1e6:6.0f} GB/s (read+write once)  {100 * moved / ms / 1e6 / copy_gbs:4.0f}% of copy")


if __name__ == "__main__":
    main()
