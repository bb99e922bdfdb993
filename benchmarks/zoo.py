"""The model zoo: models of the kind users write (a matmul or convolution followed by a
chain), fusedepi against Inductor, each as a user runs it.

Every model is built fresh (training mode), run under `torch.no_grad()`, at float32 with
torch's default precision settings (cuDNN may use TF32; matmuls are "highest") and at
bf16. Per model it prints Inductor's ms, fusedepi's ms, their ratio (Inductor / fusedepi:
above 1 is faster) as a user's loop sees them (wall: both compiles timed in turns,
`interleaved_ms`), the same for GPU time alone (replays of a CUDA graph of one call,
in turns: `timings.compare_ms`), the host's launches of a call of each (`timings.host_ms`,
as the whole-graph check times them), what fused and what the measured choice found; then
a summary of both ratios.

    python -m benchmarks.zoo --list                 # one model name per line
    python -m benchmarks.zoo --quick                # 8 models, float32 and bf16
    python -m benchmarks.zoo --models conv2d_bn_relu linear_ln_relu --dtypes bfloat16
    python -m benchmarks.zoo --warm 12 --json zoo.json   # build kernels in 12 processes first
    python -m benchmarks.zoo --models linear_hardtanh --profile   # and each backend's GPU kernels
    python -m benchmarks.zoo --table zoo_a.json zoo_b.json   # RESULTS.md's tables from --json files
    python -m benchmarks.zoo --chains               # where each model's chains stop, nothing timed
    python -m benchmarks.zoo --chains --plan WINDOW_BOX=True   # and the in-kernel tilings it changes
    python -m benchmarks.zoo --gpus 4 --warm 32 --json zoo.json   # the timed pass on 4 GPUs at once

`--warm N` first compiles every selected model with both backends in N processes
(FUSEDEPI_AUTOTUNE=off there: nothing is timed; each process compiles Inductor's
kernels in one thread, TORCHINDUCTOR_COMPILE_THREADS=1, and runs torch's CPU ops in one,
since the processes are the parallelism; with --gpus N they take the N GPUs in turn), so
that the timed pass finds nvcc's and Inductor's caches warm, and prints a line as each
compile ends; the timed pass runs one model at a time on a GPU. `--gpus N` runs the
timed pass in N processes, one a GPU of this machine, each on every N-th model, and
merges their rows; one model still runs alone on its GPU. `--json` is rewritten after every model ("complete": false
until the last; with --gpus, when the processes end or the run is stopped), so a run
stopped at a time limit leaves the rows it finished; `--table` says so of such a file.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

DTYPES = ("float32", "bfloat16")


class Seq(nn.Module):
    """An anchor module followed by `tail(y, self)`; extra parameters by name."""

    def __init__(self, anchor: nn.Module, tail: Callable, **extra):
        super().__init__()
        self.anchor, self.tail = anchor, tail
        for name, value in extra.items():
            setattr(self, name, value)

    def forward(self, x):
        return self.tail(self.anchor(x), self)


def _p(*shape):
    return nn.Parameter(torch.randn(*shape) * 0.1 + 1.0)


def gelu_erf_spelled(y):
    """BERT's GELU, written out."""
    return y * 0.5 * (1.0 + torch.erf(y / math.sqrt(2.0)))


def gelu_new(y):
    """GPT-2's GELU (Hugging Face's `gelu_new`): the tanh form, written out with a cube."""
    return 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))


def _hardswish_spelled(y):
    return y * torch.clamp((y + 3) / 6, 0, 1)


class ResidualLinearNorm(nn.Module):
    """x + Linear(x) -> LayerNorm (a transformer block's tail)."""

    def __init__(self, d):
        super().__init__()
        self.linear, self.norm = nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.linear(x))


class TwoLinears(nn.Module):
    """Linear -> sigmoid -> Linear -> logsumexp: one chain's result is the next one's input."""

    def __init__(self, k, hidden, n):
        super().__init__()
        self.a, self.b = nn.Linear(k, hidden), nn.Linear(hidden, n)

    def forward(self, x):
        return torch.logsumexp(self.b(torch.sigmoid(self.a(x))), dim=1)


class ScoresSoftmax(nn.Module):
    """Attention scores: bmm(q, k^T) * scale -> softmax."""

    def __init__(self, d):
        super().__init__()
        self.q, self.scale = nn.Linear(d, d), d ** -0.5

    def forward(self, x):
        q = self.q(x)
        return torch.softmax(torch.bmm(q, x.transpose(1, 2)) * self.scale, dim=-1)


class AlibiScoresSoftmax(nn.Module):
    """Attention scores as BLOOM computes them: baddbmm(alibi, q, k^T, alpha=scale) with a
    per-(head, key) linear bias alibi[B*heads, 1, L], then softmax."""

    def __init__(self, d, length):
        super().__init__()
        self.q, self.scale = nn.Linear(d, d), d ** -0.5
        self.register_buffer("alibi", -torch.linspace(0, 1, length).view(1, 1, length))

    def forward(self, x):
        q = self.q(x)
        alibi = self.alibi.expand(x.shape[0], 1, -1)
        return torch.softmax(torch.baddbmm(alibi, q, x.transpose(1, 2), alpha=self.scale), dim=-1)


class ScoresBiasSoftmax(nn.Module):
    """Attention scores with a learned bias per (query, key) position (Swin, T5): bmm(q,
    k^T) * scale + bias[L, L] -> softmax."""

    def __init__(self, d, length):
        super().__init__()
        self.q, self.scale = nn.Linear(d, d), d ** -0.5
        self.bias = nn.Parameter(torch.randn(length, length) * 0.1)

    def forward(self, x):
        q = self.q(x)
        return torch.softmax(torch.bmm(q, x.transpose(1, 2)) * self.scale + self.bias, dim=-1)


class ChannelMix(nn.Module):
    """A channel-mixing weight shared by the batch: bmm(w[C, C] expanded to [B, C, C], x[B, C, L])."""

    def __init__(self, c):
        super().__init__()
        self.w = nn.Parameter(torch.randn(c, c) / math.sqrt(c))

    def forward(self, x):
        return torch.bmm(self.w.expand(x.shape[0], -1, -1), x)


class AttendNorm(nn.Module):
    """Self-attention without projections: softmax(x x^T * scale) x -> LayerNorm -> GELU
    (two bmm chains: scaled softmax over the scores' rows, LayerNorm over the features)."""

    def __init__(self, d):
        super().__init__()
        self.scale, self.ln = d ** -0.5, nn.LayerNorm(d)

    def forward(self, x):
        scores = torch.softmax(torch.bmm(x, x.transpose(1, 2)) * self.scale, dim=-1)
        return F.gelu(self.ln(torch.bmm(scores, x)))


class BasicBlock(nn.Module):
    """ResNet's basic block: conv-BN-ReLU, conv-BN, + the input, ReLU."""

    def __init__(self, c):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.b2(self.c2(F.relu(self.b1(self.c1(x))))) + x)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1x1 expand-BN-ReLU6, 3x3 depthwise-BN-ReLU6, 1x1 project-BN, + input."""

    def __init__(self, c, expand):
        super().__init__()
        e = c * expand
        self.a, self.bna = nn.Conv2d(c, e, 1, bias=False), nn.BatchNorm2d(e)
        self.b, self.bnb = nn.Conv2d(e, e, 3, padding=1, groups=e, bias=False), nn.BatchNorm2d(e)
        self.c, self.bnc = nn.Conv2d(e, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu6(self.bnb(self.b(F.relu6(self.bna(self.a(x))))))
        return x + self.bnc(self.c(y))


class SqueezeExcite(nn.Module):
    """conv-BN-ReLU, then squeeze-and-excitation: the channels scaled by a gate computed
    from their means (two Linears)."""

    def __init__(self, c):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.fc1, self.fc2 = nn.Linear(c, c // 4), nn.Linear(c // 4, c)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        gate = torch.sigmoid(self.fc2(F.relu(self.fc1(y.mean((2, 3))))))
        return y * gate[:, :, None, None]


class PreActivationConv(nn.Module):
    """A pre-activation ResNet's conv (ResNet v2, BigGAN and UNet blocks): ReLU of the
    input, the conv, then ReLU and a per-channel bias. Its input is made by a kernel of
    Inductor's, not read from the caller."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv, self.b = nn.Conv2d(cin, cout, 3), _p(cout, 1, 1)

    def forward(self, x):
        return F.relu(self.conv(F.relu(x))) + self.b


