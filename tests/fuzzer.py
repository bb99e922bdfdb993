"""Differential fuzzer: random anchor + epilogue models, fusedepi against eager.

Model `index` of seed `seed` is a pure function of the two (`make_case`), so any
finding reruns alone (`--only INDEX`) and becomes a named regression test. Each
model is checked three ways: fusedepi's output against a float64 copy of the model
(the error budget), eager's output against the same copy (what "as accurate as
eager" means for an ill-conditioned chain), and whether the chain was fused.

An error over the budget and over 4x eager's is a mismatch only if it is ours: if
plain Inductor is as far off, or (where eager's own error is a good share of the
budget) the excess does not come back on two other random draws of the inputs, the
model is "ill_conditioned". A model eager refuses to run must fail alike ("rejected").

    python tests/fuzzer.py --device cpu --models 300            # the rewrite, via references
    python tests/fuzzer.py --device cuda --models 2000 --workers 12 --json fuzz.json
    python tests/fuzzer.py --bench 50                           # speed against Inductor (CUDA)
    python tests/fuzzer.py --device cuda --in-kernel-gemm --models 400 --workers 12
    python tests/fuzzer.py --device cuda --in-kernel-conv --models 400 --workers 12

`--in-kernel-gemm` draws Linear anchors of the in-kernel GEMM's shapes (N a multiple of
256, K of 8; bf16, fp16, and on CUDA a third of them float32 under matmul precision
"high", where the kernel computes in TF32) and runs them with FUSEDEPI_IN_KERNEL_GEMM=1, so that its
kernel (sm_90) meets random chains; the default setting takes it only at row counts
too large for the fuzzer. `--in-kernel-conv` likewise draws 2-D convs of the in-kernel
conv's shapes (stride 1, from generation 16 strides of 1-3 and dilations of 1-2, from
generation 19 a third of them a Conv1d or a ConvTranspose2d of stride 1, from generation 20
a quarter of the 2-D convs left a Conv3d; input
channels in 8s, 40-256 output channels in 8s; float32
ones with `cudnn.allow_tf32`, for eager and fusedepi alike) and runs them with
FUSEDEPI_IN_KERNEL_CONV=1 (sm_90; its default, auto, takes it only where the measured
choice times the chain, which the fuzzer does not).

On CPU the fused op runs its plain-torch reference (FUSEDEPI_CPU_REFERENCE=1): this
checks matching and rewriting. On CUDA it runs the rendered kernels.

Forward passes run under `torch.no_grad()`; with `--grad` each model also runs
backward (inputs and parameters require gradients, the upstream gradient is random),
and its input and parameter gradients are checked like the output: then the fused
chains return what backward needs as well.

With `--dynamic-batch` the compiled model first runs once at one more image or row
(the inputs' first row again, appended), then runs the checked call at the Case's
own batch: Dynamo then compiles a graph whose batch size is symbolic (automatic
dynamic shapes, as when a user's last batch is smaller), and that graph's fusion and
results are what is checked. The first call's BatchNorm running-stat updates and
gradients are undone before the checked one.

One file (about 1,570 lines): the generator, the three-way check and the driver are run
as a script on the device machine as well as imported by tests/test_fuzz.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import math
import os
import random
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Relative error budget against float64, as in the GPU tests.
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 1e-2}
TF32_TOLERANCE = 5e-3  # float32 models whose matmuls may run in TF32 (eager's too)
# A result within the budget, or no worse than this many times eager's own error, passes.
EAGER_SLACK = 4.0
# Eager's own error above this share of the budget: the model amplifies rounding
# (`run_case` then asks an excess over eager to come back on other inputs).
AMPLIFYING = 0.25


@dataclass
class Case:
    """One random model, as plain data.

    Attributes:
        index, seed: where it comes from (`make_case(seed, index)`).
        anchor: {"kind": "linear" | "conv" | "conv_transpose" | "bmm", ...sizes}.
        steps: the chain after the anchor, each {"op": name, ...arguments}.
        dtype: "float32", "bfloat16" or "float16".
        training: the model's mode (BatchNorm uses batch statistics when True).
        in_vocabulary: every step is one the vocabulary claims to fuse.
        generation: the generator's vocabulary (`CONV_NORMS`); models of generation 1
            stay what they were when results and regression tests recorded them.
        gemm: drawn for the in-kernel GEMM (`make_case`), and run with
            FUSEDEPI_IN_KERNEL_GEMM=1.
        tf32: a float32 model run under matmul precision "high" (TF32 allowed, for
            eager and fusedepi alike); only with `gemm`.
        implicit: drawn for the in-kernel conv (`make_case`), and run with
            FUSEDEPI_IN_KERNEL_CONV=1 (a float32 one with `cudnn.allow_tf32`).
    """

    index: int
    seed: int
    anchor: dict
    steps: list
    dtype: str
    training: bool
    in_vocabulary: bool = True
    generation: int = 1
    gemm: bool = False
    tf32: bool = False
    implicit: bool = False


# ------------------------------------------------------------------ generation

POINTWISE = [
    "relu", "gelu", "gelu_tanh", "leaky_relu", "silu", "silu_spelled", "sigmoid", "tanh", "mish", "hardswish",
    "hardsigmoid", "hardtanh", "relu6", "clamp", "clamp_min", "clamp_max", "elu", "selu", "celu", "softplus", "abs",
    "neg", "exp", "log",
]
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
# Steps with statistics over several elements: at most one per chain.
NORMS_LINEAR = ["groupnorm", "layernorm", "rmsnorm", "batchnorm", "softmax", "log_softmax"]
NORMS_CONV = ["groupnorm", "batchnorm"]
# Norms after a conv, by generator generation: a later generation draws more kinds
# without changing what an earlier one draws (generation 2 adds InstanceNorm).
CONV_NORMS = {1: NORMS_CONV, 2: NORMS_CONV + ["instancenorm"], 3: NORMS_CONV + ["instancenorm"],
              4: NORMS_CONV + ["instancenorm"], 5: NORMS_CONV + ["instancenorm", "chan_softmax", "chan_log_softmax"],
              6: NORMS_CONV + ["instancenorm", "chan_softmax", "chan_log_softmax"],
              7: NORMS_CONV + ["instancenorm", "chan_softmax", "chan_log_softmax", "conv_layernorm"],
              8: NORMS_CONV + ["instancenorm", "chan_softmax", "chan_log_softmax", "conv_layernorm", "plane_softmax",
                               "plane_log_softmax"]}
CONV_NORMS[9] = CONV_NORMS[8]
CONV_NORMS[10] = CONV_NORMS[9]
CONV_NORMS[11] = CONV_NORMS[10]
CONV_NORMS[12] = CONV_NORMS[11]
CONV_NORMS[13] = CONV_NORMS[12]
CONV_NORMS[14] = CONV_NORMS[13]
CONV_NORMS[15] = CONV_NORMS[14]
CONV_NORMS[16] = CONV_NORMS[15]
CONV_NORMS[17] = CONV_NORMS[16]
CONV_NORMS[18] = CONV_NORMS[17]
CONV_NORMS[19] = CONV_NORMS[18]
CONV_NORMS[20] = CONV_NORMS[19]
CONV_NORMS[21] = CONV_NORMS[20]
CONV_NORMS[22] = CONV_NORMS[21]
# From this generation on, the in-kernel conv's anchors (`--in-kernel-conv`) have strides
# of 1 to 3 and dilations of 1 or 2 (`_implicit_anchor`), drawn from a stream of their own.
STRIDED_GENERATION = 16
# From this generation on, half the in-kernel conv's anchors have few channels, 8 to 32
# in and 32 to 64 out, drawn from a stream of their own: the tiles of 256 pixels
# (`conv_sm90.TALL_BLOCK_M`: at most 64 channels over k-steps of at most 64 bytes).
NARROW_GENERATION = 17
# From this generation on, half the pooling windows after the in-kernel conv's 2-D anchors
# are the ones its tiles pool (`conv_sm90.POOLS_IN_TILE`): a stride of the window's size,
# 2 or 4 pixels a side, unpadded, undilated, floor mode, decided by a stream of their own
# (the window is drawn as before, then replaced: the models' other steps stay generation
# 17's).
TILE_POOL_GENERATION = 18
# From this generation on, a third of the in-kernel conv's anchors, decided by a stream of
# their own, are convs it takes as the 2-D conv they equal: a Conv1d over the anchor's
# width (`Anchor.as_2d`), or a ConvTranspose2d of stride 1 (`Anchor.flipped`; dilation 1,
# padding at most the kernel's reach); the other anchors are generation 18's.
AS_CONV2D_GENERATION = 19
# From this generation on, a quarter of the in-kernel conv's anchors that are still 2-D
# convs, decided by a stream of their own, are Conv3d (`Anchor.depth`: the output's depth
# planes), 1 to 8 planes deep and smaller planes; the other anchors are generation 19's.
CONV3D_GENERATION = 20
# From this generation on, a fifth of the in-kernel conv's anchors, decided by a stream of
# their own, have 1 to 7 input channels, or 8 to 40 not in 8s (an RGB image's 3; x's
# pixels padded to 16 bytes, `conv_sm90.PAD_PIXELS`); the other anchors are generation 20's.
ODD_CHANNELS_GENERATION = 21
# From this generation on, a broadcast operand of an N-d Linear's value [B, T, N] or of a
# bmm's viewed [B / h, h, M, N] may be per sample: its leading dim at the value's size
# where the next is 1 ([B, 1, N], [B, 1, 1]; [B / h, 1, M, N]), an element of it for a
# group of T (h) anchor rows (`spec.broadcast_sizes`). The draws are generation 21's;
# there such a mask's leading dim was set to 1.
SAMPLE_BROADCAST_GENERATION = 22
# From this generation on, the pointwise steps include erf, sin, cos, sqrt, rsqrt,
# reciprocal, log1p, expm1 and powers by a constant (`POWERS`; square as pow 2); sqrt,
# rsqrt, reciprocal, log1p and the fractional and negative powers only where the value is
# positive, expm1 only where it is bounded. The ops drawn as outside the vocabulary are
# then atan and dropout (an earlier generation's cos and x ** 3 are in the vocabulary
# now, and stay drawn there, as that generation drew them).
MATH_GENERATION = 12
MATH_POINTWISE = ["erf", "sin", "cos", "sqrt", "rsqrt", "reciprocal", "square", "pow", "log1p", "expm1"]
POWERS = [2, 3, -2, 0.5, -0.5, -1, 1.5, 4]
# From this generation on, a binary step's operand may be a `branch`: one or two of
# `BRANCH_FUNCTIONS` applied to an earlier value of the chain (`f(y) * g(y)`, the value
# `back` steps before the current one), and the pointwise steps include GELU spelled out
# with erf (BERT's `x * 0.5 * (1 + erf(x / sqrt(2)))`) and with tanh and a cube
# (GPT-2's `gelu_new`).
BRANCH_GENERATION = 13
BRANCH_FUNCTIONS = ["tanh", "sigmoid", "sin", "erf", "relu", "scale", "shift"]
SPELLED_GELUS = ["gelu_erf_spelled", "gelu_new_spelled"]
# From this generation on, the pointwise steps include PReLU (`F.prelu`: one slope, or one
# a channel where the value's dim 1 is still the anchor's channels), and a Linear's norms
# F.normalize over its features (`l2normalize`).
PRELU_GENERATION = 14
# From this generation on, a Linear's softmax, log_softmax and LayerNorm are written out in
# half the draws (`SPELLED_NORMS`: the form, "" for the module or function itself).
SPELLED_GENERATION = 15
SPELLED_NORMS = {"softmax": ["", "amax", "max_values"], "log_softmax": ["", "logsumexp"],
                 "layernorm": ["", "centred_twice", "var_rsqrt"]}
# Generation 7 adds LayerNorm over a conv output's trailing dims (`conv_layernorm`: the
# last `dims` of them, the channels included or not), and 1-D pooling windows over a
# 2-D Linear output's features among its row reductions (`FEATURE_POOLS`).
FEATURE_POOLS = ["feature_maxpool", "feature_avgpool"]
# From this generation on, a quarter of the anchors are batched matmuls (`torch.bmm`, or
# `x @ w` with a batched w) whose [B, M, N] product reads as a Conv1d's output, and the
# norms after a conv or bmm include softmax over each channel's plane (`PLANE_NORMS`:
# its spatial dims flattened, softmax over them, the shape restored); a global pool or a
# reduction over the channels with keepdim may squeeze its unit dims away after it.
BMM_GENERATION = 8
PLANE_NORMS = ["plane_softmax", "plane_log_softmax"]
# From this generation on, a binary step's operand may be an earlier value of the chain
# (`earlier`: the value `back` steps before the current one, of the same shape).
EARLIER_GENERATION = 3
# From this generation on, a binary step's operand may broadcast over some of the chain's
# dims (`broadcast`: `mask` marks the dims, of the last ones, where it has the value's
# size; `squeeze` drops its leading unit dims): per (image, channel), per position, per
# pixel, per row, per image.
BROADCAST_GENERATION = 9
# From this generation on, a reduction may follow a GroupNorm, InstanceNorm, BatchNorm or
# LayerNorm (with steps between): global pooling after a conv's, a sum, mean, amax or amin
# over a Linear's features after its.
SECOND_REDUCTION_GENERATION = 10
# From this generation on, a third of the bmm anchors are `torch.baddbmm(input, x, w,
# alpha=...)` (`baddbmm`: the input's shape, full, per position, per channel, per
# column or one value, and alpha), drawn from a stream of their own.
BADDBMM_GENERATION = 11
BADDBMM_INPUTS = ["full", "position", "channel", "column", "one"]
NORMS_BEFORE_A_REDUCTION = ("groupnorm", "instancenorm", "batchnorm", "layernorm", "conv_layernorm")
ROW_REDUCTIONS = ["logsumexp", "sum", "mean", "amax", "amin", "max_values"]
# From this generation on, a conv's chain may pool: a reduction over all its spatial dims.
POOL_GENERATION = 4
POOLS = ["pool_sum", "pool_mean", "pool_amax", "pool_amin"]
# From this generation on, also reductions over a conv's channels (dim 1): softmax and
# log_softmax among the norms, these among the pools.
CHANNEL_GENERATION = 5
CHANNEL_REDUCTIONS = ["chan_logsumexp", "chan_sum", "chan_mean", "chan_amax", "chan_amin", "chan_max_values"]
# From this generation on, also pooling windows (MaxPool / AvgPool 1d-3d) among the pools:
# kernel, stride, padding, dilation, ceil_mode, count_include_pad, divisor_override drawn.
WINDOW_GENERATION = 6
WINDOWS = ["maxpool", "avgpool"]
# Not in the vocabulary: the chain must stop there, and the model still match eager.
OUTSIDE = ["cos", "pow3", "dropout_train"]
OUTSIDE_MATH = ["atan", "dropout_train"]  # from MATH_GENERATION on: the ops outside the vocabulary now
# Values after these are in (0, 1] or (0, inf): the POSITIVE_ONLY steps only follow them.
POSITIVE = {"sigmoid", "exp", "softplus", "softmax"}
POSITIVE_ONLY = {"log", "sqrt", "rsqrt", "reciprocal", "log1p"}
# Values after these are bounded: the BOUNDED_ONLY steps only follow them (so they cannot overflow).
BOUNDED = {"sigmoid", "tanh", "hardsigmoid", "hardtanh", "relu6", "clamp", "softmax", "log_softmax_bounded"}
BOUNDED_ONLY = {"exp", "expm1"}

# The vocabulary steps each draw above becomes, where its name differs (a spelling of a
# step, or a module that reads as one); every other draw is its step's own name.
# tests/test_vocabulary.py checks that the draws cover the whole vocabulary.
STEPS_OF_DRAW = {
    "silu_spelled": ("silu",), "hardtanh": ("clamp",), "relu6": ("clamp",), "clamp_min": ("clamp",),
    "clamp_max": ("clamp",), "selu": ("elu",), "celu": ("elu",), "batchnorm": ("batchnorm_train", "batchnorm_eval"),
    "instancenorm": ("groupnorm",), "max_values": ("amax",), "conv_layernorm": ("layernorm",),
    "feature_maxpool": ("maxpool",), "feature_avgpool": ("avgpool",),
    "plane_softmax": ("spatial_softmax",), "plane_log_softmax": ("spatial_log_softmax",),
    **{pool: (f"spatial_{pool.removeprefix('pool_')}",) for pool in POOLS},
    **{op: (f"channel_{op.removeprefix('chan_')}",) for op in CHANNEL_REDUCTIONS + ["chan_softmax", "chan_log_softmax"]},
    "chan_max_values": ("channel_amax",),
    "square": ("pow",),
    "gelu_erf_spelled": ("mul", "branch", "div", "erf", "add"),
    "gelu_new_spelled": ("mul", "branch", "pow", "add", "tanh"),
}


def drawn_steps(generation: int | None = None) -> set:
    """The vocabulary steps the fuzzer's `generation` draws (None: some generation)."""
    last = max(CONV_NORMS) if generation is None else generation
    draws = POINTWISE + BINARY + NORMS_LINEAR + ROW_REDUCTIONS + (MATH_POINTWISE if last >= MATH_GENERATION else [])
    draws += SPELLED_GELUS if last >= BRANCH_GENERATION else []
    draws += ["prelu", "l2normalize"] if last >= PRELU_GENERATION else []
    draws += (POOLS if last >= POOL_GENERATION else []) + (CHANNEL_REDUCTIONS if last >= CHANNEL_GENERATION else [])
    draws += WINDOWS if last >= WINDOW_GENERATION else []
    draws += FEATURE_POOLS if last >= 7 else []
    draws += PLANE_NORMS if last >= BMM_GENERATION else []
    draws += [n for g in range(1, last + 1) for n in CONV_NORMS[g]]
    return {step for draw in draws for step in STEPS_OF_DRAW.get(draw, (draw,))}


