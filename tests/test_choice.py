"""GPU-free: the measured choice (fusion_backend/choice.py) on CPU graphs.

Under FUSEDEPI_AUTOTUNE=on a CPU chain's fused op (its plain-torch reference) is timed
against Inductor's CPU compile of the same subgraph, which exercises everything but the
GPU: the subgraph, its inputs, the nested compile, the cache and the decision.
"""

import json

import pytest
import torch
import torch.nn as nn

from fusion_backend import choice, timings
from fusion_backend.backend import collect_reports
from fusion_backend.config import load_config
from helpers import compile_records

pytestmark = pytest.mark.usefixtures("cpu_reference")


@pytest.fixture
def timed(monkeypatch, tmp_path):
    monkeypatch.setenv("FUSEDEPI_AUTOTUNE", "on")
    monkeypatch.setenv("FUSEDEPI_CACHE_DIR", str(tmp_path))
    return tmp_path


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.GELU())


def _forced(monkeypatch, fused_ms, inductor_ms, difference=0.0, graph=(1.0, 2.0, 0.1, 0.1)):
    """Forces the chains' times (and `graph`, the whole graph's: fused, Inductor's, on the
    GPU and then the CPU's launches: `choice.GraphTimes`);
    returns the list of what was measured, anchors' names and "graph"."""
    calls = []

    def measure(chain, inductor_form, fused_form, vals, shapes, device, centered):
        calls.append(chain.anchor.name)
        return fused_ms, inductor_ms, difference

    def measure_graphs(ours, theirs, example_inputs, device, cuda_graphs=False):
        calls.append("graph")
        return graph

    monkeypatch.setattr(choice, "_measure", measure)
    monkeypatch.setattr(choice, "_measure_graphs", measure_graphs)
    return calls


@pytest.mark.parametrize("fused_ms, inductor_ms, why", [
    (1.0, 2.0, None), (0.99, 1.0, None),  # faster by 1% or more: fused
    (0.995, 1.0, "not 1% faster than Inductor here: fused 0.995 ms"), (1.0, 1.0, "not 1% faster than Inductor here"),
    (2.0, 1.0, "Inductor is faster here: fused 2 ms, Inductor 1 ms")])
def test_a_chain_is_fused_only_where_it_is_faster(timed, monkeypatch, fused_ms, inductor_ms, why):
    """A chain's fused op is kept where it takes at most `choice.WIN` (99%) of Inductor's
    time: a tie, or a gain within the timings' spread, leaves the chain to Inductor."""
    _forced(monkeypatch, fused_ms, inductor_ms)
    model, x = _model(), torch.randn(8, 16)
    out, fused, refused = compile_records(model, x, grad=False)
    fuses = why is None
    records = fused if fuses else refused
    assert len(records) == 1 and f"Inductor {inductor_ms:.4g} ms" in records[0].measured
    if not fuses:
        assert records[0].reason.startswith(why)
    assert len(fused) == int(fuses)
    torch.testing.assert_close(out, _model()(x))


@pytest.mark.parametrize("fused_ms, inductor_ms", [(1.0, 2.0), (2.0, 1.0)])
def test_the_plan_names_the_forms_the_chain_was_timed_in(timed, monkeypatch, fused_ms, inductor_ms):
    """A form taken before the choice (here forced: the float32 bias in the epilogue) is
    part of what was timed: explain's text and a refusal's reason say so."""
    monkeypatch.setenv("FUSEDEPI_FOLD_GEMM_BIAS", "1")
    _forced(monkeypatch, fused_ms, inductor_ms)
    out, fused, refused = compile_records(_model(), torch.randn(8, 16), grad=False)
    (record,) = fused or refused
    assert record.plan.forms[0].form == "gemm_bias" and record.plan.forms[0].taken
    graph = "; whole graph: fused 1 ms, Inductor 2 ms" if fused else ""  # timed where the chain stays fused
    assert record.measured == (f"gemm_bias: taken (FUSEDEPI_FOLD_GEMM_BIAS=1); fused {fused_ms:.4g} ms, "
                               f"Inductor {inductor_ms:.4g} ms{graph}")
    if refused:
        assert record.reason == ("Inductor is faster here: fused 2 ms, Inductor 1 ms; "
                                 "gemm_bias: taken (FUSEDEPI_FOLD_GEMM_BIAS=1)")
    else:
        assert '"kind":"mm"' in record.spec  # the spec the kernel runs is the form's


