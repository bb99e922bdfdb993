// The apply kernel of a GroupNorm chain on a channels-last y (render.Plan.pixel_groups),
// where a group's segment does not fit the staged kernel's shared memory: a team a
// (image, group) segment, each of its vectors kV channels of one pixel, read from y in
// one load (y's [pixels, channels] rows hold a group's channels of a pixel together).
// Slot q = k * kTeam + lane of a segment holds pixel q / kSub, channels sub * kV .. +kV
// of the group (sub = q % kSub, kSub = vectors a pixel): a permutation of the segment,
// so the team's statistics (team_reduce.cuh) read it as they read the graph's order.
// kTeam is a multiple of kSub, so a thread's vectors all hold the same channels and
// their per-channel operands load once (the stage functions' _cols forms).
//
// Included by the rendered file (templates.PIXEL_GROUPS_APPLY_KERNEL) after apply.cuh and
// team_reduce.cuh; it reads the plan's constants, kSub and kGroupChannels (channels a
// group), and stage0_cols / stage1_cols. It is not a standalone header.
#pragma once

static_assert(kChunks == 1 && kTeam % kSub == 0 && kGroupChannels == kSub * kV,
              "a team holds whole segments, each thread the same channels in all its vectors");

// The first channel of this thread's vectors, within the row.
__device__ __forceinline__ int pixel_group_channel(const Place& p) {
  return static_cast<int>(p.at % kGroups) * kGroupChannels + (p.lane % kSub) * kV;
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

// The group's channel of element j of any of this thread's vectors (for team_part_reduce).
__device__ __forceinline__ auto pixel_group_parts(const Place& p) {
  return [sub = p.lane % kSub](int, int j) { return sub * kV + j; };
}
