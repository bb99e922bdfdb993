"""Hand-built specs covering every template path (used by the GPU-free template tests)."""

import math

from lowering.matcher import pool_out_size
from lowering.spec import BROADCAST, CHANNEL, EARLIER, FULL, ONE, SCALAR, SELF, Anchor, EpilogueSpec, Step

LINEAR = Anchor("mm")  # nn.Linear in float32 under TF32: the bias moves into the epilogue
CONV = Anchor("conv", has_bias=False, conv=((1, 1), (0, 0), (1, 1), False, (0, 0), 1))
CHANNELS_LAST = Anchor("conv", has_bias=True, conv=((1, 1), (1, 1), (1, 1), False, (0, 0), 1), channels_last=True)
BMM = Anchor("bmm")  # torch.bmm: [B, M, N] read as a Conv1d's output (channels M, a plane of N)


def _bias(index):
    """The folded GEMM/conv bias: the epilogue's first step."""
    return Step("add", inputs=(index,), operand=CHANNEL, reverse=True)


def workload_specs(dtype="float32"):
    """The five workloads' specs, as the matcher builds them under TF32 (sizes from benchmarks/workloads.py)."""
    p = (dtype,)
    return {
        "w1_bn_train": EpilogueSpec(
            LINEAR,
            (_bias(0), Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(1, 2, 3, 4)), Step("gelu"), Step("relu")),
            dtype, p * 5, 4096, 1, "linear_batchnorm_train",
        ),
        "w1_bn_eval": EpilogueSpec(
            LINEAR,
            (_bias(0), Step("batchnorm_eval", consts=(1e-5,), inputs=(1, 2, 3, 4)), Step("gelu"), Step("relu")),
            dtype, p * 5, 4096, 1, "linear_batchnorm_eval",
        ),
        "w2_logsumexp": EpilogueSpec(
            LINEAR,
            (_bias(0), Step("logsumexp", keepdim=True), Step("leaky_relu", consts=(0.01,)),
             Step("leaky_relu", consts=(0.01,)), Step("gelu"), Step("gelu")),
            dtype, p, 8192, 1, "linear_logsumexp",
        ),
        "w3_groupnorm": EpilogueSpec(
            LINEAR,
            (_bias(0), Step("groupnorm", consts=(1e-5,), inputs=(1, 2), groups=512),
             Step("leaky_relu", consts=(0.01,)), Step("add", operand=SELF)),
            dtype, p * 3, 8192, 1, "linear_groupnorm",
        ),
        "w4_groupnorm_silu": EpilogueSpec(
            LINEAR,
            (_bias(0), Step("groupnorm", consts=(1e-5,), inputs=(1, 2), groups=256), Step("silu"),
             Step("mul", inputs=(3,), operand=CHANNEL), Step("silu")),
            dtype, p * 4, 8192, 1, "linear_groupnorm",
        ),
        "w5_conv_groupnorm": EpilogueSpec(
            CONV,
            (_bias(0), Step("add", inputs=(1,), operand=CHANNEL), Step("mul", inputs=(2,), operand=CHANNEL),
             Step("sigmoid"), Step("groupnorm", consts=(1e-5,), inputs=(3, 4), groups=8)),
            dtype, p * 5, 32, 254 * 254, "conv_groupnorm",
        ),
    }


def gemm_specs(dtype="bfloat16"):
    """Chains the in-kernel GEMM computes (16-bit Linear layers, as the matcher builds them:
    addmm keeps its bias): workload 3, GroupNorm with groups of 32 (workload 4's) and a
    per-column operand, a pointwise chain, one in the consumer warps (`Anchor.gemm_consumers`),
    one without bias (mm) that reads a residual per
    element, one with a step before its GroupNorm, workload 1's eval chain (BatchNorm's
    per-column operands, the erf gelu), and row reductions: workload 2's logsumexp, an
    amin and a mean with steps before and after them."""
    p = (dtype,)
    return {
        "gemm_w3_groupnorm": EpilogueSpec(
            Anchor("addmm", gemm=(8192, 1)),
            (Step("groupnorm", consts=(1e-5,), inputs=(0, 1), groups=512), Step("leaky_relu", consts=(0.01,)),
             Step("add", operand=SELF)),
            dtype, p * 2, 8192, 1, "linear_groupnorm",
        ),
        "gemm_groupnorm32_mul": EpilogueSpec(
            Anchor("addmm", gemm=(8192, 1)),
            (Step("groupnorm", consts=(1e-5,), inputs=(0, 1), groups=256), Step("relu"),
             Step("mul", inputs=(2,), operand=CHANNEL), Step("leaky_relu", consts=(0.2,))),
            dtype, p * 3, 8192, 1, "linear_groupnorm",
        ),
        "gemm_pointwise": EpilogueSpec(
            Anchor("addmm", gemm=(4096, 1)),
            (Step("clamp", consts=(-1.0, 2.0)), Step("sub", inputs=(0,), operand=CHANNEL)),
            dtype, p, 4096, 1, "linear_pointwise",
        ),
        "gemm_tanh_consumers": EpilogueSpec(  # the chain in the consumer warps (the gemm_consumers form)
            Anchor("addmm", gemm=(768, 0), gemm_consumers=True),
            (Step("tanh"), Step("mul", consts=(2.0,), operand=SCALAR)),
            dtype, p, 3072, 1, "linear_pointwise",
        ),
        "gemm_mm_residual": EpilogueSpec(
            Anchor("mm", gemm=(264, 1)),
            (Step("mul", consts=(0.5,), operand=SCALAR), Step("add", inputs=(0,), operand=FULL), Step("relu")),
            dtype, p, 512, 1, "linear_pointwise",
        ),
        "gemm_scale_then_groupnorm": EpilogueSpec(
            Anchor("mm", gemm=(64, 1)),
            (Step("mul", inputs=(0,), operand=ONE), Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=2),
             Step("abs")),
            dtype, p, 512, 1, "linear_groupnorm",
        ),
        "gemm_w1_eval": EpilogueSpec(
            Anchor("addmm", gemm=(4096, 1)),
            (Step("batchnorm_eval", consts=(1e-5,), inputs=(0, 1, 2, 3)), Step("gelu"), Step("relu")),
            dtype, p * 4, 4096, 1, "linear_batchnorm_eval",
        ),
        "gemm_w2_logsumexp": EpilogueSpec(
            Anchor("addmm", gemm=(8192, 1)),
            (Step("logsumexp", keepdim=True), Step("leaky_relu", consts=(0.01,)), Step("leaky_relu", consts=(0.01,)),
             Step("gelu"), Step("gelu")),
            dtype, p, 8192, 1, "linear_logsumexp",
        ),
        "gemm_scale_amin": EpilogueSpec(
            Anchor("mm", gemm=(264, 1)),
            (Step("mul", consts=(0.5,), operand=SCALAR), Step("amin"), Step("abs")),
            dtype, p, 512, 1, "linear_amin",
        ),
        "gemm_row_scale": EpilogueSpec(  # an operand per row [M, 1]
            Anchor("addmm", gemm=(64, 1)), (_broadcast("mul", 0, (512, 0, 1)), Step("tanh")),
            dtype, p, 512, 1, "linear_pointwise",
        ),
        "gemm_sample_gate_residual": EpilogueSpec(  # a per-sample gate [B, 1, 512] over 75 rows, a residual
            Anchor("addmm", gemm=(64, 1)),
            (Step("tanh"), _broadcast("mul", 0, (75 * 512, 0, 512), (1, 512, 1)), Step("add", inputs=(1,), operand=FULL)),
            dtype, p * 2, 512, 1, "linear_pointwise",
        ),
        "gemm_relu_mean": EpilogueSpec(
            Anchor("addmm", gemm=(64, 1)),
            (Step("relu"), Step("mean", keepdim=True), Step("sigmoid")),
            dtype, p, 768, 1, "linear_mean",
        ),
    }