def test_the_choice_is_cached_on_disk_and_not_measured_again(timed, monkeypatch):
    calls = _forced(monkeypatch, 1.0, 2.0)
    model, x = _model(), torch.randn(8, 16)
    compile_records(model, x)
    assert calls == ["addmm", "graph"]
    stored = json.loads((timed / timings.CACHE_FILE).read_text())
    assert sorted(stored.values()) == [[1.0, 2.0, 0.0], [1.0, 2.0, 0.1, 0.1]]
    choice.timings._cache.clear()  # as a new process: only the file is left
    choice.timings._read_files.clear()
    _, fused, _ = compile_records(model, x)
    assert calls == ["addmm", "graph"] and len(fused) == 1


@pytest.mark.parametrize("graph, fuses", [((0.9, 1.0, 0.1, 0.1), True), ((1.0, 1.0, 0.1, 0.1), False),
                                          ((2.0, 1.0, 0.1, 0.1), False)])
def test_a_graph_slower_as_a_whole_runs_as_inductor_compiles_it(timed, monkeypatch, graph, fuses):
    """Each chain wins on its own (1 ms against 2), but where the graph with its fused ops
    is slower than Inductor's compile of the whole graph, Inductor's runs: the fused op is
    never called, and the chain's record says why, with both graphs' times."""
    from fusion_backend import ops

    calls = _forced(monkeypatch, 1.0, 2.0, graph=graph)
    model, x = _model().eval(), torch.randn(8, 16)
    torch._dynamo.reset()
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        compiled = torch.compile(model, backend="fusedepi")
        compiled(x)
    (record,) = [r for report in reports for r in report.records]
    assert calls == ["addmm", "graph"]
    ran = []
    right = ops.reference
    monkeypatch.setattr(ops, "reference", lambda inputs, spec: ran.append(spec) or right(inputs, spec))
    with torch.no_grad():
        out = compiled(x)
    torch.testing.assert_close(out, _model().eval()(x))
    assert (record.status == "fused") == fuses and bool(ran) == fuses
    # The chain's own times, then the whole graph's, in explain's "measured" text.
    assert record.measured == f"fused 1 ms, Inductor 2 ms; whole graph: fused {graph[0]:.4g} ms, Inductor 1 ms"
    if not fuses:  # slower, or a tie: not faster by `choice.WIN`'s 1%
        slower = "slower than" if graph[0] > 1.0 else "not 1% faster than"
        assert record.reason == (f"the graph with its fused ops is {slower} Inductor's: {graph[0]:.4g} ms against 1 ms "
                                 "a call for the whole graph, which Inductor then compiles as it stands")