class TimeEmbeddingResBlock(nn.Module):
    """A diffusion UNet's ResBlock half: conv, + a per-image time embedding (a Linear of
    a per-image vector, here the input's channel means), GroupNorm, SiLU."""

    def __init__(self, c, groups):
        super().__init__()
        self.conv, self.temb, self.norm = nn.Conv2d(c, c, 3, padding=1), nn.Linear(c, c), nn.GroupNorm(groups, c)

    def forward(self, x):
        t = self.temb(F.silu(x.mean((2, 3))))
        return F.silu(self.norm(self.conv(x) + t[:, :, None, None]))


class AdaGroupNormBlock(nn.Module):
    """A diffusion UNet's conditioned norm (AdaGN / FiLM): conv, GroupNorm, then a scale
    and shift per (image, channel) from a Linear of a per-image vector (here the input's
    channel means), SiLU."""

    def __init__(self, c, groups):
        super().__init__()
        self.conv, self.emb, self.norm = nn.Conv2d(c, c, 3, padding=1), nn.Linear(c, 2 * c), nn.GroupNorm(groups, c)

    def forward(self, x):
        scale, shift = self.emb(F.silu(x.mean((2, 3)))).chunk(2, dim=1)
        h = self.norm(self.conv(x)) * (1 + scale[:, :, None, None]) + shift[:, :, None, None]
        return F.silu(h)


class PatchEmbedding(nn.Module):
    """A ViT's patch embedding on flattened patches: Linear, + a position embedding
    [1, S, D], LayerNorm."""

    def __init__(self, patch, d, length):
        super().__init__()
        self.proj, self.norm = nn.Linear(patch, d), nn.LayerNorm(d)
        self.pos = nn.Parameter(torch.randn(1, length, d) * 0.02)

    def forward(self, x):
        return self.norm(self.proj(x) + self.pos)