WIDTHS = [1, 3, 7, 16, 33, 64, 100, 127, 255, 256, 384, 513, 1000, 2048, 4100]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _bmm_anchor(rng: random.Random) -> dict:
    """x[batch, out, in] times a weight [batch, in, N]: the product's plane is N (`spatial`);
    with `heads` > 1 the product is viewed [batch / heads, heads, out, N] (attention
    scores), after which only steps that keep the shape are drawn."""
    a = {"kind": "bmm", "batch": rng.randint(1, 4), "in": rng.randint(1, 64),
         "out": rng.choice([1, 2, 4, 6, 8, 12, 16, 32, 64]), "spatial": [rng.randint(2, 80)],
         "matmul": rng.random() < 0.5}
    a["heads"] = rng.choice([h for h in (1, 1, 2, 4) if a["batch"] % h == 0])
    return a


def _anchor(rng: random.Random) -> dict:
    kind = rng.choices(["linear", "conv", "conv_transpose"], weights=[6, 3, 1])[0]
    if kind == "linear":
        lead = rng.choice([[rng.randint(1, 70)], [rng.randint(1, 70)], [rng.randint(1, 5), rng.randint(1, 9)]])
        return {"kind": kind, "lead": lead, "in": rng.randint(1, 300), "out": rng.choice(WIDTHS),
                "bias": rng.random() < 0.8}
    dims = rng.choice([1, 2, 2, 2, 3]) if kind == "conv" else rng.choice([2, 3])
    low, high = {1: (4, 40), 2: (3, 24), 3: (3, 9)}[dims]
    kernel, dilation = rng.choice([1, 2, 3]), rng.choice([1, 1, 2]) if kind == "conv" else 1
    low = max(low, dilation * (kernel - 1) + 1)  # the output is at least 1 wide
    return {
        "kind": kind, "dims": dims, "batch": rng.randint(1, 4), "in": rng.randint(1, 8),
        "out": rng.choice([2, 4, 6, 8, 12, 16, 24, 32]), "spatial": [rng.randint(low, high) for _ in range(dims)],
        "kernel": kernel, "stride": rng.choice([1, 1, 2]), "padding": rng.choice([0, 1]),
        "dilation": dilation, "bias": rng.random() < 0.8,
    }


def _gemm_anchor(rng: random.Random) -> dict:
    """A Linear the in-kernel GEMM covers: K a multiple of 8, N of 256; rows on both sides
    of its 128-row tile."""
    lead = rng.choice([[rng.randint(1, 600)], [rng.randint(1, 600)], [rng.randint(1, 5), rng.randint(1, 130)]])
    return {"kind": "linear", "lead": lead, "in": 8 * rng.randint(1, 40), "out": rng.choice([256, 512, 768, 2048]),
            "bias": rng.random() < 0.8}


def _implicit_anchor(rng: random.Random, strides: random.Random | None = None,
                     narrow: random.Random | None = None) -> dict:
    """A 2-D conv the in-kernel conv covers: input channels in 8s, more output channels
    than the direct conv takes; outputs narrower and wider than its patches. Stride 1 and
    dilation 1, or where `strides` is given (STRIDED_GENERATION), drawn from it; where
    `narrow` is given (NARROW_GENERATION), half the anchors' channels drawn from it, few."""
    kernel = rng.choice([1, 3, 3, 5])
    anchor = {"kind": "conv", "dims": 2, "batch": rng.randint(1, 4), "in": 8 * rng.randint(1, 10),
              "out": 8 * rng.randint(5, 32), "spatial": [rng.randint(kernel, 24), rng.randint(kernel, 150)],
              "kernel": kernel, "stride": 1, "padding": rng.choice([0, 1, 2]), "dilation": 1,
              "bias": rng.random() < 0.8}
    if strides is not None:
        anchor["stride"] = strides.choice([1, 2, 2, 3])
        anchor["dilation"] = strides.choice([1, 1, 2]) if kernel > 1 else 1
        reach = anchor["dilation"] * (kernel - 1) + 1  # the output is at least 1 wide
        anchor["spatial"] = [max(n, reach) for n in anchor["spatial"]]
    if narrow is not None and narrow.random() < 0.5:
        anchor["in"], anchor["out"] = 8 * narrow.randint(1, 4), 8 * narrow.randint(4, 8)
    return anchor


