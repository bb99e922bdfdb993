"""The in-kernel GEMM for Hopper (sm_90a): out = chain(x @ w^T [+ bias]) in one launch, for
bf16/fp16 linear layers, and float32 ones in TF32, whose chain has no statistics beyond one tile's rows (pointwise
steps, and GroupNorm whose groups lie inside a tile); with a second, small launch where
the statistics are a row reduction (logsumexp, sum, mean, amax, amin) that the tiles'
partials give. `render.py` decides when it applies (`gemm_plan`) and renders it into
`templates.KERNEL_FILE` with the spec's stage functions.

Structure (one CTA an output tile of 128 x 256, persistent over tiles, 384 threads):
- warpgroup 0 is the producer: one thread issues bulk tensor copies (TMA) of a 128 x 64
  tile of x and a 256 x 64 tile of w (x 32 in float32: 128 bytes of K either way) into a
  ring of 3 shared-memory stages (128-byte swizzle), completing on the stage's `full`
  mbarrier. Boxes past the matrix's edge read zeros, so any M and any K (a multiple of 8,
  of 4 in float32: TMA's 16-byte row pitch) work;
- warpgroups 1 and 2 are the consumers: each multiplies its 64 rows of the x tile with the
  w tile by `wgmma.mma_async` m64n256k16 (m64n256k8 in TF32; float32 accumulators, 128 a
  thread) and frees a stage (its `empty` mbarrier) once the wgmma that read it is complete;
- the epilogue starts from the accumulators in wgmma's layout (for 8-column chunk j a thread
  holds rows r = 16 * warp + lane / 4 and r + 8, columns 8j + 2 * (lane % 4) + {0, 1}):
  bias added, rounded to the output type as the library GEMM's output is, then the spec's
  stage0 (and, with GroupNorm, the group's statistics from the thread's values and two quad
  shuffles, then stage1). Results are staged in a 128-byte-swizzled 64 KB tile and stored by
  TMA (rows past M are not written), so the next tile's wgmma starts while the copy drains.
  A float32 tile is twice that: it goes out in two rounds of 128 columns;
- a row reduction stores no tile: after the steps before the reduction, each consumer
  thread folds its 64 values of a row, its quad's shuffles combine them, and one lane
  writes the row's partial statistics over the tile's 256 columns (gemm_row_reduce.cuh; for
  logsumexp the tile's max and sum of exps) to the workspace. With no staging tile the
  ring has 4 stages. A second kernel (ROW_FINAL, a warp a row) combines a row's partials
  and runs the steps after the reduction, so the [M, N] product is never written;
- pointwise chains have a second placement, chosen at run time where a CTA has at least
  `WARPS_MIN_TILES` tiles (its epilogue then hides under the next tile's wgmma): the
  consumers stage the rounded tile and go on; warps 1-3 of the producer warpgroup (72
  registers each, to hold their 8 columns' operands) run stage0 on the staged tile in
  place and store it. Named barriers hand
  the staging tile over (kBarFull) and back (kBarEmpty). The consumers run their last
  tile's chain themselves. 16-bit tiles only (one staging round). A spec whose
  `Anchor.gemm_consumers` is set (the `gemm_consumers` form, decided by timing the chain
  both ways) renders `kMaySpareWarps` false: the consumers run the chain on every tile;
  three warps are few for transcendental steps over a tile whose mainloop is short
  (tanh after K = 768 on an H100: 129 us in the spare warps, 80 us in the consumers).

Which chains and calls take it (FUSEDEPI_IN_KERNEL_GEMM, README "In-kernel GEMM"): by
default 16-bit pointwise chains and row reductions and float32 row reductions
(`lowering.matcher.auto_takes_gemm`) at calls whose rows fill the GPU (`fills_gpu`); the
launcher runs the library GEMM and this file's epilogue kernel on the other calls, and on
every float32 call while the matmul precision is "highest". Measured on an H200 at bf16: workload 1's eval chain
at 1.09-1.10x the library GEMM through it, against 1.17-1.19x on the library path;
workload 2's logsumexp at 0.192-0.195 ms against Inductor's 0.194-0.196 and the library
path's 0.193. GroupNorm chains are not faster through it (workload 3: 1.07-1.09x against
1.04-1.09x: at 1024 x 8192 x 8192 a CTA has two tiles and the chain of each is exposed),
so they take it only with
FUSEDEPI_IN_KERNEL_GEMM=1. Tried and dropped: a cluster of 2 multicasting the w tile (no
gain), a ping-pong schedule (1.3x).
"""

