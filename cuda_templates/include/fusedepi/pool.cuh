// The apply kernel of a pooling window (MaxPool / AvgPool over 1 to 3 spatial dims) of a
// conv output: y [rows, kChannels, kInD, kInH, kInW] (NCHW, kInner elements a channel), or
// channels-last (kChannelsLastY: [rows, kInner, kChannels] in memory, a library conv's
// output in the layout cuDNN is fastest in). The output [rows, kChannels, kOutD, kOutH,
// kOutW] is contiguous either way. Or (kPoolRow) a 1-D window over a Linear output's
// features: y [rows, kChannels] (rows kYRow apart), each row one plane, the output
// [rows, kOutW].
//
// A thread computes one output element (row, channel, pooled pixel) at a time: it walks
// its window in PyTorch's order (depth, height, width), applying stage0 to each element
// it reads. On an NCHW y consecutive threads take consecutive pooled pixels of one
// channel. On a channels-last y a block takes a tile of kTilePixels consecutive pooled
// pixels of one row with all their channels: consecutive threads take consecutive
// channels of a pixel (a warp's loads are contiguous), the results wait in shared memory,
// and the block writes them channel by channel, kTilePixels consecutive elements each
// (each thread writing its own element would scatter a warp's stores over 32 planes).
// The reduction is PyTorch's CUDA kernels': max keeps the first maximum and a
// NaN wins (`v > m || isnan(v)`); avg sums in float32 in window order and divides by
// divisor_override, else by the window's size clipped to the padded input
// (count_include_pad) or to the input; a window with no input element gives 0. stage1
// then runs on the pooled value.
//
// Included by the rendered file (cuda_templates/templates.py, POOL_APPLY_KERNEL) after it
// defined, besides the launch plan's constants and Args, stage0 and stage1 and:
//   kPoolMax        max, else avg;
//   kInD/H/W, kOutD/H/W, kKD/H/W, kSD/H/W, kPD/H/W, kDD/H/W: input and pooled sizes,
//                   kernel, stride, padding and dilation per dim (unused dims: sizes 1,
//                   kernel 1, stride 1, padding 0, dilation 1);
//   kCountPad       avg: the divisor counts the padding;
//   kDivisor        avg: divisor_override, or 0;
//   kChannelsLastY  y is channels-last;
//   kPoolRow        the window runs over a Linear output's features (a row is one plane);
//   kTilePixels     channels-last: the pooled pixels a block's tile holds (render.Plan.tile).
// It is not a standalone header: the launch plan's constants differ per file.
#pragma once

constexpr long long kOutInner = static_cast<long long>(kOutD) * kOutH * kOutW;  // pooled pixels a plane
constexpr long long kPlanes = kPoolRow ? 1 : kChannels;  // planes a row: a conv's channels, or the row itself
constexpr int kPlane = kPoolRow ? static_cast<int>(kChannels) : kInner;  // elements a plane
static_assert(static_cast<long long>(kInD) * kInH * kInW == kPlane, "the window's input sizes are the plane's");
static_assert(!kPoolRow || !kChannelsLastY, "a Linear output has one layout");
// Channels-last: the tiles a row.
static_assert(!kChannelsLastY || (kTilePixels >= 1 && kChannels * (kTilePixels + 1) * 4 <= 48 * 1024),
              "a channels-last tile of at least one pixel, in static shared memory");
constexpr long long kRowTiles = kChannelsLastY ? (kOutInner + kTilePixels - 1) / kTilePixels : 0;
// Blocks a row of the output: NCHW, a thread an element; channels-last, a tile a block.
constexpr long long kPoolBlocksPerRow =
    kChannelsLastY ? kRowTiles : (kPlanes * kOutInner + kBlock - 1) / kBlock;

