// The in-kernel conv (sm_90a): an implicit GEMM over a channels-last input (or, kNchw, the
// NCHW input itself) whose output tile gets the chain on chip and is written once, in the
// graph's NCHW layout.
//
// Included by the rendered file (cuda_templates/conv_sm90.py, CONV_KERNELS) inside its
// anonymous namespace, after the file has defined what this code reads:
//   T, Args (x: the input [rows, H, W, C_in] in memory, [rows, D, H, W, C_in] where kDepth,
//   or [rows, C_in, H, W] where kNchw; w: the weight [kChannels, kTaps, kCinPad]), stage0_chan, stage0_chan_of, stage0_at,
//   kChannels (KERNEL_FILE and CONV_KERNELS' constants: kBM, kBN, kBK, kSwizzle, kStages, kTH, kTW, kKH, kKW, kPH, kPW,
//   kHo, kWo, kHoPlane, kDepth, kD, kKD, kPD, kSD, kDD, kDo, kPitch, kCBlocks, kTilesN, kTilesPerImage, kTileB, kMmaK, kPingPong,
//   kSharedRows, kWindow, kTapRows, kLoads, kStageA, kStageB, kResidentW, kWeightBytes, kWeightsRoom, kWinW, kWinH,
//   kChunkElems,
//   kWinChunks, kWinBoxBytes, kChunkBytes,
//   kConvStats, kConvReduce, kReduceOp, kConvSoftmax, kConvPixelReduce, kConvPool, kPoolKH, kPoolKW, kPoolMax,
//   kPoolDivisor, kPoolHo, kPoolWo, value_stage1, kPartsAt, kNchw, kNchwBoxW, kRecompute, NormChan,
//   norm_chan_of, norm_stage1, wgmma_n),
//   and hopper.cuh.
// It is not a standalone header: those constants differ per file.
#pragma once

// The output's rows as the tiles see them: kHo = kDo planes of kHoPlane rows (a 2-D conv:
// one). Patch row `th` of an image (of kDo x kPlaneTilesH) starts at row patch_row0(th),
// inside one plane.
constexpr int kPlaneTilesH = (kHoPlane + kTH - 1) / kTH;
__device__ __forceinline__ int patch_row0(int th) { return th / kPlaneTilesH * kHoPlane + th % kPlaneTilesH * kTH; }

// A launch's pass. kPassOnce: the tiles' whole work (a pointwise chain's result; with a
// norm, kConvStats, the conv's value and the tiles' moments, which the file's apply
// kernel normalizes in place). A norm recomputed (kRecompute) launches the kernel twice
// instead: kPassMoments writes the tiles' moments alone, and, once they are merged into
// the norm's statistics, kPassNormed computes the conv again and writes the chain's
// result with the norm applied in the tile: the conv's value is never written or read
// back (x is read twice and the mainloop run twice: worth it only where the mainloop is
// far cheaper than the output's bytes; FUSEDEPI_CONV_RECOMPUTE, off unless asked).
constexpr int kPassOnce = 0, kPassMoments = 1, kPassNormed = 2;

// Tile `tile` of the output: image `img`, pixels (h0 .. h0 + kTH) x (w0 .. w0 + kTW),
// channels n0 .. n0 + kBN. The channel tiles of one pixel patch are neighbours in the
// order, so that CTAs running at once share the patch's input in L2.
__device__ __forceinline__ void conv_tile_origin(int tile, int& img, int& h0, int& w0, int& n0) {
  constexpr int kTilesW = (kWo + kTW - 1) / kTW, kTilesH = kDo * kPlaneTilesH;
  n0 = tile % kTilesN * kBN;
  int m = tile / kTilesN;
  w0 = m % kTilesW * kTW;
  m /= kTilesW;
  h0 = patch_row0(m % kTilesH);
  img = m / kTilesH;
}

// The staging tile: a tile's results, by channel and patch row. A tile's kTW pixels of
// one channel and patch row are a run of the NCHW output that starts at any element;
// each run gets a slot of kRunSlot elements and starts in it at its offset from a
// 16-byte boundary of the output, so that the output's aligned 16-byte chunks are
// aligned vectors of the slot (what a bulk copy reads). A channel's slots are kPitch
// elements apart (the file's constant, `conv_sm90.staging_pitch`: 16 bytes past a
// multiple of 64, so that the consumers' writes, 8 pixels x 4 channels a warp, fall in
// distinct banks).
constexpr int kOutV = 16 / kElem;  // elements a 16-byte vector
constexpr int kRunSlot = kTW + kOutV;
static_assert(kPitch >= kTH * kRunSlot && kPitch % kOutV == 0, "a channel's slots, in whole vectors");
constexpr int kStaging = kBN * kPitch * kElem;

// The consumers' schedule (kPingPong, rendered: conv_sm90.tiling). Cooperative: both
// consumer warpgroups work on each tile, 64 rows each, and finish it together, the tensor
// cores idle meanwhile. Ping-pong: each warpgroup takes every other tile of the CTA
// whole (two m64 wgmmas a k-step, kBN accumulators a thread) and the two take turns on
// the tensor cores, one's finish under the other's mainloop; its accumulators bound kBN
// to 128. A ping-pong tile of 256 pixels (few channels: conv_sm90.TALL_BLOCK_M) is four
// m64 wgmmas a k-step.
constexpr int kWgRows = kPingPong ? kBM : 64;   // a consumer warpgroup's rows of a tile
constexpr int kMBlocks = kWgRows / 64;          // ... its m64 wgmmas a k-step
constexpr int kFinishers = kPingPong ? 128 : 256;  // the threads that stage and store a tile
static_assert(!kPingPong || kBN * kMBlocks <= 256, "ping-pong: kBN / 2 accumulators a thread an m64 block");
// Named barriers (0 is __syncthreads'). Cooperative: the tile is staged (kBarFull), the
// last tile's copies have read the staging tile (kBarEmpty). Ping-pong, for warpgroup h
// (0 or 1): its tile is staged (kBarFull + h, its 128 threads); it may run its mainloop
// (kBarMath + h) and stage its tile (kBarStage + h), each arrived at by the other
// warpgroup.
constexpr int kBarFull = 1, kBarEmpty = 3, kBarMath = 4, kBarStage = 6;

// One value into shared memory (address `p`) as T. No memory clobber: the compiler may
// move the chain's arithmetic around it; the asm statements that order it with the
// copies that read it (fence_async_shared, the named barriers) are volatile too.
__device__ __forceinline__ void sts_value(unsigned p, float x) {
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(p), "f"(x));
  } else {
    const T t = fusedepi::from_float<T>(x);
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(p), "h"(*reinterpret_cast<const unsigned short*>(&t)));
  }
}

// The rows and columns of the patch at (h0, w0) inside the output: kTH x kTW, cut at its
// edges (a 3-D conv's: at its depth plane's last row).
__device__ __forceinline__ int patch_rows(int h0) {
  const int left = kHoPlane - h0 % kHoPlane;
  return left < kTH ? left : kTH;
}
__device__ __forceinline__ int patch_width(int w0) { return kWo - w0 < kTW ? kWo - w0 : kTW; }

