"""GPU-free: the table of forms (fusion_backend/forms/) and the execution plan: each
row decided by its setting and, under "auto", by one timing through the one cache."""

import json
from types import SimpleNamespace

import pytest
import torch

from fusion_backend import forms, timings
from fusion_backend.config import load_config
from fusion_backend.forms import conv_layout, gemm_bias, gemm_consumers, gemm_padding
from fusion_backend.plan import ExecutionPlan
from fusion_backend.choice import Choice
from lowering.spec import Anchor, EpilogueSpec, Step

CONV2D = ((1, 1), (1, 1), (1, 1), False, (0, 0), 1)


def _node(dtype=torch.float32, device="cuda"):
    val = SimpleNamespace(device=torch.device(device, 0) if device == "cuda" else torch.device(device), dtype=dtype)
    return SimpleNamespace(meta={"val": val}, name="node")


def _chain(form: str, device="cuda"):
    """A stand-in for a matched chain that `form`'s row applies to once its `candidate`
    is patched: (chain, what `candidate` returns)."""
    node = _node(device=device)
    if form == "gemm_bias":
        spec = EpilogueSpec(Anchor("addmm"), (Step("relu"),), "float32", ("float32",), 127, 1, "linear_pointwise")
        found = (818368, 201, 127)
        operands, params = [node, node, node], [node]
    elif form == "gemm_padding":
        spec = EpilogueSpec(Anchor("addmm"), (Step("relu"),), "bfloat16", (), 513, 1, "linear_pointwise")
        found = ("addmm", "bfloat16", 4096, 151, 513, 152, 520)
        operands, params = [node, node, node], []
    else:
        spec = EpilogueSpec(Anchor("conv", True, CONV2D), (Step("relu"),), "bfloat16", (), 16, 162, "conv_pointwise")
        found = (spec.anchor, "bfloat16", (3, 5, 9, 18), (16, 5, 3, 3), False)
        operands, params = [node, node, node], []
    return SimpleNamespace(spec=spec, operands=operands, params=params, anchor=node), found


# The spec each row makes of its stand-in: (anchor kind, pad, channels-last, first step).
TAKEN = {
    "gemm_bias": ("mm", (), False, Step("add", inputs=(1,), operand="channel", reverse=True)),
    "gemm_padding": ("addmm", (152, 520), False, Step("relu")),
    "conv_layout": ("conv", (), True, Step("relu")),
}
NOT_TAKEN = {"gemm_bias": ("addmm", (), False, Step("relu")), "gemm_padding": ("addmm", (), False, Step("relu")),
             "conv_layout": ("conv", (), False, Step("relu"))}


def _form(name):
    return next(f for f in forms.FORMS if f.name == name)


def _shape(spec):
    return spec.anchor.kind, spec.anchor.pad, spec.anchor.channels_last, spec.steps[0]


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    """An empty cache directory, as a new process sees it, on a GPU named "Test GPU"."""
    monkeypatch.setattr(timings, "_cache", {})
    monkeypatch.setattr(timings, "_read_files", set())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    return tmp_path


def test_the_table_lists_each_form_once_with_its_switch():
    assert [f.name for f in forms.FORMS] == ["gemm_bias", "gemm_padding", "library_conv", "conv_layout",
                                             "in_kernel_conv", "conv_recompute", "gemm_consumers"]
    assert all(forms.BY_NAME[f.name] is f for f in forms.FORMS)
    cfg = load_config({})
    for form in forms.FORMS:  # the recompute measured slower on every zoo chain: off unless asked
        assert getattr(cfg, form.setting) == ("off" if form.name == "conv_recompute" else "auto")
        assert getattr(load_config({form.env: "0"}), form.setting) == "off"


@pytest.mark.parametrize("name", list(TAKEN))
@pytest.mark.parametrize("graph_ms, form_ms, takes", [(2.0, 0.8, True), (2.0, 1.85, False), (1.0, 1.5, False)])
def test_auto_takes_a_form_where_the_timing_says_so(monkeypatch, fresh_cache, name, graph_ms, form_ms, takes):
    chain, found = _chain(name)
    form = _form(name)
    monkeypatch.setattr(form, "candidate", lambda chain: found)
    monkeypatch.setattr(form, "measure", lambda found, device: (graph_ms, form_ms))
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache)}))
    assert _shape(chain.spec) == (TAKEN if takes else NOT_TAKEN)[name]
    assert len(rows) == 1 and rows[0].form == name and rows[0].taken == takes
    assert (rows[0].graph_ms, rows[0].form_ms) == (graph_ms, form_ms)
    assert f"{form_ms:.4g} ms against {graph_ms:.4g} ms" in rows[0].describe()
    if name == "gemm_bias":  # the bias node moves from the anchor's operands to the epilogue's
        assert (len(chain.operands), len(chain.params), len(chain.spec.param_dtypes)) == (
            (2, 2, 2) if takes else (3, 1, 1))
    # The conv layout alone keeps the spec without it, for the chain to be timed both ways.
    before = _chain(name)[0].spec
    assert rows[0].alternative == (before if takes and name == "conv_layout" else None)


@pytest.mark.parametrize("name", list(TAKEN))
def test_on_takes_a_form_untimed_and_off_skips_it(monkeypatch, tmp_path, name):
    form = _form(name)

    def measure(found, device):
        raise AssertionError("timed")

    monkeypatch.setattr(form, "measure", measure)
    chain, found = _chain(name)
    monkeypatch.setattr(form, "candidate", lambda chain: found)
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(tmp_path), form.env: "1"}))
    assert _shape(chain.spec) == TAKEN[name] and rows[0].taken and form.env in rows[0].describe()
    chain, _ = _chain(name)
    assert forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(tmp_path), form.env: "0"})) == ()
    assert _shape(chain.spec) == NOT_TAKEN[name]