// The output element (n, plane c, o) before rounding: the window's reduction of stage0's
// values, then stage1 (which saves what it saves).
__device__ __forceinline__ float pool_element(const Args& a, long long n, int c, int o) {
  const int ow = o % kOutW, oh = (o / kOutW) % kOutH, od = o / (kOutW * kOutH);
  const int d0 = od * kSD - kPD, h0 = oh * kSH - kPH, w0 = ow * kSW - kPW;
  const long long plane_at = (n * kPlanes + c) * static_cast<long long>(kPlane);  // the plane in the output's layout
  const long long y_plane = n * kYRow + static_cast<long long>(c) * kPlane;  // the plane in y (NCHW)
  float r = kPoolMax ? -INFINITY : 0.f;
#pragma unroll
  for (int kd = 0; kd < kKD; ++kd) {
    const int d = d0 + kd * kDD;
    if (d < 0 || d >= kInD) continue;
#pragma unroll
    for (int kh = 0; kh < kKH; ++kh) {
      const int h = h0 + kh * kDH;
      if (h < 0 || h >= kInH) continue;
#pragma unroll
      for (int kw = 0; kw < kKW; ++kw) {
        const int w = w0 + kw * kDW;
        if (w < 0 || w >= kInW) continue;
        const int q = (d * kInH + h) * kInW + w;
        const long long at = kChannelsLastY ? (n * kInner + q) * kChannels + c : y_plane + q;
        float v[1] = {fusedepi::to_float(a.y[at])};
        if constexpr (!kStage0Done) stage0<1>(v, c * kPlane + q, plane_at + q, a);
        if constexpr (kPoolMax) {
          if (v[0] > r || isnan(v[0])) r = v[0];
        } else {
          r += v[0];
        }
      }
    }
  }
  if constexpr (!kPoolMax) {
    // PyTorch's divisor: the window clipped to the padded input, or to the input.
    const int d1 = min(d0 + kKD, kInD + kPD), h1 = min(h0 + kKH, kInH + kPH), w1 = min(w0 + kKW, kInW + kPW);
    const int padded = (d1 - d0) * (h1 - h0) * (w1 - w0);
    const int inside = (min(d1, kInD) - max(d0, 0)) * (min(h1, kInH) - max(h0, 0)) * (min(w1, kInW) - max(w0, 0));
    const int divisor = kDivisor ? kDivisor : (kCountPad ? padded : inside);
    r = inside > 0 ? __fdiv_rn(r, static_cast<float>(divisor)) : 0.f;  // an empty window: 0, as PyTorch's
  }
  // The steps after the pool, on the pooled value: its channel is c (stage1 reads a
  // channel from a position of the unpooled plane; a pooled Linear row has no
  // per-feature operands after the pool), its flat index the output's.
  float v[1] = {r};
  stage1<1>(v, c * kPlane, (n * kPlanes + c) * kOutInner + o, a, 0.f, 0.f, true);
  return v[0];
}

// Grid: rows * kPoolBlocksPerRow blocks of kBlock threads.
__device__ __forceinline__ void pool_apply(const Args& a) {
  const long long n = blockIdx.x / kPoolBlocksPerRow;
  const long long part = blockIdx.x - n * kPoolBlocksPerRow;
  if constexpr (kChannelsLastY) {
    __shared__ float tile[kChannels][kTilePixels + 1];  // [channel][pixel], padded against bank conflicts
    const long long first = part * kTilePixels;  // the tile's first pooled pixel
    for (int i = threadIdx.x; i < kTilePixels * kChannels; i += kBlock) {
      const int p = i / static_cast<int>(kChannels), c = i - p * static_cast<int>(kChannels);
      if (first + p < kOutInner) tile[c][p] = pool_element(a, n, c, static_cast<int>(first + p));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kTilePixels * kChannels; i += kBlock) {
      const int c = i / kTilePixels, p = i - c * kTilePixels;
      if (first + p < kOutInner) a.out[(n * kChannels + c) * kOutInner + first + p] = fusedepi::from_float<T>(tile[c][p]);
    }
  } else {
    const long long e = part * kBlock + threadIdx.x;  // the element within the row: c * kOutInner + o
    if (e >= kPlanes * kOutInner) return;
    const int c = static_cast<int>(e / kOutInner), o = static_cast<int>(e - c * kOutInner);
    a.out[n * kPlanes * kOutInner + e] = fusedepi::from_float<T>(pool_element(a, n, c, o));
  }
}
