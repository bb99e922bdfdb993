// The in-kernel conv (sm_90a): an implicit GEMM over a channels-last input whose output
// tile gets the chain on chip and is written once, in the graph's NCHW layout.
//
// Included by the rendered file (cuda_templates/conv_sm90.py, CONV_KERNELS) inside its
// anonymous namespace, after the file has defined what this code reads:
//   T, Args (x: the input [rows, H, W, C_in] in memory, w: the weight [kChannels, kTaps,
//   kCinPad]), stage0_chan, stage0_chan_of, stage0_at, kChannels (KERNEL_FILE and
//   CONV_KERNELS' constants: kRowReads,: kBM, kBN, kBK, kStages, kTH, kTW, kKH, kKW, kPH, kPW,
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

// The staging tile: the rounded values of a tile, kBN channels of kBM pixels each, a
// channel's pixels contiguous and channels kPitch elements apart (16 bytes of padding: the
// consumers' writes, 8 pixels x 4 channels a warp, fall in distinct banks).
constexpr int kOutV = 16 / kElem;  // elements a 16-byte vector
constexpr int kPitch = kBM + kOutV;
constexpr int kStaging = kBN * kPitch * kElem;
constexpr int kHandoff = 256 + 96;  // the consumers and the epilogue warps
constexpr int kBarFull = 1, kBarEmpty = 2;

// One value into shared memory as T.
__device__ __forceinline__ void sts_value(uint8_t* p, float x) {
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(hop::smem_u32(p)), "f"(x) : "memory");
  } else {
    const T t = fusedepi::from_float<T>(x);
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(hop::smem_u32(p)), "h"(*reinterpret_cast<const unsigned short*>(&t))
                 : "memory");
  }
}

// The consumers' part of a tile's epilogue: each accumulator rounded to T (what the
// library conv's output holds) into the staging tile. For 8-column chunk j a thread holds
// tile rows r0 and r0 + 8 (r0 = 64 * half + 16 * warp + lane / 4) and channels
// 8j + 2 * (lane % 4) + {0, 1} of the tile.
__device__ __forceinline__ void stage_tile(const float (&d)[kBN / 2], uint8_t* staging, int half, int tid, int n0) {
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = half * 64 + warp * 16 + lane / 4;
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
    if (n0 + 8 * j >= kChannels) break;  // kChannels % 8 == 0: a chunk is inside the channels or past them
    const int c = 8 * j + 2 * (lane % 4);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) sts_value(staging + ((c + e) * kPitch + r0 + 8 * h) * kElem, d[4 * j + 2 * h + e]);
  }
}

// n values of T from x[] to out + i: 16 bytes at a time where aligned, else pairs (16-bit,
// even i) or one by one.
__device__ __forceinline__ void store_run(T* out, long long i, const float* x, int n) {
  if (n == kOutV && i % kOutV == 0) {
    uint4 v;
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int e = 0; e < 4; ++e) w[e] = __float_as_uint(x[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) w[e] = hop::pack2<T>(x[2 * e], x[2 * e + 1]);
    }
    *reinterpret_cast<uint4*>(out + i) = v;
    return;
  }
  if constexpr (kElem == 2) {
    if (i % 2 == 0) {
      int e = 0;
      for (; e + 1 < n; e += 2) *reinterpret_cast<uint32_t*>(out + i + e) = hop::pack2<T>(x[e], x[e + 1]);
      if (e < n) out[i + e] = fusedepi::from_float<T>(x[e]);
      return;
    }
  }
  for (int e = 0; e < n; ++e) out[i + e] = fusedepi::from_float<T>(x[e]);
}

