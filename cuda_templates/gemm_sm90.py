"""PROTOTYPE (issue 5, not wired into the lowering): a Hopper GEMM whose epilogue runs
on the accumulators, for bf16 C[M, N] = A[M, K] @ B[N, K]^T with float32 accumulation.

The question it answers first is whether a hand-written kernel reaches cuBLAS at the
shapes of workloads 2-4 (1024 x 8192 x 8192); only then is it worth generating its
epilogue from the spec. `benchmarks/gemm_probe.py` renders, builds, checks and times it.

Structure (one CTA a 128 x 256 output tile, 384 threads):
- warpgroup 0 is the producer: one thread issues bulk tensor copies (TMA) of a 128 x 64
  tile of A and a 256 x 64 tile of B into a ring of kStages shared-memory stages
  (128-byte swizzle), completing on the stage's `full` mbarrier;
- with a cluster of 2 (`cluster=2`), the two CTAs take vertically adjacent tiles of the same
  columns, so they share the B tile: each loads one half of it and multicasts that half
  into both CTAs' shared memory, halving B's L2 -> SM traffic. A stage is then free only
  once the consumers of both CTAs are done with it, so every consumer warp arrives on the
  `empty` barrier of both CTAs;
- warpgroups 1 and 2 are consumers: each multiplies its 64 rows of the A tile with the
  B tile by `wgmma.mma_async` m64n256k16 (both operands from shared memory, K-major),
  128 float32 accumulators a thread, and frees a stage (its `empty` mbarrier) once the
  wgmma that read it is complete;
- the epilogue reads the accumulators in wgmma's layout: for 8-column chunk j, a thread
  holds rows r = 16 * warp + lane / 4 (and r + 8), columns 8j + 2 * (lane % 4) + {0, 1}.
  A GroupNorm group of G columns (G a multiple of 8 dividing 256) lies in G / 8 chunks
  of one row, spread over the 4 lanes of a quad: its statistics are the thread's values
  plus two quad shuffles, in registers, two-pass;
- `store="direct"` writes the results from registers to global memory (4-byte stores);
  `store="tma"` writes them into a 128-byte-swizzled staging tile in shared memory (64 KB,
  paid for with one ring stage: 3 instead of 4) that one thread then stores by TMA, so the
  consumers start the next tile's wgmma while the copy drains;
- two chains besides the plain GEMM: workload 3's (GroupNorm -> leaky_relu -> x + x) and
  workload 1's in eval mode (a per-column affine, i.e. BatchNorm with the Linear's bias
  folded in, -> gelu (erf) -> relu);
- `offload=True` (TMA store only): the consumers stage the tile's bf16 values and go on
  to the next tile; warps 1-3 of the producer warpgroup (40 registers each) run the chain
  on the staged tile in place and store it by TMA. Two named barriers hand the staging
  tile over and back. The consumers run the epilogue of their last tile themselves. The
  chain then sees the GEMM's bf16-rounded output, as eager's Linear hands it on (in
  registers it sees the float32 accumulators).

Measured (H200, bf16, RESULTS.md eleventh session; medians of 7 interleaved rounds, two
runs): at 16384 x 4096 x 4096 the plain GEMM is 1.003-1.006x cuBLAS, workload 1's eval
chain in the spare warps 1.050x (in registers 1.09-1.11x) against the shipped path's
1.13x (cuBLAS, then the one-pass epilogue kernel) and Inductor's 1.17-1.18x, and workload
3's chain in registers 1.03-1.04x against 1.10x. At 1024 x 8192 x 8192 (two tiles a CTA)
the chains in registers are 1.03-1.06x against the shipped path's 1.05-1.17x; the spare
warps lose there (the last tile's epilogue dominates). GroupNorm in the spare warps reads
the staged group three times and loses to the registers' quad shuffles. Tried before and
not kept: cluster-2 multicast of B (no gain) and a ping-pong schedule (1.28-1.30x cuBLAS).
"""

from __future__ import annotations

from string import Template