def _as_conv2d(anchor: dict, rng: random.Random) -> dict:
    """A third of the time, an in-kernel conv anchor turned into a conv that runs as the
    2-D conv it equals (AS_CONV2D_GENERATION): a Conv1d over its width, or a
    ConvTranspose2d of stride 1; else `anchor`."""
    if rng.random() >= 1 / 3:
        return anchor
    if rng.random() < 0.5:
        return {**anchor, "dims": 1, "spatial": [anchor["spatial"][1]]}
    return {**anchor, "kind": "conv_transpose", "stride": 1, "dilation": 1,
            "padding": min(anchor["padding"], anchor["kernel"] - 1)}


def _as_conv3d(anchor: dict, rng: random.Random) -> dict:
    """A quarter of the time, a 2-D in-kernel conv anchor turned into a Conv3d of the same
    channels, kernel, stride, padding and dilation in every dim (CONV3D_GENERATION): 1 to
    8 input planes (at least the kernel's reach), planes of at most 20 x 48; else `anchor`."""
    if anchor["kind"] != "conv" or anchor["dims"] != 2 or rng.random() >= 1 / 4:
        return anchor
    reach = anchor["dilation"] * (anchor["kernel"] - 1) + 1
    h, w = anchor["spatial"]
    return {**anchor, "dims": 3, "spatial": [max(rng.randint(1, 8), reach), max(min(h, 20), reach),
                                             max(min(w, 48), reach)]}


def _step(rng: random.Random, ctx: dict) -> dict:
    """One random step valid for the chain's current value (`ctx`)."""
    channels = ctx["channels"]
    choices = [("pointwise", 10), ("binary", 6)]
    if not ctx["reduced"] and not ctx["has_reduction"]:
        choices.append(("norm", 4))
        if ctx["row_reducible"]:
            choices.append(("reduction", 3))
        elif ctx["kind"] == "conv" and ctx["generation"] >= POOL_GENERATION and not ctx.get("heads"):
            choices.append(("pool", 3))
    elif ctx.get("after_norm") and not ctx["reduced"]:  # a reduction after the norm
        if ctx["row_reducible"]:
            choices.append(("reduction", 3))
        elif ctx["kind"] == "conv" and not ctx.get("heads"):
            choices.append(("pool", 3))
    if ctx["allow_outside"]:
        choices.append(("outside", 1))
    family = rng.choices([c for c, _ in choices], weights=[w for _, w in choices])[0]
    if family == "pointwise":
        drawable = POINTWISE + (MATH_POINTWISE if ctx["generation"] >= MATH_GENERATION else [])
        drawable += SPELLED_GELUS if ctx["generation"] >= BRANCH_GENERATION else []
        drawable += ["prelu"] if ctx["generation"] >= PRELU_GENERATION else []
        positive = ctx["last"] in POSITIVE
        ops = [o for o in drawable if (o not in POSITIVE_ONLY or positive)
               and (o not in BOUNDED_ONLY or ctx["last"] in BOUNDED)]
        op = rng.choice(ops)
        step = {"op": op}
        if op == "pow":
            step["exponent"] = rng.choice([p for p in POWERS if positive or p in (2, 3, 4)])
        if op == "leaky_relu":
            step["slope"] = rng.choice([0.01, 0.2, -0.3, 1.5])
        elif op == "prelu":
            per_channel = not (ctx["reduced"] or ctx["has_reduction"] or ctx["nd_linear"] or ctx.get("heads"))
            step["slopes"] = rng.choice(["one", "channel"] if per_channel else ["one"])
        elif op in ("hardtanh", "clamp"):
            lo = round(rng.uniform(-2, 0.5), 3)
            step["lo"], step["hi"] = lo, round(lo + rng.uniform(0.1, 3), 3)
        elif op in ("clamp_min", "clamp_max"):
            step["bound"] = round(rng.uniform(-1, 1), 3)
        elif op in ("elu", "celu"):
            step["alpha"] = rng.choice([1.0, 0.5, 1.7])
        elif op == "softplus":
            step["beta"], step["threshold"] = rng.choice([1.0, 2.0, 0.5]), rng.choice([20.0, 1.0, 5.0])
        return step
    if family == "binary":
        op = rng.choice(BINARY)
        operands = ["channel", "one"] if op in ("maximum", "minimum") else ["scalar", "scalar", "channel", "one", "self"]
        if not ctx["reduced"] and not ctx.get("windowed") and op not in ("maximum", "minimum"):
            operands.append("full")
        if ctx["reduced"]:
            operands = [o for o in operands if o not in ("channel", "full")] or ["one"]
        if ctx["generation"] >= EARLIER_GENERATION and ctx["earlier"] and op not in ("maximum", "minimum"):
            operands += ["earlier", "earlier"]
        if ctx["generation"] >= BROADCAST_GENERATION and not ctx["reduced"] and not ctx.get("windowed"):
            operands += ["broadcast", "broadcast"]
        if ctx["generation"] >= BRANCH_GENERATION and ctx["earlier"] and op not in ("maximum", "minimum"):
            operands += ["branch", "branch"]
        operand = rng.choice(operands)
        step = {"op": op, "operand": operand, "reverse": rng.random() < 0.3 and operand != "self"}
        if operand == "scalar":
            step["value"] = round(rng.choice([-1, 1]) * rng.uniform(0.5, 2.0), 3)
        elif operand == "earlier":
            step["back"] = rng.randint(1, ctx["earlier"])
        elif operand == "branch":
            step["back"] = rng.randint(1, ctx["earlier"])
            step["functions"] = rng.sample(BRANCH_FUNCTIONS, rng.randint(1, 2))
        elif operand == "broadcast":
            step["mask"] = [rng.random() < 0.5 for _ in range(6)]
            # [B, T, N]'s rows are (b, t) pairs, a bmm's [B / h, h, M, N] has rows of (b,
            # h): before SAMPLE_BROADCAST_GENERATION, b full needed t (h) full (whole rows).
            lead = -3 if ctx["nd_linear"] else -4 if ctx.get("heads") else 0
            if lead and ctx["generation"] < SAMPLE_BROADCAST_GENERATION:
                step["mask"][lead] = step["mask"][lead] and step["mask"][lead + 1]
            step["squeeze"] = rng.random() < 0.5
        return step
    if family == "norm":
        later = ["l2normalize"] if ctx["generation"] >= PRELU_GENERATION else []
        if ctx["nd_linear"]:  # [B, T, N]: only norms over the last dim keep their meaning
            op = rng.choice(["layernorm", "rmsnorm", "softmax", "log_softmax"] + later)
        elif ctx.get("heads"):  # [B / h, h, M, N]: softmax over each plane
            op = rng.choice(PLANE_NORMS)
        else:
            op = rng.choice(NORMS_LINEAR + later if ctx["kind"] == "linear" else CONV_NORMS[ctx["generation"]])
        step = {"op": op, "eps": rng.choice([1e-5, 1e-6, 1e-3])}
        if ctx["generation"] >= SPELLED_GENERATION and op in SPELLED_NORMS and ctx["kind"] == "linear" \
                and rng.random() < 0.5:
            step["spelled"] = rng.choice(SPELLED_NORMS[op][1:])
        if op == "groupnorm":
            step["groups"] = rng.choice(_divisors(channels))
            step["affine"] = rng.random() < 0.8
        elif op in ("layernorm", "rmsnorm"):
            step["affine"] = rng.random() < 0.7
        elif op == "batchnorm":
            step["momentum"] = rng.choice([0.1, 0.3])
        elif op == "instancenorm":
            step["affine"], step["running"] = rng.random() < 0.6, rng.random() < 0.3
        elif op == "conv_layernorm":
            step["dims"], step["affine"] = rng.randint(1, len(ctx["spatial"]) + 1), rng.random() < 0.8
        return step
    if family == "reduction" and ctx["has_reduction"]:
        return {"op": rng.choice(ROW_REDUCTIONS[1:]), "keepdim": rng.random() < 0.5}
    if family == "pool" and ctx["has_reduction"]:
        return {"op": rng.choice(POOLS), "keepdim": rng.random() < 0.5}
    if family == "reduction":
        ops = ROW_REDUCTIONS + FEATURE_POOLS * 2 if ctx["generation"] >= 7 and not ctx["nd_linear"] else ROW_REDUCTIONS
        op = rng.choice(ops)
        if op in FEATURE_POOLS:
            return {**_window(rng, op.removeprefix("feature_"), [channels]), "op": op}
        return {"op": op, "keepdim": rng.random() < 0.5}
    if family == "pool":
        pools = POOLS + CHANNEL_REDUCTIONS if ctx["generation"] >= CHANNEL_GENERATION else POOLS
        pools = pools + WINDOWS * 3 if ctx["generation"] >= WINDOW_GENERATION else pools
        op = rng.choice(pools)
        if op in WINDOWS:
            window = _window(rng, op, ctx["spatial"])
            tile = ctx.get("tile_pools")
            if tile is not None and len(ctx["spatial"]) == 2 and tile.random() < 0.5:
                side = tile.choice([k for k in (2, 2, 4) if k <= min(ctx["spatial"])] or [1])
                window.update(kernel=side, stride=side, padding=0, dilation=1, ceil=False)
            return window
        step = {"op": op, "keepdim": rng.random() < 0.5}
        if step["keepdim"] and ctx["generation"] >= BMM_GENERATION:  # then its unit dims squeezed away, or not
            step["squeeze"] = rng.random() < 0.5
        return step
    return {"op": rng.choice(OUTSIDE_MATH if ctx["generation"] >= MATH_GENERATION else OUTSIDE)}


