"""Spec -> CUDA source: choose the launch shape, then fill the templates.

`plan()` decides how threads map onto the data; `render()` turns spec + plan into
a flat dict of strings and substitutes it into `templates.KERNEL_FILE`. The planners
(`plan` with `staged_plan` and `pixel_group_plan`, `direct_plan`, `gemm_plan`,
`conv_gemm_plan`) and their renderers live in one file (about 1,200 lines) because
every kernel file is one `KERNEL_FILE` whose apply kernel, fields and launches they
all fill.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from lowering.spec import (
    BROADCAST,
    CHANNEL_NORMS,
    CHANNEL_REDUCTIONS,
    FULL,
    NORMS_BEFORE_A_REDUCTION,
    POOLS,
    REDUCTIONS,
    REDUCTIONS_AFTER_A_NORM,
    ROW_NORMS,
    ROW_REDUCTIONS,
    SECOND_REDUCTION_MAX_CHANNELS,
    SEGMENT_NORMS,
    SPATIAL_NORMS,
    SPATIAL_REDUCTIONS,
    EpilogueSpec,
)

from . import conv_sm90, gemm_sm90, templates
from .snippets import cfloat, render_stage

CTYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

WARP_TEAM_MAX_VECS = 4  # a segment of up to 32 * this many vectors stays inside one warp
BLOCK_TEAM_MAX_VECS = 8  # vectors per thread when a whole block shares a segment
MAX_BLOCK = 1024
CHUNK_BLOCK = 256  # threads per block when a segment is split over several blocks
FLAT_BLOCK = 256  # threads per block of the flat mapping
CHANNEL_BLOCK = 256  # threads per block of a reduction over a conv's channels (a vector of pixels each)
CHANNEL_HOLD = 64  # values a thread holds there (channel_reduce.cuh's kHoldMax)
POOL_BLOCK = 256  # threads per block of a pooling window's kernel (an output element each)
POOL_TILE_BYTES = 40 * 1024  # pool.cuh's channels-last tile, [channels][pixels + 1] floats, at most
FLAT_NVEC = 4  # 16-byte vectors a thread there
MIN_BUSY = 0.9  # below this share of busy vector slots a segment's team narrows (or a pointwise chain runs flat)
NARROW_MAX_ELEMENTS = 32  # elements a lane of a narrowed team holds (registers)
STAGED_MAX_BYTES = 48 * 1024  # a channels-last image staged whole (static shared memory)
STAGED_PACK_BYTES = 24 * 1024  # small images a block stages together (several blocks an SM)
STAGED_BLOCK = 256  # threads a block of warp teams aims at, in whole images
STAGED_MAX_VECS = 4  # vectors a thread when a block takes an image (registers: the kernel keeps 1024 threads an SM)


class NotRenderable(Exception):
    """The spec is valid but no kernel here covers it; the message says why."""


@dataclass(frozen=True)
class Plan:
    """How the apply kernel maps threads onto segments.

    Attributes:
        seg_len: elements per segment (the span of the in-kernel reduction, or a row).
        groups: segments per row.
        vec: elements per vector access.
        team: threads per segment (<= 32: lanes of one warp; else the whole block).
        nvec: vector accesses per thread.
        chunks: blocks per segment (> 1 when a segment is longer than a block holds).
        block: threads per block.
        flat: a pointwise chain's output taken as one flat array (templates.FLAT_APPLY_KERNEL):
            kNV vectors of `vec` elements a thread, which may cross rows; team and chunks
            are then 1.
        staged: images (rows) a block copies from a channels-last y into shared memory, in
            the output's order, before the teams read them there (`staged_plan`); 0: the
            teams read y itself.
        pixels: a reduction over a conv's channels (templates.CHANNEL_APPLY_KERNEL): a
            thread a vector of `vec` pixels of one row, walking their channels; seg_len is
            then the row, and team, nvec and chunks are 1.
        cvec: with `pixels`, channels a load from a channels-last y (`vec` is then 1), else 1.
        pool: a pooling window (templates.POOL_APPLY_KERNEL): a thread an output element;
            seg_len is then the row, and vec, team, nvec and chunks are 1.
        tile: with `pool` on a channels-last y, the pooled pixels a block stages (all their
            channels) before writing them plane by plane; with `tiled`, a tile's pixels;
            else 0.
        pixel_groups: a GroupNorm on a channels-last y (templates.PIXEL_GROUPS_APPLY_KERNEL,
            `pixel_group_plan`): a vector is `vec` channels at one pixel, of one group or of
            a bundle of whole groups; a team a segment (`groups` counts bundles a row,
            `seg_len` is a bundle's), as in the graph's layout.
        tiled: a pointwise or BatchNorm chain on a channels-last y (templates.TILED_APPLY_KERNEL,
            `tiled_plan`): a block a tile of `tile` pixels x `tile_c` channels, read in
            loads of `cvec` channels, written in vectors of `vec` pixels of one channel;
            seg_len is then the row, and team, nvec and chunks are 1.
    """

    seg_len: int
    groups: int
    vec: int
    team: int
    nvec: int
    chunks: int
    block: int
    flat: bool = False
    staged: int = 0
    pixels: bool = False
    cvec: int = 1
    pool: bool = False
    tile: int = 0
    pixel_groups: bool = False
    tiled: bool = False
    tile_c: int = 0


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _widths(n: int, widest: int) -> list[int]:
    """Elements per access that divide `n`, widest first: widest, its half, its quarter, 1."""
    return [w for w in (widest, widest // 2, widest // 4, 1) if w >= 1 and n % w == 0]


def _vector_width(seg_len: int, inner: int, widest: int) -> int:
    """Elements per access: it must divide the segment; widths that keep a vector
    inside one channel are preferred while they are at least half the widest."""
    widths = _widths(seg_len, widest)
    one_channel = [w for w in widths if inner == 1 or inner % w == 0]
    if one_channel and one_channel[0] * 2 >= widths[0]:
        return one_channel[0]
    return widths[0]


def plan(spec: EpilogueSpec) -> Plan:
    """Chooses the thread mapping for `spec`.

    Raises:
        NotRenderable: a row reduction longer than one block can hold.
    """
    red = spec.reduction
    row = spec.channels * spec.inner
    if red is not None and red.name in SEGMENT_NORMS and red.groups:
        groups = red.groups  # a GroupNorm's groups, a conv LayerNorm's segments
    elif red is not None and red.name == "batchnorm_train" and spec.inner > 1:
        groups = spec.channels  # a conv's BatchNorm: partial statistics per (row, channel)
    elif red is not None and red.name in SPATIAL_REDUCTIONS + SPATIAL_NORMS:
        groups = spec.channels  # a value per (row, channel) plane, or statistics per plane
    else:
        groups = 1
    seg_len = row // groups
    if row >= 2**31:
        raise NotRenderable(f"rows of {row} elements: the kernels index a row with 32 bits")
    widest = 16 // ITEMSIZE[spec.dtype]
    if red is not None and red.name in CHANNEL_REDUCTIONS + CHANNEL_NORMS:
        return _pixels_plan(spec)
    if red is not None and red.name in POOLS:
        return _pool_plan(spec)
    vec = _vector_width(seg_len, spec.inner, widest)
    vecs = _ceil_div(seg_len, vec)
    if spec.anchor.channels_last:
        mapped = _channels_last_images(spec)
        if isinstance(mapped, str):
            raise NotRenderable(f"channels-last conv: {mapped}")
        return mapped
    if vecs <= 32 * WARP_TEAM_MAX_VECS or _ceil_div(vecs, 32) * vec <= NARROW_MAX_ELEMENTS:
        # One vector per lane while the segment fits a warp: each access is coalesced.
        # Unless that leaves many lanes idle (33 vectors: 32 lanes x 2, 31 of the second
        # ones idle): then fewer lanes, each with more vectors in flight. A segment of up
        # to 32 elements a lane stays in a warp too: a reduction needs no block-wide
        # synchronization, and a pointwise chain's slots fit its segment more closely
        # (a padded GEMM's rows of 513: 544 slots, not a block's 640 of 128 x 5).
        team = min(32, _pow2_at_least(vecs))
        if _busy(vecs, team) < MIN_BUSY:
            team = _narrow_team(vecs, max(1, NARROW_MAX_ELEMENTS // vec))
        p = Plan(seg_len, groups, vec, team, _ceil_div(vecs, team), 1, 256)
    elif vecs <= MAX_BLOCK * BLOCK_TEAM_MAX_VECS:
        team = _block_team(vecs, BLOCK_TEAM_MAX_VECS, pow2=red is not None)
        p = Plan(seg_len, groups, vec, team, _ceil_div(vecs, team), 1, team)
    elif red is not None and red.name in ROW_REDUCTIONS + ROW_NORMS + SPATIAL_NORMS + SPATIAL_REDUCTIONS:
        limit = MAX_BLOCK * BLOCK_TEAM_MAX_VECS * vec
        raise NotRenderable(f"{red.name} over {seg_len} elements: one block holds at most {limit}")
    else:
        nvec = BLOCK_TEAM_MAX_VECS
        chunks = _ceil_div(vecs, CHUNK_BLOCK * nvec)
        p = Plan(seg_len, groups, vec, CHUNK_BLOCK, nvec, chunks, CHUNK_BLOCK)
    if _flat_suits(spec, p, widest):
        return Plan(row, 1, widest, 1, FLAT_NVEC, 1, FLAT_BLOCK, flat=True)
    return p


def _pixels_plan(spec: EpilogueSpec) -> Plan:
    """The mapping of a reduction over a conv's channels: a thread a vector of pixels.
    On a contiguous y, the widest vector that divides the plane; for the two-pass steps
    (softmax, log_softmax, logsumexp) the widest that keeps every channel's values of a
    thread's pixels in registers (one read of y), past 64 channels the widest. On a
    channels-last y, a pixel a thread, its channels read in the widest vectors that
    divide them."""
    widest = 16 // ITEMSIZE[spec.dtype]
    row = spec.channels * spec.inner
    if spec.anchor.channels_last:
        cvec = _widths(spec.channels, widest)[0]
        return Plan(row, 1, 1, 1, 1, 1, CHANNEL_BLOCK, pixels=True, cvec=cvec)
    widths = _widths(spec.inner, widest)
    two_pass = spec.reduction.name in CHANNEL_NORMS + ("channel_logsumexp",)
    vec = next((w for w in widths if spec.channels * w <= CHANNEL_HOLD), widths[0]) if two_pass else widths[0]
    return Plan(row, 1, vec, 1, 1, 1, CHANNEL_BLOCK, pixels=True)


def _pool_plan(spec: EpilogueSpec) -> Plan:
    """The mapping of a pooling window: a thread an output element (pool.cuh), on either
    layout of y; on a channels-last y, blocks of `tile` pooled pixels with all their
    channels (about 4 elements a thread), staged in shared memory.

    Raises:
        NotRenderable: rows past 32-bit indices, or a channels-last tile past POOL_TILE_BYTES.
    """
    if spec.channels * spec.inner >= 2**31:
        raise NotRenderable(f"rows of {spec.channels * spec.inner} elements: the kernels index a row with 32 bits")
    tile = 0
    if spec.anchor.channels_last:
        tile = max(1, 4 * POOL_BLOCK // spec.channels)
        tile_bytes = spec.channels * (tile + 1) * 4  # [channels][pixels + 1] floats
        if tile_bytes > POOL_TILE_BYTES:
            raise NotRenderable(f"a pooling window of {spec.channels} channels-last channels: pool.cuh's tile would "
                                f"take {tile_bytes} bytes of shared memory")
    return Plan(spec.channels * spec.inner, 1, 1, 1, 1, 1, POOL_BLOCK, pool=True, tile=tile)


def channels_last_plan(spec: EpilogueSpec) -> Plan | str:
    """The mapping of `spec`'s epilogue on a channels-last y (the `conv_layout` form), or
    the reason there is none: a reduction over the channels reads it a pixel a thread, a
    pooling window an output element a thread; every other chain stages images
    (`staged_plan`), or, where they do not fit, reads a GroupNorm's pixel groups
    (`pixel_group_plan`) or tiles of pixels x channels (`tiled_plan`). None returns values
    saved for backward: the anchor output among them would be handed on channels-last,
    where the graph expects its own layout."""
    if spec.saves:
        return "it returns values saved for backward, which are read in the graph's layout"
    red = spec.reduction
    if red is not None and red.name in CHANNEL_REDUCTIONS + CHANNEL_NORMS:
        return _pixels_plan(spec)
    if red is not None and red.name in POOLS:
        try:
            return _pool_plan(spec)
        except NotRenderable as err:
            return str(err)
    return _channels_last_images(spec)


def _channels_last_images(spec: EpilogueSpec) -> Plan | str:
    """The staged mapping where whole images fit it, else a GroupNorm's pixel groups,
    else tiles of pixels x channels; or the three reasons."""
    reasons = []
    for planner in (staged_plan, pixel_group_plan, tiled_plan):
        found = planner(spec)
        if isinstance(found, Plan):
            return found
        reasons.append(found)
    return "; ".join(reasons)


TILE_BYTES = 128  # a tile's channels of one pixel, read from y (at most: all of them)
TILE_INPUT_BYTES = 16 * 1024  # a tile's pixels x channels: 16 float32 or 32 bf16 a thread of TILED_BLOCK
TILED_BLOCK = 256
TILED_MAX_PVEC = 4  # pixels a vector of the output (the tile's rows in shared memory are read with a stride of it)


def tiled_plan(spec: EpilogueSpec) -> Plan | str:
    """The mapping of a pointwise or BatchNorm (training) chain on a channels-last y whose
    images need not fit shared memory, or the reason there is none: y read as a matrix
    of pixels x channels, a block a tile of it (TILE_INPUT_BYTES, at most TILE_BYTES of
    channels a pixel) transposed through shared memory, the chain run in the output's
    order (`tiles.cuh`), so its operands are read as in the graph's layout. BatchNorm's
    statistics come from the column kernels over the same matrix, which run the steps
    before the norm per channel: none of those may read an operand by element."""
    red = spec.reduction
    if spec.inner == 1:
        return "a 1 x 1 output: the layouts are the same"
    if red is not None and red.name != "batchnorm_train":
        return f"tiles are for pointwise and BatchNorm chains, not {red.name}"
    if spec.second_reduction is not None:
        return f"tiles write the chain's value: {spec.second_reduction.name} after the norm is not read from them"
    if spec.saves:
        return "it returns values saved for backward, which are read in the graph's layout"
    if red is not None and any(s.operand in (FULL, BROADCAST) for s in spec.steps[:spec.steps.index(red)]):
        return "an operand read by element before BatchNorm: its statistics read the channels-last y by channel"
    if spec.channels * spec.inner >= 2**31:
        return f"rows of {spec.channels * spec.inner} elements: the kernels index a row with 32 bits"
    item = ITEMSIZE[spec.dtype]
    widest = 16 // item
    tile_c = min(spec.channels, TILE_BYTES // item)
    cvec = next(w for w in _widths(spec.channels, widest) if tile_c % w == 0)
    pvec = _widths(spec.inner, TILED_MAX_PVEC)[0]
    tile_p = max(pvec, min(1024, 2 ** int(math.log2(max(1, TILE_INPUT_BYTES // item // tile_c)))))
    return Plan(spec.channels * spec.inner, 1, pvec, 1, 1, 1, TILED_BLOCK, tile=tile_p, tiled=True, tile_c=tile_c,
                cvec=cvec)


PIXEL_GROUP_MIN_BYTES = 8  # a pixel's channels of a group read at once, at least


def pixel_group_plan(spec: EpilogueSpec) -> Plan | str:
    """The mapping of a GroupNorm chain on a channels-last y where a vector holds a pixel's
    channels of one group, or of several whole groups (a bundle: InstanceNorm's channels
    four or eight at a time), of at least PIXEL_GROUP_MIN_BYTES: a pixel's group read in
    one load, not a channel's pixels one element each. Or the reason there is none. A
    team takes a bundle's segment of whole pixels, as `plan` takes a group on a
    contiguous y (`groups` counts bundles, `seg_len` is a bundle's); no chunks (a segment
    fits a block); the output is written in the graph's layout. No operands read per
    element and no saves (read in the graph's order)."""
    red = spec.reduction
    if red is None or red.name != "groupnorm" or not red.groups:
        return "pixel groups are for GroupNorm chains"
    if _reads_by_element(spec) or spec.saves:
        return "an operand or a saved value read at each element's place in the graph's layout"
    cpg = spec.channels // red.groups
    widest = 16 // ITEMSIZE[spec.dtype]
    vec = next((w for w in _widths(spec.channels, widest) if w % cpg == 0 or cpg % w == 0), 1)
    if vec * ITEMSIZE[spec.dtype] < PIXEL_GROUP_MIN_BYTES:
        return (f"{cpg} channels a group of {spec.channels}: a pixel's vector of whole groups or of one group's "
                f"channels is less than {PIXEL_GROUP_MIN_BYTES} bytes")
    bundle = max(cpg, vec)
    sub = bundle // vec
    vecs = spec.inner * sub
    if vecs <= 32 * WARP_TEAM_MAX_VECS:
        team = max(sub, min(32, _pow2_at_least(vecs)))
        block = max(256, team)
    else:
        team = block = _block_team(vecs, BLOCK_TEAM_MAX_VECS, pow2=True)
    if team > MAX_BLOCK or team * BLOCK_TEAM_MAX_VECS < vecs:
        return f"a group of {bundle * spec.inner} elements: more than a block holds"
    if team % sub:
        return f"{sub} vectors a pixel do not divide a team of {team} threads"
    return Plan(bundle * spec.inner, spec.channels // bundle, vec, team, _ceil_div(vecs, team), 1, block,
                pixel_groups=True)


def _flat_suits(spec: EpilogueSpec, p: Plan, widest: int) -> bool:
    """Whether a pointwise chain runs faster taken flat than a team a row: its rows
    split into narrower vectors than 16 bytes or leave lanes idle (N = 33: one element
    a lane; flat, 3.2x faster on the H100). Linear outputs only (a conv's rows are long
    and split well); not on a padded GEMM's y, whose rows are not the output's (read
    element by element there, flat measured 2-7% slower than a team a row); and no
    residual of another dtype (read in whole vectors here)."""
    if spec.reduction is not None or spec.inner != 1 or spec.y_row != p.seg_len:
        return False
    if any(s.operand == FULL and spec.param_dtypes[s.inputs[0]] != spec.dtype for s in spec.steps):
        return False
    busy = p.seg_len / (p.vec * p.team * p.nvec * p.chunks)
    return p.vec < widest or busy < MIN_BUSY


def staged_plan(spec: EpilogueSpec) -> Plan | str:
    """The mapping for a channels-last conv's y (`Anchor.channels_last`), or the reason
    there is none: each block stages whole images in shared memory in the output's
    order, so that y is read and the output written in whole 16-byte vectors; teams
    then take segments as on a contiguous y. Segments that fit a warp team (up to
    NARROW_MAX_ELEMENTS a lane) pack several images into a block of about
    STAGED_BLOCK threads; longer ones take a block an image, which must then be a
    single segment (a pointwise chain or a norm over the whole image)."""
    red = spec.reduction
    if spec.inner == 1:
        return "a 1 x 1 output: the layouts are the same"
    if red is not None and red.name not in SEGMENT_NORMS:
        return f"{red.name} is not implemented on a channels-last y (pointwise steps and group/layer norms are)"
    if red is not None and red.normalized:
        return "a LayerNorm over trailing dims reads its affine per place in the segment, in the graph's layout"
    if spec.saves:
        return "it returns values saved for backward, which are read in the graph's layout"
    row = spec.channels * spec.inner
    image_bytes = row * ITEMSIZE[spec.dtype]
    if image_bytes > STAGED_MAX_BYTES:
        return f"an image of {image_bytes} bytes does not fit {STAGED_MAX_BYTES // 1024} KiB of shared memory"
    groups = red.groups if red is not None and red.name == "groupnorm" else 1
    seg_len = row // groups
    widest = 16 // ITEMSIZE[spec.dtype]
    vec = _vector_width(seg_len, spec.inner, widest)
    vecs = _ceil_div(seg_len, vec)
    if _ceil_div(vecs, 32) * vec <= NARROW_MAX_ELEMENTS:
        team = min(32, _pow2_at_least(vecs))
        if _busy(vecs, team) < MIN_BUSY:
            team = _narrow_team(vecs, max(1, NARROW_MAX_ELEMENTS // vec))
        # Whole warps (team reductions shuffle over full warps): images in units that
        # make the block a multiple of 32 threads.
        per_image = groups * team
        unit = 32 // math.gcd(per_image, 32)
        images = max(1, min(STAGED_BLOCK // per_image, STAGED_PACK_BYTES // image_bytes)) // unit * unit or unit
        if images * per_image > MAX_BLOCK or images * image_bytes > STAGED_MAX_BYTES:
            return f"{groups} segments of {team} threads an image: no block of whole warps holds whole images"
        return Plan(seg_len, groups, vec, team, _ceil_div(vecs, team), 1, images * per_image, staged=images)
    if groups > 1:
        return f"{groups} groups of {seg_len} elements: longer than a warp holds, and an image takes one block"
    # Powers of two here: a fitted team (544 x 2 for 1058 vectors) ran the staged kernel
    # slower than 512 x 3 on an H100 (2234 against 1597 us; fewer threads an SM).
    team = _block_team(vecs, STAGED_MAX_VECS, pow2=True)
    if team > MAX_BLOCK:
        return f"an image of {row} elements: more than a block holds"
    return Plan(seg_len, 1, vec, team, _ceil_div(vecs, team), 1, team, staged=1)


def _block_team(vecs: int, max_nvec: int, pow2: bool) -> int:
    """Threads of a block that takes a whole segment, at most `max_nvec` vectors each:
    a power of two (at least 128) under `pow2` (teams that reduce over the segment need
    one); otherwise, for a pointwise chain, any number of whole warps from 128 with
    max_nvec / 2 to max_nvec vectors each, the one whose slots the segment fills best
    (a row of 1058 vectors, 8 at most: 160 threads of 7, 94% busy, not 256 of 5, 83%)."""
    smallest = max(128, _pow2_at_least(_ceil_div(vecs, max_nvec)))
    if pow2 or smallest > MAX_BLOCK:
        return smallest
    # At least half the vectors a thread may hold: a block of 736 threads of 1 vector
    # (720 vectors, 98% busy) ran slower than 128 of 6 (94%), 933 against 627 us.
    teams = [t for t in range(128, MAX_BLOCK + 1, 32) if 2 * _ceil_div(vecs, t) >= max_nvec >= _ceil_div(vecs, t)]
    return max(teams, key=lambda t: (_busy(vecs, t), -t), default=smallest)


def _busy(vecs: int, team: int) -> float:
    """The share of a team's vector slots that hold a vector of the segment."""
    return vecs / (team * _ceil_div(vecs, team))


def _narrow_team(vecs: int, max_nvec: int) -> int:
    """The widest team (a power of two) whose slots are busy enough with at most
    `max_nvec` vectors a lane; else the busiest."""
    teams = [t for t in (32, 16, 8, 4, 2, 1) if _ceil_div(vecs, t) <= max_nvec] or [32]
    return next((t for t in teams if _busy(vecs, t) >= MIN_BUSY), max(teams, key=lambda t: _busy(vecs, t)))


DIRECT_TILE_W = 256  # output columns per direct-conv block (templates.DIRECT_CONV_KERNELS)
# The FMA kernel's blocks of 128 columns (one run of 4 columns a lane, not two), where
# they leave fewer of a block's columns outside the output than 256 (outputs up to 128
# wide, say: a 256-column block would leave half of it idle and the library conv would
# run). tests/test_gpu.py: test_direct_conv_fma_narrow.
DIRECT_FMA_NARROW = True
DIRECT_MAX_COUT = 64  # 8 warps x 8 channels
DIRECT_MAX_TAPS = 128  # in_channels x kh x kw: beyond this the conv is compute-bound
DIRECT_MIN_COLUMN_USE = 0.75  # share of a block's 256 columns inside the image
DIRECT_SMEM_BUDGET = 110 * 1024  # two blocks per SM on sm_80 / sm_90
# bf16 and fp16 convs that the tensor-core direct conv does not take (input channels not
# in 8s, output channels not in 16s up to 32: an RGB image's first conv, say) run in the
# FMA kernel, their inputs converted to float32 as they are staged (exactly), the
# products summed in float32. tests/test_gpu.py: test_direct_conv_fma_16bit.
DIRECT_FMA_16BIT = True


@dataclass(frozen=True)
class DirectPlan:
    """How the direct-conv kernel tiles the output.

    Attributes:
        kind: "fma" (CUDA cores in float32: float32, or 16-bit inputs the tensor-core
            kernel does not take under DIRECT_FMA_16BIT; GroupNorm through a stored
            pre-norm value),
            "mma" (bf16/fp16 tensor cores, GroupNorm by recomputing the conv) or
            "tf32" (float32 where TF32 is allowed: tensor cores, pre-norm value stored).
        tile_h: output rows per block.
        copad: output channels padded to 8 x a power of two (fma: 8 warps split them).
        out_vec: elements per store (divides the output width).
        smem: dynamic shared memory per block, bytes.
        tiles: blocks per image.
        tile_w: output columns per block: DIRECT_TILE_W, or 128 for the FMA kernel
            (DIRECT_FMA_NARROW).
    """

    kind: str
    tile_h: int
    copad: int
    out_vec: int
    smem: int
    tiles: int
    tile_w: int = DIRECT_TILE_W

    @property
    def stores_pre_norm(self) -> bool:
        """With GroupNorm, phase 1 stores the pre-norm value and phase 2 normalizes it
        (fma, tf32); else ("mma") phase 2 recomputes the conv."""
        return self.kind in ("fma", "tf32")


MMA_MAX_COUT = 32  # weights live in registers as A fragments
MMA_INSTRUCTIONS = {  # per dtype: float32 chains take the tensor cores in TF32 only where allowed
    "bfloat16": "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
    "float16": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
    "float32": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32",
}
MMA_MAX_WEIGHT_REGS = 48  # m-tiles x k-steps x 4


def direct_plan(spec: EpilogueSpec, arch: str = "sm90", conv_tf32: bool = False) -> DirectPlan | str:
    """The direct-conv tiling for `spec` on `arch`, or the reason the library conv runs instead.

    conv_tf32: a float32 conv may use TF32 (`torch.backends.cudnn.allow_tf32`): the
        tensor-core kernel in TF32 where its shape fits, else exact float32 FMA.
    """
    anchor = spec.anchor
    if anchor.kind != "conv":
        return "not a convolution"
    if spec.saves:
        return "it returns values saved for backward, and the direct conv does not write the conv output"
    if anchor.channels_last:
        return "the library conv runs on channels-last operands (Anchor.channels_last)"
    if anchor.library:
        return "the library conv runs it (Anchor.library: the chain measured faster so)"
    if not anchor.direct:
        return "not 2-D with groups 1 (or disabled)"
    if anchor.depth:
        return "a 3-D conv (the direct conv is 2-D)"
    if not anchor.unit_stride:
        return f"stride {anchor.conv[0]}, dilation {anchor.conv[2]} (the direct conv takes 1 and 1)"
    if anchor.has_bias:
        return "the conv keeps its bias (the matcher moves it into the epilogue)"
    red = spec.reduction
    if red is not None and red.name != "groupnorm":
        return f"{red.name} after a direct conv is not implemented"
    if spec.second_reduction is not None:
        return f"{spec.second_reduction.name} after its {red.name}: the epilogue kernel reduces the normalized value"
    cin, kh, kw, _, _ = anchor.direct
    ho, wo = anchor.direct_out_hw()
    if ho * wo != spec.inner or ho < 1 or wo < 1:
        return f"output {ho}x{wo} does not match the chain's {spec.inner} elements per channel"
    col_tiles = _ceil_div(wo, DIRECT_TILE_W)
    idle = (f"output width {wo} leaves most of a {DIRECT_TILE_W}-column tile idle"
            if wo < DIRECT_MIN_COLUMN_USE * col_tiles * DIRECT_TILE_W else "")
    fma_w = _fma_tile_w(wo)
    if idle and fma_w == DIRECT_TILE_W:
        return idle
    sm = int("".join(ch for ch in arch if ch.isdigit()))
    if red is not None and sm < 70:
        return f"the direct conv's GroupNorm phases synchronize with ld.acquire (sm_70 or newer, not {arch})"
    if spec.dtype == "float32":
        if conv_tf32 and sm >= 80 and not idle:
            tf32 = _mma_plan(spec, cin, kh, kw, ho, wo, col_tiles)
            if isinstance(tf32, DirectPlan):
                return tf32
        return _fma_plan(spec, cin, kh, kw, ho, wo, fma_w)
    mma = idle or (_mma_plan(spec, cin, kh, kw, ho, wo, col_tiles) if sm >= 80
                   else f"the tensor-core direct conv needs sm_80 or newer, not {arch}")
    if isinstance(mma, DirectPlan) or not DIRECT_FMA_16BIT or sm < 80:  # built for sm_80 and sm_90, run on sm_90
        return mma
    fma = _fma_plan(spec, cin, kh, kw, ho, wo, fma_w)
    return fma if isinstance(fma, DirectPlan) else f"{mma}; and the FMA direct conv: {fma}"


def _covers_in_fewer(tile_h: int, ho: int, heights) -> bool:
    """Whether a tile of `heights` shorter than `tile_h` still covers all `ho` output
    rows: a taller one only adds rows outside the output (a Conv1d as a 2-D conv of one
    row, `Anchor.as_2d`)."""
    return any(ho <= t < tile_h for t in heights)


def _fma_tile_w(wo: int) -> int:
    """The FMA kernel's columns a block: DIRECT_TILE_W, or under DIRECT_FMA_NARROW 128
    where that leaves fewer columns of its blocks outside the output, and enough inside
    (DIRECT_MIN_COLUMN_USE)."""
    if not DIRECT_FMA_NARROW:
        return DIRECT_TILE_W

    def outside(w: int) -> int:
        return _ceil_div(wo, w) * w - wo

    narrow = 128
    if outside(narrow) < outside(DIRECT_TILE_W) and wo >= DIRECT_MIN_COLUMN_USE * _ceil_div(wo, narrow) * narrow:
        return narrow
    return DIRECT_TILE_W


def _fma_plan(spec, cin, kh, kw, ho, wo, tile_w) -> DirectPlan | str:
    cout, red = spec.channels, spec.reduction
    if cout > DIRECT_MAX_COUT:
        return f"{cout} output channels (the direct conv takes at most {DIRECT_MAX_COUT})"
    if cin * kh * kw > DIRECT_MAX_TAPS:
        return f"{cin}x{kh}x{kw} taps per output (the direct conv takes at most {DIRECT_MAX_TAPS})"
    copad = 8 * _pow2_at_least(_ceil_div(cout, 8))
    rows_at_once = 64 // copad
    xv = _ceil_div(4 + kw - 1, 4)
    row_stride = tile_w + 4 * (xv - 1)
    col_tiles = _ceil_div(wo, tile_w)
    cpg = cout // red.groups if red is not None else 1
    slots = 1 if cpg % 8 == 0 else (8 // cpg if 8 % cpg == 0 else 8)
    heights = [t for t in (8, 4, 2, 1) if t % rows_at_once == 0]
    for tile_h in heights:
        if _covers_in_fewer(tile_h, ho, heights):
            continue
        smem = 4 * (cin * (tile_h + kh - 1) * row_stride + cin * kh * kw * copad) + 12 * 8 * slots
        if smem <= DIRECT_SMEM_BUDGET:
            out_vec = next(v for v in (4, 2, 1) if wo % v == 0)
            return DirectPlan("fma", tile_h, copad, out_vec, smem, _ceil_div(ho, tile_h) * col_tiles, tile_w)
    return f"the input tile of {cin} channels does not fit {DIRECT_SMEM_BUDGET // 1024} KiB of shared memory"


def _mma_plan(spec, cin, kh, kw, ho, wo, col_tiles) -> DirectPlan | str:
    """bf16/fp16 ("mma": weights in registers, GroupNorm by recomputing) or float32 under
    TF32 ("tf32": weights in shared memory, the pre-norm value stored as by "fma")."""
    cout, red = spec.channels, spec.reduction
    tf32 = spec.dtype == "float32"
    ce = 16 // ITEMSIZE[spec.dtype]  # channels per 16-byte chunk
    if cin % ce or cout % 16 or cout > MMA_MAX_COUT:
        return (f"{cin} -> {cout} channels (the tensor-core direct conv takes input channels in "
                f"multiples of {ce}, output channels in multiples of 16 up to {MMA_MAX_COUT})")
    if wo % 2:
        return f"odd output width {wo} (the tensor-core direct conv stores pairs)"
    cpg = cout // red.groups if red is not None else 1
    if cpg & (cpg - 1):
        return f"{cpg} channels per group (the tensor-core direct conv takes powers of two)"
    chunks = kh * kw * cin // ce
    frags = cout // 16 * _ceil_div(chunks, 2) * 4  # A-fragment registers a lane
    if not tf32 and frags > MMA_MAX_WEIGHT_REGS:
        return f"{cout}x{cin}x{kh}x{kw} weights do not fit the registers of the tensor-core direct conv"
    groups = cout // cpg
    heights = (16, 8, 4, 2, 1)
    for tile_h in heights:  # tall tiles spread the weight and halo loads over more rows
        if _covers_in_fewer(tile_h, ho, heights):
            continue
        staged = 0 if tf32 else 8 * cout * 40 * ITEMSIZE[spec.dtype]  # pass 1's output staging
        weights = 32 * 4 * frags if tf32 else 0  # TF32: A fragments in shared memory
        smem = 16 * ((tile_h + kh - 1) * (DIRECT_TILE_W + kw - 1) * (cin // ce) + 1) + weights + 12 * 8 * groups + staged
        if smem <= DIRECT_SMEM_BUDGET:
            return DirectPlan("tf32" if tf32 else "mma", tile_h, cout, 2, smem, _ceil_div(ho, tile_h) * col_tiles)
    return f"the input tile of {cin} channels does not fit {DIRECT_SMEM_BUDGET // 1024} KiB of shared memory"


@dataclass(frozen=True)
class GemmPlan:
    """The in-kernel GEMM's shape (cuda_templates/gemm_sm90.py).

    Attributes:
        k: the inner size.
        group: GroupNorm columns a group (0: a pointwise chain, which runs in the
            producer's spare warps where a CTA has gemm_sm90.WARPS_MIN_TILES tiles or more,
            or a row reduction).
        reduce: the row reduction (gemm_sm90.ROW_PARTIALS) whose partial statistics the
            tiles write, or "" (the kernel stores the chain's [rows, N] result).
        spare_warps: a 16-bit pointwise chain may run in the spare warps (False: the
            consumers run it on every tile, `Anchor.gemm_consumers`; the name says so).
    """

    k: int
    group: int
    reduce: str = ""
    block_m: int = gemm_sm90.BLOCK_M
    block_n: int = gemm_sm90.BLOCK_N
    spare_warps: bool = True

    def name(self, spec: EpilogueSpec, arch: str) -> str:
        where = "" if self.spare_warps else "consumers_"
        return f"wgmma{self.block_m}x{self.block_n}_{where}" + spec.kernel_name(arch + "a")


def gemm_plan(spec: EpilogueSpec, arch: str) -> GemmPlan | str:
    """The in-kernel GEMM for `spec` on `arch`, or the reason the library GEMM runs first."""
    anchor = spec.anchor
    if anchor.kind not in ("addmm", "mm"):
        return "not a matrix product"
    if not anchor.gemm:
        return ("not x @ w^T with a contiguous w (a Linear's weight) and a [N] bias, "
                "or the in-kernel GEMM is off (FUSEDEPI_IN_KERNEL_GEMM)")
    if arch != "sm90":
        return f"the in-kernel GEMM needs sm_90 (wgmma, TMA), not {arch}"
    if spec.dtype not in gemm_sm90.WGMMA_TYPES:
        return f"{spec.dtype}: the in-kernel GEMM takes bfloat16, float16 and float32 (in TF32)"
    if spec.saves:
        return "it returns values saved for backward, and the in-kernel GEMM writes only the result"
    k = anchor.gemm[0]
    bn = gemm_sm90.BLOCK_N
    if spec.channels % bn:
        return f"N={spec.channels} is not a multiple of the in-kernel GEMM's {bn}-column tile"
    per_16_bytes = 16 // ITEMSIZE[spec.dtype]
    if k % per_16_bytes:
        return f"K={k} is not a multiple of {per_16_bytes} (the bulk copies' 16-byte row pitch)"
    red = spec.reduction
    if spec.second_reduction is not None:
        return f"{spec.second_reduction.name} after its {red.name}: the epilogue kernel reduces the normalized value"
    if red is not None and red.name in gemm_sm90.ROW_PARTIALS:
        # The consumers run the steps before the reduction, exposed at each tile's end;
        # the steps after it run on one value a row.
        before = spec.steps[: spec.steps.index(red)]
        costly = next((s.name for s in before if s.name not in gemm_sm90.CHEAP_STEPS), None)
        if costly is not None:
            return (f"{costly} before {red.name}: the in-kernel GEMM takes cheap steps only before a reduction "
                    "(per element, at each tile's end)")
        return GemmPlan(k, 0, red.name)
    costly = next((s.name for s in spec.steps if s.name not in gemm_sm90.CHEAP_STEPS), None)
    if red is not None and costly is not None and costly not in REDUCTIONS:
        return (f"{costly}: GroupNorm chains with per-element transcendental or division steps run faster on the "
                "library GEMM and the epilogue kernel (measured)")
    group = 0
    if red is not None:
        if red.name != "groupnorm":
            return f"{red.name}: its statistics span more than the in-kernel GEMM's tile"
        group = spec.channels // red.groups
        if group % 8 or bn % group:
            return f"GroupNorm groups of {group} columns (the in-kernel GEMM takes multiples of 8 dividing {bn})"
    return GemmPlan(k, group, spare_warps=not anchor.gemm_consumers)


def conv_gemm_plan(spec: EpilogueSpec, arch: str, conv_tf32: bool = False) -> conv_sm90.ConvGemmPlan | str:
    """The in-kernel conv (an implicit GEMM, `conv_sm90`) for `spec` on `arch`, or the
    reason it does not apply. It takes the candidates for the file's own conv kernels
    (`Anchor.direct`: 2-D, or 3-D by planes of the output's depth, `Anchor.depth`; groups
    1; any dilation, strides up to conv_sm90.MAX_STRIDE) that the direct conv does not
    cover (`direct_plan`), with a pointwise chain or a norm
    over whole channels (and, where conv_sm90's switches allow, a spatial reduction, a
    softmax or reduction over each pixel's channels, or a pooling window after a
    pointwise chain). conv_tf32: a float32
    conv may use TF32 (`torch.backends.cudnn.allow_tf32`); without it float32 is not
    taken."""
    anchor = spec.anchor
    if anchor.kind != "conv" or not anchor.direct or anchor.channels_last:
        return "not a 2-D or 3-D conv with groups 1"
    if max(anchor.conv[0]) > conv_sm90.MAX_STRIDE:
        return f"stride {anchor.conv[0]} (the in-kernel conv's TMA reads strides up to {conv_sm90.MAX_STRIDE})"
    if not anchor.implicit:
        return "the in-kernel conv is not taken (FUSEDEPI_IN_KERNEL_CONV, or slower where timed)"
    if arch != "sm90":
        return f"the in-kernel conv needs sm_90 (wgmma, TMA), not {arch}"
    if isinstance(direct_plan(spec, arch, conv_tf32), DirectPlan):
        return "the direct conv covers it"
    if spec.dtype not in gemm_sm90.WGMMA_TYPES or (spec.dtype == "float32" and not conv_tf32):
        return f"{spec.dtype}: the in-kernel conv takes bfloat16, float16, and float32 where TF32 is allowed"
    if anchor.has_bias:
        return "the conv keeps its bias (the matcher moves it into the epilogue)"
    if spec.dtype == "float32" and not anchor.rounded:
        return "float32: the in-kernel conv reads x and the weight rounded to TF32 by the graph (Anchor.rounded)"
    if spec.saves:
        return "it returns values saved for backward, and the in-kernel conv writes only the result"
    reduce, softmax, pixel_reduce, pool = conv_reduces(spec), conv_softmax(spec), conv_pixel_reduce(spec), conv_pool(spec)
    if isinstance(pool, str):
        return pool
    if pool and anchor.depth:
        return "a pooling window after a 3-D conv (the in-kernel conv pools 2-D windows)"
    stats = False if reduce or softmax or pixel_reduce or pool else conv_stats(spec)
    if isinstance(stats, str):
        return stats
    cin, kh, kw, _, _ = anchor.direct
    ho, wo = anchor.direct_out_hw()
    do = anchor.direct_out_d()
    if do < 1 or ho < 1 or wo < 1 or do * ho * wo != spec.inner:
        out = "x".join(map(str, anchor.direct_out_spatial()))
        return f"output {out} does not match the chain's {spec.inner} elements per channel"
    per_16_bytes = 16 // ITEMSIZE[spec.dtype]
    if (cin % per_16_bytes and not conv_sm90.PAD_PIXELS) or spec.channels % 8:
        inputs = "" if conv_sm90.PAD_PIXELS else f"input channels in multiples of {per_16_bytes}, "
        return f"{cin} -> {spec.channels} channels (the in-kernel conv takes {inputs}output channels in multiples of 8)"
    stride, padding, dilation = anchor.plane_conv()
    # A pool's windows whole in a patch: at least a window's rows of them (patches as wide
    # as 128 // rows pixels at most).
    patch_w = min(wo, conv_sm90.BLOCK_M // pool[0]) if pool else wo
    k_bytes = conv_sm90.k_step_bytes(cin, ITEMSIZE[spec.dtype])
    # A kernel column's taps share a box of x (conv_sm90.SHARED_ROWS) where the stride
    # along the height is 1; not where x is read NCHW (a box an m64 block).
    shared = conv_sm90.SHARED_ROWS and kh > 1 and stride[0] == 1 and k_bytes in conv_sm90.SHARED_ROWS_K_BYTES

    # Every k-step's weights kept by the CTA where one channel tile covers C_out
    # (conv_sm90.RESIDENT_WEIGHTS; not where x is read NCHW).
    kd = anchor.depth[0] if anchor.depth else 1
    k_steps = kd * kh * kw * -(-cin * ITEMSIZE[spec.dtype] // k_bytes) if conv_sm90.RESIDENT_WEIGHTS else 0

    # Every tap of a depth plane reads one window of x (conv_sm90.WINDOW_BOX): stride 1,
    # and x's channels leaving a 16-byte column of the k-step empty (the window copies and
    # multiplies only the columns holding them).
    window = ((kh, kw) + tuple(dilation)
              if conv_sm90.WINDOW_BOX and tuple(stride) == (1, 1) and k_bytes in conv_sm90.WINDOW_K_BYTES
              and cin * ITEMSIZE[spec.dtype] <= k_bytes - 16 else ())

    def tiling(narrow: bool, tap_rows: tuple = (), k_steps: int = 0, window: tuple = ()) -> conv_sm90.ConvGemmPlan:
        return conv_sm90.tiling(spec.channels, patch_w, ITEMSIZE[spec.dtype], stats=stats or reduce, k_bytes=k_bytes,
                                stride_w=stride[1], ho=ho, narrow=narrow, tap_rows=tap_rows, k_steps=k_steps,
                                window=window)

    def nchw(tile: conv_sm90.ConvGemmPlan) -> bool:
        return not anchor.depth and conv_sm90.reads_nchw(tile, ITEMSIZE[spec.dtype], stride[1], anchor.direct[4],
                                                         kw, padding[1], dilation[1], stride[0])

    # Patches as wide as the output where they let the kernel read x NCHW (no channels-last
    # copy of x), else the ones that leave the fewest columns outside it.
    tile = tiling(narrow=False)
    if not nchw(tile):
        tile = tiling(narrow=True, tap_rows=(kh, dilation[0]) if shared else (), k_steps=k_steps, window=window)
    if (softmax or pixel_reduce) and tile.block_n < spec.channels:
        return (f"{spec.reduction.name} over {spec.channels} channels: more than one tile of the in-kernel conv "
                f"({tile.block_n})")
    if pool and (tile.tile_h % pool[0] or tile.tile_w % pool[1]):
        return (f"a {pool[0]} x {pool[1]} window: the in-kernel conv's {tile.tile_h} x {tile.tile_w} patch holds "
                "no whole ones")
    if anchor.recompute and not stats:
        return "a norm recomputed (Anchor.recompute), but the in-kernel conv's tiles take no norm's statistics here"
    reads_nchw = nchw(tile) and not tile.shared_rows and not tile.window
    if reads_nchw and spec.dtype == "float32":  # the wider box of a float32 NCHW stage; cooperative
        tile = replace(tile, stages=conv_sm90.nchw_stages(tile, ITEMSIZE[spec.dtype]), pingpong=False)
    return replace(tile, stats=stats, reduce=reduce, softmax=softmax, pixel_reduce=pixel_reduce, pool=pool,
                   nchw=reads_nchw, recompute=anchor.recompute)


def conv_softmax(spec: EpilogueSpec) -> int:
    """1 (softmax) or 2 (log_softmax) where the in-kernel conv's tiles normalize each
    pixel's channels (`conv_sm90.PIXEL_NORMS`; whether one tile holds them all is the
    plan's to say), else 0."""
    red = spec.reduction
    if not conv_sm90.PIXEL_NORMS or red is None or red.name not in CHANNEL_NORMS or spec.second_reduction is not None:
        return 0
    return 1 if red.name == "channel_softmax" else 2


def conv_pixel_reduce(spec: EpilogueSpec) -> str:
    """The reduction ("sum", "mean", "logsumexp", "amax", "amin") the in-kernel conv's
    tiles run over each pixel's channels (`conv_sm90.PIXEL_REDUCES`; whether one tile
    holds them all is the plan's to say), else ""."""
    red = spec.reduction
    if (not conv_sm90.PIXEL_REDUCES or red is None or red.name not in CHANNEL_REDUCTIONS
            or spec.second_reduction is not None):
        return ""
    return red.name.removeprefix("channel_")


def conv_pool(spec: EpilogueSpec) -> tuple | str:
    """The (rows, columns) of the pooling window the in-kernel conv's tiles apply
    (`conv_sm90.POOLS_IN_TILE`: a 2-D MaxPool or AvgPool after pointwise steps whose
    stride is its window, of `conv_sm90.POOL_SIDES`, unpadded, undilated, floor mode; the
    pooled plane the output's rows and columns over the window's), () where the chain has
    no pool, or why the tiles do not pool it."""
    red = spec.reduction
    if red is None or red.name not in POOLS:
        return ()
    if not conv_sm90.POOLS_IN_TILE:
        return f"{red.name} after the in-kernel conv: switched off (conv_sm90.POOLS_IN_TILE)"
    if spec.second_reduction is not None:
        return f"{spec.second_reduction.name} after {red.name}: the in-kernel conv's pool is the chain's last reduction"
    sizes, pooled, kernel, stride, padding, dilation = _pool_window_2d(spec)
    if len(kernel) != 2:
        return f"a {len(kernel)}-D {red.name}: the in-kernel conv pools 2-D windows"
    ceil_mode = red.consts[0]
    if (tuple(stride) != tuple(kernel) or any(padding) or any(d != 1 for d in dilation) or ceil_mode
            or any(k not in conv_sm90.POOL_SIDES for k in kernel)):
        return (f"{red.name} of window {tuple(kernel)}, stride {tuple(stride)}, padding {tuple(padding)}, dilation "
                f"{tuple(dilation)}{', ceil_mode' if ceil_mode else ''}: the in-kernel conv pools windows of "
                f"{conv_sm90.POOL_SIDES[1:]} pixels a side, strided by their size, unpadded, undilated")
    if tuple(pooled) != tuple(n // k for n, k in zip(sizes, kernel)):
        return f"{red.name}: pooled {tuple(pooled)} from {tuple(sizes)} is not floor mode's"
    return tuple(kernel)


def _pool_window_2d(spec: EpilogueSpec) -> tuple:
    """The spec's pooling window (sizes, pooled, kernel, stride, padding, dilation); after
    a Conv1d run as a 2-D conv of one row (`Anchor.as_2d`), its 1-D window as that row's
    (1 x k)."""
    window = spec.reduction.window
    if spec.anchor.as_2d and len(window[2]) == 1:
        sizes, pooled, kernel, stride, padding, dilation = window
        return ((1, *sizes), (1, *pooled), (1, *kernel), (1, *stride), (0, *padding), (1, *dilation))
    return window


def conv_reduces(spec: EpilogueSpec) -> bool:
    """Whether the in-kernel conv's tiles reduce the chain's value over each channel's
    pixels (a spatial reduction after pointwise steps, `conv_sm90.REDUCES`), writing no
    conv output."""
    red = spec.reduction
    return (conv_sm90.REDUCES and red is not None and red.name in SPATIAL_REDUCTIONS
            and spec.second_reduction is None)


def conv_stats(spec: EpilogueSpec) -> bool | str:
    """Whether the in-kernel conv's tiles write a norm's statistics (BatchNorm in
    training, or a GroupNorm, InstanceNorm or LayerNorm whose segments are whole
    channels of an image), False for a pointwise chain, or the reason it takes neither."""
    red = spec.reduction
    if red is None:
        return False
    if spec.second_reduction is not None:
        return f"{spec.second_reduction.name} after {red.name}: the in-kernel conv's apply kernel does not reduce"
    if red.name == "batchnorm_train" and spec.inner > 1:
        return True
    if red.name in SEGMENT_NORMS and red.groups and spec.channels % red.groups == 0:
        return True
    if red.name in SPATIAL_REDUCTIONS:
        return f"{red.name} after the in-kernel conv: switched off (conv_sm90.REDUCES)"
    if red.name in CHANNEL_NORMS:
        return (f"{red.name} after the in-kernel conv: switched off (conv_sm90.PIXEL_NORMS: slower than the "
                "library conv's form where measured)")
    if red.name in CHANNEL_REDUCTIONS:
        return f"{red.name} after the in-kernel conv: switched off (conv_sm90.PIXEL_REDUCES)"
    return (f"{red.name} after the in-kernel conv is not implemented (pointwise chains, BatchNorm, norms over "
            "whole channels of an image, spatial reductions, a softmax or reduction over a pixel's channels, "
            "pooling windows)")


def anchor_plan(spec: EpilogueSpec, arch: str,
                conv_tf32: bool = False) -> GemmPlan | conv_sm90.ConvGemmPlan | DirectPlan | None:
    """Which of the file's own kernels computes the anchor, in the order they are tried:
    the in-kernel GEMM, the in-kernel conv, the direct conv; None where the library
    computes it before the epilogue kernel."""
    for planned in (gemm_plan(spec, arch), conv_gemm_plan(spec, arch, conv_tf32), direct_plan(spec, arch, conv_tf32)):
        if not isinstance(planned, str):
            return planned
    return None


def kernel_name(spec: EpilogueSpec, arch: str, conv_tf32: bool = False) -> str:
    """The spec's kernel name; "directconv" instead of "conv" when the kernel computes the
    conv, and "_tf32" at the end when it does so in TF32; "wgmma128x256_" or
    "igemm<M>x<N>_" in front (the tile) when it computes the GEMM or the conv as one, for
    the arch it is built for (sm90a)."""
    planned = anchor_plan(spec, arch, conv_tf32)
    if isinstance(planned, DirectPlan):
        return _direct_name(spec, arch, planned)
    return planned.name(spec, arch) if planned is not None else spec.kernel_name(arch)


def build_arch(spec: EpilogueSpec, arch: str, conv_tf32: bool = False) -> str:
    """The architecture to compile `spec`'s kernel for: sm90a (wgmma, TMA) for the
    in-kernel GEMM and conv, else `arch`."""
    return arch + "a" if isinstance(anchor_plan(spec, arch, conv_tf32), (GemmPlan, conv_sm90.ConvGemmPlan)) else arch


def _direct_name(spec: EpilogueSpec, arch: str, d: DirectPlan) -> str:
    return "direct" + spec.kernel_name(arch) + ("_tf32" if d.kind == "tf32" else "")


def _fields(spec: EpilogueSpec, direct: bool = False, gemm: bool = False) -> tuple[str, str]:
    """Args fields and their bindings from the pointer array.

    Pointer order: y, out, BatchNorm's new running stats (x0, x1), saved values
    (sv0, ...), tensor inputs (p0, ...), workspace, then, for the direct conv, x and
    weight (y is then the conv kernel's output); for the in-kernel GEMM, the anchor's
    operands: [bias,] x, and w [N, K] (the weight that mat2 transposes).
    """
    fields, bind = [], ["  a.y = static_cast<const T*>(ptrs[0]);", "  a.out = static_cast<T*>(ptrs[1]);"]
    slot = 2
    bn = next((s for s in spec.steps if s.name == "batchnorm_train"), None)
    if bn is not None:
        rtype = CTYPES[spec.param_dtypes[bn.inputs[2]]]
        for name in ("x0", "x1"):
            fields.append(f"  {rtype}* __restrict__ {name};  // [channels] new running stat")
            bind.append(f"  a.{name} = static_cast<{rtype}*>(ptrs[{slot}]);")
            slot += 1
    for i, save in enumerate(spec.saves):
        ctype = CTYPES[save.dtype]
        fields.append(f"  {ctype}* __restrict__ sv{i};  // saved {save.what}")
        bind.append(f"  a.sv{i} = static_cast<{ctype}*>(ptrs[{slot}]);")
        slot += 1
    for i, dtype in enumerate(spec.param_dtypes):
        ctype = CTYPES[dtype]
        fields.append(f"  const {ctype}* __restrict__ p{i};  // tensor input {i}")
        bind.append(f"  a.p{i} = static_cast<const {ctype}*>(ptrs[{slot}]);")
        slot += 1
    bind.append(f"  a.ws = static_cast<float*>(ptrs[{slot}]);")
    if direct:
        fields.append("  const T* __restrict__ x;  // conv input [rows, in_channels, in_h, in_w]")
        fields.append("  const T* __restrict__ w;  // conv weight [channels, in_channels, kh, kw]")
        fields.append("  T* __restrict__ mid;      // = y: the conv kernel's output (stage0 applied)")
        bind.append(f"  a.x = static_cast<const T*>(ptrs[{slot + 1}]);")
        bind.append(f"  a.w = static_cast<const T*>(ptrs[{slot + 2}]);")
        bind.append("  a.mid = static_cast<T*>(ptrs[0]);")
    if gemm:
        fields += ["  const T* __restrict__ bias;  // [channels] added to the product (addmm; mm: null)",
                   "  const T* __restrict__ x;     // [rows, K] row-major",
                   "  const T* __restrict__ w;     // [channels, K] row-major"]
        names = (["bias"] if spec.anchor.kind == "addmm" else []) + ["x", "w"]
        bind += [f"  a.{name} = static_cast<const T*>(ptrs[{slot + 1 + i}]);" for i, name in enumerate(names)]
        if spec.anchor.kind != "addmm":
            bind.append("  a.bias = nullptr;")
    return "\n".join(fields), "\n".join(bind)


def _save_stats(spec: EpilogueSpec, mean: str, rstd: str, index: str, guard: str = "") -> str:
    """Writes the normalization's statistics to the saved outputs that ask for them."""
    values = {"mean": mean, "rstd": rstd}
    writes = [
        f"a.sv{i}[{index}] = fusedepi::from_float<{CTYPES[s.dtype]}>({values[s.what]});"
        for i, s in enumerate(spec.saves)
        if s.what in values
    ]
    if not writes:
        return ""
    body = " ".join(writes)
    return f"    if ({guard}) {{ {body} }}" if guard else f"  {body}"


def _check_operands(spec: EpilogueSpec, p: Plan):
    for step in spec.steps:
        if step.operand == FULL and p.vec > 1 and spec.dtype != spec.param_dtypes[step.inputs[0]]:
            raise NotRenderable(f"{step.name}: residual dtype differs from the chain's")
        if step.normalized and p.vec > 1 and any(spec.param_dtypes[i] != spec.dtype for i in step.inputs if i >= 0):
            raise NotRenderable(f"{step.name}: weight or bias dtype differs from the chain's (read in whole vectors)")


def render(spec: EpilogueSpec, arch: str, launch: Plan | None = None, conv_tf32: bool = False) -> str:
    """The complete .cu source for `spec`, compiled for `arch` (e.g. "sm90").

    Args:
        spec: the chain.
        arch: target architecture.
        launch: a thread mapping other than `plan(spec)`'s (for measuring variants).
        conv_tf32: a float32 direct conv may compute in TF32 (see direct_plan).
    """
    p = launch or plan(spec)
    _check_operands(spec, p)
    planned = anchor_plan(spec, arch, conv_tf32)
    if isinstance(planned, GemmPlan):
        return _render_gemm(spec, arch, p, planned)
    if isinstance(planned, conv_sm90.ConvGemmPlan):
        return _render_conv_gemm(spec, arch, p, planned)
    if isinstance(planned, DirectPlan):
        return _render_direct(spec, arch, p, planned)
    name = spec.kernel_name(arch)
    red = spec.reduction
    fields, bind = _fields(spec)
    apply_grid = _apply_grid(p)
    launches = []
    stats_kernels = ""
    ws_floats = "0"
    store = templates.STORE_ELEMENTS
    if red is None:
        middle = ""
    elif red.name == "batchnorm_train":
        finish = _batch_norm_finish(spec)
        if spec.inner == 1 or p.tiled:
            # [rows, features], or a channels-last [rows * inner, channels]: partials per
            # (column_stats block, column). A thread loads 16 bytes of a row's columns; on
            # a channels-last conv's pixels 4 columns in every dtype (8 bf16 columns'
            # moments took 128 registers and spilled under the kernel's launch bound; 4
            # take 98, as float32's do).
            vmax = 4 if p.tiled else 16 // ITEMSIZE[spec.dtype]
            stats_kernels = templates.COLUMN_STATS_KERNELS.substitute(
                kernel=name, col_vec=vmax if spec.channels % vmax == 0 else 1, finish=finish,
                col_rows=spec.inner if p.tiled else 1,
            )
            col_rows = "rows * kInner" if p.tiled else "rows"
            launches += [
                f"  const long long col_parts = column_parts({col_rows});",
                f"  {name}_colstats<<<dim3(col_parts, (kChannels + kColsPerBlock - 1) / kColsPerBlock), 256, 0, "
                "stream>>>(a);",
                f"  {name}_colfinal<<<(kChannels + kFinalCols - 1) / kFinalCols, dim3(kFinalCols, kFinalRows), 0, "
                "stream>>>(a, col_parts);",
            ]
            ws_floats = f"kPartials + column_parts({col_rows}) * kChannels * 3"
        else:  # a conv's [rows, channels, inner]: partials per (row, channel, chunk)
            stats_kernels = templates.CHANNEL_STATS_KERNELS.substitute(kernel=name, finish=finish)
            stats_kernels += "\n\n" + templates.PARTIAL_MOMENTS_KERNEL.substitute(
                kernel=name, parts_at="(a.ws + kPartials)"
            )
            launches += [
                f"  {name}_segparts<<<{apply_grid}, kBlock, 0, stream>>>(a);",
                f"  {name}_chanfinal<<<kChannels, 256, 0, stream>>>(a);",
            ]
            ws_floats = "kPartials + rows * kGroups * kChunks * 2"
        middle = templates.BATCH_NORM_APPLY
    elif red.name in SEGMENT_NORMS:
        eps = cfloat(red.consts[0])
        if p.chunks == 1:
            middle = _team_moments_norm(spec, red)
        else:
            middle = templates.CHUNK_NORM.substitute(
                apply=templates.APPLY_STAGE1, stats_at="(a.ws + a.rows * kGroups * kChunks * 2)"
            )
            stats_kernels = templates.PARTIAL_MOMENTS_KERNEL.substitute(kernel=name, parts_at="a.ws")
            stats_kernels += "\n\n" + templates.SEGMENT_FINAL_KERNEL.substitute(
                kernel=name, eps=eps, save_stats=_save_stats(spec, "mean", "rstd", "seg")
            )
            launches += [
                f"  {name}_segparts<<<segments * kChunks, kBlock, 0, stream>>>(a);",
                f"  {name}_segfinal<<<(segments + 255) / 256, 256, 0, stream>>>(a);",
            ]
            ws_floats = "rows * kGroups * (kChunks * 2 + 2)"
    elif red.name in ROW_NORMS + SPATIAL_NORMS:
        save_stats = ""
        if red.name in ("rmsnorm", "l2normalize"):  # the norms with an eps
            statistics = templates.TEAM_STATISTICS[red.name].substitute(eps=cfloat(red.consts[0]))
            if red.name == "rmsnorm":  # its rstd, which backward may keep
                save_stats = _save_stats(spec, "s0", "s1", "p.seg", "p.live && p.lane == 0")
        else:
            statistics = templates.TEAM_STATISTICS[red.name].substitute()
        middle = templates.TEAM_NORM.substitute(statistics=statistics, save_stats=save_stats,
                                                apply=templates.APPLY_STAGE1)
    elif red.name in CHANNEL_REDUCTIONS + CHANNEL_NORMS + POOLS:
        middle, store = "", ""  # the kernel's own (channel_reduce.cuh, pool.cuh)
    else:
        assert red.name in ROW_REDUCTIONS + SPATIAL_REDUCTIONS
        middle = templates.TEAM_ROW_REDUCE.substitute(reduce=templates.ROW_REDUCE[red.name])
        store = templates.STORE_ROW
    launches.append(f"  {name}_apply<<<{apply_grid}, kBlock, 0, stream>>>(a);")
    if p.pixel_groups:
        store = templates.PIXEL_GROUPS_STORE
    if spec.second_reduction is not None:
        store, more, ws_floats = _second_reduction(spec, p, name, ws_floats)
        stats_kernels = "\n\n".join(filter(None, [stats_kernels, more]))
        launches.append(f"  {name}_partfinal<<<(rows * kGroups * kParts + 255) / 256, 256, 0, stream>>>(a);")
    return _kernel_file(spec, name, p, fields=fields, bind=bind, stages=_stages(spec), middle=middle,
                        store=store, stats_kernels=stats_kernels, launches="\n".join(launches), ws_floats=ws_floats)


def _batch_norm_finish(spec: EpilogueSpec) -> str:
    """BatchNorm (training)'s end of its statistics, with a channel `c`'s merged moments
    `m` in scope: the normalize's scale and shift, the new running stats."""
    red = spec.reduction
    return templates.BATCH_NORM_FINISH.substitute(
        momentum=cfloat(red.consts[0]),
        eps=cfloat(red.consts[1]),
        running_mean=f"fusedepi::to_float(a.p{red.inputs[2]}[c])",
        running_var=f"fusedepi::to_float(a.p{red.inputs[3]}[c])",
        weight=f"fusedepi::to_float(a.p{red.inputs[0]}[c])" if red.inputs[0] >= 0 else "1.f",
        bias=f"fusedepi::to_float(a.p{red.inputs[1]}[c])" if red.inputs[1] >= 0 else "0.f",
        rstat_type=CTYPES[spec.param_dtypes[red.inputs[2]]],
        save_stats=_save_stats(spec, "m.mean", "invstd", "c"),
    )


def _second_reduction(spec: EpilogueSpec, p: Plan, name: str, ws_floats: str) -> tuple[str, str, str]:
    """The apply kernel's store, the finishing kernel and the workspace size (in `rows`)
    of a reduction after the norm: the apply kernel leaves each (segment, chunk, channel
    of the segment)'s value after the workspace the norm uses, the finishing kernel
    merges them.

    Raises:
        NotRenderable: a norm whose segments are not whole channels, or too many of them.
    """
    red, second = spec.reduction, spec.second_reduction
    if red.name not in NORMS_BEFORE_A_REDUCTION or second.name not in REDUCTIONS_AFTER_A_NORM or p.flat or p.pixels or p.tiled \
            or p.pool:
        raise NotRenderable(f"{second.name} after {red.name}: no kernel here reduces that")
    parts = 1
    if spec.anchor.conv_view:
        if p.seg_len % spec.inner:
            raise NotRenderable(f"{second.name} after {red.name}: its segments of {p.seg_len} split the channels")
        parts = p.seg_len // spec.inner
    if parts > SECOND_REDUCTION_MAX_CHANNELS:
        raise NotRenderable(f"{second.name} after {red.name} of {parts} channels a segment (at most "
                            f"{SECOND_REDUCTION_MAX_CHANNELS})")
    op = templates.ROW_REDUCE_OPS[second.name.removeprefix("spatial_")]
    at = re.sub(r"\brows\b", "a.rows", ws_floats)
    parts_at = f"(a.ws + ({at}))"
    more = templates.PART_FINAL_KERNEL.substitute(kernel=name, op=op, parts=parts, parts_at=parts_at)
    reduce = templates.PIXEL_GROUPS_PART_REDUCE if p.pixel_groups else templates.PART_REDUCE
    return (reduce.substitute(parts_at=parts_at), more,
            f"{ws_floats} + rows * kGroups * kChunks * {parts}")


def _team_moments_norm(spec: EpilogueSpec, red) -> str:
    """A segment norm's statistics from one team's values (mean and rstd), the saves that
    ask for them, then stage1."""
    return templates.TEAM_NORM.substitute(
        statistics=templates.TEAM_STATISTICS["moments"].substitute(eps=cfloat(red.consts[0])),
        save_stats=_save_stats(spec, "s0", "s1", "p.seg", "p.live && p.lane == 0"),
        apply=templates.APPLY_STAGE1,
    )


def staged_applies(spec: EpilogueSpec, p: Plan) -> bool:
    """Whether the staged kernel (`Plan.staged`) applies the chain while it stages y:
    a pointwise chain whose tensor operands are per channel or single values (a vector
    of y holds consecutive channels of one pixel, not consecutive output elements), and
    a block whose threads each see the same channels in all their vectors. Its result
    is then stored rounded in shared memory, as the output is: only where no step
    follows (no reduction)."""
    if not p.staged or spec.reduction is not None or spec.saves:
        return False
    if _reads_by_element(spec):
        return False
    row_bytes = spec.channels * spec.inner * ITEMSIZE[spec.dtype]
    stage_vec = 16 // ITEMSIZE[spec.dtype] if row_bytes % 16 == 0 else 1  # templates' kStageVec
    return (p.block * stage_vec) % spec.channels == 0


def _reads_full(spec: EpilogueSpec) -> bool:
    """Whether a step reads a full-shape operand (a residual), element by element."""
    return any(s.operand == FULL for s in spec.steps)


def _reads_by_element(spec: EpilogueSpec) -> bool:
    """Whether a step reads an operand at each element's place in the output (a full
    or a broadcast operand): the kernel must know that place (`e0`)."""
    return any(s.operand in (FULL, BROADCAST) for s in spec.steps)


def _apply_grid(p: Plan) -> str:
    if p.tiled:
        return "dim3((rows * kInner + kTileP - 1) / kTileP, (kChannels + kTileC - 1) / kTileC)"
    if p.pool:
        return "rows * kPoolBlocksPerRow"
    if p.pixels:
        return "(rows * (kInner / kV) + kBlock - 1) / kBlock"
    if p.flat:
        return "(rows * kRow + kBlock * kNV * kV - 1) / (kBlock * kNV * kV)"
    if p.team > 32 or p.chunks > 1:
        return "segments * kChunks"
    teams = p.block // p.team
    return f"(segments + {teams - 1}) / {teams}"


def _kernel_file(spec: EpilogueSpec, name: str, p: Plan, stage0_done="false", anchor_inside=0, includes="",
                 middle="", store=templates.STORE_ELEMENTS, apply=True, **parts) -> str:
    """The file: `templates.KERNEL_FILE` with the apply kernel (`apply`: a direct conv's file
    has none, its own kernels write the output) and `parts`' other placeholders."""
    if not apply:
        apply_kernel = ""
    elif p.flat:
        assert not middle and store == templates.STORE_ELEMENTS, "the flat mapping is for pointwise chains"
        apply_kernel = templates.FLAT_APPLY_KERNEL.substitute(kernel=name)
    elif p.pixels:
        norm, op = templates.CHANNEL_OPS[spec.reduction.name]
        apply_kernel = templates.CHANNEL_APPLY_KERNEL.substitute(
            kernel=name, norm=norm, op=op, channels_last="true" if spec.anchor.channels_last else "false", cvec=p.cvec)
    elif p.pixel_groups:
        bundle = p.seg_len // spec.inner
        apply_kernel = templates.PIXEL_GROUPS_APPLY_KERNEL.substitute(
            kernel=name, sub=bundle // p.vec, bundle=bundle,
            vec_groups=p.vec // (spec.channels // spec.reduction.groups) if bundle == p.vec else 1,
            eps=cfloat(spec.reduction.consts[0]), store=store)
    elif p.tiled:
        assert middle in ("", templates.BATCH_NORM_APPLY), "tiles are for pointwise and BatchNorm chains"
        apply_kernel = templates.TILED_APPLY_KERNEL.substitute(
            kernel=name, tile_p=p.tile, tile_c=p.tile_c, cvec=p.cvec, pvec=p.vec,
            norm="true" if spec.reduction is not None else "false")
    elif p.pool:
        apply_kernel = templates.POOL_APPLY_KERNEL.substitute(
            kernel=name, channels_last="true" if spec.anchor.channels_last else "false",
            pool_row="false" if spec.anchor.conv_view else "true", tile=p.tile, **_window(spec.reduction))
    else:
        apply_kernel = templates.APPLY_KERNEL.substitute(kernel=name, middle=middle, store=store)
    return templates.KERNEL_FILE.substitute(
        apply_header='#include "fusedepi/apply.cuh"\n#include "fusedepi/team_reduce.cuh"' if apply else "",
        apply_kernel=apply_kernel,
        wrap=p.seg_len if p.flat else 0,
        staged=p.staged,
        staged_apply="true" if staged_applies(spec, p) else "false",
        pad_k=spec.anchor.pad[0] if spec.anchor.pad else 0,
        pad_header='#include "fusedepi/pad_rows.cuh"' if spec.anchor.pad else "",
        pad_entry=templates.PAD_ROWS_ENTRY if spec.anchor.pad else templates.NO_PAD_ROWS_ENTRY,
        includes=includes,
        kernel=name,
        spec=spec.to_json(),
        ctype=CTYPES[spec.dtype],
        block=p.block,
        team=p.team,
        vec=p.vec,
        nvec=p.nvec,
        seg_len=p.seg_len,
        chunks=p.chunks,
        groups=p.groups,
        channels=spec.channels,
        inner=spec.inner,
        y_row=spec.y_row,
        fast_math="false" if spec.dtype == "float32" else "true",
        stage0_done=stage0_done,
        anchor_inside=anchor_inside,
        **parts,
    )


def _window(step) -> dict[str, str]:
    """POOL_APPLY_KERNEL's window constants of a pooling step: each per-dim tuple as (D, H, W),
    a 1-D or 2-D window's unused leading dims of size 1 (kernel 1, stride 1, padding 0)."""
    sizes, pooled, kernel, stride, padding, dilation = step.window
    lead = 3 - len(kernel)

    def dhw(values, fill) -> tuple:
        return (fill,) * lead + tuple(values)

    named = {"in": dhw(sizes, 1), "out": dhw(pooled, 1), "k": dhw(kernel, 1), "s": dhw(stride, 1),
             "p": dhw(padding, 0), "d": dhw(dilation, 1)}
    parts = {f"{key}_{axis}": str(v) for key, values in named.items() for axis, v in zip("dhw", values)}
    avg = step.name == "avgpool"
    parts.update(pool_max="false" if avg else "true", count_pad="true" if avg and step.consts[1] else "false",
                 divisor=str(step.consts[2] if avg else 0))
    return parts


def _render_direct(spec: EpilogueSpec, arch: str, p: Plan, d: DirectPlan) -> str:
    """The direct conv computes the anchor and stage0. With GroupNorm, one launch of
    two phases (templates.TWO_PHASE_KERNEL): fma and tf32 store the pre-norm value, then
    normalize it (stage1); mma computes the statistics, then recomputes the conv and
    writes the output."""
    name = _direct_name(spec, arch, d)
    red = spec.reduction
    cin, kh, kw, hi, wi = spec.anchor.direct
    ho, wo = spec.anchor.direct_out_hw()
    pad_h, pad_w = spec.anchor.conv[1]
    stats = red is not None
    eps = cfloat(red.consts[0]) if stats else "0.f"
    shape = dict(kernel=name, cin=cin, cout=spec.channels, kh=kh, kw=kw, pad_h=pad_h, pad_w=pad_w,
                 in_h=hi, in_w=wi, out_h=ho, out_w=wo, tile_h=d.tile_h, stats="true" if stats else "false",
                 cpg=spec.channels // red.groups if stats else 1, smem=d.smem)
    # fma and tf32 store the pre-norm value; phase 2 normalizes it (NORMALIZE_TILE)
    normalize = ""
    if stats and d.stores_pre_norm:
        normalize = templates.NORMALIZE_TILE.substitute(kernel=name, apply_vec=_apply_vec(d, ho, wo))
    if d.kind == "fma":
        conv = templates.DIRECT_CONV_KERNELS.substitute(
            copad=d.copad, out_vec=d.out_vec, tile_w=d.tile_w, dst="a.mid" if stats else "a.out", normalize=normalize,
            **shape
        )
        phases = ("conv_tile(a, n, tile);", "apply_tile(a, n, tile);")
    else:
        conv = templates.DIRECT_CONV_MMA_KERNELS.substitute(mma=MMA_INSTRUCTIONS[spec.dtype], normalize=normalize, **shape)
        if d.kind == "tf32":
            phases = ("mma_tile<2>(a, n, tile);", "apply_tile(a, n, tile);", "mma_tile<1>(a, n, tile);")
        else:
            phases = ("mma_tile<0>(a, n, tile);", "mma_tile<1>(a, n, tile);")
    if stats:  # one launch of two phases; its workspace ends in the ticket and image counters
        conv += "\n\n" + templates.TWO_PHASE_KERNEL.substitute(
            kernel=name, eps=eps, phase1=phases[0], phase2=phases[1]
        )
        fn = f"{name}_twophase"
        ws_floats = "rows * kGroups * (kTiles * 3 + 2) + 1 + rows"
    else:  # the conv alone (fma), or the output pass alone (mma, tf32)
        single = phases[0] if d.kind == "fma" else phases[-1]
        conv += "\n\n" + templates.ONE_PHASE_KERNEL.substitute(kernel=name, phase=single)
        fn, ws_floats = f"{name}_onephase", "0"
    # Raise the kernel's shared-memory limit once per device (idempotent, so a race is harmless).
    launches = [
        "  static bool smem_ready[64] = {};",
        "  if (device >= 64 || !smem_ready[device]) {",
        f"    err = cudaFuncSetAttribute({fn}, cudaFuncAttributeMaxDynamicSharedMemorySize, kConvSmem);",
        "    if (err != cudaSuccess) return static_cast<int>(err);",
        "    if (device < 64) smem_ready[device] = true;",
        "  }",
    ]
    if stats:
        # fma and tf32 read back in phase 2 what phase 1 stored: bytes of `mid` a tile writes
        mid_tile = (spec.channels * d.tile_h * min(wo, d.tile_w) * ITEMSIZE[spec.dtype]
                    if d.stores_pre_norm else 0)
        launches += [
            "  static int sms[64] = {}, l2[64] = {};",
            "  if (device < 64 && sms[device] == 0) {",
            "    err = cudaDeviceGetAttribute(&l2[device], cudaDevAttrL2CacheSize, device);",
            "    if (err != cudaSuccess) return static_cast<int>(err);",
            "    err = cudaDeviceGetAttribute(&sms[device], cudaDevAttrMultiProcessorCount, device);",
            "    if (err != cudaSuccess) return static_cast<int>(err);",
            "  }",
            "  // lag: the blocks that run at once (two a multiprocessor) in whole images, and one",
            "  // image more, so that phase 2 rarely waits; at most every tile (small batches).",
            "  // Where phase 2 reads back a stored pre-norm value, at most the whole images whose",
            "  // values fill 3/4 of L2 (at least one image), so that the read hits L2: phase 2",
            "  // then waits more often but reads far fewer bytes from memory.",
            "  const long long items = rows * kTiles;",
            "  const long long resident = 2LL * (device < 64 ? sms[device] : 132);",
            "  long long lag = ((resident + kTiles - 1) / kTiles + 1) * kTiles;",
        ]
        if mid_tile:  # (bf16/fp16 store nothing before the norm: no L2 bound, and no division by 0)
            launches += [
                f"  const long long mid_tile = {mid_tile}LL;",
                "  if (device < 64) {",
                "    const long long fit = (3LL * l2[device] / 4 / mid_tile + kTiles - 1) / kTiles * kTiles;",
                "    lag = fit < lag ? (fit > kTiles ? fit : kTiles) : lag;",
                "  }",
            ]
        launches += [
            "  lag = lag < items ? lag : items;",
            "  err = cudaMemsetAsync(conv_counters(a), 0, (1 + rows) * sizeof(int), stream);",
            "  if (err != cudaSuccess) return static_cast<int>(err);",
            f"  {fn}<<<items + lag, 256, kConvSmem, stream>>>(a, static_cast<int>(lag));",
        ]
    else:
        launches.append(f"  {fn}<<<rows * kTiles, 256, kConvSmem, stream>>>(a);")
    middle = ""
    fields, bind = _fields(spec, direct=True)
    return _kernel_file(
        spec, name, p, stage0_done="true", anchor_inside=1, fields=fields, bind=bind, apply=False,
        stages=_stages(spec), middle=middle, store=templates.STORE_ELEMENTS,
        stats_kernels=conv, launches="\n".join(launches), ws_floats=ws_floats,
    )


def _render_gemm(spec: EpilogueSpec, arch: str, p: Plan, g: GemmPlan) -> str:
    """The in-kernel GEMM computes the anchor and the whole chain: one launch, and a
    second, small one that finishes a row reduction from the tiles' partials."""
    name = g.name(spec, arch)
    red = spec.reduction
    op = gemm_sm90.ROW_PARTIALS.get(g.reduce)
    tile_partials = f"  row_tile_partials<{op}>(d, h, p0, p1);" if op else "  p0 = p1 = 0.f;"
    combine = f"  const float row = row_combine<{op}>(parts, lane);" if op else ""
    gemm = gemm_sm90.GEMM_KERNELS.substitute(
        kernel=name, bm=g.block_m, bn=g.block_n, bk=gemm_sm90.block_k(spec.dtype),
        mma_k=gemm_sm90.WGMMA_TYPES[spec.dtype][1],
        stages=gemm_sm90.STAGES_ROW_REDUCE if g.reduce else gemm_sm90.STAGES, k=g.k,
        bias="true" if spec.anchor.kind == "addmm" else "false", group=g.group,
        eps=cfloat(red.consts[0]) if red is not None and g.group else "0.f",
        row_reads="true" if _reads_full(spec) else "false",
        row_reduce="true" if g.reduce else "false", tile_partials=tile_partials.rstrip("\n"),
        warps_min_tiles=gemm_sm90.WARPS_MIN_TILES, spare_warps="true" if g.spare_warps else "false",
        wgmma=gemm_sm90.wgmma_asm(spec.dtype),
    )
    fields, bind = _fields(spec, gemm=True)
    # The file's epilogue kernel covers the calls where the launcher runs the library GEMM
    # first (FUSEDEPI_IN_KERNEL_GEMM=auto, rows too few to fill the GPU with tiles): a
    # group lies in one tile, so one team a segment, as the library path's kernel; a row
    # reduction as the library path's kernel does it.
    middle, store, ws_floats, finish = "", templates.STORE_ELEMENTS, "0", []
    if g.reduce:
        middle = templates.TEAM_ROW_REDUCE.substitute(reduce=templates.ROW_REDUCE[red.name])
        store = templates.STORE_ROW
        gemm += "\n\n" + gemm_sm90.ROW_FINAL.substitute(kernel=name, combine=combine.rstrip("\n"))
        ws_floats = "rows * kTilesN * 2"  # the tiles' partials: a float2 a (row, column tile)
        finish = [f"    {name}_rowfinal<<<(rows + 7) / 8, 256, 0, stream>>>(a);"]  # a warp a row
    elif red is not None:
        assert p.chunks == 1, "gemm_plan admits groups of at most one tile"
        middle = _team_moments_norm(spec, red)
    launches = [
        "  if (a.x == nullptr) {  // the launcher ran the library GEMM into y: the chain alone",
        f"    {name}_apply<<<{_apply_grid(p)}, kBlock, 0, stream>>>(a);",
        "  } else {",
        "    err = static_cast<cudaError_t>(gemm_launch(a, device, stream));",
        "    if (err != cudaSuccess) return static_cast<int>(err);",
        *finish,
        "  }",
    ]
    return _kernel_file(
        spec, name, p, anchor_inside=1, includes='#include "fusedepi/hopper.cuh"\n', fields=fields, bind=bind,
        stages=_stages(spec), middle=middle, store=store, stats_kernels=gemm,
        launches="\n".join(launches), ws_floats=ws_floats,
    )


# Where an in-kernel conv's file keeps a segment norm's (mean, rstd), a float2 a segment:
# after the tiles' moments, a float2 an (image, patch, channel). Written with the file's
# constants that precede conv_sm90.cuh (kPatches = kTilesPerImage / kTilesN), so that the
# normed pass's NormChan, rendered before that header, reads the same place as the merge
# and the apply kernel.
_CONV_SEGMENT_STATS_AT = "(a.ws + a.rows * (kTilesPerImage / kTilesN) * kChannels * 2)"


def _render_conv_gemm(spec: EpilogueSpec, arch: str, p: Plan, c: conv_sm90.ConvGemmPlan) -> str:
    """The in-kernel conv computes the anchor and a pointwise chain: one launch. With a
    norm (`c.stats`) it writes the conv's value into the output (rounded to T, as the
    library conv's) and its tiles' moments of stage0 on it; a kernel merges those into
    the norm's statistics, and the file's apply kernel runs stage0 and stage1 (the
    norm, then the steps after it) on the output in place, as on the library path. With
    a spatial reduction (`c.reduce`) the tiles write each (image, patch, channel)'s
    reduction of stage0 into the workspace, and a kernel merges them and runs stage1; with
    a softmax over each pixel's channels (`c.softmax`) the tiles run stage1 too, before
    they are staged: one launch, as a pointwise chain's; so with a reduction over each
    pixel's channels (`c.pixel_reduce`: a value a pixel, stored from registers) and a
    pooling window (`c.pool`: the staged tile pooled, the pooled plane stored)."""
    name = c.name(spec, arch)
    red = spec.reduction
    anchor = spec.anchor
    cin, kh, kw, h, w = anchor.direct
    ho, wo = anchor.direct_out_hw()
    (sh, sw), (ph, pw), (dh, dw) = anchor.plane_conv()
    # A 3-D conv's depth (a 2-D conv: one plane, a tap deep)
    kd, d = anchor.depth or (1, 1)
    sd, pd, dd = anchor.depth_conv()
    conv = conv_sm90.CONV_KERNELS.substitute(
        kernel=name, bm=c.block_m, bn=c.block_n, bk=c.k_bytes // ITEMSIZE[spec.dtype],
        mma_k=gemm_sm90.WGMMA_TYPES[spec.dtype][1], stages=c.stages, th=c.tile_h, tw=c.tile_w,
        cin=cin, x_pitch=cin if c.nchw else conv_sm90.x_pitch(cin, ITEMSIZE[spec.dtype]),
        h=h, w=w, kh=kh, kw=kw, ph=ph, pw=pw, sh=sh, sw=sw, dh=dh, dw=dw, ho=ho, wo=wo,
        depth="true" if anchor.depth else "false", d=d, kd=kd, pd=pd, sd=sd, dd=dd, do=anchor.direct_out_d(),
        pitch=conv_sm90.staging_pitch(c.tile_h, c.tile_w, ITEMSIZE[spec.dtype]),
        pingpong="true" if c.pingpong else "false",
        wgmma=conv_sm90.wgmma_asm(spec.dtype, c.block_n, c.nchw and spec.dtype != "float32"),  # (float32: A in registers)
        wgmma_regs=conv_sm90.wgmma_regs_asm(spec.dtype, c.block_n),
        stats="true" if c.stats else "false", nchw="true" if c.nchw else "false",
        nchw_box_w=(conv_sm90.nchw_box_w(c.tile_h, c.tile_w) if c.nchw and spec.dtype == "float32"
                    else conv_sm90.NCHW_BOX_W),
        parts_at="2 * kChannels" if c.stats and red.name == "batchnorm_train" else "0",
        reduce="true" if c.reduce else "false", pixel_reduce="true" if c.pixel_reduce else "false",
        reduce_op=templates.ROW_REDUCE_OPS[red.name.removeprefix("spatial_") if c.reduce else c.pixel_reduce or "sum"],
        softmax=c.softmax,
        value_stage1=("  float y[1] = {v};\n  stage1<1>(y, pos, e0, a, s0, s1);\n  v = y[0];"
                      if c.softmax or c.pixel_reduce or c.pool else ""),
        recompute="true" if c.recompute else "false", norm_chan=_conv_norm_chan(spec, c),
        shared_rows="true" if c.shared_rows else "false", window="true" if c.window else "false",
        resident_weights="true" if c.resident_weights else "false",
        **_conv_pool_constants(spec, c, ho, wo),
    )
    fields, bind = _fields(spec, direct=True)

    def conv_pass(name: str) -> list[str]:
        return [f"  err = static_cast<cudaError_t>(conv_launch(a, device, stream, {name}));",
                "  if (err != cudaSuccess) return static_cast<int>(err);"]

    launches = conv_pass("kPassMoments" if c.recompute else "kPassOnce")
    middle, ws_floats = "", "0"  # a pointwise chain: the conv's launch alone writes its result
    if c.reduce:  # the tiles' partials, a float an (image, patch, channel); a kernel merges them into out
        ws_floats = "rows * kPatches * kChannels"
        conv += "\n\n" + conv_sm90.CONV_REDUCE_FINAL.substitute(kernel=name)
        grid = "static_cast<unsigned>((rows * kChannels + 255) / 256)"
        launches += [f"  {name}_convreduce<<<{grid}, 256, 0, stream>>>(a);"]
    if c.stats:  # the output holds the conv's value: the apply kernel runs stage0 on it, then the norm
        def parts(rows: str) -> str:  # the tiles' moments, a float2 a (image, patch, channel)
            return f"{rows} * kPatches * kChannels * 2"

        bn = red.name == "batchnorm_train"  # else segments of whole channels (GroupNorm...)
        if bn:
            # Workspace: the normalize's scale[C] and shift[C], then the moments.
            done = _batch_norm_finish(spec)
            normalize, grid, ws_floats = templates.BATCH_NORM_APPLY, "kChannels", f"2 * kChannels + {parts('rows')}"
        else:
            # Workspace: the moments, then (mean, rstd) a segment.
            done = conv_sm90.SEGMENT_STATS.substitute(stats_at=_CONV_SEGMENT_STATS_AT, eps=cfloat(red.consts[0]))
            normalize = templates.CHUNK_NORM.substitute(apply=templates.APPLY_STAGE1, stats_at=_CONV_SEGMENT_STATS_AT)
            grid, ws_floats = "segments", f"{parts('rows')} + rows * kGroups * 2"
        conv += "\n\n" + conv_sm90.CONV_STATS_FINAL.substitute(
            kernel=name, segments="false" if bn else "true", seg_groups=1 if bn else red.groups, done=done)
        launches.append(f"  {name}_convstats<<<{grid}, 256, 0, stream>>>(a);")
        if c.recompute:  # the conv again, the norm applied in its tiles: no apply kernel
            launches += conv_pass("kPassNormed")
        else:
            middle = normalize
            launches += ["  Args b = a;  // the apply kernel normalizes the output in place",
                         "  b.y = a.out;",
                         f"  {name}_apply<<<{_apply_grid(p)}, kBlock, 0, stream>>>(b);"]
    apply = c.stats and not c.recompute
    return _kernel_file(spec, name, p, anchor_inside=1, includes='#include "fusedepi/hopper.cuh"\n', apply=apply,
                        fields=fields, bind=bind, stages=_stages(spec), middle=middle, stats_kernels=conv,
                        launches="\n".join(launches), ws_floats=ws_floats)


def _conv_norm_chan(spec: EpilogueSpec, c: conv_sm90.ConvGemmPlan) -> str:
    """CONV_KERNELS' NormChan, norm_chan_of and norm_stage1 (conv_sm90.cuh's normed pass):
    with `c.recompute`, a thread's channel's stage1 operands and the statistics of its
    segment in image `img` (GroupNorm and the like: (mean, rstd), where the stats kernel
    leaves them; BatchNorm's stage1 reads its scale and shift as operands, its s0 and
    s1 unused), loaded as the tile is finished, a channel at a time, and stage1 on one
    value with them; else empty ones, never called."""
    if not c.recompute:
        return ("struct NormChan {};\n"
                "[[maybe_unused]] __device__ __forceinline__ NormChan norm_chan_of(const Args&, int, int) { return {}; }\n"
                "[[maybe_unused]] __device__ __forceinline__ void norm_stage1(float&, const NormChan&, long long, "
                "const Args&) {}")
    red = spec.reduction
    if red.name == "batchnorm_train":
        stats = "  k.s0 = 0.f;\n  k.s1 = 0.f;"
    else:  # the segment's (mean, rstd), where the merge leaves them
        stats = (f"  const float* s = {_CONV_SEGMENT_STATS_AT} + "
                 f"(static_cast<long long>(img) * {red.groups} + c / {spec.channels // red.groups}) * 2;\n"
                 "  k.s0 = s[0];\n  k.s1 = s[1];")
    return ("struct NormChan {\n  stage1_chan k;\n  float s0, s1;\n};\n"
            "__device__ __forceinline__ NormChan norm_chan_of(const Args& a, int img, int c) {\n"
            "  NormChan k;\n  k.k = stage1_chan_of(a, c);\n" + stats + "\n  return k;\n}\n"
            "__device__ __forceinline__ void norm_stage1(float& v, const NormChan& k, long long e0, const Args& a) {\n"
            "  float y[1] = {v};\n  stage1_at<1>(y, k.k, e0, a, k.s0, k.s1);\n  v = y[0];\n}")


def _conv_pool_constants(spec: EpilogueSpec, c: conv_sm90.ConvGemmPlan, ho: int, wo: int) -> dict:
    """CONV_KERNELS' pool placeholders: the window of `c.pool` (the spec's pooling step),
    or none (a 1 x 1 window over the output's plane, never used)."""
    if not c.pool:
        return dict(pool="false", pool_kh=1, pool_kw=1, pool_max="false", pool_divisor=1, pool_ho=ho, pool_wo=wo)
    red = spec.reduction
    (kh, kw), (pooled_h, pooled_w) = c.pool, _pool_window_2d(spec)[1]
    avg = red.name == "avgpool"
    return dict(pool="true", pool_kh=kh, pool_kw=kw, pool_max="false" if avg else "true",
                pool_divisor=(red.consts[2] or kh * kw) if avg else 1, pool_ho=pooled_h, pool_wo=pooled_w)


def _apply_vec(d: DirectPlan, ho: int, wo: int) -> int:
    """Elements per access of the fused normalize: a tile's run per channel is kTH whole
    rows (one column tile) or kTW columns of a row, and every run starts a multiple of it."""
    if _ceil_div(wo, d.tile_w) == 1:
        return next(v for v in (4, 2, 1) if (d.tile_h * wo) % v == 0 and (ho * wo) % v == 0)
    return next(v for v in (4, 2, 1) if wo % v == 0)


def _stages(spec: EpilogueSpec) -> str:
    """stage0 (steps before the reduction, or all) and stage1 (the reduction's normalize
    and the steps after it) as device functions; with a reduction after the norm
    (`second_reduction`), stage1 ends before it and stage2 holds it and the steps after."""
    steps, red, second = list(spec.steps), spec.reduction, spec.second_reduction
    # Where each stage starts, and the end: stage i runs steps[bounds[i]:bounds[i + 1]].
    bounds = [0, steps.index(red) if red is not None else len(steps)]
    bounds += ([steps.index(second)] if second is not None else []) + [len(steps)]
    count = len(bounds) - 1

    def stage_of(step: int) -> int:  # the stage that runs step `step` (past the end: the last)
        return next((i for i in range(count) if step < bounds[i + 1]), count - 1)

    # A value saved after `at` steps is stored after step at - 1 of its stage; at 0 it
    # is the anchor output itself, which the launcher returns.
    # A silu's sigmoid is stored from the silu step's input. A 16-bit value saved
    # before a reduction is rounded in registers, so the statistics (amax's maximum,
    # a norm's mean) are those of the value backward reads, as in eager; later values
    # keep float32, as Inductor does (a rounded tiny softplus fed log's gradient a
    # factor 12 off eager's in float16).
    saves_after: list[dict] = [{} for _ in range(count)]
    sigmoids_at: list[dict] = [{} for _ in range(count)]
    for slot, save in enumerate(spec.saves):
        if save.what == "value" and save.at > 0:
            stage = stage_of(save.at - 1)
            rounded = red is not None and stage < count - 1
            saves_after[stage].setdefault(save.at - 1 - bounds[stage], []).append((slot, CTYPES[save.dtype], rounded))
        elif save.what == "sigmoid":
            stage = stage_of(save.at)
            sigmoids_at[stage].setdefault(save.at - bounds[stage], []).append((slot, CTYPES[save.dtype]))
    # stage1 opens with the reduction's own normalize statement (none for logsumexp),
    # stage2 with the second reduction's (none).
    comments = ("Steps before the reduction (all of them when there is none).",
                "The reduction's normalize, then the steps after it" + (" up to the next reduction." if second else "."),
                "The steps after the reduction that follows the norm, on its value.")
    return "\n".join(
        templates.STAGE_FUNCTION.substitute(
            name=f"stage{i}", extra=", float s0, float s1" if i == 1 else "", comment=comments[i],
            **render_stage(steps[bounds[i]:bounds[i + 1]], saves_after[i], sigmoids_at[i], bounds[i]))
        for i in range(count)
    )