// The element of out at which a tile's run of channel `c`, output row `h` starts (column w0).
__device__ __forceinline__ long long run_start(int img, long long c, int h, int w0) {
  return ((static_cast<long long>(img) * kChannels + c) * kHo + h) * kWo + w0;
}

// The per-channel operands of the channels a consumer thread holds (channel 8j + 2 *
// (lane % 4) + e of the tile), loaded at the tile's start, so that their loads' latency
// passes under the mainloop. (Loaded in the finish, after the staging's shared-memory
// stores, the kernel took 1.12 ms on bf16 128 x 64 x 128 x 128 -> 128 on an H100; loaded
// here, 0.97 ms.)
struct TileChans {
  stage0_chan k[kBN / 8][2];
};
__device__ __forceinline__ void load_chans(TileChans& c, int tid, int n0, const Args& a) {
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (n0 + 8 * j < kChannels) c.k[j][e] = stage0_chan_of(a, n0 + 8 * j + 2 * (tid % 4) + e);
}

// f(j, e, h, i) for each accumulator d[i] of a consumer thread (i = 4j + 2h + e: channel
// chunk j, channel 2 * (lane % 4) + e of it, row r0 + 8h) whose channel is an output channel.
template <typename F>
__device__ __forceinline__ void each_value(int n0, F&& f) {
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
    if (n0 + 8 * j >= kChannels) break;  // kChannels % 8 == 0: a chunk is inside the channels or past them
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int h = 0; h < 2; ++h) f(j, e, h, 4 * j + 2 * h + e);
  }
}

// A norm's statistics from the tiles (kConvStats): each tile writes, for each of its
// channels, the moments (mean, M2) of its pixels' values before the norm (stage0 on the
// stored conv value, in float32) to a.ws + kPartsAt, a float2 at (tile / kTilesN) * kChannels +
// channel: [rows][kPatches][kChannels]; conv_stats_final merges them. In shared memory
// after the staging tile (a consumer warpgroup's own in ping-pong): a sum a (finishing
// warp, channel) for each pass, and the channels' means. (conv_sm90.stats_floats
// counts the same floats.)
constexpr int kPatches = kTilesPerImage / kTilesN;  // pixel patches an image
constexpr int kFinishWarps = kFinishers / 32;
constexpr int kStatsFloats = (2 * kFinishWarps + 1) * kBN;  // a tile's finishers'
constexpr int kStatsBytes = kConvStats || kConvReduce ? kStatsFloats * 4 * (kPingPong ? 2 : 1) : 0;
static_assert(!(kConvStats && kConvReduce), "a norm's moments or a spatial reduction, not both");

// The valid pixels of patch `patch` (of kPatches) of an image.
__device__ __forceinline__ int patch_pixels(int patch) {
  constexpr int kTilesW = (kWo + kTW - 1) / kTW;
  return patch_rows(patch_row0(patch / kTilesW)) * patch_width(patch % kTilesW * kTW);
}

// inside[b][h]: whether row r0 + 8h of the tile's m64 row block `block0 + b` (r0 = 16 *
// warp + lane / 4 of thread `tid`) is a pixel of the output (the patch at h0, w0 cut at
// the output's edges).
__device__ __forceinline__ void rows_inside(bool (&inside)[kMBlocks][2], int block0, int tid, int h0, int w0) {
  const int rows = patch_rows(h0), width = patch_width(w0);
#pragma unroll
  for (int b = 0; b < kMBlocks; ++b)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = (block0 + b) * 64 + tid / 32 * 16 + tid % 32 / 4 + 8 * h;
      inside[b][h] = r / kTW < rows && r % kTW < width;
    }
}

// `s` of each of the 8 lanes that share lane % 4 (one channel's values over a warp's 16
// rows) combined by `op`, in every one of them.
template <typename Op>
__device__ __forceinline__ float over_warp_rows(float s, Op op) {
  s = op(s, __shfl_xor_sync(0xffffffffu, s, 4));
  s = op(s, __shfl_xor_sync(0xffffffffu, s, 8));
  return op(s, __shfl_xor_sync(0xffffffffu, s, 16));
}

// The moments of each channel of a tile over its valid pixels, by its finishing thread
// `ft` (of kFinishers; `sync` the finishers' named barrier): d[b] holds the values of m64
// row block `block0 + b` of the tile after stage0, as stage_chain left them. Two passes
// over the registers (the sum, then the squares about the tile's mean), each reduced
// over a warp's rows by shuffles and over the finishing warps in shared memory
// (`scratch`, kStatsFloats); a channel's (mean, M2) then goes to the workspace.
template <typename Sync>
__device__ __forceinline__ void tile_moments(const float (&d)[kMBlocks][kBN / 2], int block0, int tid, int ft,
                                             float* scratch, int tile, int h0, int w0, int n0, const Args& a,
                                             Sync sync) {
  const int lane = tid % 32;
  const int rows = patch_rows(h0);
  const int width = patch_width(w0);
  bool inside[kMBlocks][2];
  rows_inside(inside, block0, tid, h0, w0);
  float* sums = scratch;                              // [kFinishWarps][kBN], pass 1
  float* squares = scratch + kFinishWarps * kBN;      // [kFinishWarps][kBN], pass 2
  float* means = scratch + 2 * kFinishWarps * kBN;    // [kBN]
  const int fw = ft / 32;
  // d: the value before the norm, stage0 on the stored conv value in float32 (what the
  // apply kernel computes from it).
  const auto warp_rows = [](float s) { return over_warp_rows(s, [](float x, float y) { return x + y; }); };
  each_value(n0, [&](int j, int e, int h, int i) {
    if (h != 0) return;  // once a channel: both rows below
    float s = 0.f;
#pragma unroll
    for (int b = 0; b < kMBlocks; ++b)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) s += inside[b][hh] ? d[b][4 * j + 2 * hh + e] : 0.f;
    s = warp_rows(s);
    if (lane < 4) sums[fw * kBN + 8 * j + 2 * lane + e] = s;
  });
  sync();
  const float count = static_cast<float>(rows * width);
  if (ft < kBN) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kFinishWarps; ++w) s += sums[w * kBN + ft];
    means[ft] = s / count;
  }
  sync();
  each_value(n0, [&](int j, int e, int h, int i) {
    if (h != 0) return;
    const float mean = means[8 * j + 2 * (lane % 4) + e];
    float q = 0.f;
#pragma unroll
    for (int b = 0; b < kMBlocks; ++b)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float v = d[b][4 * j + 2 * hh + e] - mean;
        q += inside[b][hh] ? v * v : 0.f;
      }
    q = warp_rows(q);
    if (lane < 4) squares[fw * kBN + 8 * j + 2 * lane + e] = q;
  });
  sync();
  if (ft < kBN && n0 + ft < kChannels) {
    float q = 0.f;
#pragma unroll
    for (int w = 0; w < kFinishWarps; ++w) q += squares[w * kBN + ft];
    float2* parts = reinterpret_cast<float2*>(a.ws + kPartsAt);
    parts[static_cast<long long>(tile / kTilesN) * kChannels + n0 + ft] = make_float2(means[ft], q);
  }
}

