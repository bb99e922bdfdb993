// The in-kernel GEMM (sm_90a): the consumers' epilogue on the accumulators and the
// warp-specialized kernel body (producer: TMA loads; two consumer warpgroups: wgmma, then
// the chain on the tile; spare producer warps: a pointwise chain on the staged tile).
//
// Included by the rendered file (cuda_templates/gemm_sm90.py, GEMM_KERNELS) inside its
// anonymous namespace, after the file has defined what this code reads:
//   T, Args, the stage functions and their _chan/_chan_of/_cols forms, kChannels (KERNEL_FILE);
//   the GEMM's constants (kBM, kBN, kBK, kStages, kK, kBias, kGroup, kG, kRowReads,
//   kRowReduce, kPointwise, kTilesN, kTileA, kTileB, kRounds, kRoundCols, kBar*, kHandoff,
//   kEps), wgmma_256 and tile_partials (GEMM_KERNELS; gemm_row_reduce.cuh), and
//   gemm_tile.cuh's helpers.
// It is not a standalone header: those constants differ per file.
#pragma once

// The consumers' epilogue of one tile on the accumulators, in place: bias, rounding, the
// chain (unless `hand_over`: the epilogue warps run it); stage_round then stages the
// values. With a row reduction, the chain before it, then the rows' partial statistics
// over the tile's columns into the workspace, a.ws[row * kTilesN + n0 / kBN] (a float2).
__device__ __forceinline__ void consumer_epilogue(float (&d)[128], int half, int tid, int m0, int n0, const Args& a,
                                                  bool hand_over) {
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = half * 64 + warp * 16 + lane / 4;  // tile rows r0 and r0 + 8
  const int col0 = n0 + 2 * (lane % 4);
  const auto live = [&](int h) { return !kRowReads || m0 + r0 + 8 * h < a.rows; };
  // The library GEMM's output: the product plus bias, rounded to T.
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    float2 b = make_float2(0.f, 0.f);
    if constexpr (kBias) b = hop::load_pair<T>(a.bias + col0 + 8 * j);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float2 y = hop::round_pair<T>(d[4 * j + 2 * h] + b.x, d[4 * j + 2 * h + 1] + b.y);
      d[4 * j + 2 * h] = y.x;
      d[4 * j + 2 * h + 1] = y.y;
    }
  }
  const auto flat = [&](int h, int col) { return (m0 + r0 + 8 * h) * kChannels + col; };
  // The chain's per-column operands: loaded once for a column pair, used for both rows.
  if (!hand_over) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int col = col0 + 8 * j;
      const stage0_chan k[2] = {stage0_chan_of(a, col), stage0_chan_of(a, col + 1)};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v[2] = {d[4 * j + 2 * h], d[4 * j + 2 * h + 1]};
        if (live(h)) stage0_cols<2>(v, k, flat(h, col), a);
        d[4 * j + 2 * h] = v[0];
        d[4 * j + 2 * h + 1] = v[1];
      }
    }
  }
  if constexpr (kRowReduce) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float p0, p1;
      tile_partials(d, h, p0, p1);
      const long long row = m0 + r0 + 8 * h;
      if (lane % 4 == 0 && row < a.rows)
        reinterpret_cast<float2*>(a.ws)[row * kTilesN + n0 / kBN] = make_float2(p0, p1);
    }
    return;
  }
  if (kGroup > 0 && !hand_over) {
    // A group of kGroup columns of a row: kGroup / 8 chunks of this thread and its quad.
    constexpr int kChunks = kG / 8;
    constexpr float kInv = 1.f / kG;
#pragma unroll
    for (int g = 0; g < 32 / kChunks; ++g) {
      float mean[2], rstd[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float sum = 0.f;
#pragma unroll
        for (int q = 0; q < kChunks; ++q) sum += d[4 * (g * kChunks + q) + 2 * h] + d[4 * (g * kChunks + q) + 2 * h + 1];
        mean[h] = fusedepi::team_sum_warp<4>(sum) * kInv;
        float sq = 0.f;
#pragma unroll
        for (int q = 0; q < kChunks; ++q)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = d[4 * (g * kChunks + q) + 2 * h + e] - mean[h];
            sq = fmaf(x, x, sq);
          }
        rstd[h] = rsqrtf(fusedepi::team_sum_warp<4>(sq) * kInv + kEps);
      }
#pragma unroll
      for (int q = 0; q < kChunks; ++q) {
        const int j = g * kChunks + q, col = col0 + 8 * j;
        const stage1_chan k[2] = {stage1_chan_of(a, col), stage1_chan_of(a, col + 1)};
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float v[2] = {d[4 * j + 2 * h], d[4 * j + 2 * h + 1]};
          if (live(h)) stage1_cols<2>(v, k, flat(h, col), a, mean[h], rstd[h]);
          d[4 * j + 2 * h] = v[0];
          d[4 * j + 2 * h + 1] = v[1];
        }
      }
    }
  }
}