def _direct(pad, direct):
    """A conv anchor the direct kernel computes: (in_channels, kh, kw, in_h, in_w)."""
    return Anchor("conv", has_bias=False, conv=((1, 1), (pad, pad), (1, 1), False, (0, 0), 1), direct=direct)


def direct_specs(dtype="float32"):
    """Convs the direct kernel computes: workload 5, padding, padded channels, two column tiles."""
    p = (dtype,)
    w5 = workload_specs(dtype)["w5_conv_groupnorm"]
    return {
        "w5_direct": EpilogueSpec(_direct(0, (8, 3, 3, 256, 256)), w5.steps, dtype, w5.param_dtypes, 32, 254 * 254,
                                  w5.fusion),
        "direct_pointwise_k5_pad2": EpilogueSpec(  # 20 channels: padded to 32, no reduction
            _direct(2, (3, 5, 5, 9, 200)), (_bias(0), Step("relu"), Step("mul", consts=(2.0,), operand=SCALAR)),
            dtype, p, 20, 9 * 200, "conv_pointwise",
        ),
        "direct_pointwise_cin8": EpilogueSpec(  # no reduction, 8 input channels: bf16/fp16 take the tensor cores
            _direct(1, (8, 3, 3, 7, 256)), (_bias(0), Step("sigmoid")), dtype, p, 16, 7 * 256, "conv_pointwise",
        ),
        "direct_groupnorm_cpg3": EpilogueSpec(  # 3 channels per group: a statistics slot per channel
            _direct(1, (4, 3, 3, 11, 256)),
            (_bias(0), Step("groupnorm", consts=(1e-5,), inputs=(1, 2), groups=8), Step("silu"),
             Step("mul", inputs=(3,), operand=CHANNEL)),
            dtype, p * 4, 24, 11 * 256, "conv_groupnorm",
        ),
        "direct_groupnorm_cpg16_16_channels": EpilogueSpec(  # one group spanning both 8-row halves
            _direct(1, (16, 3, 3, 9, 256)),
            (_bias(0), Step("tanh"), Step("groupnorm", consts=(1e-5,), inputs=(1, 2), groups=1)),
            dtype, p * 3, 16, 9 * 256, "conv_groupnorm",
        ),
        "direct_groupnorm_cpg1": EpilogueSpec(  # a group per channel
            _direct(0, (8, 3, 3, 10, 202)),
            (_bias(0), Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=32), Step("relu")),
            dtype, p, 32, 8 * 200, "conv_groupnorm",
        ),
        "direct_groupnorm_cpg16_two_column_tiles": EpilogueSpec(  # 64 channels, width 448
            _direct(0, (2, 3, 3, 10, 450)),
            (_bias(0), Step("sigmoid"), Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=4), Step("gelu")),
            dtype, p, 64, 8 * 448, "conv_groupnorm",
        ),
    }


def _implicit(pad, direct, stride=1, dilation=1):
    """A conv anchor the in-kernel conv may compute (FUSEDEPI_IN_KERNEL_CONV=1)."""
    conv = ((stride, stride), (pad, pad), (dilation, dilation), False, (0, 0), 1)
    return Anchor("conv", has_bias=False, conv=conv, direct=direct, implicit=True)


def _implicit3d(pad, direct, depth, stride=(1, 1, 1), dilation=(1, 1, 1)):
    """A 3-D conv anchor the in-kernel conv may compute: `direct` (C_in, kh, kw, H, W),
    `depth` (kd, D); padding (pad_d, pad_h, pad_w)."""
    conv = (stride, pad, dilation, False, (0, 0, 0), 1)
    return Anchor("conv", has_bias=False, conv=conv, direct=direct, depth=depth, implicit=True)