@pytest.mark.parametrize("name", list(TAKEN))
def test_auto_times_nothing_on_the_cpu(monkeypatch, tmp_path, name):
    form = _form(name)
    chain, found = _chain(name, device="cpu")
    monkeypatch.setattr(form, "candidate", lambda chain: found)
    monkeypatch.setattr(form, "measure", lambda found, device: pytest.fail("timed on the CPU"))
    assert forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(tmp_path)})) == ()
    assert _shape(chain.spec) == NOT_TAKEN[name]


@pytest.mark.parametrize("name", list(TAKEN))
def test_a_failed_timing_keeps_the_graphs_form_or_raises_under_strict(monkeypatch, fresh_cache, name):
    def fail(found, device):
        raise RuntimeError("CUDA out of memory")

    form = _form(name)
    chain, found = _chain(name)
    monkeypatch.setattr(form, "candidate", lambda chain: found)
    monkeypatch.setattr(form, "measure", fail)
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache)}))
    assert _shape(chain.spec) == NOT_TAKEN[name]
    assert not rows[0].taken and "timing failed: RuntimeError" in rows[0].describe()
    chain, _ = _chain(name)
    with pytest.raises(RuntimeError, match="out of memory"):
        forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), "FUSEDEPI_STRICT": "1"}))


def test_timings_live_in_the_one_cache(monkeypatch, fresh_cache):
    """Every row's times go to `timings.CACHE_FILE`, keyed by the row, the GPU and what
    the call's speed depends on; a new process reads them instead of timing; an
    unreadable file is measured again."""
    measured = []
    for name in TAKEN:
        form = _form(name)
        monkeypatch.setattr(form, "measure", lambda found, device, name=name: measured.append(name) or (2.0, 1.0))
    cfg = load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache)})

    def run_all():
        for name in TAKEN:
            chain, found = _chain(name)
            monkeypatch.setattr(_form(name), "candidate", lambda chain, found=found: found)
            forms.choose(chain, cfg)

    run_all()
    assert measured == list(TAKEN)
    stored = json.loads((fresh_cache / timings.CACHE_FILE).read_text())
    assert sorted(k.split("|")[0] for k in stored) == sorted(TAKEN)
    assert all(k.split("|")[1] == "Test GPU" and v == [2.0, 1.0] for k, v in stored.items())
    # and by fusedepi's sources: a time measured by other kernels is not reused
    assert all(k.split("|")[-1] == f"fusedepi {timings.source_digest()}" for k in stored)
    monkeypatch.setattr(timings, "_cache", {})  # a new process: read from the file
    monkeypatch.setattr(timings, "_read_files", set())
    run_all()
    assert len(measured) == 3
    (fresh_cache / timings.CACHE_FILE).write_text("not json")
    monkeypatch.setattr(timings, "_cache", {})
    monkeypatch.setattr(timings, "_read_files", set())
    run_all()
    assert len(measured) == 6


def test_candidates_are_timed_in_turns_and_a_steady_drift_cancels():
    """`timings.in_turns`: the timers take turns, the order reversed from round to round,
    and each keeps its median round. Two equal candidates on a device that slows by the
    same step each round read the same; timed one after the other (all of A's rounds,
    then B's) the second would read slower."""
    order, clock = [], [0.0]

    def timer(name, base):
        def time_a_round():
            order.append(name)
            clock[0] += 1.0  # the device slows down, whoever runs
            return base + clock[0]
        return time_a_round

    a, b = timings.in_turns([timer("a", 10.0), timer("b", 10.0)], rounds=4)
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert a == b == 14.5
    # A faster candidate stays faster by its own margin.
    order.clear(), clock.__setitem__(0, 0.0)
    fast, slow = timings.in_turns([timer("a", 10.0), timer("b", 12.0)], rounds=4)
    assert slow - fast == 2.0
    # Three candidates: each meets every position alike over two rounds.
    order.clear()
    timings.in_turns([timer("a", 0.0), timer("b", 0.0), timer("c", 0.0)], rounds=2)
    assert order == ["a", "b", "c", "c", "b", "a"]


def test_compare_ms_on_the_cpu_times_each_function_in_turns(monkeypatch):
    """Off a GPU `compare_ms` times wall clock: a call of each to warm up, then rounds in
    turns; the times come back in the order of the functions."""
    calls = []
    rounds = iter([3.0, 1.0, 1.5, 2.5, 3.5, 0.5, 0.75, 4.0])  # a, b, b, a, a, b, b, a
    monkeypatch.setattr(timings, "_wall_round_ms", lambda fn, n: (fn(), next(rounds))[1])
    times = timings.compare_ms([lambda: calls.append("a"), lambda: calls.append("b")], torch.device("cpu"))
    assert calls[:2] == ["a", "b"]  # the warm-up calls
    assert calls[2:] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert times == (3.25, 0.875)  # medians of (3, 2.5, 3.5, 4) and (1, 1.5, 0.5, 0.75)


