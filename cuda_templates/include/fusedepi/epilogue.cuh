// Reusable device code for fusedepi's epilogue kernels: type conversion, vector
// loads and stores, the activation vocabulary, and team/block reductions.
// Templates (cuda_templates/templates.py) only bind constants and call these.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>

namespace fusedepi {

// ------------------------------------------------------------------ types

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// V elements of T moved as one access (16 bytes when V * sizeof(T) == 16).
template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[V]) {
  Pack<T, V> pk = *reinterpret_cast<const Pack<T, V>*>(p);
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_float(pk.v[j]);
}

// Float loads through L2 only (ld.global.cg): for data other blocks of the same
// launch wrote, which this SM's L1 may hold a stale copy of.
template <int V>
__device__ __forceinline__ void load_vec_cg(const float* __restrict__ p, float (&out)[V]) {
  static_assert(V == 1 || V == 2 || V == 4, "1, 2 or 4 floats");
  if constexpr (V == 4) {
    const float4 t = __ldcg(reinterpret_cast<const float4*>(p));
    out[0] = t.x, out[1] = t.y, out[2] = t.z, out[3] = t.w;
  } else if constexpr (V == 2) {
    const float2 t = __ldcg(reinterpret_cast<const float2*>(p));
    out[0] = t.x, out[1] = t.y;
  } else {
    out[0] = __ldcg(p);
  }
}

// V elements of any T through L2 only (ld.global.cg), as one access of V * sizeof(T)
// bytes (2 to 16), converted to float: the 16-bit counterpart of load_vec_cg.
template <typename T, int V>
__device__ __forceinline__ void load_vec_cg_packed(const T* __restrict__ p, float (&out)[V]) {
  constexpr int kBytes = sizeof(T) * V;
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "2 to 16 bytes");
  Pack<T, V> pk;
  if constexpr (kBytes == 16) {
    *reinterpret_cast<uint4*>(&pk) = __ldcg(reinterpret_cast<const uint4*>(p));
  } else if constexpr (kBytes == 8) {
    *reinterpret_cast<uint2*>(&pk) = __ldcg(reinterpret_cast<const uint2*>(p));
  } else if constexpr (kBytes == 4) {
    *reinterpret_cast<unsigned int*>(&pk) = __ldcg(reinterpret_cast<const unsigned int*>(p));
  } else {
    *reinterpret_cast<unsigned short*>(&pk) = __ldcg(reinterpret_cast<const unsigned short*>(p));
  }
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = to_float(pk.v[j]);
}

// Float stores marked evict-first (st.global.cs): for a final output, which no block of
// the same launch reads (a cache hint only).
template <int V>
__device__ __forceinline__ void store_vec_cs(float* __restrict__ p, const float (&in)[V]) {
  static_assert(V == 1 || V == 2 || V == 4, "1, 2 or 4 floats");
  if constexpr (V == 4) {
    __stcs(reinterpret_cast<float4*>(p), make_float4(in[0], in[1], in[2], in[3]));
  } else if constexpr (V == 2) {
    __stcs(reinterpret_cast<float2*>(p), make_float2(in[0], in[1]));
  } else {
    __stcs(p, in[0]);
  }
}

// 4 bytes from global to shared memory, or 4 zero bytes where !valid (src is then not
// read, but must be a valid address). cp.async on sm_80+, a plain copy before; the
// copies are complete after copy_async_wait() (then a barrier makes them visible).
__device__ __forceinline__ void copy_async4(float* dst, const float* src, bool valid) {
#if __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(d), "l"(src), "r"(valid ? 4 : 0) : "memory");
#else
  *dst = valid ? *src : 0.f;
#endif
}

