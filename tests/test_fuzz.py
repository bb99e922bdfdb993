"""GPU-free tier of the differential fuzzer (`tests/fuzzer.py`): random models through
the rewrite, checked against eager and float64 via the plain-torch references.

The GPU tier is the same fuzzer with `--device cuda` (benchmarks/device_run.sh fuzz).
"""

import copy
import math
import os
from dataclasses import asdict, replace

import pytest
import torch

import fuzzer

pytestmark = pytest.mark.usefixtures("cpu_reference")

CI_MODELS = 200  # about a minute on two cores


def test_cpu_fuzz_has_no_findings_and_fuses_the_vocabulary():
    results = fuzzer.run(seed=0, indices=range(CI_MODELS), device="cpu")
    summary = fuzzer.summarize(results)
    assert summary["models"] == CI_MODELS
    assert not summary["findings"], _shown(summary["findings"])
    assert summary["in_vocabulary_fused_share"] >= 0.9, summary["reasons"]
    # The models exercise the vocabulary generation 1 draws: most of its steps fused somewhere.
    fused = {name for r in results for steps in r["fused_steps"] for name in steps}
    drawn = fuzzer.drawn_steps(1)
    assert len(fused & drawn) >= 0.8 * len(drawn), sorted(drawn - fused)
    # Out-of-vocabulary steps were generated and stopped their chains.
    assert any(not r["in_vocabulary"] for r in results)


def test_generator_covers_every_step_kind():
    ops = {s["op"] for i in range(3000) for s in fuzzer.make_case(0, i, "cuda").steps}
    wanted = set(fuzzer.POINTWISE + fuzzer.BINARY + fuzzer.NORMS_LINEAR + fuzzer.ROW_REDUCTIONS + fuzzer.OUTSIDE)
    assert wanted <= ops, wanted - ops


def test_generation_1_is_unchanged_by_later_vocabulary():
    # Recorded results and regression tests name models of generation 1.
    for index in range(500):
        case = fuzzer.make_case(0, index, "cuda")
        assert case.generation == 1 and all(s["op"] != "instancenorm" for s in case.steps)
    ops = {s["op"] for i in range(400) for s in fuzzer.make_case(0, i, "cpu", generation=2).steps}
    assert "instancenorm" in ops


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_instance_norm_chains(grad):
    # Generation 2 draws InstanceNorm (1-D/2-D/3-D, affine or not, with or without
    # running statistics) inside random chains.
    indices = _models_with(2, lambda s: s["op"] == "instancenorm", 24 if not grad else 12)
    results = fuzzer.run(seed=0, indices=indices, device="cpu", grad=grad, generation=2)
    summary = fuzzer.summarize(results)
    assert not summary["findings"], _shown(summary["findings"])
    fused = [r for r in results if r["fusion"] == "full"]
    assert len(fused) >= len(indices) // 2, summary["reasons"]


def _shown(findings: list[dict]) -> str:
    """The first findings in full (pytest's assertion message cuts dicts short)."""
    return "\n".join(repr(f) for f in findings[:3])


def _models_where(generation: int, picked, count: int) -> list[int]:
    """Indices of the first `count` models of `generation` (seed 0, CPU draw) for which
    picked(index, case) holds."""
    found = []
    for index in range(10_000):
        if picked(index, fuzzer.make_case(0, index, "cpu", generation=generation)):
            found.append(index)
            if len(found) == count:
                break
    return found


def _models_with(generation: int, drawn, count: int) -> list[int]:
    """Indices of the first `count` models of `generation` (seed 0, CPU draw) with a step
    for which drawn(step) holds."""
    return _models_where(generation, lambda _, case: any(drawn(s) for s in case.steps), count)


def _earlier_models(count: int) -> list[int]:
    """Indices of generation-3 models with an `earlier` operand."""
    return _models_with(fuzzer.EARLIER_GENERATION, lambda s: s.get("operand") == "earlier", count)


def test_generations_before_earlier_operands_are_unchanged():
    for generation in (1, 2):
        cases = [fuzzer.make_case(0, i, "cpu", generation=generation) for i in range(400)]
        assert not any(s.get("operand") == "earlier" for c in cases for s in c.steps)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_earlier_value_operands(grad):
    # Generation 3 draws binary steps whose operand is an earlier value of the chain,
    # possibly across a norm (the chain must then stop there, and still match eager).
    indices = _earlier_models(30 if not grad else 12)
    results = fuzzer.run(seed=0, indices=indices, device="cpu", grad=grad, generation=fuzzer.EARLIER_GENERATION)
    summary = fuzzer.summarize(results)
    assert len(results) == len(indices) and not summary["findings"], _shown(summary["findings"])
    fused = [r for r in results if r["fusion"] == "full"]
    assert len(fused) >= len(indices) // 3, summary["reasons"]


# Conv reductions by generation: (generation, its new draws, the fused steps they become).
CONV_REDUCTIONS = {
    "pooled": (fuzzer.POOL_GENERATION, lambda s: s["op"] in fuzzer.POOLS, "spatial_"),
    "over_channels": (fuzzer.CHANNEL_GENERATION, lambda s: s["op"].startswith("chan_"), "channel_"),
    "windows": (fuzzer.WINDOW_GENERATION, lambda s: s["op"] in fuzzer.WINDOWS, "maxpool avgpool"),
    "conv_layernorm": (7, lambda s: s["op"] == "conv_layernorm", "layernorm"),
    "feature_pools": (7, lambda s: s["op"] in fuzzer.FEATURE_POOLS, "maxpool avgpool"),
    "plane_norms": (fuzzer.BMM_GENERATION, lambda s: s["op"] in fuzzer.PLANE_NORMS, "spatial_softmax spatial_log"),
}