def test_compare_ms_on_a_gpu_sizes_its_rounds_and_warms_the_device(monkeypatch):
    """On a GPU each round makes at least MIN_ROUND_MS of the shortest function's calls,
    and the functions take turns for WARM_MS first (functions of 0.02 and 0.05 ms a call
    here, the CUDA calls faked)."""
    import contextlib

    ms = {"a": 0.02, "b": 0.05}
    rounds = []
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(timings, "_captured", lambda fn: fn)
    monkeypatch.setattr(timings, "gpu_lock", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(timings, "cuda_round_ms", lambda fn, n: (rounds.append((fn(), n)), ms[fn()])[1])
    times = timings.compare_ms([lambda: "a", lambda: "b"], torch.device("cuda"))
    assert times == (0.02, 0.05)
    n = timings.calls_a_round(0.02, 10)
    assert n == 50 and rounds[:2] == [("a", 10), ("b", 10)]  # the probe sizes the rounds
    warm = rounds[2:-8]
    assert warm and all(calls == n for _, calls in warm)
    busy = 0.07 * 10 + sum(ms[name] * calls for name, calls in warm)
    assert timings.WARM_MS <= busy < timings.WARM_MS + 0.07 * n
    assert rounds[-8:] == [(name, n) for name in "abbaabba"]
    assert timings.calls_a_round(5.0, 10) == 10 and timings.calls_a_round(1e-6, 10) == timings.MAX_CALLS


def test_gemm_padding_pads_k_and_n_to_whole_vectors():
    chain, found = _chain("gemm_padding")
    spec = gemm_padding.GemmPadding().apply(chain, found)
    assert spec.anchor.pad == (152, 520) and spec.anchor.gemm == ()


def test_the_forms_key_holds_what_the_call_depends_on(monkeypatch):
    _, found = _chain("conv_layout")
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    key = conv_layout.ConvLayout().key(found)
    assert (3, 5, 9, 18) in key and (16, 5, 3, 3) in key and CONV2D in key and key[-1] is True
    _, found = _chain("gemm_bias")
    torch.set_float32_matmul_precision("high")
    try:
        assert gemm_bias.GemmBias().key(found)[-1] is True
    finally:
        torch.set_float32_matmul_precision("highest")
    assert gemm_bias.GemmBias().key(found)[-1] is False


def test_the_plan_describes_the_forms_then_the_choice():
    row = forms.FormChoice("gemm_padding", "padded", 2.0, 0.8, True)
    plan = ExecutionPlan("{}", "kernel", (row,), Choice(0.5, 0.6, True))
    assert plan.fused
    assert plan.describe() == "gemm_padding: taken (0.8 ms against 2 ms); fused 0.5 ms, Inductor 0.6 ms"
    assert ExecutionPlan("{}", "kernel", (), Choice(0.0, 0.0, True, "")).describe() == ""


@pytest.mark.parametrize("with_ms, without_ms, difference, keeps", [
    (0.30, 0.20, 0.0, False),  # faster without the form: the plan drops it
    (0.20, 0.30, 0.0, True),   # faster with it
    (0.20, 0.30, 0.5, False),  # with it the result differs from Inductor's: never kept
])
def test_the_chain_is_timed_without_a_form_its_library_call_took(monkeypatch, with_ms, without_ms, difference, keeps):
    """A form taken by its library call alone (`FormChoice.alternative`): the rewrite
    builds and times the chain without it too, and keeps the faster fused form."""
    from fusion_backend import rewrite

    chain, _ = _chain("conv_layout")
    before = chain.spec
    taken = conv_layout.ConvLayout().apply(chain, None)
    chain.spec = taken
    row = forms.FormChoice("conv_layout", "channels-last", 0.2, 0.1, True, alternative=before)
    first = Choice(with_ms, 0.25, not difference and with_ms <= 0.25, difference=difference)
    timed = {}

    def decide(chain_, spec, cfg, claimed):
        timed[spec] = chain_.spec
        return Choice(without_ms, 0.25, without_ms <= 0.25)

    monkeypatch.setattr(rewrite.choice, "decide", decide)
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: "kernel " + str(chain_.spec.anchor.channels_last))
    plan = rewrite._without_forms(chain, ExecutionPlan(taken.to_json(), "kernel True", (row,), first),
                                  load_config({}), frozenset())
    assert list(timed) == [before.to_json()]
    assert chain.spec == (taken if keeps else before)
    assert plan.spec == chain.spec.to_json() and plan.kernel == f"kernel {keeps}"
    assert plan.forms[0].taken == keeps and plan.forms[0].alternative is None
    assert plan.choice.fused_ms == (with_ms if keeps else without_ms)
    assert f"the chain {with_ms:.4g} ms in it, {without_ms:.4g} ms without" in plan.describe()


def test_an_untimed_plan_is_not_timed_without_its_forms(monkeypatch):
    from fusion_backend import rewrite

    chain, _ = _chain("conv_layout")
    row = forms.FormChoice("conv_layout", "channels-last", 0.2, 0.1, True, alternative=chain.spec)
    monkeypatch.setattr(rewrite.choice, "decide", lambda *args: pytest.fail("timed"))
    plan = ExecutionPlan("{}", "kernel", (row,), Choice(0.0, 0.0, True, "not timed (FUSEDEPI_AUTOTUNE)"))
    assert rewrite._without_forms(chain, plan, load_config({}), frozenset()) is plan


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_chain_that_cannot_be_built_without_the_form_keeps_it(monkeypatch, strict):
    import cuda_templates
    from fusion_backend import rewrite

    chain, _ = _chain("conv_layout")
    before = chain.spec
    chain.spec = taken = conv_layout.ConvLayout().apply(chain, None)
    row = forms.FormChoice("conv_layout", "channels-last", 0.2, 0.1, True, alternative=before)
    plan = ExecutionPlan(taken.to_json(), "kernel", (row,), Choice(0.2, 0.25, True))

    def prepare(chain_, spec, cfg):
        raise cuda_templates.NotRenderable("no NCHW mapping")

    monkeypatch.setattr(rewrite, "_prepare", prepare)
    got = rewrite._without_forms(chain, plan, load_config({"FUSEDEPI_STRICT": strict}), frozenset())
    assert got is plan and chain.spec == taken


def _in_kernel_chain(rows=8192, k=768, n=3072, dtype="bfloat16", steps=(Step("tanh"),), every_call=0):
    """A stand-in for a Linear chain the in-kernel GEMM takes: x [rows, k] on "cuda"."""
    x = SimpleNamespace(meta={"val": SimpleNamespace(device=torch.device("cuda", 0), shape=(rows, k))}, name="x")
    spec = EpilogueSpec(Anchor("addmm", gemm=(k, every_call)), steps, dtype, (), n, 1, "linear_pointwise")
    return SimpleNamespace(spec=spec, operands=[x, x, x], params=[], anchor=x)