def _window(rng: random.Random, op: str, sizes: list) -> dict:
    """A pooling window that fits the conv output's spatial `sizes` (each pooled size >= 1)."""
    small = min(sizes)
    dilation = rng.choice([1, 1, 2]) if op == "maxpool" else 1
    kernel = rng.choice([k for k in (1, 2, 2, 3) if dilation * (k - 1) + 1 <= small] or [1])
    padding = rng.choice([0, 0, kernel // 2])
    step = {"op": op, "kernel": kernel, "stride": rng.choice([kernel, kernel, 1, 2]), "padding": padding,
            "dilation": dilation, "ceil": rng.random() < 0.3}
    if op == "avgpool":
        step["count_pad"] = rng.random() < 0.7
        step["divisor"] = rng.choice([None, None, None, 3]) if len(sizes) > 1 else None
    return step


def _conv_out_sizes(anchor: dict) -> list:
    """The spatial sizes of a conv anchor's output."""
    k, s, p, d = anchor["kernel"], anchor["stride"], anchor["padding"], anchor["dilation"]
    if anchor["kind"] == "conv_transpose":
        return [(n - 1) * s - 2 * p + d * (k - 1) + 1 for n in anchor["spatial"]]
    return [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n in anchor["spatial"]]


def make_case(seed: int, index: int, device: str = "cpu", generation: int = 1, gemm: bool = False,
              implicit: bool = False) -> Case:
    """The `index`-th random model of `seed` (a pure function of the two, `device`, the
    generator's `generation`, `gemm`: a 16-bit Linear of the in-kernel GEMM's shapes, and
    `implicit`: a conv of the in-kernel conv's; each drawn from a stream of its own)."""
    rng = random.Random(f"{seed}/{index}/{device}" + ("/gemm" if gemm else "") + ("/implicit" if implicit else ""))
    # Whether a bmm is drawn comes from a stream of its own: the other models of a
    # generation that draws bmm anchors stay the ones the generation before drew.
    bmm = (generation >= BMM_GENERATION and not gemm and not implicit
           and random.Random(f"{seed}/{index}/{device}/bmm").random() < 0.25)
    if implicit:
        strides = random.Random(f"{seed}/{index}/{device}/strides") if generation >= STRIDED_GENERATION else None
        narrow = random.Random(f"{seed}/{index}/{device}/narrow") if generation >= NARROW_GENERATION else None
        anchor = _implicit_anchor(rng, strides, narrow)
        if generation >= AS_CONV2D_GENERATION:
            anchor = _as_conv2d(anchor, random.Random(f"{seed}/{index}/{device}/as2d"))
        if generation >= CONV3D_GENERATION:
            anchor = _as_conv3d(anchor, random.Random(f"{seed}/{index}/{device}/conv3d"))
        if generation >= ODD_CHANNELS_GENERATION:
            odd = random.Random(f"{seed}/{index}/{device}/oddchannels")
            if odd.random() < 1 / 5:
                anchor = {**anchor, "in": odd.choice([odd.randint(1, 7), 8 * odd.randint(1, 4) + odd.randint(1, 7)])}
    else:
        anchor = _gemm_anchor(rng) if gemm else _bmm_anchor(rng) if bmm else _anchor(rng)
    if bmm and generation >= BADDBMM_GENERATION:
        extra = random.Random(f"{seed}/{index}/{device}/baddbmm")
        if extra.random() < 1 / 3:
            anchor["baddbmm"] = {"input": extra.choice(BADDBMM_INPUTS), "alpha": extra.choice([1.0, 0.125, 2.0, -0.5])}
    linear = anchor["kind"] == "linear"
    ctx = {
        "kind": "linear" if linear else "conv",
        "channels": anchor["out"],
        "reduced": False,
        "has_reduction": False,
        # (N-D inputs from generation 8: a value per (b, t) row, viewed back to [B, T])
        "row_reducible": linear and (len(anchor["lead"]) == 1 or generation >= BMM_GENERATION),
        "nd_linear": linear and len(anchor["lead"]) > 1,
        "allow_outside": rng.random() < 0.1,
        "last": "",
        "generation": generation,
        "earlier": 0,  # earlier values of the current value's shape (an `earlier` operand's choices)
        # a conv output's spatial sizes (a bmm's: its N)
        "spatial": [] if linear else list(anchor["spatial"]) if anchor["kind"] == "bmm" else _conv_out_sizes(anchor),
        "heads": anchor.get("heads", 1) > 1,  # a bmm's product viewed to 4-D
        "windowed": False,  # after a pooling window: no full operands (the residual has the conv's shape)
        # the in-kernel conv's anchors: a stream that makes half their windows the tiles' own
        "tile_pools": (random.Random(f"{seed}/{index}/{device}/tilepool")
                       if implicit and generation >= TILE_POOL_GENERATION else None),
    }
    steps, in_vocabulary = [], True
    for _ in range(rng.randint(1, 8)):
        step = _step(rng, ctx)
        steps.append(step)
        op = step["op"]
        ctx["last"] = "softmax" if op in ("softmax", "plane_softmax") else op
        if op in OUTSIDE + OUTSIDE_MATH:
            in_vocabulary = in_vocabulary and op not in OUTSIDE_MATH
            ctx["allow_outside"] = False
        if op in NORMS_LINEAR + CONV_NORMS[generation] + ROW_REDUCTIONS + POOLS + CHANNEL_REDUCTIONS + WINDOWS \
                + FEATURE_POOLS:
            ctx["has_reduction"] = True
        shrinks = ROW_REDUCTIONS + POOLS + CHANNEL_REDUCTIONS + FEATURE_POOLS
        if op in shrinks:  # (then no per-channel or full operands of the conv's shape)
            ctx["reduced"] = True
        ctx["windowed"] = ctx["windowed"] or op in WINDOWS
        ctx["after_norm"] = ctx.get("after_norm") or (generation >= SECOND_REDUCTION_GENERATION
                                                      and op in NORMS_BEFORE_A_REDUCTION)
        ctx["earlier"] = 0 if op in shrinks + WINDOWS else ctx["earlier"] + 1
    if gemm:
        dtype = rng.choice(["bfloat16", "float16"]) if device == "cuda" else "bfloat16"
    elif implicit:
        # On the CPU float32: a 16-bit CPU conv rounds conv + bias once, where cuDNN's
        # (through torch) and the fused op round the conv, then the sum.
        dtype = rng.choice(["bfloat16", "float16"]) if device == "cuda" else "float32"
    elif device == "cuda":
        dtype = rng.choices(["float32", "bfloat16", "float16"], weights=[5, 3, 2])[0]
    else:
        dtype = rng.choices(["float32", "bfloat16"], weights=[4, 1])[0]
    training = rng.random() < 0.4
    # Drawn last, so that the models drawn before TF32 was added keep everything else.
    tf32 = (gemm or implicit) and device == "cuda" and rng.random() < 1 / 3
    if tf32:
        dtype = "float32"
    return Case(index, seed, anchor, steps, dtype, training=training, in_vocabulary=in_vocabulary,
                generation=generation, gemm=gemm, tf32=tf32, implicit=implicit)


# -------------------------------------------------------------------- models


class FuzzStep(nn.Module):
    """One step of a Case, with its tensors registered so `.to()` and `.double()` reach them."""

    def __init__(self, spec: dict, channels: int, channel_shape: list, value_shape: list, gen: torch.Generator,
                 heads: bool = False):
        """`heads`: the value is a bmm's product viewed [B / h, h, M, N]; its planes are its last dim."""
        super().__init__()
        self.spec = dict(spec)
        op = spec["op"]
        self.norm = None
        self.heads = heads
        if op in BINARY and spec["operand"] in ("channel", "one", "broadcast"):
            shape = channel_shape if spec["operand"] == "channel" else []
            if spec["operand"] == "broadcast":
                shape = [n if full else 1 for n, full in zip(value_shape, spec["mask"][-len(value_shape):])]
                while spec["squeeze"] and shape and shape[0] == 1:
                    shape = shape[1:]
            t = torch.rand(shape, generator=gen) + 0.5  # away from zero: `div` stays well conditioned
            t = t * torch.where(torch.rand(shape, generator=gen) < 0.3, -1.0, 1.0)
            self.register_buffer("operand", t)
        if op == "groupnorm":
            self.norm = nn.GroupNorm(spec["groups"], channels, eps=spec["eps"], affine=spec["affine"])
        elif op == "layernorm":
            self.norm = nn.LayerNorm(channels, eps=spec["eps"], elementwise_affine=spec["affine"])
        elif op == "rmsnorm":
            self.norm = nn.RMSNorm(channels, eps=spec["eps"], elementwise_affine=spec["affine"])
        elif op == "batchnorm":
            cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(value_shape)]
            self.norm = cls(channels, eps=spec["eps"], momentum=spec["momentum"])
            with torch.no_grad():
                self.norm.running_mean.copy_(torch.randn(channels, generator=gen) * 0.1)
                self.norm.running_var.copy_(torch.rand(channels, generator=gen) + 0.5)
        elif op == "conv_layernorm":
            self.norm = nn.LayerNorm(value_shape[-spec["dims"]:], eps=spec["eps"], elementwise_affine=spec["affine"])
        elif op == "instancenorm":
            cls = {3: nn.InstanceNorm1d, 4: nn.InstanceNorm2d, 5: nn.InstanceNorm3d}[len(value_shape)]
            self.norm = cls(channels, eps=spec["eps"], affine=spec["affine"], track_running_stats=spec["running"])
            if spec["running"]:
                with torch.no_grad():
                    self.norm.running_mean.copy_(torch.randn(channels, generator=gen) * 0.1)
                    self.norm.running_var.copy_(torch.rand(channels, generator=gen) + 0.5)
        if op == "prelu":  # slopes in (-0.5, 1.5): negative ones, and some above 1
            n = channels if spec["slopes"] == "channel" else 1
            self.register_buffer("slopes", torch.rand(n, generator=gen) * 2 - 0.5)
        if self.norm is not None:
            with torch.no_grad():
                for p in self.norm.parameters():
                    p.copy_(torch.rand(p.shape, generator=gen) + 0.5)

    def forward(self, x, residual, earlier=()):
        """`earlier`: the chain's values before this one, oldest first."""
        s, op = self.spec, self.spec["op"]
        if op == "layernorm" and s.get("spelled"):
            return _layer_norm_spelled(s["spelled"], x, self.norm)
        if self.norm is not None:
            return self.norm(x)
        if op in BINARY:
            other = {"scalar": s.get("value"), "self": x, "full": residual}.get(s["operand"])
            if s["operand"] == "earlier":
                other = earlier[-s["back"]]
            elif s["operand"] == "branch":
                other = earlier[-s["back"]]
                for name in s["functions"]:
                    other = {"scale": lambda v: v * 1.5, "shift": lambda v: v - 0.25}.get(
                        name, lambda v: _pointwise(name, s, v))(other)
            if other is None:
                other = self.operand
            if op == "maximum":
                return torch.maximum(x, other)
            if op == "minimum":
                return torch.minimum(other, x)
            a, b = (other, x) if s["reverse"] else (x, other)
            return {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[op](a, b)
        if op in ROW_REDUCTIONS:  # over the features: the last dim
            keep = s["keepdim"]
            if op == "max_values":
                return torch.max(x, dim=-1, keepdim=keep).values
            return {"logsumexp": torch.logsumexp, "sum": torch.sum, "mean": torch.mean, "amax": torch.amax,
                    "amin": torch.amin}[op](x, -1, keepdim=keep)
        if op in POOLS:
            reduce = {"pool_sum": torch.sum, "pool_mean": torch.mean, "pool_amax": torch.amax,
                      "pool_amin": torch.amin}[op]
            out = reduce(x, tuple(range(2, x.dim())), keepdim=s["keepdim"])
            return out.squeeze(tuple(range(2, out.dim()))) if s.get("squeeze") else out
        if op in FEATURE_POOLS:  # [rows, N] pooled as [rows, 1, N]
            return _window_pool(op.removeprefix("feature_"), s, x.unsqueeze(1)).squeeze(1)
        if op in WINDOWS:
            return _window_pool(op, s, x)
        if op in CHANNEL_REDUCTIONS:
            reduce = {"chan_logsumexp": torch.logsumexp, "chan_sum": torch.sum, "chan_mean": torch.mean,
                      "chan_amax": torch.amax, "chan_amin": torch.amin,
                      "chan_max_values": lambda v, d, keepdim: torch.max(v, d, keepdim=keepdim).values}[op]
            out = reduce(x, 1, keepdim=s["keepdim"])
            return out.squeeze(1) if s.get("squeeze") else out
        if op == "chan_softmax":
            return F.softmax(x, dim=1)
        if op == "chan_log_softmax":
            return F.log_softmax(x, dim=1)
        if op in PLANE_NORMS:  # over each channel's plane: the spatial dims flattened, then viewed back
            fn = F.softmax if op == "plane_softmax" else F.log_softmax
            return fn(x, dim=-1) if self.heads else fn(x.flatten(2), dim=-1).view_as(x)
        if op == "prelu":
            return F.prelu(x, self.slopes)
        if op == "l2normalize":
            return F.normalize(x, dim=-1, eps=s["eps"])
        return _pointwise(op, s, x)


def _layer_norm_spelled(form: str, x, norm: nn.LayerNorm):
    """`norm` over the last dim written out (`SPELLED_NORMS`): x - mean written twice and
    the variance by pow and mean (older BERT code), or by var(unbiased=False) and rsqrt;
    then its weight and bias, where it has them."""
    u = x.mean(-1, keepdim=True)
    if form == "centred_twice":
        y = (x - u) / torch.sqrt((x - u).pow(2).mean(-1, keepdim=True) + norm.eps)
    else:
        y = (x - u) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + norm.eps)
    return y * norm.weight + norm.bias if norm.elementwise_affine else y


def _window_pool(op: str, s: dict, x):
    """MaxPool / AvgPool (`op`) of x [rows, C, *spatial] with the window of step `s`."""
    nd = x.dim() - 2
    if op == "maxpool":
        pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nd]
        return pool(x, s["kernel"], s["stride"], s["padding"], s["dilation"], ceil_mode=s["ceil"])
    pool = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nd]
    divisor = {} if nd == 1 else {"divisor_override": s["divisor"]}
    return pool(x, s["kernel"], s["stride"], s["padding"], ceil_mode=s["ceil"], count_include_pad=s["count_pad"],
                **divisor)