@pytest.mark.parametrize("kind", list(CONV_REDUCTIONS))
def test_generations_before_conv_reductions_are_unchanged(kind):
    generation, drawn, _ = CONV_REDUCTIONS[kind]
    for earlier in range(1, generation):
        cases = [fuzzer.make_case(0, i, "cpu", generation=earlier) for i in range(400)]
        assert not any(drawn(s) for c in cases for s in c.steps)
    # A generation draws the same models as the one before except where its new draws come up
    # (generation 8's come up more often: bmm anchors, N-D Linear row reductions, squeezes).
    same = sum(fuzzer.make_case(0, i, "cpu", generation=generation - 1) == replace(
        fuzzer.make_case(0, i, "cpu", generation=generation), generation=generation - 1) for i in range(200))
    assert same >= (90 if generation == fuzzer.BMM_GENERATION else 120), same


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("kind", list(CONV_REDUCTIONS))
def test_cpu_fuzz_of_conv_reductions(kind, grad):
    # Generation 4 draws global pooling (sum, mean, amax, amin over every spatial dim),
    # generation 5 also softmax, log_softmax and the reductions over a conv output's
    # channels (dim 1); keepdim either way, inside a conv's random chain, then more steps.
    # Generation 6 draws pooling windows (MaxPool / AvgPool 1d-3d), which fuse in
    # forward graphs only (backward reads the unpooled values, or max pool's indices);
    # generation 7 LayerNorm over a conv output's trailing dims.
    generation, drawn, prefixes = CONV_REDUCTIONS[kind]
    indices = _models_with(generation, drawn, 24 if not grad else 12)
    results = fuzzer.run(seed=0, indices=indices, device="cpu", grad=grad, generation=generation)
    summary = fuzzer.summarize(results)
    assert len(results) == len(indices) and not summary["findings"], _shown(summary["findings"])
    reduced = [r for r in results
               if any(name.startswith(tuple(prefixes.split())) for steps in r["fused_steps"] for name in steps)]
    if kind in ("windows", "feature_pools") and grad:
        assert not reduced and any("the pool kernel" in reason for reason in summary["reasons"]), summary["reasons"]
    else:
        assert len(reduced) >= len(indices) // 3, summary["reasons"]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_batched_matmuls(grad):
    # Generation 8 draws a quarter of its anchors as batched matmuls (torch.bmm, or x @ w
    # with a batched w), whose random chains read the product as a Conv1d's output, or
    # as attention scores viewed [B / heads, heads, M, N].
    cases = [fuzzer.make_case(0, i, "cpu", generation=fuzzer.BMM_GENERATION) for i in range(80)]
    indices = [c.index for c in cases if c.anchor["kind"] == "bmm"][: 20 if not grad else 10]
    assert len(indices) >= 10 and any(cases[i].anchor["heads"] > 1 for i in indices)  # some viewed to 4-D
    results = fuzzer.run(seed=0, indices=indices, device="cpu", grad=grad, generation=fuzzer.BMM_GENERATION)
    summary = fuzzer.summarize(results)
    assert len(results) == len(indices) and not summary["findings"], _shown(summary["findings"])
    assert sum(r["fusion"] != "none" for r in results) >= len(indices) // 2, summary["reasons"]


