// Statistics of segments (GroupNorm/LayerNorm/InstanceNorm groups, or a conv's
// (row, channel) planes for BatchNorm) too long for one block: partial (mean, M2) per
// (segment, chunk) in the apply kernel's thread mapping, and their merge per segment.
//
// Included by the rendered file (cuda_templates/templates.py, SEGMENT_STATS_KERNELS and
// CHANNEL_STATS_KERNELS) inside its anonymous namespace, after apply.cuh and what it
// reads (KERNEL_FILE's constants, Args, stage0).
// It is not a standalone header: the launch plan's constants differ per file.
#pragma once

// The partial (mean, M2) of this thread's (segment, chunk) at parts + (segment *
// kChunks + chunk) * 2: a team of lanes or a block per segment, kChunks blocks per
// segment when it is long.
__device__ __forceinline__ void segment_partials(const Args& a, float* parts) {
  const Place p = place(a);
  float v[kNV][kV];
  load_stage0(a, p, a.y + y_start(p.seg), v, false);
  const float n = static_cast<float>(min(kChunkLen, kL - (long long)p.first));
  // Relative to the part's first element: a constant part gets its mean exactly.
  const float shift = fusedepi::team_first<kTeam>(v[0][0]);
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < kNV; ++k)
    if (valid(p, k))
#pragma unroll
      for (int j = 0; j < kV; ++j) s += v[k][j] - shift;
  const float mean = shift + fusedepi::team_sum<kTeam>(s) / n;
  float q = 0.f;
#pragma unroll
  for (int k = 0; k < kNV; ++k)
    if (valid(p, k))
#pragma unroll
      for (int j = 0; j < kV; ++j) q += (v[k][j] - mean) * (v[k][j] - mean);
  q = fusedepi::team_sum<kTeam>(q);
  if (p.live && p.lane == 0) {
    float* part = parts + (p.seg * kChunks + p.first / kChunkLen) * 2;
    part[0] = mean;
    part[1] = q;
  }
}

// One thread per segment: merges its chunks' partials (at a.ws, from segment_partials)
// into (mean, rstd) at a.ws + rows * kGroups * kChunks * 2 + seg * 2, then calls
// save(seg, mean, rstd) (the saved outputs that ask for them).
template <class Save>
__device__ __forceinline__ void segment_final(const Args& a, float eps, Save save) {
  const long long seg = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (seg >= a.rows * kGroups) return;
  fusedepi::Moments m = {0.f, 0.f, 0.f};
  for (int t = 0; t < kChunks; ++t) {
    const float n = static_cast<float>(min(kChunkLen, kL - (long long)t * kChunkLen));
    const float* part = a.ws + (seg * kChunks + t) * 2;
    m = fusedepi::merge(m, {n, part[0], part[1]});
  }
  float* stats = a.ws + a.rows * kGroups * kChunks * 2 + seg * 2;
  const float mean = m.mean, rstd = rsqrtf(fmaxf(m.m2 / static_cast<float>(kL), 0.f) + eps);
  stats[0] = mean;
  stats[1] = rstd;
  save(seg, mean, rstd);
}

// BatchNorm (training) after a conv, whose segments (kGroups = channels) are the (row,
// channel) planes: one block (256 threads) per channel merges the (row, chunk) partials
// that segment_partials left at a.ws + parts, then finish(c, m) with the merged moments.
template <class Finish>
__device__ __forceinline__ void channel_final(const Args& a, long long parts, Finish finish) {
  const long long c = blockIdx.x;
  fusedepi::Moments m = {0.f, 0.f, 0.f};
  for (long long i = threadIdx.x; i < a.rows * kChunks; i += 256) {
    const long long r = i / kChunks, t = i % kChunks;
    const float n = static_cast<float>(min(kChunkLen, kL - t * kChunkLen));
    const float* part = a.ws + parts + ((r * kGroups + c) * kChunks + t) * 2;
    m = fusedepi::merge(m, {n, part[0], part[1]});
  }
  m = fusedepi::block_merge(m);
  if (threadIdx.x != 0) return;
  finish(c, m);
}