def _consumers_taken():
    """A stand-in chain with the `gemm_consumers` form taken for the chain's timing, as
    `forms.choose` leaves it: (chain, the spec before, the spec taken, the row)."""
    chain = _in_kernel_chain()
    before = chain.spec
    chain.spec = taken = gemm_consumers.GemmConsumers().apply(chain, None)
    row = forms.FormChoice("gemm_consumers", "consumers", 0.0, 0.0, True, alternative=before, by_chain=True)
    return chain, before, taken, row


@pytest.fixture
def h100(monkeypatch):
    """The row's candidate on a 132-SM sm_90 GPU."""
    monkeypatch.setattr(gemm_consumers, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))


def test_the_consumers_row_applies_where_the_spare_warps_would_run_the_chain(h100):
    """16-bit pointwise chains of the in-kernel GEMM whose CTAs get 4 tiles or more."""
    form = gemm_consumers.GemmConsumers()
    assert form.candidate(_in_kernel_chain()) == (8192, 768, 3072, "bfloat16")  # 768 tiles on 132 SMs
    assert form.candidate(_in_kernel_chain(rows=1024)) is None  # 96 tiles: the library GEMM runs first
    assert form.candidate(_in_kernel_chain(rows=2048)) is None  # 192 tiles: the consumers run the chain anyway
    assert form.candidate(_in_kernel_chain(rows=2048, every_call=1)) is None
    assert form.candidate(_in_kernel_chain(rows=5632)) == (5632, 768, 3072, "bfloat16")  # 44 x 12 = 4 x 132 tiles
    assert form.candidate(_in_kernel_chain(rows=5504)) is None  # 43 x 12 tiles
    assert form.candidate(_in_kernel_chain(dtype="float32")) is None  # the consumers run float32 chains
    assert form.candidate(_in_kernel_chain(steps=(Step("groupnorm", consts=(1e-5,), groups=96),))) is None
    assert form.candidate(_in_kernel_chain(steps=(Step("logsumexp"),))) is None
    chain = _in_kernel_chain()
    chain.spec = form.apply(chain, form.candidate(chain))
    assert chain.spec.anchor.gemm_consumers and form.candidate(chain) is None


def test_the_consumers_row_is_taken_for_the_chains_timing_alone(monkeypatch, fresh_cache, h100):
    """Under "auto" the row is taken untimed (no library call of its own) with the graph's
    spec kept, for the rewrite to time the chain both ways; with nothing to time the
    chain (FUSEDEPI_AUTOTUNE=0, a CPU chain) the spare warps stay."""
    form = _form("gemm_consumers")
    monkeypatch.setattr(form, "measure", lambda found, device: pytest.fail("timed a library call"))
    chain = _in_kernel_chain()
    before = chain.spec
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache)}))
    assert len(rows) == 1 and rows[0].taken and rows[0].by_chain and rows[0].alternative == before
    assert chain.spec.anchor.gemm_consumers and not (fresh_cache / timings.CACHE_FILE).exists()
    assert rows[0].describe() == "gemm_consumers: taken (the chain not timed)"
    chain = _in_kernel_chain()
    assert forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), "FUSEDEPI_AUTOTUNE": "0"})) == ()
    assert not chain.spec.anchor.gemm_consumers
    chain = _in_kernel_chain()
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), form.env: "1"}))
    assert chain.spec.anchor.gemm_consumers and rows[0].alternative is None and form.env in rows[0].describe()
    chain = _in_kernel_chain()
    assert forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), form.env: "0"})) == ()


@pytest.mark.parametrize("with_ms, without_ms, keeps", [(0.080, 0.129, True), (0.042, 0.041, False)])
def test_the_chain_decides_between_the_consumers_and_the_spare_warps(monkeypatch, with_ms, without_ms, keeps):
    from fusion_backend import rewrite

    chain, before, taken, row = _consumers_taken()
    monkeypatch.setattr(rewrite.choice, "decide", lambda chain_, spec, cfg, claimed: Choice(without_ms, 0.1, True))
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: f"kernel {chain_.spec.anchor.gemm_consumers}")
    plan = rewrite._without_forms(chain, ExecutionPlan(taken.to_json(), "kernel True", (row,), Choice(with_ms, 0.1, True)),
                                  load_config({}), frozenset())
    assert chain.spec == (taken if keeps else before) and plan.kernel == f"kernel {keeps}"
    assert plan.forms[0].taken == keeps
    assert plan.forms[0].describe() == (f"gemm_consumers: {'taken' if keeps else 'not taken'} "
                                        f"(the chain {with_ms:.4g} ms in it, {without_ms:.4g} ms without)")


def test_an_untimed_chain_goes_back_from_the_consumers_to_the_spare_warps(monkeypatch):
    """Where the measured choice did not time the chain after all (a size without a hint,
    a neighbourhood it cannot cut out), the row's form is dropped: the graph's is built."""
    from fusion_backend import rewrite

    chain, before, taken, row = _consumers_taken()
    monkeypatch.setattr(rewrite.choice, "decide", lambda *args: pytest.fail("timed"))
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: f"kernel {chain_.spec.anchor.gemm_consumers}")
    untimed = Choice(0.0, 0.0, True, "not timed: a size without a hint")
    plan = rewrite._without_forms(chain, ExecutionPlan(taken.to_json(), "kernel True", (row,), untimed),
                                  load_config({}), frozenset())
    assert chain.spec == before and plan.spec == before.to_json() and plan.kernel == "kernel False"
    assert plan.fused and not plan.forms[0].taken
    assert plan.forms[0].describe() == "gemm_consumers: not taken (the chain not timed)"