@pytest.mark.parametrize("graph, fuses", [
    ((1.0, 2.0, 3.0, 1.0), False),  # faster on the GPU, but its launches take 3 ms a call
    ((1.0, 2.0, 1.5, 1.0), True),   # its launches longer than its GPU time, still within Inductor's 2 ms
    ((1.0, 2.0, 1.95, 1.0), True),  # a call 2.5% faster, within the host's spread (3%), but half the GPU time
    ((1.99, 2.0, 1.0, 2.05), False),  # 0.5% less GPU time, a call 3% faster: no win by either margin ...
    ((1.99, 2.0, 1.0, 2.3), True),    # ... a call 13% faster
    ((2.5, 2.0, 1.0, 3.0), False),  # faster a call (2.5 against 3 ms) at the pace of Inductor's launches, but
                                    # more GPU time: inside a larger graph it would be slower
    ((2.02, 2.0, 1.0, 3.0), True),  # more GPU time by 1%: within the GPU timings' spread (`choice.WIN`)
])
def test_a_graph_is_timed_at_the_pace_of_its_launches_where_they_take_longer(timed, monkeypatch, graph, fuses):
    """A call in a loop takes its GPU time or the CPU's time to launch it, whichever is
    longer; inside a larger graph, its GPU time. Where the CPU's launches set the pace,
    the graph with its fused ops is kept where it loses on neither measure beyond its
    spread and wins on one by its margin; the record says which time decided."""
    _forced(monkeypatch, 1.0, 2.0, graph=graph)
    out, fused, refused = compile_records(_model().eval(), torch.randn(8, 16), grad=False)
    (record,) = fused or refused
    assert (record.status == "fused") == fuses
    gpu, theirs, cpu_ours, cpu_theirs = graph
    ours_call, theirs_call = max(gpu, cpu_ours), max(theirs, cpu_theirs)
    cpu = f"(GPU {gpu:.4g} against {theirs:.4g} ms, the CPU's launches {cpu_ours:.4g} against {cpu_theirs:.4g} ms)"
    assert record.measured == f"fused 1 ms, Inductor 2 ms; whole graph: fused {ours_call:.4g} ms, " \
                              f"Inductor {theirs_call:.4g} ms a call {cpu}"
    tail = "which Inductor then compiles as it stands"
    if fuses:
        return
    if gpu * choice.WIN > theirs:
        assert record.reason == (f"the graph with its fused ops takes more GPU time than Inductor's: {gpu:.4g} ms "
                                 f"against {theirs:.4g} ms for the whole graph (a call {ours_call:.4g} against "
                                 f"{theirs_call:.4g} ms, the CPU's launches {cpu_ours:.4g} against {cpu_theirs:.4g} "
                                 f"ms), {tail}")
    elif ours_call * choice.WIN_HOST > theirs_call:
        assert record.reason == (f"the graph with its fused ops is slower than Inductor's: {ours_call:.4g} ms against "
                                 f"{theirs_call:.4g} ms a call for the whole graph {cpu}, {tail}")
    else:
        assert record.reason == (f"the graph with its fused ops is not faster than Inductor's by 3% a call or 1% of "
                                 f"GPU time: {ours_call:.4g} ms against {theirs_call:.4g} ms a call for the whole "
                                 f"graph {cpu}, {tail}")


@pytest.mark.parametrize("times, kept", [
    # bf16 convtranspose3d_residual of the zoo (H100): its launches 0.089 ms against Inductor's
    # 0.070 and 0.092 ms of GPU time; in a loop a call took 0.135 against 0.116 ms
    ((0.0804, 0.0923, 0.0891, 0.0697), False),
    # float32 conv3d_scale_sigmoid_bias (H100): 0.1505 ms of launches, Inductor's 0.153 ms of
    # GPU time; in a loop 0.174-0.207 against 0.157 ms
    ((0.1228, 0.1532, 0.1505, 0.0738), False),
    # bf16 conv3d_scale_sigmoid_bias (H100): the caller's time still inside Inductor's GPU time;
    # in a loop 0.171 against 0.241 ms
    ((0.1109, 0.2334, 0.1154, 0.0923), True),
    # both graphs paced by their launches: the caller's time adds to both
    ((0.0270, 0.0329, 0.1240, 0.2202), True),
    # bf16 convnext_stem_layernorm2d (H100): launches 0.0968 against 0.0909 ms, Inductor's
    # GPU time 0.1252 ms; in a loop 0.195 against 0.172 ms (kept where the caller's part was 0.03)
    ((0.1152, 0.1252, 0.0968, 0.0909), False),
])
def test_the_callers_time_adds_to_a_graph_paced_by_its_launches(times, kept):
    """A call in a user's loop spends `choice.CALLER_MS` outside the compiled graph. It
    adds in full to a graph whose launches set its pace and not to one whose GPU time is
    longer still: a fused graph whose launches merely tie Inductor's GPU time loses in a
    loop. Without it (`caller_ms` 0: the CPU, where times are wall times) the first two
    were kept."""
    on_gpu = choice.GraphTimes(*times, caller_ms=choice.CALLER_MS)
    assert (on_gpu.refusal() is None) == kept
    assert choice.GraphTimes(*times).refusal() is None
    assert on_gpu.fused_call == pytest.approx(max(times[0], times[2] + choice.CALLER_MS))
    assert on_gpu.inductor_call == pytest.approx(max(times[1], times[3] + choice.CALLER_MS))
    if not kept:
        assert on_gpu.refusal().endswith(f"ms, and {choice.CALLER_MS:.4g} ms of the caller's)")