// The merge of the tiles' moments: block `blockIdx.x` (256 threads) takes a channel
// (kSegments false: BatchNorm, over every image and patch) or a segment (n, g) of
// kChannels / kSegGroups channels (GroupNorm, InstanceNorm, a LayerNorm over [C, H, W]),
// and calls done(index, merged moments) from its thread 0.
template <bool kSegments, long long kSegGroups, typename Done>
__device__ __forceinline__ void conv_stats_final(const Args& a, Done done) {
  const float2* parts = reinterpret_cast<const float2*>(a.ws + kPartsAt);
  const long long at = blockIdx.x;
  fusedepi::Moments m = {0.f, 0.f, 0.f};
  if constexpr (kSegments) {
    constexpr long long kCpg = kChannels / kSegGroups;
    const long long n = at / kSegGroups, c0 = at % kSegGroups * kCpg;
    for (long long i = threadIdx.x; i < kCpg * kPatches; i += 256) {
      const int patch = static_cast<int>(i % kPatches);
      const float2 p = parts[(n * kPatches + patch) * kChannels + c0 + i / kPatches];
      m = fusedepi::merge(m, {static_cast<float>(patch_pixels(patch)), p.x, p.y});
    }
  } else {
    for (long long i = threadIdx.x; i < a.rows * kPatches; i += 256) {
      const int patch = static_cast<int>(i % kPatches);
      const float2 p = parts[i * kChannels + at];
      m = fusedepi::merge(m, {static_cast<float>(patch_pixels(patch)), p.x, p.y});
    }
  }
  m = fusedepi::block_merge(m);
  if (threadIdx.x == 0) done(at, m);
}

// A spatial reduction from the tiles (kConvReduce: global pooling after a pointwise
// chain, `mean(dim=[2, 3])`, `adaptive_avg_pool2d(y, 1)`, amax, amin): the conv's output
// is never written. Each tile reduces each of its channels over its valid pixels (stage0
// on the conv's value rounded to T, in float32, as the apply kernel reads the library
// conv's output) with kReduceOp (kSum and kMean: the sum; kAmax, kAmin: the maximum or
// minimum, NaN where a pixel's value is NaN, as eager's) into a float at a.ws + kPartsAt:
// [rows][kPatches][kChannels]; conv_reduce_value merges an (image, channel)'s patches.
constexpr bool kReduceSum = kReduceOp == fusedepi::RowReduce::kSum || kReduceOp == fusedepi::RowReduce::kMean;
constexpr bool kReduceMax = kReduceOp == fusedepi::RowReduce::kAmax;
static_assert(!kConvReduce || kReduceOp != fusedepi::RowReduce::kLogsumexp, "sum, mean, amax, amin");
static_assert(!kConvPixelReduce || (kTilesN == 1 && !kConvStats && !kConvReduce && kConvSoftmax == 0),
              "a reduction over each pixel's channels: one tile holds them, after pointwise steps");

__device__ __forceinline__ float reduce_pair(float x, float y) {
  return kReduceSum ? x + y : kReduceMax ? fmaxf(x, y) : fminf(x, y);  // NaNs are counted apart
}

// The reduction of each channel of a tile over its valid pixels, by its finishing thread
// `ft` (as tile_moments: d after stage_chain, shuffles over a warp's rows, then the
// finishing warps' values and NaN counts in `scratch`, kStatsFloats).
template <typename Sync>
__device__ __forceinline__ void tile_reduce(const float (&d)[kMBlocks][kBN / 2], int block0, int tid, int ft,
                                            float* scratch, int tile, int h0, int w0, int n0, const Args& a,
                                            Sync sync) {
  constexpr float kIdentity = kReduceSum ? 0.f : kReduceMax ? -INFINITY : INFINITY;
  const int lane = tid % 32;
  bool inside[kMBlocks][2];
  rows_inside(inside, block0, tid, h0, w0);
  float* values = scratch;                         // [kFinishWarps][kBN]
  float* nans = scratch + kFinishWarps * kBN;      // [kFinishWarps][kBN]
  const int fw = ft / 32;
  const auto warp_rows = [](float s) { return over_warp_rows(s, [](float x, float y) { return reduce_pair(x, y); }); };
  const auto warp_count = [](float s) { return over_warp_rows(s, [](float x, float y) { return x + y; }); };
  each_value(n0, [&](int j, int e, int h, int i) {
    if (h != 0) return;  // once a channel: both rows below
    float s = kIdentity, n = 0.f;
#pragma unroll
    for (int b = 0; b < kMBlocks; ++b)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float v = d[b][4 * j + 2 * hh + e];
        s = reduce_pair(s, inside[b][hh] ? v : kIdentity);
        if constexpr (!kReduceSum) n += inside[b][hh] && isnan(v) ? 1.f : 0.f;
      }
    s = warp_rows(s);
    if constexpr (!kReduceSum) n = warp_count(n);
    if (lane < 4) {
      values[fw * kBN + 8 * j + 2 * lane + e] = s;
      nans[fw * kBN + 8 * j + 2 * lane + e] = n;
    }
  });
  sync();
  if (ft < kBN && n0 + ft < kChannels) {
    float s = kIdentity, n = 0.f;
#pragma unroll
    for (int w = 0; w < kFinishWarps; ++w) {
      s = reduce_pair(s, values[w * kBN + ft]);
      if constexpr (!kReduceSum) n += nans[w * kBN + ft];
    }
    float* parts = a.ws + kPartsAt;
    parts[static_cast<long long>(tile / kTilesN) * kChannels + n0 + ft] = n > 0.f ? NAN : s;
  }
  sync();  // the scratch is read before the next tile's reduction writes it
}

// The value of output element o = (image, channel) of a spatial reduction: its patches'
// partials (tile_reduce) merged, NaN where one is NaN (amax, amin), the mean's sum over
// the plane's kHo x kWo pixels.
__device__ __forceinline__ float conv_reduce_value(const Args& a, long long o) {
  const float* parts = a.ws + kPartsAt;
  const long long n = o / kChannels, c = o % kChannels;
  float r = parts[n * kPatches * kChannels + c];
  bool nan = isnan(r);
  for (int patch = 1; patch < kPatches; ++patch) {
    const float u = parts[(n * kPatches + patch) * kChannels + c];
    nan = nan || isnan(u);
    r = reduce_pair(r, u);
  }
  if (!kReduceSum && nan) return NAN;
  return kReduceOp == fusedepi::RowReduce::kMean ? r / static_cast<float>(static_cast<long long>(kHo) * kWo) : r;
}

