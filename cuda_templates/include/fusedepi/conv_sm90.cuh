// The in-kernel conv (sm_90a): an implicit GEMM over a channels-last input whose output
// tile gets the chain on chip and is written once, in the graph's NCHW layout.
//
// Included by the rendered file (cuda_templates/conv_sm90.py, CONV_KERNELS) inside its
// anonymous namespace, after the file has defined what this code reads:
//   T, Args (x: the input [rows, H, W, C_in] in memory, w: the weight [kChannels, kTaps,
//   kCinPad]), stage0_chan, stage0_chan_of, stage0_at, kChannels (KERNEL_FILE and
//   CONV_KERNELS' constants: kBM, kBN, kBK, kStages, kTH, kTW, kKH, kKW, kPH, kPW,
//   kHo, kWo, kPitch, kCBlocks, kTilesN, kTileA, kTileB, kMmaK, wgmma_n), and hopper.cuh.
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

// The staging tile: the rounded values of a tile, by channel and patch row. A tile's
// kTW pixels of one channel and patch row are a run of the NCHW output that starts at
// any element; each run gets a slot of kRunSlot elements and starts in it at its offset
// from a 16-byte boundary of the output (`run_shift`), so that the output's aligned
// 16-byte chunks are aligned vectors of the slot. A channel's slots are kPitch elements
// apart (the file's constant, `conv_sm90.staging_pitch`: 16 bytes past a multiple of 64,
// so that the consumers' writes, 8 pixels x 4 channels a warp, fall in distinct banks).
constexpr int kOutV = 16 / kElem;  // elements a 16-byte vector
constexpr int kRunSlot = kTW + kOutV;
static_assert(kPitch >= kTH * kRunSlot && kPitch % kOutV == 0, "a channel's slots, in whole vectors");
constexpr int kStaging = kBN * kPitch * kElem;
constexpr int kHandoff = 256 + 96;  // the consumers and the epilogue warps
constexpr int kBarFull = 1, kBarEmpty = 2;

// The offset of a run (image img, tile channel cl, output row h, first pixel w0) from the
// 16-byte boundary of the output before it, in elements.
__device__ __forceinline__ int run_shift(int img, int n0, int cl, int h, int w0) {
  const long long start = ((static_cast<long long>(img) * kChannels + n0 + cl) * kHo + h) * kWo + w0;
  return static_cast<int>(start % kOutV);
}

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

// The consumers' part of a tile's staging: each accumulator rounded to T (what the
// library conv's output holds) into its run's slot. For 8-column chunk j a thread holds
// tile rows r0 and r0 + 8 (r0 = 64 * half + 16 * warp + lane / 4) and channels
// 8j + 2 * (lane % 4) + {0, 1} of the tile. A run's shift depends on its channel modulo
// 8 only (8 planes are whole 16-byte vectors), so a thread's four (channel, row) shifts
// hold for every j.
__device__ __forceinline__ void stage_tile(const float (&d)[kBN / 2], uint8_t* staging, int half, int tid, int img,
                                           int h0, int w0, int n0) {
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = half * 64 + warp * 16 + lane / 4;
  int at[2][2];  // [h][e]: the slot offset of channel 2 * (lane % 4) + e's pixel r0 + 8h
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = r0 + 8 * h, t = r / kTW, cl = 2 * (lane % 4) + e;
      at[h][e] = cl * kPitch + t * kRunSlot + run_shift(img, n0, cl, h0 + t, w0) + r % kTW;
    }
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
    if (n0 + 8 * j >= kChannels) break;  // kChannels % 8 == 0: a chunk is inside the channels or past them
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) sts_value(staging + (8 * j * kPitch + at[h][e]) * kElem, d[4 * j + 2 * h + e]);
  }
}

// The threads that finish a tile (the consumers and the epilogue warps, `kHandoff`), and
// the output chunks each holds at once (all its shared-memory and per-channel loads
// issued before the first is used).
constexpr int kInFlight = 2;
constexpr int kRunChunks = kTW / kOutV + 1;  // the aligned chunks a run of kTW elements may touch

