// The tensor-core direct conv's tile: a block's output tile of a small 2-D convolution
// on `mma.sync` (m16n8k16 bf16/fp16, m16n8k8 TF32), computed from an input tile staged
// in shared memory, with the chain's stage0 applied in registers.
//
// Included by the rendered file (cuda_templates/templates.py, DIRECT_CONV_MMA_KERNELS)
// inside its anonymous namespace, after the file has defined what this code reads:
//   T, Args, stage0, stage0_chan, stage0_chan_of, kGroups, ... (KERNEL_FILE's constants);
//   kCin, kCout, kKH, kKW, kPadH, kPadW, kHi, kWi, kHo, kWo, kTH, kTW, kConvStats, kCpg,
//   and the values derived from them (the conv's shape: DIRECT_CONV_MMA_KERNELS);
//   conv_part, conv_stats, conv_counters (the GroupNorm workspace) and mma_step (one
//   k-step of the dtype's instruction).
// It is not a standalone header: those constants differ per file.
#pragma once

__device__ __forceinline__ unsigned pack_pair(float lo, float hi) {
  const T h[2] = {fusedepi::from_float<T>(lo), fusedepi::from_float<T>(hi)};
  unsigned u;
  memcpy(&u, h, 4);
  return u;
}

__device__ __forceinline__ unsigned to_tf32(float x) {  // round to nearest (ties away), as cuDNN
  unsigned u;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
  return u;
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// kPass 0: GroupNorm statistics only; 1: the output; 2 (TF32): stage0's value into
// `mid`, and the statistics. 256 threads: kTW / 32 warps.
template <int kPass>
__device__ __forceinline__ void mma_tile(const Args& a, const long long n, const int tile_id) {
  constexpr bool kStats = kPass != 1;  // this pass leaves GroupNorm partials
  extern __shared__ uint4 mma_smem[];
  uint4* tile = mma_smem;  // [kInRows][kInCols][kCC], kCE channels per entry; then one zero entry
  uint4* frag = mma_smem + kTileChunks + 1;  // TF32: A fragments [m][step][lane]
  fusedepi::Moments* part = reinterpret_cast<fusedepi::Moments*>(frag + kFragEntries);  // [warp][group]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // Pass 1 stages each warp's [kCout][32] outputs here, then writes whole row segments.
  T* staged = reinterpret_cast<T*>(reinterpret_cast<char*>(part + 8 * kCtaGroups)) + warp * kCout * kOutStride;
  const int oh0 = tile_id / kColTiles * kTH, ow0 = tile_id % kColTiles * kTW;

  // Input tile, channels innermost, zero outside the image.
  const T* xn = a.x + n * kCin * kHi * kWi;
  if constexpr (kVecStage) {
    // 8 columns x 8 channels at a time: eight 16-byte loads (one per channel), a
    // transpose in registers (one byte_perm per output word), eight 16-byte stores.
    constexpr int kCV = (kInCols + 7) / 8;  // 8-column vectors per tile row
    constexpr int kUnits = kInRows * kCV * kCC;
    constexpr int kUnitIters = (kUnits + 255) / 256;
#pragma unroll 3
    for (int it = 0; it < kUnitIters; ++it) {
      const int i = it * 256 + threadIdx.x;
      if (i >= kUnits) break;
      const int cv = i % kCV, rc = i / kCV, cc = rc % kCC, r = rc / kCC;
      const int ih = oh0 - kPadH + r, iw = ow0 - kPadW + 8 * cv;
      const bool in = ih >= 0 && ih < kHi && iw >= 0 && iw < kWi;  // all 8 columns, or none
      const T* src = xn + ((long long)cc * 8 * kHi + (in ? ih : 0)) * kWi + (in ? iw : 0);
      unsigned w[8][4];  // [channel][column pair]
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint4 u = in ? *reinterpret_cast<const uint4*>(src + (long long)j * kHi * kWi) : make_uint4(0u, 0u, 0u, 0u);
        w[j][0] = u.x;
        w[j][1] = u.y;
        w[j][2] = u.z;
        w[j][3] = u.w;
      }
#pragma unroll
      for (int col = 0; col < 8; ++col) {
        const int c = 8 * cv + col;
        if (c >= kInCols) break;
        const unsigned sel = col & 1 ? 0x7632u : 0x5410u;  // the pair's high or low half
        uint4 u;
        u.x = __byte_perm(w[0][col / 2], w[1][col / 2], sel);
        u.y = __byte_perm(w[2][col / 2], w[3][col / 2], sel);
        u.z = __byte_perm(w[4][col / 2], w[5][col / 2], sel);
        u.w = __byte_perm(w[6][col / 2], w[7][col / 2], sel);
        tile[(r * kInCols + c) * kCC + cc] = u;
      }
    }
  } else if constexpr (kTF32) {
    // 4-byte asynchronous copies into the entries (zero outside the image): no register
    // round trip, every copy of a thread in flight at once; the weights' fragments are
    // built meanwhile. TF32 rounding happens on the B fragments after ldmatrix. A warp
    // takes whole lines (tile row, chunk, channel) and its lanes consecutive columns.
    float* const tile_f = reinterpret_cast<float*>(tile);
    for (int line = warp; line < kInRows * kCC * kCE; line += 8) {
      const int j = line % kCE, cc = line / kCE % kCC, r = line / kCE / kCC;
      const int ih = oh0 - kPadH + r;
      const bool row_in = ih >= 0 && ih < kHi;
      const T* src = xn + ((long long)(cc * kCE + j) * kHi + (row_in ? ih : 0)) * kWi;
      float* dst = tile_f + (r * kInCols * kCC + cc) * kCE + j;
      for (int c = lane; c < kInCols; c += 32) {
        const int iw = ow0 - kPadW + c;
        const bool in = row_in && iw >= 0 && iw < kWi;
        fusedepi::copy_async4(dst + c * kCC * kCE, reinterpret_cast<const float*>(in ? src + iw : src), in);
      }
    }
  } else {
    constexpr int kStageIters = (kTileChunks + 255) / 256;
#pragma unroll 4
    for (int it = 0; it < kStageIters; ++it) {  // unrolled so that several iterations' loads are in flight
      const int i = it * 256 + threadIdx.x;
      if (i >= kTileChunks) break;
      const int c = i % kInCols, rc = i / kInCols, cc = rc % kCC, r = rc / kCC;
      const int ih = oh0 - kPadH + r, iw = ow0 - kPadW + c;
      const bool in = ih >= 0 && ih < kHi && iw >= 0 && iw < kWi;
      const T* src = xn + ((long long)cc * kCE * kHi + (in ? ih : 0)) * kWi + (in ? iw : 0);
      T v[kCE];
#pragma unroll
      for (int j = 0; j < kCE; ++j) v[j] = in ? src[(long long)j * kHi * kWi] : fusedepi::from_float<T>(0.f);
      uint4 u;
      memcpy(&u, v, 16);
      tile[(r * kInCols + c) * kCC + cc] = u;
    }
  }
  if (threadIdx.x == 0) tile[kTileChunks] = make_uint4(0u, 0u, 0u, 0u);
  if constexpr (kStats)
    for (int i = threadIdx.x; i < 8 * kCtaGroups; i += blockDim.x) part[i] = {0.f, 0.f, 0.f};

  // Weights as A fragments: row = output channel, k = (tap, input channel); zero past
  // kKChunks. 16-bit: register q of lane (g, t) holds rows g (+8 for q odd), k 2t and
  // 2t + 1 (+8 for q >= 2), in registers. TF32: row g (+8), k t (+4), one value a
  // register, in shared memory (72 registers for workload 5 would not fit).
  unsigned wa[kTF32 ? 1 : kMT][kTF32 ? 1 : kKSteps][4];
  if constexpr (kTF32) {
    for (int i = threadIdx.x; i < kFragEntries; i += blockDim.x) {
      const int fl = i % 32, s = i / 32 % kKSteps, m = i / 32 / kKSteps, fg = fl >> 2, ft = fl & 3;
      unsigned r4[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int co = m * 16 + fg + 8 * (q & 1), chunk = 2 * s + (q >> 1);
        float w = 0.f;
        if (chunk < kKChunks) {
          const int tap = chunk / kCC, ci = chunk % kCC * kCE + ft;
          w = fusedepi::to_float(a.w[((co * kCin + ci) * kKH + tap / kKW) * kKW + tap % kKW]);
        }
        r4[q] = to_tf32(w);
      }
      frag[i] = make_uint4(r4[0], r4[1], r4[2], r4[3]);
    }
  } else {
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int s = 0; s < kKSteps; ++s)
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int co = m * 16 + g + 8 * (q & 1), k0 = 2 * t + 8 * (q >> 1);
          const int chunk = 2 * s + (k0 >> 3);
          float w0 = 0.f, w1 = 0.f;
          if (chunk < kKChunks) {
            const int tap = chunk / kCC, ci = chunk % kCC * 8 + (k0 & 7);
            const T* wp = a.w + ((co * kCin + ci) * kKH + tap / kKW) * kKW + tap % kKW;
            w0 = fusedepi::to_float(wp[0]);
            w1 = fusedepi::to_float(wp[kKH * kKW]);
          }
          wa[m][s][q] = pack_pair(w0, w1);
        }
  }
  // This lane's ldmatrix row: matrix (lane / 8) = (chunk 2s + bit 0, n-tile + bit 1).
  const int mat = lane >> 3;
  int koff[kKSteps];