__device__ __forceinline__ void copy_async_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// Waits until the int at p exceeds `target` (ld.acquire.gpu: the writes the other
// block made before its release are visible to this thread afterwards).
__device__ __forceinline__ void wait_above(const int* p, int target) {
  int v;
  while (true) {
    asm volatile("ld.acquire.gpu.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    if (v > target) return;
    __nanosleep(128);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&in)[V]) {
  Pack<T, V> pk;
#pragma unroll
  for (int j = 0; j < V; ++j) pk.v[j] = from_float<T>(in[j]);
  *reinterpret_cast<Pack<T, V>*>(p) = pk;
}

// ------------------------------------------------------- per-channel operands
// A vector of W elements at position `pos` of its row ([channels, inner] flattened;
// rows are < 2^31 elements, so 32-bit math). Its channels are consecutive
// (inner == 1), or it lies inside one channel (inner % W == 0), or it straddles at
// most two (inner > W), or, in general, each element has its own. Vectors cross no
// row (W divides the row length), except under the flat mapping of pointwise chains
// (kWrap = the row length), where element j lies at (pos + j) mod kWrap.

template <int W, int kInner, long long kWrap = 0>
__device__ __forceinline__ void channels_of(int pos, int (&c)[W]) {
  if constexpr (kWrap != 0) {
#pragma unroll
    for (int j = 0; j < W; ++j) {
      int q = pos + j;
      if constexpr (kWrap >= W) {
        q = q >= kWrap ? q - static_cast<int>(kWrap) : q;
      } else {
        q %= static_cast<int>(kWrap);
      }
      c[j] = q / kInner;
    }
  } else if constexpr (kInner == 1) {
#pragma unroll
    for (int j = 0; j < W; ++j) c[j] = pos + j;
  } else if constexpr (kInner % W == 0) {
#pragma unroll
    for (int j = 0; j < W; ++j) c[j] = pos / kInner;
  } else if constexpr (kInner > W) {
    const int q = pos / kInner, r = pos - q * kInner;
#pragma unroll
    for (int j = 0; j < W; ++j) c[j] = q + (r + j >= kInner);
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) c[j] = (pos + j) / kInner;
  }
}

// Loads a per-channel parameter for each element of the vector: one vector access
// when the channels are consecutive (the caller aligns p to 32 bytes), one scalar
// when the vector shares a channel, two when it straddles two; one an element where
// vectors may cross rows (kWrap != 0: the channels wrap around, unaligned).
template <int W, long long kInner, long long kWrap = 0, typename P>
__device__ __forceinline__ void load_channel(const P* __restrict__ p, const int (&c)[W], float (&out)[W]) {
  if constexpr (kWrap != 0) {
#pragma unroll
    for (int j = 0; j < W; ++j) out[j] = to_float(p[c[j]]);
  } else if constexpr (kInner == 1 && W > 1) {
    load_vec<P, W>(p + c[0], out);
  } else if constexpr (kInner % W == 0) {
    const float x = to_float(p[c[0]]);
#pragma unroll
    for (int j = 0; j < W; ++j) out[j] = x;
  } else if constexpr (kInner > W) {
    const float first = to_float(p[c[0]]), last = to_float(p[c[W - 1]]);
#pragma unroll
    for (int j = 0; j < W; ++j) out[j] = c[j] == c[0] ? first : last;
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) out[j] = to_float(p[c[j]]);
  }
}

// W copies of one value (a per-channel operand loaded once for its channel).
template <int W>
__device__ __forceinline__ void fill(float (&out)[W], float x) {
#pragma unroll
  for (int j = 0; j < W; ++j) out[j] = x;
}

// Loads W elements of a tensor shaped like the chain's value (a residual).
template <int W, typename P>
__device__ __forceinline__ void load_full(const P* __restrict__ p, long long e0, float (&out)[W]) {
  load_vec<P, W>(p + e0, out);
}

// ------------------------------------------------------------- activations
// Each matches PyTorch's CUDA kernel for the same op, NaN propagation included.

// A binary step's arithmetic. Eager runs each op as its own kernel and rounds its result
// to memory; a float32 chain (kFast false) rounds it alone too: add.rn / sub.rn / mul.rn,
// which neither nvcc nor ptxas fuses into an FMA with a neighbouring step. (Plain
// operators with the steps kept apart in PTX by an empty asm: on an H100, `gelu_tanh`,
// `* 1.5`, `- 0.25` differed from eager in 71,624 of 1,048,576 elements, the share that
// one rounding of x * 1.5 - 0.25 gives on those values.) 16-bit chains keep float32
// values where eager rounds to 16 bits anyway, and leave the compiler free.
template <bool kFast>
__device__ __forceinline__ float step_add(float a, float b) {
  if constexpr (kFast) return a + b;
  else return __fadd_rn(a, b);
}