def test_the_spec_without_a_form_is_built_beside_the_chains_own(monkeypatch):
    """Where the measured choice will time the chain both ways, the kernel of the spec
    without the form starts building on a thread of its own when the form is taken, not
    after the chain's own build;
    nothing is built ahead where nothing times the chain."""
    import threading

    from fusion_backend import rewrite

    chain, before, _, row = _consumers_taken()
    rows = (row,)
    release, built = threading.Event(), []

    def build(spec, device, cfg):
        built.append((spec, threading.current_thread().name))
        assert release.wait(10)
        return False

    monkeypatch.setattr(rewrite, "_build", build)
    pending = rewrite._prebuild_alternatives(chain, rows, load_config({}))
    assert len(pending) == 1 and not pending[0].done()  # under way while the caller goes on
    release.set()
    assert pending[0].result(timeout=10) is False
    assert built == [(before.to_json(), built[0][1])] and built[0][1].startswith("fusedepi-build")
    assert rewrite._prebuild_alternatives(chain, rows, load_config({"FUSEDEPI_AUTOTUNE": "0"})) == []
    assert rewrite._prebuild_alternatives(chain, rows[:0], load_config({})) == []
    cpu = SimpleNamespace(**{**vars(chain), "anchor": _node(device="cpu")})
    assert rewrite._prebuild_alternatives(cpu, rows, load_config({})) == []


def test_an_untimed_chain_that_cannot_be_built_without_the_consumers_keeps_them(monkeypatch):
    import cuda_templates
    from fusion_backend import rewrite

    chain, before, taken, row = _consumers_taken()

    def prepare(chain_, spec, cfg):
        raise cuda_templates.NotRenderable("no file for it")

    monkeypatch.setattr(rewrite, "_prepare", prepare)
    plan = ExecutionPlan(taken.to_json(), "kernel True", (row,), Choice(0.0, 0.0, True, "not timed: KeyError"))
    assert rewrite._without_forms(chain, plan, load_config({}), frozenset()) is plan and chain.spec == taken


def _conv_chain(dtype="bfloat16", cin=64, cout=128, hw=64, device="cuda", norm=False):
    """A stand-in for a 2-D conv chain (k 3, stride 1, no padding, relu; `norm`:
    BatchNorm in training, then relu) that the direct conv leaves to the library: x [2,
    cin, hw, hw], weight [cout, cin, 3, 3]."""
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    x = SimpleNamespace(meta={"val": SimpleNamespace(device=dev, shape=(2, cin, hw, hw), dim=lambda: 4)}, name="x")
    w = SimpleNamespace(meta={"val": SimpleNamespace(device=dev, shape=(cout, cin, 3, 3), dim=lambda: 4)}, name="w")
    anchor = Anchor("conv", False, CONV2D[:1] + ((0, 0),) + CONV2D[2:], direct=(cin, 3, 3, hw, hw))
    if norm:
        bn = Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(0, 1, 2, 3))
        spec = EpilogueSpec(anchor, (bn, Step("relu")), dtype, (dtype,) * 4, cout, (hw - 2) ** 2,
                            "conv_batchnorm_train")
    else:
        spec = EpilogueSpec(anchor, (Step("relu"),), dtype, (), cout, (hw - 2) ** 2, "conv_pointwise")
    return SimpleNamespace(spec=spec, operands=[x, w], params=[], anchor=x)


@pytest.fixture
def sm90(monkeypatch):
    """The conv rows (`forms.base.conv_found`: the in-kernel conv's, its recompute's, the
    library conv's) on an sm_90 GPU, with cuDNN's TF32 allowed; the module to patch
    otherwise."""
    from fusion_backend.forms import base

    monkeypatch.setattr(base, "arch_of", lambda device: "sm90")
    monkeypatch.setattr(base, "conv_allows_tf32", lambda: True)
    monkeypatch.setattr(timings, "example_shape", lambda v: tuple(v.shape))
    return base


def test_the_in_kernel_conv_row_applies_where_the_in_kernel_conv_covers_the_chain(sm90, monkeypatch):
    import cuda_templates
    from fusion_backend.forms import conv_implicit

    form = conv_implicit.ConvImplicit()
    assert form.candidate(_conv_chain()) == ("bfloat16", (2, 64, 64, 64), (128, 64, 3, 3), False)
    assert form.candidate(_conv_chain("float32")) == ("float32", (2, 64, 64, 64), (128, 64, 3, 3), True)
    assert form.candidate(_conv_chain(cin=8, cout=32, hw=256)) is None  # the direct conv takes it (workload 5)
    # 12 bf16 input channels: x's pixels padded to 16 (conv_sm90.PAD_PIXELS), else not covered
    monkeypatch.setattr(cuda_templates.conv_sm90, "PAD_PIXELS", True)
    assert form.candidate(_conv_chain(cin=12)) == ("bfloat16", (2, 12, 64, 64), (128, 12, 3, 3), False)
    monkeypatch.setattr(cuda_templates.conv_sm90, "PAD_PIXELS", False)
    assert form.candidate(_conv_chain(cin=12)) is None
    assert form.candidate(_conv_chain(device="cpu")) is None
    chain = _conv_chain()
    chain.spec = conv_layout.ConvLayout().apply(chain, None)  # channels-last: still a candidate
    found = form.candidate(chain)
    assert found is not None
    chain.spec = form.apply(chain, found)
    assert chain.spec.anchor.implicit and not chain.spec.anchor.channels_last and form.applied(chain.spec)
    assert form.candidate(chain) is None  # taken once
    monkeypatch.setattr(sm90, "conv_allows_tf32", lambda: False)
    assert form.candidate(_conv_chain("float32")) is None  # exact float32: cuDNN's
    monkeypatch.setattr(sm90, "arch_of", lambda device: "sm80")
    assert form.candidate(_conv_chain()) is None


