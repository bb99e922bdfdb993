// The pad kernel of a padded library GEMM's x (`fusedepi_pad_rows`).
//
// Included by a padded library GEMM's rendered file (cuda_templates/templates.py,
// KERNEL_FILE) inside its anonymous namespace, after T and kPadK (K of x's padded rows).
// It is not a standalone header: those constants differ per file.
#pragma once

// fusedepi_pad_rows's kernel: a thread a 16-byte vector of xp's rows (kPadK is a
// multiple of 8), read element by element from x's unaligned rows of k.
constexpr int kPadVec = 16 / static_cast<int>(sizeof(T));

__global__ void __launch_bounds__(256) pad_rows(const T* __restrict__ x, T* __restrict__ xp, long long vectors,
                                                long long k) {
  const long long v = (long long)blockIdx.x * 256 + threadIdx.x;
  if (v >= vectors) return;
  constexpr long long kRowVecs = kPadK / kPadVec;
  const long long r = v / kRowVecs;
  const int c0 = static_cast<int>(v - r * kRowVecs) * kPadVec;
  const T* src = x + r * k;
  fusedepi::Pack<T, kPadVec> pk;
#pragma unroll
  for (int j = 0; j < kPadVec; ++j) pk.v[j] = c0 + j < k ? src[c0 + j] : fusedepi::from_float<T>(0.f);
  *reinterpret_cast<fusedepi::Pack<T, kPadVec>*>(xp + v * kPadVec) = pk;
}