def conv_gemm_specs(dtype="bfloat16"):
    """Convs the in-kernel conv computes (`conv_gemm_plan`): more output channels than
    the direct conv takes; padding, a tile wider than the output, two channel tiles,
    input channels below a k-step, a residual read at its NCHW place, strides and
    dilations (a patch narrowed by its stride's box). (float32 only
    where TF32 is allowed: render with conv_tf32=True.)"""
    p = (dtype,)
    specs = {
        "igemm_relu_bias_64_128": EpilogueSpec(  # conv2d_relu_bias: 62 x 62 output
            _implicit(0, (64, 3, 3, 64, 64)), (Step("relu"), Step("add", inputs=(0,), operand=CHANNEL)),
            dtype, p, 128, 62 * 62, "conv_pointwise",
        ),
        "igemm_pad1_gelu_96": EpilogueSpec(  # 96 channels, padding 1, width 13
            _implicit(1, (32, 3, 3, 9, 13)), (_bias(0), Step("gelu")), dtype, p, 96, 9 * 13, "conv_pointwise",
        ),
        "igemm_cin8_k5_320": EpilogueSpec(  # 8 input channels, two channel tiles of 160
            _implicit(2, (8, 5, 5, 20, 140)), (Step("silu"), Step("mul", consts=(2.0,), operand=SCALAR)),
            dtype, p, 320, 20 * 140, "conv_pointwise",
        ),
        "igemm_1x1_nchw_gelu": EpilogueSpec(  # a 1 x 1 conv of 128-byte rows: 16-bit x read NCHW (reads_nchw)
            _implicit(0, (64, 1, 1, 16, 64)), (_bias(0), Step("gelu")), dtype, p * 2, 128, 16 * 64, "conv_pointwise",
        ),
        # spatial reductions (conv_sm90.REDUCES): the tiles' partials, no conv output written
        "igemm_relu_global_mean": EpilogueSpec(  # conv2d_relu_global_avgpool's chain on 28 x 28: patches of 4 rows
            _implicit(1, (64, 3, 3, 28, 28)), (_bias(0), Step("relu"), Step("spatial_mean")),
            dtype, p, 128, 28 * 28, "conv_spatial_mean",
        ),
        "igemm_tanh_amax_scale": EpilogueSpec(  # amax, then a scalar step on its value; cut patches at both edges
            _implicit(0, (16, 3, 3, 19, 70)), (Step("tanh"), Step("spatial_amax"), Step("mul", consts=(2.0,),
                                                                                         operand=SCALAR)),
            dtype, (), 32, 17 * 68, "conv_spatial_amax",
        ),
        # reductions over each pixel's channels, all in one tile (conv_sm90.PIXEL_REDUCES): a value a pixel
        "igemm_channel_amin_tanh_32": EpilogueSpec(  # conv2d_min_channels_tanh's chain (keepdim), 16 -> 32
            _implicit(0, (16, 3, 3, 26, 40)), (_bias(0), Step("channel_amin", keepdim=True), Step("tanh")),
            dtype, p, 32, 24 * 38, "conv_channel_amin",
        ),
        "igemm_channel_logsumexp_128": EpilogueSpec(  # 1 x 1, 128 channels; + a residual of the pixels' shape
            _implicit(0, (16, 1, 1, 10, 36)), (Step("silu"), Step("channel_logsumexp"),
                                               Step("add", inputs=(0,), operand=FULL)),
            dtype, p, 128, 10 * 36, "conv_channel_logsumexp",
        ),
        # pooling windows in the tiles (conv_sm90.POOLS_IN_TILE): the pooled plane written, not the conv's output
        "igemm_relu_maxpool_2x2": EpilogueSpec(  # conv2d_relu_maxpool's chain, then a per-channel scale
            _implicit(1, (16, 3, 3, 40, 40)),
            (_bias(0), Step("relu"), Step("maxpool", consts=(0,), window=((40, 40), (20, 20), (2, 2), (2, 2), (0, 0),
                                                                         (1, 1))),
             Step("mul", inputs=(1,), operand=CHANNEL)),
            dtype, p * 2, 32, 40 * 40, "conv_maxpool",
        ),
        "igemm_tanh_avgpool_2x4_cut": EpilogueSpec(  # 17 x 70: a row and 2 columns past the last window; + a
            _implicit(0, (32, 3, 3, 19, 72)),       # residual of the pooled shape
            (Step("tanh"), Step("avgpool", consts=(0, 1, 0), window=((17, 70), (8, 17), (2, 4), (2, 4), (0, 0),
                                                                    (1, 1))),
             Step("add", inputs=(0,), operand=FULL)),
            dtype, p, 64, 17 * 70, "conv_avgpool",
        ),
        # a softmax over each pixel's channels, all in one tile (conv_sm90.PIXEL_NORMS)
        "igemm_channel_softmax_32": EpilogueSpec(  # conv2d_softmax_channels' chain: 32 -> 32 channels
            _implicit(1, (32, 3, 3, 24, 40)), (_bias(0), Step("channel_softmax"), Step("mul", consts=(3.0,),
                                                                                       operand=SCALAR)),
            dtype, p, 32, 24 * 40, "conv_channel_softmax",
        ),
        "igemm_channel_log_softmax_128": EpilogueSpec(  # 1 x 1, 128 channels: every channel in one tile
            _implicit(0, (16, 1, 1, 10, 36)), (Step("tanh"), Step("channel_log_softmax")),
            dtype, (), 128, 10 * 36, "conv_channel_log_softmax",
        ),
        "igemm_time_embedding": EpilogueSpec(  # + an operand per (image, channel) [N, C, 1, 1]
            _implicit(0, (64, 3, 3, 12, 20)), (_bias(0), _broadcast("add", 1, (180, 0, 1)), Step("relu")),
            dtype, p * 2, 128, 10 * 18, "conv_pointwise",
        ),
        "igemm_1x1_residual": EpilogueSpec(  # a 1 x 1 conv, then + a full-shape residual
            _implicit(0, (72, 1, 1, 7, 33)), (_bias(0), Step("add", inputs=(1,), operand=FULL), Step("relu")),
            dtype, p * 2, 64, 7 * 33, "conv_pointwise",
        ),
        # norms: the tiles' moments, their merge, the apply kernel in place
        "igemm_bn_relu_16_32": EpilogueSpec(  # BatchNorm (training), ping-pong tiles of 32 channels, 16 input
            _implicit(1, (16, 3, 3, 40, 40)),
            (_bias(0), Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(1, 2, 3, 4)), Step("relu")),
            dtype, p * 5, 32, 40 * 40, "conv_batchnorm_train",
        ),
        "igemm_bn_1x1_192": EpilogueSpec(  # BatchNorm on cooperative tiles of 192 channels
            _implicit(0, (32, 1, 1, 12, 20)),
            (_bias(0), Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(1, 2, 3, 4)), Step("silu")),
            dtype, p * 5, 192, 12 * 20, "conv_batchnorm_train",
        ),
        "igemm_groupnorm_silu": EpilogueSpec(  # groups of 8 channels, partial patches at the edges
            _implicit(1, (32, 3, 3, 20, 24)),
            (_bias(0), Step("groupnorm", consts=(1e-5,), inputs=(1, 2), groups=8), Step("silu")),
            dtype, p * 3, 64, 20 * 24, "conv_groupnorm",
        ),
        "igemm_instancenorm_leaky": EpilogueSpec(  # a group a channel, no affine
            _implicit(0, (16, 3, 3, 30, 30)),
            (_bias(0), Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=32), Step("leaky_relu", consts=(0.2,))),
            dtype, p, 32, 28 * 28, "conv_groupnorm",
        ),
        # strides and dilations: the tensor map's element strides, the taps' offsets
        "igemm_stride2_bn_relu6": EpilogueSpec(  # conv2d_stride2_bn_relu6: 30 x 70 -> 15 x 35
            _implicit(1, (32, 3, 3, 30, 70), stride=2),
            (_bias(0), Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(1, 2, 3, 4)),
             Step("clamp", consts=(0.0, 6.0))),
            dtype, p * 5, 64, 15 * 35, "conv_batchnorm_train",
        ),
        "igemm_dilated2_gelu": EpilogueSpec(  # dilation 2, padding 2: 20 x 40 -> 20 x 40
            _implicit(2, (16, 3, 3, 20, 40), dilation=2), (_bias(0), Step("gelu")),
            dtype, p, 64, 20 * 40, "conv_pointwise",
        ),
        "igemm_stride3_k5_wide": EpilogueSpec(  # 134 columns out; the box of 3 x 128 > 256: patches of 64
            _implicit(2, (16, 5, 5, 9, 400), stride=3), (_bias(0), Step("relu")),
            dtype, p, 64, 3 * 134, "conv_pointwise",
        ),
        # 3-D convs by planes of the output's depth (Anchor.depth): the patches of a plane,
        # the taps' depth planes (zeros past the input's: padding)
        "igemm3d_gn_silu": EpilogueSpec(  # conv3d_gn_silu's chain: 6 x 18 x 18 -> 4 x 16 x 16, segments over planes
            _implicit3d((0, 0, 0), (8, 3, 3, 18, 18), (3, 6)),
            (_bias(0), Step("groupnorm", consts=(1e-5,), inputs=(1, 2), groups=4), Step("silu")),
            dtype, p * 3, 16, 4 * 16 * 16, "conv_groupnorm",
        ),
        "igemm3d_pad_stride2_relu": EpilogueSpec(  # depth padding 1 and stride 2: 9 -> 5 planes of 20 x 13
            _implicit3d((1, 1, 1), (16, 3, 3, 20, 13), (3, 9), stride=(2, 1, 1)), (_bias(0), Step("relu")),
            dtype, p, 64, 5 * 20 * 13, "conv_pointwise",
        ),
        "igemm3d_bn_dilated_mean": EpilogueSpec(  # depth dilation 2; BatchNorm over every plane
            _implicit3d((0, 1, 1), (32, 3, 3, 12, 12), (3, 7), dilation=(2, 1, 1)),
            (_bias(0), Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(1, 2, 3, 4)), Step("relu")),
            dtype, p * 5, 32, 3 * 12 * 12, "conv_batchnorm_train",
        ),
        "igemm3d_global_mean": EpilogueSpec(  # a spatial mean over D x H x W from the tiles
            _implicit3d((0, 1, 1), (16, 3, 3, 10, 24), (1, 4)), (_bias(0), Step("relu"), Step("spatial_mean")),
            dtype, p, 32, 4 * 10 * 24, "conv_spatial_mean",
        ),
    }
    specs = {name: spec.with_in_kernel_conv() for name, spec in specs.items()}  # float32: operands rounded
    # norms recomputed (Anchor.recompute): a pass for the tiles' moments, then the normed pass
    for name in ("igemm_bn_relu_16_32", "igemm_bn_1x1_192", "igemm_groupnorm_silu", "igemm_instancenorm_leaky"):
        specs[f"{name}_recomputed"] = specs[name].with_norm_recomputed()
    return specs


