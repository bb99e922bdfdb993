"""GPU-free: the content-addressed kernel cache and the loaded library's C interface."""

import os
import shutil
import subprocess
import sys
import threading

import pytest

import cuda_templates
from cuda_templates import compiler
from specs import workload_specs

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")

SPEC = workload_specs("float32")["w1_bn_train"]
SOURCE = cuda_templates.render(SPEC, "sm80")


@pytest.fixture
def count_builds(monkeypatch):
    calls = []
    real = compiler._ninja_build

    def counting(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "_ninja_build", counting)
    return calls


def test_second_build_is_a_cache_hit(tmp_path, count_builds):
    first = compiler.build(SOURCE, "k", "sm80", tmp_path)
    second = compiler.build(SOURCE, "k", "sm80", tmp_path)
    assert first == second and len(count_builds) == 1
    assert first.parent.parent.name == first.parent.name[:2]  # sharded by key prefix
    assert (first.parent / "kernel.cu").read_text() == SOURCE


def test_concurrent_builds_build_once(tmp_path, count_builds):
    results = []
    threads = [threading.Thread(target=lambda: results.append(compiler.build(SOURCE, "k", "sm80", tmp_path))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and len(results) == 4 and len(count_builds) == 1


def test_a_new_process_reuses_the_cache(tmp_path):
    compiler.build(SOURCE, "k", "sm80", tmp_path)
    code = (
        "import sys, cuda_templates; from cuda_templates import compiler;"
        "compiler._ninja_build = lambda *a: sys.exit('rebuilt');"
        f"print(compiler.build(open({str(tmp_path / 'src.cu')!r}).read(), 'k', 'sm80', {str(tmp_path)!r}))"
    )
    (tmp_path / "src.cu").write_text(SOURCE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("kernel.so")


def test_key_depends_on_source_and_arch():
    nvcc = compiler.find_nvcc()
    assert compiler.cache_key(SOURCE, "sm80", nvcc) != compiler.cache_key(SOURCE, "sm90", nvcc)
    assert compiler.cache_key(SOURCE, "sm80", nvcc) != compiler.cache_key(SOURCE + " ", "sm80", nvcc)


def test_compile_error_carries_the_compiler_output(tmp_path):
    with pytest.raises(cuda_templates.CompileError, match="error"):
        compiler.build("this is not CUDA", "broken", "sm80", tmp_path)


def test_missing_nvcc_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(cuda_templates.CompileError, match="nvcc not found"):
        compiler.build(SOURCE, "k", "sm80", tmp_path)


def test_library_interface_without_a_gpu(tmp_path):
    lib = cuda_templates.load(SOURCE, "k", "sm80", tmp_path)
    channels = SPEC.channels
    # float32 column statistics: 4 columns x 16 rows a thread, 8 warps, 4 batches = 512 rows a chunk;
    # the workspace holds mean and invstd per column, then (mean, M2) per (chunk, column).
    for rows in (1, 512, 513, 16384):
        assert lib.workspace_floats(rows) == 2 * channels + -(-rows // 512) * channels * 2
    lib.run([0] * 8, 0, 0, 0)  # zero rows: returns before touching the device