// A tile's finish, part 1: the consumers apply stage0 to their accumulators in registers
// (each rounded to T first, what the library conv's output holds) and stage the results
// (with a norm, kConvStats: stage the rounded values, then apply stage0 for the moments).
// For 8-column chunk j a thread holds tile rows r0 and r0 + 8 (r0 = 64 * block + 16 *
// warp + lane / 4, `block` the tile's m64 row block of `d`) and channels 8j + 2 * (lane %
// 4) + {0, 1} of the tile; a run's offset from a 16-byte boundary depends on its channel
// modulo 8 only (8 planes are whole 16-byte vectors), so a thread's four (channel, row)
// placements, and whether each is in its run's partial first or last chunk, hold for
// every j. The staging has no branch an element: a pixel past the output's edges is
// computed and staged too, in its slot's spare room, with the chain's operands read at an
// element that exists (element 8j of a plane, of image 0), and is never stored. The
// elements of the partial chunks are stored from registers, by the warps that hold any.
// (With a branch an element for the edges and the partial chunks stored from the staging
// tile, one thread a chunk, this part took 0.41 of the kernel's 0.97 ms on bf16 128 x 64
// x 128 x 128 -> 128 on an H100: latency, at two warps a scheduler.)
template <int kPass>
__device__ __forceinline__ void stage_chain(float (&d)[kBN / 2], const TileChans& chans, uint8_t* staging,
                                            int block, int tid, int img, int h0, int w0, int n0, const Args& a) {
  constexpr long long kPlane = static_cast<long long>(kHo) * kWo;
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = block * 64 + warp * 16 + lane / 4;
  const int rows = patch_rows(h0);
  const int width = patch_width(w0);
  bool in_output[2];    // [h]: pixel r0 + 8h is inside the output (the patch cut at its edges)
  unsigned at[2][2];    // [h][e]: the shared address of channel 2 * (lane % 4) + e's pixel r0 + 8h
  long long idx[2][2];  // ... its element of out (channel chunk j adds 8j planes); 0 past the edges
  bool part[2][2];      // ... in its run's partial first or last chunk (of every chunk j alike)
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = r0 + 8 * h, t = r / kTW, x = r % kTW, cl = 2 * (lane % 4) + e;
      const long long start = run_start(img, n0 + cl, h0 + t, w0);
      // (kConvPool: each run at its slot's start, where pool_runs reads it; nothing stored from here)
      const int shift = kConvPool ? 0 : static_cast<int>(static_cast<unsigned>(start) % kOutV);  // kOutV divides 2^32
      at[h][e] = hop::smem_u32(staging) + (cl * kPitch + t * kRunSlot + shift + x) * kElem;
      const bool inside = t < rows && x < width;
      in_output[h] = inside;  // (alike for both e)
      idx[h][e] = inside ? start + x : 0;
      // the run's elements before its first whole chunk, and from its last one's end on
      const int head = min(shift ? kOutV - shift : 0, width), tail = max(width - (shift + width) % kOutV, head);
      part[h][e] = !kConvPool && inside && (x < head || x >= tail);
    }
  // The chain on every value first, in place, then the stores: independent work for the
  // scheduler to interleave (one finishing warp a scheduler in the ping-pong schedule).
  // With a norm the conv's value is stored (the library conv's output, which the apply
  // kernel reads and runs stage0 on, as on the library path: the value before the norm
  // is never rounded to T), and stage0 runs after the stores, for the moments.
  const auto chain = [&](int j, int e, int h, int i) {
    float y[1] = {d[i]};
    stage0_at<1>(y, chans.k[j][e], idx[h][e] + 8 * j * kPlane, a);
    d[i] = y[0];
  };
  constexpr bool kStoresConv = kConvStats && kPass == kPassOnce;  // the conv's value staged, stage0 after
  each_value(n0, [&](int j, int e, int h, int i) {
    d[i] = fusedepi::to_float(fusedepi::from_float<T>(d[i]));
    if constexpr (!kStoresConv) chain(j, e, h, i);
  });
  // The moments' pass stages nothing: d keeps stage0's values for tile_moments.
  if constexpr (kPass == kPassMoments) return;
  if constexpr (kPass == kPassNormed) {
    // The norm (its merged statistics), then the steps after it. A channel's operands
    // and statistics (NormChan, the file's) are loaded here, a channel at a time: held
    // from the tile's start as stage0's are, a BatchNorm's over 192 channels spilled.
#pragma unroll
    for (int j = 0; j < kBN / 8; ++j) {
      if (n0 + 8 * j >= kChannels) break;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const NormChan k = norm_chan_of(a, img, n0 + 8 * j + 2 * (lane % 4) + e);
#pragma unroll
        for (int h = 0; h < 2; ++h) norm_stage1(d[4 * j + 2 * h + e], k, idx[h][e] + 8 * j * kPlane, a);
      }
    }
  }
  if constexpr (kConvSoftmax > 0) {
    // A softmax (1) or log_softmax (2) over each pixel's channels, all in the tile: a
    // pixel's kChannels values are in the 4 lanes that share lane / 4 (each holds channels
    // 8j + 2 * (lane % 4) + e). Its maximum m (fmaxf skips NaN), then the sum s of exp(x -
    // m) (a -inf adds 0; a NaN reaches s, and so every channel of the pixel, as eager's),
    // then stage1 (the normalize, then the steps after it) on each value with (m, s or
    // log s), as the library path's channel apply kernel computes them.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      const int pixel = in_output[h] ? (h0 + r / kTW) * kWo + w0 + r % kTW : 0;
      float m = -INFINITY, sum = 0.f;
      each_value(n0, [&](int j, int e, int hh, int i) {
        if (hh == h) m = fmaxf(m, d[i]);
      });
      m = fusedepi::team_max_warp<4>(m);
      each_value(n0, [&](int j, int e, int hh, int i) {
        if (hh == h) sum += d[i] == -INFINITY ? 0.f : expf(d[i] - m);
      });
      sum = fusedepi::team_sum_warp<4>(sum);
      const float s1 = kConvSoftmax == 2 ? logf(sum) : sum;
      each_value(n0, [&](int j, int e, int hh, int i) {
        if (hh != h) return;
        const int c = n0 + 8 * j + 2 * (lane % 4) + e;
        value_stage1(d[i], c * static_cast<int>(kPlane) + pixel, idx[h][e] + 8 * j * kPlane, a, m, s1);
      });
    }
  }
  if constexpr (kConvPixelReduce) {
    // A reduction over each pixel's channels, all in the tile (kReduceOp: sum, mean,
    // logsumexp, amax, amin), one value a pixel, as the library path's channel apply
    // kernel computes it: a pixel's channels are in the 4 lanes that share lane / 4, whose
    // partials are merged by shuffles; logsumexp's maximum (fmaxf skips NaN; 0 where it is
    // infinite), then its sum of exp(x - max); amax and amin NaN where a channel is. The
    // lane with lane % 4 == 0 runs stage1 (the steps after the reduction) on the value and
    // stores it at the pixel's place in the [rows, Ho, Wo] output; nothing is staged.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float v = 0.f;
      if constexpr (kReduceSum) {
        each_value(n0, [&](int, int, int hh, int i) {
          if (hh == h) v += d[i];
        });
        v = fusedepi::team_sum_warp<4>(v);
        if constexpr (kReduceOp == fusedepi::RowReduce::kMean) v /= static_cast<float>(kChannels);
      } else if constexpr (kReduceOp == fusedepi::RowReduce::kLogsumexp) {
        float m = -INFINITY;
        each_value(n0, [&](int, int, int hh, int i) {
          if (hh == h) m = fmaxf(m, d[i]);
        });
        m = fusedepi::team_max_warp<4>(m);
        m = isinf(m) ? 0.f : m;
        each_value(n0, [&](int, int, int hh, int i) {
          if (hh == h) v += expf(d[i] - m);
        });
        v = logf(fusedepi::team_sum_warp<4>(v)) + m;
      } else {  // amax, amin: the maximum of x (of -x), NaN where a channel's value is
        float m = -INFINITY, nans = 0.f;
        each_value(n0, [&](int, int, int hh, int i) {
          if (hh != h) return;
          m = fmaxf(m, kReduceMax ? d[i] : -d[i]);
          nans += isnan(d[i]) ? 1.f : 0.f;
        });
        m = fusedepi::team_max_warp<4>(m);
        v = fusedepi::team_sum_warp<4>(nans) > 0.f ? NAN : (kReduceMax ? m : -m);
      }
      const int r = r0 + 8 * h;
      if (lane % 4 == 0 && in_output[h]) {
        const long long e = static_cast<long long>(img) * kPlane + static_cast<long long>(h0 + r / kTW) * kWo + w0 +
                            r % kTW;
        value_stage1(v, 0, e, a, 0.f, 0.f);  // no per-channel operand after a reduction over the channels
        a.out[e] = fusedepi::from_float<T>(v);
      }
    }
  }
  // A spatial reduction keeps the chain's values in registers for tile_reduce; a
  // reduction over each pixel's channels has stored its values: nothing is staged.
  if constexpr (kConvReduce || kConvPixelReduce) return;
  each_value(n0, [&](int j, int e, int h, int i) { sts_value(at[h][e] + 8 * j * kPitch * kElem, d[i]); });
  // The elements of the runs' partial chunks, which no bulk copy writes (it moves whole,
  // aligned 16-byte chunks), stored from registers: a run's first and last kOutV - 1
  // pixels at most, so most warps have none (the branch is the warp's).
  if (__any_sync(0xffffffffu, part[0][0] || part[0][1] || part[1][0] || part[1][1])) {
    each_value(n0, [&](int j, int e, int h, int i) {
      if (part[h][e]) a.out[idx[h][e] + 8 * j * kPlane] = fusedepi::from_float<T>(d[i]);
    });
  }
  if constexpr (kStoresConv) each_value(n0, chain);
}

