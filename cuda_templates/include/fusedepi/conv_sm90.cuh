// The in-kernel conv (sm_90a): an implicit GEMM over a channels-last input whose output
// tile gets the chain in registers and is written once, in the graph's NCHW layout.
//
// Included by the rendered file (cuda_templates/conv_sm90.py, CONV_KERNELS) inside its
// anonymous namespace, after the file has defined what this code reads:
//   T, Args (x: the input [rows, H, W, C_in] in memory, w: the weight [kChannels, kTaps,
//   C_in]), stage0_chan, stage0_chan_of, stage0_cols, kChannels, kRowReads (KERNEL_FILE
//   and CONV_KERNELS' constants: kBM, kBN, kBK, kStages, kTH, kTW, kKH, kKW, kPH, kPW,
//   kHo, kWo, kCBlocks, kTilesN, kTileA, kTileB, kMmaK, wgmma_n), and hopper.cuh.
// It is not a standalone header: those constants differ per file.
#pragma once

// Tile `tile` of the output: image `img`, pixels (h0 .. h0 + kTH) x (w0 .. w0 + kTW),
// channels n0 .. n0 + kBN. The channel tiles of one pixel patch are neighbours in the
// order, so that CTAs running at once share the patch's input in L2.
__device__ __forceinline__ void conv_tile_origin(int tile, int& img, int& h0, int& w0, int& n0) {
  constexpr int kTilesW = (kWo + kTW - 1) / kTW, kTilesH = (kHo + kTH - 1) / kTH;
  n0 = tile % kTilesN * kBN;
  int m = tile / kTilesN;
  w0 = m % kTilesW * kTW;
  m /= kTilesW;
  h0 = m % kTilesH * kTH;
  img = m / kTilesH;
}

// The consumers' epilogue of one tile: each value rounded to T (what the library conv's
// output holds), stage0, then stored to out[img, channel, h, w]. For 8-column chunk j a
// thread holds tile rows r0 and r0 + 8 (r0 = 64 * half + 16 * warp + lane / 4: pixel
// (r / kTW, r % kTW) of the patch) and channels n0 + 8j + 2 * (lane % 4) + {0, 1}; the 8
// lanes of a column hold 8 neighbouring pixels of a row (kTW >= 8).
__device__ __forceinline__ void conv_epilogue(float (&d)[kBN / 2], int half, int tid, int img, int h0, int w0, int n0,
                                              const Args& a) {
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = half * 64 + warp * 16 + lane / 4;
  long long at[2];  // the output's flat index of this thread's two pixels in channel 0
  bool live[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h, ph = h0 + r / kTW, pw = w0 + r % kTW;
    live[h] = ph < kHo && pw < kWo;
    at[h] = static_cast<long long>(img) * kChannels * kPlane + ph * kWo + pw;
  }
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
    const int col = n0 + 8 * j + 2 * (lane % 4);
    if (n0 + 8 * j >= kChannels) break;  // a chunk lies inside the channels or past them (kChannels % 8 == 0)
    const stage0_chan k[2][1] = {{stage0_chan_of(a, col)}, {stage0_chan_of(a, col + 1)}};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!live[h]) continue;
      const float2 y = hop::round_pair<T>(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      const float yv[2] = {y.x, y.y};
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const long long i = at[h] + static_cast<long long>(col + e) * kPlane;
        float v[1] = {yv[e]};
        stage0_cols<1>(v, k[e], i, a);
        a.out[i] = fusedepi::from_float<T>(v[0]);
      }
    }
  }
}

// The kernel's body (the file's __global__ wrapper calls it with its __grid_constant__
// tensor maps): map_x over x [rows, H, W, C_in] (dims C_in, W, H, rows), map_w over w
// [kChannels, kTaps, C_in] (dims C_in, kTaps, kChannels). Warpgroup 0's first thread
// loads, by TMA, for each k-step (tap, channel block) the patch of input pixels that tap
// reads (coordinates shifted by the tap, zeros past the image: the conv's padding) and
// the tap's weights; warpgroups 1 and 2 multiply (wgmma) and run the epilogue while the
// producer loads the next tile's first k-steps. Persistent: CTA b takes tiles b,
// b + gridDim.x, ...; the ring's stage and phase run on across tiles.
__device__ __forceinline__ void conv_body(const CUtensorMap& map_x, const CUtensorMap& map_w, const Args& a) {
  constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "the CTA's registers");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* tiles_a = smem;
  uint8_t* tiles_b = smem + kStages * kTileA;
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];

  const int wg = threadIdx.x / 128, tid = threadIdx.x % 128;
  const int n_tiles = static_cast<int>(a.rows) * kTilesPerImage;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      hop::mbar_init(&full[s], 1);
      hop::mbar_init(&empty[s], 8);  // one arrival a consumer warp
    }
    hop::mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {  // producer
    hop::regs_dec<kProducerRegs>();
    if (tid == 0) {
      int it = 0;
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int img, h0, w0, n0;
        conv_tile_origin(tile, img, h0, w0, n0);
        for (int i = 0; i < kKSteps; ++i, ++it) {
          const int s = it % kStages, tap = i / kCBlocks, c0 = i % kCBlocks * kBK;
          if (it >= kStages) hop::mbar_wait(&empty[s], ((it / kStages) + 1) & 1);
          hop::mbar_expect_tx(&full[s], kTileA + kTileB);
          hop::tma_load_4d(tiles_a + s * kTileA, &map_x, &full[s], c0, w0 + tap % kKW - kPW, h0 + tap / kKW - kPH, img);
          hop::tma_load_3d(tiles_b + s * kTileB, &map_w, &full[s], c0, tap, n0);
        }
      }
    }
  } else {  // consumers: tile rows 64 * (wg - 1) .. + 64
    hop::regs_inc<kConsumerRegs>();
    const int half = wg - 1;
    const auto release = [&](int s) {
      __syncwarp();
      if (tid % 32 == 0) hop::mbar_arrive(&empty[s]);
    };
    int it = 0;
    for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
      int img, h0, w0, n0;
      conv_tile_origin(tile, img, h0, w0, n0);
      float d[kBN / 2];
#pragma unroll
      for (int i = 0; i < kBN / 2; ++i) d[i] = 0.f;
      for (int i = 0; i < kKSteps; ++i, ++it) {
        const int s = it % kStages;
        hop::mbar_wait(&full[s], (it / kStages) & 1);
        hop::wgmma_fence();
        const uint8_t* sa = tiles_a + s * kTileA + half * 64 * 128;  // 64 rows of 128 bytes
        const uint8_t* sb = tiles_b + s * kTileB;
#pragma unroll
        for (int kk = 0; kk < kBK / kMmaK; ++kk)
          wgmma_n(d, hop::desc_sw128(sa + kk * 32), hop::desc_sw128(sb + kk * 32), (i > 0 || kk > 0) ? 1 : 0);
        hop::wgmma_commit();
        hop::wgmma_wait<1>();  // the previous k-step's wgmma is done: free its stage
        if (i > 0) release((it - 1) % kStages);
      }
      hop::wgmma_wait<0>();
      release((it - 1) % kStages);
      conv_epilogue(d, half, tid, img, h0, w0, n0, a);
    }
  }
}
