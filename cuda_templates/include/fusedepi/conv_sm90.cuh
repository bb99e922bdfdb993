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

// The staging tile: a tile's results, by channel and patch row. A tile's kTW pixels of
// one channel and patch row are a run of the NCHW output that starts at any element;
// each run gets a slot of kRunSlot elements and starts in it at its offset from a
// 16-byte boundary of the output, so that the output's aligned 16-byte chunks are
// aligned vectors of the slot (what a bulk copy reads). A channel's slots are kPitch
// elements apart (the file's constant, `conv_sm90.staging_pitch`: 16 bytes past a
// multiple of 64, so that the consumers' writes, 8 pixels x 4 channels a warp, fall in
// distinct banks).
constexpr int kOutV = 16 / kElem;  // elements a 16-byte vector
constexpr int kRunSlot = kTW + kOutV;
static_assert(kPitch >= kTH * kRunSlot && kPitch % kOutV == 0, "a channel's slots, in whole vectors");
constexpr int kStaging = kBN * kPitch * kElem;
constexpr int kConsumers = 256;  // the two consumer warpgroups, which stage and store each tile
constexpr int kBarFull = 1, kBarEmpty = 2;

// One value into shared memory (address `p`) as T. No memory clobber: the compiler may
// move the chain's arithmetic around it; the asm statements that order it with the
// copies that read it (fence_async_shared, the named barriers) are volatile too.
__device__ __forceinline__ void sts_value(unsigned p, float x) {
  if constexpr (std::is_same_v<T, float>) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(p), "f"(x));
  } else {
    const T t = fusedepi::from_float<T>(x);
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(p), "h"(*reinterpret_cast<const unsigned short*>(&t)));
  }
}

// The element of out at which a tile's run of channel `c`, output row `h` starts (column w0).
__device__ __forceinline__ long long run_start(int img, long long c, int h, int w0) {
  return ((static_cast<long long>(img) * kChannels + c) * kHo + h) * kWo + w0;
}

// The per-channel operands of the channels a consumer thread holds (channel 8j + 2 *
// (lane % 4) + e of the tile), loaded at the tile's start, so that their loads' latency
// passes under the mainloop. (Loaded in the finish, after the staging's shared-memory
// stores, the kernel took 1.12 ms on bf16 128 x 64 x 128 x 128 -> 128 on an H100; loaded
// here, 0.97 ms.)
struct TileChans {
  stage0_chan k[kBN / 8][2];
};
__device__ __forceinline__ void load_chans(TileChans& c, int tid, int n0, const Args& a) {
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (n0 + 8 * j < kChannels) c.k[j][e] = stage0_chan_of(a, n0 + 8 * j + 2 * (tid % 4) + e);
}

// A tile's finish, part 1: the consumers apply stage0 to their accumulators in registers
// (each rounded to T first, what the library conv's output holds) and stage the results.
// For 8-column chunk j a thread holds tile rows r0 and r0 + 8 (r0 = 64 * half + 16 *
// warp + lane / 4) and channels 8j + 2 * (lane % 4) + {0, 1} of the tile; a run's offset
// from a 16-byte boundary depends on its channel modulo 8 only (8 planes are whole 16-byte
// vectors), so a thread's four (channel, row) placements hold for every j. The code has
// no branch an element: a pixel past the output's edges is computed and staged too, in
// its slot's spare room, with the chain's operands read at an element that exists
// (element 8j of a plane, of image 0), and is never stored. (With a branch an element
// for the edges and another for the partial chunks' stores, this part took 0.41 of the
// kernel's 0.97 ms on bf16 128 x 64 x 128 x 128 -> 128 on an H100: latency, at two warps
// a scheduler.)
__device__ __forceinline__ void stage_chain(const float (&d)[kBN / 2], const TileChans& chans, uint8_t* staging,
                                            int half, int tid, int img, int h0, int w0, int n0, const Args& a) {
  constexpr long long kPlane = static_cast<long long>(kHo) * kWo;
  const int warp = tid / 32, lane = tid % 32;
  const int r0 = half * 64 + warp * 16 + lane / 4;
  const int rows = kHo - h0 < kTH ? kHo - h0 : kTH;
  const int width = kWo - w0 < kTW ? kWo - w0 : kTW;
  unsigned at[2][2];    // [h][e]: the shared address of channel 2 * (lane % 4) + e's pixel r0 + 8h
  long long idx[2][2];  // ... its element of out (channel chunk j adds 8j planes); 0 past the edges
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = r0 + 8 * h, t = r / kTW, x = r % kTW, cl = 2 * (lane % 4) + e;
      const long long start = run_start(img, n0 + cl, h0 + t, w0);
      const int shift = static_cast<int>(static_cast<unsigned>(start) % kOutV);  // kOutV divides 2^32
      at[h][e] = hop::smem_u32(staging) + (cl * kPitch + t * kRunSlot + shift + x) * kElem;
      idx[h][e] = t < rows && x < width ? start + x : 0;
    }
