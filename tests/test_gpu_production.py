"""GPU tier: production behaviour — dynamic batch sizes, CUDA graphs, streams and threads,
inputs the kernels do not take, warm starts, a second GPU. Skipped without CUDA."""

import copy
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from benchmarks.workloads import ConvBiasScaleSigmoidGroupNorm, LinearGroupNormLeakyDouble, relative_error
from fusion_backend import fusedepi, launch
from fusion_backend.backend import collect_reports

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def exact_float32():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    torch._dynamo.reset()
    yield
    torch.set_float32_matmul_precision(old)
    torch._dynamo.reset()


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch, count_builds):
    """An empty kernel cache and no loaded kernels; yields the list of kernel builds (nvcc runs)."""
    monkeypatch.setenv("FUSEDEPI_CACHE_DIR", str(tmp_path / "kernels"))
    launch.forget_loaded()
    yield count_builds
    launch.forget_loaded()


def _fused(reports):
    return [r for report in reports for r in report.records if r.status == "fused"]


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return LinearGroupNormLeakyDouble(256, 512, 32).cuda().to(dtype)


def _check(out, model, x, tol=1e-5):
    ref = copy.deepcopy(model).double()(x.double())
    err = relative_error(out, ref)
    assert err <= tol, f"relative error {err:.3g}"


def test_batch_sizes_share_one_kernel(fresh_cache, monkeypatch):
    # The timed float32 GEMM decisions (bias in the epilogue, padding) may pick another
    # form for the batch-1 graph Dynamo specializes; this test is about the kernel the
    # dynamic graph shares, so both stay at their untimed form.
    monkeypatch.setenv("FUSEDEPI_FOLD_GEMM_BIAS", "0")
    monkeypatch.setenv("FUSEDEPI_PAD_GEMM", "0")
    model = _model()
    compiled = torch.compile(model, backend=fusedepi, dynamic=True)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        for batch in (1, 7, 1024, 4097):
            x = torch.rand(batch, 256, device="cuda")
            _check(compiled(x), model, x)
    specs = {r.spec for r in _fused(reports)}
    assert len(specs) == 1, "\n".join(sorted(specs))
    assert len(fresh_cache) == 1, f"{len(fresh_cache)} kernel builds for one chain"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reduce_overhead_cuda_graphs(dtype, fresh_cache, monkeypatch):
    from torch._dynamo.utils import counters

    launches = []
    real_call = launch.Launcher.__call__
    monkeypatch.setattr(launch.Launcher, "__call__", lambda self, inputs: (launches.append(1), real_call(self, inputs))[1])

    model = _model(dtype)
    counters.clear()
    compiled = torch.compile(model, backend="fusedepi", mode="reduce-overhead")
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        for step in range(5):  # warm-up, recording, then replays of the graph on new inputs
            x = torch.rand(8, 256, device="cuda", dtype=dtype)
            out = compiled(x).clone()
            _check(out, model, x, 1e-5 if dtype == torch.float32 else 1e-2)
    assert [r.fusion for r in _fused(reports)] == ["linear_groupnorm"]
    assert not counters["inductor"]["cudagraph_skips"], "Inductor did not use CUDA graphs"
    # Replays launch the captured kernels without calling into Python: only the
    # warm-up and the recording ran the fused op's launcher.
    assert 1 <= len(launches) <= 2, f"{len(launches)} launcher calls in 5 steps: no graph replay"


def test_two_threads_two_streams(fresh_cache):
    model = _model()
    compiled = torch.compile(model, backend=fusedepi)
    with torch.no_grad():  # compile for both threads' shapes here: only the calls run concurrently
        for rows in (512, 513):
            compiled(torch.rand(rows, 256, device="cuda"))
    errors, results = [], {}

    def work(index):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.no_grad():
                for step in range(20):
                    x = torch.rand(512 + index, 256, device="cuda")
                    out = compiled(x)
                stream.synchronize()
                results[index] = (x, out)
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for x, out in results.values():
        _check(out, model, x)