// Thread `et` of kHandoff's part of a tile's finish: stage0 on the staged tile and the
// stores to out[img, channel, h, w], one aligned 16-byte chunk of a run at a time (a
// warp's stores one coalesced run whatever the output's width); the first and last
// chunk of a run partial, element by element; pixels past the output's edges skipped.
__device__ __forceinline__ void finish_tile(const uint8_t* staging, int et, int img, int h0, int w0, int n0,
                                            const Args& a) {
  const int channels = kChannels - n0 < kBN ? static_cast<int>(kChannels - n0) : kBN;
  const int rows = kHo - h0 < kTH ? kHo - h0 : kTH;
  const int width = kWo - w0 < kTW ? kWo - w0 : kTW;  // pixels of each run
  const int chunks = channels * kTH * kRunChunks;
  for (int v0 = et; v0 < chunks; v0 += kHandoff * kInFlight) {
    uint4 raw[kInFlight];
    stage0_chan k[kInFlight];
    long long first[kInFlight];  // the chunk's first element in out (16-byte aligned)
    int lo[kInFlight], hi[kInFlight];  // the run's elements in it
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int v = v0 + u * kHandoff, q = v % kRunChunks, t = v / kRunChunks % kTH, cl = v / (kRunChunks * kTH);
      const int shift = run_shift(img, n0, cl, h0 + t, w0);
      first[u] = ((static_cast<long long>(img) * kChannels + n0 + cl) * kHo + h0 + t) * kWo + w0 - shift + q * kOutV;
      lo[u] = q == 0 ? shift : 0;
      hi[u] = shift + width - q * kOutV < kOutV ? shift + width - q * kOutV : kOutV;
      if (v >= chunks || t >= rows) hi[u] = 0;
      if (lo[u] < hi[u]) {
        raw[u] = hop::lds128(staging + (cl * kPitch + t * kRunSlot + q * kOutV) * kElem);
        k[u] = stage0_chan_of(a, n0 + cl);
      }
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (lo[u] >= hi[u]) continue;
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw[u]);
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
      T* out = a.out + first[u];
      if (lo[u] == 0 && hi[u] == kOutV) {  // a whole chunk: one 16-byte store
        stage0_at<kOutV>(x, k[u], first[u], a);
        uint4 vec;
        uint32_t* o = reinterpret_cast<uint32_t*>(&vec);
        if constexpr (std::is_same_v<T, float>) {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[e] = __float_as_uint(x[e]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e) o[e] = hop::pack2<T>(x[2 * e], x[2 * e + 1]);
        }
        *reinterpret_cast<uint4*>(out) = vec;
      } else {  // a run's first or last chunk (a residual read one element at a time)
#pragma unroll
        for (int e = 0; e < kOutV; ++e) {
          if (e >= lo[u] && e < hi[u]) {
            float y[1] = {x[e]};
            stage0_at<1>(y, k[u], first[u] + e, a);
            out[e] = fusedepi::from_float<T>(y[0]);
          }
        }
      }
    }
  }
}

// The kernel's body (the file's __global__ wrapper calls it with its __grid_constant__
// tensor maps): map_x over x [rows, H, W, C_in] (dims C_in, W, H, rows), map_w over w
// [kChannels, kTaps x kCinPad]. Warpgroup 0's first thread loads, by TMA, for each k-step
// (tap, channel block) the patch of input pixels that tap reads (coordinates shifted by
// the tap, zeros past the image: the conv's padding) and the tap's weights; warpgroups 1
// and 2 multiply (wgmma) and stage the tile; they and warps 1-3 of warpgroup 0 run the
// chain on the staged tile and store it, the consumers their share before the next
// tile's wgmma, warps 1-3 theirs under it. Persistent: CTA b takes tiles b, b +
// gridDim.x, ...; the ring's stage and phase run on across tiles. Named barriers hand the
// staging tile over (kBarFull) and back (kBarEmpty).
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
      stage_tile(d, staging, half, tid, img, h0, w0, n0);
      hop::named_sync<kBarFull, kHandoff>();  // the whole tile is staged
      finish_tile(staging, 96 + half * 128 + tid, img, h0, w0, n0, a);  // a share of its finish
    }
  }
}