BLOCK_M, BLOCK_N, BLOCK_K = 128, 256, 64
STAGES = {"direct": 4, "tma": 3}  # ring stages by epilogue store; the TMA store's staging tile takes one


def _wgmma_asm() -> str:
    """The inline-asm statement of one m64n256k16 bf16 wgmma (128 accumulators)."""
    regs = ", ".join(f"%{i}" for i in range(128))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(128))
    return (
        "asm volatile(\n"
        '      "{\\n.reg .pred p;\\nsetp.ne.b32 p, %130, 0;\\n"\n'
        f'      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {{{regs}}}, %128, %129, p, 1, 1, 0, 0;\\n}}\\n"\n'
        f"      : {outs}\n"
        '      : "l"(desc_a), "l"(desc_b), "r"(scale_d));'
    )


GEMM_SM90 = Template(
    r"""// PROTOTYPE: see cuda_templates/gemm_sm90.py. Rendered for G = $group (0: no GroupNorm), cluster $cluster.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kBM = $bm, kBN = $bn, kBK = $bk, kStages = $stages;
constexpr int kGroup = $group;  // GroupNorm columns a group (0: no GroupNorm)
// 0: plain GEMM; 1: GroupNorm(kGroup columns) -> leaky_relu(0.01) -> x + x (workload 3);
// 2: x * gamma[col] + beta[col] -> gelu (erf) -> relu (workload 1 in eval: BatchNorm folded).
constexpr int kChain = $chain;
// The epilogue runs in warps 1-3 of the producer warpgroup, from the staging tile, while
// the consumers go on to the next tile's wgmma (the tile is handed over by named barriers);
// the consumers run the epilogue of their last tile themselves, where no wgmma is left to
// hide it under and eight warps finish it sooner than three.
constexpr bool kOffload = $offload;
constexpr int kCluster = $cluster;  // CTAs a cluster along M, sharing (multicasting) the B tile
constexpr bool kTmaStore = $tma_store;  // results staged in shared memory, stored by TMA
constexpr int kConsumerWarps = 8;  // two consumer warpgroups
constexpr int kTileA = kBM * kBK * 2, kTileB = kBN * kBK * 2;  // bytes a stage
constexpr int kOut = kTmaStore ? kBM * kBN * 2 : 0;            // bf16 staging tile
constexpr int kSmem = kStages * (kTileA + kTileB) + kOut + 1024;  // + alignment slack
constexpr int kG = kGroup > 0 ? kGroup : 8;
static_assert(kG % 8 == 0 && kBN % kG == 0, "a group lies in one tile");
static_assert(!kOffload || (kTmaStore && kCluster == 1), "the epilogue warps read the staging tile");
// Named barriers (0 is __syncthreads; 1, 2 are the consumer warpgroups'): the staging tile
// is full (256 consumers arrive, 96 epilogue threads wait), it is free again (the reverse),
// and the epilogue warps among themselves.
constexpr int kBarFull = 3, kBarEmpty = 4, kBarEpi = 5, kHandoff = 256 + 96;

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
// Arrives on the barrier at `bar`'s offset in the shared memory of cluster CTA `cta`, with
// the default (CTA-scope) semantics, as CUTLASS's cluster barriers do. Under the PTX
// memory model that is weaker than cluster scope across CTAs; it relies on the hardware
// behaviour CUTLASS's pipelines rely on. The stage's readers are wgmma's, complete by
// wait_group before the arrive. The first version used
// `.release.cluster` here and `.acquire.cluster` waits: 0.288 ms instead of 0.198 ms at
// 1024 x 8192 x 8192, cluster 1 (RESULTS.md, tenth session).
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, unsigned cta) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_u32(bar)),
      "r"(cta)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Arrives without waiting; the shared-memory writes before it are visible to the threads
// that complete the barrier by bar.sync.
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_u32(p))
               : "memory");
  return v;
}
__device__ __forceinline__ void sts128(void* p, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(p)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ float gelu_relu(float x) {  // relu(gelu(x)), gelu in its erf form
  const float y = x * 0.5f * (1.f + erff(x * 0.70710678118654752f));
  return y > 0.f ? y : 0.f;
}
// Workload 3's chain after its statistics: GroupNorm's normalize, leaky_relu(0.01), x + x.
__device__ __forceinline__ float groupnorm_leaky_double(float x, float mean, float rstd, float g, float b) {
  float y = (x - mean) * rstd * g + b;
  y = y > 0.f ? y : 0.01f * y;
  return y + y;
}
__device__ __forceinline__ float2 unpack(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}
__device__ __forceinline__ uint32_t pack(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// A box of shared memory (dense, in the map's swizzle) to global memory, in a bulk group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
  if constexpr (kCluster > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {  // every thread of every CTA of the cluster
  if constexpr (kCluster > 1) {
    asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
  } else {
    __syncthreads();
  }
}
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// The same box written at the same offset into the shared memory of every CTA in `mask`,
// completing bytes on each one's barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "h"(mask)
      : "memory");
}
// The 16-byte chunk `cc` (columns 8cc .. 8cc + 7) of row `r` of the 128 x 256 staging tile:
// two 64-row halves (one a consumer warpgroup), each four 64 x 64 boxes of 128-byte rows,
// the chunk index XORed with the row % 8 (TMA's 128-byte swizzle).
__device__ __forceinline__ uint8_t* staged_chunk(uint8_t* staging, int r, int cc) {
  return staging + (r >> 6) * 32768 + (cc >> 3) * 8192 + (r & 63) * 128 + (((cc & 7) ^ (r & 7)) << 4);
}

// The epilogue warps' share of a staged tile (thread `et` of 96), in place: the values are
// the GEMM's bf16-rounded output, as eager's Linear hands them on.
__device__ __forceinline__ void epilogue_warps_tile(uint8_t* staging, int et, int n0, const float* __restrict__ gamma,
                                                    const float* __restrict__ beta, float eps) {
  if constexpr (kChain == 2) {
    for (int q = et; q < 128 * 32; q += 96) {  // a warp: the 32 chunks of one row
      const int r = q >> 5, cc = q & 31;
      uint8_t* p = staged_chunk(staging, r, cc);
      uint4 v = lds128(p);
      uint32_t* w = reinterpret_cast<uint32_t*>(&v);
      const int col = n0 + cc * 8;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 s = __ldg(reinterpret_cast<const float4*>(gamma + col + 4 * h));
        const float4 t = __ldg(reinterpret_cast<const float4*>(beta + col + 4 * h));
        const float2 x0 = unpack(w[2 * h]), x1 = unpack(w[2 * h + 1]);
        w[2 * h] = pack(gelu_relu(fmaf(x0.x, s.x, t.x)), gelu_relu(fmaf(x0.y, s.y, t.y)));
        w[2 * h + 1] = pack(gelu_relu(fmaf(x1.x, s.z, t.z)), gelu_relu(fmaf(x1.y, s.w, t.w)));
      }
      sts128(p, v);
    }
  } else if constexpr (kChain == 1) {
    constexpr int kChunks = kG / 8, kGroupsRow = kBN / kG;
    constexpr float kInv = 1.f / kG;
    for (int q = et; q < 128 * kGroupsRow; q += 96) {
      const int r = q / kGroupsRow, g = q % kGroupsRow;
      const auto each_pair = [&](auto&& f) {  // the group's values in pairs, read from the staged tile
#pragma unroll
        for (int i = 0; i < kChunks; ++i) {
          const uint4 v = lds128(staged_chunk(staging, r, g * kChunks + i));
          const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            f(unpack(w[e]));
          }
        }
      };
      float sum = 0.f, sq = 0.f;
      each_pair([&](float2 x) { sum += x.x + x.y; });
      const float mean = sum * kInv;
      each_pair([&](float2 x) {
        sq = fmaf(x.x - mean, x.x - mean, sq);
        sq = fmaf(x.y - mean, x.y - mean, sq);
      });
      const float rstd = rsqrtf(sq * kInv + eps);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        uint8_t* p = staged_chunk(staging, r, g * kChunks + i);
        uint4 v = lds128(p);
        uint32_t* w = reinterpret_cast<uint32_t*>(&v);
        const int col = n0 + (g * kChunks + i) * 8;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float4 ga = __ldg(reinterpret_cast<const float4*>(gamma + col + 4 * h));
          const float4 be = __ldg(reinterpret_cast<const float4*>(beta + col + 4 * h));
          const float gs[4] = {ga.x, ga.y, ga.z, ga.w}, bs[4] = {be.x, be.y, be.z, be.w};
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float2 x = unpack(w[2 * h + e]);
            w[2 * h + e] = pack(groupnorm_leaky_double(x.x, mean, rstd, gs[2 * e], bs[2 * e]),
                                groupnorm_leaky_double(x.y, mean, rstd, gs[2 * e + 1], bs[2 * e + 1]));
          }
        }
        sts128(p, v);
      }
    }
  }
}

// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row atoms 1024 bytes apart.
__device__ __forceinline__ uint64_t make_desc(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_256(float (&d)[128], uint64_t desc_a, uint64_t desc_b, int scale_d) {
  $wgmma
}

// Grouped raster over units of kCluster vertically adjacent tiles (one a cluster): units
// vary fastest along M within bands of 8 tiles, so that the clusters running at once read
// a band of A and a few B tiles, which stay in L2 while they are shared.
__device__ __forceinline__ void tile_origin(int unit, int units_m, int tiles_n, unsigned rank, int& m0, int& n0) {
  constexpr int kGroupM = 8 / kCluster;
  const int per_group = kGroupM * tiles_n, first_m = unit / per_group * kGroupM;
  const int rows_in_group = min(units_m - first_m, kGroupM);
  m0 = ((first_m + unit % per_group % rows_in_group) * kCluster + rank) * kBM;
  n0 = unit % per_group / rows_in_group * kBN;
}

__global__ void __launch_bounds__(384, 1) $cluster_attr gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                                                      const __grid_constant__ CUtensorMap map_b,
                                                      const __grid_constant__ CUtensorMap map_c,  // kTmaStore only
                                                      __nv_bfloat16* __restrict__ c, const float* __restrict__ gamma,
                                                      const float* __restrict__ beta, float eps, int m_rows, int n_cols, int k) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* tiles_a = smem;
  uint8_t* tiles_b = smem + kStages * kTileA;
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int tiles_n = n_cols / kBN, units_m = m_rows / (kBM * kCluster), n_units = units_m * tiles_n;
  const int k_tiles = k / kBK;
  const unsigned rank = cluster_rank();
  const int cluster = blockIdx.x / kCluster, clusters = gridDim.x / kCluster;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps * kCluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  cluster_sync();  // the peer's barriers are initialized before any multicast or remote arrive

  // Persistent: cluster c takes units c, c + clusters, ...; the ring's stage and phase run
  // on across tiles (`it` counts k-tiles over all of this CTA's tiles), so the producer
  // loads the next tile while the consumers run the epilogue of this one. Both CTAs of a
  // cluster run the same number of k-tiles, so their rings stay in step.
  if (wg == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (tid == 0) {
      constexpr int kSliceB = kTileB / kCluster;  // bytes of B this CTA loads for the cluster
      int it = 0;
      for (int unit = cluster; unit < n_units; unit += clusters) {
        int m0, n0;
        tile_origin(unit, units_m, tiles_n, rank, m0, n0);
        for (int i = 0; i < k_tiles; ++i, ++it) {
          const int s = it % kStages;
          if (it >= kStages) mbar_wait(&empty[s], ((it / kStages) + 1) & 1);
          mbar_expect_tx(&full[s], kTileA + kTileB);  // A, and all of B (both slices)
          tma_load_2d(tiles_a + s * kTileA, &map_a, &full[s], i * kBK, m0);
          if constexpr (kCluster > 1) {
            tma_load_2d_multicast(tiles_b + s * kTileB + rank * kSliceB, &map_b, &full[s], i * kBK,
                                  n0 + rank * (kBN / kCluster), (1 << kCluster) - 1);
          } else {
            tma_load_2d(tiles_b + s * kTileB, &map_b, &full[s], i * kBK, n0);
          }
        }
      }
    } else if (kOffload && tid >= 32) {  // epilogue warps: every tile but the CTA's last
      const int et = tid - 32;
      uint8_t* staging = smem + kStages * (kTileA + kTileB);
      for (int unit = cluster; unit + clusters < n_units; unit += clusters) {
        int m0, n0;
        tile_origin(unit, units_m, tiles_n, rank, m0, n0);
        named_barrier(kBarFull, kHandoff);  // the consumers have staged the tile
        epilogue_warps_tile(staging, et, n0, gamma, beta, eps);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // our writes, then the bulk copy's reads
        named_barrier(kBarEpi, 96);
        if (et == 0) {
#pragma unroll
          for (int b = 0; b < 8; ++b) tma_store_2d(&map_c, staging + b * 8192, n0 + b % 4 * 64, m0 + b / 4 * 64);
          asm volatile("cp.async.bulk.commit_group;" ::: "memory");
          asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        }
        // The staging tile is free once the copy has read it (thread 0 arrives after its
        // wait); the consumers wait for this before they stage their next tile.
        named_arrive(kBarEmpty, kHandoff);
      }
      if (et == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
  } else {  // consumers: rows 64 * (wg - 1) .. + 64 of the tile
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    const int half = wg - 1;
    // A stage is free once every consumer warp of every CTA that reads it is done: one
    // arrival a warp on the stage's barrier in each CTA of the cluster.
    const auto release = [&](int s) {
      __syncwarp();
      if (tid % 32 == 0)
        for (int cta = 0; cta < kCluster; ++cta) mbar_arrive_cluster(&empty[s], cta);
    };
    int it = 0;
    for (int unit = cluster; unit < n_units; unit += clusters) {
      int m0, n0;
      tile_origin(unit, units_m, tiles_n, rank, m0, n0);
      const bool first = unit == cluster, last = unit + clusters >= n_units;
      const bool hand_over = kOffload && !last;  // the epilogue warps take this tile
      float d[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) d[i] = 0.f;
      for (int i = 0; i < k_tiles; ++i, ++it) {
        const int s = it % kStages;
        mbar_wait(&full[s], (it / kStages) & 1);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        const uint8_t* a = tiles_a + s * kTileA + half * 64 * 128;  // 64 rows of 128 bytes
        const uint8_t* b = tiles_b + s * kTileB;
#pragma unroll
        for (int kk = 0; kk < kBK / 16; ++kk)  // 16 elements = 32 bytes along K within the swizzled row
          wgmma_256(d, make_desc(a + kk * 32), make_desc(b + kk * 32), (i > 0 || kk > 0) ? 1 : 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        // Keep one group in flight: the previous k-tile's wgmma is done, free its stage.
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
        if (i > 0) release((it - 1) % kStages);
      }
      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
      release((it - 1) % kStages);  // the tile's last stage

      const int warp = tid / 32, lane = tid % 32;
      const int row = m0 + half * 64 + warp * 16 + lane / 4;  // and row + 8
      const int col0 = n0 + 2 * (lane % 4);
      // This warpgroup's 64 x 256 staging tile: four 64 x 64 boxes of 128-byte rows, the
      // 16-byte chunk index XORed with row % 8 (TMA's 128-byte swizzle). A warp's 4-byte
      // writes (8 rows x 4 lanes) then fall in 32 different banks.
      uint8_t* staging = smem + kStages * (kTileA + kTileB) + half * (kOut / 2);
      const auto put = [&](int h, int col, float y0, float y1) {  // rows row + 8h, columns col, col + 1
        const __nv_bfloat162 v = __floats2bfloat162_rn(y0, y1);
        if constexpr (kTmaStore) {  // st.shared: the aligned pointer's arithmetic hides the state space from nvcc
          const int r = warp * 16 + lane / 4 + 8 * h, cl = col - n0;
          const int chunk = (cl % 64 / 8) ^ (r % 8);
          asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(staging + cl / 64 * 8192 + r * 128 + chunk * 16 + cl % 8 * 2)),
                       "r"(*reinterpret_cast<const uint32_t*>(&v))
                       : "memory");
        } else {
          *reinterpret_cast<__nv_bfloat162*>(c + (long long)(row + 8 * h) * n_cols + col) = v;
        }
      };
      if constexpr (kOffload) {  // the epilogue warps are done with the staging tile
        if (!first) named_barrier(kBarEmpty, kHandoff);
      } else if constexpr (kTmaStore) {  // the previous tile's store has read the staging tile
        if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
        named_barrier(1 + half, 128);
      }
      if (kChain == 0 || hand_over) {
#pragma unroll
        for (int j = 0; j < 32; ++j)
#pragma unroll
          for (int h = 0; h < 2; ++h) put(h, col0 + 8 * j, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      } else if (kChain == 2) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          const int col = col0 + 8 * j;
          const float2 s = *reinterpret_cast<const float2*>(gamma + col), t = *reinterpret_cast<const float2*>(beta + col);
#pragma unroll
          for (int h = 0; h < 2; ++h)
            put(h, col, gelu_relu(fmaf(d[4 * j + 2 * h], s.x, t.x)), gelu_relu(fmaf(d[4 * j + 2 * h + 1], s.y, t.y)));
        }
      } else {
        constexpr int kChunks = kG / 8;
        constexpr float kInv = 1.f / kG;
#pragma unroll
        for (int g = 0; g < 32 / kChunks; ++g)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float sum = 0.f;
#pragma unroll
            for (int q = 0; q < kChunks; ++q) sum += d[4 * (g * kChunks + q) + 2 * h] + d[4 * (g * kChunks + q) + 2 * h + 1];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float mean = sum * kInv;
            float sq = 0.f;
#pragma unroll
            for (int q = 0; q < kChunks; ++q)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float x = d[4 * (g * kChunks + q) + 2 * h + e] - mean;
                sq = fmaf(x, x, sq);
              }
            sq += __shfl_xor_sync(0xffffffffu, sq, 1);
            sq += __shfl_xor_sync(0xffffffffu, sq, 2);
            const float rstd = rsqrtf(sq * kInv + eps);
#pragma unroll
            for (int q = 0; q < kChunks; ++q) {
              const int col = col0 + 8 * (g * kChunks + q);  // even: one 8-byte load of each parameter
              const float2 ga = *reinterpret_cast<const float2*>(gamma + col), be = *reinterpret_cast<const float2*>(beta + col);
              const float gs[2] = {ga.x, ga.y}, bs[2] = {be.x, be.y};
              float y[2];
#pragma unroll
              for (int e = 0; e < 2; ++e) y[e] = groupnorm_leaky_double(d[4 * (g * kChunks + q) + 2 * h + e], mean, rstd, gs[e], bs[e]);
              put(h, col, y[0], y[1]);
            }
          }
      }
      if (hand_over) {
        named_arrive(kBarFull, kHandoff);  // the tile is staged: the epilogue warps take it from here
      } else if constexpr (kTmaStore) {  // writes visible to the bulk copy, then one thread stores
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        named_barrier(1 + half, 128);
        if (tid == 0) {
#pragma unroll
          for (int b = 0; b < kBN / 64; ++b) tma_store_2d(&map_c, staging + b * 8192, n0 + b * 64, m0 + half * 64);
          asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        }
      }
    }  // tiles
    if constexpr (kTmaStore) {  // with kOffload, the last tile's store
      if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    }
  }
  if constexpr (kCluster > 1) cluster_sync();  // no CTA leaves while its peer may still arrive on its barriers
}

int make_map(CUtensorMap* map, const void* base, int rows, int cols, int box_rows, int box_cols) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult q;
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return -1;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)cols * 2};
  const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -2;
}

}  // namespace

// C[M, N] (bf16) = epilogue(A[M, K] @ B[N, K]^T); M, N, K multiples of the tile (probe only).
extern "C" int gemm_run(const void* a, const void* b, void* c, const float* gamma, const float* beta, float eps,
                        int m, int n, int k, cudaStream_t stream) {
  if (m % (kBM * kCluster) || n % kBN || k % kBK) return -3;
  CUtensorMap map_a, map_b, map_c = {};
  if (int e = make_map(&map_a, a, m, k, kBM, kBK)) return e;
  if (int e = make_map(&map_b, b, n, k, kBN / kCluster, kBK)) return e;
  if (kTmaStore)
    if (int e = make_map(&map_c, c, m, n, 64, 64)) return e;
  static int resident = 0;  // clusters that fit on the device at once (persistent grid)
  if (resident == 0) {
    if (cudaFuncSetAttribute(gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess) return -4;
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return -5;
    if constexpr (kCluster == 1) {
      resident = sms;  // one CTA an SM (its shared memory)
    } else {  // pairs of SMs in one GPC: fewer than sms / 2 where a GPC has an odd count
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(sms / kCluster * kCluster);
      config.blockDim = dim3(384);
      config.dynamicSmemBytes = kSmem;
      if (cudaOccupancyMaxActiveClusters(&resident, gemm_kernel, &config) != cudaSuccess || resident == 0) return -6;
    }
  }
  const int units = (m / (kBM * kCluster)) * (n / kBN);
  gemm_kernel<<<(units < resident ? units : resident) * kCluster, 384, kSmem, stream>>>(map_a, map_b, map_c, static_cast<__nv_bfloat16*>(c), gamma,
                                                                 beta, eps, m, n, k);
  return static_cast<int>(cudaGetLastError());
}
"""
)