@pytest.mark.parametrize(
    "make_input, fused",
    [
        (lambda: torch.rand(64, 256, device="cuda", dtype=torch.float64), False),  # dtype not fused
        (lambda: torch.rand(256, 64, device="cuda").t(), True),  # non-contiguous input: the GEMM takes it
        (lambda: torch.rand(0, 256, device="cuda"), True),  # empty batch
    ],
    ids=["float64", "transposed", "empty"],
)
def test_inputs_outside_the_kernels(make_input, fused, fresh_cache):
    x = make_input()
    model = _model(x.dtype)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        out = torch.compile(model, backend=fusedepi)(x)
        ref = model(x)
    assert bool(_fused(reports)) == fused
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_channels_last_conv_input(fresh_cache):
    torch.manual_seed(0)
    model = ConvBiasScaleSigmoidGroupNorm(8, 32, 8).cuda()
    x = torch.rand(4, 8, 40, 64, device="cuda").to(memory_format=torch.channels_last)
    with torch.no_grad():
        out = torch.compile(model, backend=fusedepi)(x)
        ref = copy.deepcopy(model).double()(x.double())
    assert relative_error(out, ref) <= 1e-5


@pytest.mark.parametrize("dynamic, mode", [(False, None), (True, None), (False, "reduce-overhead")],
                         ids=["static", "dynamic", "cuda_graphs"])