template <bool kFast>
__device__ __forceinline__ float step_sub(float a, float b) {
  if constexpr (kFast) return a - b;
  else return __fsub_rn(a, b);
}

template <bool kFast>
__device__ __forceinline__ float step_mul(float a, float b) {
  if constexpr (kFast) return a * b;
  else return __fmul_rn(a, b);
}

// x where x > 0 or NaN, else +0 (a select, no branch: NaN <= 0 is false).
__device__ __forceinline__ float relu(float x) { return x <= 0.f ? 0.f : x; }

__device__ __forceinline__ float gelu(float x) {  // erf form, F.gelu's default
  return x * 0.5f * (1.f + erff(x * static_cast<float>(M_SQRT1_2)));
}

__device__ __forceinline__ float gelu_tanh(float x) {
  const float beta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
  const float kappa = 0.044715f;
  const float cube = x * x * x;  // as ATen: kappa times the cube, not ((kappa * x) * x) * x
  const float inner = beta * (x + kappa * cube);
  return 0.5f * x * (1.f + tanhf(inner));
}

__device__ __forceinline__ float leaky_relu(float x, float slope) { return x > 0.f ? x : x * slope; }

// 1 / (1 + e^-x) on the special-function unit: ex2.approx and rcp.approx (a few
// ulp). Unlike __expf, a power of two below 2^-126 flushes to 0 instead of taking
// __expf's subnormal path (three more instructions per element); 1 + e^-x cannot
// tell the two apart. A sum over 2^126 gives 0, as __fdividef does.
__device__ __forceinline__ float sigmoid_approx(float x) {
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.44269504088896341f));
  return __fdividef(1.f, 1.f + e);
}

// kFast: hardware exp and divide (a few ulp), for chains whose output is bf16/fp16,
// where rounding to 8 or 11 mantissa bits hides the difference. float32 chains use
// the IEEE forms, as eager does.
template <bool kFast>
__device__ __forceinline__ float sigmoid(float x) {
  if constexpr (kFast) return sigmoid_approx(x);
  else return 1.f / (1.f + expf(-x));
}

template <bool kFast>
__device__ __forceinline__ float silu(float x) {
  if constexpr (kFast) return x * sigmoid_approx(x);
  else return x / (1.f + expf(-x));
}

// a / b: IEEE, or for bf16/fp16 chains (kFast) PTX's div.full.f32 (at most 2 ulp over
// the full range, subnormal operands and results kept: not the reciprocal of
// __fdividef, which flushes subnormal divisors and gives 0 past 2^126), as Triton
// divides float32. The IEEE division branches to a slow path on every element.
template <bool kFast>
__device__ __forceinline__ float divide(float a, float b) {
  if constexpr (kFast) {
    float q;
    asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
    return q;
  } else {
    return a / b;
  }
}

// e^x: expf, or for bf16/fp16 chains (kFast) ex2.approx (__expf: a few ulp, a result
// below 2^-126 flushed to 0), as in sigmoid.
template <bool kFast>
__device__ __forceinline__ float exponential(float x) {
  if constexpr (kFast) return __expf(x);
  else return expf(x);
}

template <bool kFast>
__device__ __forceinline__ float mish(float x) { return x * tanhf(log1pf(exponential<kFast>(x))); }

// std::max / std::min as ATen's kernels use them: a NaN first operand comes through.
__device__ __forceinline__ float std_max(float a, float b) { return a < b ? b : a; }
__device__ __forceinline__ float std_min(float a, float b) { return b < a ? b : a; }

// As ATen's CUDA kernels compute them in every dtype: the clamp times RN(1/6) (a
// multiply, not a division by 6; tests/test_gpu.py compares float32 bit for bit).
__device__ __forceinline__ float hardswish(float x) { return x * std_min(std_max(x + 3.f, 0.f), 6.f) * (1.f / 6.f); }

__device__ __forceinline__ float hardsigmoid(float x) { return std_min(std_max(x + 3.f, 0.f), 6.f) * (1.f / 6.f); }

// clamp / hardtanh / clamp_min / clamp_max: NaN propagates; an absent bound is infinite.
__device__ __forceinline__ float clamp(float x, float lo, float hi) {
  return isnan(x) ? x : fminf(fmaxf(x, lo), hi);
}

