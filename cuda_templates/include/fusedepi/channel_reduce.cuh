// The apply kernel of a reduction over a conv output's channels, per pixel: softmax or
// log_softmax over dim 1 (the output keeps y's shape), or logsumexp, sum, mean, amax,
// amin over dim 1 (one value per (row, pixel)).
//
// y is [rows, kChannels, kInner] (NCHW): a pixel's channels are kInner apart. A thread
// takes kV consecutive pixels of one row and walks their channels, each step one vector
// load that the warp's lanes make contiguous. Or y is channels-last (kChannelsLastY:
// [rows, kInner, kChannels], a library conv's output in the layout cuDNN is fastest in):
// a thread takes one pixel (kV = 1) and loads its channels kCV at a time. Either way
// the output is written in the graph's contiguous layout, consecutive threads on
// consecutive pixels. Where the chain's stage0 values of all channels fit in registers
// (kHold) they are read once; otherwise each pass reads y again (and recomputes stage0):
// softmax's statistics in one online pass, then the normalize; logsumexp's maximum,
// then its sum.
//
// Included by the rendered file (cuda_templates/templates.py, CHANNEL_APPLY_KERNEL) after
// it defined, besides the launch plan's constants and Args, stage0 and stage1 and:
//   kChannelNorm   0: a reduction (kChannelOp), 1: softmax, 2: log_softmax;
//   kChannelOp     the reduction (fusedepi::RowReduce) when kChannelNorm is 0;
//   kChannelsLastY y is channels-last; kCV: channels a load there (1 otherwise).
// It is not a standalone header: the launch plan's constants differ per file.
#pragma once

constexpr int kHoldMax = 64;  // floats of stage0 values a thread keeps in registers (render.CHANNEL_HOLD)
constexpr bool kHold = kChannels * kV <= kHoldMax;
constexpr long long kPixelVecs = kInner / kV;  // vectors of pixels a row
static_assert(kInner % kV == 0, "a vector of pixels lies in one channel");
static_assert(!kChannelsLastY || (kV == 1 && kChannels % kCV == 0), "channels-last: a pixel a thread, whole loads");
static_assert(kChannelsLastY || kCV == 1, "NCHW: a channel a load");

// The stage0 values of channels c .. c + kCV - 1 at this thread's pixels (row n, first
// pixel q): y loaded, then stage0 (saving what it saves where `save`).
__device__ __forceinline__ void channel_values(const Args& a, long long n, int q, int c, float (&v)[kCV][kV],
                                               bool save) {
  if constexpr (kChannelsLastY) {
    float w[kCV];
    fusedepi::load_vec<T, kCV>(a.y + (n * kInner + q) * kChannels + c, w);
#pragma unroll
    for (int j = 0; j < kCV; ++j) {
      float one[1] = {w[j]};
      if constexpr (!kStage0Done)
        stage0<1>(one, (c + j) * static_cast<int>(kInner) + q, (n * kChannels + c + j) * kInner + q, a, save);
      v[j][0] = one[0];
    }
  } else {
    const long long e0 = (n * kChannels + c) * kInner + q;
    fusedepi::load_vec<T, kV>(a.y + e0, v[0]);
    if constexpr (!kStage0Done) stage0<kV>(v[0], c * static_cast<int>(kInner) + q, e0, a, save);
  }
}

// f(c, v) for every channel c in order, v its values: from registers where they are held
// (`first`: loaded into them), else loaded again (`first`: saving stage0's saves).
template <class F>
__device__ __forceinline__ void each_channel(const Args& a, long long n, int q, float (&held)[kHold ? kChannels : 1][kV],
                                             bool first, F f) {
  if constexpr (kHold) {
    if (first) {
#pragma unroll
      for (int c = 0; c < kChannels; c += kCV)
        channel_values(a, n, q, c, *reinterpret_cast<float(*)[kCV][kV]>(&held[c]), true);
    }
#pragma unroll
    for (int c = 0; c < kChannels; ++c) f(c, held[c]);
  } else {
#pragma unroll 4
    for (int c = 0; c < kChannels; c += kCV) {
      float v[kCV][kV];
      channel_values(a, n, q, c, v, first);
#pragma unroll
      for (int j = 0; j < kCV; ++j) f(c + j, v[j]);
    }
  }
}