def _pointwise(op: str, s: dict, x):
    simple = {
        "relu": F.relu, "gelu": F.gelu, "silu": F.silu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "mish": F.mish,
        "hardswish": F.hardswish, "hardsigmoid": F.hardsigmoid, "relu6": F.relu6, "selu": F.selu, "abs": torch.abs,
        "neg": torch.neg, "exp": torch.exp, "log": torch.log, "cos": torch.cos, "erf": torch.erf, "sin": torch.sin,
        "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "square": torch.square,
        "log1p": torch.log1p, "expm1": torch.expm1,
        "atan": torch.atan,
    }
    if op in simple:
        return simple[op](x)
    if op == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if op == "gelu_erf_spelled":
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if op == "gelu_new_spelled":
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    if op == "leaky_relu":
        return F.leaky_relu(x, s["slope"])
    if op == "silu_spelled":
        return x * torch.sigmoid(x)
    if op == "hardtanh":
        return F.hardtanh(x, s["lo"], s["hi"])
    if op == "clamp":
        return torch.clamp(x, s["lo"], s["hi"])
    if op == "clamp_min":
        return torch.clamp(x, min=s["bound"])
    if op == "clamp_max":
        return torch.clamp(x, max=s["bound"])
    if op == "elu":
        return F.elu(x, s["alpha"])
    if op == "celu":
        return F.celu(x, s["alpha"])
    if op == "softplus":
        return F.softplus(x, s["beta"], s["threshold"])
    if op == "softmax" and s.get("spelled"):
        m = x.amax(-1, keepdim=True) if s["spelled"] == "amax" else torch.max(x, dim=-1, keepdim=True).values
        e = torch.exp(x - m)
        return e / e.sum(-1, keepdim=True)
    if op == "log_softmax" and s.get("spelled"):
        return x - torch.logsumexp(x, -1, keepdim=True)
    if op == "softmax":
        return F.softmax(x, dim=-1)
    if op == "log_softmax":
        return F.log_softmax(x, dim=-1)
    if op == "pow3":
        return x.pow(3)
    if op == "pow":
        return x ** s["exponent"]
    if op == "dropout_train":
        return F.dropout(x, 0.5, training=True)
    raise ValueError(f"unknown fuzz step {op!r}")


class BatchedProduct(nn.Module):
    """x[B, M, K] times a weight w[B, K, N]: `torch.bmm(x, w)`, or `x @ w` (`matmul`), or
    with `baddbmm` ({"input": kind, "alpha": a}) `torch.baddbmm(input, x, w, alpha=a)`
    with an input of that kind's shape; viewed [B / heads, heads, M, N] where `heads` > 1."""

    def __init__(self, batch: int, m: int, k: int, n: int, matmul: bool, heads: int = 1, baddbmm: dict | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(batch, k, n) / math.sqrt(k))
        self.matmul, self.heads, self.alpha = matmul, heads, (baddbmm or {}).get("alpha", 1.0)
        self.input = None
        if baddbmm:
            shape = {"full": (batch, m, n), "position": (m, n), "channel": (m, 1), "column": (1, n),
                     "one": (1,)}[baddbmm["input"]]
            self.input = nn.Parameter(torch.randn(shape))

    def forward(self, x):
        if self.input is not None:
            y = torch.baddbmm(self.input, x, self.weight, alpha=self.alpha)
        else:
            y = x @ self.weight if self.matmul else torch.bmm(x, self.weight)
        return y.view(-1, self.heads, *y.shape[1:]) if self.heads > 1 else y


