"""The C++ launcher (fusion_backend/csrc/launcher.cpp, fusion_backend/native.py).

GPU-free: the source compiles against this torch's headers; a failed build leaves the
Python launcher serving CUDA calls (or raises under strict mode); the plan encoding.
GPU: the C++ and Python launchers return the same bits on the fuzzer's models, and the
C++ one serves every call after a spec's first.
"""

import os
import re
import shutil
import struct
import subprocess
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from fusion_backend import launch, load_config, native, rewrite
from fusion_backend.rewrite import FusionError
from lowering.spec import Anchor, EpilogueSpec, Save, Step

GPP = shutil.which("g++")


def _cuda_include_dirs():
    try:
        return native.cuda_include_dirs()
    except native.BuildError:
        return []


@pytest.mark.skipif(GPP is None or not _cuda_include_dirs(), reason="needs g++ and nvcc")
def test_launcher_source_compiles(tmp_path):
    # The product's own command, without linking (a CPU build of torch has no c10_cuda).
    # Such a build also ships c10/cuda's headers without the one its CMake generates,
    # whose content only matters for linking.
    stub = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    command = native.build_command(GPP, str(tmp_path / "unused.so"))
    result = subprocess.run(command + ["-fsyntax-only", f"-I{tmp_path}", "-Wall", "-Wextra", "-Werror=return-type"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    ours = [line for line in result.stderr.splitlines() if str(native.SOURCE) in line and "warning" in line]
    assert not ours, "\n".join(ours)


@pytest.mark.skipif(not _cuda_include_dirs(), reason="needs nvcc")
def test_build_key_follows_the_source_and_torch(monkeypatch):
    key = native.build_key()
    assert key == native.build_key()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert native.build_key() != key


@pytest.fixture
def native_untried(monkeypatch):
    """ops' launcher state as in a process that has not tried the C++ launcher; restored after."""
    if launch.native_launcher() == "loaded":
        pytest.skip("the C++ launcher is loaded in this process")
    monkeypatch.setattr(launch, "_native_state", "python")


def _has_cuda_kernel() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("fusedepi::chain", "CUDA")


def test_a_failed_build_leaves_the_python_launcher_serving(native_untried, monkeypatch, tmp_path):
    def failing(cache_dir):
        raise native.BuildError("RuntimeError: no compiler")

    monkeypatch.setattr(native, "build", failing)
    assert _has_cuda_kernel()
    with pytest.raises(native.BuildError, match="no compiler"):
        launch.enable_native(tmp_path)
    assert launch.native_launcher() == "failed"
    assert _has_cuda_kernel(), "the Python CUDA implementation was not put back"
    assert not launch.enable_native(tmp_path), "a failed build is tried again in the same process"


def test_a_failed_build_warns_or_raises_under_strict(native_untried, monkeypatch, tmp_path, caplog):
    calls = []

    def failing(cache_dir):
        calls.append(cache_dir)
        raise native.BuildError("RuntimeError: no compiler\nmore lines")

    monkeypatch.setattr(native, "build", failing)
    monkeypatch.setenv("FUSEDEPI_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FUSEDEPI_STRICT", "1")
    with pytest.raises(FusionError, match="C\\+\\+ launcher failed to build: RuntimeError: no compiler"):
        rewrite._enable_native(load_config())
    monkeypatch.setattr(launch, "_native_state", "python")
    monkeypatch.delenv("FUSEDEPI_STRICT")
    with caplog.at_level("WARNING", logger="fusedepi"):
        rewrite._enable_native(load_config())
    assert "the C++ launcher failed to build (RuntimeError: no compiler); fused ops launch from Python" in caplog.text
    assert calls == [tmp_path, tmp_path]
    assert _has_cuda_kernel()


@pytest.mark.parametrize("failure", [RuntimeError("no kernel for you"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_failed_install_puts_the_python_launcher_back(failure, native_untried, monkeypatch, tmp_path):
    def failing():
        raise failure

    monkeypatch.setattr(native, "build", lambda cache_dir: tmp_path / native.LIBRARY)
    monkeypatch.setattr(native, "load", lambda library: None)
    monkeypatch.setattr(native, "install", failing)
    with pytest.raises(native.BuildError if isinstance(failure, Exception) else KeyboardInterrupt):
        launch.enable_native(tmp_path)
    assert launch.native_launcher() == "failed"
    assert _has_cuda_kernel(), "the Python CUDA implementation was not put back"


@pytest.mark.skipif(not _cuda_include_dirs(), reason="needs nvcc")
def test_a_compiler_error_is_a_build_error_recorded_for_later_processes(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "compilers", lambda: [shutil.which("false") or "/bin/false"])
    with pytest.raises(native.BuildError, match="failed on launcher.cpp"):
        native.build(tmp_path)
    entries = list((tmp_path / "native").iterdir())
    assert [p.suffix for p in entries if p.is_file()] == [".lock"]
    (entry,) = [d for d in entries if d.is_dir()]
    assert [p.name for p in entry.iterdir()] == [native.FAILED], "a build directory was left behind"
    runs = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: runs.append(a))
    with pytest.raises(native.BuildError, match=f"failed on launcher.cpp.*recorded in .*{native.FAILED}"):
        native.build(tmp_path)
    assert not runs, "a compiler refused before ran again"


def test_a_compiler_killed_by_a_signal_is_not_recorded(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "compilers", lambda: ["/usr/bin/c++"])
    monkeypatch.setattr(native, "_entry", lambda cxx, cache_dir: tmp_path / "entry")
    monkeypatch.setattr(native, "build_command", lambda cxx, output: ["sh", "-c", "kill -9 $$"])
    with pytest.raises(native.BuildError, match="failed on launcher.cpp"):
        native.build(tmp_path)
    assert not (tmp_path / "entry" / native.FAILED).exists()


def test_a_library_whose_errors_do_not_reach_python_is_recorded(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "compilers", lambda: ["/usr/bin/c++"])
    monkeypatch.setattr(native, "_entry", lambda cxx, cache_dir: tmp_path / "entry")
    monkeypatch.setattr(native, "build_command", lambda cxx, output: ["touch", output])
    with pytest.raises(native.BuildError, match="does not raise its errors into Python"):
        native.build(tmp_path)
    assert "does not raise its errors" in (tmp_path / "entry" / native.FAILED).read_text()

    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    (tmp_path / "entry" / native.FAILED).unlink()
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **k: slow(cmd, **k) if cmd[0] == native.sys.executable
                        else subprocess.CompletedProcess(cmd, 0, "", ""))
    with pytest.raises(native.BuildError, match="was not tried: its test process ran past 300 s"):
        native.build(tmp_path)
    assert not (tmp_path / "entry" / native.FAILED).exists(), "a test that did not finish was recorded as a failure"


def test_compilers_are_tried_in_order_without_duplicates(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "g++")
    found = native.compilers()
    assert found and found[0] == shutil.which("g++")
    assert len({os.path.realpath(c) for c in found}) == len(found)
    tried = []

    def build_with(cxx, cache_dir):
        tried.append(cxx)
        if cxx == "/opt/other/g++":
            raise native.BuildError(f"the launcher built by {cxx} does not raise its errors into Python")
        return tmp_path / f"{cxx.replace('/', '_')}.so"

    entries = {"/opt/other/g++": tmp_path / "a", "/usr/bin/c++": tmp_path / "b", "/usr/bin/g++": tmp_path / "c"}
    monkeypatch.setattr(native, "_entry", lambda cxx, cache_dir: entries[cxx])
    monkeypatch.setattr(native, "compilers", lambda: list(entries))
    monkeypatch.setattr(native, "_build_with", build_with)
    # the first to pass is taken; the others build side by side with the first
    assert native.build(tmp_path) == tmp_path / "_usr_bin_c++.so"
    _wait_for(lambda: len(tried) == 3)
    assert sorted(tried) == sorted(entries)
    # a compiler with a library in the cache ends the list: none after it builds
    tried.clear()
    entries["/usr/bin/c++"].mkdir()
    (entries["/usr/bin/c++"] / native.LIBRARY).touch()
    assert native.build(tmp_path) == tmp_path / "_usr_bin_c++.so" and tried == ["/opt/other/g++", "/usr/bin/c++"]
    # one with a failure recorded is not built beside the others
    tried.clear()
    (entries["/usr/bin/c++"] / native.LIBRARY).unlink()
    entries["/opt/other/g++"].mkdir()
    (entries["/opt/other/g++"] / native.FAILED).write_text("refused\n")
    assert native.build(tmp_path) == tmp_path / "_usr_bin_c++.so"
    _wait_for(lambda: len(tried) == 3)
    assert sorted(tried) == ["/opt/other/g++", "/usr/bin/c++", "/usr/bin/g++"]
    monkeypatch.setattr(native, "compilers", lambda: ["/opt/other/g++"])
    with pytest.raises(native.BuildError, match="does not raise its errors"):
        native.build(tmp_path)


def _wait_for(done, seconds: float = 10.0) -> None:
    """Until `done()` (the builds `native.build` leaves running in its threads), or `seconds`."""
    import time

    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_enable_native_waits_for_the_build_start_native_started(native_untried, monkeypatch, tmp_path):
    started, release = __import__("threading").Event(), __import__("threading").Event()
    builds = []

    def build(cache_dir):
        builds.append(cache_dir)
        started.set()
        release.wait(10)
        raise native.BuildError("no compiler")

    monkeypatch.setattr(native, "build", build)
    launch.start_native(tmp_path)
    assert started.wait(10)
    launch.start_native(tmp_path)  # under way: not started twice
    release.set()
    with pytest.raises(native.BuildError, match="no compiler"):
        launch.enable_native(tmp_path)
    assert builds == [tmp_path] and launch.native_launcher() == "failed" and not launch._native_builds
    launch.start_native(tmp_path)  # tried: nothing more
    assert builds == [tmp_path] and not launch._native_builds


def test_a_library_whose_errors_crash_is_refused(tmp_path):
    """`_errors_reach_python` runs the library in a new process: one that dies there (here:
    no library at all) is a BuildError, not a crash of this process."""
    with pytest.raises(native.BuildError, match="does not raise its errors into Python"):
        native._errors_reach_python(tmp_path / "missing.so", "c++")


def _launcher(anchor, saves=(), **fields):
    """The attributes of launch.Launcher that native.register reads."""
    spec = SimpleNamespace(anchor=anchor, channels=fields.pop("channels", 16), dtype=fields.pop("dtype", "bfloat16"))
    defaults = dict(spec=spec, anchor_path="library anchor", n_operands=anchor.n_operands,
                    gemm_auto=False, row_output=False, reduced_tail=(), keeps_spatial=False, stores_pre_norm=False, running_stats=(),
                    saves=[(s, getattr(torch, s.dtype)) for s in saves], gemm_tf32=False, reads_conv_tf32=False,
                    conv_tf32=False, in_kernel_nchw=False)
    defaults.update(fields)
    return SimpleNamespace(**defaults)


def test_plan_layout_of_a_library_conv_with_saves():
    conv = Anchor("conv", has_bias=True, conv=((2, 1), (1, 0), (1, 3), False, (0, 0), 4))
    saves = (Save("value", "float32", (-1, 16, 5, 5), 16 * 25, at=0), Save("mean", "bfloat16", (16,), 0),
             Save("value", "float16", (-1, 16), 16, at=2))
    launcher = _launcher(conv, saves, running_stats=(2, 3))
    assert native._layout(launcher) == [0, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        0, 0, 0, 0, 0]
    assert native._conv(conv) == [2, 2, 1, 1, 0, 1, 3, 0, 0, 0, 4]
    assert native._saves(launcher) == [1, 0, 400, 4, -1, 16, 5, 5, 0, 2, 0, 1, 16, 0, 1, 16, 2, -1, 16]


def test_plan_layout_of_a_gemm_and_the_variants_that_read_tf32_settings():
    launcher = _launcher(Anchor("addmm"), anchor_path="in-kernel GEMM", gemm_auto=True, row_output=True,
                         reduced_tail=(1,), channels=8192)
    assert native._layout(launcher) == [1, 0, 3, 1, 1, 1, 1, 0, 0, 0, 0, 8192, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        0, 0, 0, 0, 0]
    assert native._conv(launcher.spec.anchor) == []
    assert native.covers(launcher)
    # A float32 in-kernel GEMM file, and the two variants of a float32 direct conv: the C++
    # launcher reads the TF32 setting at each call and runs the plan made for it.
    tf32_gemm = _launcher(Anchor("mm"), anchor_path="in-kernel GEMM", gemm_tf32=True)
    assert native.covers(tf32_gemm) and native._layout(tf32_gemm)[20:23] == [1, 0, 0]
    conv = Anchor("conv", conv=((1, 1), (0, 0), (1, 1), False, (0, 0), 1), direct=(4, 3, 3, 10, 12))
    for variant in (False, True):
        direct = _launcher(conv, anchor_path="direct conv", reads_conv_tf32=True, conv_tf32=variant)
        assert native.covers(direct) and native._layout(direct)[20:23] == [0, 1, int(variant)]
    # The in-kernel conv: its input's and weight's shapes travel, and the weight's input
    # channels as the kernel reads them (whole k-steps: 12 bf16 channels take one of 64
    # bytes, 32 channels), and x's pixels' pitch (12 channels padded to 16 bytes, 16).
    implicit = Anchor("conv", conv=((1, 1), (1, 1), (1, 1), False, (0, 0), 1), direct=(12, 3, 5, 20, 30),
                      implicit=True)
    launcher = _launcher(implicit, anchor_path="in-kernel conv", channels=128)
    assert native.covers(launcher)
    assert native._layout(launcher) == [3, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 128, 20, 28, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        12, 20, 30, 3, 5, 32, 0, 0, 0, 0, 0, 0, 16, 0]
    # Its float32 form on x and a weight rounded to TF32 by the graph (`Anchor.rounded`).
    rounded = _launcher(replace(implicit, rounded=True), anchor_path="in-kernel conv", channels=128,
                        reads_conv_tf32=True, conv_tf32=True)
    assert native.covers(rounded) and native._layout(rounded)[21:23] + native._layout(rounded)[29:31] == [1, 1, 1, 0]
    # A spatial reduction in its tiles (`ConvGemmPlan.reduce`): the reduction's [rows, C] output.
    reduced = _launcher(implicit, anchor_path="in-kernel conv", channels=128, row_output=True, reduced_tail=(128,))
    assert native.covers(reduced) and native._layout(reduced)[4:7] == [1, 1, 128]
    # Reading x in its NCHW layout (`ConvGemmPlan.nchw`), on the in-kernel conv's path only.
    nchw = _launcher(implicit, anchor_path="in-kernel conv", channels=128, in_kernel_nchw=True)
    assert native._layout(nchw)[30] == 1 and native._layout(nchw)[35] == 12  # (x NCHW: not padded)
    assert native._layout(_launcher(conv, anchor_path="direct conv", in_kernel_nchw=True))[30] == 0
    # A Conv1d as the 2-D conv of one row (`Anchor.as_2d`): the output is the graph's
    # [rows, C, L], on the paths whose kernels compute the conv.
    one_row = replace(implicit, as_2d=True, conv=((1, 1), (0, 1), (1, 1), False, (0, 0), 1),
                      direct=(12, 1, 5, 1, 30))
    assert one_row.direct_out_spatial() == (28,) and implicit.direct_out_spatial() == (20, 28)
    for path in ("in-kernel conv", "direct conv"):
        layout = native.LaunchLayout.of(_launcher(one_row, anchor_path=path, channels=128))
        assert (layout.one_row, layout.out_h, layout.out_w) == (True, 1, 28)
    # ... and the library conv's output squeezed to it.
    layout = native.LaunchLayout.of(_launcher(replace(one_row, direct=(), implicit=False), channels=128))
    assert (layout.one_row, layout.out_h, layout.out_w) == (True, 0, 0)
    assert not native.LaunchLayout.of(_launcher(implicit, anchor_path="in-kernel conv", channels=128)).one_row
    # A 3-D conv (`Anchor.depth`): x's, the weight's and the output's depths travel, on the
    # in-kernel conv's path; 0 on a 2-D conv's.
    conv3d = replace(implicit, conv=((2, 1, 1), (1, 1, 1), (1, 1, 1), False, (0, 0, 0), 1), depth=(3, 9))
    assert conv3d.direct_out_spatial() == (5, 20, 28)
    layout = native.LaunchLayout.of(_launcher(conv3d, anchor_path="in-kernel conv", channels=128))
    assert (layout.in_d, layout.k_d, layout.out_d, layout.out_h, layout.out_w) == (9, 3, 5, 20, 28)
    assert native._layout(_launcher(conv3d, anchor_path="in-kernel conv", channels=128))[-5:-2] == [9, 3, 5]
    assert native._layout(launcher)[-5:-2] == [0, 0, 0]


def test_plan_layout_of_a_baddbmm():
    # Its alpha travels as the 64 bits of the double, read back exactly; 0 elsewhere.
    for alpha in (1.0, -0.5, 0.1, 1 / 3):
        launcher = _launcher(Anchor("bmm", has_bias=True, alpha=alpha), channels=12)
        bits = native._layout(launcher)[36]
        assert bits == native.alpha_bits(alpha) and struct.unpack("<d", struct.pack("<q", bits))[0] == alpha
        assert native.covers(launcher)
    assert native._layout(_launcher(Anchor("bmm"), channels=12))[36] == 0


def test_plan_layout_of_a_permuted_conv():
    conv = Anchor("conv", has_bias=True, conv=((1, 1), (3, 3), (1, 1), False, (0, 0), 96), permuted=True)
    launcher = _launcher(conv, channels=96)
    assert native._layout(launcher)[18:20] == [0, 1] and native.covers(launcher)


def test_plan_layout_of_a_padded_gemm():
    launcher = _launcher(Anchor("addmm", pad=(152, 520)), channels=513)
    assert native._layout(launcher) == [0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 513, 0, 0, 0, 0, 152, 520, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                        0, 0, 0, 0, 0]


def test_plan_layout_of_a_channels_last_conv():
    conv = Anchor("conv", has_bias=True, conv=((1, 1), (1, 1), (1, 1), False, (0, 0), 1), channels_last=True)
    assert native._layout(_launcher(conv)) == [0, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                               0, 0, 0, 0, 0]


@pytest.mark.parametrize("tail", [(), (1,), (16,), (16, 1, 1), (1, 1, 1), (16, 7, 9), (16, 3, 5, 4)])
def test_plan_layout_of_a_reduced_output(tail):
    """A reduced output's shape after its rows travels as its tail: a row reduction's
    [rows] or [rows, 1], a spatial reduction's [rows, C] or [rows, C, 1, 1] (one channel
    with keepdim: [rows, 1, 1, 1]), a pool's [rows, C, *pooled]."""
    conv = Anchor("conv", conv=((1, 1), (1, 1), (1, 1), False, (0, 0), 1))
    layout = native.LaunchLayout.of(_launcher(conv, row_output=True, reduced_tail=tail))
    dims = (layout.out_d0, layout.out_d1, layout.out_d2, layout.out_d3)
    assert (layout.out_rank, dims[:layout.out_rank], layout.out_spatial) == (len(tail), tail, False)
    assert dims[layout.out_rank:] == (0,) * (4 - len(tail))
    # A reduction over the channels: [rows, 1] or [rows], then y's spatial dims.
    layout = native.LaunchLayout.of(_launcher(conv, row_output=True, reduced_tail=tail, keeps_spatial=True))
    assert layout.out_spatial


def test_a_layout_decodes_to_the_record_it_encodes():
    launcher = _launcher(Anchor("addmm", pad=(152, 520)), channels=513, gemm_auto=True, reduced_tail=(1,))
    record = native.LaunchLayout.of(launcher)
    assert native.LaunchLayout.decode(record.encode()) == record
    assert record.pad_k == 152 and record.pad_n == 520 and record.gemm_auto is True and record.channels == 513
    with pytest.raises(ValueError, match="entries"):
        native.LaunchLayout.decode(record.encode()[:-1])


def test_saves_and_checks_decode_to_the_records_they_encode():
    conv = Anchor("conv", has_bias=True, conv=((2, 1), (1, 0), (1, 3), False, (0, 0), 4))
    saves = (Save("value", "float32", (-1, 16, 5, 5), 16 * 25, at=0), Save("mean", "bfloat16", (16,), 0))
    records = [native.SaveLayout.of(s) for s in saves]
    assert records[0] == native.SaveLayout(True, 0, 400, (-1, 16, 5, 5))
    assert records[1] == native.SaveLayout(False, 2, 0, (16,))
    flat = native._saves(_launcher(conv, saves))
    assert native.SaveLayout.decode_all(flat) == records
    with pytest.raises(ValueError, match="cut short"):
        native.SaveLayout.decode_all(flat[:-1])
    checks = native.CheckLayout(2, 520, ((151, 0), (0, 151 * 513)), ((0, 513, 0, 1), (2, 0, 513, 1), (2, 0, 64, 4)))
    flat = checks.encode()
    assert flat == [2, 520, 2, 151, 0, 0, 151 * 513, 3, 0, 513, 0, 1, 2, 0, 513, 1, 2, 0, 64, 4]
    assert native.CheckLayout.decode(flat) == checks
    for cut in (flat[:-1], flat + [0], flat[:2]):
        with pytest.raises(ValueError, match="counts"):
            native.CheckLayout.decode(cut)
    # A launcher's record: its spec's dtype and row, the anchor sizes it checks every call.
    spec = EpilogueSpec(Anchor("addmm"), (Step("relu"),), "bfloat16", (), 513, 1, "linear_pointwise")
    launcher = SimpleNamespace(spec=spec, anchor_sizes=[(151, 0)])
    assert native._checks(launcher) == [2, 513, 1, 151, 0, 0]


def test_the_cpp_launcher_reads_the_layout_and_codes_python_writes():
    # One contract, two sources: set_plan reads LaunchLayout's fields in its order, and
    # the enum and dtype codes are the ones native.py writes.
    import dataclasses

    source = native.SOURCE.read_text()
    reads = dict((int(i), name) for name, i in re.findall(r"plan->(\w+) = (?:static_cast<\w+>\()?layout\[(\d+)\]", source))
    names = [f.name for f in dataclasses.fields(native.LaunchLayout)]
    assert [reads[i] for i in sorted(reads)] == names and sorted(reads) == list(range(len(names)))
    assert f"constexpr size_t kLayoutFields = {len(names)};" in source
    anchors = dict(re.findall(r"(k\w+) = (\d+)", re.search(r"enum class Anchor[^}]*}", source).group(0)))
    assert {k: int(v) for k, v in anchors.items()} == {"k" + n.capitalize(): c for n, c in native.ANCHOR_CODES.items()}
    paths = dict(re.findall(r"(k\w+) = (\d+)", re.search(r"enum class Path[^}]*}", source).group(0)))
    assert {k: int(v) for k, v in paths.items()} == {
        {"library anchor": "kLibraryAnchor", "in-kernel GEMM": "kGemm", "direct conv": "kDirectConv",
         "in-kernel conv": "kImplicitConv"}[n]: c
        for n, c in native.PATH_CODES.items()}
    dtypes = dict(re.findall(r"case (\d+): return at::k(\w+);", re.search(r"dtype_of\(int64_t code\)[^}]*}", source).group(0)))
    torch_names = {"Float": "float32", "Half": "float16", "BFloat16": "bfloat16", "Double": "float64"}
    assert {torch_names[v]: int(k) for k, v in dtypes.items()} == native.DTYPE_CODES


# --------------------------------------------------------------------------- GPU


@pytest.fixture
def python_launches(monkeypatch):
    """Counts the calls that the Python launcher runs."""
    calls = []
    real = launch.Launcher.__call__
    monkeypatch.setattr(launch.Launcher, "__call__", lambda self, inputs: (calls.append(self), real(self, inputs))[1])
    return calls


def _agree(spec, inputs, python_launches) -> bool:
    """Runs `spec` on `inputs` through `fusedepi::chain` and through the Python launcher;
    asserts equal bits. Returns whether C++ served the first."""
    before = len(python_launches)
    ours = torch.ops.fusedepi.chain(inputs, spec)
    served = len(python_launches) == before
    theirs = torch.ops.fusedepi.chain_py(inputs, spec)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    return served


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["library-anchor", "in-kernel-gemm", "in-kernel-conv"])
def test_cpp_and_python_launchers_agree_on_fuzzed_models(kind, monkeypatch, python_launches):
    # in-kernel-conv: the fuzzer's generation of Conv1d, stride-1 ConvTranspose2d and Conv3d
    # among the in-kernel conv's anchors (their outputs shaped by `LaunchLayout.one_row`,
    # and `out_d`, in C++).
    from fuzzer import CONV3D_GENERATION, make_case, run_case

    gemm, implicit = kind == "in-kernel-gemm", kind == "in-kernel-conv"
    generation = CONV3D_GENERATION if implicit else 1

    captured = []
    real = launch.launcher_for

    def capturing(spec, device):
        launcher = real(spec, device)
        return lambda inputs: (captured.append((spec, [t.clone() for t in inputs])), launcher(inputs))[1]

    monkeypatch.setattr(launch, "launcher_for", capturing)
    for index in range(30):
        case = make_case(7, index, "cuda", generation=generation, gemm=gemm, implicit=implicit)
        result = run_case(case, "cuda", grad=index % 3 == 0)
        assert result.check != "error", result.finding
    monkeypatch.setattr(launch, "launcher_for", real)
    assert launch.native_launcher() == "loaded"
    assert len(captured) >= 15, f"only {len(captured)} fused calls in 30 models"
    served, kinds = 0, set()
    for spec, inputs in captured:
        launcher = launch.launcher_for(spec, inputs[0].device)
        covered = native.covers(launcher)
        cpp = _agree(spec, inputs, python_launches)
        assert cpp == covered, f"C++ served: {cpp}, covers the spec: {covered} ({launcher.spec.fusion})"
        served += cpp
        if cpp:
            kinds |= {launcher.anchor_path, *(["saves"] if launcher.saves else []),
                      *(["running stats"] if launcher.running_stats else [])}
    assert served >= 10, f"C++ served {served} of {len(captured)} calls"
    # What the C++ side met: the in-kernel GEMM's models run it at every call
    # (FUSEDEPI_IN_KERNEL_GEMM=1); the others have convs, and training graphs' saves.
    expected = ({"in-kernel GEMM", "saves"} if gemm else {"in-kernel conv"} if implicit
                else {"library anchor", "saves"})
    assert expected <= kinds, f"C++ served {sorted(kinds)}"


@pytest.mark.gpu
def test_cpp_launcher_asks_python_about_new_rows_of_an_in_kernel_gemm(python_launches):
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU()).cuda().to(torch.bfloat16)
    x = torch.rand(8192, 256, device="cuda", dtype=torch.bfloat16)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        torch.compile(model, backend=fusedepi)(x)
    (spec,) = [r.spec for report in reports for r in report.records if r.status == "fused"]
    assert "wgmma" in [r.kernel for report in reports for r in report.records][0]
    bias, weight = model[0].bias, model[0].weight
    for rows, in_kernel in ((8192, True), (8, False), (8, False), (8192, True)):
        launcher = launch.launcher_for(spec, x.device)
        inputs = [bias, torch.rand(rows, 256, device="cuda", dtype=torch.bfloat16), weight.t()]
        known = rows in launcher._gemm_rows
        assert _agree(spec, inputs, python_launches) == known, f"{rows} rows"
        assert launcher.in_kernel_gemm(rows) == in_kernel
    # Dropped plans: the next call asks Python again, which plans it anew.
    launch.forget_loaded()
    assert native.plan_count() == 0
    assert not _agree(spec, inputs, python_launches)
    assert native.plan_count() == 1
    assert _agree(spec, inputs, python_launches)


@pytest.mark.gpu
@pytest.mark.parametrize("tail", ["gelu", "batchnorm", "softmax"])
def test_cpp_and_python_launchers_agree_on_a_padded_gemm(tail, monkeypatch, python_launches):
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    monkeypatch.setenv("FUSEDEPI_PAD_GEMM", "1")
    torch.manual_seed(0)
    norm = {"gelu": torch.nn.GELU(), "batchnorm": torch.nn.BatchNorm1d(513), "softmax": torch.nn.Softmax(-1)}[tail]
    model = torch.nn.Sequential(torch.nn.Linear(151, 513), norm).cuda().to(torch.bfloat16)
    x = torch.rand(3000, 151, device="cuda", dtype=torch.bfloat16)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        torch.compile(model, backend=fusedepi)(x)
    (record,) = [r for report in reports for r in report.records if r.status == "fused"]
    assert "padded to K=152, N=520" in record.kernel
    inputs = [model[0].bias, x, model[0].weight.t()]
    if tail == "batchnorm":
        bn = model[1]
        inputs += [bn.weight, bn.bias, bn.running_mean.clone(), bn.running_var.clone()]
    launch.launcher_for(record.spec, x.device)  # planned: C++ serves the next call
    assert _agree(record.spec, inputs, python_launches)


@pytest.mark.gpu
def test_cpp_and_python_launchers_agree_on_a_channels_last_conv(monkeypatch, python_launches):
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    monkeypatch.setenv("FUSEDEPI_CONV_CHANNELS_LAST", "1")
    monkeypatch.setenv("FUSEDEPI_DISABLE", "direct_conv")  # the ConvTranspose as cuDNN runs it (not Anchor.flipped)
    torch._dynamo.reset()  # a static batch: earlier tests' Sequential models would make this compile dynamic
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.ConvTranspose2d(4, 16, 2, padding=1), torch.nn.GroupNorm(4, 16),
                                torch.nn.SiLU()).cuda().to(torch.bfloat16)
    x = torch.rand(300, 4, 10, 19, device="cuda", dtype=torch.bfloat16)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        torch.compile(model, backend=fusedepi)(x)
    (record,) = [r for report in reports for r in report.records if r.status == "fused"]
    assert record.kernel.endswith("(library conv on channels-last operands)")
    conv, norm = model[0], model[1]
    inputs = [x, conv.weight, conv.bias, norm.weight, norm.bias]
    launch.launcher_for(record.spec, x.device)  # planned: C++ serves the next call
    assert _agree(record.spec, inputs, python_launches)