// Online softmax statistics over the channels: m the running maximum (NaN skipped by
// fmaxf), s the sum of exp(x - m) rescaled as m grows; a -inf element adds 0 (a pixel of
// only -inf keeps s = 0 and normalizes to NaN, as eager's does). A NaN reaches s.
__device__ __forceinline__ void online_softmax(float x, float& m, float& s) {
  const float mn = fmaxf(m, x);
  s = s * (m == mn ? 1.f : expf(m - mn)) + (x == -INFINITY ? 0.f : expf(x - mn));
  m = mn;
}

__device__ __forceinline__ void channel_apply(const Args& a) {
  const long long t = (long long)blockIdx.x * kBlock + threadIdx.x;
  if (t >= a.rows * kPixelVecs) return;
  const long long n = t / kPixelVecs;
  const int q = static_cast<int>(t - n * kPixelVecs) * kV;
  float held[kHold ? kChannels : 1][kV];
  if constexpr (kChannelNorm > 0) {
    float m[kV], s[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) m[j] = -INFINITY, s[j] = 0.f;
    each_channel(a, n, q, held, true, [&](int, const float (&v)[kV]) {
#pragma unroll
      for (int j = 0; j < kV; ++j) online_softmax(v[j], m[j], s[j]);
    });
#pragma unroll
    for (int j = 0; j < kV; ++j) s[j] = kChannelNorm == 2 ? logf(s[j]) : s[j];
    each_channel(a, n, q, held, false, [&](int c, const float (&v)[kV]) {
      const long long e0 = (n * kChannels + c) * kInner + q;
      float out[kV];
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        float one[1] = {v[j]};
        stage1<1>(one, c * static_cast<int>(kInner) + q + j, e0 + j, a, m[j], s[j], true);
        out[j] = one[0];
      }
      fusedepi::store_vec<T, kV>(a.out + e0, out);
    });
  } else {
    float r[kV];
    if constexpr (kChannelOp == fusedepi::RowReduce::kSum || kChannelOp == fusedepi::RowReduce::kMean) {
#pragma unroll
      for (int j = 0; j < kV; ++j) r[j] = 0.f;
      each_channel(a, n, q, held, true, [&](int, const float (&v)[kV]) {
#pragma unroll
        for (int j = 0; j < kV; ++j) r[j] += v[j];
      });
      if constexpr (kChannelOp == fusedepi::RowReduce::kMean) {
#pragma unroll
        for (int j = 0; j < kV; ++j) r[j] /= static_cast<float>(kChannels);
      }
    } else if constexpr (kChannelOp == fusedepi::RowReduce::kLogsumexp) {
      // As the apply kernel's team_row_reduce: the maximum, then the sum of exp(x - shift)
      // with shift = 0 where the maximum is infinite.
      float mx[kV], sum[kV];
#pragma unroll
      for (int j = 0; j < kV; ++j) mx[j] = -INFINITY, sum[j] = 0.f;
      each_channel(a, n, q, held, true, [&](int, const float (&v)[kV]) {
#pragma unroll
        for (int j = 0; j < kV; ++j) mx[j] = fmaxf(mx[j], v[j]);
      });
#pragma unroll
      for (int j = 0; j < kV; ++j) mx[j] = isinf(mx[j]) ? 0.f : mx[j];
      each_channel(a, n, q, held, false, [&](int, const float (&v)[kV]) {
#pragma unroll
        for (int j = 0; j < kV; ++j) sum[j] += expf(v[j] - mx[j]);
      });
#pragma unroll
      for (int j = 0; j < kV; ++j) r[j] = logf(sum[j]) + mx[j];
    } else {  // amax, amin: the max of x (of -x), NaN where any is NaN
      constexpr bool kMax = kChannelOp == fusedepi::RowReduce::kAmax;
      bool nan[kV];
#pragma unroll
      for (int j = 0; j < kV; ++j) r[j] = -INFINITY, nan[j] = false;
      each_channel(a, n, q, held, true, [&](int, const float (&v)[kV]) {
#pragma unroll
        for (int j = 0; j < kV; ++j) r[j] = fmaxf(r[j], kMax ? v[j] : -v[j]), nan[j] = nan[j] || isnan(v[j]);
      });
#pragma unroll
      for (int j = 0; j < kV; ++j) r[j] = nan[j] ? NAN : (kMax ? r[j] : -r[j]);
    }
    // The steps after the reduction, on each pixel's value (flat index n * kInner + pixel).
    const long long e0 = n * kInner + q;
#pragma unroll
    for (int j = 0; j < kV; ++j) {
      float one[1] = {r[j]};
      stage1<1>(one, 0, e0 + j, a, 0.f, 0.f, true);
      r[j] = one[0];
    }
    fusedepi::store_vec<T, kV>(a.out + e0, r);
  }
}