// A tile's finish, part 2, by finishing thread `ct` (of kFinishers): each run (a channel
// and patch row of the staged tile) gets one bulk copy of its whole 16-byte chunks of out,
// committed as one bulk group; the copies run on under the next mainloop, and the tile's
// stager waits for them to have read the staging tile before it stages the next. (The
// elements of a run's partial chunks were stored by stage_chain.)
__device__ __forceinline__ void store_runs(const uint8_t* staging, int ct, int img, int h0, int w0, int n0,
                                           const Args& a) {
  const int channels = kChannels - n0 < kBN ? static_cast<int>(kChannels - n0) : kBN;
  const int rows = patch_rows(h0);
  const int width = patch_width(w0);
  const T* slots = reinterpret_cast<const T*>(staging);
  for (int v = ct; v < channels * kTH; v += kFinishers) {
    const int cl = v / kTH, t = v % kTH;
    if (t >= rows) continue;
    const long long start = run_start(img, n0 + cl, h0 + t, w0), end = start + width;
    const int shift = static_cast<int>(static_cast<unsigned>(start) % kOutV);  // kOutV divides 2^32
    const long long lo = start + (shift ? kOutV - shift : 0), hi = end - end % kOutV;
    if (hi > lo) {
      const T* run = slots + cl * kPitch + t * kRunSlot + shift;  // run[i]: out[start + i]
      hop::bulk_store(a.out + lo, run + (lo - start), static_cast<unsigned>((hi - lo) * kElem));
    }
  }
  hop::bulk_commit();
}

// A pooling window over each channel's plane (kConvPool: a MaxPool2d or AvgPool2d whose
// stride is its window, kPoolKH x kPoolKW, unpadded), in place of store_runs: the tile
// was staged with each run at its slot's start (stage_chain), and finishing thread `ct`
// (of kFinishers) pools it a pooled element at a time, consecutive threads taking
// consecutive pooled pixels of a channel's row; the conv's output is never written. A
// patch holds whole windows (kTH and kTW are multiples of the window, and the patches
// start at multiples of kTH and kTW); the pooled plane is kPoolHo x kPoolWo, the output's
// rows and columns past its last whole window dropped (PyTorch's floor mode). As pool.cuh:
// max keeps the first maximum and a NaN wins (`v > m || isnan(v)`); avg sums in float32
// in window order and divides by kPoolDivisor (the window's size, or divisor_override);
// then the steps after the pool on the pooled value (value_stage1). The window reads the
// staged values, rounded to T as eager's tensor before the pool is.
constexpr int kPoolTH = kTH / kPoolKH, kPoolTW = kTW / kPoolKW;  // a tile's pooled rows and columns
static_assert(!kConvPool || (kTH % kPoolKH == 0 && kTW % kPoolKW == 0), "a patch of whole windows");
static_assert(!kConvPool || (!kConvStats && !kConvReduce && kConvSoftmax == 0), "a pool after pointwise steps");

__device__ __forceinline__ void pool_runs(const uint8_t* staging, int ct, int img, int h0, int w0, int n0,
                                          const Args& a) {
  const int channels = kChannels - n0 < kBN ? static_cast<int>(kChannels - n0) : kBN;
  const int oh0 = h0 / kPoolKH, ow0 = w0 / kPoolKW;
  const T* slots = reinterpret_cast<const T*>(staging);
  for (int v = ct; v < channels * kPoolTH * kPoolTW; v += kFinishers) {
    const int cl = v / (kPoolTH * kPoolTW), tp = v / kPoolTW % kPoolTH, xp = v % kPoolTW;
    if (oh0 + tp >= kPoolHo || ow0 + xp >= kPoolWo) continue;
    const T* window = slots + cl * kPitch + tp * kPoolKH * kRunSlot + xp * kPoolKW;
    float r = kPoolMax ? -INFINITY : 0.f;
#pragma unroll
    for (int kh = 0; kh < kPoolKH; ++kh)
#pragma unroll
      for (int kw = 0; kw < kPoolKW; ++kw) {
        const float u = fusedepi::to_float(window[kh * kRunSlot + kw]);
        if constexpr (kPoolMax) {
          if (u > r || isnan(u)) r = u;
        } else {
          r += u;
        }
      }
    if constexpr (!kPoolMax) r = __fdiv_rn(r, static_cast<float>(kPoolDivisor));
    const long long o = ((static_cast<long long>(img) * kChannels + n0 + cl) * kPoolHo + oh0 + tp) * kPoolWo + ow0 + xp;
    value_stage1(r, static_cast<int>((n0 + cl) * kInner), o, a, 0.f, 0.f);
    a.out[o] = fusedepi::from_float<T>(r);
  }
}