// elu / selu / celu: negcoef = alpha * scale, poscoef = scale.
// Both sides are computed and one selected: a warp's lanes take both sides of a branch
// on mixed signs anyway, and without the branch a thread's elements interleave.
__device__ __forceinline__ float elu(float x, float negcoef, float poscoef, float input_scale) {
  const float negative = expm1f(x * input_scale) * negcoef;
  return x > 0.f ? x * poscoef : negative;
}

// Both sides computed, as in elu.
template <bool kFast>
__device__ __forceinline__ float softplus(float x, float beta, float threshold) {
  const float l = log1pf(exponential<kFast>(x * beta));
  const float smooth = beta == 1.f ? l : divide<kFast>(l, beta);  // (divide's asm does not fold)
  return x * beta > threshold ? x : smooth;
}

// torch.maximum / torch.minimum: NaN in either operand gives NaN.
__device__ __forceinline__ float maximum(float a, float b) {
  return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}
__device__ __forceinline__ float minimum(float a, float b) {
  return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fminf(a, b);
}

// -------------------------------------------------------------- reductions

// The row reductions (a row's one value): the apply kernel's (team_reduce.cuh) and the
// in-kernel GEMM's (gemm_row_reduce.cuh).
enum class RowReduce { kLogsumexp, kSum, kMean, kAmax, kAmin };

template <int kWidth>
__device__ __forceinline__ float team_sum_warp(float v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int kWidth>
__device__ __forceinline__ float team_max_warp(float v) {
#pragma unroll
  for (int o = kWidth / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over a whole block of kThreads (a multiple of 32); every thread gets the result.
template <int kThreads>
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  v = team_sum_warp<32>(v);
  __syncthreads();  // a previous call may still be reading `partial`
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = (threadIdx.x & 31) < kThreads / 32 ? partial[threadIdx.x & 31] : 0.f;
  return team_sum_warp<32>(r);
}

template <int kThreads>
__device__ __forceinline__ float block_max(float v) {
  __shared__ float partial[32];
  v = team_max_warp<32>(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = (threadIdx.x & 31) < kThreads / 32 ? partial[threadIdx.x & 31] : -INFINITY;
  return team_max_warp<32>(r);
}

// A team is kTeam consecutive lanes of one warp (kTeam <= 32), or the whole block.
template <int kTeam>
__device__ __forceinline__ float team_sum(float v) {
  if constexpr (kTeam > 32) return block_sum<kTeam>(v);
  else return team_sum_warp<kTeam>(v);
}

template <int kTeam>
__device__ __forceinline__ float team_max(float v) {
  if constexpr (kTeam > 32) return block_max<kTeam>(v);
  else return team_max_warp<kTeam>(v);
}

// The value `v` of the team's first thread, for every thread of the team.
template <int kTeam>
__device__ __forceinline__ float team_first(float v) {
  if constexpr (kTeam > 32) {
    __shared__ float first;
    __syncthreads();  // a previous call may still be reading `first`
    if (threadIdx.x == 0) first = v;
    __syncthreads();
    return first;
  } else {
    return __shfl_sync(0xffffffffu, v, 0, kTeam);
  }
}

// Chan et al.'s merge of two (count, mean, M2) summaries.
struct Moments {
  float n, mean, m2;
};

// An empty side returns the other as it is (not through delta * delta * 0, which is NaN
// when the mean is beyond 2^64).
__device__ __forceinline__ Moments merge(Moments a, Moments b) {
  if (a.n == 0.f) return b;
  if (b.n == 0.f) return a;
  const float n = a.n + b.n;
  const float delta = b.mean - a.mean;
  const float wb = b.n / n;
  return {n, a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb};
}

// The merge of a 256-thread block's moments, a tree in shared memory: the whole block's
// in thread 0 (the others' results are partial). Every thread of the block calls it.
__device__ __forceinline__ Moments block_merge(Moments m) {
  __shared__ Moments sm[256];
  sm[threadIdx.x] = m;
  __syncthreads();
  for (int o = 128; o > 0; o >>= 1) {
    if (threadIdx.x < o) sm[threadIdx.x] = merge(sm[threadIdx.x], sm[threadIdx.x + o]);
    __syncthreads();
  }
  return sm[threadIdx.x];
}

}  // namespace fusedepi