#pragma unroll
  for (int s = 0; s < kKSteps; ++s) {
    const int chunk = 2 * s + (mat & 1), tap = chunk / kCC;
    koff[s] = chunk < kKChunks ? ((tap / kKW) * kInCols + tap % kKW) * kCC + chunk % kCC : -1;
  }
  const int px_lane = warp * 32 + (mat >> 1) * 8 + (lane & 7);
  const unsigned tile_base = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  const unsigned zero_addr = tile_base + 16u * kTileChunks;

  // This thread's channels' operands (pass 1: and their groups' statistics), loaded once.
  stage0_chan chan0[kMT][2];
  stage1_chan chan1[kMT][2];
  float gmean[kMT][2], grstd[kMT][2];
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      chan0[m][h] = stage0_chan_of(a, m * 16 + 8 * h + g);
      if constexpr (kPass == 1 && kConvStats) chan1[m][h] = stage1_chan_of(a, m * 16 + 8 * h + g);
      gmean[m][h] = 0.f;
      grstd[m][h] = 0.f;
      if constexpr (kPass == 1 && kConvStats) {
        // Through L2 (__ldcg): other blocks of this launch wrote them.
        const float* st = conv_stats(a) + (n * kGroups + (m * 16 + 8 * h + g) / kCpg) * 2;
        gmean[m][h] = __ldcg(st);
        grstd[m][h] = __ldcg(st + 1);
      }
    }
  if constexpr (kTF32) fusedepi::copy_async_wait();  // this thread's part of the tile
  __syncthreads();

  const int valid_px = min(32, kWo - ow0 - warp * 32);  // columns of this warp inside the image
  float shift[kMT][2], ssum[kMT][2], ssq[kMT][2], count = 0.f;  // pass 0: per-slot statistics