def _broadcast(name, index, *terms):
    """A binary step whose operand `index` broadcasts: (div, mod, stride) triples."""
    return Step(name, consts=tuple(v for t in terms for v in t), inputs=(index,), operand=BROADCAST)


def broadcast_specs(dtype="float32"):
    """Operands that broadcast over some of the chain's dims, in each kernel family: per
    row of a Linear output (flat mapping; before BatchNorm's column statistics), per
    position of a 3-D Linear's [1, S, D], per sample of one's [B, 1, D] before a residual
    (a DiT block's gate: an element for 16 rows), per (image, channel) around a GroupNorm (a
    UNet's time embedding and FiLM), per position and per pixel in the direct conv, per
    position before a softmax over the channels, per pixel before a pool, per (image,
    channel) on a channels-last y, and an attention bias [L, L] before a bmm's plane
    softmax."""
    p = (dtype,)
    pooled = ((30, 30), (15, 15), (2, 2), (2, 2), (0, 0), (1, 1))
    return {
        "broadcast_linear_rows_flat": EpilogueSpec(
            Anchor("mm"), (Step("add", inputs=(0,), operand=CHANNEL), _broadcast("mul", 1, (33, 0, 1)), Step("sigmoid")),
            dtype, p * 2, 33, 1, "linear_pointwise",
        ),
        "broadcast_linear_position_layernorm": EpilogueSpec(
            Anchor("mm"), (_broadcast("add", 0, (1, 640, 1)), Step("layernorm", consts=(1e-5,), inputs=(-1, -1))),
            dtype, p, 64, 1, "linear_layernorm",
        ),
        "broadcast_linear_sample_gate_residual": EpilogueSpec(
            Anchor("mm"), (_broadcast("mul", 0, (16 * 96, 0, 96), (1, 96, 1)), Step("add", inputs=(1,), operand=FULL)),
            dtype, p * 2, 96, 1, "linear_pointwise",
        ),
        "broadcast_linear_rows_batchnorm_train": EpilogueSpec(
            LINEAR, (_broadcast("mul", 0, (96, 0, 1)), Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(1, 2, 3, 4)),
                     Step("relu")),
            dtype, p * 5, 96, 1, "linear_batchnorm_train",
        ),
        "broadcast_conv_film_groupnorm": EpilogueSpec(
            CONV, (_bias(0), _broadcast("add", 1, (480, 0, 1)), Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=8),
                   Step("silu"), _broadcast("mul", 2, (480, 0, 1)), _broadcast("add", 3, (480, 0, 1))),
            dtype, p * 4, 32, 20 * 24, "conv_groupnorm",
        ),
        "broadcast_direct_position": EpilogueSpec(
            _direct(0, (3, 3, 3, 10, 202)), (_bias(0), _broadcast("add", 1, (1, 16 * 1600, 1)), Step("sigmoid")),
            dtype, p * 2, 16, 8 * 200, "conv_pointwise",
        ),
        "broadcast_direct_pixel_groupnorm": EpilogueSpec(
            _direct(1, (4, 3, 3, 11, 256)),
            (_bias(0), _broadcast("mul", 1, (24 * 2816, 0, 2816), (1, 2816, 1)),
             Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=4)),
            dtype, p * 2, 24, 11 * 256, "conv_groupnorm",
        ),
        "broadcast_direct_cin8_time_embedding": EpilogueSpec(  # bf16/fp16: the tensor-core direct conv
            _direct(1, (8, 3, 3, 7, 256)), (_bias(0), _broadcast("add", 1, (1792, 0, 1)), Step("silu")),
            dtype, p * 2, 16, 7 * 256, "conv_pointwise",
        ),
        "broadcast_position_channel_softmax": EpilogueSpec(
            CONV, (_broadcast("add", 0, (1, 16 * 315, 1)), Step("channel_softmax")), dtype, p, 16, 15 * 21,
            "conv_channel_softmax",
        ),
        "broadcast_pixel_maxpool": EpilogueSpec(
            CONV, (_broadcast("mul", 0, (12 * 900, 0, 900), (1, 900, 1)), Step("maxpool", consts=(0,), window=pooled)),
            dtype, p, 12, 900, "conv_maxpool",
        ),
        "broadcast_channels_last_time_embedding": EpilogueSpec(
            CHANNELS_LAST, (Step("add", inputs=(0,), operand=CHANNEL), _broadcast("add", 1, (162, 0, 1)), Step("gelu")),
            dtype, p * 2, 16, 9 * 18, "conv_pointwise",
        ),
        "broadcast_bmm_attention_bias_softmax": EpilogueSpec(
            BMM, (_broadcast("add", 0, (1, 1600, 1)), Step("spatial_softmax")), dtype, p, 40, 40, "bmm_spatial_softmax",
        ),
    }