class FuzzModel(nn.Module):
    """anchor -> steps; a residual input feeds the `full` operands."""

    def __init__(self, case: Case):
        super().__init__()
        gen = torch.Generator().manual_seed(hash((case.seed, case.index)) & 0xFFFFFFFF)
        torch.manual_seed(gen.initial_seed())
        a = case.anchor
        if a["kind"] == "linear":
            self.anchor = nn.Linear(a["in"], a["out"], bias=a["bias"])
            value_shape = a["lead"] + [a["out"]]
            channel_shape = [a["out"]]
        elif a["kind"] == "bmm":
            heads = a.get("heads", 1)
            self.anchor = BatchedProduct(a["batch"], a["out"], a["in"], a["spatial"][0], a["matmul"], heads,
                                         a.get("baddbmm"))
            value_shape = ([a["batch"] // heads, heads] if heads > 1 else [a["batch"]]) + [a["out"], a["spatial"][0]]
            channel_shape = [a["out"], 1]
        else:
            transposed = a["kind"] == "conv_transpose"
            cls = {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (3, False): nn.Conv3d,
                   (2, True): nn.ConvTranspose2d, (3, True): nn.ConvTranspose3d}[(a["dims"], transposed)]
            kwargs = dict(stride=a["stride"], padding=a["padding"], bias=a["bias"])
            if not transposed:
                kwargs["dilation"] = a["dilation"]
            self.anchor = cls(a["in"], a["out"], a["kernel"], **kwargs)
            with torch.no_grad():
                probe = self.anchor(torch.zeros([1, a["in"]] + a["spatial"]))
            value_shape = [a["batch"]] + list(probe.shape[1:])
            channel_shape = [a["out"]] + [1] * a["dims"]
        self.value_shape = value_shape
        heads = a.get("heads", 1) > 1
        self.steps = nn.ModuleList(FuzzStep(s, a["out"], channel_shape, value_shape, gen, heads) for s in case.steps)

    def forward(self, x, residual):
        x = self.anchor(x)
        values = []
        for step in self.steps:
            x, values = step(x, residual, values), values + [x]
        return x


def make_inputs(case: Case, model: FuzzModel, device: str, draw: int = 0, on_device: bool = False) -> tuple:
    """(x, residual) of a Case; `draw` > 0 gives other random values of the same shapes.
    `on_device`: drawn by the device's generator (fast for the benchmark's large inputs;
    other values than the CPU generator's)."""
    seed = (hash((case.seed, case.index)) + 1 + 7919 * draw) & 0xFFFFFFFF
    gen = torch.Generator(device if on_device else "cpu").manual_seed(seed)
    a = case.anchor
    if a["kind"] == "linear":
        shape = a["lead"] + [a["in"]]
    elif a["kind"] == "bmm":
        shape = [a["batch"], a["out"], a["in"]]
    else:
        shape = [a["batch"], a["in"]] + a["spatial"]
    dtype = getattr(torch, case.dtype)
    where = device if on_device else "cpu"
    x = torch.randn(shape, generator=gen, device=where).to(device=device, dtype=dtype)
    residual = torch.randn(model.value_shape, generator=gen, device=where).to(device=device, dtype=dtype)
    return x, residual


# ------------------------------------------------------------------- checking


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the reference's finite elements (float64).

    inf where a non-finite reference value (NaN, +-inf) is not reproduced exactly,
    or where a finite reference value comes out non-finite.
    """
    out, ref = out.double(), ref.double()
    if out.shape != ref.shape:
        return math.inf
    finite = torch.isfinite(ref)
    same_special = (out == ref) | (torch.isnan(out) & torch.isnan(ref))
    if not bool(same_special[~finite].all()) or not bool(torch.isfinite(out[finite]).all()):
        return math.inf
    diff = (out[finite] - ref[finite]).norm().item()
    scale = ref[finite].norm().item()
    return diff / scale if scale > 0 else diff


@dataclass
class Result:
    """What happened to one Case."""

    index: int
    fusion: str  # "full" (one fused op covers the chain), "partial", "none"; "" after an error
    # "ok", "mismatch", "ill_conditioned" (Inductor is as far off, or on CPU a 16-bit
    # conv's eager with its bias added as CUDA's cuDNN path adds it, or the excess does
    # not come back on other inputs), "rejected" (eager raises for this model, and so
    # does fusedepi, the same exception and message) or "error" (any other exception)
    check: str
    in_vocabulary: bool
    dtype: str
    anchor: str
    steps: list
    err: float = 0.0  # fusedepi vs float64
    eager_err: float = 0.0  # eager vs float64
    inductor_err: float = 0.0  # plain Inductor vs float64, measured only when fusedepi's is out of budget
    reason: str = ""  # why the chain stopped or was refused
    finding: str = ""  # what failed the check
    fused_steps: list = field(default_factory=list)
    # the kernel file each fused chain was built as (its name: the form, e.g. an in-kernel
    # conv's `igemm128x128_nchw_...` where it reads x NCHW), in the order of fused_steps
    kernels: list = field(default_factory=list)
    in_kernel: bool = False  # the fused op computed its GEMM (a wgmma kernel, not cuBLAS first)
    in_kernel_conv: bool = False  # the fused op computed its conv as an implicit GEMM (an igemm kernel)
    # `--dynamic-batch`: whether the checked call followed one at another batch ("" when
    # not asked, else "ran", or why not: eager refuses that batch)
    dynamic_batch: str = ""


def _outputs(model: nn.Module, fn, x, residual, upstream) -> list[torch.Tensor]:
    """[output, BatchNorm running stats...], and with an `upstream` gradient also the
    gradients of x, the residual and every parameter (zeros where there is none)."""
    torch.manual_seed(0)  # dropout masks
    if upstream is None:
        with torch.no_grad():
            out = fn(x, residual)
        grads = []
    else:
        inputs = [t.detach().clone().requires_grad_() for t in (x, residual)]
        out = fn(*inputs)
        out.backward(upstream.to(out.dtype))
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs + list(model.parameters())]
    buffers = [b for b in model.buffers() if b.dtype.is_floating_point]
    return [out.detach()] + buffers + grads


def _worst(ours: list, eager: list, ref: list, tol: float) -> tuple[int, float, float]:
    """(index, our error, eager's error) of the tensor furthest outside the budget."""
    pairs = [(error(o, r), error(e, r)) for o, e, r in zip(ours, eager, ref)]
    index = max(range(len(pairs)), key=lambda i: pairs[i][0] / max(EAGER_SLACK * pairs[i][1], tol))
    return index, pairs[index][0], pairs[index][1]


def _inductor_error(base: nn.Module, case: Case, x, residual, ref, device: str, dtype, upstream, index) -> float:
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    torch._dynamo.reset()
    outs = _outputs(model, torch.compile(model, backend="inductor"), x, residual, upstream)
    return error(outs[index], ref[index])


def _tf32_error(base: nn.Module, x, residual, ref, device: str, upstream, index) -> float:
    """The error of the model in float64 with its anchor's x and weights rounded to TF32
    (`ops.round_to_tf32`): what a product in TF32 gives, whatever computes it."""
    from fusion_backend.ops import round_to_tf32

    model = copy.deepcopy(base).to(device=device)
    with torch.no_grad():
        for weight in (p for p in model.anchor.parameters() if p.dim() >= 2):
            weight.copy_(round_to_tf32(weight.float()))
    model = model.double()
    x = round_to_tf32(x.float()).double()
    return error(_outputs(model, model, x, residual.double(), upstream)[index], ref[index])


class _BiasAfterConv(nn.Module):
    """A conv (or transposed conv) whose bias is added to its output rounded to the
    output's dtype, as ATen's cuDNN path does ("cuDNN convolutions does not handle bias",
    aten/src/ATen/native/cudnn/ConvShared.cpp): CUDA eager, where CPU eager (oneDNN)
    adds it before rounding. Parameters stay in the conv's order (weight, bias)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.conv = conv
        del conv.weight, conv.bias
        conv.weight, conv.bias = self.weight, None

    def forward(self, x):
        y = self.conv(x)
        return y + self.bias.view([-1] + [1] * (y.dim() - 2)).to(y.dtype)


def _library_bias_error(base: nn.Module, x, residual, ref, device: str, dtype, upstream, index) -> float:
    """The error of eager with its conv's bias added as CUDA's cuDNN path adds it
    (`_BiasAfterConv`): on CPU, a 16-bit conv whose bias cancels its product rounds
    twice in CUDA eager, and in the fused chain, which adds the library conv's bias as a
    step; CPU eager rounds once (CPU model 231 of seed 9073, generation 21: a bf16
    ConvTranspose3d's x / x met 0 / 0 in one element)."""
    model = copy.deepcopy(base)
    model.anchor = _BiasAfterConv(model.anchor)
    model = model.to(device=device, dtype=dtype)
    return error(_outputs(model, model, x, residual, upstream)[index], ref[index])


def _records(reports):
    return [r for report in reports for r in report.records]


def run_case(case: Case, device: str, grad: bool = False, draw: int = 0, dynamic: bool = False) -> Result:
    """Compiles and runs one Case; compares it with eager and a float64 copy.

    Args:
        grad: also run backward and compare the gradients.
        draw: which random inputs (`make_inputs`); 0 is the Case's own.
        dynamic: check the graph Dynamo compiles once the batch size has changed
            (`_one_more_row`).
    """
    with _case_settings(case), _scalar_inductor_cpu(device):
        return _run_case(case, device, grad, draw, dynamic)


def _scalar_inductor_cpu(device: str):
    """On CPU, Inductor's C++ code without SIMD (`cpp.simdlen = 1`): its vectorized atan
    and its scalar one differ in the last bit, and where backward recomputes such a value
    in another kernel than forward's and compares it with a saved one (amin's mask of
    ties), it finds no tie and divides by a count of 0 (CPU model 235 of seed 9074,
    generation 21, with gradients: NaN gradients through a fused chain, 0.68 error
    without fusedepi; both exact without SIMD). CUDA computes such a value alike wherever
    it is computed; the CPU fuzzer checks the rewrite, not Inductor's C++ code."""
    if device != "cpu":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch({"cpp.simdlen": 1})


@contextlib.contextmanager
def _case_settings(case: Case):
    """The settings a Case runs under, as they were again afterwards: for `gemm`,
    FUSEDEPI_IN_KERNEL_GEMM=1 and, for a `tf32` one, matmul precision "high"; for
    `implicit`, FUSEDEPI_IN_KERNEL_CONV=1 and cuDNN's TF32 as `tf32` says; else none."""
    name = "FUSEDEPI_IN_KERNEL_CONV" if case.implicit else "FUSEDEPI_IN_KERNEL_GEMM" if case.gemm else ""
    if not name:
        yield
        return
    before, precision, allow_tf32 = (os.environ.get(name), torch.get_float32_matmul_precision(),
                                     torch.backends.cudnn.allow_tf32)
    os.environ[name] = "1"
    if case.implicit:
        torch.backends.cudnn.allow_tf32 = case.tf32
    elif case.tf32:
        torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = allow_tf32
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def _one_more_row(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` with its first row (image, matrix) appended: the same model at batch + 1."""
    return None if t is None else torch.cat([t, t[:1]])


def _first_call_at_another_batch(result: Result, model: nn.Module, eager_model: nn.Module, compiled,
                                 x, residual, upstream) -> None:
    """Runs `compiled` once at batch + 1, then puts `model` back as it was (BatchNorm's
    running stats, no gradients): the next call, at the Case's batch, then compiles the
    graph with a symbolic batch size. Where eager refuses batch + 1 (a parameter sized by
    the batch), nothing runs and `result.dynamic_batch` says so; an exception of
    fusedepi's propagates (a finding)."""
    more = [_one_more_row(t) for t in (x, residual, upstream)]
    try:
        probe = copy.deepcopy(eager_model)
        _outputs(probe, probe, *more)
    except Exception as err:  # noqa: BLE001 - the model is sized by its batch
        result.dynamic_batch = f"eager refuses batch + 1: {type(err).__name__}"
        return
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _outputs(model, compiled, *more)
    model.load_state_dict(state)
    for p in model.parameters():
        p.grad = None
    result.dynamic_batch = "ran"


def _run_case(case: Case, device: str, grad: bool, draw: int, dynamic: bool = False) -> Result:
    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    dtype = getattr(torch, case.dtype)
    base = FuzzModel(case).train(case.training)
    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    eager_model = copy.deepcopy(model)
    ref_model = copy.deepcopy(base).to(device=device, dtype=torch.float64)
    x, residual = make_inputs(case, base, device, draw)
    steps = [s["op"] for s in case.steps]
    anchor = case.anchor["kind"] + (f"{case.anchor['dims']}d" if "dims" in case.anchor else "")
    result = Result(case.index, "", "ok", case.in_vocabulary, case.dtype, anchor, steps)
    torch._dynamo.reset()
    reports: list = []
    dropout = "dropout_train" in steps
    upstream = None
    try:
        if grad:
            with torch.no_grad():
                shape = ref_model(x.double(), residual.double()).shape
            gen = torch.Generator().manual_seed(case.index + 1_000_003 * draw)
            upstream = torch.randn(shape, generator=gen, dtype=torch.float64).to(device)
        refs = _outputs(ref_model, ref_model, x.double(), residual.double(), upstream)
        eagers = _outputs(eager_model, eager_model, x, residual, upstream)
    except Exception as err:  # the model itself is invalid (BatchNorm of one value, say)
        eager_err = err
    else:
        eager_err = None
    if eager_err is not None:  # (outside the handler: fusedepi's exception must not chain to eager's)
        return _rejected(result, eager_err, model, x, residual, upstream)
    try:
        with collect_reports(reports), warnings.catch_warnings():
            # The fused op's outputs may not alias its inputs or each other: torch warns now
            # and will raise later; the fuzzer raises now.
            warnings.filterwarnings("error", message=".*custom operator.*alias.*")
            compiled = torch.compile(model, backend=fusedepi)
            if dynamic:
                _first_call_at_another_batch(result, model, eager_model, compiled, x, residual, upstream)
                reports.clear()  # the checked graph's reports only
            outs = _outputs(model, compiled, x, residual, upstream)
    except Exception as err:  # a crash is a finding, whatever it is
        result.check, result.finding = "error", f"{type(err).__name__}: {str(err)[:300]}"
        return result
    records = _records(reports)
    fused = [r for r in records if r.status == "fused"]
    refused = [r for r in records if r.status == "refused"]
    result.fused_steps = [[s["name"] for s in json.loads(r.spec)["steps"]] for r in fused]
    result.kernels = [r.kernel for r in fused]
    result.in_kernel = any(r.kernel.startswith("wgmma") and "library GEMM first" not in r.kernel for r in fused)
    result.in_kernel_conv = any(r.kernel.startswith("igemm") for r in fused)
    worst = 0
    tol = TF32_TOLERANCE if case.tf32 else TOLERANCE[case.dtype]
    if dropout:
        # Random masks differ between runs: only the shape and the fusion report are checked.
        result.err = 0.0 if outs[0].shape == eagers[0].shape else math.inf
    else:
        worst, result.err, result.eager_err = _worst(outs, eagers, refs, tol)
    if result.err > tol and result.err > EAGER_SLACK * result.eager_err:
        # Is it the chain's conditioning, which plain Inductor meets too (its own
        # reduction order, say), or ours? Inductor runs only for these few.
        result.inductor_err = _inductor_error(base, case, x, residual, refs, device, dtype, upstream, worst)
        # A TF32 model may have eager and Inductor exact (a library kernel without tensor
        # cores for a small conv) where ours computes in TF32 as allowed: it is held to
        # the error of the anchor's operands rounded to TF32 (GPU model 185 of seed 23,
        # generation 18: a division by the conv's value, 5.2e-3 either way).
        tf32_err = _tf32_error(base, x, residual, refs, device, upstream, worst) if case.tf32 else 0.0
        # On CPU, a 16-bit conv's bias as CUDA eager adds it (`_library_bias_error`).
        bias_err = (_library_bias_error(base, x, residual, refs, device, dtype, upstream, worst)
                    if device == "cpu" and case.anchor["kind"] in ("conv", "conv_transpose")
                    and case.anchor["bias"] and dtype != torch.float32 else None)
        # Where eager float32 has no correct digit left (error >= 1: a division by
        # rounding noise, say), no finite float32 result can be held to it.
        hopeless = 1 <= result.eager_err and math.isfinite(result.err)
        ours_only = (result.err > EAGER_SLACK * max(result.inductor_err, tf32_err) and not hopeless
                     and not (bias_err is not None and result.err <= EAGER_SLACK * bias_err))
        again = ""
        if ours_only and draw == 0 and result.eager_err > AMPLIFYING * tol and math.isfinite(result.err):
            # Eager's own error is a good share of the budget: the model amplifies
            # rounding, and which implementation's rounding lands worst changes from
            # input to input (GPU model 2930: 6.5x eager's error on one draw of four,
            # 0.4-0.9x on the others; CPU: Inductor 12x on one, 0.2-1.6x on others).
            # The excess counts unless it is gone on both of two other draws.
            others = [run_case(case, device, grad, d, dynamic) for d in (1, 2)]
            ours_only = any(r.check in ("mismatch", "error") for r in others)
            again = "; other draws: " + ", ".join(f"{r.check} ({r.err:.3g})" for r in others)
        result.check = "mismatch" if ours_only else "ill_conditioned"
        what = "output" if worst == 0 else f"output {worst} (buffers, then gradients of x, residual, parameters)"
        tf32 = f", TF32 operands' {tf32_err:.3g}" if case.tf32 else ""
        cuda_bias = f", with CUDA's conv bias {bias_err:.3g}" if bias_err is not None else ""
        result.finding = (f"{what}: error {result.err:.3g}, eager's {result.eager_err:.3g}, "
                          f"Inductor's {result.inductor_err:.3g}{tf32}{cuda_bias}{again}")
    if fused and len(fused) == 1 and fused[0].stop == "end of the graph" and not refused:
        result.fusion = "full"
    elif fused:
        result.fusion = "partial"
        result.reason = fused[0].stop if fused[0].stop != "end of the graph" else refused[0].reason
    else:
        result.fusion = "none"
        result.reason = refused[0].reason if refused else "no candidate chain"
    return result


def _innermost(err: BaseException) -> BaseException:
    """The exception at the bottom of a chain (Dynamo wraps the model's own in its own)."""
    seen = {id(err)}
    while True:
        inner = err.__cause__ or err.__context__
        if inner is None or id(inner) in seen:
            return err
        seen.add(id(inner))
        err = inner


def _rejected(result: Result, eager_err: Exception, model, x, residual, upstream) -> Result:
    """A model eager refuses to run: fusedepi must refuse it too, with the same exception
    (type and message) at the bottom of whatever Dynamo wraps it in."""
    from fusion_backend import fusedepi

    torch._dynamo.reset()
    try:
        _outputs(model, torch.compile(model, backend=fusedepi), x, residual, upstream)
    except Exception as err:
        inner = _innermost(err)
        if type(inner) is type(eager_err) and str(eager_err) == str(inner):
            result.check, result.reason = "rejected", f"{type(eager_err).__name__}: {str(eager_err)[:200]}"
            return result
        result.finding = f"eager raises {type(eager_err).__name__}, fusedepi {type(inner).__name__}: {str(inner)[:200]}"
    else:
        if _missing_dtype_kernel(eager_err) and _inductor_runs(model, x, residual, upstream):
            # Eager's kernel for this device lacks the dtype (bf16 avg_pool3d on the CPU);
            # Inductor's own code runs the op, with or without fusedepi.
            result.check = "rejected"
            result.reason = f"eager lacks a kernel, Inductor runs it: {str(eager_err)[:150]}"
            return result
        result.finding = f"eager raises {type(eager_err).__name__}: {str(eager_err)[:200]}; fusedepi runs"
    result.check = "error"
    return result


def _missing_dtype_kernel(err: Exception) -> bool:
    return isinstance(err, NotImplementedError) and "not implemented for" in str(err)


def _inductor_runs(model, x, residual, upstream) -> bool:
    torch._dynamo.reset()
    try:
        _outputs(model, torch.compile(model), x, residual, upstream)
    except Exception:  # noqa: BLE001 - Inductor refuses it too
        return False
    finally:
        torch._dynamo.reset()
    return True


# ------------------------------------------------------------------- driving


def _setup_worker(device: str):
    import conv_plan

    conv_plan.apply_from_env()  # conv_sm90's constants for the run (FUSEDEPI_TEST_CONV_PLAN)
    torch.set_float32_matmul_precision("highest")  # float32 means float32: no TF32
    torch.backends.cudnn.allow_tf32 = False
    # Every chain the matcher takes runs fused (the kernels are what is checked and
    # timed), not only those measured faster than Inductor.
    os.environ.setdefault("FUSEDEPI_AUTOTUNE", "off")
    if device == "cpu":
        os.environ["FUSEDEPI_CPU_REFERENCE"] = "1"
    import logging

    logging.getLogger("fusedepi").setLevel(logging.ERROR)  # refusals are counted, not printed


def _work(args):
    seed, index, device, grad, generation, gemm, implicit, dynamic = args
    return asdict(run_case(make_case(seed, index, device, generation, gemm, implicit), device, grad,
                           dynamic=dynamic))


def normalize_reason(reason: str) -> str:
    """A refusal reason without node names and numbers, for counting."""
    reason = re.sub(r"\b[a-z_]+_\d+\b", "<node>", reason)
    reason = re.sub(r"\(([a-z_0-9]+(, )?)+\)", "(<nodes>)", reason)
    return re.sub(r"-?\d+(\.\d+)?(e-?\d+)?", "#", reason)[:110]


def summarize(results: list[dict]) -> dict:
    """Counts: models tried, fused, partial, refused by reason, mismatches, errors."""
    fusion = collections.Counter(r["fusion"] for r in results if r["check"] not in ("error", "rejected"))
    checks = collections.Counter(r["check"] for r in results)
    # A model eager refuses to run has nothing to fuse: it is counted under checks only.
    inside = [r for r in results if r["in_vocabulary"] and r["check"] != "rejected"]
    inside_fused = sum(r["fusion"] == "full" for r in inside)
    reasons = collections.Counter(normalize_reason(r["reason"]) for r in results if r["fusion"] in ("partial", "none"))
    return {
        "models": len(results),
        "fusion": dict(fusion),
        "checks": dict(checks),
        "in_vocabulary": len(inside),
        "in_vocabulary_fully_fused": inside_fused,
        "in_vocabulary_fused_share": inside_fused / len(inside) if inside else 0.0,
        "any_fusion": fusion["full"] + fusion["partial"],
        "in_kernel_gemm": sum(r.get("in_kernel", False) for r in results),
        "in_kernel_gemm_float32": sum(r.get("in_kernel", False) and r["dtype"] == "float32" for r in results),
        "in_kernel_conv": sum(r.get("in_kernel_conv", False) for r in results),
        "dynamic_batch_ran": sum(r.get("dynamic_batch") == "ran" for r in results),
        "reasons": dict(reasons.most_common()),
        "findings": [r for r in results if r["check"] in ("mismatch", "error")],
    }


def run(seed: int, indices, device: str, workers: int = 1, progress=None, time_limit=None,
        grad: bool = False, generation: int = 1, gemm: bool = False, implicit: bool = False,
        dynamic: bool = False) -> list[dict]:
    """Runs the cases `indices` of `seed`; returns their results (as dicts), in index order.

    Args:
        grad: also run backward and check the gradients (`run_case`).
        workers: processes, each compiling its own models (kernel builds run in parallel).
        progress: print a progress line every this many models, and each finding as it comes.
        time_limit: seconds; models not finished by then are left out (the count says so).
        generation: the generator's vocabulary (`make_case`).
        gemm: draw the in-kernel GEMM's anchors and run them with it (`make_case`).
        implicit: the same for the in-kernel conv.
        dynamic: check the graph compiled once the batch size has changed (`run_case`).
    """
    jobs = [(seed, i, device, grad, generation, gemm, implicit, dynamic) for i in indices]
    results = []
    start = time.time()
    import multiprocessing

    if workers <= 1:
        _setup_worker(device)
        it = map(_work, jobs)
        pool = None
    else:
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_setup_worker, initargs=(device,))
        it = pool.imap_unordered(_work, jobs)
    try:
        for n in range(1, len(jobs) + 1):
            # The limit holds while a model hangs too (a worker that never returns).
            left = None if time_limit is None else max(0.0, time_limit - (time.time() - start))
            try:
                res = it.next(timeout=left) if pool is not None else next(it)
            except multiprocessing.TimeoutError:
                done = {r["index"] for r in results}
                unfinished = [j[1] for j in jobs if j[1] not in done]
                print(f"[fuzz] time limit: stopping after {n - 1} of {len(jobs)} models; unfinished (running or "
                      f"not started): {unfinished}", flush=True)
                break
            results.append(res)
            if progress and res["check"] in ("mismatch", "error"):
                print("FINDING", json.dumps(res), flush=True)
            if progress and (n % progress == 0 or n == len(jobs)):
                bad = sum(r["check"] in ("mismatch", "error") for r in results)
                print(f"[fuzz] {n}/{len(jobs)} models, {bad} findings, {time.time() - start:.0f} s", flush=True)
            if time_limit is not None and time.time() - start > time_limit:
                print(f"[fuzz] time limit: stopping after {n} of {len(jobs)} models", flush=True)
                break
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return sorted(results, key=lambda r: r["index"])


# ------------------------------------------------------------------ benchmark

BENCH_BYTES = 1 << 30  # anchor input + output of a scaled model: GPU time well above a call's CPU time
BENCH_ROWS = 8192  # at least this many rows of a linear model's input
BENCH_IMAGES = 32  # at least this many images of a conv model's input


def scale_case(case: Case, nbytes: int = BENCH_BYTES) -> Case:
    """The same model with a batch that makes its anchor's input and output about `nbytes`
    (at least BENCH_ROWS rows or BENCH_IMAGES images), so that a call's time is GPU work,
    not launch overhead."""
    anchor = dict(case.anchor)
    size = getattr(torch, case.dtype).itemsize
    if anchor["kind"] == "linear":
        rows = max(BENCH_ROWS, nbytes // ((anchor["in"] + anchor["out"]) * size) // 64 * 64)
        anchor["lead"] = [rows] if len(anchor["lead"]) == 1 else [rows // 64, 64]
    else:
        per_image = math.prod(FuzzModel(case).value_shape[1:]) + anchor["in"] * math.prod(anchor["spatial"])
        if anchor["kind"] == "bmm":  # a batch entry's product [M, N], x [M, K] and weight [K, N]
            per_image = (anchor["out"] + anchor["in"]) * anchor["spatial"][0] + anchor["in"] * anchor["out"]
        anchor["batch"] = max(BENCH_IMAGES, nbytes // (per_image * size))
        anchor["batch"] -= anchor["batch"] % anchor.get("heads", 1)  # whole heads
    return Case(case.index, case.seed, anchor, case.steps, case.dtype, case.training, case.in_vocabulary,
                case.generation, case.gemm, case.tf32, case.implicit)


def cpu_us(fn, calls: int = 200) -> float:
    """Microseconds of CPU a call of `fn` takes to issue its work (the GPU catches up after)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def device_profile(fn, calls: int = 20) -> tuple[float, int, list[str]]:
    """(GPU microseconds a call, kernel launches a call, "<us a call> <name>" of each kernel) of `fn`."""
    from benchmarks.compare import kernel_times

    kernels = kernel_times(fn, calls)
    return (sum(ms for ms, _, _ in kernels) * 1000, sum(n for _, n, _ in kernels),
            [f"{ms * 1000:.1f} us {name[:60]}" for ms, _, name in sorted(kernels, reverse=True)])


def _distribution(ratios: list[float]) -> dict:
    ratios = sorted(ratios)
    if not ratios:
        return {"models": 0}
    return {
        "models": len(ratios),
        "min": ratios[0],
        "p10": ratios[len(ratios) // 10],
        "median": ratios[len(ratios) // 2],
        "max": ratios[-1],
        "geomean": math.exp(sum(math.log(r) for r in ratios) / len(ratios)),
        "slower_than_inductor": sum(r < 1.0 for r in ratios),
    }


def bench(seed: int, count: int, first: int = 0, progress: bool = True, mode: str | None = None,
          profile: bool = False, nbytes: int = BENCH_BYTES) -> dict:
    """Times `count` random models that fusedepi fuses whole (on CUDA), against Inductor.

    Models are scaled with `scale_case` (to `nbytes`; 0 keeps the minimum batch, where
    most models are bound by a call's CPU time); out-of-vocabulary and partly fused
    ones are skipped. `mode` is torch.compile's, for both backends ("reduce-overhead":
    CUDA graphs, which take the per-call CPU cost out). With `profile`, each row also
    has, per backend, the GPU time and kernel launches of a call (torch.profiler) and
    the CPU time a call takes to issue them: which of the two bounds the model; the
    summary then has the distribution of the GPU-time ratios too. A model that fails to
    compile or run under either backend is listed under "errors", with its message.
    Returns the rows, the errors and the distribution of Inductor ms / fusedepi ms.
    """
    from triton.testing import do_bench

    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports

    _setup_worker("cuda")
    rows, errors, index = [], [], first
    while len(rows) + len(errors) < count:
        case = scale_case(make_case(seed, index, "cuda"), nbytes)
        index += 1
        if not case.in_vocabulary or "dropout_train" in [s["op"] for s in case.steps]:
            continue
        dtype = getattr(torch, case.dtype)
        times, kernel = {}, ""
        try:
            base = FuzzModel(case).train(case.training)
            x, residual = make_inputs(case, base, "cuda", on_device=True)
            with torch.no_grad():
                for backend in ("fusedepi", "inductor"):
                    model = copy.deepcopy(base).to(device="cuda", dtype=dtype)
                    torch._dynamo.reset()
                    reports: list = []
                    with collect_reports(reports):
                        fn = torch.compile(model, backend=fusedepi if backend == "fusedepi" else "inductor",
                                           mode=mode)
                        for _ in range(3):  # CUDA graphs record on the second call
                            fn(x, residual)
                    if backend == "fusedepi":
                        records = _records(reports)
                        fused = [r for r in records if r.status == "fused"]
                        if len(fused) != 1 or fused[0].stop != "end of the graph" or len(records) != 1:
                            break
                        kernel = fused[0].kernel
                    times[backend] = do_bench(lambda: fn(x, residual), warmup=25, rep=200, return_mode="median")
                    if profile:
                        gpu_us, launches, names = device_profile(lambda: fn(x, residual))
                        times[backend + "_profile"] = {"gpu_us": gpu_us, "launches": launches, "kernels": names,
                                                       "cpu_us": cpu_us(lambda: fn(x, residual))}
        except Exception as err:  # noqa: BLE001 - reported, and the run goes on
            message = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
            errors.append({"index": case.index, "dtype": case.dtype, "anchor": case.anchor, "kernel": kernel,
                           "steps": [s["op"] for s in case.steps], "error": message[:300]})
            if progress:
                print(f"[bench] model {case.index} {case.dtype} {kernel}: ERROR {message[:300]}", flush=True)
            continue
        finally:
            fn = model = x = residual = None
            torch.cuda.empty_cache()
        if "inductor" not in times:
            continue
        a = case.anchor
        row = {"index": case.index, "dtype": case.dtype, "anchor": a["kind"], "kernel": kernel,
               "batch": a["lead"] if a["kind"] == "linear" else a["batch"],
               "steps": [s["op"] for s in case.steps], "training": case.training,
               "fusedepi_ms": times["fusedepi"], "inductor_ms": times["inductor"],
               "ratio": times["inductor"] / times["fusedepi"]}
        if profile:
            row["fusedepi_profile"], row["inductor_profile"] = times["fusedepi_profile"], times["inductor_profile"]
            row["gpu_ratio"] = row["inductor_profile"]["gpu_us"] / max(row["fusedepi_profile"]["gpu_us"], 1e-9)
        rows.append(row)
        if progress:
            print(f"[bench] {len(rows)}/{count} model {case.index} {case.dtype} {kernel}: "
                  f"fusedepi {row['fusedepi_ms']:.4f} ms, Inductor {row['inductor_ms']:.4f} ms, "
                  f"ratio {row['ratio']:.2f}", flush=True)
            if profile:
                for backend in ("fusedepi", "inductor"):
                    p = row[backend + "_profile"]
                    print(f"    {backend:9s} GPU {p['gpu_us']:7.1f} us in {p['launches']} launches, "
                          f"CPU {p['cpu_us']:6.1f} us a call: {', '.join(p['kernels'])}", flush=True)
    summary = _distribution([r["ratio"] for r in rows])
    summary["errors"] = len(errors)
    if profile:
        summary["gpu_time"] = _distribution([r["gpu_ratio"] for r in rows])
    return {"rows": rows, "errors": errors, "summary": summary}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--models", type=int, default=300)
    parser.add_argument("--first", type=int, default=0, help="index of the first model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", type=int, nargs="*", help="run just these model indices, and show them")
    parser.add_argument("--workers", type=int, default=1, help="processes (each compiles its own models)")
    parser.add_argument("--json", help="write every result and the summary here")
    parser.add_argument("--time-limit", type=float, help="seconds; stop there and report what finished")
    parser.add_argument("--bench", type=int, metavar="N",
                        help="instead: time N wholly fused models (scaled up) against Inductor, CUDA only")
    parser.add_argument("--mode", help="torch.compile mode for --bench, e.g. reduce-overhead")
    parser.add_argument("--profile", action="store_true",
                        help="with --bench: each model's GPU time, launches and CPU time a call, per backend")
    parser.add_argument("--bench-bytes", type=int, default=BENCH_BYTES,
                        help="with --bench: scale each model's anchor input + output to about this many bytes "
                             "(0: the minimum batch, where a call's CPU time dominates)")
    parser.add_argument("--grad", action="store_true", help="also run backward and check the gradients")
    parser.add_argument("--dynamic-batch", action="store_true",
                        help="check the graph compiled after a call at another batch size (a symbolic batch)")
    parser.add_argument("--generation", type=int, choices=sorted(CONV_NORMS), default=1,
                        help="the generator's vocabulary: 2 also draws InstanceNorm after convs")
    parser.add_argument("--in-kernel-gemm", action="store_true",
                        help="draw Linear anchors of the in-kernel GEMM's shapes (bf16, fp16, float32 in TF32), "
                             "run with FUSEDEPI_IN_KERNEL_GEMM=1")
    parser.add_argument("--in-kernel-conv", action="store_true",
                        help="draw 2-D conv anchors of the in-kernel conv's shapes (bf16, fp16, float32 with cuDNN's "
                             "TF32), run with FUSEDEPI_IN_KERNEL_CONV=1")
    args = parser.parse_args(argv)
    if args.bench:
        out = bench(args.seed, args.bench, args.first, mode=args.mode, profile=args.profile,
                    nbytes=args.bench_bytes)
        print(json.dumps(out["summary"], indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
        return 0
    indices = args.only if args.only else range(args.first, args.first + args.models)
    if args.only:
        for i in indices:
            print(json.dumps(asdict(make_case(args.seed, i, args.device, args.generation, args.in_kernel_gemm,
                                              args.in_kernel_conv))))
    results = run(args.seed, indices, args.device, args.workers, progress=max(1, len(indices) // 20),
                  time_limit=args.time_limit, grad=args.grad, generation=args.generation, gemm=args.in_kernel_gemm,
                  implicit=args.in_kernel_conv, dynamic=args.dynamic_batch)
    summary = summarize(results)
    print(json.dumps({k: v for k, v in summary.items() if k != "findings"}, indent=1))
    print(f"{len(summary['findings'])} findings (printed above as they came)")
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "device": args.device, "grad": args.grad,
                                               "generation": args.generation,
                                               "in_kernel_gemm": args.in_kernel_gemm,
                                               "in_kernel_conv": args.in_kernel_conv,
                                               "dynamic_batch": args.dynamic_batch,
                                               "summary": summary,
                                               "results": results}, indent=1))
    return 1 if summary["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
