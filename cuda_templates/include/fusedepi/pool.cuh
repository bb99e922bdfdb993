// The apply kernel of a pooling window (MaxPool / AvgPool over 1 to 3 spatial dims) of a
// conv output: y [rows, kChannels, kInD, kInH, kInW] (NCHW, kInner elements a channel), or
// channels-last (kChannelsLastY: [rows, kInner, kChannels] in memory, a library conv's
// output in the layout cuDNN is fastest in). The output [rows, kChannels, kOutD, kOutH,
// kOutW] is contiguous either way.
//
// A thread takes one output element (row, channel, pooled pixel) and walks its window in
// PyTorch's order (depth, height, width), applying stage0 to each element it reads.
// Consecutive threads take consecutive pooled pixels of one channel (NCHW y), or
// consecutive channels of one pooled pixel (channels-last y: the loads of a warp are then
// contiguous). The reduction is PyTorch's CUDA kernels': max keeps the first maximum and a
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
//   kChannelsLastY  y is channels-last.
// It is not a standalone header: the launch plan's constants differ per file.
#pragma once

constexpr long long kOutInner = static_cast<long long>(kOutD) * kOutH * kOutW;  // pooled pixels a channel
static_assert(static_cast<long long>(kInD) * kInH * kInW == kInner, "the window's input sizes are the plane's");

__device__ __forceinline__ void pool_apply(const Args& a) {
  const long long t = static_cast<long long>(blockIdx.x) * kBlock + threadIdx.x;
  if (t >= a.rows * kChannels * kOutInner) return;
  long long n;
  int c, o;
  if constexpr (kChannelsLastY) {  // t = (n * kOutInner + o) * kChannels + c
    const long long pixel = t / kChannels;
    c = static_cast<int>(t - pixel * kChannels);
    n = pixel / kOutInner;
    o = static_cast<int>(pixel - n * kOutInner);
  } else {  // t = (n * kChannels + c) * kOutInner + o
    const long long plane = t / kOutInner;
    o = static_cast<int>(t - plane * kOutInner);
    n = plane / kChannels;
    c = static_cast<int>(plane - n * kChannels);
  }
  const int ow = o % kOutW, oh = (o / kOutW) % kOutH, od = o / (kOutW * kOutH);
  const int d0 = od * kSD - kPD, h0 = oh * kSH - kPH, w0 = ow * kSW - kPW;
  const long long plane_at = (n * kChannels + c) * static_cast<long long>(kInner);  // y's (n, c) plane, NCHW
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
        const long long at = kChannelsLastY ? (n * kInner + q) * kChannels + c : plane_at + q;
        float v[1] = {fusedepi::to_float(a.y[at])};
        if constexpr (!kStage0Done) stage0<1>(v, c * static_cast<int>(kInner) + q, plane_at + q, a);
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
  // channel from a position of the unpooled plane), its flat index the output's.
  const long long e0 = (n * kChannels + c) * kOutInner + o;
  float v[1] = {r};
  stage1<1>(v, c * static_cast<int>(kInner), e0, a, 0.f, 0.f, true);
  a.out[e0] = fusedepi::from_float<T>(v[0]);
}