def test_a_graph_paced_by_the_gpu_still_shows_its_launches_on_a_gpu():
    """Where the GPU's time sets both graphs' pace, the record still gives the launches
    on a GPU (where a loop's call is slower anyway, they show by how much they were
    short); on the CPU they are the wall times already given."""
    times = (0.1152, 0.1234, 0.0700, 0.0800)  # GPU times of bf16 convnext_stem_layernorm2d (H100); launches set here
    on_gpu = choice.GraphTimes(*times, caller_ms=choice.CALLER_MS)
    assert not on_gpu.cpu_decides and on_gpu.refusal() is None
    assert on_gpu.describe() == ("fused 0.1152 ms, Inductor 0.1234 ms (the CPU's launches 0.07 against 0.08 ms, "
                                 f"and {choice.CALLER_MS:.4g} ms of the caller's)")
    assert choice.GraphTimes(*times).describe() == "fused 0.1152 ms, Inductor 0.1234 ms"


def test_timings_on_one_gpu_share_a_lock_named_by_its_uuid(monkeypatch):
    """`timings.gpu_lock_path`: one lock file a GPU, named by its UUID (two GPUs of one
    model get two locks), by its name where torch gives no UUID."""
    from types import SimpleNamespace

    props = {0: SimpleNamespace(uuid="GPU-aaaa", name="NVIDIA H200"), 1: SimpleNamespace(uuid="GPU-bbbb",
                                                                                       name="NVIDIA H200"),
             2: SimpleNamespace(name="NVIDIA H200")}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props[device.index])
    paths = [timings.gpu_lock_path(torch.device("cuda", i)) for i in range(3)]
    assert [p.name for p in paths] == ["fusedepi-timing-GPU-aaaa.lock", "fusedepi-timing-GPU-bbbb.lock",
                                       "fusedepi-timing-NVIDIA_H200.lock"]


def test_a_timing_inside_another_on_one_thread_takes_the_gpu_lock_once(monkeypatch, tmp_path):
    """`timings.gpu_lock` nested on one thread does not wait for itself; another thread
    waits until the outer one ends."""
    import threading
    import time as _time

    monkeypatch.setattr(timings, "gpu_lock_path", lambda device: tmp_path / "gpu.lock")
    device = torch.device("cuda", 0)
    order = []

    def other():
        with timings.gpu_lock(device):
            order.append("other")

    with timings.gpu_lock(device):
        with timings.gpu_lock(device):  # returns at once
            order.append("inner")
        thread = threading.Thread(target=other)
        thread.start()
        _time.sleep(0.2)
        order.append("outer ends")
    thread.join(timeout=10)
    assert order == ["inner", "outer ends", "other"]


def test_host_ms_times_the_cpus_share_of_a_call():
    """`timings.host_ms`: each function's time a call on the host, in turns; a function that
    holds the host 2 ms a call reads at least that, one that returns at once far less."""
    import time as _time

    slow, fast = timings.host_ms([lambda: _time.sleep(0.002), lambda: None], torch.device("cpu"), calls=3, rounds=2)
    assert slow >= 2.0 and fast < 0.5