// The tap (of kTaps) of k-step r of load i (kTapRows k-steps a load): a box a tap; a
// kernel column's taps down its height (kSharedRows); every tap of a depth plane of them
// (kWindow).
__device__ __forceinline__ int load_tap(int i, int r) {
  const int q = i / kCBlocks;
  if constexpr (kWindow) return q * (kKH * kKW) + r;
  if constexpr (kSharedRows) return q / kKW * (kKH * kKW) + q % kKW + r * kKW;
  return q;
}

// The 16-byte columns of channels of x a window's load copies from channel c0 on: whole
// wgmma K steps (32 bytes) holding channels of x, the rest of the load's none (their
// weights are zeros, and their wgmmas are skipped).
__device__ __forceinline__ int window_chunks(int c0) {
  const int bytes = (kCin - c0 < kBK ? kCin - c0 : kBK) * kElem;
  return (bytes + 31) / 32 * 2;
}

// float32 x read NCHW (kNchwRegs): tap `tap_hw` (of a plane of taps) reads the patch's
// pixels from column nchw_column(w0, tap_hw) of the input on; its box starts at the
// 16-byte column at or before that one, nchw_lead(tap_hw) (0 to 3) columns earlier (w0 is
// a multiple of kTW, so of 4).
__device__ __forceinline__ int nchw_column(int w0, int tap_hw) { return w0 + tap_hw % kKW * kDW - kPW; }
__device__ __forceinline__ int nchw_lead(int tap_hw) { return (tap_hw % kKW * kDW - kPW) & 3; }

// x rounded to the nearest TF32 value (ties away from zero), as ops.round_to_tf32 rounds.
__device__ __forceinline__ uint32_t tf32_bits(float x) {
  uint32_t u;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
  return u;
}

// A consumer thread's A fragments of k8 step `kk` of a k-step (kNchwRegs), rounded to TF32,
// for each of its m64 blocks: rows r and r + 8 (r = 16 * warp + lane / 4 of the block), k
// columns lane % 4 and lane % 4 + 4 (mma.m16n8k8's A a warp). Tile row `row` is pixel (row
// / kTW, row % kTW) of the patch; `box` points at the stage's box past its lead columns:
// channel c of patch row t at box[(c * kTH + t) * kNchwBoxW]. A register's 32 lanes read 8
// neighbouring pixels of 4 channels kTH * kNchwBoxW floats apart (8 banks past 32 floats):
// 32 distinct banks.
__device__ __forceinline__ void nchw_a_regs(uint32_t (&av)[kMBlocks][4], const float* box, int kk, int tid,
                                            int half) {
  const int lane = tid % 32;
  constexpr int kChan = kTH * kNchwBoxW;
#pragma unroll
  for (int b = 0; b < kMBlocks; ++b) {
    const int row = (kPingPong ? 0 : half * 64) + b * 64 + tid / 32 * 16 + lane / 4;
    const float* p = box + (kMmaK * kk + lane % 4) * kChan + row / kTW * kNchwBoxW + row % kTW;
    av[b][0] = tf32_bits(p[0]);
    av[b][1] = tf32_bits(p[8]);
    av[b][2] = tf32_bits(p[4 * kChan]);
    av[b][3] = tf32_bits(p[4 * kChan + 8]);
  }
}