#pragma unroll
  for (int m = 0; m < kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) shift[m][h] = ssum[m][h] = ssq[m][h] = 0.f;
  for (int rr = 0; rr < kTH && valid_px > 0; ++rr) {
    const int oh = oh0 + rr;
    if (oh >= kHo) break;
    float acc[kMT][4][4];
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[m][j][e] = 0.f;
#pragma unroll
    for (int jp = 0; jp < 2; ++jp)
#pragma unroll
      for (int s = 0; s < kKSteps; ++s) {
        const unsigned addr =
            koff[s] >= 0 ? tile_base + 16u * ((rr * kInCols + px_lane + jp * 16) * kCC + koff[s]) : zero_addr;
        unsigned b[4];
        ldmatrix_x4(b, addr);
        if constexpr (kTF32)
#pragma unroll
          for (int q = 0; q < 4; ++q) b[q] = to_tf32(__uint_as_float(b[q]));
#pragma unroll
        for (int m = 0; m < kMT; ++m) {
          if constexpr (kTF32) {
            const uint4 f = frag[(m * kKSteps + s) * 32 + lane];
            const unsigned af[4] = {f.x, f.y, f.z, f.w};
            mma_step(acc[m][2 * jp], af, b[0], b[1]);
            mma_step(acc[m][2 * jp + 1], af, b[2], b[3]);
          } else {
            mma_step(acc[m][2 * jp], wa[m][s], b[0], b[1]);
            mma_step(acc[m][2 * jp + 1], wa[m][s], b[2], b[3]);
          }
        }
      }

    // acc[m][j]: channels m*16 + g (e = 0, 1) and + 8 (e = 2, 3), columns j*8 + 2t + (e & 1).
    // Per-channel operands are loaded once per channel and row, not per pair. Columns
    // past the image's edge run the stages too (no branches), at a clamped position so
    // that residual loads stay inside the tensor; the statistics and the stores leave
    // them out.
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int co = m * 16 + 8 * h + g;
        const stage0_chan& k0 = chan0[m][h];
        const stage1_chan& k1 = chan1[m][h];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int ow = min(ow0 + warp * 32 + j * 8 + 2 * t, kWo - 2);
          const long long e0 = n * kChannels * kInner + co * kInner + oh * kWo + ow;
          float v[2] = {acc[m][j][2 * h], acc[m][j][2 * h + 1]};
          stage0_at<2>(v, k0, e0, a);
          const bool in_image = j * 8 + 2 * t < valid_px;  // the pair (the output width is even)
          if constexpr (kPass == 1) {
            if constexpr (kConvStats) stage1_at<2>(v, k1, e0, a, gmean[m][h], grstd[m][h]);
            if constexpr (kStageOutput) {
              fusedepi::store_vec<T, 2>(staged + co * kOutStride + j * 8 + 2 * t, v);
            } else if (in_image) {  // 4 lanes fill a 32-byte sector
              fusedepi::store_vec<T, 2>(a.out + e0, v);
            }
          }
          if constexpr (kPass == 2)
            if (in_image) fusedepi::store_vec<T, 2>(a.mid + e0, v);
          acc[m][j][2 * h] = v[0];
          acc[m][j][2 * h + 1] = v[1];
        }
      }
    if constexpr (kPass == 1 && kStageOutput) {
      // Each instruction writes two channels' 32 contiguous columns (one pair per lane).
      __syncwarp();
      const int col = 2 * (lane & 15);
      if (col < valid_px) {
        const long long row0 = n * kChannels * kInner + (long long)oh * kWo + ow0 + warp * 32 + col;
#pragma unroll 4
        for (int co = lane >> 4; co < kCout; co += 2) {
          // 4-byte aligned: the output width and `col` are even.
          *reinterpret_cast<unsigned*>(a.out + row0 + (long long)co * kInner) =
              *reinterpret_cast<const unsigned*>(staged + co * kOutStride + col);
        }
      }
      __syncwarp();
    }
    if constexpr (kStats) {
      // Shifted sums per slot over this thread's valid columns, all rows of the block.
      // The shift is a value of the data: column 2t of the first row, valid whenever any
      // of this thread's columns is (a thread without one leaves count 0).
      if (rr == 0)
#pragma unroll
        for (int m = 0; m < kMT; ++m)
#pragma unroll
          for (int h = 0; h < 2; ++h) shift[m][h] = acc[m][0][2 * h];
#pragma unroll
      for (int m = 0; m < kMT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < 4; ++j)
            if (j * 8 + 2 * t < valid_px)
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const float d = acc[m][j][2 * h + e] - shift[m][h];
                ssum[m][h] += d;
                ssq[m][h] = fmaf(d, d, ssq[m][h]);
              }
