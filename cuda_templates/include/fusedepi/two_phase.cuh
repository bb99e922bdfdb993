// A direct conv with GroupNorm as ONE launch of two phases. Phase 1 of a tile leaves
// (n, mean, M2) partials per (image, group, tile); phase 2 needs its image's (mean,
// rstd). Blocks take tickets in the order they start (an atomic counter that the
// launcher zeroes with the image counters): ticket t runs phase 1 of tile t, then
// phase 2 of tile t - lag. The block that finishes an image's last phase-1 tile merges
// its partials into (mean, rstd) and releases the image; phase 2 waits for the
// release. lag >= tiles per image, so every tile a wait depends on holds a smaller
// ticket: its block has started and waits on nothing before it counts, so the launch
// cannot deadlock, whichever blocks are resident. The phases of different images
// overlap: the compute of one with the memory traffic or the stores of the other,
// and neither waits for the other's tail.
//
// Included by the rendered file (cuda_templates/templates.py, TWO_PHASE_KERNEL) inside
// its anonymous namespace, after the direct conv's constants (kTiles, kGroups), Args and
// the workspace accessors conv_part, conv_stats, conv_counters.
// It is not a standalone header: those constants differ per file.
#pragma once

// phase1(n, tile) and phase2(n, tile) run one tile of each phase; eps is GroupNorm's.
template <class Phase1, class Phase2>
__device__ __forceinline__ void two_phase(const Args& a, int lag, float eps, Phase1 phase1, Phase2 phase2) {
  __shared__ int ticket, last;
  int* const counters = conv_counters(a);
  if (threadIdx.x == 0) ticket = atomicAdd(counters, 1);
  __syncthreads();
  const long long t = ticket, items = a.rows * kTiles;
  if (t < items) {
    const long long n = t / kTiles;
    phase1(n, static_cast<int>(t % kTiles));
    // Every thread's stores (phase-1 output, partials), then the count; thread 0 fences
    // again after the barrier, so that the others' stores are ordered before its atomic.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      last = atomicAdd(counters + 1 + n, 1) == kTiles - 1;
    }
    __syncthreads();
    if (last) {  // every tile of image n is out: merge its partials, release the image
      __threadfence();
      for (int g = threadIdx.x; g < kGroups; g += blockDim.x) {
        fusedepi::Moments m = {0.f, 0.f, 0.f};
        for (int k = 0; k < kTiles; ++k) {
          const float* part = conv_part(a, n, g, k);
          m = fusedepi::merge(m, {__ldcg(part), __ldcg(part + 1), __ldcg(part + 2)});
        }
        float* stats = conv_stats(a) + (n * kGroups + g) * 2;
        stats[0] = m.mean;
        stats[1] = rsqrtf(fmaxf(m.m2 / m.n, 0.f) + eps);
      }
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(counters + 1 + n, 1);
      }
    }
  }
  const long long u = t - lag;
  if (u >= 0 && u < items) {
    const long long n = u / kTiles;
    const int tile = static_cast<int>(u % kTiles);
    if (threadIdx.x == 0) fusedepi::wait_above(counters + 1 + n, kTiles);
    __syncthreads();  // with thread 0's acquire: the image's writes are visible to the block
    phase2(n, tile);
  }
}
