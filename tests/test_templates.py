"""GPU-free: rendered sources, launch plans, and an nvcc compile of every template path."""

import concurrent.futures
import functools
import itertools
import math
import os
import re
import sys
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import cuda_templates
from cuda_templates import compiler
from cuda_templates.render import pixel_group_plan, plan, tiled_plan
from cuda_templates.snippets import SNIPPETS, Operands, _float32_reciprocal, cfloat
from lowering import VOCABULARY, EpilogueSpec
from lowering.spec import BROADCAST, CHANNEL, FULL, SCALAR, Anchor, Save, Step
from specs import (
    CHANNELS_LAST,
    CONV,
    _implicit,
    awkward_specs,
    broadcast_specs,
    conv_gemm_specs,
    gemm_specs,
    conv_batchnorm_specs,
    pixel_group_specs,
    second_reduction_specs,
    tiled_specs,
    direct_specs,
    training_specs,
    vocabulary_specs,
    workload_specs,
)

DTYPES = ["float32", "bfloat16", "float16"]
ALL_SPECS = {
    f"{name}-{dtype}": spec
    for dtype in DTYPES
    for name, spec in {
        **workload_specs(dtype), **awkward_specs(dtype), **direct_specs(dtype), **vocabulary_specs(dtype),
        **training_specs(dtype), **conv_batchnorm_specs(dtype), **broadcast_specs(dtype),
        **second_reduction_specs(dtype), **pixel_group_specs(dtype), **tiled_specs(dtype),
    }.items()
}
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")


def test_every_vocabulary_step_has_device_code():
    assert set(VOCABULARY) == set(SNIPPETS)


@pytest.mark.parametrize("name", list(ALL_SPECS))
def test_render_is_complete_and_named(name):
    spec = ALL_SPECS[name]
    source = cuda_templates.render(spec, "sm90")
    assert "$" not in source.replace("${", "")  # every placeholder substituted
    kernel = cuda_templates.kernel_name(spec, "sm90")
    assert source.startswith(f"// fusedepi epilogue kernel: {kernel}")
    # Every file has its apply kernel but a direct conv's, whose own kernels write the output.
    direct = kernel.startswith("directconv_")
    assert (f"{kernel}_apply(" in source) != direct and ('#include "fusedepi/apply.cuh"' in source) != direct
    assert source == cuda_templates.render(EpilogueSpec.from_json(spec.to_json()), "sm90")


@pytest.mark.parametrize("name", list(ALL_SPECS))
def test_plan_covers_the_segment(name):
    spec = ALL_SPECS[name]
    p = plan(spec)
    if p.pixels:  # a reduction over a conv's channels: a thread a vector of pixels of one channel
        assert spec.reduction.name.startswith("channel_") and spec.inner % p.vec == 0
        assert (p.team, p.nvec, p.chunks, p.groups) == (1, 1, 1, 1) and p.block % 32 == 0
        return
    if p.pool:  # a pooling window: a thread an output element (the grid covers them)
        assert spec.reduction.name in ("maxpool", "avgpool") and (p.vec, p.team, p.nvec, p.chunks) == (1, 1, 1, 1)
        assert "<<<rows * kPoolBlocksPerRow, kBlock, 0, stream>>>" in cuda_templates.render(spec, "sm90")
        return
    if p.tiled:  # tiles of pixels x channels of a channels-last y: the grid covers both
        assert spec.anchor.channels_last and (p.team, p.nvec, p.chunks, p.groups) == (1, 1, 1, 1)
        assert spec.inner % p.vec == 0 and p.tile % p.vec == 0 and p.tile_c % p.cvec == 0 == spec.channels % p.cvec
        assert p.tile_c * (p.tile + 1) * 4 <= 48 * 1024 and p.block % 32 == 0
        assert "dim3((rows * kInner + kTileP - 1) / kTileP, (kChannels + kTileC - 1) / kTileC)" in \
            cuda_templates.render(spec, "sm90")
        return
    if p.flat:  # the whole output as one array: rows need not split into vectors
        assert spec.reduction is None and spec.inner == 1 and (p.team, p.chunks, p.groups) == (1, 1, 1)
        assert p.seg_len == spec.channels and p.vec * {"float32": 4}.get(spec.dtype, 2) == 16
        return
    assert p.seg_len % p.vec == 0
    assert p.block % 32 == 0 and p.block % p.team == 0
    # Teams that reduce are powers of two; a pointwise chain's block team is whole warps.
    assert p.team & (p.team - 1) == 0 or (spec.reduction is None and p.team % 32 == 0 and p.team == p.block)
    assert p.team * p.nvec * p.vec * p.chunks >= p.seg_len  # every element has a thread
    if p.chunks > 1:
        assert p.team == p.block
    if p.staged:  # a block holds whole images of a channels-last y, in shared memory
        itemsize = {"float32": 4}.get(spec.dtype, 2)
        assert p.chunks == 1 and p.staged * spec.channels * spec.inner * itemsize <= 48 * 1024
        assert p.block == p.staged * p.groups * p.team if p.team <= 32 else (p.staged, p.groups) == (1, 1)


def test_plans_of_the_workloads():
    specs = workload_specs("bfloat16")
    assert plan(specs["w3_groupnorm"]).team == 2  # a group of 16 bf16 = two 16-byte vectors
    assert plan(specs["w2_logsumexp"]).team > 32  # a row of 8192 is a block's job
    w5 = plan(specs["w5_conv_groupnorm"])
    assert w5.chunks > 1 and 64516 % w5.vec == 0  # vectors stay inside one channel


def test_pointwise_chains_on_rows_that_split_badly_run_flat():
    awkward = awkward_specs("bfloat16")
    for name in ("flat_channel_operands", "flat_narrow_row", "pointwise_only"):
        p = plan(awkward[name])
        assert p.flat and p.vec == 8, name  # 16-byte vectors over the flat output
        source = cuda_templates.render(awkward[name], "sm90")
        assert f"constexpr long long kWrap = {awkward[name].channels};" in source
    # N = 33: elements' channels and per-channel operands one by one, as vectors cross rows
    assert "fusedepi::load_channel<W, kInner, kWrap>" in cuda_templates.render(awkward["flat_channel_operands"], "sm90")
    # rows that split into whole vectors over busy lanes, reductions and conv outputs keep a team a row
    specs = {**workload_specs("bfloat16"), **awkward}
    # and so does a padded GEMM's y, whose rows are longer than the output's
    for name in ("w1_bn_eval", "w3_groupnorm", "w5_conv_groupnorm", "layernorm_residual", "padded_gemm_softmax",
                 "padded_gemm_pointwise"):
        assert not plan(specs[name]).flat, name
        assert "constexpr long long kWrap = 0;" in cuda_templates.render(specs[name], "sm90")
    # float32 rows of 255: 4-element vectors would leave the last lane's vector short
    assert plan(awkward_specs("float32")["pointwise_only"]).flat


def test_float32_binary_steps_round_alone():
    # add.rn / sub.rn / mul.rn in float32 chains (no FMA across steps, as eager's kernels);
    # plain operators in 16-bit chains.
    steps = (Step("mul", consts=(1.5,), operand=SCALAR), Step("sub", consts=(0.25,), operand=SCALAR),
             Step("add", inputs=(0,), operand=CHANNEL, reverse=True))
    for dtype in ("float32", "bfloat16"):
        source = cuda_templates.render(EpilogueSpec(Anchor("mm"), steps, dtype, (dtype,), 64, 1, "linear_pointwise"),
                                       "sm90")
        assert "x = fusedepi::step_mul<kFastMath>(x, static_cast<float>(0x1.8000000000000p+0));" in source
        assert "x = fusedepi::step_sub<kFastMath>(x, static_cast<float>(0x1.0000000000000p-2));" in source
        assert re.search(r"x = fusedepi::step_add<kFastMath>\(pv0\[j\], x\);", source), source
    header = (Path(cuda_templates.__file__).parent / "include" / "fusedepi" / "epilogue.cuh").read_text()
    for name, op in (("add", "__fadd_rn"), ("sub", "__fsub_rn"), ("mul", "__fmul_rn")):
        body = header[header.index(f"float step_{name}("):]
        assert f"else return {op}(a, b);" in body[:200]


def test_sixteen_bit_chains_take_hardware_exp_and_division():
    steps = (Step("softplus", consts=(1.0, 20.0)), Step("exp"), Step("hardsigmoid"), Step("hardswish"), Step("mish"),
             Step("div", consts=(2.5,), operand=SCALAR, reverse=True), Step("div", consts=(3.0,), operand=SCALAR))
    for dtype, fast in (("bfloat16", "true"), ("float16", "true"), ("float32", "false")):
        source = cuda_templates.render(EpilogueSpec(Anchor("mm"), steps, dtype, (), 64, 1, "linear_pointwise"), "sm90")
        assert f"constexpr bool kFastMath = {fast};" in source
        for fn in ("softplus", "exponential", "mish"):
            assert f"fusedepi::{fn}<kFastMath>(x" in source, fn
        for fn in ("hardsigmoid", "hardswish"):  # ATen multiplies by 1/6 in every dtype
            assert f"fusedepi::{fn}(x" in source, fn
        # 2.5 / x: IEEE in float32 (eager's division), div.full in 16-bit chains (Triton's)
        assert "x = fusedepi::divide<kFastMath>(static_cast<float>(0x1.4000000000000p+1), x);" in source
        # x / 3: times the float reciprocal of 3, as eager divides by a scalar on CUDA
        assert "x = fusedepi::step_mul<kFastMath>(x, static_cast<float>(0x1.5555560000000p-2));" in source


@pytest.mark.parametrize("value", [3.0, 0.1, 7.0, -6.5, 1 / 3, 1e-40, 3e-39, 1e-45, 1e38, 3.4e38, 3.5e38, 1e300,
                                   0.0, -0.0, math.inf, -math.inf, math.nan, 2.0 ** -126, 1.0000001])