def awkward_specs(dtype="float32"):
    """Odd sizes and operand kinds: scalar loads, residuals, layernorm, no reduction."""
    p = (dtype,)
    return {
        "groupnorm_odd_groups": EpilogueSpec(  # N=520, 8 groups of 65: scalar path, masked lanes
            LINEAR, (Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=8), Step("gelu_tanh")),
            dtype, (), 520, 1, "linear_groupnorm",
        ),
        "layernorm_residual": EpilogueSpec(
            Anchor("mm"),
            (Step("add", inputs=(0,), operand=CHANNEL), Step("layernorm", consts=(1e-5,), inputs=(1, 2)),
             Step("add", inputs=(3,), operand=FULL), Step("tanh"), Step("sub", consts=(1.5,), operand=SCALAR, reverse=True),
             Step("div", inputs=(4,), operand=ONE)),
            dtype, p * 5, 513, 1, "linear_layernorm",
        ),
        "pointwise_only": EpilogueSpec(  # an addmm whose bias was not folded
            Anchor("addmm"), (Step("sigmoid"), Step("mul", consts=(2.0,), operand=SCALAR)),
            dtype, (), 255, 1, "linear_pointwise",
        ),
        "logsumexp_short_row": EpilogueSpec(
            LINEAR, (Step("logsumexp", keepdim=False), Step("silu")), dtype, (), 100, 1, "linear_logsumexp",
        ),
        # Pointwise chains on rows that split badly: the flat mapping (vectors across rows).
        "flat_channel_operands": EpilogueSpec(  # N=33: per-channel operands element by element
            Anchor("mm"),
            (Step("add", inputs=(0,), operand=CHANNEL), Step("mul", inputs=(1,), operand=CHANNEL),
             Step("add", inputs=(2,), operand=FULL), Step("sigmoid")),
            dtype, p * 3, 33, 1, "linear_pointwise",
        ),
        "flat_narrow_row": EpilogueSpec(  # N=3: a vector spans several rows
            Anchor("mm"), (Step("add", inputs=(0,), operand=CHANNEL), Step("gelu")), dtype, p, 3, 1, "linear_pointwise",
        ),
        # Binary steps whose operand is an earlier value of the chain (held in a register).
        "earlier_values_pointwise": EpilogueSpec(  # y * tanh(softplus(y)) + y
            Anchor("mm"), (Step("softplus", consts=(1.0, 20.0)), Step("tanh"),
                           Step("mul", consts=(0,), operand=EARLIER, reverse=True),
                           Step("add", consts=(0,), operand=EARLIER)),
            dtype, (), 96, 1, "linear_pointwise",
        ),
        "earlier_values_after_groupnorm": EpilogueSpec(  # g = GroupNorm(y); g - sigmoid(g)
            Anchor("mm"), (Step("groupnorm", consts=(1e-5,), inputs=(0, 1), groups=4), Step("sigmoid"),
                           Step("sub", consts=(1,), operand=EARLIER, reverse=True)),
            dtype, p * 2, 128, 1, "linear_groupnorm",
        ),
        # Library GEMMs on padded operands: y's rows are pad[1] apart, not N (kYRow).
        "padded_gemm_pointwise": EpilogueSpec(
            Anchor("addmm", pad=(152, 520)), (Step("gelu"), Step("add", inputs=(0,), operand=FULL)),
            dtype, p, 513, 1, "linear_pointwise",
        ),
        "padded_gemm_softmax": EpilogueSpec(
            Anchor("mm", pad=(208, 4104)), (Step("softmax"), Step("relu")), dtype, (), 4100, 1, "linear_softmax",
        ),
        "padded_gemm_groupnorm": EpilogueSpec(
            Anchor("addmm", pad=(152, 520)), (Step("groupnorm", consts=(1e-5,), inputs=(0, 1), groups=4),),
            dtype, p * 2, 516, 1, "linear_groupnorm",
        ),
        # Library convs on channels-last operands: blocks stage whole images (kStaged).
        "channels_last_pointwise": EpilogueSpec(  # C=16, 9 x 18: images packed into a block
            CHANNELS_LAST, (Step("add", inputs=(0,), operand=CHANNEL), Step("batchnorm_eval", consts=(1e-5,),
                                                                          inputs=(1, 2, 3, 4)),
                            Step("add", inputs=(5,), operand=FULL), Step("elu", consts=(1.0, 1.0, 1.0))),
            dtype, p * 6, 16, 9 * 18, "conv_batchnorm_eval",
        ),
        "channels_last_per_channel": EpilogueSpec(  # operands per channel: staging applies the chain
            CHANNELS_LAST, (Step("add", inputs=(0,), operand=CHANNEL), Step("batchnorm_eval", consts=(1e-5,),
                                                                          inputs=(1, 2, 3, 4)),
                            Step("div", consts=(3.0,), operand=SCALAR), Step("elu", consts=(1.0, 1.0, 1.0))),
            dtype, p * 5, 16, 9 * 18, "conv_batchnorm_eval",
        ),
        "channels_last_groupnorm": EpilogueSpec(  # 2 channels of 80: 2 groups, narrow teams
            CHANNELS_LAST, (Step("groupnorm", consts=(1e-5,), inputs=(0, 1), groups=2), Step("mul", inputs=(2,), operand=CHANNEL)),
            dtype, p * 3, 2, 80, "conv_groupnorm",
        ),
        "channels_last_odd_image": EpilogueSpec(  # C=5, 23 x 23: a block an image, scalar staging
            CHANNELS_LAST, (Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=1), Step("gelu")),
            dtype, (), 5, 23 * 23, "conv_groupnorm",
        ),
        "padded_gemm_batchnorm_train": EpilogueSpec(
            Anchor("addmm", pad=(152, 520)),
            (Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(0, 1, 2, 3)), Step("silu")),
            dtype, p * 4, 513, 1, "linear_batchnorm_train",
        ),
        "narrow_batchnorm_train": EpilogueSpec(  # 7 columns: 4 rows a warp for the statistics
            LINEAR, (Step("maximum", inputs=(0,), operand=ONE),
                     Step("batchnorm_train", consts=(0.1, 1e-3), inputs=(1, 2, 3, 4)), Step("hardsigmoid")),
            dtype, p * 5, 7, 1, "linear_batchnorm_train",
        ),
    }