// The epilogue warps' part (thread `et` of 96): stage0 on the staged tile, 16 bytes of one
// channel's pixels at a time (a patch row holds whole vectors: kTW >= 8), stored to
// out[img, channel, h, w]; the pixels past the output's edge are skipped.
__device__ __forceinline__ void finish_tile(const uint8_t* staging, int et, int img, int h0, int w0, int n0,
                                            const Args& a) {
  constexpr int kVecsPerChannel = kBM / kOutV;
  for (int v = et; v < kBN * kVecsPerChannel; v += 96) {
    const int cl = v / kVecsPerChannel, r = v % kVecsPerChannel * kOutV, col = n0 + cl;
    if (col >= kChannels) break;
    const int ph = h0 + r / kTW, pw = w0 + r % kTW;
    if (ph >= kHo || pw >= kWo) continue;
    const uint4 raw = hop::lds128(staging + (cl * kPitch + r) * kElem);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
    float x[kOutV];
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
      for (int e = 0; e < 4; ++e) x[e] = __uint_as_float(w[e]);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = hop::unpack2<T>(w[e]);
        x[2 * e] = f.x;
        x[2 * e + 1] = f.y;
      }
    }
    const long long i = (static_cast<long long>(img) * kChannels + col) * kPlane + ph * kWo + pw;
    const stage0_chan k = stage0_chan_of(a, col);
    const int n = kWo - pw < kOutV ? kWo - pw : kOutV;
    if (n == kOutV && (!kRowReads || i % kOutV == 0)) {
      stage0_at<kOutV>(x, k, i, a);
    } else {  // a residual is read in whole vectors at aligned places only, and no further than the row goes
      for (int e = 0; e < n; ++e) {
        float y[1] = {x[e]};
        stage0_at<1>(y, k, i + e, a);
        x[e] = y[0];
      }
    }
    store_run(a.out, i, x, n);
  }
}

// The kernel's body (the file's __global__ wrapper calls it with its __grid_constant__
// tensor maps): map_x over x [rows, H, W, C_in] (dims C_in, W, H, rows), map_w over w
// [kChannels, kTaps x kCinPad]. Warpgroup 0's first thread
// loads, by TMA, for each k-step (tap, channel block) the patch of input pixels that tap
// reads (coordinates shifted by the tap, zeros past the image: the conv's padding) and
// the tap's weights; warpgroups 1 and 2 multiply (wgmma) and stage the tile, then go on
// with the next; warps 1-3 of warpgroup 0 run the chain on the staged tile and store it.
// Persistent: CTA b takes tiles b, b + gridDim.x, ...; the ring's stage and phase run on
// across tiles. Named barriers hand the staging tile over (kBarFull) and back (kBarEmpty).
__device__ __forceinline__ void conv_body(const CUtensorMap& map_x, const CUtensorMap& map_w, const Args& a) {
  constexpr int kProducerRegs = 72, kConsumerRegs = 216;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 384 * 168, "the CTA's registers");
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* tiles_a = smem;
  uint8_t* tiles_b = smem + kStages * kTileA;
  uint8_t* staging = smem + kStages * (kTileA + kTileB);
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

  if (wg == 0) {
    hop::regs_dec<kProducerRegs>();
    if (tid == 0) {  // the producer
      int it = 0;
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int img, h0, w0, n0;
        conv_tile_origin(tile, img, h0, w0, n0);
        for (int i = 0; i < kKSteps; ++i, ++it) {
          const int s = it % kStages, tap = i / kCBlocks, c0 = i % kCBlocks * kBK;
          if (it >= kStages) hop::mbar_wait(&empty[s], ((it / kStages) + 1) & 1);
          hop::mbar_expect_tx(&full[s], kTileA + kTileB);
          hop::tma_load_4d(tiles_a + s * kTileA, &map_x, &full[s], c0, w0 + tap % kKW - kPW, h0 + tap / kKW - kPH, img);
          hop::tma_load_2d(tiles_b + s * kTileB, &map_w, &full[s], tap * kCinPad + c0, n0);
        }
      }
    } else if (tid >= 32) {  // the epilogue warps
      for (int tile = blockIdx.x; tile < n_tiles; tile += gridDim.x) {
        int img, h0, w0, n0;
        conv_tile_origin(tile, img, h0, w0, n0);
        hop::named_sync<kBarFull, kHandoff>();  // the consumers have staged the tile
        finish_tile(staging, tid - 32, img, h0, w0, n0, a);
        // The staging tile is free (the consumers wait for this before their next tile's).
        if (tile + static_cast<int>(gridDim.x) < n_tiles) hop::named_arrive<kBarEmpty, kHandoff>();
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
      if (tile != static_cast<int>(blockIdx.x)) hop::named_sync<kBarEmpty, kHandoff>();  // the last tile is out
      stage_tile(d, staging, half, tid, n0);
      hop::named_arrive<kBarFull, kHandoff>();  // the epilogue warps take it from here
    }
  }
}
