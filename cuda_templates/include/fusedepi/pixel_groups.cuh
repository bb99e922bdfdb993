// The apply kernel of a GroupNorm chain on a channels-last y (render.Plan.pixel_groups),
// where a group's segment does not fit the staged kernel's shared memory: a team a
// bundle of kBundle channels (a group, or kVecGroups whole groups where a group is
// narrower than a vector: InstanceNorm's one channel), each of its vectors kV channels
// of one pixel, read from y in one load (y's [pixels, channels] rows hold them together).
// Slot q = k * kTeam + lane of a bundle holds pixel q / kSub, channels sub * kV .. +kV of
// the bundle (sub = q % kSub, kSub = vectors a pixel): a permutation of the bundle, so the
// team's statistics (team_reduce.cuh) read it as they read the graph's order. kTeam is a
// multiple of kSub, so a thread's vectors all hold the same channels and their
// per-channel operands load once (the stage functions' _cols forms).
//
// Included by the rendered file (templates.PIXEL_GROUPS_APPLY_KERNEL) after apply.cuh and
// team_reduce.cuh; it reads the plan's constants (kL: a bundle's elements, kGroups:
// bundles a row), kSub, kBundle and kVecGroups, and stage0_cols / stage1_cols. It is not
// a standalone header.
#pragma once

static_assert(kChunks == 1 && kTeam % kSub == 0 && kBundle == kSub * kV && kV % kVecGroups == 0,
              "a team holds whole bundles, each thread the same channels in all its vectors");

// The first channel of this thread's vectors, within the row.
__device__ __forceinline__ int pixel_group_channel(const Place& p) {
  return static_cast<int>(p.at % kGroups) * kBundle + (p.lane % kSub) * kV;
}

// Loads this thread's vectors of its segment; masked slots hold 0.
__device__ __forceinline__ void pixel_group_load(const Args& a, const Place& p, int c0, float (&v)[kNV][kV]) {
  const T* src = a.y + (p.at / kGroups) * kRow + c0;
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    if (valid(p, k)) {
      const int pixel = (k * kTeam + p.lane) / kSub;
      fusedepi::load_vec<T, kV>(src + (long long)pixel * kChannels, v[k]);
    } else {
#pragma unroll
      for (int j = 0; j < kV; ++j) v[k][j] = 0.f;
    }
  }
}

// Stores this thread's vectors into the graph's (contiguous) layout: element j of a vector
// to its channel's plane. Consecutive lanes hold consecutive pixels, so each of the kV
// stores of a warp writes consecutive elements of one plane.
__device__ __forceinline__ void pixel_group_store(const Args& a, const Place& p, int c0, const float (&v)[kNV][kV]) {
  T* dst = a.out + (p.at / kGroups) * kRow + (long long)c0 * kInner;
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    if (!valid(p, k)) continue;
    const int pixel = (k * kTeam + p.lane) / kSub;
#pragma unroll
    for (int j = 0; j < kV; ++j) dst[(long long)j * kInner + pixel] = fusedepi::from_float<T>(v[k][j]);
  }
}

// The bundle's channel of element j of any of this thread's vectors (for team_part_reduce).
__device__ __forceinline__ auto pixel_group_parts(const Place& p) {
  return [sub = p.lane % kSub](int, int j) { return sub * kV + j; };
}

// (mean, rstd) of each of a vector's kVecGroups groups (kV / kVecGroups consecutive
// elements of every vector each), as team_moments takes them for one: two passes over
// registers, each group's mean taken relative to its first element.
__device__ __forceinline__ void pixel_group_moments(const Place& p, const float (&v)[kNV][kV], float eps,
                                                    float (&s0)[kVecGroups], float (&s1)[kVecGroups]) {
  constexpr int kW = kV / kVecGroups;  // elements of one group in a vector
  constexpr float kCount = static_cast<float>(kL / kVecGroups);
#pragma unroll
  for (int g = 0; g < kVecGroups; ++g) {
    const float shift = fusedepi::team_first<kTeam>(v[0][g * kW]);
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < kNV; ++k)
      if (valid(p, k))
#pragma unroll
        for (int j = 0; j < kW; ++j) s += v[k][g * kW + j] - shift;
    const float mean = shift + fusedepi::team_sum<kTeam>(s) / kCount;
    float q = 0.f;
#pragma unroll
    for (int k = 0; k < kNV; ++k)
      if (valid(p, k))
#pragma unroll
        for (int j = 0; j < kW; ++j) q += (v[k][g * kW + j] - mean) * (v[k][g * kW + j] - mean);
    s0[g] = mean;
    s1[g] = rsqrtf(fmaxf(fusedepi::team_sum<kTeam>(q) / kCount, 0.f) + eps);
  }
}