def conv_batchnorm_specs(dtype="float32"):
    """BatchNorm (training) after a conv, per-channel statistics over (rows, inner):
    planes short enough for a few lanes, one block, or several blocks a plane."""
    p = (dtype,)
    bn = Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(0, 1, 2, 3))
    return {
        f"conv_batchnorm_train_{inner}": EpilogueSpec(
            CONV, (Step("hardswish"), bn, Step("relu")), dtype, p * 4, channels, inner, "conv_batchnorm_train",
        )
        for channels, inner in ((16, 24), (6, 1000), (32, 254 * 254))
    }


def vocabulary_specs(dtype="float32"):
    """Every pointwise step in one chain, and each row norm and row reduction once."""
    p = (dtype,)
    pointwise = (
        Step("mish"), Step("hardswish"), Step("hardsigmoid"), Step("clamp", consts=(-0.5, float("inf"))),
        Step("elu", consts=(1.6732632423543772, 1.0507009873554805, 1.0)), Step("softplus", consts=(2.0, 20.0)),
        Step("abs"), Step("exp"), Step("log"), Step("neg"), Step("maximum", inputs=(0,), operand=ONE),
        Step("minimum", inputs=(1,), operand=CHANNEL), Step("prelu", inputs=(1,), operand=CHANNEL), Step("erf"), Step("sin"), Step("cos"), Step("sigmoid"),
        Step("sqrt"), Step("rsqrt"), Step("reciprocal"), Step("log1p"), Step("tanh"), Step("expm1"),
        *(Step("pow", consts=(c,)) for c in (2.0, -0.5, 3.0, 0.5, -2.0, -1.0, 1.5, 1.0)),  # all positive here
    )
    specs = {
        "pointwise_vocabulary": EpilogueSpec(LINEAR, pointwise, dtype, p * 2, 264, 1, "linear_pointwise"),
        # GELU spelled out: y * 0.5 held, back to y, its erf factor, the product
        "branch_gelu_spelled": EpilogueSpec(LINEAR, (
            Step("mul", consts=(0.5,), operand=SCALAR), Step("branch", consts=(0,), operand=EARLIER),
            Step("div", consts=(math.sqrt(2.0),), operand=SCALAR), Step("erf"), Step("add", consts=(1.0,), operand=SCALAR),
            Step("mul", consts=(1,), operand=EARLIER, reverse=True)), dtype, (), 264, 1, "linear_pointwise"),
        "pow_zero": EpilogueSpec(LINEAR, (Step("pow", consts=(0.0,)), Step("add", consts=(0.5,), operand=SCALAR)),
                                 dtype, (), 264, 1, "linear_pointwise"),
        "l2normalize_scaled": EpilogueSpec(  # CLIP's F.normalize(y, dim=-1) * logit scale
            LINEAR, (Step("l2normalize", consts=(1e-12,)), Step("mul", consts=(14.3,), operand=SCALAR)),
            dtype, (), 512, 1, "linear_l2normalize",
        ),
        "rmsnorm_weight": EpilogueSpec(
            LINEAR, (Step("rmsnorm", consts=(1e-6,)), Step("mul", inputs=(0,), operand=CHANNEL), Step("silu")),
            dtype, p, 4096, 1, "linear_rmsnorm",
        ),
    }
    for name in ("softmax", "log_softmax"):
        specs[f"{name}_row"] = EpilogueSpec(
            LINEAR, (Step("gelu"), Step(name), Step("mul", consts=(3.0,), operand=SCALAR)), dtype, (), 1000, 1,
            f"linear_{name}",
        )
    for name in ("sum", "mean", "amax", "amin"):
        specs[f"{name}_row"] = EpilogueSpec(
            LINEAR, (Step("relu"), Step(name, keepdim=True), Step("sigmoid")), dtype, (), 2056, 1, f"linear_{name}",
        )
    # Spatial reductions of a conv output (global pooling), then per-channel, full
    # ([rows, C]) and scalar operands: planes of 7 x 7 (a warp team a plane), 30 x 30
    # and 128 x 128 (a block a plane).
    for name, inner in (("sum", 49), ("mean", 900), ("amax", 128 * 128), ("amin", 49)):
        specs[f"spatial_{name}_{inner}"] = EpilogueSpec(
            CONV, (Step("add", inputs=(0,), operand=CHANNEL, reverse=True), Step("gelu"),
                   Step(f"spatial_{name}", keepdim=name in ("mean", "amin")), Step("mul", inputs=(1,), operand=CHANNEL),
                   Step("add", inputs=(2,), operand=FULL), Step("relu")),
            dtype, p * 3, 24, inner, f"conv_spatial_{name}",
        )
    # Over a conv output's channels, per pixel: channels held in registers (12), or read
    # again each pass (96); vectors of pixels (planes of 900) or single pixels (49).
    for name, channels, inner in (("softmax", 12, 900), ("log_softmax", 96, 49), ("logsumexp", 96, 900),
                                  ("sum", 12, 49), ("mean", 12, 900), ("amax", 96, 900), ("amin", 12, 900)):
        keepdim = name in ("logsumexp", "amax")
        after = ((Step("mul", inputs=(1,), operand=CHANNEL),) if name.endswith("softmax")
                 else (Step("add", inputs=(1,), operand=FULL),)) + (Step("tanh"),)
        specs[f"channel_{name}_{channels}x{inner}"] = EpilogueSpec(
            CONV, (Step("add", inputs=(0,), operand=CHANNEL, reverse=True), Step("silu"),
                   Step(f"channel_{name}", keepdim=keepdim)) + after,
            dtype, p * 2, channels, inner, f"conv_channel_{name}",
        )
    # The same on a channels-last y (the conv_layout form): a pixel a thread, its channels
    # held (32) or read again (96), a full operand after the reduction.
    for name, channels, inner in (("softmax", 32, 900), ("logsumexp", 96, 49), ("amin", 12, 900)):
        after = (Step("mul", inputs=(0,), operand=CHANNEL),) if name == "softmax" else \
            (Step("add", inputs=(0,), operand=FULL),)
        specs[f"channels_last_{name}_{channels}x{inner}"] = EpilogueSpec(
            CHANNELS_LAST, (Step("silu"), Step(f"channel_{name}", keepdim=True)) + after + (Step("relu"),),
            dtype, p, channels, inner, f"conv_channel_{name}",
        )
    # LayerNorm over a conv output's trailing dims: segments of a row (30, a warp team),
    # of a plane (30 x 30) and of the whole image (12 x 30 x 30, a block; 16 x 64 x 64,
    # chunks), a weight and bias of the segment's shape, per-channel operands around it.
    for normalized, channels, inner in (((30,), 12, 900), ((30, 30), 12, 900), ((12, 30, 30), 12, 900),
                                        ((16, 64, 64), 16, 4096)):
        segments = channels * inner // math.prod(normalized)
        specs[f"conv_layernorm_{'x'.join(map(str, normalized))}"] = EpilogueSpec(
            CONV, (Step("add", inputs=(0,), operand=CHANNEL, reverse=True),
                   Step("layernorm", consts=(1e-5,), inputs=(1, 2), groups=segments, normalized=normalized),
                   Step("mul", inputs=(3,), operand=CHANNEL), Step("gelu")),
            dtype, p * 4, channels, inner, "conv_layernorm",
        )
    # Softmax over the plane of a bmm's product (attention scores, a team a (row, channel)
    # plane: 37, a warp team; 1000 and 4100, a block), then per-channel and scalar
    # operands; an InstanceNorm (a group a channel) of a bmm's product.
    for name, channels, inner in (("softmax", 48, 1000), ("log_softmax", 8, 37), ("softmax", 8, 4100)):
        specs[f"bmm_spatial_{name}_{channels}x{inner}"] = EpilogueSpec(
            BMM, (Step("mul", consts=(0.125,), operand=SCALAR), Step(f"spatial_{name}"),
                  Step("mul", inputs=(0,), operand=CHANNEL)),
            dtype, p, channels, inner, f"bmm_spatial_{name}",
        )
    specs["bmm_instance_norm_24x37"] = EpilogueSpec(
        BMM, (Step("groupnorm", consts=(1e-5,), inputs=(-1, -1), groups=24), Step("relu")), dtype, (), 24, 37,
        "bmm_groupnorm",
    )
    # Pooling windows over a conv output's spatial dims, then per-channel and full (pooled
    # shape) operands: 2x2 max pool of 30 x 30; 3x3 avg pool, stride 2, padding 1, ceil_mode,
    # padding not counted, of 31 x 31; a 3-D avg pool with divisor_override; a dilated 1-D
    # max pool; a 2x2 max pool of a channels-last y.
    pools = (("maxpool", CONV, (30, 30), (2, 2), (2, 2), (0, 0), (1, 1), (0,)),
             ("avgpool", CONV, (31, 31), (3, 3), (2, 2), (1, 1), (1, 1), (1, 0, 0)),
             ("avgpool", CONV, (6, 10, 9), (2, 3, 2), (2, 3, 2), (0, 1, 0), (1, 1, 1), (0, 1, 5)),
             ("maxpool", CONV, (99,), (3,), (2,), (1,), (2,), (0,)),
             ("maxpool", CHANNELS_LAST, (30, 30), (2, 2), (2, 2), (0, 0), (1, 1), (0,)))
    pools += (("avgpool", LINEAR, (4096,), (4,), (4,), (0,), (1,), (0, 1, 0)),  # over a Linear output's features
              ("maxpool", Anchor("addmm", pad=(152, 520)), (513,), (3,), (2,), (1,), (1,), (1,)))  # rows of 520 in y
    for name, anchor, sizes, kernel, stride, padding, dilation, consts in pools:
        ceil = bool(consts[0])
        pooled = tuple(pool_out_size(*d, ceil) for d in zip(sizes, kernel, stride, padding, dilation))
        window = (sizes, pooled, kernel, stride, padding, dilation)
        layout = "channels_last_" if anchor.channels_last else ""
        if anchor.kind == "conv":
            specs[f"{layout}{name}_{'x'.join(map(str, sizes))}"] = EpilogueSpec(
                anchor, (Step("add", inputs=(0,), operand=CHANNEL, reverse=True), Step("relu"),
                         Step(name, consts=consts, window=window), Step("mul", inputs=(1,), operand=CHANNEL),
                         Step("add", inputs=(2,), operand=FULL), Step("sigmoid")),
                dtype, p * 3, 12, math.prod(sizes), f"conv_{name}",
            )
        else:  # no per-feature operand after the pool: the features are pooled
            specs[f"linear_{name}_{sizes[0]}{'_padded' if anchor.pad else ''}"] = EpilogueSpec(
                anchor, (Step("add", inputs=(0,), operand=CHANNEL), Step("gelu"), Step(name, consts=consts, window=window),
                         Step("add", inputs=(1,), operand=FULL), Step("mul", inputs=(2,), operand=ONE)),
                dtype, p * 3, sizes[0], 1, f"linear_{name}",
            )
    return specs