def test_scalar_reciprocal_rounds_as_float32_division(value):
    """The baked reciprocal is torch's float32 1 / float(value), bit for bit, and is
    computed without tensors: the backend renders under Dynamo's fake mode, where a
    tensor's value cannot be read (a build that did so fell back to Inductor)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    expected = torch.ones((), dtype=torch.float32) / torch.tensor(value, dtype=torch.float32)
    with FakeTensorMode():
        got = _float32_reciprocal(value)
        rendered = SNIPPETS["div"](Step("div", consts=(value,), operand=SCALAR), Operands())
    want = float(expected)
    if math.isnan(want):
        assert math.isnan(got)
    else:  # the same double: a float32 value, the same sign of zero
        assert (got, math.copysign(1.0, got)) == (want, math.copysign(1.0, want))
    assert rendered == f"x = fusedepi::step_mul<kFastMath>(x, {cfloat(got)});"


def test_earlier_values_are_held_in_registers_within_their_stage():
    awkward = awkward_specs("float32")
    source = cuda_templates.render(awkward["earlier_values_pointwise"], "sm90")
    assert source.count("const float h0 = x;") == 3  # stage0 and its _at and _cols forms
    assert "x = fusedepi::step_mul<kFastMath>(h0, x);  // mul" in source
    assert "x = fusedepi::step_add<kFastMath>(x, h0);  // add" in source
    source = cuda_templates.render(awkward["earlier_values_after_groupnorm"], "sm90")
    stage1 = source[source.index("void stage1("):]
    assert "const float h1 = x;" in stage1 and "x = fusedepi::step_sub<kFastMath>(h1, x);  // sub" in stage1
    with pytest.raises(ValueError, match="does not hold"):  # held across the reduction: the matcher refuses it too
        bad = replace(awkward["earlier_values_after_groupnorm"],
                      steps=awkward["earlier_values_after_groupnorm"].steps[:2] + (
                          Step("sub", consts=(0,), operand="earlier", reverse=True),))
        cuda_templates.render(bad, "sm90")


def test_channels_last_convs_stage_whole_images():
    awkward = awkward_specs("bfloat16")
    packed = plan(awkward["channels_last_groupnorm"])  # 2 images of 80 a row, 2 x 4 lanes an image
    assert (packed.team, packed.groups, packed.staged, packed.block) == (4, 2, 32, 256)
    one = plan(awkward["channels_last_odd_image"])  # 5 x 529 elements: a block an image, scalar
    assert (one.staged, one.vec, one.team) == (1, 1, one.block)
    source = cuda_templates.render(awkward["channels_last_groupnorm"], "sm90")
    assert "constexpr int kStaged = 32;" in source and "stage_images(a, img);" in source
    assert "constexpr int kStaged = 0;" in cuda_templates.render(awkward["pointwise_only"], "sm90")


def test_channels_last_pointwise_chains_apply_while_staging():
    """Staging applies a pointwise chain whose operands are per channel (a thread's
    vectors share their channels); a full-tensor operand, a norm, or a block whose
    vectors start at different channels leave it to the apply loop."""
    awkward = awkward_specs("bfloat16")
    spec, per_channel = awkward["channels_last_pointwise"], awkward["channels_last_per_channel"]
    assert cuda_templates.render(per_channel, "sm90").count("constexpr bool kStagedApply = true;") == 1
    misaligned = replace(per_channel, channels=24)  # 24 does not divide a block's 128 x 8 channels
    for other in (spec, misaligned, awkward["channels_last_groupnorm"], awkward["pointwise_only"]):
        assert "constexpr bool kStagedApply = false;" in cuda_templates.render(other, "sm90")


@pytest.mark.parametrize("change, reason, tiled", [
    (dict(channels=64, inner=32 * 32), "does not fit 48 KiB", True),
    (dict(inner=1), "1 x 1 output", False),
    (dict(steps=(Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=3),), channels=3, inner=4000),
     "longer than a warp holds", False),  # (and 3 channels: vectors of one, 2 bytes, too few for pixel groups)
    (dict(steps=(Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(0, 1, 2, 3)),)), "batchnorm_train is not", True),
    (dict(saves=(Save("value", "bfloat16", (-1, 16, 9, 18), 16 * 162),)), "saved for backward", False),
])
def test_channels_last_refusals(change, reason, tiled):
    """What the staged kernel refuses; pointwise chains of large images and BatchNorm
    take tiles instead, the rest no channels-last mapping at all."""
    spec = replace(awkward_specs("bfloat16")["channels_last_pointwise"], **change)
    assert reason in cuda_templates.staged_plan(spec)
    if tiled:
        assert plan(spec).tiled
        return
    with pytest.raises(cuda_templates.NotRenderable, match="channels-last conv: "):
        plan(spec)


def test_tiles_take_pointwise_and_batchnorm_chains_and_refuse_the_rest():
    specs = tiled_specs("bfloat16")
    p = plan(specs["tiled_relu_bias"])
    assert (p.tile, p.tile_c, p.cvec, p.vec) == (128, 64, 8, 4)  # 128 bytes of channels a pixel, 16 KiB a tile
    assert (plan(specs["tiled_six_channels_batchnorm"]).tile_c, plan(specs["tiled_odd_planes_forty_eight"]).vec) == (6, 1)
    source = cuda_templates.render(specs["tiled_batchnorm_relu"], "sm90")
    assert "constexpr long long kColRows = 9216;" in source and "constexpr bool kTiledNorm = true;" in source
    assert "column_parts(rows * kInner);" in source and "colstats<<<dim3(col_parts, " in source
    bn = specs["tiled_batchnorm_relu"]
    gn = Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=64)
    refused = {
        "not groupnorm": replace(bn, steps=(gn, Step("relu")), param_dtypes=()),
        "read by element before BatchNorm": replace(
            bn, steps=(Step("add", inputs=(5,), operand=FULL),) + bn.steps, param_dtypes=bn.param_dtypes * 2),
        "saved for backward": replace(bn, saves=(Save("value", "bfloat16", (-1, 64, 96, 96), 64 * 9216),)),
        "spatial_mean after the norm": replace(bn, steps=bn.steps + (Step("spatial_mean"),)),
    }
    for reason, spec in refused.items():
        assert reason in tiled_plan(spec), reason


def test_channels_last_groupnorm_reads_pixel_groups_where_images_do_not_fit():
    """A GroupNorm's group of a pixel is a vector of y where the staged kernel cannot hold
    the image; not where it is under 8 bytes, nor with an operand read per element."""
    spec = pixel_group_specs("float32")["pixel_groups_gn_silu"]
    assert "does not fit 48 KiB" in cuda_templates.staged_plan(spec)
    p = plan(spec)
    assert p.pixel_groups and p.vec == 4 and p.team == 512 and p.chunks == 1
    source = cuda_templates.render(spec, "sm90")
    assert "pixel_group_store(a, p, c0, v);" in source and "constexpr int kSub = 1;" in source
    sixteen = plan(pixel_group_specs("bfloat16")["pixel_groups_sixteen_channels_mean"])
    assert sixteen.pixel_groups and sixteen.vec == 8 and sixteen.team % 2 == 0
    assert "pixel_group_parts(p)" in cuda_templates.render(pixel_group_specs("bfloat16")["pixel_groups_sixteen_channels_mean"], "sm90")
    narrow = replace(spec, steps=(Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=5),), channels=5,
                     param_dtypes=())
    assert "less than 8 bytes" in pixel_group_plan(narrow)
    bundles = plan(pixel_group_specs("float32")["pixel_groups_instancenorm_bundles"])
    assert bundles.pixel_groups and bundles.vec == 4 and bundles.groups == 8 and bundles.seg_len == 4 * 48 * 48
    source = cuda_templates.render(pixel_group_specs("bfloat16")["pixel_groups_instancenorm_bundles"], "sm90")
    assert "constexpr int kVecGroups = 8;" in source and "constexpr int kBundle = 8;" in source
    residual = replace(spec, steps=spec.steps + (Step("add", inputs=(3,), operand=FULL),), param_dtypes=("float32",) * 4)
    assert "read at each element's place" in pixel_group_plan(residual)


def test_padded_gemm_files_pad_x_in_their_own_kernel():
    awkward = awkward_specs("bfloat16")
    padded = cuda_templates.render(awkward["padded_gemm_pointwise"], "sm90")
    assert "constexpr long long kPadK = 152;" in padded and "pad_rows<<<" in padded
    plain = cuda_templates.render(awkward["pointwise_only"], "sm90")  # no pad kernel: fusedepi_pad_rows refuses
    assert "constexpr long long kPadK = 0;" in plain and "pad_rows.cuh" not in plain and "pad_rows<<<" not in plain
    assert "return static_cast<int>(cudaErrorNotSupported);" in plain


def test_channels_last_pooling_windows_tile_what_shared_memory_holds():
    specs = vocabulary_specs()
    spec = specs["channels_last_maxpool_30x30"]
    assert cuda_templates.channels_last_plan(spec).pool
    wide = replace(spec, channels=6000)
    assert "pooling window of 6000 channels-last channels" in cuda_templates.channels_last_plan(wide)
    with pytest.raises(cuda_templates.NotRenderable, match="shared memory"):
        plan(wide)
    assert plan(replace(wide, anchor=CONV)).pool  # NCHW: no tile


def test_no_channels_last_form_returns_values_saved_for_backward():
    # A training graph's saved anchor output would leave the fused op channels-last,
    # where the graph (and the op's fake) has it contiguous.
    spec = replace(vocabulary_specs()["channel_amax_96x900"], anchor=CHANNELS_LAST)
    assert cuda_templates.channels_last_plan(spec).pixels
    saved = replace(spec, saves=(Save("value", spec.dtype, (-1, 96, 30, 30), 96 * 900, at=0),))
    assert "saved for backward" in cuda_templates.channels_last_plan(saved)


def test_row_reduction_too_long_is_not_renderable():
    spec = workload_specs("float32")["w2_logsumexp"]
    long_row = EpilogueSpec(spec.anchor, spec.steps, spec.dtype, (), 1 << 20, 1, spec.fusion)
    with pytest.raises(cuda_templates.NotRenderable, match="one block holds at most"):
        cuda_templates.render(long_row, "sm90")


def test_direct_conv_plans():
    w5 = direct_specs()["w5_direct"]
    d = cuda_templates.direct_plan(w5)
    assert isinstance(d, cuda_templates.DirectPlan)
    assert (d.tile_h, d.copad, d.out_vec, d.tiles) == (8, 32, 2, 32)  # 254 rows in 32 tiles of 8
    assert d.smem <= 110 * 1024  # two blocks per SM
    assert cuda_templates.kernel_name(w5, "sm90").startswith("directconv_")
    source = cuda_templates.render(w5, "sm90")
    assert "fusedepi_anchor_inside() { return 1; }" in source
    # float32: one launch computes the conv and normalizes earlier images (after the counters' reset)
    launches = source[source.index("extern \"C\" int fusedepi_run"):]
    assert "cudaMemsetAsync(conv_counters(a)" in launches and launches.count("<<<") == 1
    assert "_twophase<<<" in launches and "conv_tile(a, n, tile);" in source and "apply_tile(a, n, tile);" in source
    assert '#include "fusedepi/direct_conv.cuh"' in source and "return a.mid;" in source  # conv_dst: y, then normalized
    pointwise = cuda_templates.render(direct_specs()["direct_pointwise_k5_pad2"], "sm90")
    assert "_apply<<<" not in pointwise and "_onephase<<<" in pointwise  # one kernel writes `out`
    assert "conv_tile(a, n, tile);" in pointwise and "_twophase" not in pointwise and "return a.out;" in pointwise
    assert cuda_templates.direct_plan(direct_specs()["direct_pointwise_k5_pad2"]).copad == 32  # 20 -> 32


def test_direct_conv_lag_keeps_the_stored_value_in_l2():
    # Phase 2 of the FMA/TF32 kernels reads back what phase 1 stored: the launcher caps the
    # lag at the images whose stored values fill 3/4 of L2. W5: 32 channels x 8 rows x 254
    # columns x 4 bytes a tile; the bf16 kernel stores nothing and keeps the plain lag.
    def mid_tile(spec, **kw):
        launches = cuda_templates.render(spec, "sm90", **kw).split('extern "C" int fusedepi_run')[1]
        found = re.search(r"const long long mid_tile = (\d+)LL;", launches)
        return int(found.group(1)) if found else 0  # (no bound emitted)

    w5 = direct_specs()["w5_direct"]
    assert mid_tile(w5) == mid_tile(w5, conv_tf32=True) == 32 * 8 * 254 * 4
    bf16 = cuda_templates.render(direct_specs("bfloat16")["w5_direct"], "sm90")
    assert mid_tile(direct_specs("bfloat16")["w5_direct"]) == 0 and "l2[device] / 4" not in bf16
    launches = cuda_templates.render(w5, "sm90").split('extern "C" int fusedepi_run')[1]
    assert "cudaDevAttrL2CacheSize" in launches and "fit > kTiles ? fit : kTiles" in launches  # never under an image


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(direct=()), "groups 1"),
        (dict(conv=((2, 2), (0, 0), (1, 1), False, (0, 0), 1)), "the direct conv takes 1 and 1"),
        (dict(conv=((1, 1), (0, 0), (2, 2), False, (0, 0), 1)), "the direct conv takes 1 and 1"),
        (dict(has_bias=True), "keeps its bias"),
    ],
)
def test_direct_conv_falls_back_to_the_library_conv(change, reason):
    from dataclasses import replace

    w5 = direct_specs()["w5_direct"]
    spec = replace(w5, anchor=replace(w5.anchor, **change))
    assert reason in cuda_templates.direct_plan(spec)
    assert not cuda_templates.kernel_name(spec, "sm90").startswith("direct")
    assert "fusedepi_anchor_inside() { return 0; }" in cuda_templates.render(spec, "sm90")


def test_direct_conv_kinds():
    w5_bf16 = direct_specs("bfloat16")["w5_direct"]
    d = cuda_templates.direct_plan(w5_bf16)
    assert d.kind == "mma" and (d.tile_h, d.tiles) == (16, 16)
    source = cuda_templates.render(w5_bf16, "sm90")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
    # one launch: statistics pass (phase 1), then the output pass (phase 2), which normalizes in registers
    launches = source[source.index('extern "C" int fusedepi_run'):]
    assert launches.count("<<<") == 1 and "_twophase<<<" in launches
    assert '#include "fusedepi/direct_conv_mma.cuh"' in source
    assert "mma_tile<0>(a, n, tile);" in source and "mma_tile<1>(a, n, tile);" in source
    assert cuda_templates.direct_plan(direct_specs()["w5_direct"]).kind == "fma"
    # 3 input channels do not fill a 16-byte chunk: bf16 runs the FMA kernel (or, without
    # DIRECT_FMA_16BIT, the library conv)
    assert cuda_templates.direct_plan(direct_specs("bfloat16")["direct_pointwise_k5_pad2"]).kind == "fma"
    # Turing has no m16n8k16 bf16/fp16 mma: its chains keep the library conv there
    assert "sm_80" in cuda_templates.direct_plan(w5_bf16, "sm75")
    assert cuda_templates.kernel_name(w5_bf16, "sm75").startswith("conv_")
    assert cuda_templates.direct_plan(direct_specs()["w5_direct"], "sm75").kind == "fma"
    # The two GroupNorm phases synchronize through ld.acquire: not before Volta
    assert "sm_70" in cuda_templates.direct_plan(direct_specs()["w5_direct"], "sm61")
    assert cuda_templates.direct_plan(direct_specs()["direct_pointwise_k5_pad2"], "sm61").kind == "fma"


def test_direct_conv_limits():
    from dataclasses import replace

    w5 = direct_specs()["w5_direct"]
    narrow = replace(w5, anchor=replace(w5.anchor, direct=(8, 3, 3, 256, 34)), inner=254 * 32)
    assert "leaves most" in cuda_templates.direct_plan(narrow)
    deep = replace(w5, anchor=replace(w5.anchor, direct=(64, 3, 3, 256, 256)))
    assert "taps" in cuda_templates.direct_plan(deep)
    wide = replace(w5, channels=128, steps=w5.steps[:-1] + (replace(w5.steps[-1], groups=8),))
    assert "output channels" in cuda_templates.direct_plan(wide)


def test_constants_are_exact_float_conversions():
    assert cfloat(0.01) == f"static_cast<float>({(0.01).hex()})"
    assert cfloat(float("inf")) == "INFINITY" and cfloat(float("-inf")) == "(-INFINITY)"


def test_template_headers_document_every_placeholder():
    from cuda_templates import templates

    from cuda_templates import conv_sm90, gemm_sm90

    for module, template in ((templates, templates.KERNEL_FILE), (gemm_sm90, gemm_sm90.GEMM_KERNELS),
                             (conv_sm90, conv_sm90.CONV_KERNELS)):
        documented = set(re.findall(r"#\s+\$(\w+)", open(module.__file__).read()))
        used = set(re.findall(r"\$\{?(\w+)", template.template))
        assert used and used <= documented, used - documented


def _compile_job(test: str, name: str, arch: str = "sm90a") -> tuple[str, str, str]:
    """(source, kernel name, nvcc arch) that the compile test `test` builds for `name`."""
    if test == "test_nvcc_compiles":
        spec = ALL_SPECS[name]
        return cuda_templates.render(spec, arch), cuda_templates.kernel_name(spec, arch), arch
    if test == "test_nvcc_compiles_tf32_direct_convs":
        spec = TF32_SPECS[name]
        return cuda_templates.render(spec, arch, conv_tf32=True), cuda_templates.kernel_name(spec, arch, True), arch
    if test == "test_nvcc_compiles_the_in_kernel_conv":  # wgmma and TMA, sm_90a only; float32 where TF32 is allowed
        spec = CONV_GEMM_SPECS[name]
        return cuda_templates.render(spec, "sm90", conv_tf32=True), cuda_templates.kernel_name(spec, "sm90", True), "sm90a"
    spec = GEMM_SPECS[name]  # test_nvcc_compiles_the_in_kernel_gemm: wgmma and TMA, sm_90a only (build_arch)
    return cuda_templates.render(spec, "sm90"), cuda_templates.kernel_name(spec, "sm90"), "sm90a"


_COMPILE_TESTS = ("test_nvcc_compiles", "test_nvcc_compiles_tf32_direct_convs", "test_nvcc_compiles_the_in_kernel_gemm",
                  "test_nvcc_compiles_the_in_kernel_conv")


@pytest.fixture(scope="session")
def nvcc_builds(request, tmp_path_factory):
    """The builds of every compile test this session runs, started together on all
    cores (nvcc runs one core a build): {(test, name, arch): future of the library}."""
    cache = tmp_path_factory.getbasetemp() / "kernel-cache"
    keys = [(item.originalname, item.callspec.params["name"], item.callspec.params.get("arch", "sm90a"))
            for item in request.session.items if getattr(item, "originalname", "") in _COMPILE_TESTS]
    pool = concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 2))
    builds = {key: pool.submit(lambda key=key: cuda_templates.build(*_compile_job(*key), cache)) for key in keys}
    yield builds
    pool.shutdown(cancel_futures=True)


def _assert_builds(nvcc_builds, test, name, arch="sm90a"):
    """nvcc builds the test's source into a non-empty library (a cache shared by the session's tests)."""
    library = nvcc_builds[(test, name, arch)].result()
    assert library.exists() and library.stat().st_size > 0


# The compile tests build one representative spec per kernel form and architecture
# (`representatives`), plus specs until every step appears with every operand kind it
# takes; FUSEDEPI_TEST_ALL_SPECS=1 builds every spec (after a change to the templates).
ALL_BUILDS = os.environ.get("FUSEDEPI_TEST_ALL_SPECS", "") == "1"


def _form(spec: EpilogueSpec, arch: str, conv_tf32: bool = False) -> tuple:
    """What decides which template code a spec's file holds: float32 or 16-bit, its
    kernels and the launch plan's switches (its steps are covered apart)."""
    source = cuda_templates.render(spec, arch, conv_tf32=conv_tf32)
    kernel = cuda_templates.kernel_name(spec, arch, conv_tf32)
    kernels = tuple(sorted(set(re.findall(rf"\b{re.escape(kernel)}_(\w+)\s*(?:<[^>]*>)?\(", source))))
    switches = tuple(re.findall(r"constexpr (?:int|bool|long long) (k(?:Staged|StagedApply|Wrap|PadK|Chunks|Team|"
                                r"Stage0Done|ConvStats|Recompute|RowReduce|RowReads|Bias|Sub|VecGroups|TiledNorm|ColRows|MaySpareWarps)) = (true|false|\d+);", source))
    coarse = tuple((k, v if v in ("true", "false") else str(int(v) > (32 if k == "kTeam" else 1 if k in ("kChunks", "kVecGroups", "kColRows") else 0)))
                   for k, v in switches)
    return ("float32" if spec.dtype == "float32" else "16-bit", kernel.split("_")[0], kernels, coarse)