// The kernel's body (the file's __global__ wrapper calls it with its __grid_constant__
// tensor maps): map_x over x [rows, H, W, C_in] (dims C_in, W, H, rows; kDepth: over x
// [rows, D, H, W, C_in], dims C_in, W, H, D, rows, a box one plane deep; kNchw: over x
// [rows, C_in, H, W], dims W, H, C_in, rows, a box an m64 block), map_w over w
// [kChannels, kTaps x kCinPad]. Warpgroup 0's first thread loads, by TMA, for each k-step
// (tap, channel block of kSwizzle bytes: the tiles' rows) the patch of input pixels that
// tap reads (the patch's origin times the stride, shifted by the tap times the dilation;
// every kSW-th / kSH-th pixel, the map's element strides; zeros past the image: the
// conv's padding) and the tap's weights, tile after tile of the CTA in order, into one
// ring. With kSharedRows (stride 1 along the height) a stage is a load of kTapRows
// k-steps: the taps of a kernel column (and depth tap) read rows of x kDH apart, so one
// box of kTH + (kKH - 1) * kDH rows holds all of them (the rows of a tap start r * kDH
// box rows in, whole 8-row swizzle atoms as kTW is a multiple of 8), beside those taps'
// weights: a third of the copies of x of a 3 x 3 kernel's, fewer of their rows by up to
// kKH x (conv_sm90.SHARED_ROWS: k-steps of 64 bytes). With kResidentW (one channel
// tile) the producer copies every k-step's weights once, before the first tile, onto
// their own barrier, and the stages hold x alone. With kWindow (stride 1, patches of 64
// or 128 columns) a load is a channel block of every tap of a depth plane: the tile's
// whole input window, kWinH rows of kWinW pixels, one unswizzled box a 16-byte column of
// channels (window_chunks: those holding x's channels), where tap (kh, kw) of an m64
// block (inside one patch row) starts kh * kDH rows and kw * kDW pixels in (desc_nosw:
// 16-byte rows, 8-row groups 128 bytes apart, a wgmma's two columns kChunkBytes apart).
// Warpgroups 1 and 2 multiply (wgmma), apply the chain in registers, stage the tile and
// issue its bulk copies to out, which run under the next mainloop. Persistent: CTA b
// takes tiles b, b + gridDim.x, ... (its tiles 0, 1, 2, ...); cooperative, both consumer
// warpgroups take each; ping-pong, warpgroup h takes the CTA's tiles h, h + 2, ... The
// ring's stage and phase run on across tiles.
template <int kPass>
__device__ __forceinline__ void conv_body(const CUtensorMap& map_x, const CUtensorMap& map_w, const Args& a) {
  static_assert(kRecompute ? kConvStats && kPass != kPassOnce : kPass == kPassOnce, "the passes of the file's plan");
  constexpr bool kMoments = kConvStats && kPass != kPassNormed;  // the tiles write their moments
  constexpr bool kStores = kPass != kPassMoments && !kConvReduce && !kConvPixelReduce;  // ... or their values
  constexpr int kProducerRegs = kPingPong ? 40 : 72, kConsumerRegs = kPingPong ? 232 : 216;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "the CTA's registers");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* tiles_a = smem;
  uint8_t* tiles_b = smem + kStages * kStageA;  // kResidentW: every k-step's weights, kWeightBytes
  uint8_t* staging = tiles_b + kWeightsRoom;
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages], weights_full;
  // The weights of k-step (tap, channel block c) of load i, step r of it (kTapRows)
  const auto weights_at = [&](int s, int i, int r) -> const uint8_t* {
    if constexpr (kResidentW) {
      return tiles_b + (load_tap(i, r) * kCBlocks + i % kCBlocks) * kTileB;
    } else {
      return tiles_b + s * kStageB + r * kTileB;
    }
  };

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int n_tiles = static_cast<int>(a.rows) * kTilesPerImage;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      hop::mbar_init(&full[s], 1);
      hop::mbar_init(&empty[s], kPingPong ? 4 : 8);  // one arrival a warp of the consumers of the stage
    }
    if constexpr (kResidentW) hop::mbar_init(&weights_full, 1);
    hop::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    hop::regs_dec<kProducerRegs>();
    if (tid == 0) {  // the producer
      if constexpr (kResidentW) {  // every k-step's weights, once: the CTA's tiles share their channels
        hop::mbar_expect_tx(&weights_full, kWeightBytes);
        for (int k = 0; k < kKSteps; ++k)
          hop::tma_load_2d(tiles_b + k * kTileB, &map_w, &weights_full, k * kBK, 0);  // (tap, block): k * kBK
      }
      int it = 0;
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int img, h0, w0, n0;
        conv_tile_origin(tile, img, h0, w0, n0);
        for (int i = 0; i < kLoads; ++i, ++it) {
          // load i: channel block i % kCBlocks of tap `tap` (kSharedRows: of the taps tap,
          // tap + kKW, ... down the kernel's height, whose rows of x one box holds; kWindow:
          // of the taps of its depth plane, the window of x a box a 16-byte column)
          const int s = it % kStages, c0 = i % kCBlocks * kBK;
          const int tap = load_tap(i, 0);
          const int tap_hw = tap % (kKH * kKW);  // the tap's place in a depth plane of taps
          // (kDepth) the patch's output plane, and the input plane its depth tap reads
          const int plane = h0 / kHoPlane, plane_in = plane * kSD + tap / (kKH * kKW) * kDD - kPD;
          if (it >= kStages) hop::mbar_wait(&empty[s], ((it / kStages) + 1) & 1);
          const int chunks = kWindow ? window_chunks(c0) : 0;
          hop::mbar_expect_tx(&full[s], (kWindow ? chunks * kWinBoxBytes : kNchwRegs ? kNchwBoxBytes : kStageA) +
                                            (kResidentW ? 0 : kStageB));
          if constexpr (kWindow) {  // the window a box a 16-byte column of channels, from the patch's origin
            for (int j = 0; j < chunks; ++j) {
              uint8_t* dst = tiles_a + s * kStageA + j * kChunkBytes;
              if constexpr (kDepth) {
                hop::tma_load_5d(dst, &map_x, &full[s], c0 + j * kChunkElems, w0 - kPW, h0 - plane * kHoPlane - kPH,
                                 plane_in, img);
              } else {
                hop::tma_load_4d(dst, &map_x, &full[s], c0 + j * kChunkElems, w0 - kPW, h0 - kPH, img);
              }
            }
          } else if constexpr (kNchwRegs) {
            // float32: one box, the patch's kTH rows by kBK channels, from the 16-byte column
            // at or before the tap's first (nchw_column; its 0-3 columns before the patch
            // are skipped by the consumers' loads)
            hop::tma_load_4d(tiles_a + s * kStageA, &map_x, &full[s], nchw_column(w0, tap_hw) - nchw_lead(tap_hw),
                             h0 + tap_hw / kKW * kDH - kPH, c0, img);
          } else if constexpr (kNchw) {  // a box an m64 block: its kNchwBoxW pixels of one patch row, kBK channels
#pragma unroll
            for (int b = 0; b < kBM / 64; ++b)
              hop::tma_load_4d(tiles_a + s * kStageA + b * 64 * kSwizzle, &map_x, &full[s],
                               w0 + b * 64 % kTW + tap_hw % kKW * kDW - kPW,
                               (h0 + b * 64 / kTW) * kSH + tap_hw / kKW * kDH - kPH, c0, img);
          } else if constexpr (kDepth) {  // the tap's input plane for the patch's output plane
            hop::tma_load_5d(tiles_a + s * kStageA, &map_x, &full[s], c0, w0 * kSW + tap_hw % kKW * kDW - kPW,
                             (h0 - plane * kHoPlane) * kSH + tap_hw / kKW * kDH - kPH, plane_in, img);
          } else {
            hop::tma_load_4d(tiles_a + s * kStageA, &map_x, &full[s], c0, w0 * kSW + tap_hw % kKW * kDW - kPW,
                             h0 * kSH + tap_hw / kKW * kDH - kPH, img);
          }
          if constexpr (!kResidentW) {
#pragma unroll
            for (int r = 0; r < kTapRows; ++r)
              hop::tma_load_2d(tiles_b + s * kStageB + r * kTileB, &map_w, &full[s], load_tap(i, r) * kCinPad + c0,
                               n0);
          }
        }
      }
    }  // warps 1-3 have nothing to do
  } else {  // consumers: tile rows 64 * (wg - 1) .. + 64, or (ping-pong) whole tiles in turn
    hop::regs_inc<kConsumerRegs>();
    const int half = wg - 1;
    const int ft = kPingPong ? tid : half * 128 + tid;  // this thread among the tile's finishers
    const auto release = [&](int s) {
      __syncwarp();
      if (tid % 32 == 0) hop::mbar_arrive(&empty[s]);
    };
    if constexpr (kResidentW) hop::mbar_wait(&weights_full, 0);  // its one phase
    const int first = blockIdx.x + (kPingPong ? half * gridDim.x : 0);
    const int step = (kPingPong ? 2 : 1) * gridDim.x;
    for (int tile = first, j = 0; tile < n_tiles; tile += step, ++j) {
      // the tile's loads in the ring: the CTA's tiles before it had kLoads each
      int it = (kPingPong ? 2 * j + half : j) * kLoads;
      // ping-pong: the other warpgroup's tile after this one exists (it waits for this
      // warpgroup's turn to end), and the one before it (this waits for its turn)
      const bool other_next = kPingPong && tile + gridDim.x < n_tiles;
      const bool other_before = kPingPong && tile - static_cast<int>(gridDim.x) >= static_cast<int>(blockIdx.x);
      int img, h0, w0, n0;
      conv_tile_origin(tile, img, h0, w0, n0);
      float d[kMBlocks][kBN / 2];
#pragma unroll
      for (int b = 0; b < kMBlocks; ++b)
#pragma unroll
        for (int i = 0; i < kBN / 2; ++i) d[b][i] = 0.f;
      TileChans chans;
      load_chans(chans, tid, n0, a);
      if (other_before) hop::named_sync<256>(kBarMath + half);  // the other's wgmmas are all issued
      for (int i = 0; i < kLoads; ++i, ++it) {
        const int s = it % kStages;
        hop::mbar_wait(&full[s], (it / kStages) & 1);
        if constexpr (kNchwRegs) {
          // float32 x read NCHW: the k-step's A fragments into registers, rounded, then its
          // wgmmas, waited for before the next k-step's registers are written (ptxas
          // serializes every wgmma of a file whose A registers are written while an earlier
          // wgmma is in flight). Cooperative, so that the other warpgroup's wgmmas run
          // while this one loads.
          const uint8_t* sb = weights_at(s, i, 0);
          const float* box =
              reinterpret_cast<const float*>(tiles_a + s * kStageA) + nchw_lead(load_tap(i, 0) % (kKH * kKW));
          uint32_t av[kBK / kMmaK][kMBlocks][4];
#pragma unroll
          for (int kk = 0; kk < kBK / kMmaK; ++kk) nchw_a_regs(av[kk], box, kk, tid, half);
          hop::wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBK / kMmaK; ++kk)
#pragma unroll
            for (int b = 0; b < kMBlocks; ++b)
              wgmma_regs_n(d[b], av[kk][b], hop::desc_sw<kSwizzle>(sb + kk * 32), (i > 0 || kk > 0) ? 1 : 0);
          hop::wgmma_commit();
          hop::wgmma_wait<0>();
          release(s);
          continue;
        }
        hop::wgmma_fence();
#pragma unroll
        for (int r = 0; r < kTapRows; ++r) {
          const uint8_t* sb = weights_at(s, i, r);
          if constexpr (kWindow) {
            // tap (kh, kw) of the plane: an m64 block (inside one patch row, kTW % 64 == 0)
            // reads the window's pixels from its origin shifted by the tap, 16-byte rows
            // (8-row groups 128 bytes apart), a wgmma's two 16-byte columns kChunkBytes apart
            const int kh = r / kKW, kw = r % kKW, c0 = i % kCBlocks * kBK;
#pragma unroll
            for (int kk = 0; kk < kBK / kMmaK; ++kk) {
              if (2 * kk >= window_chunks(c0)) break;  // the load's columns past x's channels: not copied
#pragma unroll
              for (int b = 0; b < kMBlocks; ++b) {
                const int row0 = (kPingPong ? 0 : half * 64) + b * 64, t = row0 / kTW, x0 = row0 % kTW;
                const uint8_t* sa = tiles_a + s * kStageA + 2 * kk * kChunkBytes +
                                    ((t + kh * kDH) * kWinW + x0 + kw * kDW) * 16;
                wgmma_n(d[b], hop::desc_nosw(sa, kChunkBytes, 128), hop::desc_sw<kSwizzle>(sb + kk * 32),
                        (i > 0 || r > 0 || kk > 0) ? 1 : 0);
              }
            }
          } else {
            // the k-step's tap reads the box from its row r * kDH on: whole 8-row swizzle atoms
            const uint8_t* sa = tiles_a + s * kStageA + (r * kDH * kTW + (kPingPong ? 0 : half * 64)) * kSwizzle;
#pragma unroll
            for (int kk = 0; kk < kBK / kMmaK; ++kk)
#pragma unroll
              for (int b = 0; b < kMBlocks; ++b) {
                // an m64 block's rows of kSwizzle bytes, K-major; or (kNchw) its kBK channel rows
                // of 64 pixels, MN-major: a wgmma's 16 channels are two 1 KB atoms
                const uint64_t desc_a = kNchw ? hop::desc_mn128(sa + b * 64 * kSwizzle + kk * 2048)
                                              : hop::desc_sw<kSwizzle>(sa + b * 64 * kSwizzle + kk * 32);
                wgmma_n(d[b], desc_a, hop::desc_sw<kSwizzle>(sb + kk * 32), (i > 0 || r > 0 || kk > 0) ? 1 : 0);
              }
          }
        }
        hop::wgmma_commit();
        hop::wgmma_wait<1>();  // the previous k-step's wgmma is done: free its stage
        if (i > 0) release((it - 1) % kStages);
      }
      // The other's turn: its wgmmas queue behind this tile's last ones. (In turn, a
      // warpgroup's wait on a stage's `full` barrier is at most one phase ahead of the
      // stage's last fill. Run with two mainloops at once the kernel failed, "unspecified
      // launch failure" on an H100; likely a wait two phases ahead, whose parity reads
      // as complete.)
      if (other_next) hop::named_arrive<256>(kBarMath + 1 - half);
      hop::wgmma_wait<0>();
#pragma unroll
      for (int b = 0; b < kMBlocks; ++b) hop::fence_accumulators(d[b]);
      if constexpr (!kNchwRegs) release((it - 1) % kStages);  // (kNchwRegs: each k-step's at its wait)
      if constexpr (kPingPong) {
        if (other_before) hop::named_sync<256>(kBarStage + half);  // its copies have read the staging tile
      } else if (tile != static_cast<int>(blockIdx.x)) {  // the last tile's copies have read the staging tile
        hop::bulk_wait_read();
        hop::named_sync<kBarEmpty, kFinishers>();
      }
#pragma unroll
      for (int b = 0; b < kMBlocks; ++b)
        stage_chain<kPass>(d[b], chans, staging, kPingPong ? b : half, tid, img, h0, w0, n0, a);
      hop::fence_async_shared();  // the staging tile's writes, before the bulk copies read it
      hop::named_sync<kFinishers>(kBarFull + (kPingPong ? half : 0));  // the whole tile is staged
      if constexpr (kConvPool) {
        pool_runs(staging, ft, img, h0, w0, n0, a);
      } else if constexpr (kStores) {
        store_runs(staging, ft, img, h0, w0, n0, a);
      }
      if (other_next) {  // the other warpgroup stages its tile once these copies have read this one
        hop::bulk_wait_read();
        hop::named_arrive<256>(kBarStage + 1 - half);
      }
      if constexpr (kMoments) {  // the tile's moments, on the finishers' barrier
        float* scratch = reinterpret_cast<float*>(staging + kStaging) + (kPingPong ? half * kStatsFloats : 0);
        tile_moments(d, kPingPong ? 0 : half, tid, ft, scratch, tile, h0, w0, n0, a,
                     [&] { hop::named_sync<kFinishers>(kBarFull + (kPingPong ? half : 0)); });
      }
      if constexpr (kConvReduce) {  // the tile's reduction of each channel, on the finishers' barrier
        float* scratch = reinterpret_cast<float*>(staging + kStaging) + (kPingPong ? half * kStatsFloats : 0);
        tile_reduce(d, kPingPong ? 0 : half, tid, ft, scratch, tile, h0, w0, n0, a,
                    [&] { hop::named_sync<kFinishers>(kBarFull + (kPingPong ? half : 0)); });
      }
    }
    hop::bulk_wait();  // the copies are complete before the kernel ends
  }
}