from __future__ import annotations

from string import Template

from lowering.vocabulary import VOCABULARY

from .templates import ROW_REDUCE_OPS

BLOCK_M, BLOCK_N = 128, 256
TILE_K_BYTES = 128  # a stage's depth along K: one 128-byte swizzled row (64 16-bit, 32 float32 values)
STAGES = 3  # ring stages; the 64 KB staging tile takes the place of a fourth
STAGES_ROW_REDUCE = 4  # a row reduction stores no tile: no staging tile, a fourth stage
WARPS_MIN_TILES = 4  # tiles a CTA from which a pointwise chain runs in the spare warps
# Per dtype: wgmma's operand type and K of one instruction (32 bytes of K either way).
# float32 products run in TF32 (the launcher takes this path only where
# torch.get_float32_matmul_precision() allows TF32). wgmma reads the float32 operands'
# top 19 bits from shared memory: it truncates where eager's cuBLAS rounds, so products
# lean towards zero, and the error is 2-3x eager's TF32 error on a pointwise chain, 30-35x
# on workload 2's logsumexp (9e-6 against 3e-7 on an H200, still inside float32's 1e-5).
# Rounding in shared memory would add a pass over every stage.
WGMMA_TYPES = {"bfloat16": ("bf16", 16), "float16": ("f16", 16), "float32": ("tf32", 8)}
WGMMA_K_BYTES = 32  # K of one wgmma instruction, in bytes, for every operand type


def block_k(dtype: str) -> int:
    """Elements of K a stage holds: one 128-byte swizzled row."""
    return TILE_K_BYTES // WGMMA_K_BYTES * WGMMA_TYPES[dtype][1]
# Steps whose per-element code is a few float32 operations (`StepKind.cheap` in the
# vocabulary): no transcendental function, no division, at most per-column loads. A
# GroupNorm chain (which the consumers run, exposed at the end of each tile) takes these
# only: on an H200 at bf16, workload 4's chain (two silu) ran at 1.14x the library GEMM
# in it against 1.08-1.15x on the library path. Pointwise chains take any step.
CHEAP_STEPS = frozenset(kind.name for kind in VOCABULARY.values() if kind.cheap)


# FUSEDEPI_IN_KERNEL_GEMM=auto: the in-kernel GEMM runs where its tiles give every SM one
# at least and keep the last wave this full; else cuBLAS (which picks its tile per shape)
# runs first and the chain follows. Measured at two shapes only (an H200: 2048 and 256
# tiles on 132 SMs, both 97% full).
MIN_WAVE_USE = 0.75