CHAINS = {"plain": 0, "groupnorm": 1, "affine_gelu_relu": 2}


def render_gemm_probe(group: int = 0, cluster: int = 1, store: str = "direct", chain: str | None = None,
                      offload: bool = False) -> str:
    """The prototype's source for bf16 output.

    Args:
        group: GroupNorm columns a group (chain "groupnorm").
        cluster: 2 pairs CTAs that multicast the shared B tile (M a multiple of 256).
        store: "direct" (registers to global) or "tma" (staged in shared memory, stored by TMA).
        chain: "plain" (the GEMM), "groupnorm" (GroupNorm(group columns) -> leaky_relu(0.01)
            -> x + x, workload 3) or "affine_gelu_relu" (x * gamma[col] + beta[col] -> gelu ->
            relu: workload 1 in eval, its BatchNorm and the Linear's bias folded into gamma
            and beta); default "groupnorm" if group else "plain".
        offload: the epilogue runs in the producer warpgroup's three spare warps, from the
            staging tile (store "tma", cluster 1), instead of in the consumers' registers.
    """
    if cluster not in (1, 2):
        raise ValueError(f"cluster must be 1 or 2, not {cluster}")
    if store not in STAGES:
        raise ValueError(f"store must be one of {sorted(STAGES)}, not {store!r}")
    chain = chain or ("groupnorm" if group else "plain")
    if chain not in CHAINS:
        raise ValueError(f"chain must be one of {sorted(CHAINS)}, not {chain!r}")
    if (chain == "groupnorm") != (group > 0):
        raise ValueError(f"a group size goes with the groupnorm chain only (chain {chain!r}, group {group})")
    if offload and (store != "tma" or cluster != 1):
        raise ValueError("offload needs store='tma' and cluster 1: the epilogue warps read the staging tile")
    attr = f"__cluster_dims__({cluster}, 1, 1)" if cluster > 1 else ""
    return GEMM_SM90.substitute(bm=BLOCK_M, bn=BLOCK_N, bk=BLOCK_K, stages=STAGES[store], group=group,
                                cluster=cluster, cluster_attr=attr, tma_store="true" if store == "tma" else "false",
                                chain=CHAINS[chain], offload="true" if offload else "false", wgmma=_wgmma_asm())
