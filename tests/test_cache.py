"""GPU-free: the content-addressed kernel cache and the loaded library's C interface."""

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import cuda_templates
from cuda_templates import compiler
from specs import workload_specs

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")

SPEC = workload_specs("float32")["w1_bn_train"]
SOURCE = cuda_templates.render(SPEC, "sm80")


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
    # FUSEDEPI_DEBUG's builds (-lineinfo) have entries of their own
    assert compiler.cache_key(SOURCE, "sm80", nvcc) != compiler.cache_key(SOURCE, "sm80", nvcc, line_info=True)
    assert "-lineinfo" in compiler.nvcc_flags("sm90a", True) and "-lineinfo" not in compiler.nvcc_flags("sm90a")


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
    # float32 column statistics: 4 columns a thread, batches of 6 rows, 8 warps, 32 / 4 = 8 batches
    # = 384 rows a block; the workspace holds the normalize scale and shift per column, then
    # (mean, M2, count) per (block, column).
    for rows in (1, 384, 385, 16384):
        assert lib.workspace_floats(rows) == 2 * channels + -(-rows // 384) * channels * 3
    lib.run([0] * 8, 0, 0, 0)  # zero rows: returns before touching the device


def test_truncated_library_is_detected_and_rebuilt(tmp_path, count_builds, caplog):
    library = compiler.build(SOURCE, "k", "sm80", tmp_path)
    good = library.read_bytes()
    library.write_bytes(good[: len(good) // 3])  # a build cut short, a disk error
    with caplog.at_level("WARNING", logger="fusedepi"):
        again = compiler.build(SOURCE, "k", "sm80", tmp_path)
    assert again == library and len(count_builds) == 2
    assert compiler._intact(again) and len(again.read_bytes()) > len(good) // 3
    assert "damaged" in caplog.text
    cuda_templates.load(SOURCE, "k", "sm80", tmp_path)  # loads


def test_entry_without_its_checksum_is_rebuilt(tmp_path, count_builds):
    library = compiler.build(SOURCE, "k", "sm80", tmp_path)
    library.with_name("kernel.so.sha256").unlink()  # e.g. killed between install steps
    compiler.build(SOURCE, "k", "sm80", tmp_path)
    assert len(count_builds) == 2 and library.with_name("kernel.so.sha256").exists()


def _fresh_private_cache(monkeypatch):
    monkeypatch.setattr(compiler, "_private_cache", None)


def test_unwritable_cache_falls_back_to_a_private_one(tmp_path, monkeypatch, caplog):
    _fresh_private_cache(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a cache "directory" below a regular file cannot be created (also as root)
    with caplog.at_level("WARNING", logger="fusedepi"):
        library = compiler.build(SOURCE, "k", "sm80", blocker / "cache")
        compiler.build(SOURCE, "k", "sm80", blocker / "cache")
    assert library.exists() and not str(library).startswith(str(blocker))
    assert caplog.text.count("cannot write the kernel cache") == 1  # one warning per process


def test_full_cache_falls_back_to_a_private_one(tmp_path, monkeypatch):
    _fresh_private_cache(monkeypatch)
    real = compiler._ninja_build

    def no_space(source, arch, nvcc, workdir, line_info=False):
        if str(workdir).startswith(str(tmp_path)):
            raise OSError(28, "No space left on device")
        return real(source, arch, nvcc, workdir, line_info)

    monkeypatch.setattr(compiler, "_ninja_build", no_space)
    library = compiler.build(SOURCE, "k", "sm80", tmp_path)
    assert library.exists() and not str(library).startswith(str(tmp_path))


def test_two_processes_build_once(tmp_path):
    code = (
        "import sys; from cuda_templates import compiler; real = compiler._ninja_build\n"
        "def counted(*a):\n    print('built', flush=True); return real(*a)\n"
        "compiler._ninja_build = counted\n"
        f"print(compiler.build(open({str(tmp_path / 'src.cu')!r}).read(), 'k', 'sm80', {str(tmp_path / 'cache')!r}))"
    )
    (tmp_path / "src.cu").write_text(SOURCE)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    lines = [out.split() for out, _ in outs]
    assert sum(line.count("built") for line in lines) == 1
    assert lines[0][-1] == lines[1][-1]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_a_failed_build_keeps_its_source_where_the_error_says(tmp_path):
    source = "this is not CUDA\n"
    with pytest.raises(cuda_templates.CompileError) as raised:
        cuda_templates.build(source, "broken", "sm80", tmp_path)
    message = str(raised.value)
    kept = re.search(r"kept in (\S+)\)", message)
    assert kept, message
    assert (Path(kept.group(1)) / "kernel.cu").read_text() == source
    assert "nvcc" in (Path(kept.group(1)) / "build.ninja").read_text()
    assert f"{kept.group(1)}/kernel.cu" in message  # the error names the kept file, not the removed one


def test_debug_builds_carry_line_info_in_entries_of_their_own(tmp_path):
    plain = compiler.build(SOURCE, "k", "sm80", tmp_path)
    lined = compiler.build(SOURCE, "k", "sm80", tmp_path, line_info=True)
    assert plain != lined and lined.exists()
    assert lined.stat().st_size > plain.stat().st_size  # the line table
