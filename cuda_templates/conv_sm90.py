"""The in-kernel conv for Hopper (sm_90a): out = chain(conv2d(x, w)) in one launch, an
implicit GEMM whose output tile gets the chain in registers and is written once.

The GEMM: M = the output's pixels (rows x Ho x Wo), N = the output channels, K = kh x kw x
C_in (a Conv3d's: rows x Do x Ho x Wo pixels, K = kd x kh x kw x C_in, its Do planes of Ho
rows tiled as one plane of Do x Ho rows, a patch inside one depth plane, x
[rows, D, H, W, C_in] read by a 5-D tensor map a plane deep).
`render.conv_gemm_plan` decides where it applies (2-D or 3-D, groups 1, any dilation,
strides up to MAX_STRIDE, pointwise chains and norms over whole channels, C_in a
multiple of 16 bytes, sm_90)
and renders it into `templates.KERNEL_FILE` with the spec's stage functions; the launcher hands it the input
in channels-last memory ([rows, H, W, C_in]; one copy, as Inductor's channels-last conv
makes), or in 16-bit as the graph has it where every tap's box starts on a 16-byte
column (`reads_nchw`, a 1 x 1 conv: a box an m64 block, 64 pixels of a patch row by a
k-step's channels, read by the wgmma as an MN-major A), and the weight as [C_out, kh, kw,
C_in].

Structure (include/fusedepi/conv_sm90.cuh; one CTA an output tile of 128 pixels (256 where
the tile has few channels: TALL_BLOCK_M) x kBN channels, persistent over tiles, 384 threads):
- a tile's pixels are a patch of kTH x kTW output pixels of one image (kTW: the output
  width rounded up to a power of two, 8 to 128);
- warpgroup 0's first thread is the producer: for each k-step (a tap, and a block of
  input channels of 128 bytes, or of 64 where a pixel's C_in fits them:
  `k_step_bytes`) it copies by TMA the patch of input pixels that tap reads (a 4-D box of
  the channels-last input, shifted by the tap times the dilation; with a stride s the box
  spans s times the patch and TMA reads every s-th pixel of it, its element strides;
  coordinates outside the image read zeros, which is the conv's zero padding, and
  channels past C_in too) and the tap's weights (a
  2-D box of [C_out, taps x C_in'], C_in' padded with zeros by the launcher to whole
  k-steps, so a k-step never mixes two taps); where the stride along the height is 1, one
  box of x serves a kernel column's taps (`ConvGemmPlan.shared_rows`, SHARED_ROWS). Both
  land as rows of the k-step's bytes in
  the swizzle of that width (the in-kernel GEMM's tiles: 128), in a ring of stages;
- warpgroups 1 and 2 are the consumers: wgmma m64nBNk16 (k8 in TF32), float32
  accumulators. Where the tile is at most PINGPONG_MAX_N channels wide they take the CTA's
  tiles in turn (ping-pong: each holds a whole tile, two m64 wgmmas a k-step, four in a
  tile of 256, and one's finish runs under the other's mainloop); wider tiles are shared,
  64 rows each (cooperative). Each accumulator is rounded to the output type (what the
  library conv's output holds), stage0 is applied to it in registers (the tile's
  per-channel operands loaded before its mainloop), and the result goes into a staging
  tile, with no branch an element: each (channel, patch row) run of kTW pixels in a slot of its own, placed at
  the run's offset from a 16-byte boundary of the NCHW output; the elements of a run's
  partial first and last 16-byte chunk are stored from registers;
- the finishing threads then issue one bulk copy (cp.async.bulk, shared to global) a
  run for its whole 16-byte chunks, which run under the next mainloop; before the
  staging tile is written again its copies have read it. Warps 1-3 of warpgroup 0 idle.
  At 128 x 64 x 128 x 128 -> 128 channels, k 3 (H100, kernel time): bf16 0.56 ms
  ping-pong, 0.76 ms cooperative; the mainloop alone 0.50 and 0.40 ms (one warpgroup's
  wgmmas at a time run slower than two warpgroups' together).

With a norm (`ConvGemmPlan.stats`: BatchNorm in training, or GroupNorm, InstanceNorm, a
LayerNorm over whole channels), the tiles store the conv's value (rounded to T, as the
library conv's output) and write each channel's moments of stage0 on it over the tile's
pixels (two passes over the registers, in float32: the sum, then the squares about the
tile's mean); CONV_STATS_FINAL merges them (a block a channel or segment), and the
file's apply kernel runs stage0 and the norm on the output in place, as on the library
path (the value before the norm is never rounded to T). With the norm recomputed
(`ConvGemmPlan.recompute`, `Anchor.recompute`) there is no apply kernel: the kernel's
first pass writes the moments alone, and after their merge a second pass computes the
conv again and runs stage0 and stage1 (the norm with the merged statistics, then the
steps after it) in its tiles, writing the chain's result once.

With a spatial reduction after a pointwise chain (`ConvGemmPlan.reduce`, REDUCES: global
pooling, the sum, mean, maximum or minimum over each channel's plane) the tiles write no
conv output: each reduces its channels over its valid pixels in registers (shuffles over a
warp's rows, shared memory over the finishing warps) into a float an (image, patch,
channel), and CONV_REDUCE_FINAL merges an (image, channel)'s patches and runs the steps
after the reduction on the value. With a softmax or log_softmax over each pixel's
channels where one tile holds them all (`ConvGemmPlan.softmax`, PIXEL_NORMS), each pixel's
maximum and sum of exponentials come from the 4 lanes that hold its channels (shuffles),
and stage1 (the normalize, then the steps after it) runs on every value before the tile
is staged and written as a pointwise chain's. With a reduction over each pixel's
channels where one tile holds them all (`ConvGemmPlan.pixel_reduce`, PIXEL_REDUCES: sum,
mean, logsumexp, amax, amin) the same lanes merge their partials and one of them stores
the pixel's value; nothing is staged. With a pooling window whose stride is the
window (`ConvGemmPlan.pool`, POOLS_IN_TILE: MaxPool2d, AvgPool2d of 2 or 4 pixels a side,
unpadded) the staged tile is pooled by the finishing threads instead of stored, and the
pooled plane is the only output.

float32 runs in TF32 (wgmma reads the operands' top 19 bits), only where
`torch.backends.cudnn.allow_tf32` allows it, as cuDNN's conv does.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Template

from .gemm_sm90 import WGMMA_TYPES

BLOCK_M = 128  # output pixels a tile
# Output pixels a tile where its channels are few (at most TALL_MAX_N, ping-pong) and a
# k-step is at most TALL_MAX_K_BYTES: four m64 wgmmas a k-step instead of two,
# over a short mainloop (a 16 -> 32 channel 3 x 3 conv: 9 k-steps of 64 bytes a tile)
# that otherwise waits on each k-step's wgmma latency, and half the tiles' finishes.
TALL_BLOCK_M = 256
TALL_MAX_N = 64
TALL_MAX_K_BYTES = 64
# Output channels a tile: the widths whose results were checked against float64 on an
# H100, by element size (the staging tile's bytes bound float32 to 128). bf16 tiles of 96
# and 256 channels gave wrong values there (96: channels 64-95 only; float32 at 96 was
# right; the cause is not known), so a tile takes the next checked width instead. Tiles
# of 32 serve outputs of 8-32 channels (a 64-wide tile's half would be work thrown away:
# conv2d_bn_relu's 32 channels, H100, the chain 0.195 against 0.254 ms float32).
BLOCK_N = {2: (32, 64, 128, 160, 192), 4: (32, 64, 112, 128)}
SMEM_BUDGET = 220 * 1024  # the ring's stages and the staging tile
MIN_STAGES = 3
# The widest tile a consumer warpgroup holds whole (kBN float32 accumulators a thread of
# its 232 registers): the ping-pong schedule's bound.
PINGPONG_MAX_N = 128
# A k-step's bytes of input channels (the tiles' rows and their swizzle): 64 where a
# pixel's C_in fits them, else 128 (a 128-byte k-step of a 16-channel bf16 input is three
# quarters zeros, read, staged and multiplied all the same). Not 32: k-steps of 32 bytes
# (16 bf16 channels) were slower than 64-byte ones, half zeros, on an H200 (the conv
# kernel, bf16, a kernel column's taps sharing a box): conv2d_bn_relu 73.7 against 58.2
# us, conv2d_layernorm_image_relu 40.8 against 37.5, conv2d_instancenorm_leaky 53.2
# against 50.9, conv2d_relu_maxpool 66.2 against 64.6, conv2d_dilated_gelu 70.0 against
# 71.5 (benchmarks/NOTES.md).
K_STEP_BYTES = (64, 128)
# x's pixels padded to 16 bytes (`x_pitch`): a conv whose C_in is not a whole 16 bytes (an
# RGB image's 3 channels, 4 bf16 ones) reads a channels-last copy of x whose pixels are
# 16 bytes apart (TMA's strides), its channels past C_in never read (the tensor map's
# channel dim is C_in: TMA fills the box past it with zeros, as past a k-step's C_in).
# On an H100 (the GPU tier's test_in_kernel_conv_of_padded_pixels, 12 cases, and the GPU
# fuzzer); the zoo's measured choice takes it for bf16 conv3d_bn_relu (GPU time 0.383 ->
# 0.246 ms, Inductor 0.434) and conv3d_scale_sigmoid_bias (0.238 -> 0.111 ms, Inductor
# 0.238), benchmarks/NOTES.md. `--plan PAD_PIXELS=False` times the library conv's form.
PAD_PIXELS = True
# The ring's depth at most: 8 stages of 128-byte k-steps, as many bytes of narrower ones
# (a k-step of 64 bytes is half the work, the latency it must hide the same).
RING_BYTES_K = 8 * 128
# The largest stride the tensor map reads (TMA's element strides: 1 to 8). A box spans
# the patch's width times the stride, at most MAX_BOX pixels, which bounds the patch's width.
MAX_STRIDE = 8
MAX_BOX = 256
# The widest patch `tiling` takes (a power of two, 8 to BLOCK_M). Of the widths up to it
# (and MAX_BOX), `tiling` takes the widest that computes the fewest columns outside the
# output: 128 for outputs 126 to 128 wide, 32 for 94 or 96 (patches of 128 would leave a
# quarter of each tile outside; on an H200 patches of 32 took 0.0718 against 0.0830 ms
# for conv2d_residual_relu in float32, 0.0475-0.0480 against 0.0524-0.0531 ms for
# conv2d_min_channels_tanh, benchmarks/NOTES.md).
MAX_PATCH_W = BLOCK_M
# The narrowest width `tiling` narrows a patch to (64-byte runs of a channel in 16-bit);
# narrower patches, whose runs would be shorter, were not measured.
NARROWEST_PATCH_W = 32
# 16-bit convs of stride 1 along the width, patches 64 or 128 wide, an input width of
# whole 16-byte rows and every tap's box starting on a 16-byte column (a 1 x 1 conv
# without padding, say) read x in the graph's NCHW layout (ConvGemmPlan.nchw): no
# channels-last copy of x. A TMA box of the 128-byte swizzle whose innermost coordinate
# is off a 16-byte column stopped the kernel with "illegal instruction" on an H200 (3 x 3
# convs, padded or not); 1 x 1 ones were right (benchmarks/NOTES.md).
READS_NCHW = True
NCHW_BOX_W = 64  # pixels of an NCHW box: one m64 block, a 128-byte swizzle row in 16-bit
# float32 (TF32) convs of stride 1 read x in its NCHW layout as well, and round it to TF32
# themselves (ConvGemmPlan.nchw; `nchw_box_w`): TF32 wgmmas take K-major operands only, so
# a consumer loads its A fragments from an unswizzled box of the patch's rows by a k-step's
# channels (any column: a tap's shift is in the address) and rounds them in registers
# (`cvt.rna`), and the graph's channels-last, rounded copy of x (a pass over x before the
# conv) is not made. Patches 64 or 128 wide (one or two rows). Right on an H100
# (tests/test_gpu.py, test_in_kernel_conv_reads_a_float32_x_nchw), but off: slower than
# the channels-last kernel and the graph's rounding copy together (Conv2d 64 -> 128 over
# 128 x 64 x 128 x 128: 1419 against 1120 + 353 us; benchmarks/RESULTS.md).
READS_NCHW_TF32 = False
# A spatial reduction after a pointwise chain (global pooling: spatial_sum, _mean, _amax,
# _amin) inside the tiles, the conv's output never written (ConvGemmPlan.reduce); GPU
# tests: tests/test_gpu.py, test_in_kernel_conv_spatial_reduction.
REDUCES = True
# A softmax or log_softmax over each pixel's channels (channel_softmax, channel_log_softmax)
# where one tile holds all of them, in registers before the tile is staged
# (ConvGemmPlan.softmax); GPU tests: test_in_kernel_conv_channel_softmax. Right, but off:
# on conv2d_softmax_channels (H200) it took 0.1205 / 0.1234 ms (float32 / bf16) against
# the library conv's form's 0.0995 / 0.0812, so it would only cost a build and a timing.
PIXEL_NORMS = False
# A reduction over each pixel's channels (channel_sum, _mean, _logsumexp, _amax, _amin)
# after a pointwise chain where one tile holds every channel, one value a pixel written
# from registers (ConvGemmPlan.pixel_reduce); GPU tests: test_in_kernel_conv_pixel_reduction.
PIXEL_REDUCES = True
# A MaxPool2d or AvgPool2d after a pointwise chain, its stride its window (2 or 4 pixels a
# side), unpadded, pooled in the tile from the staged values (ConvGemmPlan.pool): the
# conv's output never written, the pooled plane written once; GPU tests:
# test_in_kernel_conv_pool.
POOLS_IN_TILE = True
# The window sides a patch of power-of-two rows and columns holds whole.
POOL_SIDES = (1, 2, 4)
# The taps of a kernel column read one box of x where the stride along the height is 1
# (ConvGemmPlan.shared_rows): kh taps' rows of a patch of tile_h rows are tile_h + (kh - 1)
# x dilation rows of x, copied once for the kh k-steps; for the k-step widths of
# SHARED_ROWS_K_BYTES (the narrow one, whose copies of 64-byte rows are the mainloop's
# largest part), where the box has at most 1 / SHARED_ROWS_MIN_SAVING of the
# kh x tile_h rows the taps' own boxes would copy, and then in patches narrowed to
# SHARED_ROWS_PATCH_W where that covers the output as well (taller patches, more rows of
# their box shared). On an H200 (bf16, the conv kernel, 32-byte k-steps then,
# benchmarks/NOTES.md): conv2d_bn_relu 85.8 us, shared in 128-wide patches 73.1, in
# 64-wide ones 71.9 (in 32-wide ones 81.2: the finish's runs get short);
# conv2d_dilated_gelu's 2-row patches, whose box of 6 rows saves none, 72.5 apart and
# 74.9 shared; 128-byte k-steps (conv2d_relu_bias) 53.4 apart and 60.1 shared.
SHARED_ROWS = True
SHARED_ROWS_K_BYTES = (64,)
SHARED_ROWS_MIN_SAVING = 1.5
SHARED_ROWS_PATCH_W = 64
# Where one channel tile covers C_out, every tile of a CTA multiplies by the same
# weights: with RESIDENT_WEIGHTS the producer copies all k-steps' weights once (at most
# RESIDENT_MAX_BYTES) and the ring's stages hold x alone (ConvGemmPlan.resident_weights;
# a 3 x 3 conv's 12 copies a tile of a shared box become 3). Off: right on an H100
# (tests/test_gpu.py, test_in_kernel_conv_with_resident_weights); the conv kernel
# (`kernel_variants --plan RESIDENT_WEIGHTS=True`, H100, us): conv2d_bn_relu float32
# 56.8 -> 49.6, bf16 57.8 -> 55.3; conv2d_relu_maxpool 64.0 -> 63.8 (bf16), 55.0 -> 55.5
# (float32); conv2d_gn_silu bf16 15.2 -> 16.1.
RESIDENT_WEIGHTS = False
RESIDENT_MAX_BYTES = 64 * 1024
# Every tap of a depth plane reads one window of x (ConvGemmPlan.window): a stride-1
# conv's tile reads tile_h + (kh - 1) x dilation rows of tile_w + (kw - 1) x dilation
# pixels once a k-step, a TMA box a 16-byte column of channels (only those holding x's
# channels), unswizzled, so that a tap's shift by one pixel is a descriptor's start
# (desc_nosw); m64 blocks inside one patch row (patches of 64 or 128 columns). A 3 x 3
# conv of 16 bf16 channels in patches of 64 x 4: 2 copies of 396 16-byte rows a tile,
# where the shared box copies 3 boxes of 384 64-byte rows. Taken only where C_in leaves
# a 16-byte column of the k-step empty (render.conv_gemm_plan): the conv kernel on an
# H100 (us, `kernel_variants --plan WINDOW_BOX=True`), shared box -> window, bf16 of 16
# channels (32 of the k-step's 64 bytes): conv2d_bn_relu 57.8 -> 53.0,
# conv2d_dilated_gelu 71.9 -> 55.5, conv2d_relu_maxpool 63.5 -> 55.2,
# conv2d_tanh_avgpool 65.5 -> 57.5; float32 conv3d_bn_relu (4 channels) 471.1 -> 189.0;
# where C_in fills the k-step it lost: float32 of 16 channels conv2d_bn_relu 56.7 -> 66.0,
# conv2d_dilated_gelu 59.1 -> 73.4, conv2d_tanh_avgpool 60.7 -> 65.1; unet3d_conv_gn_silu
# bf16 (32 channels) 56.1 -> 66.4. Right on an H100 (the GPU tier's in-kernel conv tests
# with it on, test_in_kernel_conv_with_a_window, and the GPU fuzzer); `--plan
# WINDOW_BOX=False` times the shared box's form.
WINDOW_BOX = True
WINDOW_K_BYTES = (64,)


@dataclass(frozen=True)
class ConvGemmPlan:
    """The in-kernel conv's tiling.

    Attributes:
        block_n: output channels a tile (a multiple of 8, at most 256).
        block_m: output pixels a tile (BLOCK_M, or TALL_BLOCK_M for ping-pong tiles of few channels).
        k_bytes: input-channel bytes a k-step (`k_step_bytes`): the tiles' rows, the swizzle's width.
        tile_h, tile_w: the output pixel patch of a tile (tile_h x tile_w = block_m).
        stages: the ring's depth.
        pingpong: each consumer warpgroup takes whole tiles in turn (one's finish under
            the other's mainloop; block_n <= PINGPONG_MAX_N), else both take each tile.
        stats: the tiles write each channel's moments over their pixels (a norm's
            statistics, `stats_floats`), beside the conv's value.
        nchw: x is read in its NCHW layout (`reads_nchw`): an m64 block's 64 pixels of a
            patch row by a k-step's channels a box, MN-major (the wgmma's transposed A),
            not the channels-last copy's rows of channels.
        reduce: the tiles reduce each channel over their pixels (a spatial reduction,
            REDUCES) and write that instead of the conv's output.
        softmax: 0, or 1 (softmax) or 2 (log_softmax) over each pixel's channels, all in
            the tile (PIXEL_NORMS), applied before the tile is staged.
        pixel_reduce: "" or the reduction over each pixel's channels ("sum", "mean",
            "logsumexp", "amax", "amin"), all in the tile (PIXEL_REDUCES): one value a
            pixel is written, nothing staged.
        pool: () or the (rows, columns) of a pooling window whose stride is the window,
            unpadded (POOLS_IN_TILE): the staged tile is pooled and only the pooled plane
            is written; the patch holds whole windows.
        recompute: with `stats`: the kernel runs twice (`Anchor.recompute`), its first
            pass writing the tiles' moments alone, its second, after their merge, the
            chain with the norm applied in the tile; the conv's value is never written.
        shared_rows: a stage of the ring holds one box of x for the taps of a kernel
            column (and channel block), tile_h + (kh - 1) x dilation rows, and those taps'
            weights (SHARED_ROWS; stride 1 along the height, x channels-last).
        resident_weights: every k-step's weights are copied once a CTA and kept (one
            channel tile covers C_out: RESIDENT_WEIGHTS); the ring's stages hold x alone.
        window: every tap of a depth plane reads one window of x, tile_h + (kh - 1) x
            dilation rows of tile_w + (kw - 1) x dilation pixels, a box a 16-byte column of
            channels, unswizzled (WINDOW_BOX; stride 1, patches of 64 or 128 columns).
    """

    block_n: int
    tile_h: int
    tile_w: int
    stages: int
    pingpong: bool = False
    stats: bool = False
    k_bytes: int = 128
    block_m: int = BLOCK_M
    nchw: bool = False
    reduce: bool = False
    softmax: int = 0
    pixel_reduce: str = ""
    pool: tuple = ()
    recompute: bool = False
    shared_rows: bool = False
    resident_weights: bool = False
    window: bool = False

    def describe(self) -> str:
        """The tiling in words (`benchmarks.zoo --chains` prints it)."""
        parts = [f"tiles of {self.block_n} channels x {self.tile_h} x {self.tile_w} pixels",
                 f"{self.k_bytes}-byte k-steps", f"{self.stages} stages"]
        parts += [words for words, on in (("ping-pong", self.pingpong), ("x read NCHW", self.nchw),
                                          ("a kernel column's taps sharing a box", self.shared_rows),
                                          ("resident weights", self.resident_weights),
                                          ("a tile's whole window a box", self.window)) if on]
        return ", ".join(parts)

    def name(self, spec, arch: str) -> str:
        return (f"igemm{self.block_m}x{self.block_n}{'_nchw' if self.nchw else ''}{'_sr' if self.shared_rows else ''}"
                f"{'_rw' if self.resident_weights else ''}{'_win' if self.window else ''}"
                f"{'_rc' if self.recompute else ''}_"
                + spec.kernel_name(arch + "a"))


def reads_nchw(plan: "ConvGemmPlan", itemsize: int, stride_w: int, width: int, kernel_w: int = 1,
               padding_w: int = 0, dilation_w: int = 1, stride_h: int = 1) -> bool:
    """Whether the in-kernel conv of `plan` may read an NCHW x of `width` input columns.
    16-bit (READS_NCHW; the wgmma reads A MN-major from shared memory): stride 1 along the
    width (a box of NCHW_BOX_W neighbouring pixels), patches of whole boxes, rows of whole
    16 bytes (the tensor map's strides), and each of the `kernel_w` taps' boxes starting
    on a 16-byte column (tap * dilation_w - padding_w in whole 16 bytes; the patches start
    at multiples of NCHW_BOX_W). float32 (READS_NCHW_TF32; A loaded into registers,
    `nchw_box_w`): stride 1, patches 64 or 128 wide, rows of whole 16 bytes, and MIN_STAGES
    of the ring's stages in shared memory with the wider box (`nchw_stages`)."""
    if itemsize == 4:
        return (READS_NCHW_TF32 and stride_w == 1 and stride_h == 1 and plan.tile_w in (64, 128)
                and plan.block_m == BLOCK_M and width * itemsize % 16 == 0 and not plan.shared_rows
                and not plan.window and not plan.resident_weights and nchw_stages(plan, itemsize) >= MIN_STAGES)
    per_16_bytes = 16 // itemsize
    taps_aligned = all((t * dilation_w - padding_w) % per_16_bytes == 0 for t in range(kernel_w))
    return (READS_NCHW and itemsize == 2 and stride_w == 1 and plan.tile_w % NCHW_BOX_W == 0
            and width * itemsize % 16 == 0 and taps_aligned)


def nchw_box_w(tile_h: int, tile_w: int) -> int:
    """The columns of a float32 NCHW box (the rendered file's kNchwBoxW where x is read NCHW
    in float32): the patch's tile_w, the 0 to 3 columns a tap's shift puts before it (the box
    starts on a 16-byte column), and spare ones so that a channel's tile_h rows of the box
    are 8 banks past a multiple of 32 floats: a warp's A fragment (8 neighbouring pixels of
    4 channels) then reads 32 distinct banks. tile_h 1: tile_w + 8; 2: tile_w + 4.

    Raises:
        ValueError: a patch of more than two rows (no such width: 4 rows of whole 16
            bytes are a multiple of 16 floats).
    """
    for w in range(tile_w + 4, tile_w + 36, 4):
        if w * tile_h % 32 in (8, 24):
            return w
    raise ValueError(f"no float32 NCHW box for a patch of {tile_h} x {tile_w}")


def nchw_stage_a(plan: "ConvGemmPlan") -> int:
    """A float32 NCHW stage's bytes of x (the rendered file's kStageA): a box of the patch's
    rows by the k-step's channels, to 1024 bytes (the next stage's weights' swizzle atom)."""
    box = (plan.k_bytes // 4) * plan.tile_h * nchw_box_w(plan.tile_h, plan.tile_w) * 4
    return -(-box // 1024) * 1024


def nchw_stages(plan: "ConvGemmPlan", itemsize: int) -> int:
    """The ring's stages of `plan` where x is read NCHW in float32: `plan.stages` at most,
    as many as shared memory holds beside the staging tile (and the moments) with the box
    of `nchw_stage_a` (wider than the channels-last stage's tile_w pixels)."""
    staging = staging_bytes(plan.block_n, plan.tile_h, plan.tile_w, itemsize, plan.stats, pingpong=False)  # cooperative
    stage = nchw_stage_a(plan) + plan.block_n * plan.k_bytes
    return min(plan.stages, (SMEM_BUDGET - staging) // stage)


def k_step_bytes(cin: int, itemsize: int) -> int:
    """Bytes of input channels a k-step: the narrowest of K_STEP_BYTES that holds a
    pixel's C_in, 128 where none does (then C_in takes several k-steps a tap)."""
    return next((b for b in K_STEP_BYTES if cin * itemsize <= b), K_STEP_BYTES[-1])


def x_pitch(cin: int, itemsize: int) -> int:
    """The elements between two pixels of the channels-last x the in-kernel conv reads:
    C_in rounded up to whole 16 bytes (PAD_PIXELS; TMA's strides)."""
    per_16_bytes = 16 // itemsize
    return -(-cin // per_16_bytes) * per_16_bytes


def padded_in_channels(cin: int, dtype: str) -> int:
    """The weight's input channels as the kernel reads them ([C_out, kh, kw, C_in']):
    C_in padded with zeros to whole k-steps, so that no box reaches past a row's end."""
    itemsize = 4 if dtype == "float32" else 2  # WGMMA_TYPES: float32 (as TF32), bf16, fp16
    step = k_step_bytes(cin, itemsize) // itemsize
    return -(-cin // step) * step


def staging_pitch(tile_h: int, tile_w: int, itemsize: int) -> int:
    """The rendered file's kPitch (conv_sm90.cuh): the elements between two channels of
    the staging tile, a slot of tile_w + 16 bytes for each of the patch's rows, rounded
    up to 64 bytes, + 16."""
    out_v = 16 // itemsize
    return -(-tile_h * (tile_w + out_v) * itemsize // 64) * 64 // itemsize + out_v


def stats_floats(block_n: int, pingpong: bool) -> int:
    """The shared floats of a tile's moments (the kernel's kStatsFloats, a consumer
    warpgroup's in ping-pong): a sum a (finishing warp, channel) for each of the two
    passes (mean, then M2), and the channels' means."""
    warps = 4 if pingpong else 8
    return (2 * warps + 1) * block_n * (2 if pingpong else 1)


def staging_bytes(block_n: int, tile_h: int, tile_w: int, itemsize: int, stats: bool, pingpong: bool) -> int:
    """The staging tile's bytes and, with `stats`, the tile's moments' (the kernel's
    kStaging + kStatsBytes): the shared memory a CTA holds beside its ring."""
    staging = block_n * staging_pitch(tile_h, tile_w, itemsize) * itemsize
    return staging + (4 * stats_floats(block_n, pingpong) if stats else 0)


def patch_width(wo: int, widest: int) -> int:
    """Of the power-of-two patch widths from NARROWEST_PATCH_W (or `widest`, if that is
    narrower) to `widest`, the widest whose patches cover `wo` columns with the fewest
    outside them (94: 32, three patches of 96 columns; 126: 128; 56: 64)."""
    widths = [w for w in (8 << i for i in range(widest.bit_length() - 3)) if w >= min(widest, NARROWEST_PATCH_W)]
    return min(widths, key=lambda w: (-(-wo // w) * w, -w))


def tiling(cout: int, wo: int, itemsize: int, stats: bool = False, k_bytes: int = 128,
           stride_w: int = 1, ho: int = 0, narrow: bool = True, tap_rows: tuple = (),
           k_steps: int = 0, window: tuple = ()) -> ConvGemmPlan:
    """The tile for C_out channels and an output of `ho` x `wo` pixels (`ho` 0: not
    known): the fewest channel tiles of a BLOCK_N width, the narrowest that covers C_out
    in that many; a patch as wide as the output (a power of two, 8 to MAX_PATCH_W, and at
    most MAX_BOX / stride_w: the input box it reads spans the patch's width times the
    stride), or with `narrow` narrower where that leaves fewer columns outside it
    (`patch_width`);
    TALL_BLOCK_M pixels where the tile is ping-pong, of at most TALL_MAX_N channels, over
    k-steps of at most TALL_MAX_K_BYTES, and its patch's rows fit the output's height,
    else BLOCK_M; and as many ring stages of k-steps of `k_bytes` (`k_step_bytes`) as
    shared memory holds beside the staging tile (and, with `stats`, the tile's moments),
    RING_BYTES_K bytes of k-steps at most. Where fewer than MIN_STAGES fit beside that
    tile's staging (a narrow patch's many runs, the moments of a wide tile), a tile of
    BLOCK_M pixels, then the next narrower width is taken. `tap_rows`, (kh, dilation)
    of a kernel whose column's taps may share a box of x (`ConvGemmPlan.shared_rows`): the
    patch narrowed to SHARED_ROWS_PATCH_W where it covers as many columns, and the box
    shared where its tile_h + (kh - 1) x dilation rows (MAX_BOX at most) are at most 1 /
    SHARED_ROWS_MIN_SAVING of the taps' kh x tile_h and MIN_STAGES of its stages fit; a
    stage then holds that box and kh taps' weights, and the ring RING_BYTES_K / kh bytes of
    k-steps at most (MIN_STAGES at least). `k_steps`, a tile's k-steps where its weights
    may stay resident (RESIDENT_WEIGHTS): where one channel tile covers C_out and their
    bytes are at most RESIDENT_MAX_BYTES, they take their room once and the stages hold
    x alone. `window`, (kh, kw, dilation_h, dilation_w) of a stride-1 kernel whose plane of
    taps may read one window of x (WINDOW_BOX, `ConvGemmPlan.window`): patches of 64 or
    128 columns that cover as many, a stage the window's 16-byte columns of a k-step and
    kh x kw taps' weights, taken first where MIN_STAGES of them fit.

    Raises:
        ValueError: k_bytes is not one of K_STEP_BYTES, or stride_w not 1 to MAX_STRIDE.
    """
    if k_bytes not in K_STEP_BYTES:
        raise ValueError(f"a k-step of {k_bytes} bytes (the swizzles: {K_STEP_BYTES})")
    if not 1 <= stride_w <= MAX_STRIDE:
        raise ValueError(f"stride {stride_w} (the tensor map reads 1 to {MAX_STRIDE})")
    widths = BLOCK_N[itemsize]
    n_tiles = -(-cout // widths[-1])
    preferred = next(n for n in widths if n * n_tiles >= cout)
    tile_w = 8
    while tile_w < min(wo, MAX_PATCH_W) and 2 * tile_w * stride_w <= MAX_BOX:
        tile_w *= 2
    if narrow:
        tile_w = patch_width(wo, tile_w)
    # A patch taller than the whole output widens where its tiles then cover fewer
    # pixels, rows and columns counted (a Conv1d as a 2-D conv of one row, `Anchor.as_2d`:
    # 300 columns in patches of 2 x 64 cover 640 pixels, of 1 x 128 384).
    def covered(w: int) -> int:
        rows = BLOCK_M // w
        return -(-ho // rows) * rows * -(-wo // w) * w

    wider = tile_w
    while ho and BLOCK_M // wider > ho and wider < MAX_PATCH_W and 2 * wider * stride_w <= MAX_BOX:
        wider *= 2
        if covered(wider) < covered(tile_w):
            tile_w = wider
    for block_n in sorted((n for n in widths if n <= preferred), reverse=True):
        pingpong = block_n <= PINGPONG_MAX_N
        tall = (pingpong and block_n <= TALL_MAX_N and k_bytes <= TALL_MAX_K_BYTES
                and (ho == 0 or TALL_BLOCK_M // tile_w <= ho))
        for block_m in (TALL_BLOCK_M, BLOCK_M) if tall else (BLOCK_M,):
            kh, dilation = tap_rows or (1, 1)

            def shares(w: int) -> bool:  # a kernel column's taps share the box of a patch w wide
                rows = block_m // w
                box = rows + (kh - 1) * dilation
                return bool(tap_rows) and box <= MAX_BOX and kh * rows >= SHARED_ROWS_MIN_SAVING * box

            def narrowest(fits) -> int:
                # taller patches share more of their box or window: the narrowest from
                # SHARED_ROWS_PATCH_W that covers as many columns, its rows the output's at most
                cover = -(-wo // tile_w) * tile_w
                return min((w for w in (SHARED_ROWS_PATCH_W << i for i in range(4)) if w <= tile_w
                            and -(-wo // w) * w == cover and (not ho or block_m // w <= ho) and fits(w)),
                           default=0) if narrow else 0

            patch_w = narrowest(shares) or tile_w
            weights = k_steps * block_n * k_bytes  # every k-step's weights, kept where one tile covers C_out
            resident = bool(k_steps) and cout <= block_n and weights <= RESIDENT_MAX_BYTES
            win_kh, win_kw, win_dh, win_dw = window or (1, 1, 1, 1)

            def windows(w: int) -> bool:  # every tap of a plane reads one window of x, patches w wide
                return (bool(window) and w % 64 == 0 and w + (win_kw - 1) * win_dw <= MAX_BOX
                        and block_m // w + (win_kh - 1) * win_dh <= MAX_BOX)

            window_w = narrowest(windows)
            # A window where MIN_STAGES of its stages fit, else a shared box, else a box a tap
            modes = ([("window", window_w)] if window_w else []) + ([("shared", patch_w)] if shares(patch_w) else [])
            for mode, w in modes + [("tap", tile_w)]:
                rows = block_m // w
                if mode == "window":  # the window's 16-byte columns, each to 128 bytes, to the weights' atom
                    column = -(-((w + (win_kw - 1) * win_dw) * (rows + (win_kh - 1) * win_dh) * 16) // 128) * 128
                    x_bytes, taps = -(-(k_bytes // 16 * column) // (8 * k_bytes)) * (8 * k_bytes), win_kh * win_kw
                elif mode == "shared":  # a box of the kernel column's rows, kh taps' weights
                    x_bytes, taps = (rows + (kh - 1) * dilation) * w * k_bytes, kh
                else:  # an x box and a w box a k-step of k_bytes-byte rows
                    x_bytes, taps = block_m * k_bytes, 1
                stage = x_bytes + (0 if resident else taps * block_n * k_bytes)  # (the weights resident: x alone)
                staging = staging_bytes(block_n, rows, w, itemsize, stats, pingpong) + (weights if resident else 0)
                stages = min(max(RING_BYTES_K // k_bytes // taps, MIN_STAGES), (SMEM_BUDGET - staging) // stage)
                if stages >= MIN_STAGES:
                    return ConvGemmPlan(block_n, rows, w, stages, pingpong=pingpong, stats=stats, k_bytes=k_bytes,
                                        block_m=block_m, shared_rows=mode == "shared", window=mode == "window",
                                        resident_weights=resident)
    raise AssertionError(f"no tile of {widths} fits {MIN_STAGES} stages ({cout}, {wo}, {itemsize})")  # 32 always fits


def wgmma_asm(dtype: str, n: int, a_mn_major: bool = False) -> str:
    """One m64nNk16 wgmma (k8 in TF32): N / 2 float32 accumulators `d`, both operands
    K-major from shared memory, or A MN-major (`a_mn_major`, 16-bit only).

    Raises:
        ValueError: an MN-major A in TF32.
    """
    t, _ = WGMMA_TYPES[dtype]
    if a_mn_major and t == "tf32":
        raise ValueError("TF32 wgmma reads K-major operands only")
    transpose = (", 1, 0" if a_mn_major else ", 0, 0") if t != "tf32" else ""
    return _wgmma_statement(dtype, n, ["desc_a"], "l", transpose)


def wgmma_regs_asm(dtype: str, n: int) -> str:
    """One m64nNk16 wgmma (k8 in TF32) whose A is four 32-bit registers of each thread
    (`a`: its fragment, as mma.m16n8k8's / m16n8k16's A a warp), B K-major from shared
    memory: N / 2 float32 accumulators `d`."""
    t, _ = WGMMA_TYPES[dtype]
    return _wgmma_statement(dtype, n, [f"a[{i}]" for i in range(4)], "r", ", 0" if t != "tf32" else "")


def _wgmma_statement(dtype: str, n: int, a: list[str], a_kind: str, tail: str) -> str:
    """The asm statement of one wgmma m64nN of `dtype` into the N / 2 float32 accumulators
    `d`: A the C++ operands `a` (one descriptor, or a fragment's registers: braced), B the
    descriptor `desc_b`, the accumulators scaled by `scale_d` != 0, and `tail` (the
    transpose flags a 16-bit wgmma takes) after the scales."""
    t, k = WGMMA_TYPES[dtype]
    acc = n // 2
    regs = ", ".join(f"%{i}" for i in range(acc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(acc))
    a_ops = ", ".join(f"%{acc + i}" for i in range(len(a)))
    a_ops = a_ops if len(a) == 1 else "{" + a_ops + "}"
    b, scale = acc + len(a), acc + len(a) + 1
    inputs = ", ".join([f'"{a_kind}"({x})' for x in a] + ['"l"(desc_b)', '"r"(scale_d)'])
    return (
        "asm volatile(\n"
        f'      "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{scale}, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{t}.{t} {{{regs}}}, {a_ops}, %{b}, p, 1, 1{tail};\\n}}\\n"\n'
        f"      : {outs}\n"
        f"      : {inputs});"
    )


# The conv's constants, the wgmma instruction, the kernel named per spec around
# conv_sm90.cuh's body, and its launch; inside KERNEL_FILE (after Args and the stage
# functions). Placeholders:
#   $kernel     the kernel name (prefix of the __global__)
#   $bm         tile pixels (ConvGemmPlan.block_m)
#   $bn         tile channels (ConvGemmPlan.block_n)
#   $bk         input channels a k-step (ConvGemmPlan.k_bytes of them)
#   $mma_k      K of one wgmma instruction
#   $stages     the ring's depth
#   $th         the tile's pixel patch: rows
#   $tw         ... and columns
#   $cin        the input's channels
#   $x_pitch    the elements between two pixels of channels-last x (x_pitch; $cin where NCHW)
#   $h          the input's height
#   $w          the input's width
#   $kh         the kernel's height
#   $kw         the kernel's width
#   $ph         the padding of the height
#   $pw         the padding of the width
#   $sh         the stride of the height (1 to MAX_STRIDE)
#   $sw         the stride of the width (1 to MAX_STRIDE)
#   $dh         the dilation of the height
#   $dw         the dilation of the width
#   $ho         the output's height (a 3-D conv's: of one depth plane)
#   $wo         the output's width
#   $depth      a 3-D conv (`Anchor.depth`): true or false
#   $d          the input's depth (1 where 2-D)
#   $kd         the kernel's depth (1 where 2-D)
#   $pd         the padding of the depth (0 where 2-D)
#   $sd         the stride of the depth (1 where 2-D)
#   $dd         the dilation of the depth (1 where 2-D)
#   $do         the output's depth (1 where 2-D)
#   $pitch      the staging tile's elements between two channels (staging_pitch)
#   $pingpong   the consumers' schedule: true (ping-pong) or false (cooperative)
#   $stats      the tiles write their channels' moments (ConvGemmPlan.stats): true or false
#   $reduce     the tiles reduce their channels instead of writing them (ConvGemmPlan.reduce)
#   $pixel_reduce  the tiles reduce each pixel's channels, all in the tile (ConvGemmPlan.pixel_reduce)
#   $reduce_op  either reduction (a fusedepi::RowReduce; kSum where none)
#   $softmax    ConvGemmPlan.softmax
#   $value_stage1  value_stage1's body: stage1 on one value (ConvGemmPlan.softmax, .pixel_reduce,
#               .pool), else nothing
#   $pool       a pooling window in the tiles (ConvGemmPlan.pool): true or false
#   $pool_kh    its window (and stride): rows (1 where none)
#   $pool_kw    ... and columns
#   $pool_max   max (true) or avg (false)
#   $pool_divisor  avg's divisor: the window's size, or divisor_override (1 where none)
#   $pool_ho    the pooled plane's rows (the output's where none)
#   $pool_wo    ... and columns
#   $nchw       x read in its NCHW layout (ConvGemmPlan.nchw): true or false
#   $nchw_box_w pixels of an NCHW box (NCHW_BOX_W; float32: nchw_box_w, its columns)
#   $recompute  the norm recomputed (ConvGemmPlan.recompute): true or false
#   $shared_rows  a kernel column's taps share one box of x (ConvGemmPlan.shared_rows): true or false
#   $resident_weights  every k-step's weights copied once a CTA (ConvGemmPlan.resident_weights): true or false
#   $window     every tap of a depth plane reads one window of x (ConvGemmPlan.window): true or false
#   $norm_chan  NormChan's fields, norm_chan_of's and norm_stage1's bodies (render: the norm's
#               stage1 operands and statistics for the normed pass, else nothing)
#   $parts_at   where the moments or the reductions go: floats from the workspace's start
#   $wgmma      the wgmma_asm() statement
#   $wgmma_regs the wgmma_regs_asm() statement (A from registers: float32 x read NCHW)
CONV_KERNELS = Template(
    r"""// In-kernel conv (cuda_templates/conv_sm90.py): out = chain(conv2d(x, w)), an implicit GEMM.
namespace hop = fusedepi::sm90;

constexpr int kBM = $bm, kBN = $bn, kBK = $bk, kStages = $stages, kMmaK = $mma_k;
constexpr int kTH = $th, kTW = $tw;  // the tile's output pixels: kTH rows of kTW
constexpr int kCin = $cin, kH = $h, kW = $w;
constexpr int kXPitch = $x_pitch;  // elements between two pixels of channels-last x (C_in to 16 bytes)
constexpr int kKH = $kh, kKW = $kw, kPH = $ph, kPW = $pw;
constexpr int kSH = $sh, kSW = $sw, kDH = $dh, kDW = $dw;  // stride, dilation
// A 3-D conv (kDepth): x [rows, D, H, W, C_in], taps kKD x kKH x kKW; its output's kDo
// depth planes of kHoPlane rows are the kHo rows of one plane [kDo x kHoPlane, kWo] to
// the tiles (NCDHW holds them so), a patch inside one depth plane.
constexpr bool kDepth = $depth;
constexpr int kD = $d, kKD = $kd, kPD = $pd, kSD = $sd, kDD = $dd, kDo = $do;
constexpr int kTaps = kKD * kKH * kKW;
constexpr int kHoPlane = $ho, kHo = kDo * kHoPlane, kWo = $wo;
constexpr int kPitch = $pitch;  // the staging tile's elements between two channels
constexpr bool kPingPong = $pingpong;  // the consumers' schedule (conv_sm90.cuh)
constexpr bool kConvStats = $stats;  // the tiles write their channels' moments (conv_sm90.cuh)
constexpr bool kConvReduce = $reduce;  // the tiles reduce their channels, nothing else written (conv_sm90.cuh)
constexpr bool kConvPixelReduce = $pixel_reduce;  // ... or each pixel's channels, one value a pixel written
constexpr fusedepi::RowReduce kReduceOp = $reduce_op;  // the reduction of either
constexpr int kConvSoftmax = $softmax;  // 1 softmax, 2 log_softmax over each pixel's channels in the tile
// stage1 (the reduction's normalize where it has one, then the steps after it) on one
// value v in the tiles: at its channel's place pos in the row and its element e0 of the
// output, with a normalize's statistics (s0, s1) (kConvSoftmax, kConvPixelReduce, kConvPool).
[[maybe_unused]] __device__ __forceinline__ void value_stage1(float& v, int pos, long long e0, const Args& a, float s0,
                                                              float s1) {
$value_stage1
}
// A pooling window over each channel's plane in place of the output's stores (conv_sm90.cuh, pool_runs):
// kPoolKH x kPoolKW, its stride; max or avg (by kPoolDivisor); the pooled plane kPoolHo x kPoolWo.
constexpr bool kConvPool = $pool;
constexpr int kPoolKH = $pool_kh, kPoolKW = $pool_kw, kPoolDivisor = $pool_divisor;
constexpr int kPoolHo = $pool_ho, kPoolWo = $pool_wo;
constexpr bool kPoolMax = $pool_max;
constexpr bool kNchw = $nchw;  // x read in its NCHW layout, boxes of kNchwBoxW pixels (conv_sm90.cuh)
// A norm recomputed: the conv runs twice, for the moments, then for the normed chain (conv_sm90.cuh's passes).
constexpr bool kRecompute = $recompute;
constexpr int kNchwBoxW = $nchw_box_w;
// float32 x read NCHW (conv_sm90.nchw_box_w): a k-step's box is kBK channels of the patch's
// kTH rows of kNchwBoxW columns from a 16-byte column, unswizzled; the consumers load their
// A fragments from it into registers, rounded to TF32 (conv_sm90.cuh).
constexpr bool kNchwRegs = kNchw && sizeof(T) == 4;
constexpr int kNchwBoxBytes = kNchwRegs ? kBK * kTH * kNchwBoxW * 4 : 0;
[[maybe_unused]] constexpr long long kPartsAt = $parts_at;  // ... at a.ws + kPartsAt (kConvStats, kConvReduce)
constexpr int kCBlocks = (kCin + kBK - 1) / kBK;  // k-steps a tap
constexpr int kCinPad = kCBlocks * kBK;  // the weight's input channels, padded with zeros by the launcher
constexpr int kKSteps = kTaps * kCBlocks;
// The taps of a kernel column share a box of x (ConvGemmPlan.shared_rows, conv_sm90.cuh's
// producer), or every tap of a depth plane of them one window of x (ConvGemmPlan.window):
// kTapRows k-steps a load of the ring, kLoads loads a tile.
constexpr bool kSharedRows = $shared_rows;
constexpr bool kWindow = $window;
constexpr int kTapRows = kWindow ? kKH * kKW : kSharedRows ? kKH : 1;
constexpr int kLoads = kKSteps / kTapRows;
constexpr int kBoxRows = kSharedRows ? kTH + (kKH - 1) * kDH : kTH * kSH;  // x's box: rows (strides spanned)
// kWindow: the tile's input window (stride 1), kWinH rows of kWinW pixels, one box a
// 16-byte column of channels (kChunkElems of them), unswizzled rows of 16 bytes, each
// column kChunkBytes after the last (desc_nosw's K stride)
constexpr int kWinW = kTW + (kKW - 1) * kDW, kWinH = kTH + (kKH - 1) * kDH;
constexpr int kChunkElems = 16 / static_cast<int>(sizeof(T)), kWinChunks = kBK / kChunkElems;
constexpr int kWinBoxBytes = kWinW * kWinH * 16, kChunkBytes = (kWinBoxBytes + 127) / 128 * 128;
// x's box of a channels-last tensor map: channels, pixels, rows (a window's, or a patch's spanning its strides)
constexpr cuuint32_t kXBox[3] = {static_cast<cuuint32_t>(kWindow ? kChunkElems : kBK),
                                 static_cast<cuuint32_t>(kWindow ? kWinW : kTW * kSW),
                                 static_cast<cuuint32_t>(kWindow ? kWinH : kBoxRows)};
constexpr int kTilesN = static_cast<int>((kChannels + kBN - 1) / kBN);
constexpr int kTilesPerImage = kDo * ((kHoPlane + kTH - 1) / kTH) * ((kWo + kTW - 1) / kTW) * kTilesN;
constexpr int kElem = static_cast<int>(sizeof(T));
constexpr int kSwizzle = kBK * kElem;  // a k-step's bytes: the tiles' rows, in the swizzle of that width
constexpr int kTileB = kBN * kSwizzle;  // a tap's weights: bytes
// A stage's bytes: x's patch (kSharedRows: the box of kBoxRows rows of kTW pixels; kWindow: the
// window's columns, to the weights' swizzle atom), and its taps' weights
constexpr int kStageA = kWindow ? (kWinChunks * kChunkBytes + 8 * kSwizzle - 1) / (8 * kSwizzle) * (8 * kSwizzle)
                        : kNchwRegs ? (kNchwBoxBytes + 1023) / 1024 * 1024  // conv_sm90.nchw_stage_a
                                    : (kSharedRows ? kBoxRows * kTW : kBM) * kSwizzle;
constexpr int kStageB = kTapRows * kTileB;
// Every k-step's weights copied once a CTA and kept (ConvGemmPlan.resident_weights): the stages hold x alone.
constexpr bool kResidentW = $resident_weights;
constexpr int kWeightBytes = kKSteps * kTileB;
constexpr int kWeightsRoom = kResidentW ? kWeightBytes : kStages * kStageB;  // the weights' shared memory

__device__ __forceinline__ void wgmma_n(float (&d)[kBN / 2], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  $wgmma
}
[[maybe_unused]] __device__ __forceinline__ void wgmma_regs_n(float (&d)[kBN / 2], const uint32_t (&a)[4],
                                                              uint64_t desc_b, int scale_d) {
  $wgmma_regs
}

// The norm applied in the normed pass's tiles (kRecompute): a channel's operands, and stage1 on one value.
$norm_chan

#include "fusedepi/conv_sm90.cuh"

constexpr int kConvSmem = kStages * kStageA + kWeightsRoom + kStaging + kStatsBytes + 1024;  // + alignment slack
static_assert(kTH * kTW == kBM && kTW >= 8, "a tile's patch: kBM pixels, rows of 8 or more");
static_assert(kBM == 128 || (kBM == 256 && kPingPong), "tiles of 128 pixels, or 256 in ping-pong");
static_assert(!kNchw || kNchwRegs ||
                  (kElem == 2 && kSW == 1 && kTW % kNchwBoxW == 0 && kNchwBoxW * kElem == 128 &&
                   kW * kElem % 16 == 0 && kBK % 16 == 0),
              "an NCHW x: 16-bit, stride 1 along the width, patches of whole 128-byte boxes, rows of 16 bytes");
static_assert(!kNchwRegs || (kSW == 1 && kSH == 1 && kTH <= 2 && kTW % 64 == 0 && kW * kElem % 16 == 0 &&
                             kNchwBoxW >= kTW + 4 && kNchwBoxW % 4 == 0 && kNchwBoxW <= 256 &&
                             (kTH * kNchwBoxW % 32 == 8 || kTH * kNchwBoxW % 32 == 24) && !kPingPong &&
                             !kSharedRows && !kWindow && !kResidentW),
              "a float32 NCHW x: stride 1, m64 blocks inside a patch row of 64 or 128, a box of whole 16 bytes "
              "from 0-3 columns before the patch, its rows 8 banks past 32 floats, cooperative consumers");
static_assert((kSwizzle == 64 || kSwizzle == 128 || (kWindow && kSwizzle == 32)) && kBK % kMmaK == 0 &&
                  kMmaK * kElem == 32,
              "rows of 64 or 128 bytes (conv_sm90.K_STEP_BYTES; 32 with a window), 32 bytes a wgmma");
static_assert(kTileB % (8 * kSwizzle) == 0 && kStageA % (8 * kSwizzle) == 0 && kTW % 8 == 0,
              "each stage's tiles, and a tap's rows of a shared box, aligned to the swizzle's 8-row atom");
static_assert(!kSharedRows || (kSH == 1 && kKH > 1 && !kNchw && kBoxRows <= 256),
              "a box shared down the kernel's height: stride 1 along it, channels-last x, 256 rows at most");
static_assert(!kWindow || (!kSharedRows && kSH == 1 && kSW == 1 && kTW % 64 == 0 && !kNchw && kWinW <= 256 &&
                            kWinH <= 256 && kChunkBytes < (1 << 18)),
              "a window: stride 1, m64 blocks inside a patch row, channels-last x, TMA's boxes, desc_nosw's strides");
static_assert(!kResidentW || (kTilesN == 1 && kWeightBytes < (1 << 20)),
              "resident weights: one channel tile (every tile's n0 0), one barrier phase's bytes");
static_assert(kBN % 8 == 0 && kBN <= 256 && kChannels % 8 == 0, "wgmma's N; whole 8-channel chunks");
static_assert(kXPitch * kElem % 16 == 0 && kXPitch >= kCin && (!kNchw || kXPitch == kCin), "TMA's 16-byte strides");
static_assert(kSH >= 1 && kSH <= 8 && kSW >= 1 && kSW <= 8 && kTW * kSW <= 256 && kTH * kSH <= 256,
              "TMA's element strides (1 to 8) and boxes (256 elements a dim)");
static_assert(kConvSmem <= 227 * 1024, "sm_90's dynamic shared memory a block");
static_assert(kDepth || (kD == 1 && kKD == 1 && kPD == 0 && kSD == 1 && kDD == 1 && kDo == 1), "2-D: one plane");
static_assert(!kDepth || (!kNchw && !kConvPool), "a 3-D conv: channels-last x, no pooling window in the tiles");

template <int kPass>
__global__ void __launch_bounds__(384, 1) ${kernel}_conv(const __grid_constant__ CUtensorMap map_x,
                                                         const __grid_constant__ CUtensorMap map_w, const Args a) {
  conv_body<kPass>(map_x, map_w, a);
}

// Launches pass `pass` of the conv on `device` (conv_sm90.cuh: kPassOnce, or with
// kRecompute kPassMoments then kPassNormed): one CTA an SM (its shared memory), at most
// one a tile.
int conv_launch(const Args& a, int device, cudaStream_t stream, int pass) {
  constexpr int kFirst = kRecompute ? kPassMoments : kPassOnce, kLast = kRecompute ? kPassNormed : kPassOnce;
  if (pass != kFirst && pass != kLast) return static_cast<int>(cudaErrorInvalidValue);
  CUtensorMap map_x, map_w;
  if constexpr (kNchw) {  // [rows, C_in, H, W]: kNchwBoxW pixels of a row (float32: of kTH rows) by a k-step's channels
    const cuuint64_t x_dims[4] = {kW, kH, kCin, static_cast<cuuint64_t>(a.rows)};
    const cuuint64_t x_strides[3] = {static_cast<cuuint64_t>(kW) * kElem, static_cast<cuuint64_t>(kH) * kW * kElem,
                                     static_cast<cuuint64_t>(kCin) * kH * kW * kElem};
    const cuuint32_t x_box[4] = {kNchwBoxW, kNchwRegs ? kTH : 1, kBK, 1};
    if (int e = hop::encode_map<T>(&map_x, a.x, 4, x_dims, x_strides, x_box, kNchwRegs ? 0 : kNchwBoxW * kElem)) {
      return e;
    }
  } else if constexpr (kDepth) {  // [rows, D, H, W, C_in], pixels kXPitch elements apart: a box of one depth plane
    const cuuint64_t x_dims[5] = {kCin, kW, kH, kD, static_cast<cuuint64_t>(a.rows)};
    const cuuint64_t x_strides[4] = {static_cast<cuuint64_t>(kXPitch) * kElem,
                                     static_cast<cuuint64_t>(kW) * kXPitch * kElem,
                                     static_cast<cuuint64_t>(kH) * kW * kXPitch * kElem,
                                     static_cast<cuuint64_t>(kD) * kH * kW * kXPitch * kElem};
    const cuuint32_t x_box[5] = {kXBox[0], kXBox[1], kXBox[2], 1, 1};
    const cuuint32_t x_steps[5] = {1, kSW, kSH, 1, 1};
    if (int e = hop::encode_map<T>(&map_x, a.x, 5, x_dims, x_strides, x_box, kWindow ? 0 : kSwizzle, x_steps)) return e;
  } else {  // [rows, H, W, C_in], pixels kXPitch elements apart
    const cuuint64_t x_dims[4] = {kCin, kW, kH, static_cast<cuuint64_t>(a.rows)};
    const cuuint64_t x_strides[3] = {static_cast<cuuint64_t>(kXPitch) * kElem,
                                     static_cast<cuuint64_t>(kW) * kXPitch * kElem,
                                     static_cast<cuuint64_t>(kH) * kW * kXPitch * kElem};
    // A stride s: the box spans s times the patch, of which TMA reads every s-th pixel.
    // A window (kWindow): a box a 16-byte column of channels, kWinH rows of kWinW pixels, unswizzled.
    const cuuint32_t x_box[4] = {kXBox[0], kXBox[1], kXBox[2], 1};
    const cuuint32_t x_steps[4] = {1, kSW, kSH, 1};
    if (int e = hop::encode_map<T>(&map_x, a.x, 4, x_dims, x_strides, x_box, kWindow ? 0 : kSwizzle, x_steps)) return e;
  }
  if (int e = hop::encode_map_2d<T>(&map_w, a.w, kChannels, kTaps * kCinPad, kBN, kBK, kSwizzle)) return e;
  static int sms[64] = {};
  if (device >= 64) return static_cast<int>(cudaErrorInvalidDevice);
  if (sms[device] == 0) {  // once a device: the shared-memory limit of each pass's kernel, and the SM count
    const auto smem = [](auto kernel) {
      return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kConvSmem);
    };
    cudaError_t err = smem(${kernel}_conv<kFirst>);
    if (err == cudaSuccess && kLast != kFirst) err = smem(${kernel}_conv<kLast>);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms[device], cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const long long tiles = a.rows * kTilesPerImage;
  if (tiles > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidValue);
  const int grid = static_cast<int>(tiles < sms[device] ? tiles : sms[device]);
  if (pass == kLast) {
    ${kernel}_conv<kLast><<<grid, 384, kConvSmem, stream>>>(map_x, map_w, a);
  } else {
    ${kernel}_conv<kFirst><<<grid, 384, kConvSmem, stream>>>(map_x, map_w, a);
  }
  return static_cast<int>(cudaGetLastError());
}"""
)

# The merge of the tiles' moments into a norm's statistics (conv_sm90.cuh,
# conv_stats_final): a block a channel (BatchNorm) or a segment. Placeholders:
#   $kernel      the kernel name (prefix of the __global__)
#   $segments    true: segments of whole channels (GroupNorm...); false: BatchNorm's channels
#   $seg_groups  segments an image (kSegGroups)
#   $done        statements ending a channel's or segment's statistics, with its index `c`
#                and its merged moments `m` (render: BatchNorm's finish, or SEGMENT_STATS)
CONV_STATS_FINAL = Template(
    r"""__global__ void __launch_bounds__(256) ${kernel}_convstats(Args a) {
  conv_stats_final<$segments, $seg_groups>(a, [&](long long c, fusedepi::Moments m) {
$done
  });
}"""
)

# The output of a spatial reduction (ConvGemmPlan.reduce): element o = (image, channel)
# merges its patches' partials (conv_sm90.cuh, conv_reduce_value), then stage1 (the steps
# after the reduction) runs on it at its channel's place. Placeholder: $kernel.
CONV_REDUCE_FINAL = Template(
    r"""__global__ void __launch_bounds__(256) ${kernel}_convreduce(Args a) {
  const long long o = static_cast<long long>(blockIdx.x) * 256 + threadIdx.x;
  if (o >= a.rows * kChannels) return;
  float r[1] = {conv_reduce_value(a, o)};
  stage1<1>(r, static_cast<int>(o % kChannels * kInner), o, a, 0.f, 0.f);
  a.out[o] = fusedepi::from_float<T>(r[0]);
}"""
)

# A segment's (mean, rstd) into the workspace, where the apply kernel reads them
# (templates.CHUNK_NORM). Placeholders:
#   $stats_at    the statistics' place (a float* expression)
#   $eps         the norm's eps (a C float)
SEGMENT_STATS = Template(
    r"""    float* stats = $stats_at + c * 2;
    stats[0] = m.mean;
    stats[1] = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + $eps);"""
)

__all__ = ["BLOCK_M", "CONV_KERNELS", "CONV_REDUCE_FINAL", "CONV_STATS_FINAL", "K_STEP_BYTES", "MAX_STRIDE",
           "SEGMENT_STATS", "SHARED_ROWS", "SHARED_ROWS_K_BYTES", "TALL_BLOCK_M", "ConvGemmPlan", "k_step_bytes",
           "nchw_box_w", "nchw_stage_a", "nchw_stages", "padded_in_channels", "reads_nchw", "staging_bytes", "stats_floats",
           "tiling",
           "wgmma_asm", "wgmma_regs_asm"]
