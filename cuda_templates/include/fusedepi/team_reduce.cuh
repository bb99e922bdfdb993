// The apply kernel's reductions of a segment inside its team (lanes of a warp, or a
// block): a norm's two statistics for stage1, or a row reduction's value.
//
// Included by the rendered file (cuda_templates/templates.py, APPLY_KERNEL) after
// apply.cuh, which defines what this code reads: Place, valid, runs, and the launch
// plan's kNV, kV, kTeam, kL.
// It is not a standalone header: the launch plan's constants differ per file.
#pragma once

// This thread's live elements folded into one float: it starts at `init` and becomes
// update(acc, e) for each element e. Under kDense every slot computes the update and a
// select keeps it for live ones.
template <class Update>
__device__ __forceinline__ float team_fold(const Place& p, const float (&v)[kNV][kV], float init, Update update) {
  float acc = init;
#pragma unroll
  for (int k = 0; k < kNV; ++k)
    if (runs(p, k))
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const float u = update(acc, v[k][j]);
        acc = valid(p, k) ? u : acc;
      }
  return acc;
}

// (mean, rstd), two passes over registers: group and layer norm. The mean is taken
// relative to the segment's first element, so a constant segment (a clamp can make
// one) has its mean exactly and normalizes to exactly 0, as eager's Welford does.
__device__ __forceinline__ void team_moments(const Place& p, const float (&v)[kNV][kV], float eps, float& s0,
                                             float& s1) {
  const float shift = fusedepi::team_first<kTeam>(v[0][0]);
  const float s = team_fold(p, v, 0.f, [&](float acc, float e) { return acc + (e - shift); });
  const float mean = shift + fusedepi::team_sum<kTeam>(s) / static_cast<float>(kL);
  const float q = team_fold(p, v, 0.f, [&](float acc, float e) { return acc + (e - mean) * (e - mean); });
  const float var = fusedepi::team_sum<kTeam>(q) / static_cast<float>(kL);
  s0 = mean;
  s1 = rsqrtf(fmaxf(var, 0.f) + eps);
}

// The segment's sum of squares, over the team.
__device__ __forceinline__ float team_sum_of_squares(const Place& p, const float (&v)[kNV][kV]) {
  return fusedepi::team_sum<kTeam>(team_fold(p, v, 0.f, [](float acc, float e) { return acc + e * e; }));
}

// RMSNorm: s1 = rsqrt(mean(x^2) + eps), as the decomposed RMSNorm computes it; s0 = 0.
__device__ __forceinline__ void team_rms(const Place& p, const float (&v)[kNV][kV], float eps, float& s0, float& s1) {
  s0 = 0.f;
  s1 = rsqrtf(team_sum_of_squares(p, v) / static_cast<float>(kL) + eps);
}

// F.normalize: s1 = max(||x||, eps), the norm rounded to T first as linalg_vector_norm
// returns it, the clamp's result too (a NaN norm stays NaN, as clamp's); s0 = 0.
__device__ __forceinline__ void team_l2(const Place& p, const float (&v)[kNV][kV], float eps, float& s0, float& s1) {
  const float norm = fusedepi::to_float(fusedepi::from_float<T>(sqrtf(team_sum_of_squares(p, v))));
  s0 = 0.f;
  s1 = fusedepi::to_float(fusedepi::from_float<T>(norm < eps ? eps : norm));
}

// Softmax: s0 = the row's max, s1 = the sum of exp(x - s0), or its log (kLog:
// log_softmax). A NaN is skipped by fmaxf but reaches every output through the sum,
// as in eager.
template <bool kLog>
__device__ __forceinline__ void team_softmax(const Place& p, const float (&v)[kNV][kV], float& s0, float& s1) {
  const float mx = team_fold(p, v, -INFINITY, [](float acc, float e) { return fmaxf(acc, e); });
  const float max = fusedepi::team_max<kTeam>(mx);
  const float s = team_fold(p, v, 0.f, [&](float acc, float e) { return acc + expf(e - max); });
  const float sum = fusedepi::team_sum<kTeam>(s);
  s0 = max;
  s1 = kLog ? logf(sum) : sum;
}

// The row reductions: the row's value. fmaxf skips NaN, so amax/amin count NaNs apart
// (any NaN gives NaN, as eager), and logsumexp's NaN reaches the result through the sum.
using fusedepi::RowReduce;