@pytest.mark.gpu
@pytest.mark.parametrize("dtype, cin", [(torch.bfloat16, 64), (torch.bfloat16, 24), (torch.float32, 20)])
def test_cpp_and_python_launchers_agree_on_the_in_kernel_conv(dtype, cin, monkeypatch, python_launches):
    """The in-kernel conv's operands change layout in C++ as in Python (x channels-last,
    the weight [C_out, kh, kw, C_in'] with zeros past C_in where C_in is no whole number of
    k-steps): the same bits; float32 for each value of cuDNN's TF32 flag (off: the library
    conv). An x of the same size in another shape raises, from Python's check."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the in-kernel conv is built for sm_90a")
    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "off")
    monkeypatch.setenv("FUSEDEPI_IN_KERNEL_CONV", "1")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(cin, 128, 3, padding=1), torch.nn.ReLU()).cuda().to(dtype)
    x = torch.rand(4, cin, 20, 30, device="cuda", dtype=dtype) * 2 - 1
    record, inputs = _fused_call(model, x, monkeypatch)
    assert record.kernel.startswith("igemm128x"), record.kernel
    for flag in (True, False) if dtype == torch.float32 else (True,):
        torch.backends.cudnn.allow_tf32 = flag
        launcher = launch.launcher_for(record.spec, x.device)
        assert launcher.native and launcher.anchor_path == ("in-kernel conv" if flag else "library anchor")
        assert _agree(record.spec, inputs, python_launches), flag
    torch.backends.cudnn.allow_tf32 = True
    launch.launcher_for(record.spec, x.device)
    other = [inputs[0].reshape(4, cin, 30, 20)] + inputs[1:]
    with pytest.raises(RuntimeError, match="the kernel was built for"):
        torch.ops.fusedepi.chain(other, record.spec)
    torch.cuda.synchronize()

class _ConvThen(torch.nn.Module):
    """Conv2d(16 -> 32, k3, padding 1) -> `tail`."""

    def __init__(self, tail):
        super().__init__()
        self.conv = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.tail = tail

    def forward(self, x):
        return self.tail(self.conv(x))


def _relu_global_mean(y):
    return torch.relu(y).mean(dim=(2, 3))


def _channel_amin_tanh(y):
    return torch.tanh(torch.amin(y, dim=1, keepdim=True))


def _relu_maxpool(y):
    return torch.nn.functional.max_pool2d(torch.relu(y), 2)


@pytest.mark.gpu
@pytest.mark.parametrize("tail, switch", [(_relu_global_mean, "REDUCES"), (_channel_amin_tanh, "PIXEL_REDUCES"),
                                          (_relu_maxpool, "POOLS_IN_TILE")])
def test_cpp_and_python_launchers_agree_on_the_in_kernel_convs_reduced_outputs(tail, switch, monkeypatch,
                                                                                python_launches):
    """An output that a reduction or a pool in the in-kernel conv's tiles shrinks ([rows, C]
    after a spatial mean; [rows, 1, H, W] after a reduction over each pixel's channels,
    which keeps the spatial dims; [rows, C, H / 2, W / 2] after a 2 x 2 pool) is made alike
    in C++ and Python: the same shapes, strides and bits."""
    from cuda_templates import conv_sm90

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the in-kernel conv is built for sm_90a")
    monkeypatch.setattr(conv_sm90, switch, True)
    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "off")
    monkeypatch.setenv("FUSEDEPI_IN_KERNEL_CONV", "1")
    torch.manual_seed(0)
    model = _ConvThen(tail).cuda().to(torch.bfloat16)
    x = torch.rand(3, 16, 20, 32, device="cuda", dtype=torch.bfloat16) * 2 - 1
    record, inputs = _fused_call(model, x, monkeypatch)
    assert record.kernel.startswith("igemm"), record.kernel
    assert launch.launcher_for(record.spec, x.device).native
    assert _agree(record.spec, inputs, python_launches)
    torch.cuda.synchronize()


def _fused_call(model, x, monkeypatch):
    """The fused record of compiling `model` on `x` (one chain) and the inputs of its op's
    first call, which the Python launcher serves (plans are made on that call)."""
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    torch._dynamo.reset()
    launch.forget_loaded()
    captured = []
    real = launch.launcher_for

    def capturing(spec, device):
        launcher = real(spec, device)
        return lambda inputs: (captured.append([t.clone() for t in inputs]), launcher(inputs))[1]

    monkeypatch.setattr(launch, "launcher_for", capturing)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        torch.compile(model, backend=fusedepi)(x)
    monkeypatch.setattr(launch, "launcher_for", real)
    (record,) = [r for report in reports for r in report.records if r.status == "fused"]
    assert captured, "the fused op did not run"
    return record, captured[0]


@pytest.mark.gpu
def test_cpp_launcher_reads_the_matmul_precision_at_every_call(monkeypatch, python_launches):
    """A float32 in-kernel GEMM file computes its GEMM in TF32 only while matmuls may use
    TF32: the C++ launcher reads the setting at each call, as Python's launcher does."""
    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "off")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), _LogSumExp()).cuda()
    x = torch.rand(8192, 256, device="cuda")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        record, inputs = _fused_call(model, x, monkeypatch)
        assert "wgmma" in record.kernel, record.kernel
        launcher = launch.launcher_for(record.spec, x.device)
        assert launcher.native and launcher.gemm_tf32
        assert launcher.in_kernel_gemm(8192)  # the rows' answer, which C++ has from here on
        results = {}
        for precision in ("highest", "high", "highest", "high"):
            torch.set_float32_matmul_precision(precision)
            assert _agree(record.spec, inputs, python_launches), precision
            results.setdefault(precision, []).append(torch.ops.fusedepi.chain(inputs, record.spec)[0])
        # The two settings ran two GEMMs (TF32 rounds the operands), each the same every time.
        for outs in results.values():
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        assert not torch.equal(results["highest"][0], results["high"][0])
    finally:
        torch.set_float32_matmul_precision(before)


