// The direct conv's second phase with GroupNorm: normalizes one output tile of `mid`
// (the conv's values, stage0 applied, in the file's dtype T) into `out` with its
// image's statistics (stage1).
//
// Included by the rendered file (cuda_templates/templates.py, NORMALIZE_TILE) inside its
// anonymous namespace, after the file has defined what this code reads:
//   T, Args, stage1_at, stage1_chan, stage1_chan_of, kGroups, kChannels, kInner (KERNEL_FILE's);
//   kCout, kCpg, kHo, kWo, kTH, kTW, kColTiles and conv_stats (the direct conv's);
//   kAV, kRuns, kRunVecs, kLaneVecs, kApplyBatch (NORMALIZE_TILE's).
// It is not a standalone header: those constants differ per file.
#pragma once

// Normalizes one tile of `mid` into `out` (stage1); its image's statistics are out.
__device__ __forceinline__ void apply_tile(const Args& a, const long long n, const int tile) {
  __shared__ float gstat[kGroups * 2];  // this image's (mean, rstd) per group
  for (int i = threadIdx.x; i < kGroups * 2; i += blockDim.x) gstat[i] = __ldcg(conv_stats(a) + n * kGroups * 2 + i);
  __syncthreads();
  const int oh0 = tile / kColTiles * kTH, ow0 = tile % kColTiles * kTW;
  const int rows_here = min(kTH, kHo - oh0);
  const int runs = kColTiles == 1 ? 1 : rows_here;
  const int run_len = kColTiles == 1 ? rows_here * kWo : min(kTW, kWo - ow0);
  // Each warp takes whole channels (their operands loaded once); its lanes stride over
  // the channel's runs in vectors, kApplyBatch vectors in flight per lane.
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int co = warp; co < kCout; co += 8) {
    const stage1_chan k1 = stage1_chan_of(a, co);
    const float mean = gstat[co / kCpg * 2], rstd = gstat[co / kCpg * 2 + 1];
    const long long base = n * kChannels * kInner + (long long)co * kInner + (long long)oh0 * kWo + ow0;
    const T* src = a.mid + base;
    T* dst = a.out + base;
#pragma unroll 1
    for (int j0 = 0; j0 < kLaneVecs; j0 += kApplyBatch) {
      float v[kApplyBatch][kAV];
      int at[kApplyBatch];  // offset from base (0 for a lane past the end: loaded, not stored)
      bool ok[kApplyBatch];
#pragma unroll
      for (int b = 0; b < kApplyBatch; ++b) {  // all loads first, so that they are in flight together
        const int i = (j0 + b) * 32 + lane;
        if constexpr (kColTiles == 1) {  // one contiguous run
          ok[b] = i * kAV < run_len;
          at[b] = ok[b] ? i * kAV : 0;
        } else {
          const int run = i / kRunVecs, off = i % kRunVecs * kAV;
          ok[b] = run < runs && off < run_len;
          at[b] = ok[b] ? run * kWo + off : 0;
        }
        if constexpr (sizeof(T) == 4) {  // (T is float here; the cast only lets 16-bit files compile it)
          fusedepi::load_vec_cg<kAV>(reinterpret_cast<const float*>(src + at[b]), v[b]);
        } else {
          fusedepi::load_vec_cg_packed<T, kAV>(src + at[b], v[b]);
        }
      }
#pragma unroll
      for (int b = 0; b < kApplyBatch; ++b) {
        stage1_at<kAV>(v[b], k1, base + at[b], a, mean, rstd, true);
        if (!ok[b]) continue;
        if constexpr (sizeof(T) == 4) {
          fusedepi::store_vec_cs<kAV>(reinterpret_cast<float*>(dst + at[b]), v[b]);
        } else {
          fusedepi::store_vec<T, kAV>(dst + at[b], v[b]);
        }
      }
    }
  }
}