def _two_chains():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 24), nn.Sigmoid())


@pytest.mark.parametrize("graphs, fused_anchor", [
    ([(2.0, 1.0, 0.1, 0.1), (0.5, 1.0, 0.1, 0.1)], "addmm"),    # without the chain that gained least, the graph wins
    ([(2.0, 1.0, 0.1, 0.1), (1.5, 1.0, 0.1, 0.1)], None),       # slower either way: Inductor's graph
])
def test_a_graph_slower_as_a_whole_is_tried_without_its_weakest_chain(timed, monkeypatch, graphs, fused_anchor):
    """Two chains, each faster alone (the second by less), the graph with both slower than
    Inductor's: it is compiled and timed again without the chain that gained least, which
    goes to Inductor with the reason; one report a graph, as explain reads it."""
    from fusion_backend import backend

    times = {"addmm": (1.0, 3.0), "addmm_1": (1.0, 1.5)}  # the second chain gains least
    calls = []

    def measure(chain, inductor_form, fused_form, vals, shapes, device, centered):
        calls.append(chain.anchor.name)
        return times[chain.anchor.name] + (0.0,)

    def measure_graphs(ours, theirs, example_inputs, device, cuda_graphs=False):
        calls.append("graph")
        return graphs[calls.count("graph") - 1]

    monkeypatch.setattr(choice, "_measure", measure)
    monkeypatch.setattr(choice, "_measure_graphs", measure_graphs)
    model, x = _two_chains().eval(), torch.randn(8, 16)
    torch._dynamo.reset()
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        out = torch.compile(model, backend="fusedepi")(x)
    torch.testing.assert_close(out, _two_chains().eval()(x))
    assert len(reports) == 1
    records = {r.anchor: r for r in reports[0].records}
    assert set(records) == {"addmm", "addmm_1"}
    # Both chains timed once (the second compile reads addmm's time from the cache), the
    # graph twice: with both, and without addmm_1.
    assert calls == ["addmm", "addmm_1", "graph", "graph"]
    assert records["addmm_1"].status == "refused"
    assert records["addmm_1"].reason.startswith("left to Inductor after the whole graph was timed with it: the "
                                                "graph with its fused ops is slower than Inductor's: 2 ms against 1 ms")
    assert [a for a, r in records.items() if r.status == "fused"] == ([fused_anchor] if fused_anchor else [])
    if fused_anchor is None:
        assert records["addmm"].reason.startswith("the graph with its fused ops is slower than Inductor's: 1.5 ms")


def test_a_fused_result_that_differs_from_inductors_is_not_taken(timed, monkeypatch, caplog):
    """A fused op that computes something else than Inductor's form of the same nodes (here
    its reference made wrong by half) is left to Inductor, however fast; the reason says
    by how much, and a warning is logged."""
    from fusion_backend import ops

    right = ops.reference
    monkeypatch.setattr(ops, "reference", lambda inputs, spec: [t * 1.5 for t in right(inputs, spec)])
    model, x = _model().eval(), torch.randn(8, 16)
    with caplog.at_level("WARNING", logger="fusedepi"):
        out, fused, refused = compile_records(model, x)
    assert not fused and refused[0].reason.startswith("its result differs from Inductor's by 0.5 (relative")
    assert "is left to Inductor" in caplog.text
    torch.testing.assert_close(out, _model().eval()(x))


