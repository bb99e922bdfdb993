// The in-kernel GEMM's tile helpers (sm_90a): which tile a CTA takes, the staging tile's
// swizzled layout, its TMA store, the spare warps' stage0 on a staged tile, and the
// consumers' writes into it.
//
// Included by the rendered file (cuda_templates/gemm_sm90.py, GEMM_KERNELS) inside its
// anonymous namespace, after the file has defined what this code reads:
//   T, Args, stage0_chan, stage0_chan_of, stage0_cols, kChannels, ... (KERNEL_FILE's constants);
//   kBM, kBN, kBK, kTilesN, kElem, kBoxCols, kRoundCols, kRounds, kBarFull, kBarEmpty,
//   kBarEpi, kHandoff (the GEMM's tiling: GEMM_KERNELS), and hopper.cuh's primitives.
// It is not a standalone header: those constants differ per file.
#pragma once

// Grouped raster: tiles vary fastest along M within bands of 8 row tiles, so that the CTAs
// running at once read a band of x and a few w tiles, which stay in L2 while shared.
__device__ __forceinline__ void tile_origin(int tile, int tiles_m, int& m0, int& n0) {
  constexpr int kBand = 8;
  const int per_band = kBand * kTilesN, first_m = tile / per_band * kBand;
  const int band_rows = min(tiles_m - first_m, kBand);
  m0 = (first_m + tile % per_band % band_rows) * kBM;
  n0 = tile % per_band / band_rows * kBN;
}

// The 16-byte chunk `cc` (0 .. 31) of row `r` of a round of the staging tile (columns
// 8cc .. 8cc + 7 of 16-bit values, 4cc .. 4cc + 3 of float32): two 64-row halves (one a
// consumer warpgroup), each four boxes of 64 128-byte rows, the chunk index XORed with
// row % 8 (TMA's 128-byte swizzle): a warp's 4-byte writes (8 rows x 4 lanes) fall in
// 32 different banks, its 8-byte writes in two passes over them.
__device__ __forceinline__ uint8_t* staged_chunk(uint8_t* staging, int r, int cc) {
  return staging + (r >> 6) * 32768 + (cc >> 3) * 8192 + (r & 63) * 128 + (((cc & 7) ^ (r & 7)) << 4);
}

// Stores the staged rows m0 + 64 * first_half .. of a round (columns n0 .. n0 + kRoundCols)
// by TMA (rows past M: none).
__device__ __forceinline__ void store_staged(const CUtensorMap* map, uint8_t* staging, const Args& a, int m0, int n0,
                                             int first_half, int halves) {
  for (int half = first_half; half < first_half + halves; ++half) {
    if (m0 + half * 64 >= a.rows) break;
#pragma unroll
    for (int b = 0; b < 4; ++b)
      hop::tma_store_2d(map, staging + half * 32768 + b * 8192, n0 + b * kBoxCols, m0 + half * 64);
  }
  hop::bulk_commit();
}

// The epilogue warps' share of a staged tile (thread `et` of 96), in place: stage0 on the
// rounded values, 8 columns at a time. A warp takes the 32 chunks of a row, so a thread
// keeps its 8 columns (chunk et % 32) for the whole tile and loads their operands once.
// (A template so that float32 files, whose consumers run the chain, do not instantiate it.)
template <int kE>
__device__ __forceinline__ void warps_stage0(uint8_t* staging, int et, int m0, int n0, const Args& a) {
  static_assert(kE == 2 && kBN / 8 == 32 && 96 % 32 == 0, "16-bit values; a thread's chunk is the same on every row");
  const int cc = et % 32, col = n0 + cc * 8;
  stage0_chan k[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) k[e] = stage0_chan_of(a, col + e);
  for (int r = et / 32; r < kBM; r += 3) {
    const long long row = m0 + r;
    if (kRowReads && row >= a.rows) continue;
    uint8_t* p = staged_chunk(staging, r, cc);
    uint4 v = hop::lds128(p);
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
    float x[8];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = hop::unpack2<T>(w[e]);
      x[2 * e] = f.x;
      x[2 * e + 1] = f.y;
    }
    stage0_cols<8>(x, k, row * kChannels + col, a);
#pragma unroll
    for (int e = 0; e < 4; ++e) w[e] = hop::pack2<T>(x[2 * e], x[2 * e + 1]);
    hop::sts128(p, v);
  }
}

// This consumer thread's values of a round into its warpgroup's staging half: for 8-column
// chunk j, rows r0 and r0 + 8 (r0 = 64 * half + 16 * warp + lane / 4), columns
// 8j + 2 * (lane % 4) + {0, 1} of the tile, for the chunks inside the round's columns.
__device__ __forceinline__ void stage_round(const float (&d)[128], uint8_t* staging, int half, int tid, int round) {
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = half * 64 + warp * 16 + lane / 4;
  constexpr int kChunks = kRoundCols / 8;  // 8-column chunks a round
#pragma unroll
  for (int q = 0; q < kChunks; ++q) {
    const int j = round * kChunks + q, byte = (8 * q + 2 * (lane % 4)) * kElem;  // within the round's row
#pragma unroll
    for (int h = 0; h < 2; ++h)
      hop::sts_pair<T>(staged_chunk(staging, r0 + 8 * h, byte / 16) + byte % 16, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
  }
}
