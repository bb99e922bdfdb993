// Row reductions in the in-kernel GEMM: each consumer thread folds its 64 values of a
// tile row and its quad's shuffles combine them into the row's partial statistics for
// the tile (row_tile_partials); a second kernel, a warp a row, combines a row's kTilesN
// partials into its value (row_combine). The arithmetic is the apply kernel's
// (team_reduce.cuh), the summation order the tiles'.
//
// Included by the in-kernel GEMM's rendered file (cuda_templates/gemm_sm90.py,
// GEMM_KERNELS) inside its anonymous namespace, after kTilesN and kChannels.
// It is not a standalone header: those constants differ per file.
#pragma once

// Row `h` of this consumer thread's accumulators (`d`, wgmma's layout: 64 values)
// folded into one float: it starts at `init` and becomes update(acc, e) for each.
template <class Update>
__device__ __forceinline__ float tile_fold(const float (&d)[128], int h, float init, Update update) {
  float acc = init;
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int i = 0; i < 2; ++i) acc = update(acc, d[4 * j + 2 * h + i]);
  return acc;
}

// The partial statistics (p0, p1) of row `h` over the tile's 256 columns:
// logsumexp (max, sum of exp(e - max)), sum and mean (sum, 0), amax and amin (the max
// of x or -x, the NaN count: fmaxf skips NaN, so NaNs are counted apart).
template <fusedepi::RowReduce kOp>
__device__ __forceinline__ void row_tile_partials(const float (&d)[128], int h, float& p0, float& p1) {
  using fusedepi::RowReduce;
  if constexpr (kOp == RowReduce::kLogsumexp) {
    p0 = fusedepi::team_max_warp<4>(tile_fold(d, h, -INFINITY, [](float acc, float e) { return fmaxf(acc, e); }));
    const float shift = isinf(p0) ? 0.f : p0;
    p1 = fusedepi::team_sum_warp<4>(tile_fold(d, h, 0.f, [&](float acc, float e) { return acc + expf(e - shift); }));
  } else if constexpr (kOp == RowReduce::kSum || kOp == RowReduce::kMean) {
    p0 = fusedepi::team_sum_warp<4>(tile_fold(d, h, 0.f, [](float acc, float e) { return acc + e; }));
    p1 = 0.f;
  } else {
    constexpr bool kMax = kOp == RowReduce::kAmax;  // amin: the max of -x
    p0 = fusedepi::team_max_warp<4>(
        tile_fold(d, h, -INFINITY, [](float acc, float e) { return fmaxf(acc, kMax ? e : -e); }));
    p1 = fusedepi::team_sum_warp<4>(
        tile_fold(d, h, 0.f, [](float acc, float e) { return acc + (isnan(e) ? 1.f : 0.f); }));
  }
}

// A row's kTilesN partials `parts` folded by a warp (a lane taking every 32nd, from
// `init` by update(acc, q)), then across the warp by `combine`.
template <class Update, class Combine>
__device__ __forceinline__ float parts_fold(const float2* parts, int lane, float init, Update update,
                                            Combine combine) {
  float acc = init;
  for (int t = lane; t < kTilesN; t += 32) acc = update(acc, parts[t]);
  return combine(acc);
}

// The row's value from its tiles' partials. logsumexp: each tile's sum is rescaled to
// the row's max by exp(tile max - row max); where a maximum is infinite, exp(e) itself
// (shift 0), as the apply kernel does: a tile of -inf has sum 0 and factor exp(-inf) =
// 0; a tile with +inf has sum inf, and the row's shift is then 0. A NaN reaches the
// result through the sums.
template <fusedepi::RowReduce kOp>
__device__ __forceinline__ float row_combine(const float2* parts, int lane) {
  using fusedepi::RowReduce;
  const auto max = [](float v) { return fusedepi::team_max_warp<32>(v); };
  const auto sum = [](float v) { return fusedepi::team_sum_warp<32>(v); };
  if constexpr (kOp == RowReduce::kLogsumexp) {
    const float m = parts_fold(parts, lane, -INFINITY, [](float acc, float2 q) { return fmaxf(acc, q.x); }, max);
    const float shift = isinf(m) ? 0.f : m;
    const float s =
        parts_fold(parts, lane, 0.f, [&](float acc, float2 q) { return acc + q.y * expf(q.x - shift); }, sum);
    return logf(s) + shift;
  } else if constexpr (kOp == RowReduce::kSum || kOp == RowReduce::kMean) {
    const float s = parts_fold(parts, lane, 0.f, [](float acc, float2 q) { return acc + q.x; }, sum);
    return kOp == RowReduce::kMean ? s / static_cast<float>(kChannels) : s;
  } else {
    const float m = parts_fold(parts, lane, -INFINITY, [](float acc, float2 q) { return fmaxf(acc, q.x); }, max);
    const float nans = parts_fold(parts, lane, 0.f, [](float acc, float2 q) { return acc + q.y; }, sum);
    return nans > 0.f ? NAN : (kOp == RowReduce::kAmax ? m : -m);
  }
}