@pytest.mark.parametrize("centered, within", [(True, True), (False, False)])
def test_centered_operands_keep_a_rounding_of_the_product_from_looking_like_a_wrong_result(centered, within):
    """Two forms may round a conv's product differently (TF32, a bf16 output of another
    algorithm). After a normalization, operands in [0.5, 1.5) (a product of large mean,
    small spread) magnify that rounding up to the bound; operands centered on 0 do not."""
    torch.manual_seed(0)
    x = choice._random_like(torch.empty(8, 64, 18, 18), (8, 64, 18, 18), centered)
    w = choice._random_like(torch.empty(64, 64, 3, 3), (64, 64, 3, 3), centered)
    y = torch.nn.functional.conv2d(x, w)
    other = y * (1 + torch.randn_like(y) * 2**-12)  # a rounding of TF32's size
    chain = lambda t: torch.nn.functional.group_norm(t.bfloat16().float(), 8).bfloat16()  # noqa: E731
    assert (choice.difference([chain(y)], [chain(other)]) < choice.AGREEMENT / 5) == within


def test_the_difference_of_two_forms_results():
    a = torch.linspace(-1.0, 2.0, 12).view(3, 4)
    assert choice.difference([a], [a.clone()]) == 0.0
    assert choice.difference([a * 1.01, a], [a, a]) == pytest.approx(0.01)
    assert choice.difference([a.t().contiguous().view(3, 4)], [a]) > 0.5  # the same values elsewhere
    assert choice.difference([a[:2]], [a]) == float("inf")
    nan = a.clone()
    nan[0, 0] = float("nan")
    assert choice.difference([nan], [nan.clone()]) == 0.0  # NaN where both have it
    assert choice.difference([nan], [a]) == float("inf")  # one element of 12 finite in one only


def test_a_failed_timing_keeps_the_fused_op_with_the_reason(timed, monkeypatch):
    def fail(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(choice, "_measure", fail)
    monkeypatch.setattr(choice, "_measure_graphs", fail)  # and the whole graph's
    _, fused, _ = compile_records(_model(), torch.randn(8, 16))
    assert len(fused) == 1 and fused[0].measured == "not timed: RuntimeError"


def test_measuring_against_inductor_changes_no_state(timed):
    """A real measurement on the CPU: BatchNorm's running statistics, the RNG and the
    result are as eager leaves them, whichever form wins."""
    model, x = _model().train(), torch.randn(8, 16)
    reference = _model().train()
    state = torch.get_rng_state()
    out, fused, refused = compile_records(model, x, grad=False)
    assert torch.equal(torch.get_rng_state(), state)
    want = reference(x)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)
    (record,) = fused + refused
    assert record.measured.startswith("fused ") and "ms, Inductor" in record.measured


def test_measuring_the_whole_graph_changes_no_state(timed, monkeypatch):
    """The chain forced to win on its own, the whole graph measured for real (on the CPU):
    BatchNorm's running statistics, the RNG and the result are as eager leaves them,
    whichever graph runs."""
    monkeypatch.setattr(choice, "_measure", lambda *args: (1.0, 2.0, 0.0))
    measured = []
    real = choice._measure_graphs
    monkeypatch.setattr(choice, "_measure_graphs", lambda *args: measured.append(real(*args)) or measured[-1])
    model, x = _model().train(), torch.randn(8, 16)
    reference = _model().train()
    state = torch.get_rng_state()
    out, fused, refused = compile_records(model, x, grad=False)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(measured) == 1 and all(ms > 0 for ms in measured[0])
    torch.testing.assert_close(out, reference(x))
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    torch.testing.assert_close(model[1].running_var, reference[1].running_var)
    assert len(fused + refused) == 1


def test_the_whole_graph_is_timed_at_a_dynamic_sizes_hint(timed, monkeypatch):
    """With a dynamic batch, Dynamo hands the backend the size as a symbolic int among the
    inputs: the whole graph is timed with its hint there (a symbolic int passed on as
    it is would be read as a garbage size), and both sizes run right."""
    monkeypatch.setenv("FUSEDEPI_STRICT", "1")  # a failed timing raises
    monkeypatch.setattr(choice, "_measure", lambda *args: (1.0, 2.0, 0.0))
    measured = []
    real = choice._measure_graphs
    monkeypatch.setattr(choice, "_measure_graphs", lambda *args: measured.append(real(*args)) or measured[-1])
    model = _model().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusedepi", dynamic=True)
    with torch.no_grad():
        for batch in (8, 13):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(compiled(x), model(x))
    assert len(measured) == 1