def test_the_recompute_row_applies_to_an_in_kernel_conv_whose_tiles_take_a_norms_statistics(sm90, monkeypatch):
    import cuda_templates
    from fusion_backend.forms import conv_recompute

    from fusion_backend.forms import conv_implicit

    form, implicit = conv_recompute.ConvRecompute(), conv_implicit.ConvImplicit()
    chain = _conv_chain()
    chain.spec = implicit.apply(chain, None)
    assert form.candidate(chain) is None  # a pointwise chain: nothing to recompute
    chain = _conv_chain(norm=True)
    assert form.candidate(chain) is None  # the library conv
    chain.spec = implicit.apply(chain, None)
    found = form.candidate(chain)
    assert found == ("bfloat16", (2, 64, 64, 64), (128, 64, 3, 3), False)
    assert "norm recomputed" in form.describe(found)
    chain.spec = form.apply(chain, found)
    assert form.applied(chain.spec) and form.candidate(chain) is None  # taken once
    plan = cuda_templates.conv_gemm_plan(chain.spec, "sm90")
    assert plan.recompute and plan.stats and "_rc_" in plan.name(chain.spec, "sm90")
    # Under "auto" both rows are taken for the chain's timing, the second from the first's spec;
    # unset, the recompute's row is off.
    monkeypatch.setattr(_form("conv_layout"), "candidate", lambda chain: None)
    chain = _conv_chain(norm=True)
    rows = forms.choose(chain, load_config({"FUSEDEPI_CONV_RECOMPUTE": "auto"}))
    assert [(r.form, r.taken, r.by_chain) for r in rows] == [("in_kernel_conv", True, True),
                                                             ("conv_recompute", True, True)]
    assert rows[1].alternative.anchor.implicit and not rows[1].alternative.anchor.recompute
    assert chain.spec.anchor.recompute
    for unset_or_off in ({}, {"FUSEDEPI_CONV_RECOMPUTE": "0"}):
        chain = _conv_chain(norm=True)
        rows = forms.choose(chain, load_config(unset_or_off))
        assert [r.form for r in rows] == ["in_kernel_conv"] and not chain.spec.anchor.recompute


def test_an_untimed_chain_drops_the_in_kernel_conv_and_the_recompute_taken_from_it(sm90, monkeypatch):
    """Both by-chain rows go back where nothing timed the chain: the in-kernel conv's
    return takes the recompute row's with it; that row is not returned a second time
    (which would build the in-kernel conv's spec again)."""
    from fusion_backend import rewrite
    monkeypatch.setattr(_form("conv_layout"), "candidate", lambda chain: None)
    chain = _conv_chain(norm=True)
    plain = chain.spec
    rows = forms.choose(chain, load_config({"FUSEDEPI_CONV_RECOMPUTE": "auto"}))
    built = []
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: built.append(spec) or "kernel")
    untimed = Choice(0.0, 0.0, True, "not timed: a size without a hint")
    plan = rewrite._without_forms(chain, ExecutionPlan(chain.spec.to_json(), "kernel", rows, untimed),
                                  load_config({}), frozenset())
    assert chain.spec == plain and plan.spec == plain.to_json() and built == [plain.to_json()]
    assert [r.describe() for r in plan.forms] == ["in_kernel_conv: not taken (the chain not timed)",
                                                  "conv_recompute: not taken (the chain not timed)"]


def test_a_conv_chain_takes_channels_last_then_the_in_kernel_conv_for_the_chains_timing(
        sm90, monkeypatch, fresh_cache):
    """Under "auto" the layout row is timed by its library call and the in-kernel conv's
    row is taken untimed, starting from the spec the layout row left; with nothing to
    time the chain it is not taken, and FUSEDEPI_IN_KERNEL_CONV=0 leaves it out."""
    monkeypatch.setattr(_form("conv_layout"), "candidate", lambda chain: _chain("conv_layout")[1])
    monkeypatch.setattr(_form("conv_layout"), "measure", lambda found, device: (0.5, 0.3))
    monkeypatch.setattr(_form("in_kernel_conv"), "measure", lambda found, device: pytest.fail("timed"))
    chain = _conv_chain()
    plain = chain.spec
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache)}))
    assert [(r.form, r.taken, r.by_chain) for r in rows] == [("conv_layout", True, False),
                                                             ("in_kernel_conv", True, True)]
    assert rows[0].alternative == plain and rows[1].alternative.anchor.channels_last
    assert chain.spec.anchor.implicit and not chain.spec.anchor.channels_last
    chain = _conv_chain()
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), "FUSEDEPI_AUTOTUNE": "0"}))
    assert [r.form for r in rows] == ["conv_layout"] and not chain.spec.anchor.implicit
    chain = _conv_chain()
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), "FUSEDEPI_IN_KERNEL_CONV": "0"}))
    assert [r.form for r in rows] == ["conv_layout"] and not chain.spec.anchor.implicit


def _conv_forms_taken():
    """A stand-in conv chain as `forms.choose` leaves it where channels-last was taken by
    its library call and the in-kernel conv for the chain's timing: (chain, (the spec in
    the graph's layout, channels-last, the in-kernel conv), the two rows)."""
    from fusion_backend.forms import conv_implicit

    chain = _conv_chain()
    plain = chain.spec
    chain.spec = last = conv_layout.ConvLayout().apply(chain, None)
    chain.spec = implicit = conv_implicit.ConvImplicit().apply(chain, None)
    rows = (forms.FormChoice("conv_layout", "channels-last", 0.5, 0.3, True, alternative=plain),
            forms.FormChoice("in_kernel_conv", "in-kernel", 0.0, 0.0, True, alternative=last, by_chain=True))
    return chain, (plain, last, implicit), rows


