"""GPU-free: environment switches, the fallback boundary and strict mode."""

import logging

import pytest
import torch
import torch.nn as nn

import cuda_templates
from fusion_backend import FusionError, load_config
from fusion_backend import rewrite as rewrite_module
from fusion_backend.config import ANCHOR_FORMS, FUSION_NAMES, STEP_NAMES
from helpers import SMALL_WORKLOADS, compile_records, steps_of

pytestmark = pytest.mark.usefixtures("cpu_reference")


def _workload(name):
    factory, shape, fusion = SMALL_WORKLOADS[name]
    torch.manual_seed(0)
    return factory(), torch.rand(shape), fusion


def test_disable_all_hands_everything_to_inductor(monkeypatch):
    monkeypatch.setenv("FUSEDEPI_DISABLE", "all")
    model, x, _ = _workload("3")
    out, fused, refused = compile_records(model, x)
    assert not fused and not refused
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_disable_one_fusion(monkeypatch):
    monkeypatch.setenv("FUSEDEPI_DISABLE", "linear_groupnorm")
    model, x, _ = _workload("3")
    out, fused, refused = compile_records(model, x)
    assert not fused and "fusion linear_groupnorm disabled by FUSEDEPI_DISABLE" in refused[0].reason
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_disable_one_step_shortens_the_chain(monkeypatch):
    monkeypatch.setenv("FUSEDEPI_DISABLE", "gelu")
    model, x, _ = _workload("1_eval")
    out, fused, _ = compile_records(model, x)
    assert steps_of(fused[0]) == ["batchnorm_eval"]
    assert "step gelu disabled" in fused[0].stop
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_every_fusion_name_is_disableable():
    for name in FUSION_NAMES | STEP_NAMES | ANCHOR_FORMS:
        assert name in load_config({"FUSEDEPI_DISABLE": name}).disabled