#pragma unroll
      for (int j = 0; j < 4; ++j) count += j * 8 + 2 * t < valid_px ? 2.f : 0.f;
    }
  }
  if constexpr (kStats) {
    // Per thread and slot (count, mean, M2); merged over the group's lanes, then over
    // the slots of a group (more than 8 channels), then over the warps.
    fusedepi::Moments mo[kMT][2];
#pragma unroll
    for (int m = 0; m < kMT; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mo[m][h] = {0.f, 0.f, 0.f};
        if (count > 0.f)
          mo[m][h] = {count, shift[m][h] + ssum[m][h] / count,
                      fmaxf(ssq[m][h] - ssum[m][h] * ssum[m][h] / count, 0.f)};
#pragma unroll
        for (int o = 1; o < 4 * kGroupLanes; o <<= 1) {
          const fusedepi::Moments other = {__shfl_xor_sync(0xffffffffu, mo[m][h].n, o),
                                           __shfl_xor_sync(0xffffffffu, mo[m][h].mean, o),
                                           __shfl_xor_sync(0xffffffffu, mo[m][h].m2, o)};
          mo[m][h] = fusedepi::merge(mo[m][h], other);
        }
      }
    if (t == 0 && g % kGroupLanes == 0) {
#pragma unroll
      for (int m = 0; m < kMT; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          fusedepi::Moments& slot = part[warp * kCtaGroups + (m * 16 + 8 * h + g) / kCpg];
          slot = fusedepi::merge(slot, mo[m][h]);
        }
    }
    __syncthreads();
    for (int grp = threadIdx.x; grp < kCtaGroups; grp += blockDim.x) {
      fusedepi::Moments m = {0.f, 0.f, 0.f};
      for (int w = 0; w < 8; ++w) m = fusedepi::merge(m, part[w * kCtaGroups + grp]);
      float* dst = conv_part(a, n, grp, tile_id);
      dst[0] = m.n;
      dst[1] = m.mean;
      dst[2] = m.m2;
    }
  }
}