class _LogSumExp(torch.nn.Module):
    def forward(self, y):
        return torch.logsumexp(y, dim=1)


@pytest.mark.gpu
def test_cpp_launcher_runs_the_direct_convs_variant_for_cudnns_tf32_flag(monkeypatch, python_launches):
    """A float32 direct conv has a kernel for each value of cuDNN's TF32 flag: the C++
    launcher reads the flag at each call and runs that variant's plan."""
    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "off")
    torch.manual_seed(0)
    # 4 input channels: the TF32 variant is the tensor-core kernel, the other one FMA.
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 16, 3, padding=1), torch.nn.ReLU()).cuda()
    x = torch.rand(2, 4, 256, 256, device="cuda")
    before = torch.backends.cudnn.allow_tf32
    try:
        record, inputs = _fused_call(model, x, monkeypatch)
        assert "direct" in record.kernel, record.kernel
        results = {}
        for flag in (True, False, True, False):
            torch.backends.cudnn.allow_tf32 = flag
            launcher = launch.launcher_for(record.spec, x.device)  # this variant's plan, made once
            assert launcher.conv_tf32 == flag and launcher.native
            assert _agree(record.spec, inputs, python_launches), flag
            results.setdefault(flag, []).append(torch.ops.fusedepi.chain(inputs, record.spec)[0])
        for outs in results.values():
            torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        assert not torch.equal(results[True][0], results[False][0])
    finally:
        torch.backends.cudnn.allow_tf32 = before