// Whether the spare-warp kernel (kOffload) exists: a pointwise chain on 16-bit tiles (float32
// tiles are staged in two rounds), unless the spec keeps it in the consumers
// (kMaySpareWarps). Where it does not, the launch names only the plain kernel (a discarded
// branch naming <true> still asks nvcc for a stub of an instantiation that has no
// definition: warning #20280).
constexpr bool kSpareWarps = kMaySpareWarps && kPointwise && kRounds == 1;

// The GEMM kernel's body (the file's __global__ wrapper, named per spec, calls it with
// its __grid_constant__ tensor maps): map_a x [rows, kK], map_b w [kChannels, kK], map_c
// out [rows, kChannels] (unset with kRowReduce). kOffload: a pointwise chain runs in the
// producer warpgroup's spare warps (see cuda_templates/gemm_sm90.py).
template <bool kOffload>
__device__ __forceinline__ void gemm_body(const CUtensorMap& map_a, const CUtensorMap& map_b, const CUtensorMap& map_c,
                                          const Args& a) {
  constexpr bool kWarps = kOffload && kSpareWarps;
  // Registers a thread: the epilogue warps keep their 8 columns' operands (more with
  // kWarps). The consumers' setmaxnreg.inc waits until the producer's dec has freed what
  // it asks for, out of the 168 a thread that the launch gave 384 threads: more hangs.
  constexpr int kProducerRegs = kWarps ? 72 : 40, kConsumerRegs = kWarps ? 216 : 232;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "the CTA's registers");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* tiles_a = smem;
  uint8_t* tiles_b = smem + kStages * kTileA;
  uint8_t* staging = smem + kStages * (kTileA + kTileB);
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int tiles_m = static_cast<int>((a.rows + kBM - 1) / kBM), n_tiles = tiles_m * kTilesN;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      hop::mbar_init(&full[s], 1);
      hop::mbar_init(&empty[s], kConsumerWarps);
    }
    hop::mbar_init_fence();
  }
  __syncthreads();

  // Persistent: CTA b takes tiles b, b + gridDim.x, ...; the ring's stage and phase run on
  // across tiles (`it` counts k-tiles over all of this CTA's tiles), so the producer loads
  // the next tile while the consumers run the epilogue of this one.
  if (wg == 0) {  // producer
    hop::regs_dec<kProducerRegs>();
    if (tid == 0) {
      int it = 0;
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int m0, n0;
        tile_origin(tile, tiles_m, m0, n0);
        for (int i = 0; i < kKTiles; ++i, ++it) {
          const int s = it % kStages;
          if (it >= kStages) hop::mbar_wait(&empty[s], ((it / kStages) + 1) & 1);
          hop::mbar_expect_tx(&full[s], kTileA + kTileB);
          hop::tma_load_2d(tiles_a + s * kTileA, &map_a, &full[s], i * kBK, m0);
          hop::tma_load_2d(tiles_b + s * kTileB, &map_b, &full[s], i * kBK, n0);
        }
      }
    } else if constexpr (kWarps) {  // epilogue warps: every tile but the CTA's last
      if (tid < 32) return;
      const int et = tid - 32;
      for (int tile = blockIdx.x; tile + static_cast<int>(gridDim.x) < n_tiles; tile += gridDim.x) {
        int m0, n0;
        tile_origin(tile, tiles_m, m0, n0);
        hop::named_sync<kBarFull, kHandoff>();  // the consumers have staged the tile
        warps_stage0<kElem>(staging, et, m0, n0, a);
        hop::fence_async_shared();
        hop::named_sync<kBarEpi, 96>();
        if (et == 0) {
          store_staged(&map_c, staging, a, m0, n0, 0, 2);
          hop::bulk_wait_read();
        }
        // The staging tile is free once the copy has read it (thread 0 arrives after its
        // wait); the consumers wait for this before they stage their next tile.
        hop::named_arrive<kBarEmpty, kHandoff>();
      }
      if (et == 0) hop::bulk_wait();
    }
  } else {  // consumers: rows 64 * (wg - 1) .. + 64 of the tile
    hop::regs_inc<kConsumerRegs>();
    const int half = wg - 1;
    const auto release = [&](int s) {  // one arrival a warp
      __syncwarp();
      if (tid % 32 == 0) hop::mbar_arrive(&empty[s]);
    };
    int it = 0;
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
      int m0, n0;
      tile_origin(tile, tiles_m, m0, n0);
      const bool first = tile == static_cast<int>(blockIdx.x), last = tile + static_cast<int>(gridDim.x) >= n_tiles;
      const bool hand_over = kWarps && !last;
      float d[128];
#pragma unroll
      for (int i = 0; i < 128; ++i) d[i] = 0.f;
      for (int i = 0; i < kKTiles; ++i, ++it) {
        const int s = it % kStages;
        hop::mbar_wait(&full[s], (it / kStages) & 1);
        hop::wgmma_fence();
        const uint8_t* sa = tiles_a + s * kTileA + half * 64 * 128;  // 64 rows of 128 bytes
        const uint8_t* sb = tiles_b + s * kTileB;
#pragma unroll
        for (int kk = 0; kk < kBK / kMmaK; ++kk)  // 32 bytes along K within the swizzled row
          wgmma_256(d, hop::desc_sw<128>(sa + kk * 32), hop::desc_sw<128>(sb + kk * 32), (i > 0 || kk > 0) ? 1 : 0);
        hop::wgmma_commit();
        hop::wgmma_wait<1>();  // the previous k-tile's wgmma is done: free its stage
        if (i > 0) release((it - 1) % kStages);
      }
      hop::wgmma_wait<0>();
      hop::fence_accumulators(d);
      release((it - 1) % kStages);
      consumer_epilogue(d, half, tid, m0, n0, a, hand_over);  // in registers
      if constexpr (!kRowReduce) {  // a row reduction leaves partial statistics only: no staging tile, no store
        if constexpr (kWarps) {  // the epilogue warps are done with the staging tile
          if (!first) hop::named_sync<kBarEmpty, kHandoff>();
        }
        for (int round = 0; round < kRounds; ++round) {
          if constexpr (!kWarps) {  // the previous store has read the staging tile
            if (tid == 0) hop::bulk_wait_read();
            hop::named_sync<128>(1 + half);
          }
          stage_round(d, staging, half, tid, round);
          if (hand_over) {
            hop::named_arrive<kBarFull, kHandoff>();  // the epilogue warps take it from here
          } else {  // writes visible to the bulk copy, then one thread stores
            hop::fence_async_shared();
            hop::named_sync<128>(1 + half);
            if (tid == 0) store_staged(&map_c, staging, a, m0, n0 + round * kRoundCols, half, 1);
          }
        }
      }
    }
    if (tid == 0) hop::bulk_wait();
  }
}