def representatives(specs: dict, arch: str, conv_tf32: bool = False) -> list[str]:
    """Names of `specs` that cover every form (`_form`), every kernel family in every
    dtype, every (step, operand kind), and values saved for backward."""
    if ALL_BUILDS:
        return list(specs)

    def covers(spec):
        family = cuda_templates.kernel_name(spec, arch, conv_tf32).split("_")[0]
        form = _form(spec, arch, conv_tf32)
        strided = spec.anchor.kind == "conv" and bool(spec.anchor.direct) and not spec.anchor.unit_stride
        return ({("form",) + form, ("dtype", family, spec.dtype), ("saves", bool(spec.saves)), ("strided", strided)}
                | {("step", s.name, s.operand) for s in spec.steps}
                | {("broadcast",) + form for s in spec.steps if s.operand == BROADCAST})

    chosen, covered = [], set()
    for name, spec in specs.items():
        new = covers(spec) - covered
        if new:
            chosen.append(name)
            covered |= new
    return chosen


def test_representatives_cover_every_step_and_form():
    for arch in ("sm80", "sm90a"):
        chosen = representatives(ALL_SPECS, arch)
        assert ALL_BUILDS or len(chosen) < len(ALL_SPECS)
        assert {_form(ALL_SPECS[n], arch) for n in chosen} == {_form(s, arch) for s in ALL_SPECS.values()}
        assert {ALL_SPECS[n].dtype for n in chosen} == set(DTYPES)
        assert {(s.name, s.operand) for n in chosen for s in ALL_SPECS[n].steps} == {
            (s.name, s.operand) for spec in ALL_SPECS.values() for s in spec.steps}
        assert {s.name for n in chosen for s in ALL_SPECS[n].steps} == set(VOCABULARY)


@needs_nvcc
@pytest.mark.parametrize("name, arch", [(n, a) for a in ("sm80", "sm90a") for n in representatives(ALL_SPECS, a)])
def test_nvcc_compiles(name, arch, nvcc_builds):
    _assert_builds(nvcc_builds, "test_nvcc_compiles", name, arch)


TF32_SPECS = {f"{name}-tf32": spec for name, spec in direct_specs("float32").items()
              if getattr(cuda_templates.direct_plan(spec, "sm90", conv_tf32=True), "kind", "") == "tf32"}


@needs_nvcc
@pytest.mark.parametrize("name, arch", [(n, a) for a in ("sm80", "sm90a") for n in representatives(TF32_SPECS, a, True)])
def test_nvcc_compiles_tf32_direct_convs(name, arch, nvcc_builds):
    _assert_builds(nvcc_builds, "test_nvcc_compiles_tf32_direct_convs", name, arch)


GEMM_SPECS = {
    f"{name}-{dtype}": spec for dtype in ("bfloat16", "float16", "float32") for name, spec in gemm_specs(dtype).items()
}
WGMMA = {"bfloat16": "m64n256k16.f32.bf16.bf16", "float16": "m64n256k16.f32.f16.f16", "float32": "m64n256k8.f32.tf32.tf32"}


@pytest.mark.parametrize("name", list(GEMM_SPECS))
def test_in_kernel_gemm_plans_and_names(name):
    spec = GEMM_SPECS[name]
    g = cuda_templates.gemm_plan(spec, "sm90")
    assert isinstance(g, cuda_templates.GemmPlan)
    red = spec.reduction
    assert g.group == (spec.channels // red.groups if red is not None and red.name == "groupnorm" else 0)
    assert g.reduce == (red.name if red is not None and red.name != "groupnorm" else "")
    assert cuda_templates.build_arch(spec, "sm90") == "sm90a"
    kernel = cuda_templates.kernel_name(spec, "sm90")
    assert kernel.startswith("wgmma128x256_") and kernel.endswith("_sm90a")
    source = cuda_templates.render(spec, "sm90")
    assert source.count(f"wgmma.mma_async.sync.aligned.{WGMMA[spec.dtype]} ") == 1
    # 128 accumulators, the two descriptors; 16-bit operands say they are not transposed
    # (both K-major), TF32 takes no such operands (K-major only).
    assert f"%127}}, %128, %129, p, 1, 1{'' if spec.dtype == 'float32' else ', 0, 0'};" in source
    assert f"constexpr bool kBias = {'true' if spec.anchor.kind == 'addmm' else 'false'};" in source
    assert ("constexpr bool kRowReads = true;" in source) == ("residual" in name)
    assert "fusedepi_anchor_inside() { return 1; }" in source
    # Only the GEMM and the row reductions' finishing kernel use the workspace: the
    # launcher passes none on the calls that run the epilogue kernel after cuBLAS.
    before_gemm = source[: source.index("// In-kernel GEMM")]
    apply = source[source.index("_apply(Args a)"):source.index("}  // namespace")]
    assert "a.ws" not in before_gemm and "a.ws" not in apply
    # Elsewhere than sm_90 the library GEMM runs first, and the epilogue kernel follows.
    assert "needs sm_90" in cuda_templates.gemm_plan(spec, "sm80")
    assert "wgmma" not in cuda_templates.render(spec, "sm80")


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda s: replace(s, dtype="float32", anchor=replace(s.anchor, gemm=(258, 1))), "K=258 is not a multiple of 4"),
        (lambda s: replace(s, channels=8200, steps=s.steps[:1] + (replace(s.steps[1], groups=1025),) + s.steps[2:]),
         "N=8200 is not a multiple"),
        (lambda s: replace(s, anchor=replace(s.anchor, gemm=(255, 1))), "K=255 is not a multiple of 8"),
        (lambda s: replace(s, anchor=replace(s.anchor, gemm=())), "not x @ w^T"),
        (lambda s: replace(s, steps=(replace(s.steps[0], groups=2048),) + s.steps[1:]), "groups of 4 columns"),
        (lambda s: replace(s, steps=(Step("softmax"),)), "softmax: its statistics span"),
        (lambda s: replace(s, steps=(Step("gelu"), Step("logsumexp", keepdim=True))), "gelu before logsumexp"),
        (lambda s: replace(s, steps=(Step("layernorm", consts=(1e-5,), inputs=(-1, -1)),)), "layernorm"),
        (lambda s: replace(s, saves=(Save("mean", "float32", (-1, 256), 256),)), "saved for backward"),
        # Workload 4: measured slower in the in-kernel GEMM (its chain runs in the consumers).
        (lambda s: replace(s, steps=s.steps[:1] + (Step("silu"),) + s.steps[2:]),
         "silu: GroupNorm chains with per-element"),
        (lambda s: replace(s, steps=s.steps + (Step("div", consts=(3.0,), operand=SCALAR),)), "div: GroupNorm chains"),
    ],
)
def test_in_kernel_gemm_refusals_name_the_reason(change, reason):
    spec = change(gemm_specs("bfloat16")["gemm_groupnorm32_mul"])
    found = cuda_templates.gemm_plan(spec, "sm90")
    assert isinstance(found, str) and reason in found
    assert not cuda_templates.kernel_name(spec, "sm90").startswith("wgmma")


def test_in_kernel_gemm_auto_rule_and_its_library_fallback():
    # FUSEDEPI_IN_KERNEL_GEMM=auto: tiles for every SM, the last wave at least 3/4 full.
    assert cuda_templates.fills_gpu(16384, 4096, 132)  # workload 1: 2048 tiles, 16 waves
    assert cuda_templates.fills_gpu(1024, 8192, 132)  # workloads 2-4: 256 tiles, 2 waves 97% full
    assert not cuda_templates.fills_gpu(1000, 512, 132)  # 16 tiles
    assert not cuda_templates.fills_gpu(128 * 35, 1024, 132)  # 140 tiles: the second wave 6% full
    assert cuda_templates.fills_gpu(128 * 33, 1024, 132)  # 132 tiles: one full wave
    # Else the launcher runs cuBLAS and passes null operands: the file's epilogue kernel
    # runs the chain, with GroupNorm's statistics in a team as the library path's kernel.
    for name in ("gemm_w1_eval", "gemm_w3_groupnorm"):
        spec = gemm_specs("bfloat16")[name]
        source = cuda_templates.render(spec, "sm90")
        fallback = source[source.index("if (a.x == nullptr)"):]
        assert fallback.index("_apply<<<") < fallback.index("gemm_launch(a, device, stream)")
        apply = source[source.index("_apply(Args a)"):source.index("}  // namespace")]
        assert ("team_moments(p, v," in apply) == (spec.reduction is not None)


@pytest.mark.parametrize("name", ["gemm_w2_logsumexp", "gemm_scale_amin", "gemm_relu_mean"])
def test_in_kernel_gemm_row_reductions_write_partials_then_finish(name):
    # The tiles write a (row, column tile) partial each and no [rows, N] tile; a second
    # kernel combines a row's partials and runs the steps after the reduction. The
    # library path's calls run the epilogue kernel's row reduction instead.
    spec = gemm_specs("bfloat16")[name]
    source = cuda_templates.render(spec, "sm90")
    assert "constexpr bool kRowReduce = true;" in source
    assert f"kStages = {cuda_templates.gemm_sm90.STAGES_ROW_REDUCE};" in source
    # The tile's partials of this reduction (gemm_sm90.cuh's consumers write them to a.ws).
    op = cuda_templates.gemm_sm90.ROW_PARTIALS[spec.reduction.name]
    assert ("void tile_partials(const float (&d)[128], int h, float& p0, float& p1) {\n"
            f"  row_tile_partials<{op}>(d, h, p0, p1);") in source
    assert f"const float row = row_combine<{op}>(parts, lane);" in source  # the second kernel's
    launch = source[source.index("} else {", source.index("if (a.x == nullptr)")):]
    assert launch.index("gemm_launch(a, device, stream)") < launch.index("_rowfinal<<<(rows + 7) / 8, 256")
    assert "return rows * kTilesN * 2; }" in source  # the workspace: a float2 a (row, column tile)
    apply = source[source.index("_apply(Args a)"):source.index("}  // namespace")]
    assert "a.out[p.seg] = fusedepi::from_float<T>(row);" in apply  # the library path's row store
    # Pointwise and GroupNorm chains keep the staging tile and 3 stages.
    w1 = cuda_templates.render(gemm_specs("bfloat16")["gemm_w1_eval"], "sm90")
    assert "constexpr bool kRowReduce = false;" in w1 and "_rowfinal" not in w1 and "kStages = 3;" in w1


def test_an_in_kernel_gemm_whose_consumers_run_the_chain_has_no_spare_warp_kernel():
    """`Anchor.gemm_consumers` (the `gemm_consumers` form): the file's switch is off, so
    `kSpareWarps` is false and the launch names only the plain kernel; the name says so."""
    spec = GEMM_SPECS["gemm_tanh_consumers-bfloat16"]
    source = cuda_templates.render(spec, "sm90")
    assert "constexpr bool kMaySpareWarps = false;" in source
    assert cuda_templates.kernel_name(spec, "sm90").startswith("wgmma128x256_consumers_addmm_tanh_mul_bf16")
    spare = replace(spec, anchor=replace(spec.anchor, gemm_consumers=False))
    assert "constexpr bool kMaySpareWarps = true;" in cuda_templates.render(spare, "sm90")
    assert cuda_templates.kernel_name(spare, "sm90").startswith("wgmma128x256_addmm_tanh_mul_bf16")
    assert "kMaySpareWarps = true;" in cuda_templates.render(GEMM_SPECS["gemm_w1_eval-bfloat16"], "sm90")


def test_in_kernel_gemm_in_tf32_stages_float32_tiles_in_two_rounds():
    # 128-byte rows along K: 32 float32 values a stage, four k8 wgmmas of 32 bytes each; the
    # 64 KB staging tile holds 128 of a float32 tile's 256 columns, so it goes out in two
    # rounds of four 32-column boxes, and the consumers run the chain themselves.
    # (The rounds, boxes and the spare warps follow from sizeof(T) in the C++ itself, the
    # same text for every dtype: the nvcc compile of each spec and the GPU tests check them.)
    assert cuda_templates.gemm_sm90.block_k("float32") == 32 and cuda_templates.gemm_sm90.block_k("bfloat16") == 64
    for name in ("gemm_w1_eval", "gemm_w3_groupnorm", "gemm_w2_logsumexp"):
        source = cuda_templates.render(gemm_specs("float32")[name], "sm90")
        assert "constexpr int kMmaK = 8;" in source and "using T = float;" in source
        assert "kBN = 256, kBK = 32, kStages = " in source
        # TF32 takes no transpose operands; 16-bit wgmma says both are K-major.
        assert "m64n256k8.f32.tf32.tf32 {" in source and "p, 1, 1;" in source and "p, 1, 1, 0, 0;" not in source
        # At "highest" the launcher runs cuBLAS and this file's epilogue kernel instead.
        assert "if (a.x == nullptr)" in source and "_apply<<<" in source
    bf16 = cuda_templates.render(gemm_specs("bfloat16")["gemm_w1_eval"], "sm90")
    assert "kBK = 64" in bf16 and "constexpr int kMmaK = 16;" in bf16 and "p, 1, 1, 0, 0;" in bf16


@needs_nvcc
@pytest.mark.parametrize("name", representatives(GEMM_SPECS, "sm90"))
def test_nvcc_compiles_the_in_kernel_gemm(name, nvcc_builds):
    _assert_builds(nvcc_builds, "test_nvcc_compiles_the_in_kernel_gemm", name)