def _tiles(rows: int, channels: int) -> int:
    """The output tiles of a [rows, channels] product (channels a multiple of BLOCK_N)."""
    return -(-rows // BLOCK_M) * (channels // BLOCK_N)


def fills_gpu(rows: int, channels: int, sms: int) -> bool:
    """Whether a [rows, channels] output gives the in-kernel GEMM's persistent CTAs on
    `sms` SMs enough tiles (FUSEDEPI_IN_KERNEL_GEMM=auto)."""
    tiles = _tiles(rows, channels)
    if tiles < sms:
        return False
    waves = -(-tiles // sms)
    return tiles >= MIN_WAVE_USE * waves * sms


def spare_warps_run(rows: int, channels: int, sms: int) -> bool:
    """Whether a [rows, channels] output gives each of the persistent CTAs on `sms` SMs
    `WARPS_MIN_TILES` tiles, so that a 16-bit pointwise chain runs in the spare warps
    (as `gemm_launch` decides at every call)."""
    tiles = _tiles(rows, channels)
    return tiles > 0 and tiles >= WARPS_MIN_TILES * min(tiles, sms)


# The row reductions the in-kernel GEMM covers (gemm_row_reduce.cuh), with the enumerator
# each is instantiated with: all of the apply kernel's.
ROW_PARTIALS = ROW_REDUCE_OPS


def wgmma_asm(dtype: str) -> str:
    """The inline-asm statement of one m64n256 wgmma (k16 for 16-bit operands, k8 for
    TF32; 128 float32 accumulators `d`, operands from shared memory by the descriptors
    `desc_a`, `desc_b`, both K-major: TF32 takes no transpose operands)."""
    t, k = WGMMA_TYPES[dtype]
    regs = ", ".join(f"%{i}" for i in range(128))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(128))
    transpose = ", 0, 0" if t != "tf32" else ""
    return (
        "asm volatile(\n"
        '      "{\\n.reg .pred p;\\nsetp.ne.b32 p, %130, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n256k{k}.f32.{t}.{t} {{{regs}}}, %128, %129, p, 1, 1{transpose};\\n}}\\n"\n'
        f"      : {outs}\n"
        '      : "l"(desc_a), "l"(desc_b), "r"(scale_d));'
    )


# The GEMM's constants, its per-spec fragments (the wgmma instruction, a row reduction's
# tile partials) as functions, the kernel named per spec around gemm_sm90.cuh's body, and
# its launch; inside KERNEL_FILE (after Args and the stage functions). Placeholders:
#   $kernel     the kernel name (prefix of the __global__)
#   $bm         tile rows (BLOCK_M)
#   $bn         tile columns (BLOCK_N)
#   $bk         tile depth along K (block_k: 128 bytes of it)
#   $mma_k      K of one wgmma instruction (WGMMA_TYPES: 32 bytes of it)
#   $stages     the ring's depth (STAGES)
#   $k          the GEMM's inner size (the Linear's in_features)
#   $bias       "true" when the anchor is addmm: a.bias[N] is added before rounding
#   $group      GroupNorm columns a group, 0 without GroupNorm (a pointwise chain or a row reduction)
#   $eps        GroupNorm's eps (a C++ float)
#   $row_reads  "true" when a step reads a tensor per element (a residual): rows past M skip it
#   $row_reduce "true" for a row reduction (sum, mean, amax, amin, logsumexp): the consumers
#               write each row's partial statistics (ROW_PARTIALS) and no tile
#   $tile_partials  the call that sets p0, p1 for row h (row_tile_partials, a row
#               reduction's ROW_PARTIALS entry), or "p0 = p1 = 0.f;"
#   $warps_min_tiles   tiles a CTA from which a pointwise chain runs in the spare warps
#   $spare_warps "false" where the consumers run a pointwise chain on every tile
#               (`Anchor.gemm_consumers`): the file has no spare-warp kernel
#   $wgmma      the wgmma_asm() statement
GEMM_KERNELS = Template(
    r"""// In-kernel GEMM (cuda_templates/gemm_sm90.py): out = chain(x @ w^T [+ bias]), x [rows, kK], w [kChannels, kK].
namespace hop = fusedepi::sm90;

constexpr int kBM = $bm, kBN = $bn, kBK = $bk, kStages = $stages;
constexpr int kMmaK = $mma_k;  // K of one wgmma: 32 bytes (16 bf16/fp16 values, 8 TF32)
constexpr int kK = $k;
constexpr bool kBias = $bias;
constexpr int kGroup = $group;        // GroupNorm columns a group (0: a pointwise chain)
constexpr int kG = kGroup > 0 ? kGroup : 8;  // the same, where the pointwise chain's kernel divides by it
constexpr bool kRowReads = $row_reads;
constexpr bool kRowReduce = $row_reduce;
constexpr bool kPointwise = kGroup == 0 && !kRowReduce;  // may run in the spare warps (kOffload)
constexpr bool kMaySpareWarps = $spare_warps;  // false: the consumers run it on every tile
constexpr int kWarpsMinTiles = $warps_min_tiles;
constexpr int kKTiles = (kK + kBK - 1) / kBK;
constexpr int kTilesN = static_cast<int>(kChannels / kBN);
constexpr int kElem = static_cast<int>(sizeof(T));
constexpr int kTileA = kBM * kBK * kElem, kTileB = kBN * kBK * kElem;  // bytes a stage
static_assert(kBK * kElem == 128 && kBK % kMmaK == 0 && kMmaK * kElem == 32, "128-byte rows, 32 bytes a wgmma");
// The staging tile: 64 KB, 128-byte rows (boxes of kBoxCols columns), four boxes a
// consumer warpgroup's 64 rows. 16-bit tiles go out in one round of 256 columns, float32
// tiles in two of 128.
constexpr int kBoxCols = 128 / kElem;
constexpr int kRoundCols = 4 * kBoxCols;
constexpr int kRounds = kBN / kRoundCols;
constexpr int kOut = kRowReduce ? 0 : kBM * kRoundCols * kElem;  // the staging tile
constexpr int kGemmSmem = kStages * (kTileA + kTileB) + kOut + 1024;  // + alignment slack
static_assert(kGemmSmem <= 227 * 1024, "sm_90's dynamic shared memory a block");
constexpr int kConsumerWarps = 8;
static_assert(kChannels % kBN == 0 && kK * kElem % 16 == 0, "gemm_plan admits these shapes only");
static_assert(kG % 8 == 0 && kBN % kG == 0, "a group lies in one tile");
static_assert(kElem == 2 || std::is_same_v<T, float>, "bf16/fp16 operands, or float32 in TF32");
// Named barriers (0 is __syncthreads; 1, 2 are the consumer warpgroups'): the staging tile
// is full (256 consumers arrive, 96 epilogue threads wait), it is free again (the reverse),
// and the epilogue warps among themselves.
constexpr int kBarFull = 3, kBarEmpty = 4, kBarEpi = 5, kHandoff = 256 + 96;

__device__ __forceinline__ void wgmma_256(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  $wgmma
}

#include "fusedepi/gemm_row_reduce.cuh"

// A row reduction's partial statistics (p0, p1) of row `h` over this consumer thread's
// 64 values and its quad's (gemm_row_reduce.cuh).
__device__ __forceinline__ void tile_partials(const float (&d)[128], int h, float& p0, float& p1) {
$tile_partials
}

constexpr float kEps = $eps;  // GroupNorm's eps

#include "fusedepi/gemm_tile.cuh"

#include "fusedepi/gemm_sm90.cuh"

template <bool kOffload>
__global__ void __launch_bounds__(384, 1) ${kernel}_gemm(const __grid_constant__ CUtensorMap map_a,
                                                         const __grid_constant__ CUtensorMap map_b,
                                                         const __grid_constant__ CUtensorMap map_c, const Args a) {
  gemm_body<kOffload>(map_a, map_b, map_c, a);
}

// Launches the GEMM on `device`: one CTA an SM (its shared memory), at most one a tile.
int gemm_launch(const Args& a, int device, cudaStream_t stream) {
  CUtensorMap map_a, map_b, map_c{};
  if (int e = hop::encode_map_2d<T>(&map_a, a.x, a.rows, kK, kBM, kBK)) return e;
  if (int e = hop::encode_map_2d<T>(&map_b, a.w, kChannels, kK, kBN, kBK)) return e;
  if (!kRowReduce) {  // a row reduction's out is [rows]: the consumers write partials
    if (int e = hop::encode_map_2d<T>(&map_c, a.out, a.rows, kChannels, 64, kBoxCols)) return e;
  }
  static int sms[64] = {};
  if (device >= 64) return static_cast<int>(cudaErrorInvalidDevice);
  if (sms[device] == 0) {  // once a device: the shared-memory limit, and the SM count
    cudaError_t err = cudaFuncSetAttribute(${kernel}_gemm<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemmSmem);
    if constexpr (kSpareWarps) {
      if (err == cudaSuccess)
        err = cudaFuncSetAttribute(${kernel}_gemm<kSpareWarps>, cudaFuncAttributeMaxDynamicSharedMemorySize, kGemmSmem);
    }
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms[device], cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  const long long tiles = (a.rows + kBM - 1) / kBM * kTilesN;
  if (tiles > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidValue);
  const int grid = static_cast<int>(tiles < sms[device] ? tiles : sms[device]);
  // A pointwise chain in the spare warps where a CTA has enough tiles to hide it under
  // (16-bit outputs: float32 tiles are staged in two rounds, and the consumers run the chain).
  if constexpr (kSpareWarps) {
    if (tiles >= static_cast<long long>(kWarpsMinTiles) * grid) {
      ${kernel}_gemm<kSpareWarps><<<grid, 384, kGemmSmem, stream>>>(map_a, map_b, map_c, a);
      return static_cast<int>(cudaGetLastError());
    }
  }
  ${kernel}_gemm<false><<<grid, 384, kGemmSmem, stream>>>(map_a, map_b, map_c, a);
  return static_cast<int>(cudaGetLastError());
}"""
)

# A row reduction's last step (after GEMM_KERNELS in the same file): the row's value from
# its tiles' partials, then stage1 (the steps after the reduction) on it.
# Placeholders: $kernel; $combine, the statement that leaves the row's value in `row`
# (row_combine of the reduction's ROW_PARTIALS entry).
ROW_FINAL = Template(
    r"""// The row's value from the kTilesN partials the in-kernel GEMM wrote, then stage1; a warp a row.
__global__ void __launch_bounds__(256) ${kernel}_rowfinal(Args a) {
  const long long r = (long long)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= a.rows) return;
  const float2* parts = reinterpret_cast<const float2*>(a.ws) + r * kTilesN;
$combine
  if (lane == 0) {
    float v[1] = {row};
    stage1<1>(v, 0, r, a, 0.f, 0.f, true);
    a.out[r] = fusedepi::from_float<T>(v[0]);
  }
}"""
)