template <RowReduce kOp>
__device__ __forceinline__ float team_row_reduce(const Place& p, const float (&v)[kNV][kV]) {
  if constexpr (kOp == RowReduce::kLogsumexp) {
    const float m = team_fold(p, v, -INFINITY, [](float acc, float e) { return fmaxf(acc, e); });
    const float mx = fusedepi::team_max<kTeam>(m);
    const float shift = isinf(mx) ? 0.f : mx;
    const float s = team_fold(p, v, 0.f, [&](float acc, float e) { return acc + expf(e - shift); });
    return logf(fusedepi::team_sum<kTeam>(s)) + shift;
  } else if constexpr (kOp == RowReduce::kSum || kOp == RowReduce::kMean) {
    const float s = fusedepi::team_sum<kTeam>(team_fold(p, v, 0.f, [](float acc, float e) { return acc + e; }));
    return kOp == RowReduce::kMean ? s / static_cast<float>(kL) : s;
  } else {
    constexpr bool kMax = kOp == RowReduce::kAmax;  // amin: the max of -x, negated
    const float m = team_fold(p, v, -INFINITY, [](float acc, float e) { return fmaxf(acc, kMax ? e : -e); });
    const float nans = team_fold(p, v, 0.f, [](float acc, float e) { return acc + (isnan(e) ? 1.f : 0.f); });
    if (fusedepi::team_sum<kTeam>(nans) > 0.f) return NAN;
    const float mx = fusedepi::team_max<kTeam>(m);
    return kMax ? mx : -mx;
  }
}

// A reduction after the chain's norm (EpilogueSpec.second_reduction: sum, mean, amax,
// amin): this team's values after stage1, reduced apart for each of the kParts channels
// of its segment (kParts is 1 where a segment is one channel, or a Linear's row;
// part_of(k, j) is the channel of the segment that element j of vector k holds). The
// value of (segment, chunk, channel) goes to parts[(seg * kChunks + chunk) * kParts +
// channel]: a sum (kSum, kMean), a max or a min, or NaN where that share holds one
// (fmaxf skips NaN); part_value merges the chunks.
template <RowReduce kOp, int kParts, class PartOf>
__device__ __forceinline__ void team_part_reduce(const Place& p, const float (&v)[kNV][kV], float* parts,
                                                 PartOf part_of) {
  constexpr bool kSum = kOp == RowReduce::kSum || kOp == RowReduce::kMean;
  constexpr bool kMax = kOp == RowReduce::kAmax;  // amin: the max of -x, negated
  static_assert(kOp != RowReduce::kLogsumexp, "logsumexp does not follow a norm");
  const long long at = (p.seg * kChunks + p.first / kChunkLen) * kParts;
  for (int part = 0; part < kParts; ++part) {
    float acc = kSum ? 0.f : -INFINITY;
    float nans = 0.f;
#pragma unroll
    for (int k = 0; k < kNV; ++k) {
      if (!valid(p, k)) continue;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        if (kParts > 1 && part_of(k, j) != part) continue;
        const float e = v[k][j];
        if constexpr (kSum) {
          acc += e;
        } else {
          acc = fmaxf(acc, kMax ? e : -e);
          nans += isnan(e) ? 1.f : 0.f;
        }
      }
    }
    float value;
    if constexpr (kSum) {
      value = fusedepi::team_sum<kTeam>(acc);
    } else {
      const float mx = fusedepi::team_max<kTeam>(acc);
      value = fusedepi::team_sum<kTeam>(nans) > 0.f ? NAN : (kMax ? mx : -mx);
    }
    if (p.live && p.lane == 0) parts[at + part] = value;
  }
}

// Output element o (= segment * kParts + channel of the segment) of a reduction after
// the norm: its chunks' values from team_part_reduce merged (a NaN in any gives NaN),
// a mean divided by the channel's kL / kParts elements.
template <RowReduce kOp, int kParts>
__device__ __forceinline__ float part_value(const float* parts, long long o) {
  constexpr bool kSum = kOp == RowReduce::kSum || kOp == RowReduce::kMean;
  const float* at = parts + (o / kParts) * kChunks * kParts + o % kParts;
  float r = at[0];
  bool nan = isnan(r);
  for (int c = 1; c < kChunks; ++c) {
    const float u = at[(long long)c * kParts];
    nan = nan || isnan(u);
    r = kSum ? r + u : (kOp == RowReduce::kAmax ? fmaxf(r, u) : fminf(r, u));
  }
  if (!kSum && nan) return NAN;
  return kOp == RowReduce::kMean ? r / static_cast<float>(kL / kParts) : r;
}

// The segment's channel of element j of vector k in the apply kernel's own mapping: the
// segment's kParts channels of kL / kParts elements each, in order.
template <int kParts>
__device__ __forceinline__ auto parts_in_order(const Place& p) {
  return [&p](int k, int j) { return static_cast<int>((offset_of(p, k) + j) / (kL / kParts)); };
}