class PatchifyStem(nn.Module):
    """ConvNeXt's stem: a 4 x 4 conv of stride 4, then LayerNorm over the channels in
    timm's LayerNorm2d form (channels moved last, normalized, moved back)."""

    def __init__(self, cin, c):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(cin, c, 4, stride=4), nn.LayerNorm(c)

    def forward(self, x):
        return self.norm(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: 7x7 depthwise conv, channels last, LayerNorm, Linear 4x, GELU,
    Linear back, channels first, + input."""

    def __init__(self, c):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.ln, self.fc1, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(self.ln(self.dw(x).permute(0, 2, 3, 1)))))
        return x + y.permute(0, 3, 1, 2)


class DiTMlpHalf(nn.Module):
    """A DiT block's MLP half: LayerNorm (no affine) modulated by a shift and scale, the
    MLP (tanh GELU), its output times a gate, + the input; shift, scale and gate per sample
    from a conditioning vector through SiLU and a Linear (adaLN), here the tokens' mean
    (DiT's is the timestep's and class's embedding)."""

    def __init__(self, d, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.fc1, self.fc2, self.ada = nn.Linear(d, hidden), nn.Linear(hidden, d), nn.Linear(d, 3 * d)

    def forward(self, x):
        shift, scale, gate = self.ada(F.silu(x.mean(1))).chunk(3, dim=-1)
        h = self.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        return x + gate.unsqueeze(1) * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


@dataclass(frozen=True)
class ZooModel:
    name: str
    make: Callable[[], nn.Module]
    shape: tuple  # the input's shape


class BertLayerNorm(nn.Module):
    """LayerNorm over the last dim written out, as older BERT code has it."""

    def __init__(self, n, eps=1e-12):
        super().__init__()
        self.weight, self.bias, self.eps = nn.Parameter(torch.ones(n)), nn.Parameter(torch.zeros(n)), eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        return self.weight * ((x - u) / torch.sqrt(s + self.eps)) + self.bias


def softmax_spelled(y, dim):
    """Softmax over `dim` written out, the maximum subtracted."""
    e = torch.exp(y - torch.max(y, dim=dim, keepdim=True)[0])
    return e / torch.sum(e, dim=dim, keepdim=True)


def _conv(cin, cout, k=3, **kw):
    return nn.Conv2d(cin, cout, k, **kw)


MODELS = [
    # 2-D convolutions, few channels on large images
    ZooModel("conv2d_relu", lambda: Seq(_conv(3, 16, padding=1), lambda y, m: F.relu(y)), (32, 3, 256, 256)),
    ZooModel("conv2d_bn_relu", lambda: Seq(_conv(16, 32, padding=1), lambda y, m: F.relu(m.bn(y)), bn=nn.BatchNorm2d(32)),
             (32, 16, 128, 128)),
    ZooModel("conv2d_gn_silu", lambda: Seq(_conv(32, 64, padding=1), lambda y, m: F.silu(m.gn(y)),
                                           gn=nn.GroupNorm(8, 64)), (16, 32, 64, 64)),
    ZooModel("conv2d_bias_scale_sigmoid_gn", lambda: Seq(
        _conv(8, 32), lambda y, m: m.gn(torch.sigmoid((y + m.b) * m.s)), b=_p(32, 1, 1), s=_p(32, 1, 1),
        gn=nn.GroupNorm(8, 32)), (32, 8, 128, 128)),
    ZooModel("conv2d_relu_bias", lambda: Seq(_conv(64, 128), lambda y, m: F.relu(y) + m.b, b=_p(128, 1, 1)),
             (32, 64, 64, 64)),
    ZooModel("conv2d_wide_relu_bias", lambda: Seq(_conv(64, 128), lambda y, m: F.relu(y) + m.b, b=_p(128, 1, 1)),
             (128, 64, 128, 128)),  # a 1.04 GB float32 conv output
    ZooModel("preactivation_conv_relu_bias", lambda: PreActivationConv(64, 128), (32, 64, 64, 64)),
    ZooModel("conv2d_relu_hardswish_spelled", lambda: Seq(_conv(8, 64), lambda y, m: _hardswish_spelled(F.relu(y))),
             (32, 8, 128, 128)),
    ZooModel("conv2d_mish_spelled_bn", lambda: Seq(
        _conv(16, 32), lambda y, m: m.bn(y * torch.tanh(F.softplus(y))), bn=nn.BatchNorm2d(32)), (32, 16, 96, 96)),
    ZooModel("conv2d_instancenorm_leaky", lambda: Seq(
        _conv(16, 32), lambda y, m: F.leaky_relu(m.norm(y), 0.2), norm=nn.InstanceNorm2d(32)), (32, 16, 96, 96)),
    ZooModel("conv2d_stride2_bn_relu6", lambda: Seq(
        _conv(32, 64, stride=2, padding=1), lambda y, m: F.relu6(m.bn(y)), bn=nn.BatchNorm2d(64)), (32, 32, 128, 128)),
    ZooModel("conv2d_1x1_bn_silu", lambda: Seq(_conv(64, 128, 1), lambda y, m: F.silu(m.bn(y)), bn=nn.BatchNorm2d(128)),
             (32, 64, 56, 56)),
    # a ResNet-50 bottleneck's 1 x 1 reduction of 256 channels to 64 (no conv bias), BatchNorm, ReLU
    ZooModel("resnet_bottleneck_reduce_1x1", lambda: Seq(
        nn.Conv2d(256, 64, 1, bias=False), lambda y, m: F.relu(m.bn(y)), bn=nn.BatchNorm2d(64)), (32, 256, 56, 56)),
    # downsampling by a stride of 2: a ResNet stage's first conv, a diffusion UNet's down block
    ZooModel("resnet_downsample_bn_relu", lambda: Seq(
        _conv(64, 128, stride=2, padding=1), lambda y, m: F.relu(m.bn(y)), bn=nn.BatchNorm2d(128)), (32, 64, 56, 56)),
    # torchvision's ResNet stem (7 x 7, stride 2, RGB in, no bias), before its max pool
    ZooModel("resnet_stem_bn_relu", lambda: Seq(
        _conv(3, 64, 7, stride=2, padding=3, bias=False), lambda y, m: F.relu(m.bn(y)), bn=nn.BatchNorm2d(64)),
        (32, 3, 224, 224)),
    ZooModel("unet_downsample_gn_silu", lambda: Seq(
        _conv(128, 128, stride=2, padding=1), lambda y, m: F.silu(m.gn(y)), gn=nn.GroupNorm(32, 128)),
        (16, 128, 64, 64)),
    # PReLU: face recognition (ArcFace's iResNet: BN, conv, BN, PReLU a channel) and
    # super-resolution feature layers (ESPCN, SRGAN: one slope)
    ZooModel("conv2d_bn_prelu", lambda: Seq(
        _conv(64, 64, padding=1), lambda y, m: m.act(m.bn(y)), bn=nn.BatchNorm2d(64), act=nn.PReLU(64)),
        (32, 64, 56, 56)),
    ZooModel("conv2d_5x5_prelu", lambda: Seq(_conv(3, 64, 5, padding=2), lambda y, m: m.act(y), act=nn.PReLU()),
             (16, 3, 128, 128)),
    ZooModel("conv2d_dilated_gelu", lambda: Seq(_conv(16, 16, dilation=2, padding=2), lambda y, m: F.gelu(y)),
             (32, 16, 128, 128)),
    ZooModel("conv2d_depthwise_bn_relu", lambda: Seq(
        _conv(64, 64, groups=64, padding=1), lambda y, m: F.relu(m.bn(y)), bn=nn.BatchNorm2d(64)), (32, 64, 64, 64)),
    ZooModel("conv2d_gn_gelu_global_mean", lambda: Seq(
        _conv(16, 64), lambda y, m: F.gelu(m.gn(y)).mean(dim=(2, 3)), gn=nn.GroupNorm(16, 64)), (32, 16, 64, 64)),
    ZooModel("conv2d_gn_silu_global_max", lambda: Seq(
        _conv(64, 128, padding=1), lambda y, m: torch.amax(F.silu(m.gn(y)), dim=(2, 3)), gn=nn.GroupNorm(32, 128)),
        (32, 64, 32, 32)),
    # heads: global average pooling before a classifier, per-pixel classes of a segmentation net
    ZooModel("resnet_head_bn_relu_avgpool", lambda: Seq(
        _conv(256, 512, padding=1), lambda y, m: F.adaptive_avg_pool2d(F.relu(m.bn(y)), 1).flatten(1),
        bn=nn.BatchNorm2d(512)), (64, 256, 7, 7)),
    ZooModel("conv2d_relu_global_avgpool", lambda: Seq(
        _conv(64, 128, padding=1), lambda y, m: F.adaptive_avg_pool2d(F.relu(y), 1).flatten(1)), (32, 64, 28, 28)),
    ZooModel("conv2d_1x1_log_softmax_classes", lambda: Seq(_conv(64, 21, 1), lambda y, m: F.log_softmax(y, dim=1)),
             (16, 64, 64, 64)),
    ZooModel("conv2d_relu_maxpool", lambda: Seq(_conv(16, 32, padding=1), lambda y, m: F.max_pool2d(F.relu(y), 2)),
             (32, 16, 128, 128)),
    ZooModel("conv2d_tanh_avgpool", lambda: Seq(_conv(16, 32, padding=1), lambda y, m: F.avg_pool2d(torch.tanh(y), 2)),
             (32, 16, 128, 128)),
    ZooModel("conv2d_softmax_channels", lambda: Seq(_conv(16, 32), lambda y, m: torch.softmax(y, dim=1)),
             (32, 16, 96, 96)),
    ZooModel("conv2d_min_channels_tanh", lambda: Seq(
        _conv(16, 32), lambda y, m: torch.tanh(torch.min(y, dim=1, keepdim=True).values)), (32, 16, 96, 96)),
    ZooModel("conv2d_min_cpu_scalar_bias", lambda: Seq(
        _conv(64, 128), lambda y, m: (torch.min(y, torch.tensor(0.5)) + m.b) * 2.0, b=_p(128, 1, 1)),
        (16, 64, 64, 64)),
    ZooModel("conv2d_residual_relu", lambda: Seq(_conv(32, 32, padding=1), lambda y, m: F.relu(y + m.scale * y),
                                                 scale=_p(32, 1, 1)), (32, 32, 96, 96)),
    ZooModel("conv2d_hardtanh_sub_tanh", lambda: Seq(
        _conv(8, 32), lambda y, m: torch.tanh(F.hardtanh(y, -1, 1) - 0.5)), (64, 8, 128, 128)),
    # 3-D, 1-D and transposed convolutions
    ZooModel("conv3d_bn_relu", lambda: Seq(nn.Conv3d(4, 16, 3, padding=1), lambda y, m: F.relu(m.bn(y)),
                                           bn=nn.BatchNorm3d(16)), (8, 4, 32, 64, 64)),
    ZooModel("conv3d_gn_silu", lambda: Seq(nn.Conv3d(8, 16, 3), lambda y, m: F.silu(m.gn(y)), gn=nn.GroupNorm(4, 16)),
             (4, 8, 18, 66, 66)),
    ZooModel("conv3d_scale_sigmoid_bias", lambda: Seq(
        nn.Conv3d(3, 16, 3), lambda y, m: torch.sigmoid(y * m.s) + m.b, s=_p(16, 1, 1, 1), b=_p(16, 1, 1, 1)),
        (8, 3, 18, 66, 66)),
    # a 3-D UNet's residual block conv (MONAI, medical volumes) and a video ResNet's 3 x 3 x 3
    # conv (R3D-18's layer 2), of the widths those nets use
    ZooModel("unet3d_conv_gn_silu", lambda: Seq(nn.Conv3d(32, 32, 3, padding=1), lambda y, m: F.silu(m.gn(y)),
                                                gn=nn.GroupNorm(8, 32)), (2, 32, 32, 64, 64)),
    ZooModel("r3d_conv_bn_relu", lambda: Seq(nn.Conv3d(64, 128, 3, stride=(1, 2, 2), padding=1, bias=False),
                                             lambda y, m: F.relu(m.bn(y)), bn=nn.BatchNorm3d(128)),
             (4, 64, 8, 56, 56)),
    ZooModel("convtranspose2d_bn_relu", lambda: Seq(
        nn.ConvTranspose2d(32, 16, 4, stride=2, padding=1), lambda y, m: F.relu(m.bn(y)), bn=nn.BatchNorm2d(16)),
        (16, 32, 64, 64)),
    ZooModel("convtranspose2d_scale_mean", lambda: Seq(
        nn.ConvTranspose2d(64, 128, 3), lambda y, m: (y * 2.0).mean(dim=(2, 3), keepdim=True)), (16, 64, 64, 64)),
    ZooModel("convtranspose2d_gn_tanh", lambda: Seq(
        nn.ConvTranspose2d(16, 32, 3, stride=2), lambda y, m: torch.tanh(m.gn(y)), gn=nn.GroupNorm(8, 32)),
        (16, 16, 64, 64)),
    ZooModel("convtranspose3d_residual", lambda: Seq(
        nn.ConvTranspose3d(16, 8, 3, stride=2, padding=1), lambda y, m: (y + m.b) * y + y, b=_p(8, 1, 1, 1)),
        (4, 16, 16, 32, 32)),
    ZooModel("conv1d_bn_gelu", lambda: Seq(nn.Conv1d(64, 128, 5, padding=2), lambda y, m: F.gelu(m.bn(y)),
                                           bn=nn.BatchNorm1d(128)), (64, 64, 1024)),
    ZooModel("conv1d_relu_gn", lambda: Seq(nn.Conv1d(32, 64, 3), lambda y, m: m.gn(F.relu(y)), gn=nn.GroupNorm(8, 64)),
             (64, 32, 2048)),
    # a wav2vec 2.0 feature-encoder layer (stride 2, no bias), and Conv-TasNet's 1 x 1
    # bottleneck with PReLU and its global LayerNorm (GroupNorm of one group)
    ZooModel("wav2vec2_conv_layer_gelu", lambda: Seq(nn.Conv1d(512, 512, 3, stride=2, bias=False),
                                                     lambda y, m: F.gelu(y)), (8, 512, 3200)),
    ZooModel("convtasnet_1x1_prelu_gln", lambda: Seq(nn.Conv1d(128, 512, 1), lambda y, m: m.gln(m.act(y)),
                                                     act=nn.PReLU(), gln=nn.GroupNorm(1, 512)), (8, 128, 4000)),
    # a decoder's stride-1 transposed conv (the conv it equals, flipped weight)
    ZooModel("convtranspose2d_s1_bn_silu", lambda: Seq(nn.ConvTranspose2d(64, 32, 3, padding=1),
                                                       lambda y, m: F.silu(m.bn(y)), bn=nn.BatchNorm2d(32)),
             (16, 64, 64, 64)),
    # LayerNorm over a conv output's trailing dims: its last dim, a whole image
    ZooModel("convtranspose3d_layernorm_gelu", lambda: Seq(
        nn.ConvTranspose3d(32, 64, 4, stride=2, padding=1), lambda y, m: F.gelu(m.ln(y)) * 2.0, ln=nn.LayerNorm(64)),
        (8, 32, 8, 32, 32)),
    ZooModel("conv2d_layernorm_image_relu", lambda: Seq(
        _conv(16, 32, padding=1), lambda y, m: F.relu(m.ln(y)), ln=nn.LayerNorm([32, 32, 32])), (256, 16, 32, 32)),
    # pooling windows after 3-D and 1-D convs
    ZooModel("conv3d_relu_maxpool3d_scale", lambda: Seq(
        nn.Conv3d(8, 32, 3), lambda y, m: F.max_pool3d(F.relu(y), 2) * m.s, s=_p(32, 1, 1, 1)), (8, 8, 34, 66, 66)),
    ZooModel("conv1d_gelu_avgpool1d_bias", lambda: Seq(
        nn.Conv1d(64, 128, 5, padding=2), lambda y, m: F.avg_pool1d(F.gelu(y), 4) + m.b, b=_p(128, 1)),
        (32, 64, 2048)),
    # Linear layers
    ZooModel("mlp_gelu", lambda: Seq(nn.Linear(1024, 4096), lambda y, m: F.gelu(y)), (8192, 1024)),
    ZooModel("linear_ln_relu", lambda: Seq(nn.Linear(1024, 1024), lambda y, m: F.relu(m.ln(y)), ln=nn.LayerNorm(1024)),
             (16384, 1024)),
    ZooModel("linear_bn_relu", lambda: Seq(nn.Linear(1024, 1024), lambda y, m: F.relu(m.bn(y)),
                                           bn=nn.BatchNorm1d(1024)), (16384, 1024)),
    ZooModel("linear_avgpool_gelu_scale", lambda: Seq(
        nn.Linear(4096, 8192), lambda y, m: F.gelu(F.avg_pool1d(y.unsqueeze(1), 4).squeeze(1)) * 2.0), (4096, 4096)),
    ZooModel("linear_softmax", lambda: Seq(nn.Linear(512, 4096), lambda y, m: torch.softmax(y, dim=-1)), (4096, 512)),
    ZooModel("classifier_log_softmax", lambda: Seq(nn.Linear(2048, 1000), lambda y, m: F.log_softmax(y, dim=1)),
             (4096, 2048)),
    # BERT's output dense layer with LayerNorm as older BERT code writes it
    ZooModel("bert_output_layernorm_spelled", lambda: Seq(nn.Linear(3072, 768), lambda y, m: m.ln(y),
                                                          ln=BertLayerNorm(768)), (8192, 3072)),
    # a classifier's probabilities with softmax written out (the maximum subtracted)
    ZooModel("classifier_softmax_spelled", lambda: Seq(nn.Linear(2048, 1000), lambda y, m: softmax_spelled(y, 1)),
             (4096, 2048)),
    ZooModel("linear_gn_swish", lambda: Seq(nn.Linear(2048, 2048), lambda y, m: F.silu(m.gn(y)),
                                            gn=nn.GroupNorm(32, 2048)), (4096, 2048)),
    ZooModel("linear_rmsnorm", lambda: Seq(nn.Linear(1024, 2048), lambda y, m: m.norm(y), norm=nn.RMSNorm(2048)),
             (8192, 1024)),
    # CLIP's projection head: an embedding normalized to unit length, times the logit scale
    ZooModel("clip_projection_normalize", lambda: Seq(
        nn.Linear(768, 512, bias=False), lambda y, m: F.normalize(y, dim=-1) * 14.3), (8192, 768)),
    ZooModel("linear_logsumexp_relu", lambda: Seq(
        nn.Linear(4096, 4096), lambda y, m: F.relu(torch.logsumexp(y, dim=1, keepdim=True))), (2048, 4096)),
    ZooModel("linear_residual_layernorm", lambda: ResidualLinearNorm(1024), (16384, 1024)),
    ZooModel("linear_3d_tanh_scale", lambda: Seq(nn.Linear(768, 3072), lambda y, m: torch.tanh(y) * 2.0),
             (16, 512, 768)),
    ZooModel("linear_swish_gate", lambda: Seq(nn.Linear(2048, 2048), lambda y, m: y * torch.sigmoid(y) * m.w,
                                              w=_p(2048)), (8192, 2048)),
    ZooModel("linear_hardtanh", lambda: Seq(nn.Linear(512, 512), lambda y, m: F.hardtanh(y)), (32768, 512)),
    ZooModel("linear_mean", lambda: Seq(nn.Linear(1024, 1024), lambda y, m: y.mean(dim=1)), (16384, 1024)),
    ZooModel("linear_amax_sigmoid", lambda: Seq(nn.Linear(1024, 2048), lambda y, m: torch.sigmoid(y.amax(dim=1))),
             (8192, 1024)),
    ZooModel("linear_sigmoid_linear_logsumexp", lambda: TwoLinears(1024, 2048, 512), (8192, 1024)),
    ZooModel("linear_mish_residual", lambda: Seq(nn.Linear(1024, 1024), lambda y, m: y + F.mish(y)), (16384, 1024)),
    # a SIREN layer (sin(30 * Wx + b)) and Primer's squared ReLU
    ZooModel("siren_sine_layer", lambda: Seq(nn.Linear(256, 256), lambda y, m: torch.sin(30.0 * y)), (65536, 256)),
    ZooModel("linear_squared_relu", lambda: Seq(nn.Linear(1024, 4096), lambda y, m: F.relu(y) ** 2), (8192, 1024)),
    # transformer MLPs whose GELU is written out: BERT's erf form, GPT-2's `gelu_new`
    ZooModel("bert_mlp_gelu_spelled", lambda: Seq(nn.Linear(768, 3072), lambda y, m: gelu_erf_spelled(y)), (8192, 768)),
    ZooModel("gpt2_mlp_gelu_new", lambda: Seq(nn.Linear(768, 3072), lambda y, m: gelu_new(y)), (8192, 768)),
    # blocks of well-known networks
    ZooModel("resnet_basic_block", lambda: BasicBlock(64), (32, 64, 56, 56)),
    ZooModel("mobilenet_inverted_residual", lambda: InvertedResidual(24, 6), (32, 24, 56, 56)),
    ZooModel("se_conv_block", lambda: SqueezeExcite(64), (32, 64, 56, 56)),
    ZooModel("unet_resblock_time_embedding", lambda: TimeEmbeddingResBlock(128, 32), (16, 128, 32, 32)),
    ZooModel("convnext_block", lambda: ConvNeXtBlock(96), (32, 96, 56, 56)),
    ZooModel("convnext_stem_layernorm2d", lambda: PatchifyStem(3, 96), (32, 3, 224, 224)),
    ZooModel("unet_adagn_film", lambda: AdaGroupNormBlock(128, 32), (16, 128, 32, 32)),
    # DiT-B/2's MLP half: 256 tokens of 768, its gate per sample ([B, 1, 768] over 256 rows)
    ZooModel("dit_mlp_gated_residual", lambda: DiTMlpHalf(768, 3072), (16, 256, 768)),
    ZooModel("vit_patch_embedding", lambda: PatchEmbedding(768, 768, 196), (32, 196, 768)),
    # batched matmuls: attention, channel mixing shared by the batch
    ZooModel("bmm_scores_softmax", lambda: ScoresSoftmax(64), (64, 256, 64)),
    ZooModel("bmm_scores_bias_softmax", lambda: ScoresBiasSoftmax(64, 256), (64, 256, 64)),
    ZooModel("baddbmm_alibi_scores_softmax", lambda: AlibiScoresSoftmax(64, 256), (64, 256, 64)),
    ZooModel("bmm_attend_layernorm_gelu", lambda: AttendNorm(128), (32, 512, 128)),
    ZooModel("bmm_mix_groupnorm_silu", lambda: Seq(ChannelMix(256), lambda y, m: F.silu(m.gn(y)),
                                                   gn=nn.GroupNorm(8, 256)), (32, 256, 1024)),
    ZooModel("bmm_mix_instancenorm_relu", lambda: Seq(ChannelMix(128), lambda y, m: F.relu(m.norm(y)),
                                                      norm=nn.InstanceNorm1d(128)), (32, 128, 2048)),
]
BY_NAME = {m.name: m for m in MODELS}
ANCHORS = ("conv", "gemm")


@functools.cache
def anchor_kind(name: str) -> str:
    """"conv" where the model holds a convolution (of any dimension, transposed too: issue
    targets name "the zoo's conv models"), else "gemm". Built on the meta device: no
    memory, no kernels."""
    with torch.device("meta"):
        model = BY_NAME[name].make()
    return "conv" if any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules()) else "gemm"
QUICK = ["conv2d_relu_bias", "conv2d_bn_relu", "conv2d_bias_scale_sigmoid_gn", "conv3d_bn_relu",
         "convtranspose2d_bn_relu", "linear_ln_relu", "linear_gn_swish", "linear_sigmoid_linear_logsumexp"]


def _settings():
    """torch's defaults, as a user has them: matmuls "highest", cuDNN may use TF32."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True


def _model_and_input(zoo: ZooModel, dtype: torch.dtype, device: str = "cuda", batch: int | None = None):
    torch.manual_seed(0)
    model = zoo.make().to(device, dtype)
    x = torch.rand(zoo.shape if batch is None else (batch,) + zoo.shape[1:], device=device, dtype=dtype)
    return model, x


def interleaved_ms(fns: dict, calls: int = 20, rounds: int = 8) -> dict:
    """Per name, the median over `rounds` of the mean ms of `calls` back-to-back calls of
    its function as a user's loop makes them (CUDA events, no CUDA graph), the functions
    taking turns (`timings.in_turns`): a drift of the host's or the GPU's speed over the
    seconds of a measurement reaches every function alike. (Timed one after the other,
    two compiles of one graph read up to 3x apart where the CPU's launch time decides.)"""
    import functools

    from fusion_backend.timings import cuda_round_ms, in_turns

    for fn in fns.values():  # warm up: a recompile after dynamo.reset, the allocator
        cuda_round_ms(fn, 3)
    medians = in_turns([functools.partial(cuda_round_ms, fn, calls) for fn in fns.values()], rounds)
    return dict(zip(fns, medians))


def _max_error(out, ref) -> float:
    outs = out if isinstance(out, (tuple, list)) else [out]
    refs = ref if isinstance(ref, (tuple, list)) else [ref]
    worst = 0.0
    for o, r in zip(outs, refs):
        r = r.double()
        worst = max(worst, float((o.double() - r).norm() / r.norm().clamp_min(1e-30)))
    return worst


def kernel_profile(fn, calls: int = 5, top: int = 8) -> list[tuple[str, float]]:
    """The `top` GPU kernels of a call of `fn` by GPU time: (name, us per call)."""
    from .compare import kernel_times

    rows = sorted(kernel_times(fn, calls), reverse=True)[:top]
    return [(name, ms * 1000) for ms, _, name in rows]


def run_model(zoo: ZooModel, dtype_name: str, time_it: bool = True, profile: bool = False) -> dict:
    """Compiles `zoo` with Inductor and with fusedepi at `dtype_name`; with `time_it`,
    checks both against float64 and times them (without: the compiles alone, as the warm
    pass makes them)."""
    import copy

    from fusion_backend import fusedepi
    from fusion_backend.backend import collect_reports
    from fusion_backend.timings import compare_ms, host_ms

    _settings()
    dtype = getattr(torch, dtype_name)
    base, x = _model_and_input(zoo, dtype)
    row = {"model": zoo.name, "dtype": dtype_name}
    compiled = {}
    with torch.no_grad():
        reference = None
        if time_it:
            started = time.perf_counter()
            reference = copy.deepcopy(base).double()(x.double())
            torch.cuda.synchronize()
            row["reference_s"] = round(time.perf_counter() - started, 1)
        for backend in ("inductor", "fusedepi"):
            model = copy.deepcopy(base)
            torch._dynamo.reset()
            reports: list = []
            started = time.perf_counter()
            with collect_reports(reports):
                fn = torch.compile(model, backend=fusedepi if backend == "fusedepi" else "inductor")
                out = fn(x)
            torch.cuda.synchronize()
            row[f"{backend}_compile_s"] = round(time.perf_counter() - started, 1)
            if reference is not None:
                row[f"{backend}_error"] = _max_error(out, reference)
            if backend == "fusedepi":
                records = [r for report in reports for r in report.records]
                row["fused"] = [f"{r.fusion} ({r.measured})" if r.measured else r.fusion
                                for r in records if r.status == "fused"]
                row["refused"] = [f"{r.anchor}: {r.reason}" for r in records if r.status == "refused"]
            compiled[backend] = fn
        calls = {backend: (lambda fn=fn: fn(x)) for backend, fn in compiled.items()}
        if time_it:
            for backend, ms in interleaved_ms(calls).items():
                row[f"{backend}_ms"] = ms
            for backend, ms in zip(calls, compare_ms(list(calls.values()), x.device)):
                row[f"{backend}_gpu_ms"] = ms
            # The host's launches of a call as the whole-graph check times them, taken
            # here after the compile: a check made during the compile that read them
            # otherwise shows beside its record.
            for backend, ms in zip(calls, host_ms(list(calls.values()), x.device)):
                row[f"{backend}_launch_ms"] = ms
        for backend, call in calls.items() if profile else ():
            row[f"{backend}_kernels"] = kernel_profile(call)
    if time_it:
        row["ratio"] = row["inductor_ms"] / row["fusedepi_ms"]
        row["gpu_ratio"] = row["inductor_gpu_ms"] / row["fusedepi_gpu_ms"]
    return row


def chains(zoo: ZooModel, dtype_name: str) -> list[str]:
    """What the matcher takes in `zoo` at `dtype_name`, nothing timed (a batch of 2;
    without a GPU through the fused op's reference): a line per fused chain with where
    it stops, and per anchor left alone its reason."""
    from fusion_backend import explain

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, x = _model_and_input(zoo, getattr(torch, dtype_name), device, batch=2)
    with torch.no_grad():
        report = explain(model, x, verbose=False)
    lines = []
    for r in report.fused:
        lines.append(f"fused {r.fusion}: stops at {r.stop}")
        tiling = in_kernel_tiling(r.spec)
        if tiling:
            lines.append(f"  in-kernel conv on sm_90: {tiling}")
    return lines + [f"not fused {r.anchor}: {r.reason}" for r in report.refused]


def in_kernel_tiling(spec_json: str) -> str:
    """How the in-kernel conv would run the chain of `spec_json` on sm_90, TF32 allowed
    as cuDNN's default allows it (`cuda_templates.conv_gemm_plan`): its tiling, or why it
    would not run it; with `--plan`, also the tiling without it where that differs, so
    that the rows a plan constant changes are the ones to time. "" where the chain's
    anchor is not a conv the in-kernel conv could take. Nothing is built or timed."""
    import cuda_templates
    from benchmarks.kernel_variants import set_plan as set_constants
    from cuda_templates import conv_sm90
    from lowering.spec import EpilogueSpec

    spec = EpilogueSpec.from_json(spec_json)
    if spec.anchor.kind != "conv" or not spec.anchor.direct or spec.anchor.permuted:
        return ""
    spec = spec.with_in_kernel_conv()

    def tiling() -> str:
        plan = cuda_templates.conv_gemm_plan(spec, "sm90", conv_tf32=True)
        if isinstance(plan, str):
            return f"not taken: {plan}"
        cin = spec.anchor.direct[0]
        pitch = conv_sm90.x_pitch(cin, getattr(torch, spec.dtype).itemsize)
        return plan.describe() + (f", x's pixels padded to {pitch} channels" if pitch != cin else "")

    planned = tiling()
    if not PLAN:
        return planned
    set_constants(PLAN_DEFAULTS)
    try:
        without = tiling()
    finally:
        set_constants(PLAN)
    return planned + (f" (without --plan: {without})" if without != planned else " (the same without --plan)")


def _warm(task):
    """One warm compile: (name, dtype, error or "", its seconds, where they went: each
    backend's compile's seconds, as far as it got)."""
    name, dtype_name = task
    os.environ["FUSEDEPI_AUTOTUNE"] = "off"
    import logging

    logging.getLogger("fusedepi").setLevel(logging.ERROR)
    started = time.perf_counter()
    try:
        row = run_model(BY_NAME[name], dtype_name, time_it=False)
    except Exception as err:  # noqa: BLE001 - reported, and the timed pass meets it again
        return name, dtype_name, f"{type(err).__name__}: {str(err)[:200]}", time.perf_counter() - started, ""
    phases = f"inductor {row['inductor_compile_s']:.0f} s, fusedepi {row['fusedepi_compile_s']:.0f} s"
    return name, dtype_name, "", time.perf_counter() - started, phases


# conv_sm90's constants this run sets (`--plan NAME=VALUE`, `set_plan`), in every process
# that compiles; recorded in the --json result.
PLAN: dict = {}
PLAN_DEFAULTS: dict = {}  # the values PLAN replaced (`in_kernel_tiling` compares against them)


def set_plan(plan: dict) -> None:
    """Sets `cuda_templates.conv_sm90`'s constants as `plan` names them (from
    `kernel_variants.parse_plan`) in this process, and keeps them in PLAN and the values
    they replace in PLAN_DEFAULTS."""
    from benchmarks.kernel_variants import set_plan as set_constants
    from cuda_templates import conv_sm90

    PLAN_DEFAULTS.update({name: getattr(conv_sm90, name) for name in plan if name not in PLAN_DEFAULTS})
    set_constants(plan)
    PLAN.update(plan)


def _warm_worker(counter, devices: list[str] | None, plan: dict | None = None) -> None:
    """A warm process's start: one CPU thread for torch's own ops (the processes are
    the parallelism), conv_sm90's constants as `plan` sets them, and, with `devices`, the
    next of them in turn as its only GPU (the processes spread over the GPUs the timed pass
    uses, not all on the first)."""
    torch.set_num_threads(1)
    set_plan(plan or {})
    if devices:
        with counter.get_lock():
            index = counter.value
            counter.value += 1
        os.environ["CUDA_VISIBLE_DEVICES"] = devices[index % len(devices)]


def warm(tasks: list[tuple[str, str]], processes: int, devices: list[str] | None) -> int:
    """Compiles each (model, dtype) of `tasks` with both backends in `processes`
    processes (`_warm`, spread over `devices`), printing a line as each ends (its
    seconds, the time so far) so that a run cut short says how far it got. Returns the
    number of compiles that failed."""
    import signal

    started, failed, done = time.perf_counter(), 0, 0
    threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # the pool's processes inherit it
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a time limit: the pool stopped
    try:
        context = multiprocessing.get_context("spawn")
        counter = context.Value("i", 0)
        with context.Pool(processes, initializer=_warm_worker, initargs=(counter, devices, dict(PLAN))) as pool:
            for name, dtype_name, error, seconds, phases in pool.imap_unordered(_warm, tasks):
                done += 1
                failed += bool(error)
                print(f"[warm] {done}/{len(tasks)} {name} {dtype_name}: {seconds:.0f} s"
                      f"{' (' + phases + ')' if phases else ''}{' ' + error if error else ''} "
                      f"({time.perf_counter() - started:.0f} s so far)", flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if threads is None:
            del os.environ["TORCHINDUCTOR_COMPILE_THREADS"]
        else:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = threads
        print(f"[warm] {done} of {len(tasks)} compiles in {time.perf_counter() - started:.0f} s", flush=True)
    return failed


def gpu_shards(names: list[str], gpus: int, visible: str | None) -> list[tuple[str, list[str]]]:
    """(CUDA_VISIBLE_DEVICES, models) for each of `gpus` timed-pass processes: every
    gpus-th model of `names`, on the i-th GPU this process sees (`visible`: its own
    CUDA_VISIBLE_DEVICES, None for all of the machine's). Processes with no model are
    left out.

    Raises:
        ValueError: fewer GPUs visible than `gpus`.
    """
    devices = visible_gpus(gpus, visible)
    return [(devices[i], names[i::gpus]) for i in range(gpus) if names[i::gpus]]


def visible_gpus(gpus: int, visible: str | None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES names of the first `gpus` GPUs this process sees
    (`visible`: its own CUDA_VISIBLE_DEVICES, None for all of the machine's).

    Raises:
        ValueError: fewer GPUs visible than `gpus`.
    """
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if devices is not None and len(devices) < gpus:
        raise ValueError(f"--gpus {gpus}: CUDA_VISIBLE_DEVICES={visible} names {len(devices)}")
    return devices[:gpus] if devices is not None else [str(i) for i in range(gpus)]


def merged_rows(paths: list[str], names: list[str], dtypes: list[str]) -> tuple[list[dict], bool]:
    """The rows of the timed-pass processes' --json files, in the order of `names` and
    `dtypes`, and whether every file is there and complete."""
    found, complete = {}, True
    for path in paths:
        try:
            with open(path) as handle:
                result = json.load(handle)
        except (OSError, ValueError):  # not written yet: its process timed no model
            complete = False
            continue
        complete &= result.get("complete") is True
        found.update({(r["model"], r["dtype"]): r for r in result["rows"]})
    return [found[(n, d)] for n in names for d in dtypes if (n, d) in found], complete


def _time_on_gpus(names: list[str], args) -> tuple[list[dict], bool]:
    """The timed pass of `names` in args.gpus processes (`gpu_shards`); their output
    goes to this process's stdout as they print it. A SIGTERM here (a time limit) stops
    them, and the rows they finished are kept."""
    import signal
    import subprocess
    import tempfile

    shards = gpu_shards(names, args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    with tempfile.TemporaryDirectory(prefix="fusedepi-zoo-") as tmp:
        paths = [os.path.join(tmp, f"gpu{i}.json") for i in range(len(shards))]
        procs = []
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            for (device, these), path in zip(shards, paths):
                cmd = [sys.executable, "-m", "benchmarks.zoo", "--models", *these, "--dtypes", *args.dtypes,
                       "--json", path] + (["--profile"] if args.profile else [])
                cmd += [arg for item in args.plan or [] for arg in ("--plan", item)]
                procs.append(subprocess.Popen(cmd, env=dict(os.environ, CUDA_VISIBLE_DEVICES=device)))
            for proc in procs:
                proc.wait()
        finally:
            signal.signal(signal.SIGTERM, previous)
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                proc.wait()
            rows, complete = merged_rows(paths, names, args.dtypes)
            if args.json:
                _write_json(args.json, _result(rows, args.dtypes, complete=complete))
        failed = [p.returncode for p in procs if p.returncode]
        return rows, complete and not failed


def summary(rows: list[dict], key: str = "ratio") -> dict:
    ratios = [r[key] for r in rows if key in r]
    if not ratios:
        return {"models": 0}
    return {
        "models": len(ratios),
        "min": min(ratios),
        "geomean": math.exp(sum(math.log(r) for r in ratios) / len(ratios)),
        "below_0.97": sum(r < 0.97 for r in ratios),
        # of those, the rows that ran a graph of fusedepi's (the others ran Inductor's
        # compile of the same graph in both columns: the measurement's spread)
        "below_0.97_fused": sum(r[key] < 0.97 and bool(r.get("fused")) for r in rows if key in r),
        "fused_any": sum(bool(r.get("fused")) for r in rows if key in r),
    }


def below(s: dict) -> str:
    """A summary's count of rows below 0.97x and, where there are any, how many of them
    fused a chain ("2 (1 fused)")."""
    return f"{s['below_0.97']} ({s['below_0.97_fused']} fused)" if s["below_0.97"] else "0"


def markdown(results: list[dict]) -> str:
    """RESULTS.md's two zoo tables from the `--json` results of one or more runs (shards):
    per dtype the GPU-time and wall summaries, the models that fused a chain and theirs;
    then one row per model and dtype, in the zoo's order.

    Raises:
        ValueError: the runs hold one model and dtype twice, or a row failed.
    """
    rows: dict = {}
    for result in results:
        for row in result["rows"]:
            key = (row["model"], row["dtype"])
            if key in rows:
                raise ValueError(f"{row['model']} {row['dtype']} is in more than one run")
            if "failed" in row:
                raise ValueError(f"{row['model']} {row['dtype']} failed: {row['failed']}")
            rows[key] = row
    order = {name: i for i, name in enumerate(BY_NAME)}
    ordered = sorted(rows.values(), key=lambda r: (order.get(r["model"], len(order)), DTYPES.index(r["dtype"])))
    lines = ["| dtype | models | GPU time: min / geometric mean / below 0.97x | wall: min / geometric mean / "
             "below 0.97x | chains fused | those models, GPU time: min / geometric mean |",
             "|---|---|---|---|---|---|"]
    for dtype_name in DTYPES:
        these = [r for r in ordered if r["dtype"] == dtype_name]
        if not these:
            continue
        gpu, wall = summary(these, "gpu_ratio"), summary(these, "ratio")
        fused = summary([r for r in these if r.get("fused")], "gpu_ratio")
        tail = f"{fused['min']:.2f} / {fused['geomean']:.3f}" if fused["models"] else "-"
        lines.append(f"| {dtype_name} | {gpu['models']} | {gpu['min']:.2f} / {gpu['geomean']:.3f} / "
                     f"{below(gpu)} | {wall['min']:.2f} / {wall['geomean']:.3f} / {below(wall)} | "
                     f"{fused['models']} models | {tail} |")
    lines += ["", "| anchor | dtype | models | GPU time: min / geometric mean / below 0.97x | "
                  "wall: min / geometric mean / below 0.97x |", "|---|---|---|---|---|"]
    for anchor in ANCHORS:
        for dtype_name in DTYPES:
            these = [r for r in ordered if r["dtype"] == dtype_name and anchor_kind(r["model"]) == anchor]
            if not these:
                continue
            gpu, wall = summary(these, "gpu_ratio"), summary(these, "ratio")
            lines.append(f"| {anchor} | {dtype_name} | {gpu['models']} | {gpu['min']:.2f} / {gpu['geomean']:.3f} / "
                         f"{below(gpu)} | {wall['min']:.2f} / {wall['geomean']:.3f} / {below(wall)} |")
    lines += ["", "| model | dtype | Inductor GPU ms | fusedepi GPU ms | GPU ratio | wall ratio | "
                  "fused (measured) / not fused |", "|---|---|---|---|---|---|---|"]
    for r in ordered:
        what = "; ".join(list(r["fused"]) + [f"not fused: {x}" for x in r["refused"]])
        lines.append(f"| {r['model']} | {r['dtype']} | {r['inductor_gpu_ms']:.3f} | {r['fusedepi_gpu_ms']:.3f} | "
                     f"{r['gpu_ratio']:.2f} | {r['ratio']:.2f} | {what} |")
    stopped = sum(result.get("complete") is False for result in results)
    if stopped:
        lines += ["", f"{stopped} of the {len(results)} runs stopped before their last model: their rows are "
                      "the models they finished."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true", help="print the model names and exit")
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} models: {', '.join(QUICK)}")
    parser.add_argument("--models", nargs="*", choices=list(BY_NAME), metavar="NAME", help="these models only")
    parser.add_argument("--dtypes", nargs="*", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--anchor", choices=ANCHORS, help="only the models with a convolution (conv), or without (gemm)")
    parser.add_argument("--shard", default="1/1", help="I/N: the I-th of N equal parts of the selection")
    parser.add_argument("--warm", type=int, default=0, metavar="N", help="compile everything in N processes first")
    parser.add_argument("--gpus", type=int, default=1, metavar="N",
                        help="the timed pass in N processes, one a GPU, each on every N-th model")
    parser.add_argument("--json", help="also write the rows and the summary here")
    parser.add_argument("--profile", action="store_true", help="also list each backend's GPU kernels per call")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print RESULTS.md's tables from --json files")
    parser.add_argument("--plan", action="append", metavar="NAME=VALUE",
                        help="set a constant of cuda_templates.conv_sm90 (a switch still off, say) for the run")
    parser.add_argument("--chains", action="store_true",
                        help="print where each model's chains stop and each conv chain's in-kernel tiling on sm_90, "
                             "with --plan also without it where it differs (FUSEDEPI_AUTOTUNE=off; on the CPU via the "
                             "reference)")
    args = parser.parse_args(argv)
    from benchmarks.kernel_variants import parse_plan

    try:
        set_plan(parse_plan(args.plan))
    except ValueError as err:
        print(f"benchmarks.zoo: {err}", file=sys.stderr)
        return 2
    if PLAN:
        print(f"conv_sm90 set: {', '.join(f'{k}={v!r}' for k, v in PLAN.items())}", flush=True)
    if args.list:
        print("\n".join(n for n in BY_NAME if not args.anchor or anchor_kind(n) == args.anchor))
        return 0
    if args.table:
        results = []
        for path in args.table:
            with open(path) as handle:
                results.append(json.load(handle))
        try:
            print(markdown(results))
        except ValueError as err:
            print(f"benchmarks.zoo --table: {err}", file=sys.stderr)
            return 2
        return 0
    names = args.models or (QUICK if args.quick else list(BY_NAME))
    if args.anchor:
        names = [n for n in names if anchor_kind(n) == args.anchor]
    shard = re.fullmatch(r"(\d+)/(\d+)", args.shard)
    index, count = (int(v) for v in shard.groups()) if shard else (0, 0)
    if not 1 <= index <= count:
        print(f"benchmarks.zoo: --shard {args.shard}: I/N with 1 <= I <= N", file=sys.stderr)
        return 2
    names = names[index - 1::count]
    if not names or not args.dtypes:
        print(f"benchmarks.zoo: nothing selected ({len(names)} models, {len(args.dtypes)} dtypes: --models, --anchor "
              f"{args.anchor}, --shard {args.shard} and --dtypes leave no row)", file=sys.stderr)
        return 2
    if args.chains:
        import logging

        os.environ["FUSEDEPI_AUTOTUNE"] = "off"
        os.environ.setdefault("FUSEDEPI_CPU_REFERENCE", "1")  # read only for CPU tensors
        logging.getLogger("fusedepi").setLevel(logging.ERROR)
        for name in names:
            for dtype_name in args.dtypes:
                for line in chains(BY_NAME[name], dtype_name):
                    print(f"{name:34s} {dtype_name:9s} {line}", flush=True)
        return 0
    if not torch.cuda.is_available():
        print("benchmarks.zoo needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.gpus < 1 or (args.gpus > 1 and args.gpus > torch.cuda.device_count()):
        print(f"benchmarks.zoo: --gpus {args.gpus}, of {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 2
    tasks = [(n, d) for n in names for d in args.dtypes]
    if args.warm:
        devices = visible_gpus(args.gpus, os.environ.get("CUDA_VISIBLE_DEVICES")) if args.gpus > 1 else None
        warm(tasks, args.warm, devices)
    if args.gpus > 1:
        rows, complete = _time_on_gpus(names, args)
        _print_summary(_result(rows, args.dtypes, complete=complete))
        if not complete:
            print(f"benchmarks.zoo --gpus: {len(rows)} of {len(tasks)} rows (a process stopped early or failed)",
                  file=sys.stderr)
        return 0 if complete else 1
    rows = []
    for name, dtype_name in tasks:
        try:
            row = run_model(BY_NAME[name], dtype_name, profile=args.profile)
        except Exception as err:  # noqa: BLE001 - one model's failure is a row, not the end
            row = {"model": name, "dtype": dtype_name, "failed": f"{type(err).__name__}: {str(err)[:300]}"}
        rows.append(row)
        if args.json:  # the rows so far, so that a run stopped at a time limit keeps them
            _write_json(args.json, _result(rows, args.dtypes, complete=False))
        if "failed" in row:
            print(f"{name:34s} {dtype_name:9s} FAILED {row['failed']}", flush=True)
            continue
        print(f"{name:34s} {dtype_name:9s} inductor {row['inductor_ms']:8.3f} ms  fusedepi {row['fusedepi_ms']:8.3f} ms"
              f"  {row['ratio']:5.2f}x  (GPU {row['inductor_gpu_ms']:.3f} / {row['fusedepi_gpu_ms']:.3f} ms, "
              f"{row['gpu_ratio']:.2f}x)  err {row['fusedepi_error']:.1e} (inductor {row['inductor_error']:.1e})"
              f"  compile {row['fusedepi_compile_s']:.0f}/{row['inductor_compile_s']:.0f} s"
              + (f"  launches {row['inductor_launch_ms']:.4f} / {row['fusedepi_launch_ms']:.4f} ms"
                 if "fusedepi_launch_ms" in row else ""), flush=True)
        for fused in row["fused"]:
            print(f"    fused: {fused}", flush=True)
        for refused in row["refused"]:
            print(f"    not fused: {refused[:200]}", flush=True)
        for backend in ("inductor", "fusedepi") if args.profile else ():
            for kernel, us in row[f"{backend}_kernels"]:
                print(f"    {backend:8s} {us:9.1f} us  {kernel[:110]}", flush=True)
    result = _result(rows, args.dtypes, complete=True)
    _print_summary(result)
    if args.json:
        _write_json(args.json, result)
    return 0


def _print_summary(result: dict) -> None:
    for what, table in (("wall", result["summary"]), ("GPU time", result["gpu_summary"])):
        for dtype_name, s in table.items():
            if s["models"]:
                print(f"summary {dtype_name} ({what}): {s['models']} models, min {s['min']:.2f}x, geomean "
                      f"{s['geomean']:.3f}x, {below(s)} below 0.97x, {s['fused_any']} fused a chain")
    for anchor in ANCHORS:
        for dtype_name in result["gpu_summary"]:
            s = summary([r for r in result["rows"] if r["dtype"] == dtype_name and anchor_kind(r["model"]) == anchor],
                        "gpu_ratio")
            if s["models"]:
                print(f"summary {anchor} models {dtype_name} (GPU time): {s['models']} models, min {s['min']:.2f}x, "
                      f"geomean {s['geomean']:.3f}x, {below(s)} below 0.97x")


def _result(rows: list[dict], dtypes, complete: bool) -> dict:
    """The `--json` record: the rows and their summaries; `complete` is False while the
    run is under way (a file left so by a run that was stopped holds the rows it got to)."""
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "complete": complete,
            "plan": {k: repr(v) for k, v in PLAN.items()}, "rows": rows,
            "summary": {d: summary([r for r in rows if r["dtype"] == d]) for d in dtypes},
            "gpu_summary": {d: summary([r for r in rows if r["dtype"] == d], "gpu_ratio") for d in dtypes}}


def _write_json(path: str, result: dict) -> None:
    """Writes `result` to `path` whole or not at all (a temporary file, then a rename)."""
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(result, handle, indent=1)
    os.replace(partial, path)


if __name__ == "__main__":
    sys.exit(main())