#pragma unroll
  for (int j = 0; j < kBN / 8; ++j) {
    if (n0 + 8 * j >= kChannels) break;  // kChannels % 8 == 0: a chunk is inside the channels or past them
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float y[1] = {fusedepi::to_float(fusedepi::from_float<T>(d[4 * j + 2 * h + e]))};
        stage0_at<1>(y, chans.k[j][e], idx[h][e] + 8 * j * kPlane, a);
        sts_value(at[h][e] + 8 * j * kPitch * kElem, y[0]);
      }
  }
}

// A tile's finish, part 2, by consumer thread `ct` (of kConsumers). Each run (a channel
// and patch row of the staged tile) gets one bulk copy of its whole 16-byte chunks of out,
// committed as one bulk group; the copies run on under the next tile's mainloop, and the
// consumers wait for them to have read the staging tile before they stage the next. The
// elements of a run's partial chunk at its start and at its end (of a run with no whole
// chunk: all of them, fewer than kOutV at either side) are stored by kOutV neighbouring
// threads, one element each, so that a warp's store touches a sector or two a chunk.
// (Stored by one thread a chunk, a warp's store touched 32 sectors: on bf16 128 x 64 x
// 128 x 128 -> 128, an H100, ncu counted 55% of the kernel's global sectors excess, and
// the kernel took 0.82 ms; spread so, 0.76 ms on another H100.)
__device__ __forceinline__ void store_runs(const uint8_t* staging, int ct, int img, int h0, int w0, int n0,
                                           const Args& a) {
  const int channels = kChannels - n0 < kBN ? static_cast<int>(kChannels - n0) : kBN;
  const int rows = kHo - h0 < kTH ? kHo - h0 : kTH;
  const int width = kWo - w0 < kTW ? kWo - w0 : kTW;
  const T* slots = reinterpret_cast<const T*>(staging);
  // [lo, hi): run v's whole chunks of out, from `start`; run[i]: out[start + i] in the staging tile
  const auto run_of = [&](int v, long long& start, long long& lo, long long& hi, const T*& run) {
    const int cl = v / kTH, t = v % kTH;
    start = run_start(img, n0 + cl, h0 + t, w0);
    const int shift = static_cast<int>(static_cast<unsigned>(start) % kOutV);  // kOutV divides 2^32
    const long long end = start + width;
    lo = start + (shift ? kOutV - shift : 0);
    hi = end - end % kOutV;
    run = slots + cl * kPitch + t * kRunSlot + shift;
  };
  for (int v = ct; v < channels * kTH; v += kConsumers) {
    if (v % kTH >= rows) continue;
    long long start, lo, hi;
    const T* run;
    run_of(v, start, lo, hi, run);
    if (hi > lo) hop::bulk_store(a.out + lo, run + (lo - start), static_cast<unsigned>((hi - lo) * kElem));
  }
  hop::bulk_commit();
  constexpr int kTogether = kConsumers / kOutV;  // partial chunks stored at once
  const int q = ct % kOutV;
  for (int u = ct / kOutV; u < channels * kTH * 2; u += kTogether) {
    const int v = u / 2;
    if (v % kTH >= rows) continue;
    long long start, lo, hi;
    const T* run;
    run_of(v, start, lo, hi, run);
    const long long end = start + width, head_end = lo < end ? lo : end, tail = hi > head_end ? hi : head_end;
    const long long e = (u % 2 == 0 ? start : tail) + q;
    if (e < (u % 2 == 0 ? head_end : end)) a.out[e] = run[e - start];
  }
}

// The kernel's body (the file's __global__ wrapper calls it with its __grid_constant__
// tensor maps): map_x over x [rows, H, W, C_in] (dims C_in, W, H, rows), map_w over w
// [kChannels, kTaps x kCinPad]. Warpgroup 0's first thread loads, by TMA, for each k-step
// (tap, channel block) the patch of input pixels that tap reads (coordinates shifted by
// the tap, zeros past the image: the conv's padding) and the tap's weights; warpgroups 1
// and 2 multiply (wgmma), apply the chain in registers, stage the tile and issue its bulk
// copies to out, which run under the next tile's wgmma. Persistent: CTA b takes tiles b,
// b + gridDim.x, ...; the ring's stage and phase run on across tiles. Two named barriers
// of the consumers: the tile is staged (kBarFull), the last tile's copies have read the
// staging tile (kBarEmpty).
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
    }  // warps 1-3 have nothing to do
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
      TileChans chans;
      load_chans(chans, tid, n0, a);
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
      if (tile != static_cast<int>(blockIdx.x)) {  // the last tile's copies have read the staging tile
        hop::bulk_wait_read();
        hop::named_sync<kBarEmpty, kConsumers>();
      }
      stage_chain(d, chans, staging, half, tid, img, h0, w0, n0, a);
      hop::fence_async_shared();  // the staging tile's writes, before the bulk copies read it
      hop::named_sync<kBarFull, kConsumers>();  // the whole tile is staged
      store_runs(staging, half * 128 + tid, img, h0, w0, n0, a);
    }
    hop::bulk_wait();  // the copies are complete before the kernel ends
  }
}
