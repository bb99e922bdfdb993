// The FMA direct conv's tile: a block's output tile of a small 2-D convolution in
// CUDA-core float32 FMA (float32 with TF32 off; bf16 and fp16 inputs the tensor-core
// kernel does not take, converted to float32 as they are staged), from an input tile
// staged in shared memory, with the chain's stage0 applied in registers and, with
// GroupNorm, the tile's partial statistics left in the workspace.
//
// Included by the rendered file (cuda_templates/templates.py, DIRECT_CONV_KERNELS)
// inside its anonymous namespace, after the file has defined what this code reads:
//   T, Args, stage0_at, stage0_chan, stage0_chan_of, kGroups, ... (KERNEL_FILE's constants);
//   kCin, kCout, kCoPad, kKH, kKW, kPadH, kPadW, kHi, kWi, kHo, kWo, kTH, kTW, kColRuns, kOV,
//   kConvStats, kCpg and the values derived from them (the conv's shape);
//   conv_part (the GroupNorm workspace) and conv_dst (where the tile's values go).
// It is not a standalone header: those constants differ per file.
#pragma once

__device__ __forceinline__ void conv_tile(const Args& a, const long long n, const int tile) {
  extern __shared__ float4 conv_smem[];
  float* xs = reinterpret_cast<float*>(conv_smem);  // [kCin][kInRows][kSW]
  float* wsm = xs + kCin * kInRows * kSW;            // [tap][kCoPad]
  fusedepi::Moments* part = reinterpret_cast<fusedepi::Moments*>(wsm + kTaps * kCoPad);  // [warp][slot]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int oh0 = tile / kColTiles * kTH, ow0 = tile % kColTiles * kTW;

  // The input tile, zero outside the image (padding), and the weights, as float32.
  // float32 is copied with cp.async (sm_80+; zero-filled where the source is outside),
  // so that all of a thread's copies are in flight at once rather than a round trip per
  // row; 16-bit values are loaded and converted (exactly) on the way.
  static_assert(sizeof(T) == 4 || sizeof(T) == 2, "the FMA direct conv reads float32, bf16 or fp16");
  const T* xn = a.x + n * kCin * kHi * kWi;
  for (int r = warp; r < kCin * kInRows; r += 8) {
    const int ci = r / kInRows, ih = oh0 - kPadH + r % kInRows;
    const bool row_in = ih >= 0 && ih < kHi;
    const T* src = xn + ((long long)ci * kHi + (row_in ? ih : 0)) * kWi;
#pragma unroll
    for (int k = 0; k < (kSW + 31) / 32; ++k) {
      const int col = k * 32 + lane, iw = ow0 - kPadW + col;
      const bool in = row_in && iw >= 0 && iw < kWi;
      if (col >= kSW) continue;
      if constexpr (sizeof(T) == 4) {
        // (T is float here; the cast only lets the 16-bit files compile this branch)
        fusedepi::copy_async4(xs + r * kSW + col, reinterpret_cast<const float*>(in ? src + iw : src), in);
      } else {
        xs[r * kSW + col] = in ? fusedepi::to_float(src[iw]) : 0.f;
      }
    }
  }
  for (int i = threadIdx.x; i < kTaps * kCoPad; i += blockDim.x) {
    const int co = i % kCoPad, tap = i / kCoPad;
    if constexpr (sizeof(T) == 4) {
      fusedepi::copy_async4(wsm + i, reinterpret_cast<const float*>(a.w + (co < kCout ? co * kTaps + tap : 0)),
                            co < kCout);
    } else {
      wsm[i] = co < kCout ? fusedepi::to_float(a.w[co * kTaps + tap]) : 0.f;
    }
  }
  if constexpr (sizeof(T) == 4) fusedepi::copy_async_wait();
  if constexpr (kConvStats)
    for (int i = threadIdx.x; i < 8 * kSlots; i += blockDim.x) part[i] = {0.f, 0.f, 0.f};
  __syncthreads();

  const int cg = warp % kCog;  // this warp's output channels: cg * 8 ... cg * 8 + 7
  const int valid_cols = min(kTW, kWo - ow0);
  for (int rr = warp / kCog; rr < kTH; rr += kRowsAtOnce) {
    const int oh = oh0 + rr;
    if (oh >= kHo) break;
    float acc[kColRuns][4][8];  // [run][column][channel]
#pragma unroll
    for (int s = 0; s < kColRuns; ++s)
#pragma unroll
      for (int p = 0; p < 4; ++p)
#pragma unroll
        for (int o = 0; o < 8; ++o) acc[s][p][o] = 0.f;
#pragma unroll 2
    for (int ci = 0; ci < kCin; ++ci) {
#pragma unroll
      for (int kh = 0; kh < kKH; ++kh) {
        const float* row = xs + (ci * kInRows + rr + kh) * kSW + 4 * lane;
        float xv[kColRuns][4 * kXV];
#pragma unroll
        for (int s = 0; s < kColRuns; ++s)
#pragma unroll
          for (int q = 0; q < kXV; ++q) {
            const float4 t = *reinterpret_cast<const float4*>(row + 128 * s + 4 * q);
            xv[s][4 * q] = t.x;
            xv[s][4 * q + 1] = t.y;
            xv[s][4 * q + 2] = t.z;
            xv[s][4 * q + 3] = t.w;
          }
        const float* wrow = wsm + (ci * kKH + kh) * kKW * kCoPad + cg * 8;
#pragma unroll
        for (int kw = 0; kw < kKW; ++kw) {
          const float4 w0 = *reinterpret_cast<const float4*>(wrow + kw * kCoPad);
          const float4 w1 = *reinterpret_cast<const float4*>(wrow + kw * kCoPad + 4);
          const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
          for (int s = 0; s < kColRuns; ++s)
#pragma unroll
            for (int p = 0; p < 4; ++p)
#pragma unroll
              for (int o = 0; o < 8; ++o) acc[s][p][o] = fmaf(xv[s][p + kw], w[o], acc[s][p][o]);
        }
      }
    }

    // Epilogue on the registers: stage0 (which starts with the folded conv bias), store;
    // the values as stored feed the statistics. Per-channel operands once per channel.
#pragma unroll
    for (int o = 0; o < 8; ++o) {
      const int co = cg * 8 + o;
      if (kCoPad != kCout && co >= kCout) continue;
      const stage0_chan k0 = stage0_chan_of(a, co);
#pragma unroll
      for (int s = 0; s < kColRuns; ++s)
#pragma unroll
        for (int p = 0; p < 4; p += kOV) {
          const int ow = ow0 + 128 * s + 4 * lane + p;
          if (ow >= kWo) continue;
          float v[kOV];
#pragma unroll
          for (int j = 0; j < kOV; ++j) v[j] = acc[s][p + j][o];
          const long long e0 = n * kChannels * kInner + co * kInner + oh * kWo + ow;
          stage0_at<kOV>(v, k0, e0, a);
#pragma unroll
          for (int j = 0; j < kOV; ++j) {  // statistics of the values as stored
            v[j] = fusedepi::to_float(fusedepi::from_float<T>(v[j]));
            acc[s][p + j][o] = v[j];
          }
          fusedepi::store_vec<T, kOV>(conv_dst(a) + e0, v);
        }
    }
    if constexpr (kConvStats) {
      // (count, mean, M2) of each slot over the warp's row: two passes over registers.
#pragma unroll
      for (int l = 0; l < kSlots; ++l) {
        const int c0 = cg * 8 + l * kSlotCh;
        const int chans = max(0, min(kSlotCh, kCout - c0));
        if (chans == 0) continue;
        const float count = static_cast<float>(valid_cols * chans);
        float sum = 0.f;
#pragma unroll
        for (int s = 0; s < kColRuns; ++s)
#pragma unroll
          for (int p = 0; p < 4; ++p)
            if (ow0 + 128 * s + 4 * lane + p < kWo)
#pragma unroll
              for (int o = l * kSlotCh; o < (l + 1) * kSlotCh; ++o)
                if (kCoPad == kCout || cg * 8 + o < kCout) sum += acc[s][p][o];
        const float mean = fusedepi::team_sum_warp<32>(sum) / count;
        float q = 0.f;
#pragma unroll
        for (int s = 0; s < kColRuns; ++s)
#pragma unroll
          for (int p = 0; p < 4; ++p)
            if (ow0 + 128 * s + 4 * lane + p < kWo)
#pragma unroll
              for (int o = l * kSlotCh; o < (l + 1) * kSlotCh; ++o)
                if (kCoPad == kCout || cg * 8 + o < kCout) q += (acc[s][p][o] - mean) * (acc[s][p][o] - mean);
        q = fusedepi::team_sum_warp<32>(q);
        if (lane == 0) part[warp * kSlots + l] = fusedepi::merge(part[warp * kSlots + l], {count, mean, q});
      }
    }
  }
  if constexpr (kConvStats) {
    __syncthreads();
    for (int g = threadIdx.x; g < kGroups; g += blockDim.x) {
      fusedepi::Moments m = {0.f, 0.f, 0.f};
      for (int w = 0; w < 8; ++w)
        for (int l = 0; l < kSlots; ++l)
          if ((w % kCog * 8 + l * kSlotCh) / kCpg == g) m = fusedepi::merge(m, part[w * kSlots + l]);
      float* dst = conv_part(a, n, g, tile);
      dst[0] = m.n;
      dst[1] = m.mean;
      dst[2] = m.m2;
    }
  }
}