def training_specs(dtype="float32"):
    """The workloads as a training graph has them: they also return what backward needs
    (the anchor output, values after some steps, normalization statistics). Saves after
    a folded bias do not come from the matcher (it keeps the bias of an anchor output
    used elsewhere) but cover stores from stage0."""
    from dataclasses import replace

    from lowering.spec import Save

    w = workload_specs(dtype)
    stat = "float32"

    def value(at, channels, per_row=None):
        per_row = channels if per_row is None else per_row
        return Save("value", dtype, (-1, channels if per_row == channels else 1), per_row, at)

    def stats(kind, per_row, shape, sdtype=dtype):
        return Save(kind, sdtype, shape, per_row)

    return {
        "train_w1_bn": replace(w["w1_bn_train"], saves=(
            value(0, 4096), value(2, 4096), stats("mean", 0, (4096,), stat), stats("rstd", 0, (4096,), stat))),
        "train_w2_logsumexp": replace(w["w2_logsumexp"], saves=(value(1, 8192), value(2, 8192, per_row=1))),
        "train_w3_groupnorm": replace(w["w3_groupnorm"], saves=(
            value(1, 8192), stats("mean", 512, (-1, 512)), stats("rstd", 512, (-1, 512)))),
        "train_w4_groupnorm_silu": replace(w["w4_groupnorm_silu"], saves=(
            value(2, 8192), stats("mean", 256, (-1, 256)), stats("rstd", 256, (-1, 256)),
            Save("sigmoid", dtype, (-1, 8192), 8192, 2), Save("sigmoid", dtype, (-1, 8192), 8192, 4))),
        "train_w5_conv_groupnorm": replace(w["w5_conv_groupnorm"], saves=(
            Save("value", dtype, (-1, 32, 254, 254), 32 * 254 * 254, 1),
            stats("mean", 8, (-1, 8)), stats("rstd", 8, (-1, 8)))),
        "train_rmsnorm_widened": replace(vocabulary_specs(dtype)["rmsnorm_weight"], saves=(
            Save("value", stat, (-1, 4096), 4096, 0), Save("rstd", stat, (-1, 1), 1),
            Save("value", stat, (-1, 4096), 4096, 1), Save("sigmoid", dtype, (-1, 4096), 4096, 2))),
        "train_layernorm_residual": replace(awkward_specs(dtype)["layernorm_residual"], saves=(
            value(2, 513), value(4, 513, per_row=513), stats("mean", 1, (-1, 1), stat), stats("rstd", 1, (-1, 1), stat))),
    }