def test_generation_9_adds_broadcast_operands_only():
    broadcast = lambda c: any(s.get("operand") == "broadcast" for s in c.steps)  # noqa: E731
    earlier = [fuzzer.make_case(0, i, "cpu", generation=fuzzer.BROADCAST_GENERATION - 1) for i in range(200)]
    assert not any(broadcast(c) for c in earlier)
    later = [fuzzer.make_case(0, i, "cpu", generation=fuzzer.BROADCAST_GENERATION) for i in range(200)]
    same = sum(a == replace(b, generation=a.generation) for a, b in zip(earlier, later))
    assert sum(map(broadcast, later)) >= 30 and same >= 100, same  # (a binary step draws from more operands)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_broadcast_operands(grad):
    # Generation 9: operands per (image, channel), position, pixel, row, ... (a random
    # subset of the value's dims at its sizes, the rest 1), in random chains.
    gen = fuzzer.BROADCAST_GENERATION
    cases = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(200)]
    picked = [c for c in cases if any(s.get("operand") == "broadcast" for s in c.steps) and c.in_vocabulary]
    picked = picked[: 24 if not grad else 12]
    results = fuzzer.run(seed=0, indices=[c.index for c in picked], device="cpu", grad=grad, generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(picked) and not summary["findings"], _shown(summary["findings"])
    whole = [r for r in results if r["fusion"] == "full"]
    assert len(whole) >= len(picked) * 2 // 3, summary["reasons"]


def _per_sample_models(count: int) -> list[int]:
    """Indices of the first `count` generation-22 models (seed 0, CPU draw, in the
    vocabulary) that differ from generation 21's: those with a per-sample operand."""
    gen = fuzzer.SAMPLE_BROADCAST_GENERATION

    def differs(index, case):
        earlier = fuzzer.make_case(0, index, "cpu", generation=gen - 1)
        return case.in_vocabulary and earlier != replace(case, generation=earlier.generation)

    return _models_where(gen, differs, count)


def test_generation_22_differs_by_per_sample_operands_only():
    gen = fuzzer.SAMPLE_BROADCAST_GENERATION
    for index in range(300):
        earlier = fuzzer.make_case(0, index, "cpu", generation=gen - 1)
        later = fuzzer.make_case(0, index, "cpu", generation=gen)
        if earlier == replace(later, generation=earlier.generation):
            continue
        # the one difference: a broadcast mask of an N-d value whose leading dim is kept
        pairs = [(a, b) for a, b in zip(earlier.steps, later.steps) if a != b]
        assert len(earlier.steps) == len(later.steps) and pairs, index
        for a, b in pairs:
            assert a["operand"] == b["operand"] == "broadcast" and a == {**b, "mask": a["mask"]}, (index, a, b)
            assert [x for x, y in zip(a["mask"], b["mask"]) if x != y] == [False], (index, a["mask"], b["mask"])


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_per_sample_operands(grad):
    # Generation 22: broadcast operands of an N-d Linear's or a bmm's viewed value at the
    # batch's size in their leading dim and 1 in the next ([B, 1, N]: an element for a
    # group of anchor rows), in random chains, computing what eager computes.
    gen = fuzzer.SAMPLE_BROADCAST_GENERATION
    indices = _per_sample_models(16 if not grad else 8)
    results = fuzzer.run(seed=0, indices=indices, device="cpu", grad=grad, generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(indices) and not summary["findings"], _shown(summary["findings"])
    whole = [r for r in results if r["fusion"] == "full"]
    assert len(whole) >= len(indices) // 2, summary["reasons"]
    # each fused chain's kernel is in the row (on the CPU, the reference)
    assert all(r["kernels"] == ["reference (cpu)"] * len(r["fused_steps"]) for r in results), results


def _second_reduction(case) -> bool:
    """Whether a reduction follows a norm in `case`'s draws."""
    ops = [s["op"] for s in case.steps]
    norm = next((i for i, op in enumerate(ops) if op in fuzzer.NORMS_BEFORE_A_REDUCTION), None)
    return norm is not None and any(op in fuzzer.ROW_REDUCTIONS + fuzzer.POOLS for op in ops[norm + 1:])


def test_generation_10_adds_reductions_after_a_norm_only():
    gen = fuzzer.SECOND_REDUCTION_GENERATION
    earlier = [fuzzer.make_case(0, i, "cpu", generation=gen - 1) for i in range(300)]
    assert not any(map(_second_reduction, earlier))
    later = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(300)]
    same = sum(a == replace(b, generation=a.generation) for a, b in zip(earlier, later))
    assert sum(map(_second_reduction, later)) >= 15 and same >= 200, same


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_reductions_after_a_norm(grad):
    # Generation 10: global pooling after a conv's GroupNorm, InstanceNorm, BatchNorm or
    # LayerNorm, a row reduction after a Linear's, with random steps between and after.
    gen = fuzzer.SECOND_REDUCTION_GENERATION
    cases = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(400)]
    picked = [c for c in cases if _second_reduction(c) and c.in_vocabulary][: 20 if not grad else 10]
    results = fuzzer.run(seed=0, indices=[c.index for c in picked], device="cpu", grad=grad, generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(picked) and not summary["findings"], _shown(summary["findings"])
    norms = ("groupnorm", "layernorm", "batchnorm_train")
    second = [r for r in results for steps in r["fused_steps"]
              if any(n in norms for n in steps) and any(n in ("sum", "mean", "amax", "amin") or n.startswith("spatial_")
                                                         for n in steps[[n in norms for n in steps].index(True):])]
    assert len(second) >= len(picked) // 3, summary["reasons"]


def test_generation_11_adds_baddbmm_anchors_only():
    gen = fuzzer.BADDBMM_GENERATION
    earlier = [fuzzer.make_case(0, i, "cpu", generation=gen - 1) for i in range(300)]
    later = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(300)]
    assert not any("baddbmm" in c.anchor for c in earlier)
    changed = [b for a, b in zip(earlier, later) if a != replace(b, generation=a.generation)]
    assert changed and all("baddbmm" in c.anchor for c in changed), len(changed)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_baddbmm_anchors(grad):
    # Generation 11: baddbmm with a full, per-position, per-channel, per-column or
    # one-element input and alpha, then random chains.
    gen = fuzzer.BADDBMM_GENERATION
    cases = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(600)]
    picked = [c for c in cases if "baddbmm" in c.anchor and c.in_vocabulary][: 16 if not grad else 8]
    assert len(picked) >= (16 if not grad else 8)
    results = fuzzer.run(seed=0, indices=[c.index for c in picked], device="cpu", grad=grad, generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(picked) and not summary["findings"], _shown(summary["findings"])
    fused = [r for r in results if r["fused_steps"]]
    assert len(fused) >= len(picked) // 2, summary["reasons"]


def test_gpu_finding_of_a_baddbmm_read_outside_its_chain():
    # The GPU fuzzer's model 831 of seed 1, generation 13 (a bf16 baddbmm whose input
    # cancels its product, and `sin` of its value divided into the chain's result after
    # the softmax that stops the chain): when the chain added the input to the bmm's
    # rounded product, one element came out inf (eager 7.6e4). The library call now adds
    # it (`Anchor.alpha`), rounding once as eager does, and the chain fuses.
    result = fuzzer.run_case(fuzzer.make_case(1, 831, "cuda", generation=13), "cpu")
    assert result.check == "ok" and result.fusion != "none", result


def test_cpu_finding_of_a_baddbmm_cancelling_inside_its_chain():
    # The CPU fuzzer's model 449 of seed 9072, generation 21, with gradients (a bf16
    # baddbmm, alpha -0.5, whose input cancels its product; the chain divides its channel
    # sum by a signed zero made from it): with the input added to the bmm's rounded
    # product inside the chain, one element came out +inf where eager's and float64's
    # are -inf. The library call adds it now, rounding once as eager does.
    result = fuzzer.run_case(fuzzer.make_case(9072, 449, "cpu", generation=21), "cpu", grad=True)
    assert result.check == "ok" and result.fusion == "full", result


def test_cpu_finding_of_a_conv_bias_cancelling_its_product():
    # The CPU fuzzer's model 231 of seed 9073, generation 21: a bf16 ConvTranspose3d whose
    # bias cancels its product in one element, then x / x. The chain adds the library
    # conv's bias to its rounded output as CUDA eager does (cuDNN leaves the bias to ATen),
    # so it met 0 / 0 where CPU eager (oneDNN, one rounding) and float64 have 0.84: the
    # fuzzer holds a CPU run of such a chain to CUDA eager's error as well.
    # CPU eager's bf16 conv is oneDNN's, which differs by CPU: on an AMD EPYC with AVX2
    # alone (torch 2.13.0+cpu) eager meets the inf as well, and the fused chain matches it.
    case = fuzzer.make_case(9073, 231, "cpu", generation=21)
    result = fuzzer.run_case(case, "cpu")
    assert result.fusion == "full", result
    if math.isinf(result.eager_err):
        assert result.check == "ok" and math.isinf(result.err), result
        return
    assert result.check == "ill_conditioned", result
    assert "with CUDA's conv bias inf" in result.finding, result


def test_cpu_finding_of_a_recomputed_atan_under_an_amin():
    # The CPU fuzzer's model 235 of seed 9074, generation 21, with gradients: Linear ->
    # minimum (fused) -> atan -> amin -> ...; Inductor's C++ code computed atan with SIMD
    # in forward and without in backward's recomputation, so amin's backward found no
    # tie and the gradient of x came out NaN (Inductor alone: 0.68 error). The CPU fuzzer
    # runs Inductor's C++ code without SIMD.
    result = fuzzer.run_case(fuzzer.make_case(9074, 235, "cpu", generation=21), "cpu", grad=True)
    assert result.check == "ok" and result.fusion == "partial", result


def test_conv_with_its_bias_added_as_cuda_eager_adds_it():
    torch.manual_seed(0)  # 43 of its 288 values differ from the conv's own bias add
    conv = torch.nn.Conv2d(3, 4, 3).to(torch.bfloat16)
    x = torch.randn(2, 3, 6, 6, dtype=torch.bfloat16)
    split = fuzzer._BiasAfterConv(copy.deepcopy(conv))
    assert [p.shape for p in split.parameters()] == [p.shape for p in conv.parameters()]
    unbiased = torch.nn.functional.conv2d(x, conv.weight)
    torch.testing.assert_close(split(x), unbiased + conv.bias.view(-1, 1, 1), rtol=0, atol=0)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_math_steps(grad):
    # Generation 12: erf, log1p, expm1, sin, cos, sqrt, rsqrt, reciprocal and constant powers among the
    # pointwise steps; earlier generations draw what they drew.
    gen = fuzzer.MATH_GENERATION
    earlier = [fuzzer.make_case(0, i, "cpu", generation=gen - 1) for i in range(300)]
    assert not any(s["op"] in set(fuzzer.MATH_POINTWISE) - set(fuzzer.OUTSIDE) for c in earlier for s in c.steps)
    cases = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(600)]
    picked = [c for c in cases if c.in_vocabulary and any(s["op"] in fuzzer.MATH_POINTWISE for s in c.steps)]
    picked = picked[: 24 if not grad else 10]
    assert len(picked) >= (24 if not grad else 10)
    results = fuzzer.run(seed=0, indices=[c.index for c in picked], device="cpu", grad=grad, generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(picked) and not summary["findings"], _shown(summary["findings"])
    math_steps = {"erf", "sin", "cos", "sqrt", "rsqrt", "reciprocal", "pow", "log1p", "expm1"}
    fused = [r for r in results if math_steps & {n for steps in r["fused_steps"] for n in steps}]
    assert len(fused) >= len(picked) // 2, summary["reasons"]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_branches(grad):
    # Generation 13: binary steps whose operand is computed from an earlier value by one
    # or two steps, and GELU spelled with erf and with tanh; generation 12 draws what it drew.
    gen = fuzzer.BRANCH_GENERATION
    before = [fuzzer.make_case(0, i, "cpu", generation=gen - 1) for i in range(300)]
    assert not any(s.get("operand") == "branch" or s["op"] in fuzzer.SPELLED_GELUS for c in before for s in c.steps)
    cases = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(600)]
    picked = [c for c in cases if c.in_vocabulary
              and any(s.get("operand") == "branch" or s["op"] in fuzzer.SPELLED_GELUS for s in c.steps)]
    picked = picked[: 24 if not grad else 10]
    assert len(picked) >= (24 if not grad else 10)
    results = fuzzer.run(seed=0, indices=[c.index for c in picked], device="cpu", grad=grad, generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(picked) and not summary["findings"], _shown(summary["findings"])
    fused = [r for r in results if any("branch" in steps for steps in r["fused_steps"])]
    assert len(fused) >= len(picked) // 2, summary["reasons"]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_of_written_out_norms(grad):
    # Generation 15: a Linear's softmax, log_softmax and LayerNorm written out in half the
    # draws; generation 14 draws what it drew. Forward, softmax and LayerNorm written out
    # fuse as their steps (y - logsumexp(y) stays two ops: it is not log_softmax on a row
    # holding +inf, which model 442 draws); with backward (which reads their values in
    # between) the chain stops before them.
    gen = fuzzer.SPELLED_GENERATION
    before = [fuzzer.make_case(0, i, "cpu", generation=gen - 1) for i in range(300)]
    assert not any("spelled" in s and s["op"] in fuzzer.SPELLED_NORMS for c in before for s in c.steps)
    cases = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(600)]
    picked = [c for c in cases if c.in_vocabulary and any(s.get("spelled") and s["op"] in fuzzer.SPELLED_NORMS
                                                          for s in c.steps)]
    assert {s["spelled"] for c in picked for s in c.steps if s.get("spelled") and s["op"] in fuzzer.SPELLED_NORMS} \
        == {form for forms in fuzzer.SPELLED_NORMS.values() for form in forms[1:]}
    picked = picked[: 24 if not grad else 10]
    assert len(picked) >= (24 if not grad else 10)
    results = fuzzer.run(seed=0, indices=[c.index for c in picked], device="cpu", grad=grad, generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(picked) and not summary["findings"], _shown(summary["findings"])
    if not grad:
        fused = [r for r in results if {"softmax", "layernorm"} & {n for s in r["fused_steps"] for n in s}]
        assert len(fused) >= len(picked) // 3, summary["reasons"]

def test_cpu_fuzz_of_row_reductions_of_nd_linear_outputs():
    # Generation 8 also reduces the features of a Linear applied to [B, T, K] inputs.
    gen = fuzzer.BMM_GENERATION
    cases = [fuzzer.make_case(0, i, "cpu", generation=gen) for i in range(300)]
    indices = [c.index for c in cases if c.anchor["kind"] == "linear" and len(c.anchor["lead"]) > 1
               and any(s["op"] in fuzzer.ROW_REDUCTIONS for s in c.steps)][:16]
    assert len(indices) >= 8
    results = fuzzer.run(seed=0, indices=indices, device="cpu", generation=gen)
    summary = fuzzer.summarize(results)
    assert len(results) == len(indices) and not summary["findings"], _shown(summary["findings"])
    reduced = [r for r in results if any(n in ("logsumexp", "sum", "mean", "amax", "amin")
                                         for steps in r["fused_steps"] for n in steps)]
    assert len(reduced) >= len(indices) // 3, summary["reasons"]


def test_cpu_fuzz_of_in_kernel_gemm_shapes():
    # --in-kernel-gemm: 16-bit Linear anchors the in-kernel GEMM covers, a stream of
    # their own (generation 1's models unchanged), run with FUSEDEPI_IN_KERNEL_GEMM=1
    # (on CPU the rewrite through references; tests/test_gpu.py and the GPU fuzzer run
    # the kernel).
    cases = [fuzzer.make_case(0, i, "cpu", gemm=True) for i in range(40)]
    assert all(c.gemm and c.dtype == "bfloat16" and c.anchor["kind"] == "linear" for c in cases)
    assert all(c.anchor["out"] % 256 == 0 and c.anchor["in"] % 8 == 0 for c in cases)
    plain = [fuzzer.make_case(0, i, "cpu") for i in range(40)]
    assert sum(p.anchor == c.anchor and p.steps == c.steps for p, c in zip(plain, cases)) == 0  # a stream of its own
    before = os.environ.get("FUSEDEPI_IN_KERNEL_GEMM")
    results = fuzzer.run(seed=0, indices=range(24), device="cpu", gemm=True)
    assert os.environ.get("FUSEDEPI_IN_KERNEL_GEMM") == before  # the setting is the case's only
    summary = fuzzer.summarize(results)
    assert not summary["findings"], _shown(summary["findings"])
    assert summary["fusion"].get("full", 0) >= 12, summary["reasons"]
    assert summary["in_kernel_gemm"] == 0  # no wgmma kernel runs on CPU


def test_in_kernel_gemm_fuzz_draws_tf32_models_on_cuda():
    # On CUDA a third of the --in-kernel-gemm models are float32 under matmul precision
    # "high" (the in-kernel GEMM then computes in TF32), drawn after everything else: the
    # rest of a model is what it was before TF32 was added.
    import dataclasses

    cases = [fuzzer.make_case(0, i, "cuda", gemm=True) for i in range(60)]
    tf32 = [c for c in cases if c.tf32]
    assert 10 <= len(tf32) <= 30 and all(c.dtype == "float32" for c in tf32)
    assert all(c.dtype in ("bfloat16", "float16") for c in cases if not c.tf32)
    # run_case sets the precision for the case only (here through the CPU references).
    precision = torch.get_float32_matmul_precision()
    cpu = [dataclasses.replace(fuzzer.make_case(0, i, "cpu", gemm=True), dtype="float32", tf32=True) for i in range(2)]
    results = [fuzzer.run_case(c, "cpu") for c in cpu]
    assert torch.get_float32_matmul_precision() == precision
    assert all(r.check in ("ok", "rejected") for r in results), results


def test_cpu_fuzz_of_in_kernel_conv_shapes():
    # --in-kernel-conv: 2-D convs the in-kernel conv covers, a stream of their own, run
    # with FUSEDEPI_IN_KERNEL_CONV=1 and, for float32, cuDNN's TF32 (on CPU the rewrite
    # through references, in float32: a 16-bit CPU conv rounds conv + bias once, unlike
    # cuDNN through torch and the fused op; the GPU fuzzer runs the kernel).
    import dataclasses

    cases = [fuzzer.make_case(0, i, "cuda", implicit=True) for i in range(60)]
    assert all(c.implicit and not c.gemm and c.anchor["kind"] == "conv" and c.anchor["dims"] == 2 for c in cases)
    assert all(c.anchor["in"] % 8 == 0 and c.anchor["out"] % 8 == 0 and c.anchor["out"] > 32 for c in cases)
    assert all(c.anchor["stride"] == 1 and c.anchor["dilation"] == 1 for c in cases)
    assert 10 <= sum(c.tf32 for c in cases) <= 30 and all(c.dtype == "float32" for c in cases if c.tf32)
    plain = [fuzzer.make_case(0, i, "cuda") for i in range(60)]
    assert sum(p.anchor == c.anchor and p.steps == c.steps for p, c in zip(plain, cases)) == 0  # a stream of its own
    before = os.environ.get("FUSEDEPI_IN_KERNEL_CONV")
    results = fuzzer.run(seed=0, indices=range(12), device="cpu", implicit=True)  # (its worker setup: TF32 off)
    allow_tf32 = torch.backends.cudnn.allow_tf32
    tf32 = fuzzer.run_case(dataclasses.replace(fuzzer.make_case(0, 0, "cpu", implicit=True), dtype="float32",
                                               tf32=True), "cpu")
    assert os.environ.get("FUSEDEPI_IN_KERNEL_CONV") == before  # the settings are the case's only
    assert torch.backends.cudnn.allow_tf32 == allow_tf32
    summary = fuzzer.summarize(results)
    assert not summary["findings"] and tf32.check in ("ok", "rejected"), _shown(summary["findings"])
    assert summary["fusion"].get("full", 0) >= 4, summary["reasons"]
    assert summary["in_kernel_conv"] == 0  # no igemm kernel runs on CPU


def test_cases_and_models_are_reproducible():
    a, b = fuzzer.make_case(7, 11), fuzzer.make_case(7, 11)
    assert a == b and a != fuzzer.make_case(7, 12)
    ma, mb = fuzzer.FuzzModel(a), fuzzer.FuzzModel(b)
    for pa, pb in zip(ma.state_dict().values(), mb.state_dict().values()):
        assert torch.equal(pa, pb)
    xa, ra = fuzzer.make_inputs(a, ma, "cpu")
    xb, rb = fuzzer.make_inputs(b, mb, "cpu")
    assert torch.equal(xa, xb) and torch.equal(ra, rb)


def test_error_metric():
    ref = torch.tensor([1.0, float("nan"), float("inf"), -2.0], dtype=torch.float64)
    assert fuzzer.error(ref.clone(), ref) == 0.0
    assert fuzzer.error(torch.tensor([1.0, 0.0, float("inf"), -2.0]), ref) == math.inf  # NaN lost
    assert fuzzer.error(torch.tensor([1.0, float("nan"), float("inf"), float("nan")]), ref) == math.inf
    assert fuzzer.error(torch.tensor([1.1, float("nan"), float("inf"), -2.0]), ref) == pytest.approx(0.1 / math.sqrt(5))
    assert fuzzer.error(torch.zeros(3), torch.zeros(3, dtype=torch.float64)) == 0.0


def test_ill_conditioned_chain_is_told_apart_from_a_mismatch(monkeypatch):
    # Found by the CPU fuzzer (seed 0, model 135): x / x makes a constant, whose
    # BatchNorm (training) divides rounding noise by sqrt(eps). The BatchNorm ran in
    # Inductor (it now fuses after a conv, so the step is disabled here); its error
    # exceeds eager's, and fusedepi's is Inductor's.
    monkeypatch.setenv("FUSEDEPI_DISABLE", "batchnorm_train")
    case = fuzzer.make_case(0, 135)
    result = fuzzer.run_case(case, "cpu")
    assert result.check == "ill_conditioned", result
    assert result.err <= fuzzer.EAGER_SLACK * result.inductor_err


def test_model_eager_rejects_is_rejected_alike():
    # Found by the GPU fuzzer (seed 0, model 2568 of the CUDA draw): GroupNorm in
    # training with one value a group; eager raises, so must the compiled model.
    result = fuzzer.run_case(fuzzer.make_case(0, 2568, "cuda"), "cpu", grad=True)
    assert result.check == "rejected", result
    assert "Expected more than 1 value" in result.reason
    summary = fuzzer.summarize([asdict(result)])
    assert not summary["findings"] and summary["in_vocabulary"] == 0 and not summary["fusion"], summary


@pytest.mark.parametrize("compiled", ["runs", "raises otherwise"])
def test_model_eager_rejects_but_fusedepi_does_not_is_a_finding(monkeypatch, compiled):
    outputs = fuzzer._outputs

    def fake(model, fn, *args):
        if fn is model:  # eager and the float64 copy
            raise ValueError("eager's reason")
        if compiled == "raises otherwise":
            raise ValueError("another reason")
        return outputs(model, fn, *args)

    monkeypatch.setattr(fuzzer, "_outputs", fake)
    result = fuzzer.run_case(fuzzer.make_case(0, 3), "cpu")
    assert result.check == "error" and "eager raises ValueError" in result.finding, result


@pytest.mark.parametrize("again", [False, True], ids=["once", "on-every-draw"])
def test_excess_over_eager_counts_when_it_comes_back_on_other_inputs(monkeypatch, again):
    # Where eager's own error is a good share of the budget, an excess on one input
    # draw alone is the chain's conditioning (GPU fuzzer model 2930); on other draws
    # too, a mismatch.
    draws = []
    make_inputs = fuzzer.make_inputs

    xs = {}

    def inputs(case, model, device, draw=0):
        draws.append(draw)
        xs[draw], residual = make_inputs(case, model, device, draw)
        return xs[draw], residual

    def worst(ours, eager, ref, tol):  # eager at 10x the budget; ours 10x over eager's
        return 0, (1e-3 if again or draws[-1] == 0 else 1e-4), 1e-4

    monkeypatch.setattr(fuzzer, "make_inputs", inputs)
    monkeypatch.setattr(fuzzer, "_worst", worst)
    monkeypatch.setattr(fuzzer, "_inductor_error", lambda *args: 1e-4)
    result = fuzzer.run_case(fuzzer.make_case(0, 3), "cpu")
    assert result.check == ("mismatch" if again else "ill_conditioned"), result
    assert draws == [0, 1, 2] and "other draws" in result.finding, result
    assert not torch.equal(xs[0], xs[1]) and not torch.equal(xs[1], xs[2])


def test_excess_over_a_well_conditioned_eager_is_a_mismatch_at_once(monkeypatch):
    draws = []
    make_inputs = fuzzer.make_inputs
    monkeypatch.setattr(fuzzer, "make_inputs", lambda *a, **k: draws.append(1) or make_inputs(*a, **k))
    monkeypatch.setattr(fuzzer, "_worst", lambda *args: (0, 1e-4, 1e-7))  # eager at 1% of the budget
    monkeypatch.setattr(fuzzer, "_inductor_error", lambda *args: 1e-7)
    result = fuzzer.run_case(fuzzer.make_case(0, 3), "cpu")
    assert result.check == "mismatch" and len(draws) == 1, result


def test_tf32_error_is_the_budget_of_a_tf32_model_whose_eager_ran_exact():
    # GPU fuzzer, seed 23, generation 18, model 185 (in-kernel conv draw): a 16 -> 80 conv
    # of TF32 operands, then a division of a per-channel operand by the conv's value.
    # cuDNN ran eager and Inductor exact (1.8e-6, 2.3e-6); the in-kernel conv in TF32
    # gave 5.2e-3, the error its operands rounded to TF32 give in float64.
    case = fuzzer.make_case(23, 185, "cuda", 18, implicit=True)
    assert case.tf32 and [s["op"] for s in case.steps][:3] == ["mul", "div", "avgpool"]
    assert _tf32_error(case) == pytest.approx(5.2e-3, rel=0.02)
    # A well-conditioned model's TF32 error is well within the budget.
    assert 0 < _tf32_error(fuzzer.make_case(23, 0, "cuda", 18, implicit=True)) < fuzzer.TF32_TOLERANCE / 4


def _tf32_error(case) -> float:
    base = fuzzer.FuzzModel(case).train(case.training)
    x, residual = fuzzer.make_inputs(case, base, "cpu")
    exact = fuzzer.copy.deepcopy(base).double()
    ref = fuzzer._outputs(exact, exact, x.double(), residual.double(), None)
    return fuzzer._tf32_error(base, x, residual, ref, "cpu", None, 0)


CI_GRAD_MODELS = 60  # with backward: about two minutes on two cores


def test_cpu_fuzz_with_gradients_has_no_findings():
    results = fuzzer.run(seed=1, indices=range(CI_GRAD_MODELS), device="cpu", grad=True)
    summary = fuzzer.summarize(results)
    assert not summary["findings"], _shown(summary["findings"])
    assert summary["fusion"].get("full", 0) >= 0.7 * CI_GRAD_MODELS, summary


# Findings of the fuzzer with --grad (seed 0), which the CPU reference reproduces.
# CUDA cases: a recomputed amax input (698, 787), bf16 values recomputed by Inductor
# beside statistics from the fused op (138, 975), silu's sigmoid saved after a row
# reduction (716). CPU cases: a folded conv bias rounded twice before a value saved
# for a backward that branches on its sign (31, 118).
GRAD_REGRESSIONS = [("cuda", 138), ("cuda", 698), ("cuda", 716), ("cuda", 787), ("cuda", 975), ("cpu", 31),
                    ("cpu", 118)]


@pytest.mark.parametrize("case_device, index", GRAD_REGRESSIONS)
def test_gradient_fuzz_regressions(case_device, index):
    result = fuzzer.run_case(fuzzer.make_case(0, index, case_device), "cpu", grad=True)
    assert result.check == "ok", result
    assert result.fusion in ("full", "partial"), result


def test_gradient_fuzz_regression_of_an_extremum_after_the_chain():
    # Generation 13, seed 26, model 272 (CPU): Conv3d, LayerNorm over W, erf, then a
    # spatial amin that the chain does not take; every gradient of x was NaN (the amin's
    # input recomputed in backward; tests/test_training.py has the small form).
    result = fuzzer.run_case(fuzzer.make_case(26, 272, "cpu", generation=13), "cpu", grad=True)
    assert result.check == "ok", result
    assert result.fusion == "partial", result


def test_gradient_fuzz_regression_of_a_norm_after_steps():
    # Generation 13, seed 28, model 203 (CPU): float32 Linear, erf, cos, / the erf's
    # value, SiLU, RMSNorm, / -0.797. Backward recomputed the RMSNorm's input from the
    # steps before it in Inductor's code and read the statistics the fused op took:
    # the gradient of x 0.305 off float64 (eager 7.1e-4, Inductor 9.2e-3).
    result = fuzzer.run_case(fuzzer.make_case(28, 203, "cpu", generation=13), "cpu", grad=True)
    assert result.check == "ok", result
    assert result.fusion == "full", result


@pytest.mark.parametrize("index", [144, 187])
def test_gradient_fuzz_regression_of_backwards_work_in_the_forward_graph(index):
    # Generation 13, seed 28 (CPU): a mish after steps, then a reduction (144: 3-D
    # Linear, minimum, mish, mean over the features; 187: bmm, tanh, pow, mish, relu6,
    # softmax over the plane). The forward graph computes mish's derivative from its
    # input for backward; the walk took it for chain steps and stopped before the mish.
    result = fuzzer.run_case(fuzzer.make_case(28, index, "cpu", generation=13), "cpu", grad=True)
    assert result.check == "ok", result
    assert result.fusion == "full", result


def test_a_dtype_eagers_cpu_kernel_lacks_is_not_a_finding():
    # Generation 13, seed 26, model 209: a bf16 Conv3d chain ending in AvgPool3d, with
    # backward. Eager's CPU avg_pool3d has no bf16 kernel; Inductor's code runs the pool
    # (nothing fused: the chain ends before a pool whose input backward reads).
    result = fuzzer.run_case(fuzzer.make_case(26, 209, "cpu", generation=13), "cpu", grad=True)
    assert result.check == "rejected" and "eager lacks a kernel" in result.reason, result


def test_cpu_fuzz_with_the_library_call_forms_forced(monkeypatch):
    # The timed forms of the library call (a float32 GEMM's bias moved into the epilogue,
    # a 16-bit GEMM on padded operands, a conv on channels-last operands) rewrite the spec
    # they start from; forced on, the fuzzer's chains go through each (on CPU the
    # references run them; a moved bias once left earlier-value operands one step short).
    for name in ("FUSEDEPI_FOLD_GEMM_BIAS", "FUSEDEPI_PAD_GEMM", "FUSEDEPI_CONV_CHANNELS_LAST"):
        monkeypatch.setenv(name, "1")
    indices = _earlier_models(24)
    results = fuzzer.run(seed=0, indices=indices, device="cpu", generation=fuzzer.EARLIER_GENERATION)
    results += fuzzer.run(seed=0, indices=range(40), device="cpu")
    summary = fuzzer.summarize(results)
    assert not summary["findings"], _shown(summary["findings"])
    assert summary["fusion"].get("full", 0) >= 30, summary["reasons"]
    # The bias moved into the epilogue where the chain allowed it: fused chains of float32
    # Linear models whose first step is that bias's add, earlier-value models among them.
    moved = [r for r in results if r["dtype"] == "float32" and r["anchor"] == "linear" and r["fused_steps"]
             and r["fused_steps"][0][:1] == ["add"]]
    assert len(moved) >= 5 and any(r["index"] in indices for r in moved), len(moved)


def _anchors_changed_by(generation: int) -> list[tuple]:
    """(the generation before's model, `generation`'s) for each of the in-kernel conv's
    fuzzer models 0 to 59 of seed 0 whose anchor `generation` changes; every other model
    is the generation before's."""
    import dataclasses

    pairs = [(fuzzer.make_case(0, i, "cpu", generation=generation - 1, implicit=True),
              fuzzer.make_case(0, i, "cpu", generation=generation, implicit=True)) for i in range(60)]
    for b, c in pairs:
        assert c.anchor != b.anchor or dataclasses.replace(c, generation=generation - 1) == b
    return [(b, c) for b, c in pairs if c.anchor != b.anchor]


def _implicit_runs_clean(indices, generation: int) -> list:
    """The in-kernel conv's fuzzer models `indices` of seed 0 and `generation`, run on the
    CPU through the fused op's reference: no finding, at least 4 fused whole. Their results."""
    results = fuzzer.run(seed=0, indices=indices, device="cpu", generation=generation, implicit=True)
    summary = fuzzer.summarize(results)
    assert not summary["findings"], _shown(summary["findings"])
    assert summary["fusion"].get("full", 0) >= 4, summary["reasons"]
    return results


def test_cpu_fuzz_of_strided_in_kernel_convs():
    # Generation 16 draws the in-kernel conv's strides (1 to 3) and dilations (1, 2) from
    # a stream of their own: its anchors are otherwise generation 15's, and so are its
    # models of stride 1 and dilation 1 (a chain's steps fit its output's sizes). Run on
    # CPU through the fused op's reference (the rewrite, the output sizes); the GPU fuzzer
    # runs the kernel.
    import dataclasses

    gen = fuzzer.STRIDED_GENERATION
    before = [fuzzer.make_case(0, i, "cuda", generation=gen - 1, implicit=True) for i in range(60)]
    after = [fuzzer.make_case(0, i, "cuda", generation=gen, implicit=True) for i in range(60)]
    assert {c.anchor["stride"] for c in after} == {1, 2, 3} and {c.anchor["dilation"] for c in after} == {1, 2}
    for b, c in zip(before, after):
        assert {**c.anchor, "stride": 1, "dilation": 1, "spatial": b.anchor["spatial"]} == b.anchor
        if c.anchor == b.anchor:
            assert dataclasses.replace(c, generation=gen - 1) == b
    for c in after:  # every output at least one pixel
        assert all(n >= 1 for n in fuzzer._conv_out_sizes(c.anchor))
    _implicit_runs_clean(range(12), gen)


def test_cpu_fuzz_of_narrow_in_kernel_convs():
    # Generation 17 draws half the in-kernel conv's anchors with few channels (8-32 in,
    # 32-64 out) from a stream of their own, so that tiles of 256 pixels run: the other
    # anchors are generation 16's. Run on CPU through the fused op's reference.
    import dataclasses

    from cuda_templates import conv_sm90

    gen = fuzzer.NARROW_GENERATION
    before = [fuzzer.make_case(0, i, "cuda", generation=gen - 1, implicit=True) for i in range(60)]
    after = [fuzzer.make_case(0, i, "cuda", generation=gen, implicit=True) for i in range(60)]
    narrow = [c for b, c in zip(before, after) if c.anchor != b.anchor]
    assert 20 <= len(narrow) <= 40
    for b, c in zip(before, after):
        assert {**c.anchor, "in": b.anchor["in"], "out": b.anchor["out"]} == b.anchor
        if c.anchor == b.anchor:
            assert dataclasses.replace(c, generation=gen - 1) == b
        else:
            assert c.anchor["in"] in (8, 16, 24, 32) and c.anchor["out"] in range(32, 65, 8)
    tall = shared = 0
    for c in narrow:  # the tile the in-kernel conv plans for each, by its sizes
        itemsize = 4 if c.dtype == "float32" else 2
        ho, wo = fuzzer._conv_out_sizes(c.anchor)
        k_bytes = conv_sm90.k_step_bytes(c.anchor["in"], itemsize)
        # (a kernel column's taps may share a box of x: stride 1, a narrow k-step, as render's conv_gemm_plan asks)
        tap_rows = ((c.anchor["kernel"], c.anchor["dilation"])
                    if c.anchor["kernel"] > 1 and c.anchor["stride"] == 1 and k_bytes in conv_sm90.SHARED_ROWS_K_BYTES
                    else ())
        plan = conv_sm90.tiling(c.anchor["out"], wo, itemsize, k_bytes=k_bytes, stride_w=c.anchor["stride"], ho=ho,
                                tap_rows=tap_rows)
        tall += plan.block_m == conv_sm90.TALL_BLOCK_M
        shared += plan.shared_rows
    assert tall >= 10 and 5 <= shared < len(narrow), (tall, shared)  # both of the in-kernel conv's mainloops
    _implicit_runs_clean([c.index for c in narrow[:12]], gen)


def test_cpu_fuzz_of_windows_the_in_kernel_convs_tiles_pool():
    # Generation 18 makes half the pooling windows after the in-kernel conv's 2-D anchors
    # the ones its tiles pool (conv_sm90.POOLS_IN_TILE: a stride of the window's size, 2 or
    # 4 a side, unpadded, undilated, floor mode), from a stream of their own: every other
    # draw is generation 17's. Run on CPU through the fused op's reference.
    import dataclasses

    gen = fuzzer.TILE_POOL_GENERATION
    before = [fuzzer.make_case(0, i, "cuda", generation=gen - 1, implicit=True) for i in range(200)]
    after = [fuzzer.make_case(0, i, "cuda", generation=gen, implicit=True) for i in range(200)]
    changed = []
    for b, c in zip(before, after):
        if dataclasses.replace(c, generation=gen - 1) == b:
            continue
        changed.append(c)
        assert [s["op"] for s in c.steps] == [s["op"] for s in b.steps] and c.anchor == b.anchor
        for old, new in zip(b.steps, c.steps):
            if new != old:
                assert new["op"] in fuzzer.WINDOWS and new["kernel"] == new["stride"] in (2, 4)
                assert (new["padding"], new["dilation"], new["ceil"]) == (0, 1, False)
    assert len(changed) >= 8
    _implicit_runs_clean([c.index for c in changed[:8]], gen)


def test_cpu_fuzz_of_convs_run_as_the_2d_conv_they_equal():
    # Generation 19 turns a third of the in-kernel conv's anchors, by a stream of their
    # own, into a Conv1d over their width (Anchor.as_2d) or a ConvTranspose2d of stride 1
    # (Anchor.flipped): the other draws are generation 18's. Run on CPU through the fused
    # op's reference.
    gen = fuzzer.AS_CONV2D_GENERATION
    pairs = _anchors_changed_by(gen)
    assert 10 <= len(pairs) <= 30
    kinds = set()
    for b, c in pairs:
        if c.anchor["kind"] == "conv":
            assert c.anchor["dims"] == 1 and c.anchor["spatial"] == [b.anchor["spatial"][1]]
            kinds.add("conv1d")
        else:
            assert c.anchor["kind"] == "conv_transpose" and c.anchor["stride"] == 1
            assert c.anchor["padding"] <= c.anchor["kernel"] - 1
            kinds.add("conv_transpose")
    assert kinds == {"conv1d", "conv_transpose"}
    results = _implicit_runs_clean([c.index for _, c in pairs[:10]], gen)
    assert {r["anchor"] for r in results} == {"conv1d", "conv_transpose2d"}


def test_cpu_fuzz_of_conv3d_in_kernel_convs():
    # Generation 20 turns a quarter of the in-kernel conv's 2-D anchors, decided by a
    # stream of their own, into Conv3d of the same channels and parameters (Anchor.depth):
    # the other models are generation 19's. Run on CPU through the fused op's reference.
    gen = fuzzer.CONV3D_GENERATION
    pairs = _anchors_changed_by(gen)
    assert 5 <= len(pairs) <= 25
    for b, c in pairs:
        assert b.anchor["kind"] == "conv" and b.anchor["dims"] == 2 and c.anchor["dims"] == 3
        assert {**c.anchor, "dims": 2, "spatial": b.anchor["spatial"]} == b.anchor
        assert all(n >= 1 for n in fuzzer._conv_out_sizes(c.anchor))
    results = _implicit_runs_clean([c.index for _, c in pairs[:10]], gen)
    assert {r["anchor"] for r in results} == {"conv3d"}


def test_cpu_fuzz_of_in_kernel_convs_of_odd_input_channels():
    # Generation 21 gives a fifth of the in-kernel conv's anchors, decided by a stream of
    # their own, 1 to 7 input channels or 8 to 40 not in 8s (conv_sm90.PAD_PIXELS); the
    # other models are generation 20's. Run on CPU through the fused op's reference.
    gen = fuzzer.ODD_CHANNELS_GENERATION
    pairs = _anchors_changed_by(gen)
    assert 5 <= len(pairs) <= 25
    for b, c in pairs:
        assert {**c.anchor, "in": b.anchor["in"]} == b.anchor and c.anchor["in"] % 8 and 1 <= c.anchor["in"] <= 39
    assert any(c.anchor["in"] < 8 for _, c in pairs) and any(c.anchor["in"] > 8 for _, c in pairs)
    _implicit_runs_clean([c.index for _, c in pairs[:10]], gen)


def _batch(case) -> int:
    a = case.anchor
    return a["lead"][0] if a["kind"] == "linear" else a["batch"]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_cpu_fuzz_at_a_symbolic_batch(grad):
    """`dynamic=True` in the fuzzer: each model first runs at batch + 1, so that the checked
    call at its own batch (2 or more) compiles the graph Dynamo makes with a symbolic batch
    size. Half the models hold a BatchNorm, whose running stats the first call moves and
    which must be as eager's after the checked call alone."""
    gen, per_kind = max(fuzzer.CONV_NORMS), 6 if grad else 10
    picked = {"batchnorm": [], "other": []}
    for index in range(2000):
        case = fuzzer.make_case(0, index, "cpu", generation=gen)
        kind = "batchnorm" if any(s["op"] == "batchnorm" for s in case.steps) else "other"
        if _batch(case) >= 2 and len(picked[kind]) < per_kind:
            picked[kind].append(index)
        if all(len(v) == per_kind for v in picked.values()):
            break
    indices = sorted(picked["batchnorm"] + picked["other"])
    results = fuzzer.run(seed=0, indices=indices, device="cpu", grad=grad, generation=gen, dynamic=True)
    summary = fuzzer.summarize(results)
    assert not summary["findings"], _shown(summary["findings"])
    ran = [r for r in results if r["dynamic_batch"] == "ran"]
    assert len(ran) >= len(indices) // 2, [r["dynamic_batch"] for r in results]
    assert sum(r["fusion"] == "full" for r in ran) >= len(ran) // 2, summary["reasons"]


def test_cpu_fuzz_fuses_the_same_steps_at_a_symbolic_batch():
    """Models whose chain value has two users, a GroupNorm and a branch back to the value
    (seed 9103, generation 21: models 24 and 74): at a symbolic batch the graph lists the
    value's users in another order than at a static one, and the matcher takes them in
    graph order all the same, so the same steps fuse (the GroupNorm, not a branch
    through it that fuses nothing)."""
    gen = max(fuzzer.CONV_NORMS)
    for index in (24, 74):
        case = fuzzer.make_case(9103, index, "cpu", generation=gen)
        static = fuzzer.run_case(case, "cpu")
        symbolic = fuzzer.run_case(case, "cpu", dynamic=True)
        assert symbolic.dynamic_batch == "ran"
        assert static.check == symbolic.check == "ok", (static.finding, symbolic.finding)
        assert symbolic.fused_steps == static.fused_steps and "groupnorm" in static.fused_steps[0], \
            (static.fused_steps, symbolic.fused_steps, symbolic.reason)
