"""GPU-free: torch.compile's mode/options and dynamic shapes reach fusedepi as a user passes them."""

import pytest
import torch
from torch._dynamo.utils import counters

from fusion_backend import fusedepi
from fusion_backend.backend import collect_reports
from helpers import SMALL_WORKLOADS

pytestmark = pytest.mark.usefixtures("cpu_reference")


def _fused(reports):
    return [r for report in reports for r in report.records if r.status == "fused"]


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compile_modes_are_accepted(mode):
    factory, shape, fusion = SMALL_WORKLOADS["3"]
    torch.manual_seed(0)
    model, x = factory(), torch.rand(shape)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        out = torch.compile(model, backend="fusedepi", mode=mode)(x)
        ref = model(x)
    assert [r.fusion for r in _fused(reports)] == [fusion]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_options_are_inductor_config():
    factory, shape, _ = SMALL_WORKLOADS["2"]
    model, x = factory(), torch.rand(shape)
    with torch.no_grad():
        out = torch.compile(model, backend="fusedepi", options={"epilogue_fusion": False})(x)
        torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_unknown_option_is_a_clear_error():
    factory, shape, _ = SMALL_WORKLOADS["2"]
    model, x = factory(), torch.rand(shape)
    with pytest.raises(Exception, match="unknown Inductor options \\['no_such_option'\\]"):
        torch.compile(model, backend="fusedepi", options={"no_such_option": 1})(x)


@pytest.mark.parametrize("name,dynamic", [("1_train", True), ("3", True), ("3", None), ("5", None)])
def test_changing_batch_compiles_one_kernel(name, dynamic):
    """Every batch size runs the same fused chain: one spec, so one kernel (the kernels
    take the row count at run time). With dynamic=True Dynamo compiles one graph for all
    sizes but 1, which it specializes; with the default (automatic dynamic) Dynamo
    recompiles as it sees new sizes. Either way the spec does not change."""
    factory, shape, fusion = SMALL_WORKLOADS[name]
    torch.manual_seed(0)
    model = factory()
    eager = factory()
    eager.load_state_dict(model.state_dict())
    batches = (2, 7, 33) if name == "1_train" else (2, 7, 33, 1)  # BatchNorm training needs 2 rows
    counters.clear()
    reports: list = []
    compiled = torch.compile(model, backend=fusedepi, dynamic=dynamic)
    with torch.no_grad(), collect_reports(reports):
        for batch in batches:
            x = torch.rand((batch, *shape[1:]))
            out = compiled(x)
            torch.testing.assert_close(out, eager(x), atol=1e-5, rtol=1e-5)
    fused = _fused(reports)
    graphs = counters["stats"]["unique_graphs"]
    assert len(fused) == graphs and {r.fusion for r in fused} == {fusion}
    assert len({r.spec for r in fused}) == 1
    if dynamic:
        assert graphs == (2 if 1 in batches else 1)
    if name == "1_train":  # running stats tracked over every call
        torch.testing.assert_close(model.bn.running_mean, eager.bn.running_mean)
        torch.testing.assert_close(model.bn.running_var, eager.bn.running_var)


def test_dynamic_spatial_sizes_are_refused_with_the_reason():
    """dynamic=True also makes a conv's H and W symbolic; the conv kernels are specialized on
    them, so the chain goes to Inductor and the report says why."""
    factory, shape, _ = SMALL_WORKLOADS["5"]
    model, x = factory(), torch.rand(shape)
    reports: list = []
    with torch.no_grad(), collect_reports(reports):
        out = torch.compile(model, backend=fusedepi, dynamic=True)(x)
    refused = [r for report in reports for r in report.records if r.status == "refused"]
    assert "are dynamic; only the batch size may vary" in refused[0].reason
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


class _NormTimesItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(4, 12, 3, padding=1), torch.nn.GroupNorm(2, 12)

    def forward(self, x):
        y = self.conv(x)
        return self.norm(y) * y


def test_a_values_users_are_taken_in_graph_order():
    """`norm(y) * y`: the conv's users are [group_norm, mul] in the static graph and [mul,
    group_norm] in the graph of a symbolic batch (a call at batch 5, then at 4). Either
    way the GroupNorm is the chain's next step (the chain then stops at the multiply: y
    is from before a reduction), not a branch through it from the multiply (a branch
    holds pointwise steps only, so nothing would fuse)."""
    torch.manual_seed(0)
    model = _NormTimesItsInput()
    compiled = torch.compile(model, backend=fusedepi)
    stops = []
    with torch.no_grad():
        for batch in (5, 4):
            x = torch.rand(batch, 4, 9, 7)
            reports: list = []
            with collect_reports(reports):
                out = compiled(x)
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
            fused = _fused(reports)
            assert [r.fusion for r in fused] == ["conv_groupnorm"], [r.reason for rep in reports for r in rep.records]
            stops.append(fused[0].stop)
    assert all("from before its groupnorm" in stop for stop in stops), stops


@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_inductor_graph_cache_serves_a_second_compile(grad, monkeypatch, tmp_path):
    """A new compile of the same model (as in a new process) loads Inductor's compiled
    graphs from its FX graph cache, as plain Inductor does: a warm start pays no codegen."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    factory, shape, fusion = SMALL_WORKLOADS["3"]
    torch.manual_seed(0)
    model, x = factory(), torch.rand(shape, requires_grad=grad)
    hits = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        reports: list = []
        with torch.set_grad_enabled(grad), collect_reports(reports):
            out = torch.compile(model, backend="fusedepi")(x)
            if grad:
                out.sum().backward()
        assert [r.fusion for r in _fused(reports)] == [fusion]
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
        hits.append(counters["inductor"]["fxgraph_cache_hit"])
    graphs = 2 if grad else 1  # forward (+ backward)
    assert hits == [0, graphs]


def test_inductor_graph_cache_is_keyed_on_fusedepis_sources(monkeypatch, tmp_path):
    """The cache key holds a digest of fusedepi's sources (`timings.source_digest`): a
    changed reference (the fused op's fake) is not served the old compile's code."""
    from fusion_backend import timings

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    factory, shape, fusion = SMALL_WORKLOADS["3"]
    torch.manual_seed(0)
    model, x = factory(), torch.rand(shape)
    assert len(timings.source_digest()) == 16
    hits = []
    for digest in (timings.source_digest(), "another-source"):
        monkeypatch.setattr(timings, "source_digest", lambda digest=digest: digest)
        torch._dynamo.reset()
        counters.clear()
        reports: list = []
        with torch.no_grad(), collect_reports(reports):
            torch.compile(model, backend="fusedepi")(x)
        assert [r.fusion for r in _fused(reports)] == [fusion]
        hits.append(counters["inductor"]["fxgraph_cache_hit"])
    assert hits == [0, 0]