def second_reduction_specs(dtype="float32"):
    """A reduction after the chain's norm (`EpilogueSpec.second_reduction`): global pooling
    after a conv's GroupNorm (channels per group apart, one block or several a group),
    InstanceNorm (planes split over several blocks) and BatchNorm (the ReLU's value also
    returned, as a squeeze-and-excitation block uses it), on a channels-last y, after a
    bmm's InstanceNorm, and a row reduction after a Linear's LayerNorm and BatchNorm1d."""
    from lowering.spec import Save

    p = (dtype,)
    gn = lambda groups, inputs=(-1, -1): Step("groupnorm", consts=(1e-5,), inputs=inputs, groups=groups)
    bn = Step("batchnorm_train", consts=(0.1, 1e-5), inputs=(0, 1, 2, 3))
    return {
        "second_conv_groupnorm_mean": EpilogueSpec(
            CONV, (_bias(0), gn(8, (1, 2)), Step("gelu"), Step("spatial_mean"), Step("add", inputs=(3,), operand=CHANNEL),
                   Step("relu")),
            dtype, p * 4, 32, 20 * 24, "conv_groupnorm",
        ),
        "second_conv_groupnorm_amin_chunks": EpilogueSpec(
            CONV, (gn(16), Step("silu"), Step("spatial_amin", keepdim=True)), dtype, (), 64, 100 * 100, "conv_groupnorm",
        ),
        "second_conv_instancenorm_sum_chunks": EpilogueSpec(
            CONV, (gn(8), Step("leaky_relu", consts=(0.2,)), Step("spatial_sum"), Step("mul", consts=(0.5,), operand=SCALAR)),
            dtype, (), 8, 201 * 203, "conv_groupnorm",
        ),
        "second_conv_batchnorm_amax_saves": EpilogueSpec(
            CONV, (bn, Step("relu"), Step("spatial_amax")), dtype, p * 4, 16, 30 * 30, "conv_batchnorm_train",
            saves=(Save("value", dtype, (-1, 16, 30, 30), 16 * 900, 2),),
        ),
        "second_channels_last_groupnorm_mean": EpilogueSpec(
            CHANNELS_LAST, (gn(4), Step("relu"), Step("spatial_mean")), dtype, (), 16, 14 * 14, "conv_groupnorm",
        ),
        "second_bmm_instancenorm_mean": EpilogueSpec(
            BMM, (gn(24), Step("tanh"), Step("spatial_mean", keepdim=True)), dtype, (), 24, 100, "bmm_groupnorm",
        ),
        "second_linear_layernorm_sum": EpilogueSpec(
            LINEAR, (_bias(0), Step("layernorm", consts=(1e-5,), inputs=(1, 2)), Step("relu"), Step("sum", keepdim=True),
                     Step("sigmoid")),
            dtype, p * 3, 1000, 1, "linear_layernorm",
        ),
        "second_linear_batchnorm_mean": EpilogueSpec(
            LINEAR, (bn, Step("gelu"), Step("mean")), dtype, p * 4, 96, 1, "linear_batchnorm_train",
        ),
    }


def pixel_group_specs(dtype="float32"):
    """GroupNorm on a channels-last y whose images do not fit the staged kernel: a vector
    a pixel's channels of a group (`render.pixel_group_plan`): one vector a pixel (4 or 8
    channels a group), four (16), warp teams (short segments of a wide image), and a
    reduction after the norm; bundles of whole groups where a group is narrower than a
    vector (InstanceNorm; 2 channels a group), a reduction after them."""
    p = (dtype,)
    gn = lambda groups, inputs=(-1, -1): Step("groupnorm", consts=(1e-5,), inputs=inputs, groups=groups)
    return {
        "pixel_groups_gn_silu": EpilogueSpec(
            CHANNELS_LAST, (_bias(0), gn(16, (1, 2)), Step("silu")), dtype, p * 3, 64, 64 * 64, "conv_groupnorm"),
        "pixel_groups_sixteen_channels_mean": EpilogueSpec(
            CHANNELS_LAST, (_bias(0), gn(4), Step("relu"), Step("spatial_mean")), dtype, p, 64, 37 * 41, "conv_groupnorm"),
        "pixel_groups_warp_teams": EpilogueSpec(
            CHANNELS_LAST, (gn(64), Step("mul", inputs=(0,), operand=CHANNEL)), dtype, p, 512, 30, "conv_groupnorm"),
        "pixel_groups_instancenorm_bundles": EpilogueSpec(
            CHANNELS_LAST, (gn(32, (0, 1)), Step("leaky_relu", consts=(0.2,))), dtype, p * 2, 32, 48 * 48,
            "conv_groupnorm"),
        "pixel_groups_two_channels_max": EpilogueSpec(
            CHANNELS_LAST, (gn(32), Step("tanh"), Step("spatial_amax")), dtype, (), 64, 45 * 47, "conv_groupnorm"),
    }


def tiled_specs(dtype="float32"):
    """Pointwise and BatchNorm (training) chains on a channels-last y whose images do not
    fit the staged kernel (`render.tiled_plan`): tiles of pixels x channels, the chain
    run in the output's order. A residual and a per-image operand (read by element
    there), channels that do not fill a tile (48: 32 + 16) or a load (6), planes that a
    vector of four pixels does not divide (57 x 57), BatchNorm after per-channel steps."""
    p = (dtype,)
    bn = lambda first: Step("batchnorm_train", consts=(0.1, 1e-5), inputs=tuple(range(first, first + 4)))
    per_image = _broadcast("mul", 2, (128 * 128 * 64, 0, 64), (128 * 128, 64, 1))  # [N, C, 1, 1]
    return {
        "tiled_relu_bias": EpilogueSpec(
            CHANNELS_LAST, (_bias(0), Step("relu"), Step("add", inputs=(1,), operand=CHANNEL)), dtype, p * 2, 128,
            128 * 128, "conv_pointwise"),
        "tiled_residual_relu": EpilogueSpec(
            CHANNELS_LAST, (_bias(0), Step("add", inputs=(1,), operand=FULL), Step("relu"), per_image), dtype, p * 3,
            64, 128 * 128, "conv_pointwise"),
        "tiled_odd_planes_forty_eight": EpilogueSpec(
            CHANNELS_LAST, (Step("gelu"), Step("mul", consts=(0.5,), operand=SCALAR)), dtype, (), 48, 57 * 57,
            "conv_pointwise"),
        "tiled_batchnorm_relu": EpilogueSpec(
            CHANNELS_LAST, (_bias(0), bn(1), Step("relu")), dtype, p * 5, 64, 96 * 96, "conv_batchnorm_train"),
        "tiled_six_channels_batchnorm": EpilogueSpec(
            CHANNELS_LAST, (Step("hardswish"), bn(0), Step("add", inputs=(4,), operand=FULL)), dtype, p * 5, 6,
            131 * 67, "conv_batchnorm_train"),
    }