class _ConvGroupNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.gn = nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8)

    def forward(self, x):
        return torch.relu(self.gn(self.conv(x)))


def test_a_chain_whose_neighbourhood_takes_a_dynamic_size_is_timed_at_its_hint(timed, monkeypatch):
    """GroupNorm's decomposition views the conv output by the batch: with a dynamic batch
    the chain's neighbourhood takes that size, a symbolic int, as an input, which the
    chain's own timing passes at its hint (measured for real, on the CPU)."""
    monkeypatch.setenv("FUSEDEPI_STRICT", "1")  # a failed timing raises
    measured = []
    real = choice._measure
    monkeypatch.setattr(choice, "_measure", lambda *args: measured.append(args[3:5]) or real(*args))
    torch.manual_seed(0)
    model = _ConvGroupNorm().eval()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fusedepi")
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, 3, 10, 12)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x))
    vals, shapes = measured[0]
    assert [s for v, s in zip(vals, shapes) if isinstance(v, torch.SymInt)] == [(2,)], shapes


class _SharedMix(nn.Module):
    """A weight shared by the batch, expanded (stride 0) into a bmm, then GroupNorm and SiLU."""

    def __init__(self):
        super().__init__()
        self.w, self.gn = nn.Parameter(torch.randn(8, 8)), nn.GroupNorm(2, 8)

    def forward(self, x):
        return torch.nn.functional.silu(self.gn(torch.bmm(self.w.expand(x.shape[0], -1, -1), x)))