@pytest.mark.parametrize("winner", ["implicit", "channels_last", "plain"])
def test_the_chain_is_timed_in_each_form_two_rows_took_and_the_fastest_kept(monkeypatch, winner):
    """A conv chain with channels-last taken by its library call and the in-kernel conv
    taken for the chain's timing: three fused forms are timed and the fastest runs; each
    row says the times with and without its form, and is taken where the plan holds it."""
    from fusion_backend import rewrite

    chain, (plain, last, implicit), rows = _conv_forms_taken()
    ms = {"implicit": 0.2, "channels_last": 0.3, "plain": 0.4}
    ms[winner] = 0.1
    by_spec = {implicit.to_json(): "implicit", last.to_json(): "channels_last", plain.to_json(): "plain"}
    timed = []

    def decide(chain_, spec, cfg, claimed):
        assert chain_.spec.to_json() == spec
        timed.append(by_spec[spec])
        return Choice(ms[by_spec[spec]], 0.35, True)

    monkeypatch.setattr(rewrite.choice, "decide", decide)
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: "kernel " + by_spec[spec])
    plan = rewrite._without_forms(chain, ExecutionPlan(implicit.to_json(), "kernel implicit", rows,
                                                       Choice(ms["implicit"], 0.35, True)), load_config({}), frozenset())
    assert timed == ["plain", "channels_last"]  # each once; the plan's own spec was timed already
    assert plan.kernel == f"kernel {winner}" and by_spec[plan.spec] == winner and chain.spec.to_json() == plan.spec
    assert plan.choice.fused_ms == 0.1
    assert [r.taken for r in plan.forms] == [winner == "channels_last", winner == "implicit"]
    assert all(r.alternative is None for r in plan.forms)
    text = plan.describe()
    assert (f"conv_layout: {'taken' if winner == 'channels_last' else 'not taken'} (0.3 ms against 0.5 ms; "
            f"the chain {ms['channels_last']:.4g} ms in it, {ms['plain']:.4g} ms without)") in text
    assert (f"in_kernel_conv: {'taken' if winner == 'implicit' else 'not taken'} "
            f"(the chain {ms['implicit']:.4g} ms in it, {ms['channels_last']:.4g} ms without)") in text


def test_a_form_whose_result_differs_is_never_the_fastest(monkeypatch):
    from fusion_backend import rewrite
    from fusion_backend.forms import conv_implicit

    chain = _conv_chain()
    plain = chain.spec
    chain.spec = implicit = conv_implicit.ConvImplicit().apply(chain, None)
    row = forms.FormChoice("in_kernel_conv", "in-kernel", 0.0, 0.0, True, alternative=plain, by_chain=True)
    monkeypatch.setattr(rewrite.choice, "decide", lambda chain_, spec, cfg, claimed: Choice(0.4, 0.35, False))
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: "kernel")
    differs = Choice(0.1, 0.35, False, difference=0.3)
    plan = rewrite._without_forms(chain, ExecutionPlan(implicit.to_json(), "kernel", (row,), differs),
                                  load_config({}), frozenset())
    assert chain.spec == plain and plan.choice.fused_ms == 0.4 and not plan.forms[0].taken


def test_an_untimed_conv_chain_keeps_channels_last_and_drops_the_in_kernel_conv(monkeypatch):
    """Not timed after all (a size without a hint): the row taken for the chain's timing
    goes back to the spec it started from, the layout its library call chose."""
    from fusion_backend import rewrite

    chain, (plain, last, implicit), rows = _conv_forms_taken()
    monkeypatch.setattr(rewrite.choice, "decide", lambda *args: pytest.fail("timed"))
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: "kernel")
    untimed = Choice(0.0, 0.0, True, "not timed: a size without a hint")
    plan = rewrite._without_forms(chain, ExecutionPlan(implicit.to_json(), "kernel", rows, untimed),
                                  load_config({}), frozenset())
    assert chain.spec == last and plan.spec == last.to_json() and plan.fused
    assert [r.taken for r in plan.forms] == [True, False]
    assert plan.forms[1].describe() == "in_kernel_conv: not taken (the chain not timed)"


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_form_taken_for_the_timing_whose_kernel_fails_to_build_gives_way(monkeypatch, strict):
    """The in-kernel conv's kernel fails to build (nvcc): the chain is built in the spec
    the layout row left, the row not taken with the reason; under strict mode it raises."""
    from cuda_templates.compiler import CompileError
    from fusion_backend import rewrite

    chain, (plain, last, implicit), rows = _conv_forms_taken()
    built = []

    def prepare(chain_, spec, cfg):
        built.append(chain_.spec)
        if chain_.spec.anchor.implicit:
            raise CompileError("nvcc failed\nline 2")
        return "kernel"

    monkeypatch.setattr(rewrite, "_prepare", prepare)
    cfg = load_config({"FUSEDEPI_STRICT": strict})
    if strict == "1":
        with pytest.raises(CompileError):
            rewrite._prepare_taken(chain, rows, cfg)
        return
    kernel, got = rewrite._prepare_taken(chain, rows, cfg)
    assert kernel == "kernel" and built == [implicit, last] and chain.spec == last
    assert got[0] is rows[0] and not got[1].taken and got[1].alternative is None
    assert got[1].describe() == "in_kernel_conv: not taken (its kernel failed to build: nvcc failed)"


def test_the_library_conv_row_applies_where_the_direct_conv_would_compute_the_conv(sm90):
    import cuda_templates
    from fusion_backend.forms import conv_library

    form = conv_library.ConvLibrary()
    chain = _conv_chain(cin=8, cout=32, hw=256)  # workload 5's conv: the direct conv's
    found = form.candidate(chain)
    assert found == ("bfloat16", (2, 8, 256, 256), (32, 8, 3, 3), False)
    assert "instead of the direct conv" in form.describe(found)
    assert form.candidate(_conv_chain()) is None  # 64 -> 128: the in-kernel conv's or the library's
    assert form.candidate(_conv_chain(cin=8, cout=32, hw=256, device="cpu")) is None
    chain.spec = form.apply(chain, found)
    assert chain.spec.anchor.library and form.applied(chain.spec) and chain.spec.anchor.direct
    assert form.candidate(chain) is None  # taken once
    # The library conv computes it now: no kernel of the file does; the in-kernel conv's
    # spec is the file's again (and there the direct conv covers it).
    assert isinstance(cuda_templates.direct_plan(chain.spec, "sm90"), str)
    assert cuda_templates.anchor_plan(chain.spec, "sm90") is None
    assert not chain.spec.with_in_kernel_conv().anchor.library
    assert EpilogueSpec.from_json(chain.spec.to_json()) == chain.spec