@pytest.mark.parametrize(
    "env, message",
    [
        ({"FUSEDEPI_DISABLE": "gelu,linear_groupnrom"}, "unknown name(s) ['linear_groupnrom']"),
        ({"FUSEDEPI_LOG_LEVEL": "LOUD"}, "not a logging level"),
        ({"FUSEDEPI_IN_KERNEL_GEMM": "always"}, "FUSEDEPI_IN_KERNEL_GEMM: 'always' is not auto, 1 (on) or 0 (off)"),
        ({"FUSEDEPI_PAD_GEMM": "maybe"}, "FUSEDEPI_PAD_GEMM: 'maybe' is not auto, 1 (on) or 0 (off)"),
        ({"FUSEDEPI_CONV_CHANNELS_LAST": "nhwc"}, "FUSEDEPI_CONV_CHANNELS_LAST: 'nhwc' is not auto, 1 (on) or 0 (off)"),
        ({"FUSEDEPI_GEMM_CONSUMERS": "spare"}, "FUSEDEPI_GEMM_CONSUMERS: 'spare' is not auto, 1 (on) or 0 (off)"),
        ({"FUSEDEPI_LIBRARY_CONV": "cudnn"}, "FUSEDEPI_LIBRARY_CONV: 'cudnn' is not auto, 1 (on) or 0 (off)"),
    ],
)
def test_bad_settings_are_clear_errors(env, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")):
        load_config(env)


@pytest.mark.parametrize("name, field", [("FUSEDEPI_IN_KERNEL_GEMM", "in_kernel_gemm"), ("FUSEDEPI_PAD_GEMM", "pad_gemm"),
                                         ("FUSEDEPI_CONV_CHANNELS_LAST", "conv_channels_last"),
                                         ("FUSEDEPI_FOLD_GEMM_BIAS", "fold_gemm_bias"),
                                         ("FUSEDEPI_GEMM_CONSUMERS", "gemm_consumers"),
                                         ("FUSEDEPI_LIBRARY_CONV", "library_conv"),
                                         ("FUSEDEPI_CONV_RECOMPUTE", "conv_recompute")])
def test_auto_on_off_settings(name, field):
    unset = "off" if field == "conv_recompute" else "auto"  # measured slower on the zoo: asked for only
    assert getattr(load_config({}), field) == unset and getattr(load_config({name: ""}), field) == unset
    for value, mode in (("auto", "auto"), ("1", "on"), ("on", "on"), ("0", "off"), ("Off", "off"), (" ", unset)):
        assert getattr(load_config({name: value}), field) == mode


def test_cache_dir_default_and_override(tmp_path):
    assert load_config({"XDG_CACHE_HOME": str(tmp_path)}).cache_dir == tmp_path / "fusedepi"
    assert load_config({"FUSEDEPI_CACHE_DIR": str(tmp_path / "k")}).cache_dir == tmp_path / "k"
    assert load_config({"FUSEDEPI_STRICT": "1"}).strict and not load_config({}).strict


def _failing_build(chain, spec, cfg):
    """A real build of source that does not compile (or, without nvcc, a real 'nvcc not found')."""
    cuda_templates.build("this is not CUDA", "broken", "sm80", cfg.cache_dir)


def test_compile_failure_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FUSEDEPI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(rewrite_module, "_prepare", _failing_build)
    model, x, _ = _workload("4")
    with caplog.at_level(logging.WARNING, logger="fusedepi"):
        out, fused, refused = compile_records(model, x)
    assert not fused and refused[0].reason.startswith("kernel build failed")
    warnings = [r for r in caplog.records if r.name == "fusedepi" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "Inductor runs this chain" in warnings[0].getMessage()
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_compile_failure_raises_in_strict_mode(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDEPI_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FUSEDEPI_STRICT", "1")
    monkeypatch.setattr(rewrite_module, "_prepare", _failing_build)
    model, x, _ = _workload("4")
    with pytest.raises(Exception) as info:
        compile_records(model, x)
    assert isinstance(info.value, FusionError) or "FusionError" in repr(info.value)
    assert "CompileError" in repr(info.value.__cause__) or "nvcc" in str(info.value)


def test_matcher_crash_leaves_the_graph_to_inductor(monkeypatch, caplog):
    def crash(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(rewrite_module, "match_graph", crash)
    model, x, _ = _workload("2")
    with caplog.at_level(logging.WARNING, logger="fusedepi"):
        out, fused, _ = compile_records(model, x)
    assert not fused and any("pattern matching failed" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strict", [False, True])
def test_graph_surgery_failure_is_undone(strict, monkeypatch, caplog):
    def crash(graph):
        raise RuntimeError("surgery bug")

    monkeypatch.setattr(rewrite_module, "_stable_topological_sort", crash)
    model, x, _ = _workload("3")
    if strict:
        monkeypatch.setenv("FUSEDEPI_STRICT", "1")
        with pytest.raises(Exception, match="rewriting the graph failed"):
            compile_records(model, x)
        return
    with caplog.at_level(logging.WARNING, logger="fusedepi"):
        out, fused, refused = compile_records(model, x)
    assert not fused and "graph rewrite failed: surgery bug" in refused[-1].reason
    assert any("rewriting the graph failed" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_cpu_chains_are_not_fused_without_the_reference_switch(monkeypatch):
    monkeypatch.delenv("FUSEDEPI_CPU_REFERENCE")
    model, x, _ = _workload("3")
    out, fused, refused = compile_records(model, x)
    assert not fused and "CUDA-only" in refused[0].reason
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_inductor_compile_of_the_same_model_does_not_shadow_ours():
    # AOTAutograd's cache is keyed before our rewrite; a hit would return Inductor's artifact.
    model, x, fusion = _workload("3")
    with torch.no_grad():
        torch.compile(model)(x)
    _, fused, _ = compile_records(model, x)
    assert [r.fusion for r in fused] == [fusion]


def test_entry_point_registers_the_backend():
    from torch._dynamo import list_backends

    assert "fusedepi" in list_backends(exclude_tags=())


def test_explain_reports_and_restores_buffers(capsys):
    from fusion_backend import explain

    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Linear(32, 8))
    before = model[1].running_mean.clone()
    with torch.no_grad():
        report = explain(model, torch.randn(8, 16))
    printed = capsys.readouterr().out
    assert [r.fusion for r in report.fused] == ["linear_batchnorm_train"]
    assert report.refused and "no epilogue" in report.refused[0].reason
    assert "linear_batchnorm_train" in printed and "why not fused" in printed
    torch.testing.assert_close(model[1].running_mean, before)
    assert model[1].num_batches_tracked.item() == 0


def _recorded_chain_call(monkeypatch):
    """(inputs, spec, outputs) of one call of the fused op, from a CPU compile."""
    from fusion_backend import ops

    calls, original = [], ops.reference
    monkeypatch.setattr(ops, "reference", lambda inputs, spec: calls.append((inputs, spec)) or original(inputs, spec))
    model, x, _ = _workload("4")
    _, fused, _ = compile_records(model, x)
    assert fused and calls
    inputs, spec = calls[-1]
    return inputs, spec, original(inputs, spec)


@pytest.mark.parametrize("strict", [False, True], ids=["fallback", "strict"])
def test_build_failure_at_call_time(strict, monkeypatch, caplog):
    # A kernel built at call time (another device's architecture, dropped kernels) that
    # fails: the chain runs its reference with one warning, or raises in strict mode.
    from fusion_backend import launch

    inputs, spec, expected = _recorded_chain_call(monkeypatch)
    attempts = []

    def failing_launcher(spec, device):
        attempts.append(device)
        raise cuda_templates.CompileError("nvcc failed: simulated")

    monkeypatch.setattr(launch, "launcher_for", failing_launcher)
    monkeypatch.setattr(launch, "_unbuilt", set())
    if strict:
        monkeypatch.setenv("FUSEDEPI_STRICT", "1")
        with pytest.raises(cuda_templates.CompileError):
            launch._chain_cuda(inputs, spec)
        return
    with caplog.at_level(logging.WARNING, logger="fusedepi"):
        first = launch._chain_cuda(inputs, spec)
        second = launch._chain_cuda(inputs, spec)
    warnings = [r for r in caplog.records if r.name == "fusedepi" and r.levelno == logging.WARNING]
    assert len(attempts) == 1 and len(warnings) == 1 and "plain-torch reference" in warnings[0].getMessage()
    for out in (first, second):
        assert len(out) == len(expected)
        for got, want in zip(out, expected):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["FUSEDEPI_STRICT", "FUSEDEPI_CPU_REFERENCE", "FUSEDEPI_DEBUG"])
def test_on_off_switches_reject_other_values(name):
    assert getattr(load_config({name: "1"}), name.removeprefix("FUSEDEPI_").lower()) is True
    with pytest.raises(ValueError, match=name):
        load_config({name: "maybe"})


def test_explain_says_why_it_has_nothing_to_report(monkeypatch):
    from fusion_backend import explain

    model = torch.nn.Sequential(torch.nn.ReLU())
    report = explain(model, torch.randn(4, 8), verbose=False)
    assert not report.fused and not report.refused and "no candidate chain" in str(report)
    monkeypatch.setenv("FUSEDEPI_DISABLE", "all")
    report = explain(torch.nn.Linear(8, 8), torch.randn(4, 8), verbose=False)
    assert str(report) == "FUSEDEPI_DISABLE=all: every graph went to Inductor unfused"


def test_explain_prints_no_empty_table(monkeypatch):
    from fusion_backend import explain

    report = explain(nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32)), torch.randn(8, 16), verbose=False)
    text = str(report)
    assert report.fused and not report.refused
    assert text.endswith("refused candidates: 0") and "why not fused" not in text


def test_explain_says_when_inductor_compiled_everything(monkeypatch):
    from fusion_backend import explain

    monkeypatch.setenv("FUSEDEPI_DISABLE", "linear_layernorm")
    report = explain(nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32)), torch.randn(8, 16), verbose=False)
    assert not report.fused and report.refused
    assert str(report).endswith("no chain fused: Inductor compiled the model as it would without fusedepi")


def test_the_cpu_demo_fuses_both_samples_and_matches_eager(capsys, monkeypatch):
    from fusion_backend import demo

    monkeypatch.setenv("FUSEDEPI_CPU_REFERENCE", "1")  # the demo sets it; restored after the test
    assert demo.main(["--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "linear_batchnorm_train" in printed and "conv_groupnorm" in printed
    assert printed.count("fused 1 chain(s)") == 2