CONV_GEMM_SPECS = {
    f"{name}-{dtype}": spec for dtype in ("bfloat16", "float32") for name, spec in conv_gemm_specs(dtype).items()
}


@pytest.mark.parametrize("name", list(CONV_GEMM_SPECS))
def test_in_kernel_conv_plans_and_names(name, monkeypatch):
    from cuda_templates import conv_sm90

    monkeypatch.setattr(conv_sm90, "REDUCES", True)  # the spatial reductions' specs
    monkeypatch.setattr(conv_sm90, "PIXEL_NORMS", True)  # ... and the channel softmax's
    monkeypatch.setattr(conv_sm90, "POOLS_IN_TILE", True)  # ... and the pooling windows'
    monkeypatch.setattr(conv_sm90, "PIXEL_REDUCES", True)  # ... and the reductions over a pixel's channels
    spec = CONV_GEMM_SPECS[name]
    c = cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True)
    assert isinstance(c, cuda_templates.ConvGemmPlan), c
    source = cuda_templates.render(spec, "sm90", conv_tf32=True)
    # Channel tiles of at most 256, in 8s, as few as cover C_out; a pixel patch as wide
    # as the output (8 to 128), where its input box of the patch's width times the stride
    # fits TMA's 256, or narrower where fewer columns fall outside (not where it reads x
    # NCHW: whole boxes of 64).
    widths = conv_sm90.BLOCK_N[2 if spec.dtype != "float32" else 4]  # the widths checked on a GPU
    tiles = -(-spec.channels // c.block_n)
    assert c.block_n in widths and tiles == -(-spec.channels // widths[-1])
    assert c.block_n == min(n for n in widths if n * tiles >= spec.channels)
    assert c.stages >= 3
    ho, wo = spec.anchor.direct_out_hw()
    (sh, sw), _, (dh, dw) = spec.anchor.plane_conv()
    itemsize = 4 if spec.dtype == "float32" else 2
    # 256 pixels where a ping-pong tile of few channels runs over narrow k-steps and the
    # patch's rows fit the output's height
    tall = (c.pingpong and c.block_n <= conv_sm90.TALL_MAX_N and c.k_bytes <= conv_sm90.TALL_MAX_K_BYTES
            and 256 // c.tile_w <= ho)
    assert c.block_m == (256 if tall else 128) and f"kBM = {c.block_m}, kBN = {c.block_n}," in source
    assert c.tile_h * c.tile_w == c.block_m and (c.tile_w == 8 or c.tile_w < 2 * wo)
    # (the widest patch whose box fits; with a pool, whose rows hold a window's)
    patch_w = min(wo, 128 // c.pool[0]) if c.pool else wo
    widest = conv_sm90.tiling(c.block_n, patch_w, itemsize, stride_w=sw, narrow=False).tile_w
    assert widest >= min(patch_w, 128) or 2 * widest * sw > 256  # as wide as the output, or as the box allows
    chosen = widest if c.nchw else conv_sm90.patch_width(patch_w, widest)
    # (narrower where a kernel column's taps then share a box of x: as many columns covered)
    # (or, with a window, 64 or 128 columns)
    assert c.tile_w == chosen or ((c.shared_rows or c.window) and conv_sm90.SHARED_ROWS_PATCH_W <= c.tile_w < chosen
                                  and -(-patch_w // c.tile_w) * c.tile_w == -(-patch_w // chosen) * chosen)
    assert c.tile_w * sw <= 256 and c.tile_h * sh <= 256
    assert cuda_templates.build_arch(spec, "sm90", True) == "sm90a"
    kernel = cuda_templates.kernel_name(spec, "sm90", True)
    assert kernel.startswith(f"igemm{c.block_m}x{c.block_n}_") and kernel.endswith("_sm90a")
    assert f"constexpr int kPitch = {conv_sm90.staging_pitch(c.tile_h, c.tile_w, itemsize)};" in source
    assert f"constexpr int kSH = {sh}, kSW = {sw}, kDH = {dh}, kDW = {dw};" in source
    assert f"constexpr int kHoPlane = {ho}, kHo = kDo * kHoPlane, kWo = {wo};" in source
    # A 3-D conv: its depth's constants; a 2-D conv one plane, a tap deep
    (kd, d), do = spec.anchor.depth or (1, 1), spec.anchor.direct_out_d()
    sd, pd, dd = (p[0] for p in spec.anchor.conv[:3]) if spec.anchor.depth else (1, 0, 1)
    assert (f"constexpr int kD = {d}, kKD = {kd}, kPD = {pd}, kSD = {sd}, kDD = {dd}, kDo = {do};" in source
            and f"constexpr bool kDepth = {'true' if spec.anchor.depth else 'false'};" in source)
    assert not (spec.anchor.depth and c.nchw)
    # A k-step of the narrowest swizzle (64, 128 bytes) that holds a pixel's C_in,
    # 128 bytes where none does; the weight padded to whole k-steps of it.
    cin = spec.anchor.direct[0]
    step = min([b for b in (64, 128) if b >= cin * itemsize] or [128])
    assert c.k_bytes == step and f"kBK = {step // itemsize}," in source
    cin_pad = conv_sm90.padded_in_channels(cin, spec.dtype)
    assert cin_pad % (step // itemsize) == 0 and cin <= cin_pad < cin + step // itemsize
    # Ping-pong (each consumer warpgroup a whole tile: block_n accumulators a thread) up
    # to 128 channels a tile, the cooperative schedule above.
    assert c.pingpong == (c.block_n <= conv_sm90.PINGPONG_MAX_N == 128)
    assert f"constexpr bool kPingPong = {'true' if c.pingpong else 'false'};" in source
    # A kernel column's taps share one box of x, tile_h + (kh - 1) x dilation rows, where
    # the stride along the height is 1 and the k-steps are narrow; a stage then holds that
    # box and kh taps' weights.
    kh = spec.anchor.direct[1]
    box = c.tile_h + (kh - 1) * dh  # rows of x a kernel column's taps read
    eligible = (kh > 1 and sh == 1 and not c.nchw and step in conv_sm90.SHARED_ROWS_K_BYTES
                and box <= 256 and kh * c.tile_h >= conv_sm90.SHARED_ROWS_MIN_SAVING * box)
    staged = c.block_n * conv_sm90.staging_pitch(c.tile_h, c.tile_w, itemsize) * itemsize
    staged += 4 * conv_sm90.stats_floats(c.block_n, c.pingpong) if c.stats or c.reduce else 0
    shared_stage = (box * c.tile_w + kh * c.block_n) * step
    # (a box a tap where fewer than MIN_STAGES shared stages fit: 5 x 5 taps' weights of 160 channels)
    # A tile's whole window of x (conv_sm90.WINDOW_BOX, taken before a shared box): stride 1,
    # channels-last x, C_in leaving a 16-byte column of the 64-byte k-step empty, patches of
    # 64 or 128 columns.
    windowed = (conv_sm90.WINDOW_BOX and (sh, sw) == (1, 1) and step in conv_sm90.WINDOW_K_BYTES and not c.nchw
                and cin * itemsize <= step - 16)
    assert not c.window or (windowed and c.tile_w in (64, 128) and not c.shared_rows)
    assert f"constexpr bool kWindow = {'true' if c.window else 'false'};" in source and ("_win_" in kernel) == c.window
    assert c.window or c.shared_rows == (eligible and conv_sm90.MIN_STAGES * shared_stage <= conv_sm90.SMEM_BUDGET - staged)
    assert f"constexpr bool kSharedRows = {'true' if c.shared_rows else 'false'};" in source
    assert ("_sr_" in kernel) == c.shared_rows
    stage = ((c.tile_h + (kh - 1) * dh) * c.tile_w + kh * c.block_n if c.shared_rows else c.block_m + c.block_n) * step
    assert c.window or c.stages * stage <= conv_sm90.SMEM_BUDGET
    t, k = {"bfloat16": ("bf16", 16), "float16": ("f16", 16), "float32": ("tf32", 8)}[spec.dtype]
    acc = c.block_n // 2
    assert f"wgmma.mma_async.sync.aligned.m64n{c.block_n}k{k}.f32.{t}.{t} " in source
    transpose = "" if t == "tf32" else ", 1, 0" if c.nchw else ", 0, 0"  # A MN-major where x is read NCHW
    assert f"%{acc - 1}}}, %{acc}, %{acc + 1}, p, 1, 1{transpose};" in source
    assert "fusedepi_anchor_inside() { return 1; }" in source
    # A norm: the tiles write their moments, a kernel merges them, the apply kernel
    # normalizes the output in place; a pointwise chain is the conv's launch alone.
    assert c.reduce == (spec.reduction is not None and spec.reduction.name.startswith("spatial_"))
    assert c.softmax == {"channel_softmax": 1, "channel_log_softmax": 2}.get(getattr(spec.reduction, "name", None), 0)
    pools = spec.reduction is not None and spec.reduction.name in ("maxpool", "avgpool")
    assert c.pool == (tuple(spec.reduction.window[2]) if pools else ())
    channel_reductions = ("channel_sum", "channel_mean", "channel_logsumexp", "channel_amax", "channel_amin")
    reduced = getattr(spec.reduction, "name", "")
    assert c.pixel_reduce == (reduced.removeprefix("channel_") if reduced in channel_reductions else "")
    assert f"constexpr bool kConvPixelReduce = {'true' if c.pixel_reduce else 'false'};" in source
    assert c.stats == (spec.reduction is not None and not c.reduce and not c.softmax and not c.pool
                       and not c.pixel_reduce)
    assert f"constexpr bool kConvPool = {'true' if c.pool else 'false'};" in source
    if c.pool:  # whole windows in a patch; the pooled plane the only output
        assert c.tile_h % c.pool[0] == 0 and c.tile_w % c.pool[1] == 0
        assert f"kPoolKH = {c.pool[0]}, kPoolKW = {c.pool[1]}," in source
    # value_stage1 (stage1 on one value in the tiles) is rendered for the forms that call it
    hook = "stage1<1>(y, pos, e0, a, s0, s1);" in source
    assert hook == bool(c.softmax or c.pixel_reduce or c.pool)
    assert f"constexpr int kConvSoftmax = {c.softmax};" in source
    assert ("_convstats(" in source) == c.stats
    assert ("_apply(" in source) == ("b.y = a.out;" in source) == (c.stats and not c.recompute)
    assert f"constexpr bool kConvStats = {'true' if c.stats else 'false'};" in source
    # A norm recomputed: the moments' pass, the merge, then the normed pass, whose tiles run
    # stage1 with the merged statistics (no apply kernel); else one pass.
    assert c.recompute == spec.anchor.recompute and (c.stats or not c.recompute)
    assert f"constexpr bool kRecompute = {'true' if c.recompute else 'false'};" in source
    assert ("stage1_at<1>(y, k.k, e0, a, k.s0, k.s1);" in source) == c.recompute
    if c.recompute:
        launch = source[source.index("conv_launch(a, device, stream, kPassMoments)"):]
        assert launch.index("_convstats<<<") < launch.index("conv_launch(a, device, stream, kPassNormed)")
        assert "_rc_" in c.name(spec, "sm90")
    else:
        assert "conv_launch(a, device, stream, kPassOnce)" in source and "stream, kPassNormed)" not in source
    if c.stats:  # the output holds the conv's value; the apply kernel runs stage0 on it, as on the library path
        assert "constexpr bool kStage0Done = false;" in source
        bn = spec.reduction.name == "batchnorm_train"
        assert f"constexpr long long kPartsAt = {'2 * kChannels' if bn else '0'};" in source
        assert f"conv_stats_final<{'false, 1' if bn else f'true, {spec.reduction.groups}'}>" in source
    # Without TF32 a float32 conv is not taken (exact float32 stays with the library);
    # nor on sm_80, nor where the direct conv covers the chain.
    if spec.dtype == "float32":
        assert "TF32" in cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=False)
    assert "sm_90" in cuda_templates.conv_gemm_plan(spec, "sm80", conv_tf32=True)


def test_in_kernel_conv_refuses_what_it_does_not_cover(monkeypatch):
    from cuda_templates import conv_sm90

    base = CONV_GEMM_SPECS["igemm_relu_bias_64_128-bfloat16"]

    def implicit(spec):
        return replace(spec, anchor=replace(spec.anchor, implicit=True))

    off = replace(base, anchor=replace(base.anchor, implicit=False))  # FUSEDEPI_IN_KERNEL_CONV unset
    assert "FUSEDEPI_IN_KERNEL_CONV" in cuda_templates.conv_gemm_plan(off, "sm90")
    direct = implicit(direct_specs("bfloat16")["direct_pointwise_cin8"])  # 16 output channels: the direct conv's
    assert "direct conv covers" in cuda_templates.conv_gemm_plan(direct, "sm90")
    gn = CONV_GEMM_SPECS["igemm_groupnorm_silu-bfloat16"]
    assert cuda_templates.conv_gemm_plan(gn, "sm90").stats
    # a norm recomputed where the tiles take no norm's statistics (a pointwise chain)
    assert "recomputed" in cuda_templates.conv_gemm_plan(base.with_norm_recomputed(), "sm90")
    # segments that split a channel (a LayerNorm over the rows of an image), a norm with a
    # reduction after it, reductions other than a norm: the library conv and the epilogue
    rows_ln = replace(gn, steps=(gn.steps[0], replace(gn.steps[1], name="layernorm", groups=64 * 20), gn.steps[2]))
    assert "not implemented" in cuda_templates.conv_gemm_plan(rows_ln, "sm90")
    then_mean = replace(gn, steps=gn.steps[:2] + (Step("spatial_mean"),))
    assert "after groupnorm" in cuda_templates.conv_gemm_plan(then_mean, "sm90")
    softmax = replace(gn, steps=(gn.steps[0], Step("channel_softmax")), fusion="conv_channel_softmax")
    assert "switched off" in cuda_templates.conv_gemm_plan(softmax, "sm90")  # conv_sm90.PIXEL_NORMS
    channel_max = replace(gn, steps=(gn.steps[0], Step("channel_amax")), fusion="conv_channel_amax")
    assert cuda_templates.conv_gemm_plan(channel_max, "sm90").pixel_reduce  # conv_sm90.PIXEL_REDUCES
    channel_norm_then_max = replace(gn, steps=gn.steps[:2] + (Step("channel_amax"),))
    assert "after groupnorm" in cuda_templates.conv_gemm_plan(channel_norm_then_max, "sm90")
    # C_in not a whole 16 bytes: x's pixels padded to them (conv_sm90.PAD_PIXELS), else refused
    odd_cin = replace(base, anchor=replace(base.anchor, direct=(60, 3, 3, 64, 64)))
    monkeypatch.setattr(conv_sm90, "PAD_PIXELS", True)
    assert isinstance(cuda_templates.conv_gemm_plan(odd_cin, "sm90"), cuda_templates.ConvGemmPlan)
    assert "kXPitch = 64;" in cuda_templates.render(odd_cin, "sm90")
    monkeypatch.setattr(conv_sm90, "PAD_PIXELS", False)
    assert "input channels in multiples of 8" in cuda_templates.conv_gemm_plan(odd_cin, "sm90")
    odd_cout = replace(base, channels=100)
    assert "output channels in multiples of 8" in cuda_templates.conv_gemm_plan(odd_cout, "sm90")
    # strides past TMA's element strides (8); an output the chain's sizes do not match
    conv = base.anchor.conv
    stride9 = replace(base, anchor=replace(base.anchor, conv=((9, 9),) + conv[1:]))
    assert "strides up to 8" in cuda_templates.conv_gemm_plan(stride9, "sm90")
    stride2 = replace(base, anchor=replace(base.anchor, conv=((2, 2),) + conv[1:]))
    assert "does not match" in cuda_templates.conv_gemm_plan(stride2, "sm90")
    assert isinstance(cuda_templates.conv_gemm_plan(replace(stride2, inner=31 * 31), "sm90"),
                      cuda_templates.ConvGemmPlan)
    with pytest.raises(ValueError, match="stride 9"):
        conv_sm90.tiling(64, 100, 2, stride_w=9)
    fp16 = conv_gemm_specs("float16")["igemm_relu_bias_64_128"]
    assert isinstance(cuda_templates.conv_gemm_plan(fp16, "sm90"), cuda_templates.ConvGemmPlan)
    # float32 only on operands the graph rounds to TF32 (the tensor cores would truncate them)
    f32 = CONV_GEMM_SPECS["igemm_relu_bias_64_128-float32"]
    assert f32.anchor.rounded and not isinstance(cuda_templates.conv_gemm_plan(f32, "sm90", conv_tf32=True), str)
    unrounded = replace(f32, anchor=replace(f32.anchor, rounded=False))
    assert "rounded to TF32" in cuda_templates.conv_gemm_plan(unrounded, "sm90", conv_tf32=True)


def test_in_kernel_conv_shares_a_box_down_the_kernel():
    # conv2d_bn_relu's 16 -> 32 channels of 128 x 128 (bf16, k-steps of 64 bytes): patches
    # narrowed to 64 x 4, a box of 6 rows for a kernel column's 3 taps; the ring at most
    # RING_BYTES_K / 3 bytes of k-steps.
    from cuda_templates import conv_sm90

    assert conv_sm90.k_step_bytes(16, 2) == 64
    c = conv_sm90.tiling(32, 128, 2, stats=True, k_bytes=64, ho=128, tap_rows=(3, 1))
    assert c.shared_rows and (c.tile_h, c.tile_w, c.block_m) == (4, 64, 256)
    assert c.stages == max(conv_sm90.RING_BYTES_K // 64 // 3, conv_sm90.MIN_STAGES)
    apart = conv_sm90.tiling(32, 128, 2, stats=True, k_bytes=64, ho=128)  # a box a tap: the output's width
    assert not apart.shared_rows and (apart.tile_h, apart.tile_w) == (2, 128)
    # A dilation of 8: a box of tile_h + 16 rows saves too little of the taps' 3 x tile_h
    wide = conv_sm90.tiling(64, 64, 2, k_bytes=64, ho=64, tap_rows=(3, 8))
    assert not wide.shared_rows and wide.tile_w == 64
    # Dilation 2 on 128 columns: 2-row patches would save nothing (a box of 6 rows), 4-row ones do
    dilated = conv_sm90.tiling(16, 128, 2, k_bytes=64, ho=128, tap_rows=(3, 2))
    assert dilated.shared_rows and (dilated.tile_h, dilated.tile_w) == (4, 64)


def test_in_kernel_conv_keeps_one_channel_tiles_weights(monkeypatch):
    # conv_sm90.RESIDENT_WEIGHTS (off): where one channel tile covers C_out, every k-step's
    # weights are copied once a CTA and the stages hold x alone; not where C_out takes two
    # tiles, nor beyond RESIDENT_MAX_BYTES.
    from cuda_templates import conv_sm90

    bn_relu = CONV_GEMM_SPECS["igemm_bn_relu_16_32-bfloat16"]
    assert not cuda_templates.conv_gemm_plan(bn_relu, "sm90").resident_weights
    monkeypatch.setattr(conv_sm90, "WINDOW_BOX", False)  # (a shared box's)
    monkeypatch.setattr(conv_sm90, "RESIDENT_WEIGHTS", True)
    c = cuda_templates.conv_gemm_plan(bn_relu, "sm90")
    assert c.resident_weights and c.shared_rows and "_sr_rw_" in c.name(bn_relu, "sm90")
    source = cuda_templates.render(bn_relu, "sm90")
    assert "constexpr bool kResidentW = true;" in source
    # 9 k-steps of 32 channels x 64 bytes kept; the stages of x alone fill what is left
    alone = conv_sm90.tiling(32, 40, 2, stats=True, k_bytes=64, ho=40, tap_rows=(3, 1), k_steps=9)
    assert alone.resident_weights and alone.stages >= c.stages
    two_tiles = CONV_GEMM_SPECS["igemm_cin8_k5_320-bfloat16"]  # 320 channels: two tiles of 160
    assert not cuda_templates.conv_gemm_plan(two_tiles, "sm90").resident_weights
    assert not conv_sm90.tiling(128, 64, 2, k_bytes=128, ho=64, k_steps=49 * 4).resident_weights  # 1.6 MB


@needs_nvcc
@pytest.mark.parametrize("name", representatives(CONV_GEMM_SPECS, "sm90", True))
def test_nvcc_compiles_the_in_kernel_conv(name, nvcc_builds):
    _assert_builds(nvcc_builds, "test_nvcc_compiles_the_in_kernel_conv", name)


def _cuobjdump() -> str | None:
    """cuobjdump from $CUDA_HOME/bin, NVIDIA's `nvidia-cuda-cuobjdump` and
    `nvidia-cuda-nvdisasm` wheels (the `test` extra: cuobjdump -sass runs nvdisasm from
    its own folder), Triton's package (the `bench` extra), or PATH; not every CUDA image
    ships it."""
    import importlib.util

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    places = [os.path.join(home, "bin")] if home else []
    for package, below in (("nvidia", ("cu13", "bin")), ("triton", ("backends", "nvidia", "bin"))):
        try:
            found = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            found = None
        if found is not None and found.submodule_search_locations:
            places += [os.path.join(p, *below) for p in found.submodule_search_locations]
    found = [os.path.join(p, "cuobjdump") for p in places if os.access(os.path.join(p, "cuobjdump"), os.X_OK)]
    return found[0] if found else shutil.which("cuobjdump")


CUOBJDUMP = _cuobjdump()


def accumulator_uses_in_flight(sass: str) -> list[str]:
    """The instructions of `sass` that touch a wgmma's accumulator registers after the
    wgmma (HGMMA) is issued and before the wait for all of them (WARPGROUP.DEPBAR.LE
    gsb0, 0x0): they would read values the tensor cores are still writing."""
    found, accumulators = [], set()
    for line in sass.splitlines():
        if not re.search(r"/\*[0-9a-f]{4}\*/", line):
            continue
        instruction = line.split("*/", 1)[1].split(";")[0].strip()
        hgmma = re.match(r"(?:@!?U?P\w+\s+)?HGMMA\.64x(\d+)x\d+\S*\s+R(\d+),", instruction)
        if hgmma:  # m64nNk: N / 2 float32 accumulators a thread, from R<base>
            n, base = int(hgmma.group(1)), int(hgmma.group(2))
            accumulators |= set(range(base, base + n // 2))
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in instruction:
            accumulators = set()
        elif accumulators and "WARPGROUP." not in instruction:
            if {int(r) for r in re.findall(r"\bR(\d+)\b", instruction)} & accumulators:
                found.append(instruction)
    return found


def _wgmma_sass(dtype: str, workdir) -> tuple[tuple[str, str], ...]:
    """(kernel name, SASS) of the wgmma kernels the SASS checks read, in `dtype`: the
    in-kernel conv file in which ptxas packed the last accumulators to float16 before
    the wait for the last wgmma (fuzzer generation 16, seed 0, model 61's conv: 32 -> 128
    channels, 64-byte k-steps, a 41-pixel-wide output), a conv of 256-pixel tiles
    (conv_sm90.TALL_BLOCK_M: four m64 blocks a consumer), and an in-kernel GEMM file."""
    conv = EpilogueSpec(_implicit(0, (32, 3, 3, 14, 43)), (Step("relu"),), dtype, (), 128, 12 * 41,
                        "conv_pointwise").with_in_kernel_conv()
    tall = EpilogueSpec(_implicit(1, (16, 3, 3, 20, 70)), (Step("relu"),), dtype, (), 32, 20 * 70,
                        "conv_pointwise").with_in_kernel_conv()
    assert cuda_templates.conv_gemm_plan(tall, "sm90", conv_tf32=True).block_m == 256
    found = []
    for spec in (conv, tall, GEMM_SPECS[f"gemm_pointwise-{dtype}"]):
        source = cuda_templates.render(spec, "sm90", conv_tf32=True)
        name = cuda_templates.kernel_name(spec, "sm90", True)
        library = cuda_templates.build(source, name, "sm90a", workdir)
        sass = subprocess.run([CUOBJDUMP, "-sass", str(library)], capture_output=True, text=True, check=True).stdout
        found.append((name, sass))
    return tuple(found)


@pytest.fixture(scope="module")
def wgmma_sass(tmp_path_factory):
    """`_wgmma_sass` of a dtype, built once for the module's SASS checks."""
    return functools.lru_cache(maxsize=None)(functools.partial(_wgmma_sass, workdir=tmp_path_factory.mktemp("sass")))


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_no_accumulator_is_read_before_its_wgmma_is_waited_for(dtype, wgmma_sass):
    # hop::fence_accumulators keeps every use of the accumulators after the wait.
    for name, sass in wgmma_sass(dtype):
        assert "HGMMA" in sass, name
        assert not accumulator_uses_in_flight(sass), (name, accumulator_uses_in_flight(sass)[:5])


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_wgmma_kernels_use_no_local_memory(dtype, wgmma_sass):
    # Local loads and stores (LDL, STL): spilled registers, or a register array indexed at
    # run time; in these kernels the accumulators and the chain's values stay in registers.
    for name, sass in wgmma_sass(dtype):
        assert not re.search(r"\b(?:LDL|STL)\b", sass), (name, re.findall(r"[^;\n]*\b(?:LDL|STL)\b[^;]*", sass)[:3])


def test_in_kernel_conv_nchw_plans(monkeypatch):
    # x read in its NCHW layout (conv_sm90.reads_nchw): 16-bit, stride 1 along the width,
    # patches of whole 64-pixel boxes, input rows of 16 bytes, and every tap's box from a
    # 16-byte column (a box off one stopped the kernel on an H200: "illegal instruction").
    from cuda_templates import conv_sm90

    bf16 = conv_gemm_specs("bfloat16")
    pointwise = bf16["igemm_1x1_nchw_gelu"]  # 1 x 1, 16 x 64 out: patches of 64
    c = cuda_templates.conv_gemm_plan(pointwise, "sm90")
    assert c.nchw and c.tile_w == 64 and cuda_templates.kernel_name(pointwise, "sm90").startswith("igemm128x128_nchw_")
    source = cuda_templates.render(pointwise, "sm90")
    assert "constexpr bool kNchw = true;" in source and "constexpr int kNchwBoxW = 64;" in source
    assert "p, 1, 1, 1, 0;" in source and "p, 1, 1, 0, 0;" not in source  # A MN-major (transposed)
    assert cuda_templates.conv_gemm_plan(conv_gemm_specs("float16")["igemm_1x1_nchw_gelu"], "sm90").nchw
    monkeypatch.setattr(conv_sm90, "READS_NCHW", False)
    assert not cuda_templates.conv_gemm_plan(pointwise, "sm90").nchw
    monkeypatch.setattr(conv_sm90, "READS_NCHW", True)

    def variant(direct, inner, stride=1, padding=0, dilation=1):
        anchor = replace(pointwise.anchor, direct=direct, conv=((1, stride), (0, padding), (1, dilation))
                         + pointwise.anchor.conv[3:])
        return cuda_templates.conv_gemm_plan(replace(pointwise, anchor=anchor, inner=inner), "sm90")

    # not: float32 (TF32 reads K-major operands only), a stride along the width, patches
    # narrower than a box, input rows of other than whole 16 bytes, taps off 16-byte columns
    f32 = CONV_GEMM_SPECS["igemm_1x1_nchw_gelu-float32"]
    assert not cuda_templates.conv_gemm_plan(f32, "sm90", conv_tf32=True).nchw
    assert "constexpr bool kNchw = false;" in cuda_templates.render(f32, "sm90", conv_tf32=True)
    with pytest.raises(ValueError, match="K-major"):
        conv_sm90.wgmma_asm("float32", 64, a_mn_major=True)
    strided = variant((64, 1, 1, 16, 256), 16 * 128, stride=2)
    assert strided.tile_w == 128 and not strided.nchw
    narrow = variant((64, 1, 1, 16, 32), 16 * 32)
    assert narrow.tile_w == 32 and not narrow.nchw
    assert not variant((64, 1, 1, 16, 68), 16 * 68).nchw  # 136-byte rows
    assert variant((64, 1, 1, 16, 72), 16 * 72).nchw
    assert not variant((64, 1, 3, 16, 72), 16 * 70).nchw  # taps from columns 0, 1 and 2
    assert not variant((64, 1, 3, 16, 72), 16 * 72, padding=1).nchw
    assert not variant((64, 1, 1, 16, 64), 16 * 66, padding=1).nchw  # from column -1
    assert variant((64, 1, 1, 16, 64), 16 * 80, padding=8).nchw  # from column -8: 16 bytes
    assert variant((64, 1, 3, 16, 64), 16 * 64, padding=8, dilation=8).nchw  # columns -8, 0, 8
    assert not cuda_templates.conv_gemm_plan(bf16["igemm_relu_bias_64_128"], "sm90").nchw  # 3 x 3


def _tf32_nchw_spec(direct=(64, 3, 3, 128, 128), padding=0, stride=1):
    """Issue 33's example as the in-kernel conv takes it in float32 (TF32): Conv2d(64 ->
    128, k3) -> relu -> + bias[128, 1, 1], its input `direct` (C_in, kh, kw, H, W)."""
    spec = conv_gemm_specs("float32")["igemm_relu_bias_64_128"]
    cin, kh, kw, h, w = direct
    anchor = replace(spec.anchor, direct=direct, rounded=True,
                     conv=((stride, stride), (padding, padding)) + spec.anchor.conv[2:])
    ho, wo = (h + 2 * padding - kh) // stride + 1, (w + 2 * padding - kw) // stride + 1
    return replace(spec, anchor=anchor, inner=ho * wo)


def test_in_kernel_conv_reads_a_float32_x_nchw(monkeypatch):
    # float32 x read NCHW (conv_sm90.READS_NCHW_TF32): A loaded into registers from an
    # unswizzled box and rounded there, so any tap's column (3 x 3, padded or not), stride
    # 1, patches of 64 or 128 (one or two rows), rows of whole 16 bytes; cooperative.
    from cuda_templates import conv_sm90

    spec = _tf32_nchw_spec()
    monkeypatch.setattr(conv_sm90, "READS_NCHW_TF32", False)
    assert not cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True).nchw
    monkeypatch.setattr(conv_sm90, "READS_NCHW_TF32", True)
    c = cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True)
    assert c.nchw and not c.pingpong and (c.tile_h, c.tile_w, c.block_n, c.block_m) == (1, 128, 128, 128)
    assert c.stages == conv_sm90.nchw_stages(c, 4) >= conv_sm90.MIN_STAGES
    source = cuda_templates.render(spec, "sm90", conv_tf32=True)
    assert "constexpr bool kNchw = true;" in source and "constexpr int kNchwBoxW = 136;" in source
    assert "{%64, %65, %66, %67}, %68, p, 1, 1;" in source  # the register-A wgmma, m64n128k8
    # the box: the patch's columns, 0-3 before it, rows 8 banks past 32 floats
    assert (conv_sm90.nchw_box_w(1, 128), conv_sm90.nchw_box_w(2, 64), conv_sm90.nchw_box_w(1, 64)) == (136, 68, 72)
    for h, w in ((1, 64), (1, 128), (2, 64), (2, 128)):
        box = conv_sm90.nchw_box_w(h, w)
        assert box >= w + 4 and box % 4 == 0 and box * h % 32 in (8, 24)
    with pytest.raises(ValueError, match="4 x 32"):
        conv_sm90.nchw_box_w(4, 32)
    padded = cuda_templates.conv_gemm_plan(_tf32_nchw_spec((64, 3, 3, 62, 64), padding=1), "sm90", conv_tf32=True)
    assert padded.nchw and (padded.tile_h, padded.tile_w) == (2, 64)
    # not: a stride, input rows of other than whole 16 bytes, the switch off; 16-bit as before
    assert not cuda_templates.conv_gemm_plan(_tf32_nchw_spec((64, 3, 3, 128, 256), stride=2), "sm90",
                                             conv_tf32=True).nchw
    assert not cuda_templates.conv_gemm_plan(_tf32_nchw_spec((64, 3, 3, 128, 130)), "sm90", conv_tf32=True).nchw
    assert not cuda_templates.conv_gemm_plan(conv_gemm_specs("bfloat16")["igemm_relu_bias_64_128"], "sm90").nchw


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("direct, padding", [((64, 3, 3, 128, 128), 0), ((64, 3, 3, 62, 64), 1)])
def test_nvcc_compiles_the_float32_nchw_in_kernel_conv(direct, padding, monkeypatch, tmp_path):
    # The float32 NCHW files build; their wgmmas read A from registers, a k-step's four
    # back to back (ptxas serializes every wgmma of a file whose A registers are written
    # while one is in flight: a wait after each), no accumulator is read before the last
    # wgmma's wait, and nothing spills.
    from cuda_templates import conv_sm90

    monkeypatch.setattr(conv_sm90, "READS_NCHW_TF32", True)
    spec = _tf32_nchw_spec(direct, padding)
    kernel = cuda_templates.kernel_name(spec, "sm90", True)
    assert "_nchw_" in kernel
    sass = _clean_wgmma_sass(spec, tmp_path)
    mainloop = re.findall(r"HGMMA\.64x128x8\.F32\.TF32 R\d+, R\d+, gdesc[^;]*;|WARPGROUP\.DEPBAR", sass)
    assert "WARPGROUP.DEPBAR" in mainloop and mainloop.index("WARPGROUP.DEPBAR") == 4, mainloop


def test_in_kernel_conv_spatial_reduction_plans(monkeypatch):
    # A spatial reduction after a pointwise chain in the tiles (conv_sm90.REDUCES; the
    # switch off names it): the tiles' partials, a float an (image, patch, channel),
    # then a kernel that merges them and runs the steps after the reduction; no apply
    # kernel, no conv output.
    from cuda_templates import conv_sm90

    spec = conv_gemm_specs("bfloat16")["igemm_relu_global_mean"]
    monkeypatch.setattr(conv_sm90, "REDUCES", False)
    assert "switched off" in cuda_templates.conv_gemm_plan(spec, "sm90")
    monkeypatch.setattr(conv_sm90, "REDUCES", True)
    c = cuda_templates.conv_gemm_plan(spec, "sm90")
    assert c.reduce and not c.stats and (c.tile_h, c.tile_w) == (4, 32)
    source = cuda_templates.render(spec, "sm90")
    assert "constexpr bool kConvReduce = true;" in source and "constexpr bool kConvStats = false;" in source
    assert "constexpr fusedepi::RowReduce kReduceOp = fusedepi::RowReduce::kMean;" in source
    assert "fusedepi_workspace_floats(long long rows) { return rows * kPatches * kChannels; }" in source
    assert "_convreduce<<<" in source and "_apply(" not in source
    amax = conv_gemm_specs("float32")["igemm_tanh_amax_scale"]
    amax = replace(amax, anchor=replace(amax.anchor, rounded=True))
    c = cuda_templates.conv_gemm_plan(amax, "sm90", conv_tf32=True)
    assert c.reduce and c.block_m == 256
    assert "fusedepi::RowReduce::kAmax;" in cuda_templates.render(amax, "sm90", conv_tf32=True)
    # not: a reduction after a norm, a chain that saves values for backward
    gn = conv_gemm_specs("bfloat16")["igemm_groupnorm_silu"]
    assert not cuda_templates.conv_gemm_plan(gn, "sm90").reduce
    from lowering.spec import Save

    saving = replace(spec, saves=(Save("value", "bfloat16", (-1, 128, 28, 28), 128 * 28 * 28, at=1),))
    assert "saved for backward" in cuda_templates.conv_gemm_plan(saving, "sm90")


def test_in_kernel_conv_pixel_reduction_plans(monkeypatch):
    # A reduction over each pixel's channels where one tile holds them all
    # (conv_sm90.PIXEL_REDUCES; the switch off names it): one launch, a value a pixel
    # stored from registers, no workspace, no apply kernel; more channels than a tile
    # holds are refused.
    from cuda_templates import conv_sm90

    spec = conv_gemm_specs("bfloat16")["igemm_channel_amin_tanh_32"]
    monkeypatch.setattr(conv_sm90, "PIXEL_REDUCES", False)
    assert "switched off (conv_sm90.PIXEL_REDUCES)" in cuda_templates.conv_gemm_plan(spec, "sm90")
    monkeypatch.setattr(conv_sm90, "PIXEL_REDUCES", True)
    c = cuda_templates.conv_gemm_plan(spec, "sm90")
    assert c.pixel_reduce == "amin" and not c.stats and not c.reduce and not c.softmax and c.block_n >= 32
    source = cuda_templates.render(spec, "sm90")
    assert "constexpr bool kConvPixelReduce = true;" in source and "constexpr bool kConvReduce = false;" in source
    assert "constexpr fusedepi::RowReduce kReduceOp = fusedepi::RowReduce::kAmin;" in source
    assert "stage1<1>(y, pos, e0, a, s0, s1);" in source  # the steps after it, on the pixel's value (value_stage1)
    assert "fusedepi_workspace_floats(long long rows) { return 0; }" in source and "_apply(" not in source
    lse = conv_gemm_specs("float32")["igemm_channel_logsumexp_128"]
    lse = replace(lse, anchor=replace(lse.anchor, rounded=True))
    assert cuda_templates.conv_gemm_plan(lse, "sm90", conv_tf32=True).pixel_reduce == "logsumexp"
    wide = replace(lse, channels=256)  # float32 tiles hold at most 128 channels
    assert "more than one tile" in cuda_templates.conv_gemm_plan(wide, "sm90", conv_tf32=True)


def test_in_kernel_conv_pool_plans(monkeypatch):
    # A pooling window whose stride is its window, unpadded (conv_sm90.POOLS_IN_TILE; the
    # switch off names it): the tiles stage the chain's values and pool them, writing the
    # pooled plane only (one launch, no workspace, no apply kernel); every other window is
    # refused with its geometry.
    from cuda_templates import conv_sm90

    spec = conv_gemm_specs("bfloat16")["igemm_relu_maxpool_2x2"]
    monkeypatch.setattr(conv_sm90, "POOLS_IN_TILE", False)
    assert "switched off" in cuda_templates.conv_gemm_plan(spec, "sm90")
    monkeypatch.setattr(conv_sm90, "POOLS_IN_TILE", True)
    c = cuda_templates.conv_gemm_plan(spec, "sm90")
    assert c.pool == (2, 2) and not c.stats and not c.reduce and c.tile_h % 2 == 0
    source = cuda_templates.render(spec, "sm90")
    assert "constexpr bool kConvPool = true;" in source and "constexpr bool kPoolMax = true;" in source
    assert "kPoolKH = 2, kPoolKW = 2, kPoolDivisor = 1;" in source and "kPoolHo = 20, kPoolWo = 20;" in source
    assert "fusedepi_workspace_floats(long long rows) { return 0; }" in source and "_apply(" not in source
    avg = conv_gemm_specs("float32")["igemm_tanh_avgpool_2x4_cut"]
    avg = replace(avg, anchor=replace(avg.anchor, rounded=True))
    c = cuda_templates.conv_gemm_plan(avg, "sm90", conv_tf32=True)
    assert c.pool == (2, 4) and c.tile_w % 4 == 0
    source = cuda_templates.render(avg, "sm90", conv_tf32=True)
    assert "kPoolKH = 2, kPoolKW = 4, kPoolDivisor = 8;" in source and "kPoolHo = 8, kPoolWo = 17;" in source
    # divisor_override divides instead of the window's size
    override = replace(avg.reduction, consts=(0, 1, 5))
    overridden = replace(avg, steps=(avg.steps[0], override, avg.steps[2]))
    assert "kPoolDivisor = 5;" in cuda_templates.render(overridden, "sm90", conv_tf32=True)
    # A wide output: patches narrowed so that their rows hold whole windows of 4 rows.
    wide = replace(spec, anchor=replace(spec.anchor, direct=(16, 3, 3, 16, 256)), inner=16 * 256,
                   steps=(spec.steps[0], spec.steps[1], replace(spec.steps[2], window=(
                       (16, 256), (4, 64), (4, 4), (4, 4), (0, 0), (1, 1))), spec.steps[3]))
    c = cuda_templates.conv_gemm_plan(wide, "sm90")
    assert c.pool == (4, 4) and c.tile_h % 4 == 0 and c.tile_w <= 32
    # refused: strides other than the window, padding, dilation, ceil_mode, sides of 3
    window = spec.steps[2].window
    for geometry, consts in (((2, 2), (1, 1), (0, 0), (1, 1)), (0,)), (((2, 2), (2, 2), (1, 1), (1, 1)), (0,)), \
            (((2, 2), (2, 2), (0, 0), (2, 2)), (0,)), (((2, 2), (2, 2), (0, 0), (1, 1)), (1,)), \
            (((3, 3), (3, 3), (0, 0), (1, 1)), (0,)):
        refused = replace(spec, steps=spec.steps[:2] + (replace(spec.steps[2], window=window[:2] + geometry,
                                                                consts=consts),) + spec.steps[3:])
        assert "the in-kernel conv pools windows of (2, 4) pixels a side" in cuda_templates.conv_gemm_plan(refused,
                                                                                                           "sm90")


def _clean_wgmma_sass(spec, workdir) -> str:
    """The SASS of `spec`'s in-kernel file (float32 in TF32), after checking that it holds
    wgmmas, reads no accumulator before the last one's wait, and spills nothing."""
    kernel = cuda_templates.kernel_name(spec, "sm90", True)
    library = cuda_templates.build(cuda_templates.render(spec, "sm90", conv_tf32=True), kernel, "sm90a", workdir)
    sass = subprocess.run([CUOBJDUMP, "-sass", str(library)], capture_output=True, text=True, check=True).stdout
    assert "HGMMA" in sass, kernel
    assert not accumulator_uses_in_flight(sass), (kernel, accumulator_uses_in_flight(sass)[:5])
    assert not re.search(r"\b(?:LDL|STL)\b", sass), kernel
    return sass


RESIDENT_WEIGHT_SPECS = ("igemm_bn_relu_16_32", "igemm_channel_logsumexp_128", "igemm3d_gn_silu", "igemm_relu_maxpool_2x2")


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_nvcc_compiles_the_in_kernel_conv_with_resident_weights(dtype, tmp_path, monkeypatch):
    # The files with every k-step's weights kept build (a shared box and a box a tap, 2-D
    # and 3-D, a norm, a pixel's reduction, a pool): wgmmas with no accumulator read
    # before the last one's wait, nothing spilled.
    from cuda_templates import conv_sm90

    monkeypatch.setattr(conv_sm90, "RESIDENT_WEIGHTS", True)
    for name in RESIDENT_WEIGHT_SPECS:
        spec = CONV_GEMM_SPECS[f"{name}-{dtype}"]
        assert cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True).resident_weights, name
        _clean_wgmma_sass(spec, tmp_path)


def test_in_kernel_conv_reads_a_window(monkeypatch):
    # conv_sm90.WINDOW_BOX: a stride-1 conv of 64-byte k-steps in patches of 64 or 128
    # columns reads its tile's whole input window once a k-step, a box a 16-byte column of
    # channels, where C_in leaves a column of the k-step empty; not with a stride, nor in
    # patches narrower than an m64 block's row, nor where C_in fills the k-step.
    from cuda_templates import conv_sm90

    bn_relu = CONV_GEMM_SPECS["igemm_bn_relu_16_32-bfloat16"]  # 40 x 40 out: patches of 64 x 4
    monkeypatch.setattr(conv_sm90, "WINDOW_BOX", False)
    assert not cuda_templates.conv_gemm_plan(bn_relu, "sm90").window
    monkeypatch.setattr(conv_sm90, "WINDOW_BOX", True)
    c = cuda_templates.conv_gemm_plan(bn_relu, "sm90")
    assert c.window and not c.shared_rows and (c.tile_h, c.tile_w) == (4, 64) and "_win_" in c.name(bn_relu, "sm90")
    source = cuda_templates.render(bn_relu, "sm90")
    assert "constexpr bool kWindow = true;" in source and "constexpr bool kSharedRows = false;" in source
    for name in ("igemm_stride2_bn_relu6-bfloat16", "igemm_instancenorm_leaky-bfloat16"):  # a stride; 32-wide patches
        assert not cuda_templates.conv_gemm_plan(CONV_GEMM_SPECS[name], "sm90").window, name
    # 16 float32 channels fill the 64-byte k-step; 8 leave two of its columns empty
    f32 = CONV_GEMM_SPECS["igemm_bn_relu_16_32-float32"]
    assert not cuda_templates.conv_gemm_plan(f32, "sm90", conv_tf32=True).window
    assert cuda_templates.conv_gemm_plan(_in_channels(f32, 8), "sm90", conv_tf32=True).window
    # a stage: the window's four 16-byte columns (66 x 6 pixels each, to 128 bytes) and 9 taps' weights
    window = conv_sm90.tiling(32, 40, 2, stats=True, k_bytes=64, ho=40, tap_rows=(3, 1), window=(3, 3, 1, 1))
    column = -(-(66 * 6 * 16) // 128) * 128
    assert window.window and window.stages * (4 * column + 9 * 32 * 64) <= conv_sm90.SMEM_BUDGET


WINDOW_SPECS = ("igemm_bn_relu_16_32", "igemm_channel_amin_tanh_32", "igemm_relu_maxpool_2x2",
                "igemm_channel_logsumexp_128")


def _in_channels(spec, cin: int):
    """`spec` with its conv's input channels `cin`."""
    return replace(spec, anchor=replace(spec.anchor, direct=(cin,) + spec.anchor.direct[1:]))


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("resident", [False, True], ids=["weights_a_stage", "resident_weights"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_nvcc_compiles_the_in_kernel_conv_reading_a_window(dtype, resident, tmp_path, monkeypatch):
    # The window's files build (a norm, a pixel's reduction, a pool, a 1 x 1 conv; the
    # weights a stage or resident): wgmmas with no accumulator read before the last one's
    # wait, nothing spilled.
    from cuda_templates import conv_sm90

    monkeypatch.setattr(conv_sm90, "WINDOW_BOX", True)
    monkeypatch.setattr(conv_sm90, "RESIDENT_WEIGHTS", resident)
    for name in WINDOW_SPECS:  # (16 channels: 32 bytes of bf16; 8 float32 ones)
        spec = CONV_GEMM_SPECS[f"{name}-{dtype}"]
        spec = _in_channels(spec, 8) if dtype == "float32" else spec
        c = cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True)
        assert c.window and c.resident_weights == resident, (name, c)
        _clean_wgmma_sass(spec, tmp_path)


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_nvcc_compiles_the_in_kernel_conv_of_padded_pixels(dtype, tmp_path, monkeypatch):
    # 3 input channels (an RGB image's): x's pixels 16 bytes apart (conv_sm90.PAD_PIXELS,
    # launch.padded_pixels), 2-D and 3-D: wgmmas with no accumulator read before the last
    # one's wait, nothing spilled.
    from cuda_templates import conv_sm90

    monkeypatch.setattr(conv_sm90, "PAD_PIXELS", True)
    for name in ("igemm_bn_relu_16_32", "igemm3d_gn_silu"):
        spec = _in_channels(CONV_GEMM_SPECS[f"{name}-{dtype}"], 3)
        assert isinstance(cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True), cuda_templates.ConvGemmPlan)
        source = cuda_templates.render(spec, "sm90", conv_tf32=True)
        assert "constexpr int kCin = 3," in source and f"kXPitch = {4 if dtype == 'float32' else 8};" in source, name
        _clean_wgmma_sass(spec, tmp_path)


def test_in_kernel_conv_channel_softmax_plans(monkeypatch):
    # A softmax or log_softmax over each pixel's channels in registers (conv_sm90.PIXEL_NORMS;
    # the switch off names it), where one tile holds every channel: then staged and
    # stored as a pointwise chain's tile; no apply kernel, no workspace.
    from cuda_templates import conv_sm90

    spec = conv_gemm_specs("bfloat16")["igemm_channel_softmax_32"]
    monkeypatch.setattr(conv_sm90, "PIXEL_NORMS", False)
    assert "switched off" in cuda_templates.conv_gemm_plan(spec, "sm90")
    monkeypatch.setattr(conv_sm90, "PIXEL_NORMS", True)
    c = cuda_templates.conv_gemm_plan(spec, "sm90")
    assert c.softmax == 1 and not c.stats and not c.reduce and c.block_n == 32
    source = cuda_templates.render(spec, "sm90")
    assert "constexpr int kConvSoftmax = 1;" in source and "stage1<1>(y, pos, e0, a, s0, s1);" in source
    assert "fusedepi_workspace_floats(long long rows) { return 0; }" in source and "_apply(" not in source
    assert "x = expf(x - s0) / s1;" in source  # stage1's normalize, as the library path's
    log = conv_gemm_specs("bfloat16")["igemm_channel_log_softmax_128"]
    assert cuda_templates.conv_gemm_plan(log, "sm90").softmax == 2
    assert "x = x - s0 - s1;" in cuda_templates.render(log, "sm90")
    # bf16 tiles of 192 (cooperative) hold 192 channels; float32 tiles hold at most 128
    wide = replace(log, channels=192)
    assert cuda_templates.conv_gemm_plan(wide, "sm90").block_n == 192
    wide32 = replace(conv_gemm_specs("float32")["igemm_channel_log_softmax_128"], channels=192)
    wide32 = replace(wide32, anchor=replace(wide32.anchor, rounded=True))
    assert "more than one tile" in cuda_templates.conv_gemm_plan(wide32, "sm90", conv_tf32=True)
    f32 = conv_gemm_specs("float32")["igemm_channel_softmax_32"]
    f32 = replace(f32, anchor=replace(f32.anchor, rounded=True))
    assert "_apply(" not in cuda_templates.render(f32, "sm90", conv_tf32=True)
    assert "_apply(" in cuda_templates.render(f32, "sm90")  # exact float32: the library conv, then the kernel


def _softmax_specs(dtype):  # bf16 also on a cooperative tile of 192 channels
    specs = [conv_gemm_specs(dtype)[name] for name in ("igemm_channel_softmax_32", "igemm_channel_log_softmax_128")]
    return specs + ([replace(specs[1], channels=192)] if dtype == "bfloat16" else [])


def _pixel_reduction_specs(dtype):  # amin, logsumexp; bf16 also sum, mean, amax and a cooperative tile of 192
    amin, lse = (conv_gemm_specs(dtype)[name] for name in ("igemm_channel_amin_tanh_32", "igemm_channel_logsumexp_128"))
    if dtype != "bfloat16":
        return [amin, lse]
    return [amin, lse, replace(lse, channels=192)] + [
        replace(amin, steps=(amin.steps[0], replace(amin.steps[1], name=f"channel_{op}"), amin.steps[2]))
        for op in ("sum", "mean", "amax")]


# The in-kernel conv's forms that reduce or pool in the tiles: (the conv_sm90 switch,
# the specs of a dtype, the plan's field that says the form is taken, the SASS it holds
# (True) or lacks (False): the spatial reduction's merging kernel; no bulk copies
# (UBLKCP.G.S, store_runs') where nothing is staged or the pooled plane is stored directly).
REDUCING_FORMS = {
    "channel_softmax": ("PIXEL_NORMS", _softmax_specs, "softmax", {}),
    "spatial_reduction": ("REDUCES", lambda dtype: [conv_gemm_specs(dtype)[name] for name in (
        "igemm_relu_global_mean", "igemm_tanh_amax_scale")], "reduce", {"_convreduce": True}),
    "pixel_reduction": ("PIXEL_REDUCES", _pixel_reduction_specs, "pixel_reduce", {"UBLKCP": False}),
    "pool": ("POOLS_IN_TILE", lambda dtype: [conv_gemm_specs(dtype)[name] for name in (
        "igemm_relu_maxpool_2x2", "igemm_tanh_avgpool_2x4_cut")], "pool", {"UBLKCP": False}),
}


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("form", list(REDUCING_FORMS))
def test_nvcc_compiles_the_in_kernel_convs_reducing_forms(form, dtype, tmp_path, monkeypatch):
    # Each form's files build with the form taken: the tiles' wgmmas with no accumulator
    # read before the last one's wait, nothing spilled, and the form's own SASS.
    from cuda_templates import conv_sm90

    switch, specs, field, sass_has = REDUCING_FORMS[form]
    monkeypatch.setattr(conv_sm90, switch, True)
    for spec in specs(dtype):
        spec = replace(spec, anchor=replace(spec.anchor, rounded=dtype == "float32"))
        assert getattr(cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True), field), spec.fusion
        sass = _clean_wgmma_sass(spec, tmp_path)
        for text, present in sass_has.items():
            assert (text in sass) == present, (spec.fusion, text)


@needs_nvcc
@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump not installed")
@pytest.mark.parametrize("dtype, name", [("bfloat16", "igemm_1x1_nchw_gelu"), ("float16", "igemm_bn_relu_16_32")])
def test_nvcc_compiles_the_nchw_in_kernel_conv(dtype, name, tmp_path):
    # The NCHW files build; their wgmmas read A transposed (tnspA), no accumulator is read
    # before the last wgmma's wait, and nothing spills. (BatchNorm's 16 -> 32 as a 1 x 1
    # conv on 128-wide rows: tiles of 256 pixels, 4 boxes a k-step.)
    spec = conv_gemm_specs(dtype)[name]
    if spec.anchor.direct[1:3] != (1, 1):
        anchor = replace(spec.anchor, direct=(16, 1, 1, 40, 128), conv=((1, 1), (0, 0)) + spec.anchor.conv[2:])
        spec = replace(spec, anchor=anchor, inner=40 * 128)
        assert cuda_templates.conv_gemm_plan(spec, "sm90").block_m == 256
    kernel = cuda_templates.kernel_name(spec, "sm90")
    assert "_nchw_" in kernel
    library = cuda_templates.build(cuda_templates.render(spec, "sm90"), kernel, "sm90a", tmp_path)
    sass = subprocess.run([CUOBJDUMP, "-sass", str(library)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"HGMMA\.64x\d+x16\.F32\S* R\d+, gdesc\[UR\d+\]\.tnspA", sass), kernel
    assert not accumulator_uses_in_flight(sass), accumulator_uses_in_flight(sass)[:5]
    assert not re.search(r"\b(?:LDL|STL)\b", sass)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_direct_conv_fma_takes_16_bit_inputs_the_tensor_cores_do_not(dtype, monkeypatch):
    # An RGB image's conv (3 input channels) and 20 output channels: the tensor-core
    # kernel takes neither; under DIRECT_FMA_16BIT (on) the FMA kernel does, staging the
    # 16-bit values as float32.
    render_module = sys.modules["cuda_templates.render"]
    spec = direct_specs(dtype)["direct_pointwise_k5_pad2"]
    monkeypatch.setattr(render_module, "DIRECT_FMA_16BIT", False)
    assert "multiples of 8" in cuda_templates.direct_plan(spec)
    monkeypatch.setattr(render_module, "DIRECT_FMA_16BIT", True)
    d = cuda_templates.direct_plan(spec)
    assert isinstance(d, cuda_templates.DirectPlan) and d.kind == "fma" and d.copad == 32
    source = cuda_templates.render(spec, "sm90")
    assert '#include "fusedepi/direct_conv.cuh"' in source and "mma.sync" not in source
    assert cuda_templates.kernel_name(spec, "sm90").startswith("directconv_")
    # what the tensor cores take stays theirs, with or without GroupNorm
    assert cuda_templates.direct_plan(direct_specs(dtype)["w5_direct"]).kind == "mma"
    assert cuda_templates.direct_plan(direct_specs(dtype)["direct_pointwise_cin8"]).kind == "mma"
    assert cuda_templates.direct_plan(direct_specs(dtype)["direct_groupnorm_cpg3"]).kind == "fma"
    # not before sm_80: the 16-bit FMA kernel has run on sm_90 only, and the library conv runs there
    assert "sm_80" in cuda_templates.direct_plan(direct_specs(dtype)["w5_direct"], "sm75")
    # what neither takes gives both reasons
    wide = replace(spec, channels=96)
    reason = cuda_templates.direct_plan(wide)
    assert "multiples of 8" in reason and "96 output channels" in reason


@needs_nvcc
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_nvcc_compiles_the_16_bit_fma_direct_conv(dtype, tmp_path, monkeypatch):
    # Pointwise (one phase) and GroupNorm (two phases, the pre-norm value stored in the
    # 16-bit dtype) files build for sm_80 and sm_90.
    monkeypatch.setattr(sys.modules["cuda_templates.render"], "DIRECT_FMA_16BIT", True)
    for name in ("direct_pointwise_k5_pad2", "direct_groupnorm_cpg3"):
        spec = direct_specs(dtype)[name]
        assert cuda_templates.direct_plan(spec).kind == "fma"
        for arch in ("sm80", "sm90"):
            kernel = cuda_templates.kernel_name(spec, arch)
            cuda_templates.build(cuda_templates.render(spec, arch), kernel, arch, tmp_path)


def _with_input_width(spec, width):
    """`spec` with its conv's input `width` columns wide."""
    anchor = replace(spec.anchor, direct=spec.anchor.direct[:4] + (width,))
    ho, wo = anchor.direct_out_hw()
    return replace(spec, anchor=anchor, inner=ho * wo)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_direct_conv_fma_blocks_of_128_columns(dtype, monkeypatch):
    # Under DIRECT_FMA_NARROW the FMA kernel takes blocks of 128 columns where they leave
    # fewer columns outside the output: 100 and 300 wide (the library conv's before), not
    # 200 or 254 (as many outside either way).
    render_module = sys.modules["cuda_templates.render"]
    monkeypatch.setattr(render_module, "DIRECT_FMA_16BIT", True)
    monkeypatch.setattr(render_module, "DIRECT_FMA_NARROW", False)
    base = direct_specs(dtype)["direct_pointwise_k5_pad2"]  # 3 -> 20 channels, 5 x 5, padding 2: wo = width
    assert "256-column tile idle" in cuda_templates.direct_plan(_with_input_width(base, 100))
    monkeypatch.setattr(render_module, "DIRECT_FMA_NARROW", True)
    for wo, tile_w in ((100, 128), (128, 128), (300, 128), (200, 256), (254, 256), (450, 256)):
        spec = _with_input_width(base, wo)
        d = cuda_templates.direct_plan(spec)
        assert isinstance(d, cuda_templates.DirectPlan) and d.kind == "fma" and d.tile_w == tile_w, (wo, d)
        assert d.tiles == -(-9 // d.tile_h) * -(-wo // tile_w)
        assert f"constexpr int kTW = {tile_w};" in cuda_templates.render(spec, "sm90")
    assert "256-column tile idle" in cuda_templates.direct_plan(_with_input_width(base, 80))  # idle either way
    assert "256-column tile idle" in cuda_templates.direct_plan(_with_input_width(base, 150))
    # the tensor-core kernels keep their 256 columns: what they take at 256 wide goes to FMA at 100
    cin8 = direct_specs(dtype)["direct_pointwise_cin8"]
    assert cuda_templates.direct_plan(_with_input_width(cin8, 100), "sm90", conv_tf32=True).kind == "fma"
    assert cuda_templates.direct_plan(cin8, "sm90", conv_tf32=True).kind in ("mma", "tf32")


@needs_nvcc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nvcc_compiles_the_fma_direct_conv_of_128_columns(dtype, tmp_path, monkeypatch):
    # Pointwise (one phase) and GroupNorm (two phases) files of 128-column blocks build.
    render_module = sys.modules["cuda_templates.render"]
    monkeypatch.setattr(render_module, "DIRECT_FMA_16BIT", True)
    monkeypatch.setattr(render_module, "DIRECT_FMA_NARROW", True)
    for name in ("direct_pointwise_k5_pad2", "direct_groupnorm_cpg3"):
        spec = _with_input_width(direct_specs(dtype)[name], 112)
        d = cuda_templates.direct_plan(spec)
        assert d.kind == "fma" and d.tile_w == 128, d
        cuda_templates.build(cuda_templates.render(spec, "sm90"), cuda_templates.kernel_name(spec, "sm90"), "sm90",
                             tmp_path)


def _one_row(spec, cin, cout, k, width, padding=0, stride=1):
    """`spec`'s chain after a Conv1d(cin, cout, k) on rows of `width`, as the 2-D conv of one
    row the matcher makes of it (`Anchor.as_2d`)."""
    conv = ((1, stride), (0, padding), (1, 1), False, (0, 0), 1)
    anchor = replace(spec.anchor, conv=conv, direct=(cin, 1, k, 1, width), as_2d=True)
    wo = (width + 2 * padding - k) // stride + 1
    return replace(spec, anchor=anchor, channels=cout, inner=wo)


@needs_nvcc
def test_a_conv1d_as_one_row_tiles_no_row_outside_and_builds(tmp_path):
    # The in-kernel conv: patches of 1 x 128 (a 300-wide row would take 64 x 2, a row
    # outside); the FMA direct conv: blocks of the fewest rows its channels allow. Both build.
    igemm = _one_row(conv_gemm_specs("bfloat16")["igemm_relu_bias_64_128"], 64, 128, 5, 300, padding=2)
    plan = cuda_templates.conv_gemm_plan(igemm, "sm90")
    assert isinstance(plan, cuda_templates.ConvGemmPlan) and (plan.tile_h, plan.tile_w) == (1, 128), plan
    two_d = conv_gemm_specs("bfloat16")["igemm_relu_bias_64_128"]
    assert cuda_templates.conv_gemm_plan(two_d, "sm90").tile_h > 1  # a 62 x 62 output: unchanged
    fma = _one_row(direct_specs("float32")["direct_pointwise_k5_pad2"], 3, 20, 5, 250, padding=2)
    d = cuda_templates.direct_plan(fma, "sm90")
    assert d.kind == "fma" and d.tile_h == 64 // d.copad, d  # 32 channels: 2 rows at once, no fewer
    for spec in (igemm, fma):
        arch = cuda_templates.build_arch(spec, "sm90")
        cuda_templates.build(cuda_templates.render(spec, "sm90"), cuda_templates.kernel_name(spec, "sm90"), arch,
                             tmp_path)


def test_tf32_direct_conv_plans():
    w5 = direct_specs()["w5_direct"]
    d = cuda_templates.direct_plan(w5, "sm90", conv_tf32=True)
    assert d.kind == "tf32" and d.tile_h == 8 and d.smem <= 110 * 1024  # two blocks per SM
    assert cuda_templates.kernel_name(w5, "sm90", conv_tf32=True).endswith("_tf32")
    source = cuda_templates.render(w5, "sm90", conv_tf32=True)
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in source  # (cvt.rna.tf32: direct_conv_mma.cuh)
    # phase 1 stores the pre-norm value, phase 2 normalizes it
    assert "mma_tile<2>(a, n, tile);" in source and "apply_tile(a, n, tile);" in source
    # exact float32 unless TF32 is allowed, and before sm_80
    assert cuda_templates.direct_plan(w5, "sm90").kind == "fma"
    assert cuda_templates.direct_plan(w5, "sm75", conv_tf32=True).kind == "fma"
    # 3 input channels do not fill a 16-byte chunk of 4 floats: FMA
    assert cuda_templates.direct_plan(direct_specs()["direct_pointwise_k5_pad2"], "sm90", conv_tf32=True).kind == "fma"
    pointwise = cuda_templates.render(direct_specs()["direct_pointwise_cin8"], "sm90", conv_tf32=True)
    assert "mma_tile<1>(a, n, tile);" in pointwise and "_twophase" not in pointwise


def test_saved_values_are_stored_where_the_spec_says():
    # W4 in training (bias, groupnorm | silu, mul, silu): groupnorm's output (slot 0),
    # its statistics (1, 2) and each silu's sigmoid (3, 4).
    spec = training_specs("bfloat16")["train_w4_groupnorm_silu"]
    source = cuda_templates.render(spec, "sm90")
    stage1 = source[source.index("void stage1("):source.index("struct stage1_chan")]
    marks = ["// groupnorm", "sv0v[j] = x;", "sv3v[j] = fusedepi::sigmoid", "// silu", "// mul",
             "sv4v[j] = fusedepi::sigmoid", "x = fusedepi::silu"]
    positions = [stage1.index(m) for m in marks[:-1]] + [stage1.rindex(marks[-1])]
    assert positions == sorted(positions), dict(zip(marks, positions))
    assert "rounded" not in stage1  # after the reduction values stay float32
    assert "a.sv1[p.seg] = fusedepi::from_float<__nv_bfloat16>(s0)" in source
    assert "a.sv2[p.seg] = fusedepi::from_float<__nv_bfloat16>(s1)" in source
    # W3 saves the value after its folded bias, before the statistics: rounded in
    # registers (every kernel running stage0), stored only where `save` is set.
    source = cuda_templates.render(training_specs("bfloat16")["train_w3_groupnorm"], "sm90")
    stage0 = source[source.index("void stage0("):source.index("struct stage0_chan")]
    assert stage0.index("// add") < stage0.index("saved: rounded") < stage0.index("sv0v[j] = x;")
    assert "if (save) fusedepi::store_vec<__nv_bfloat16, W>(a.sv0 + e0, sv0v);" in stage0
    assert "load_stage0(a, p, seg_source(a, p, img), v, true);" in source  # the apply kernel writes the saves


def test_pointwise_teams_fit_their_segments():
    # A padded GEMM's rows of 513 (bf16, read element by element): a warp, 17 a lane
    # (544 slots), not a block of 128 x 5 (640).
    padded = EpilogueSpec(Anchor("addmm", pad=(152, 520)), (Step("gelu"), Step("neg")), "bfloat16", (), 513, 1,
                          "linear_pointwise")
    p = plan(padded)
    assert (p.team, p.nvec, p.vec, p.flat) == (32, 17, 1, False)
    # An NCHW conv's rows of 16 x 529 (1058 vectors of 8): a block of whole warps of 4-8
    # vectors a thread that the row fills (160 x 7, 94%), not a power of two (256 x 5,
    # 83%); a norm over the row keeps a power of two (its block-wide reductions), as
    # does the staged kernel of a channels-last conv (measured faster so).
    nchw = EpilogueSpec(CONV, (Step("relu"),), "bfloat16", (), 16, 23 * 23, "conv_pointwise")
    p = plan(nchw)
    assert not p.staged and p.team == p.block == 160 and p.nvec == 7
    norm = replace(nchw, steps=(Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=1),), fusion="conv_groupnorm")
    assert plan(norm).team == 256
    assert plan(replace(nchw, anchor=CHANNELS_LAST)).team == 512


def _one_file_a_form(arch: str) -> list[tuple[str, str, str]]:
    """A compile job for the first spec of each (anchor form, float32 or 16-bit, with or
    without a reduction) at `arch`."""
    picked: dict = {}
    for name, spec in ALL_SPECS.items():
        key = (cuda_templates.kernel_name(spec, arch).split("_")[0], spec.dtype == "float32", spec.reduction is None)
        picked.setdefault(key, ("test_nvcc_compiles", name, arch))
    return list(picked.values())


@needs_nvcc
def test_kernel_files_compile_without_warnings():
    # nvcc's front end on one file of each form: nothing declared and left unused, no
    # unreachable code, no kernel instantiation named without a definition (a warning on
    # every build is one a user learns to ignore).
    jobs = _one_file_a_form("sm90a") + [("test_nvcc_compiles", "direct_pointwise_k5_pad2-float32", "sm80"),
                                        ("test_nvcc_compiles_tf32_direct_convs", next(iter(TF32_SPECS)), "sm90a")]
    jobs += [("test_nvcc_compiles_the_in_kernel_gemm", n, "sm90a") for n in ("gemm_pointwise-bfloat16",
                                                                              "gemm_w2_logsumexp-float32")]
    # the in-kernel conv's two schedules: ping-pong (64 channels a tile), cooperative (160,
    # 192), each with a norm's moments too
    # (and k-steps of 128, 32 and 64 bytes: 72 and 32 float32 input channels, 8 bf16, 32 bf16)
    jobs += [("test_nvcc_compiles_the_in_kernel_conv", n, "sm90a") for n in (
        "igemm_1x1_residual-float32", "igemm_cin8_k5_320-bfloat16", "igemm_groupnorm_silu-float32",
        "igemm_bn_1x1_192-bfloat16")]
    nvcc = compiler.find_nvcc()

    def warnings_of(job, directory):
        source, kernel, arch = _compile_job(*job)
        path = directory / f"{kernel}.cu"
        path.write_text(source)
        number = arch[2:]
        run = subprocess.run([nvcc, "-std=c++17", f"-gencode=arch=compute_{number},code=sm_{number}", "-cuda", "-I",
                              str(compiler.INCLUDE_DIR), str(path), "-o", os.devnull],
                             capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        return [line for line in run.stderr.splitlines() if "warning" in line]

    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        found = dict(zip([j[1] for j in jobs], pool.map(lambda job: warnings_of(job, Path(tmp)), jobs)))
    assert len(jobs) >= 16
    assert not any(found.values()), {name: lines for name, lines in found.items() if lines}


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("tile_h, tile_w", [(1, 128), (2, 64), (8, 16), (16, 8)])
def test_in_kernel_conv_staging_pitch(tile_h, tile_w, itemsize):
    # The kernel file's kPitch: a slot of tile_w + 16 bytes for each patch row (a run staged
    # at any offset from a 16-byte boundary of the output fits), rounded up to 64 bytes,
    # + 16: two channels apart by 2 * kPitch fall 8 banks apart (the consumers' writes).
    from cuda_templates import conv_sm90

    pitch = conv_sm90.staging_pitch(tile_h, tile_w, itemsize)
    out_v = 16 // itemsize
    assert pitch * itemsize % 64 == 16
    assert tile_h * (tile_w + out_v) <= pitch - out_v < tile_h * (tile_w + out_v) + 64 // itemsize
    assert 2 * pitch * itemsize // 4 % 32 == 8


def test_in_kernel_conv_tiles_fit_shared_memory():
    # Every output width and channel count gets a tiling whose ring (3 stages or more)
    # and staging tile fit sm_90's 227 KiB a block, as conv_sm90.cuh's kConvSmem counts
    # them (the narrowest patches have the largest staging tiles: 16 runs a channel).
    from cuda_templates import conv_sm90

    for itemsize, k_bytes, stats in itertools.product((2, 4), conv_sm90.K_STEP_BYTES, (False, True)):
        for cout in range(8, 1025, 8):
            for wo in (1, 7, 8, 9, 13, 16, 31, 64, 126, 300):
                t = conv_sm90.tiling(cout, wo, itemsize, stats=stats, k_bytes=k_bytes)
                staging = t.block_n * conv_sm90.staging_pitch(t.tile_h, t.tile_w, itemsize) * itemsize
                moments = 4 * conv_sm90.stats_floats(t.block_n, t.pingpong) if stats else 0
                smem = t.stages * (t.block_m + t.block_n) * k_bytes + staging + moments + 1024
                assert t.stages >= 3 and smem <= 227 * 1024, (itemsize, cout, wo, t)
                # the ring holds 8 k-steps of 128 bytes at most, or as many bytes of narrower ones
                assert t.k_bytes == k_bytes and t.stages * k_bytes <= 8 * 128, t
    with pytest.raises(ValueError, match="k-step of 48 bytes"):
        conv_sm90.tiling(64, 64, 2, k_bytes=48)


@pytest.mark.parametrize("wo, width", [(94, 32), (96, 32), (126, 128), (128, 128), (200, 32), (100, 128), (62, 64),
                                       (56, 64), (48, 64), (28, 32), (19, 32), (5, 8)])
def test_in_kernel_conv_patches_leave_the_fewest_columns_outside(wo, width):
    # The widest power-of-two patch (32 to the output's width) with the fewest columns
    # outside the output: 94 columns in three patches of 32, not one of 128.
    from cuda_templates import conv_sm90

    t = conv_sm90.tiling(32, wo, 2, ho=64)
    assert t.tile_w == width and t.tile_h * t.tile_w == t.block_m, t
    if wo >= conv_sm90.NARROWEST_PATCH_W:
        assert all(-(-wo // w) * w >= -(-wo // width) * width for w in (32, 64, 128) if w <= max(width, wo))


@pytest.mark.parametrize("exponent, code", [
    (0.0, "x = 1.0f;"), (2.0, "x = x * x;"), (3.0, "x = x * x * x;"),
    (-2.0, "x = fusedepi::divide<kFastMath>(1.0f, x * x);"), (0.5, "x = sqrtf(x);"), (-0.5, "x = rsqrtf(x);"),
    (-1.0, "x = fusedepi::divide<kFastMath>(1.0f, x);"), (1.5, "x = powf(x, static_cast<float>(0x1.8000000000000p+0));"),
])
def test_a_constant_power_is_computed_as_aten_computes_it(exponent, code):
    """ATen's CUDA pow by a scalar: sqrt, rsqrt and reciprocal for 0.5, -0.5 and -1;
    products for 2, 3 and -2; 1 for 0 (its own shortcut); powf otherwise."""
    from cuda_templates.snippets import SNIPPETS

    assert SNIPPETS["pow"](Step("pow", consts=(exponent,)), None) == code
    assert SNIPPETS["pow"](Step("pow", consts=(1.0,)), None) == ""