def test_operands_whose_elements_share_memory_are_timed(timed):
    """The timing's random inputs keep each operand's strides, an expanded one's 0 too:
    they are filled through the memory the strides span, which a stride of 0 shares."""
    torch.manual_seed(0)
    model, x = _SharedMix(), torch.randn(3, 8, 20)
    out, fused, refused = compile_records(model, x)
    (record,) = fused + refused
    assert record.measured.startswith("fused ") and "ms, Inductor" in record.measured, record.measured
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_both_forms_compute_the_neighbourhood_as_the_whole_graph_does():
    """The chain with its consumers (here the sum of a value it also returns, and a
    tanh after it), cut out twice: as the graph has it, and with the fused op in place
    of the chain. Fed what the whole graph gives their inputs, both compute what the
    whole graph computes at the values read outside them; the next matmul is not in it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lowering import match_graph

    def f(x, w, b, residual, w2):
        y = torch.nn.functional.layer_norm(torch.nn.functional.linear(x, w, b), (32,))
        z = torch.tanh(torch.nn.functional.gelu(y + residual))
        return z @ w2, y.sum() * 2

    args = (torch.randn(8, 16), torch.randn(32, 16), torch.randn(32), torch.randn(8, 32), torch.randn(32, 4))
    gm = make_fx(f)(*args)
    chains, _ = match_graph(gm.graph, allow_cpu=True)
    (chain,) = chains
    after = choice.consumers(chain)
    assert torch.ops.aten.mm.default not in [n.target for n in after]
    assert {torch.ops.aten.sum.default, torch.ops.aten.mul.Tensor} <= {n.target for n in after}
    inductor_form, fused_form, inputs = choice.subgraphs(chain, chain.spec.to_json())
    assert torch.ops.fusedepi.chain.default in [n.target for n in fused_form.graph.nodes]
    values = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, n):
            values[n] = super().run_node(n)
            return values[n]

    Recording(gm).run(*args)
    want = [values[n] for n in choice._escaping(list(chain.nodes) + after)]
    for form in (inductor_form, fused_form):
        got = form(*(values[n] for n in inputs))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_the_fused_form_asks_the_layouts_the_rewrite_asks(monkeypatch):
    """A conv that runs channels-last: the fused form that the choice times asks Inductor
    for channels-last x and weight (`ops.input_layouts`), as the rewritten graph does, so
    that Inductor's copies are timed with the chain; the plain conv asks nothing. The ask
    reaches Inductor's inner compile, past AOTAutograd's trace of the form."""
    import torch._inductor.compile_fx as inductor_compile
    from dataclasses import replace

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from lowering import match_graph

    def f(x, w, b):
        return torch.relu(torch.nn.functional.conv2d(x, w, b))

    with FakeTensorMode():
        args = (torch.empty(2, 3, 9, 9), torch.empty(8, 3, 3, 3), torch.empty(8))
        gm = make_fx(f)(*args)
    (chain,) = match_graph(gm.graph, allow_cpu=True)[0]
    for channels_last in (False, True):
        chain.spec = replace(chain.spec, anchor=replace(chain.spec.anchor, channels_last=channels_last))
        _, fused_form, _ = choice.subgraphs(chain, chain.spec.to_json())
        (op,) = [n for n in fused_form.graph.nodes if n.target is torch.ops.fusedepi.chain.default]
        asked = op.meta.get("eager_input_vals")
        if not channels_last:
            assert asked is None
            continue
        (values, spec), kwargs = asked
        assert spec == chain.spec.to_json() and kwargs == {} and len(values) == len(op.args[0])
        assert values[0].is_contiguous(memory_format=torch.channels_last) and values[0].shape == (2, 3, 9, 9)
        assert values[1].is_contiguous(memory_format=torch.channels_last) and values[1].shape == (8, 3, 3, 3)
        assert all(v is None for v in values[2:])
        assert [v.stride() if v is not None else None for v in values] == (
            [(243, 1, 27, 3), (27, 1, 9, 3)] + [None] * (len(values) - 2))

        reached = []

        def inner(traced, inputs, **kwargs):
            (call,) = traced.graph.find_nodes(op="call_function", target=torch.ops.fusedepi.chain.default)
            reached.append(call.meta.get("eager_input_vals"))
            raise _Reached()

        monkeypatch.setattr(inductor_compile, "compile_fx_inner", inner)
        example = [torch.rand(2, 3, 9, 9), torch.rand(8, 3, 3, 3), torch.rand(8)]
        with pytest.raises(_Reached):
            choice._inductor_compile(fused_form, example)
        ((traced_values, _), _), = reached
        assert [v.stride() if v is not None else None for v in traced_values] == (
            [(243, 1, 27, 3), (27, 1, 9, 3)] + [None] * (len(values) - 2))


class _Reached(Exception):
    """Raised by a stand-in for Inductor's inner compile once it has seen its graph."""


def test_autotune_setting_is_validated():
    assert load_config({}).autotune == "auto"
    assert load_config({"FUSEDEPI_AUTOTUNE": "0"}).autotune == "off"
    with pytest.raises(ValueError, match="FUSEDEPI_AUTOTUNE"):
        load_config({"FUSEDEPI_AUTOTUNE": "maybe"})


_COMPILE_ONCE = """
import torch, torch.nn as nn
import fusion_backend
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU())
with torch.no_grad():
    torch.compile(model, backend="fusedepi")(torch.randn(8, 16))
"""


def test_a_new_process_with_a_warm_cache_measures_nothing(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, FUSEDEPI_CPU_REFERENCE="1", FUSEDEPI_AUTOTUNE="on", FUSEDEPI_LOG_LEVEL="INFO",
               FUSEDEPI_CACHE_DIR=str(tmp_path))
    measured = []
    for _ in range(2):
        run = subprocess.run([sys.executable, "-c", _COMPILE_ONCE], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        measured.append(run.stderr.count("measured in"))
    assert measured[0] >= 1 and measured[1] == 0  # the chain (and the graph, where it fused), then nothing