def test_a_direct_conv_chain_takes_the_library_conv_for_the_chains_timing(sm90, monkeypatch, fresh_cache):
    """Under "auto" the library conv's row is taken untimed where the chain will be timed,
    and the in-kernel conv's row does not apply to it (the direct conv covers the conv);
    with nothing to time the chain, or FUSEDEPI_LIBRARY_CONV=0, the direct conv stays;
    FUSEDEPI_LIBRARY_CONV=1 takes the library conv untimed."""
    monkeypatch.setattr(_form("library_conv"), "measure", lambda found, device: pytest.fail("timed"))
    monkeypatch.setattr(_form("conv_layout"), "candidate", lambda chain: None)  # (its own row, tested above)
    chain = _conv_chain(cin=8, cout=32, hw=256)
    direct = chain.spec
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache)}))
    assert [(r.form, r.taken, r.by_chain) for r in rows] == [("library_conv", True, True)]
    assert rows[0].alternative == direct and chain.spec.anchor.library
    for env in ({"FUSEDEPI_AUTOTUNE": "0"}, {"FUSEDEPI_LIBRARY_CONV": "0"}):
        chain = _conv_chain(cin=8, cout=32, hw=256)
        assert forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), **env})) == ()
        assert chain.spec == direct
    chain = _conv_chain(cin=8, cout=32, hw=256)
    rows = forms.choose(chain, load_config({"FUSEDEPI_CACHE_DIR": str(fresh_cache), "FUSEDEPI_LIBRARY_CONV": "1"}))
    assert [r.form for r in rows] == ["library_conv"] and chain.spec.anchor.library


def _library_forms_taken():
    """A stand-in direct-conv chain as `forms.choose` leaves it where the library conv was
    taken for the chain's timing and channels-last by its library call: (chain, (the
    direct conv's spec, the library conv's, channels-last), the two rows)."""
    from fusion_backend.forms import conv_library

    chain = _conv_chain(cin=8, cout=32, hw=256)
    direct = chain.spec
    chain.spec = library = conv_library.ConvLibrary().apply(chain, None)
    chain.spec = last = conv_layout.ConvLayout().apply(chain, None)
    rows = (forms.FormChoice("library_conv", "library", 0.0, 0.0, True, alternative=direct, by_chain=True),
            forms.FormChoice("conv_layout", "channels-last", 0.5, 0.3, True, alternative=library))
    return chain, (direct, library, last), rows


@pytest.mark.parametrize("winner", ["direct", "library", "channels_last"])
def test_the_direct_conv_the_library_conv_and_its_layout_are_timed_and_the_fastest_kept(
        sm90, monkeypatch, winner):
    from fusion_backend import rewrite

    chain, (direct, library, last), rows = _library_forms_taken()
    ms = {"direct": 0.3, "library": 0.4, "channels_last": 0.35}
    ms[winner] = 0.1
    by_spec = {direct.to_json(): "direct", library.to_json(): "library", last.to_json(): "channels_last"}
    monkeypatch.setattr(rewrite.choice, "decide",
                        lambda chain_, spec, cfg, claimed: Choice(ms[by_spec[spec]], 0.35, True))
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: "kernel " + by_spec[spec])
    plan = rewrite._without_forms(chain, ExecutionPlan(last.to_json(), "kernel channels_last", rows,
                                                       Choice(ms["channels_last"], 0.35, True)), load_config({}),
                                  frozenset())
    assert by_spec[plan.spec] == winner and plan.choice.fused_ms == 0.1
    assert [r.taken for r in plan.forms] == [winner != "direct", winner == "channels_last"]
    assert (f"library_conv: {'not taken' if winner == 'direct' else 'taken'} (the chain "
            f"{ms['library']:.4g} ms in it, {ms['direct']:.4g} ms without)") in plan.describe()


def test_an_untimed_chain_goes_back_to_the_direct_conv_and_drops_the_layout_taken_after(sm90, monkeypatch):
    from fusion_backend import rewrite

    chain, (direct, library, last), rows = _library_forms_taken()
    monkeypatch.setattr(rewrite.choice, "decide", lambda *args: pytest.fail("timed"))
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: "kernel")
    untimed = Choice(0.0, 0.0, True, "not timed: a size without a hint")
    plan = rewrite._without_forms(chain, ExecutionPlan(last.to_json(), "kernel", rows, untimed), load_config({}),
                                  frozenset())
    assert chain.spec == direct and plan.spec == direct.to_json()
    assert [r.taken for r in plan.forms] == [False, False]
    assert [r.describe() for r in plan.forms] == ["library_conv: not taken (the chain not timed)",
                                                  "conv_layout: not taken (0.3 ms against 0.5 ms; the chain not timed)"]


def test_a_form_whose_timing_failed_says_so_not_zero(monkeypatch):
    """The chain without a form could not be timed (`choice.decide`'s untimed Choice): the
    row says why, not "0 ms", and the timed form stays."""
    from fusion_backend import rewrite
    from fusion_backend.forms import conv_implicit

    chain = _conv_chain()
    plain = chain.spec
    chain.spec = implicit = conv_implicit.ConvImplicit().apply(chain, None)
    row = forms.FormChoice("in_kernel_conv", "in-kernel", 0.0, 0.0, True, alternative=plain, by_chain=True)
    monkeypatch.setattr(rewrite.choice, "decide",
                        lambda chain_, spec, cfg, claimed: Choice(0.0, 0.0, True, "not timed: RuntimeError"))
    monkeypatch.setattr(rewrite, "_prepare", lambda chain_, spec, cfg: "kernel")
    plan = rewrite._without_forms(chain, ExecutionPlan(implicit.to_json(), "kernel", (row,), Choice(0.05, 0.07, True)),
                                  load_config({}), frozenset())
    assert chain.spec == implicit and plan.forms[0].taken
    assert plan.forms[0].describe() == ("in_kernel_conv: taken (the chain in it: 0.05 ms; without it: "
                                          "not timed: RuntimeError)")
