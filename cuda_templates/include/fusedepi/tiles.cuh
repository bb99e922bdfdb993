// The apply kernel of a pointwise or BatchNorm chain on a channels-last y of any image
// size (render.Plan.tiled): y is, in memory, a matrix of rows * kInner pixels x kChannels
// channels; a block takes a tile of kTileP consecutive pixels x kTileC channels, reads it
// in vectors of kCV channels of one pixel (whole 32-byte sectors of each pixel's row),
// transposes it through shared memory, and runs the chain in the output's order: each
// vector is kPV consecutive pixels of one channel, at its place in the graph's
// (contiguous) layout, so the stage functions read every operand as the contiguous
// apply kernel does (per channel, a residual, a broadcast) and the stores are coalesced.
// A tile may span two images (a vector never does: kPV divides kInner).
//
// Included by the rendered file (templates.TILED_APPLY_KERNEL) after apply.cuh; it reads
// T, Args, kChannels, kInner, kRow, kBlock, kTileP, kTileC, kCV, kPV, kTiledNorm and
// stage0 / stage1. It is not a standalone header.
#pragma once

static_assert(kTileC % kCV == 0 && kChannels % kCV == 0 && kTileP % kPV == 0 && kInner % kPV == 0,
              "whole vectors: kCV channels of a pixel in, kPV pixels of a channel out");

// A row of kTileP + 1 floats a channel: a warp's writes (lanes on kTileC / kCV channel
// vectors of a few pixels) fall in distinct banks.
constexpr int kTileStride = kTileP + 1;
constexpr int kTileIn = kTileP * (kTileC / kCV);   // vectors a tile reads
constexpr int kTileOut = kTileC * (kTileP / kPV);  // vectors a tile writes
constexpr int kInPerThread = (kTileIn + kBlock - 1) / kBlock;
constexpr int kOutPerThread = (kTileOut + kBlock - 1) / kBlock;

__device__ __forceinline__ void tiled_apply(const Args& a) {
  __shared__ float tile[kTileC * kTileStride];
  const long long pixels = a.rows * kInner;
  const long long q0 = (long long)blockIdx.x * kTileP;  // the tile's first pixel
  const int c0 = static_cast<int>(blockIdx.y) * kTileC;  // and first channel
  // Every load of the tile in flight before the first shared-memory store.
  fusedepi::Pack<T, kCV> pk[kInPerThread];
#pragma unroll
  for (int t = 0; t < kInPerThread; ++t) {
    const int i = t * kBlock + static_cast<int>(threadIdx.x);
    const int pixel = i / (kTileC / kCV), c = (i % (kTileC / kCV)) * kCV;
    if (i < kTileIn && q0 + pixel < pixels && c0 + c < kChannels)
      pk[t] = *reinterpret_cast<const fusedepi::Pack<T, kCV>*>(a.y + (q0 + pixel) * kChannels + c0 + c);
  }
#pragma unroll
  for (int t = 0; t < kInPerThread; ++t) {
    const int i = t * kBlock + static_cast<int>(threadIdx.x);
    const int pixel = i / (kTileC / kCV), c = (i % (kTileC / kCV)) * kCV;
    if (i < kTileIn)
#pragma unroll
      for (int j = 0; j < kCV; ++j) tile[(c + j) * kTileStride + pixel] = fusedepi::to_float(pk[t].v[j]);
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < kOutPerThread; ++t) {
    const int i = t * kBlock + static_cast<int>(threadIdx.x);
    const int c = i / (kTileP / kPV), pixel = (i % (kTileP / kPV)) * kPV;
    const long long q = q0 + pixel;
    if (i >= kTileOut || q >= pixels || c0 + c >= kChannels) continue;
    float v[kPV];
#pragma unroll
    for (int j = 0; j < kPV; ++j) v[j] = tile[c * kTileStride + pixel + j];
    const long long image = q / kInner;
    const int pos = (c0 + c) * kInner + static_cast<int>(q - image * kInner);  // in the output's row
    const long long e0 = image * kRow + pos;
    stage0<kPV>(v, pos, e0, a);
    if constexpr (kTiledNorm) stage1<kPV>(v, pos, e0, a, 0.f, 0.f);  // BatchNorm: its scale/shift from a.ws
    fusedepi::store_vec<T, kPV>(a.out + e0, v);
  }
}