def test_the_measured_choice_times_the_whole_graph(dynamic, mode, fresh_cache, monkeypatch):
    """FUSEDEPI_AUTOTUNE at its default: each chain and then the whole graph are timed on
    the GPU against Inductor (a dynamic batch at its hint; under reduce-overhead, graphs
    that replay CUDA graphs of their own; a failed timing raises under strict mode), and
    whichever graph runs, both batch sizes match float64."""
    from fusion_backend import choice

    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "auto")
    monkeypatch.setenv("FUSEDEPI_STRICT", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # either graph exact in float32
    measured = []
    real = choice._measure_graphs
    monkeypatch.setattr(choice, "_measure_graphs", lambda *args: measured.append(real(*args)) or measured[-1])
    torch.manual_seed(0)
    model = ConvBiasScaleSigmoidGroupNorm(8, 32, 8).cuda()
    compiled = torch.compile(model, backend="fusedepi", mode=mode)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        for batch in (6, 9):
            x = torch.rand(batch, 8, 66, 70, device="cuda")
            if dynamic:  # the batch alone: a conv chain with dynamic image sizes is refused
                torch._dynamo.mark_dynamic(x, 0)
            out = compiled(x).clone()
            ref = copy.deepcopy(model).double()(x.double())
            assert relative_error(out, ref) <= 1e-5
    records = [r for report in reports for r in report.records]
    timed_chains = [r for r in records if r.plan is not None and r.plan.choice.inductor_ms > 0]
    assert timed_chains, [r.reason for r in records]
    # The whole graph is timed exactly where a chain stayed fused after its own timing.
    fused_graphs = sum(any(r.status == "fused" or "whole graph" in r.reason for r in report.records)
                       for report in reports)
    assert len(measured) == fused_graphs and all(ms > 0 for pair in measured for ms in pair)


class _LinearTanhScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(768, 3072)

    def forward(self, x):
        return torch.tanh(self.linear(x)) * 2.0


def test_the_in_kernel_gemms_placement_is_measured(fresh_cache, monkeypatch):
    """FUSEDEPI_AUTOTUNE at its default, on sm_90: a bf16 Linear chain whose CTAs have
    tiles for the spare warps is timed with its chain in the consumer warps and in the
    spare warps (`forms.gemm_consumers`); explain gives both times, and whichever kernel
    (or Inductor) runs matches float64."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the in-kernel GEMM is built for sm_90a")
    from fusion_backend import rewrite

    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "auto")
    monkeypatch.setenv("FUSEDEPI_STRICT", "1")
    plans = []  # every chain's plan, also where the whole graph then goes to Inductor
    real = rewrite._without_forms
    monkeypatch.setattr(rewrite, "_without_forms", lambda *args: plans.append(real(*args)) or plans[-1])
    torch.manual_seed(0)
    model = _LinearTanhScale().cuda().to(torch.bfloat16)
    rows = 128 * -(-4 * torch.cuda.get_device_properties(0).multi_processor_count // 12)  # 4 tiles a CTA
    x = torch.rand(rows, 768, device="cuda", dtype=torch.bfloat16) * 2 - 1
    with torch.no_grad():
        out = torch.compile(model, backend="fusedepi")(x)
    text = "; ".join(plan.describe() for plan in plans)
    assert re.search(r"gemm_consumers: (not )?taken \(the chain [\d.e-]+ ms in it, [\d.e-]+ ms without\)", text), text
    ref = copy.deepcopy(model).double()(x.double())
    assert relative_error(out, ref) <= 1e-2  # bf16, as tests/test_gpu.py


class _ConvReluBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(64, 128, 3)
        self.bias = nn.Parameter(torch.randn(128, 1, 1) * 0.1)

    def forward(self, x):
        return torch.relu(self.conv(x)) + self.bias


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_in_kernel_conv_is_measured(dtype, fresh_cache, monkeypatch):
    """FUSEDEPI_AUTOTUNE and FUSEDEPI_IN_KERNEL_CONV at their defaults, on sm_90: a conv
    the direct conv does not take is timed with the in-kernel conv and with the library
    conv (`forms.conv_implicit`); explain gives both times, and whichever runs (or
    Inductor) matches float64 (float32 with cuDNN's default TF32)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the in-kernel conv is built for sm_90a")
    from fusion_backend import rewrite

    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "auto")
    monkeypatch.delenv("FUSEDEPI_IN_KERNEL_CONV", raising=False)
    monkeypatch.setenv("FUSEDEPI_STRICT", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    plans = []
    real = rewrite._without_forms
    monkeypatch.setattr(rewrite, "_without_forms", lambda *args: plans.append(real(*args)) or plans[-1])
    torch.manual_seed(0)
    model = _ConvReluBias().cuda().to(dtype)
    x = torch.rand(16, 64, 66, 66, device="cuda", dtype=dtype) * 2 - 1
    with torch.no_grad():
        out = torch.compile(model, backend="fusedepi")(x)
    text = "; ".join(plan.describe() for plan in plans)
    assert re.search(r"in_kernel_conv: (not )?taken \(the chain [\d.e-]+ ms in it, [\d.e-]+ ms without\)", text), text
    ref = copy.deepcopy(model).double()(x.double())
    assert relative_error(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 2e-3)  # bf16; TF32 as cuDNN's


def test_warm_start_runs_no_nvcc(tmp_path):
    """A new process with a warm kernel cache compiles and runs the chain without building."""
    code = (
        "import torch; from cuda_templates import compiler; from fusion_backend import fusedepi;"
        "from benchmarks.workloads import LinearGroupNormLeakyDouble, ConvBiasScaleSigmoidGroupNorm;"
        "builds = []; real = compiler._ninja_build;"
        "compiler._ninja_build = lambda *a: (builds.append(a[1]), real(*a))[1];"
        "torch.manual_seed(0);"
        "m1 = LinearGroupNormLeakyDouble(256, 512, 32).cuda(); m2 = ConvBiasScaleSigmoidGroupNorm(8, 32, 8).cuda();"
        "torch.no_grad().__enter__();"
        "torch.compile(m1, backend=fusedepi)(torch.rand(64, 256, device='cuda'));"
        "torch.compile(m2, backend=fusedepi)(torch.rand(2, 8, 40, 64, device='cuda'));"
        "torch.cuda.synchronize(); print('builds', len(builds))"
    )
    env = dict(os.environ, FUSEDEPI_CACHE_DIR=str(tmp_path / "kernels"))
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert runs[0].stdout.split()[-1] == "2"  # cold: one kernel per chain
    assert runs[1].stdout.split()[-1] == "0"  # warm: none


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu(fresh_cache):
    # The same chain on cuda:0 and cuda:1: one build, the kernel loaded on each device,
    # and each call launched on its tensors' device whatever the current device is.
    model = _model()
    outs = {}
    for index in (0, 1):
        dev = f"cuda:{index}"
        local = copy.deepcopy(model).to(dev)
        x = torch.rand(300, 256, device=dev)
        with torch.no_grad(), torch.cuda.device(1 - index):  # the current device is the other GPU
            outs[index] = torch.compile(local, backend=fusedepi)(x)
        assert outs[index].device == x.device
        _check(outs[index], local, x)
    assert len(fresh_cache) == 1
    assert {key[1] for key in launch._launchers} >= {0, 1}


def test_timings_wait_for_another_processs_timing_on_the_same_gpu():
    """`timings.compare_ms` holds the GPU's timing lock: while another process holds it
    (here a child process, 1.5 s), a timing waits, and then times as usual."""
    import time

    from fusion_backend import timings

    path = timings.gpu_lock_path(torch.device("cuda", torch.cuda.current_device()))
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(path)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(1.5)")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        x = torch.randn(256, 256, device="cuda")
        started = time.perf_counter()
        times = timings.compare_ms([lambda: x @ x, lambda: x + 1], torch.device("cuda"))
        waited = time.perf_counter() - started
    finally:
        holder.wait(timeout=30)
    assert waited >= 1.0, waited
    assert len(times) == 2 and all(t > 0 for t in times)
