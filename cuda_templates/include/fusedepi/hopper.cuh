// Hopper (sm_90a) building blocks of the in-kernel GEMM and conv (cuda_templates/gemm_sm90.py, conv_sm90.py):
// mbarriers, named barriers, bulk tensor copies (TMA) in both directions, shared-memory
// matrix descriptors for wgmma, and pairs of output values (16-bit packing, or two
// floats). Host side: tensor-map encoding through the driver entry point the runtime
// hands out (no -lcuda at link time).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace fusedepi {
namespace sm90 {

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------ mbarriers

__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
// Makes the initializations visible to the bulk copy engine before its first arrival.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// Arrives, and expects `bytes` more of bulk-copy transactions before the phase completes.
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// ------------------------------------------------------------- named barriers
// Id 0 is __syncthreads'. bar.arrive does not wait; the shared-memory writes before it
// are visible to the threads that complete the barrier by bar.sync.

template <int kId, int kThreads>
__device__ __forceinline__ void named_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
// The same with the id known at run time only (one barrier a consumer warpgroup).
template <int kThreads>
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kId, int kThreads>
__device__ __forceinline__ void named_arrive() {
  asm volatile("bar.arrive %0, %1;" ::"n"(kId), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "n"(kThreads) : "memory");
}

// ------------------------------------------------------------- shared memory

__device__ __forceinline__ uint4 lds128(const void* p) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem_u32(p))
               : "memory");
  return v;
}
__device__ __forceinline__ void sts128(void* p, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(smem_u32(p)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// st.shared of 4 bytes: nvcc cannot see the state space through an aligned pointer's arithmetic.
__device__ __forceinline__ void sts32(void* p, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(smem_u32(p)), "r"(v) : "memory");
}
__device__ __forceinline__ void sts64(void* p, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(smem_u32(p)), "f"(a), "f"(b) : "memory");
}
// The generic proxy's shared-memory writes, then the bulk copy's reads.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// --------------------------------------------------------------- bulk copies

// A box of global memory into shared memory (in the map's swizzle); its bytes complete on `bar`.
// Elements outside the tensor read as zero, and count towards the bytes all the same.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}
// The same for a 4-D map (coordinates innermost first; negative ones and ones past the
// tensor's end read zeros too: the implicit-GEMM conv's padding).
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], "
      "[%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}
// A box of shared memory to global memory, in this thread's bulk group; elements outside
// the tensor are not written.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, const void* src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_u32(src)), "r"(c0), "r"(c1)
               : "memory");
}
// `bytes` (a multiple of 16) of shared memory to global memory, both 16-byte aligned, in
// this thread's bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's bulk stores have read their shared memory (it may be written again).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// ... and are complete.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// ------------------------------------------------------------------- wgmma

// Shared-memory matrix descriptor: K-major rows of kBytes (32, 64 or 128) in the swizzle of
// that width, 8-row atoms 8 * kBytes apart (the layout a tensor map of that swizzle writes;
// the tile aligned to 8 * kBytes). Mode bits 62-63: 1 = 128-byte, 2 = 64-byte, 3 = 32-byte.
template <int kBytes>
__device__ __forceinline__ uint64_t desc_sw(const void* p) {
  static_assert(kBytes == 32 || kBytes == 64 || kBytes == 128, "a swizzle of 32, 64 or 128 bytes");
  constexpr uint64_t kMode = kBytes == 128 ? 1 : kBytes == 64 ? 2 : 3;
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(8 * kBytes / 16) << 32) | (kMode << 62);
}
// Shared-memory matrix descriptor of a 16-bit operand MN-major in the 128-byte swizzle:
// rows of 64 MN elements (128 bytes), one a K index, in 8-row atoms of 1 KB (the layout a
// tensor map of that swizzle writes from a box whose inner dim is 64 MN elements). The
// stride from 8 K rows to the next (SBO) is 1 KB; an m64 operand spans one atom along MN,
// so the offset between MN atoms (LBO) is not read (1).
__device__ __forceinline__ uint64_t desc_mn128(const void* p) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 / 16) << 32) | (1ull << 62);
}
// Shared-memory matrix descriptor, K-major with no swizzle: core matrices of 8 rows of 16
// bytes, each row 16 bytes after the last (the layout a tensor map without swizzle writes
// from a box whose inner dim is 16 bytes); `sbo` bytes from one 8-row group to the next
// along M, `lbo` bytes from one 16-byte column of K to the next (multiples of 16). Mode
// bits 62-63: 0.
__device__ __forceinline__ uint64_t desc_nosw(const void* p, unsigned lbo, unsigned sbo) {
  const uint64_t addr = smem_u32(p);
  return ((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32);
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Called right after wgmma_wait<0>: keeps every read of the accumulators after the wait.
// Each is written in place (+ -0.0, the identity; NaN stays NaN), a write ptxas keeps
// after the wait as the wgmma writes the same register, and later reads depend on it.
// (Without it ptxas moved a float16 conv file's packing of its last accumulators to half
// above the wait, reading partial sums. An empty asm with the registers as operands, as
// CUTLASS's operand fence, binds nvcc's front end only: the PTX had them in order.)
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("add.f32 %0, %0, 0f80000000;" : "+f"(d[i])::"memory");
}

// Registers a thread of this warpgroup may hold from here on (warp-specialized kernels
// give the producer's few and the consumers' many; the sum must fit the SM's file).
template <int kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ------------------------------------------------------------- 16-bit pairs

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
  }
}
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// ------------------------------------------------------ pairs of output values
// A thread's accumulators come in pairs of adjacent columns; T is the output type.

// Two adjacent T values from global memory (the bias), widened.
template <typename T>
__device__ __forceinline__ float2 load_pair(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return *reinterpret_cast<const float2*>(p);
  } else {
    return unpack2<T>(*reinterpret_cast<const uint32_t*>(p));
  }
}
// (a, b) rounded to T and widened again: the value the library GEMM's output holds.
template <typename T>
__device__ __forceinline__ float2 round_pair(float a, float b) {
  if constexpr (std::is_same_v<T, float>) {
    return make_float2(a, b);
  } else {
    return unpack2<T>(pack2<T>(a, b));
  }
}
// (a, b) as T into shared memory: 4 bytes (16-bit T) or 8.
template <typename T>
__device__ __forceinline__ void sts_pair(void* p, float a, float b) {
  if constexpr (std::is_same_v<T, float>) {
    sts64(p, a, b);
  } else {
    sts32(p, pack2<T>(a, b));
  }
}

// ------------------------------------------------------------------- host

// A tensor map of `rank` dims over T (bf16, fp16 or float32): dims and boxes innermost
// first, strides[i] the bytes between steps of dim i + 1 (multiples of 16), the box's
// inner dim `swizzle` bytes (32, 64 or 128: the swizzle's row, as desc_sw<swizzle> reads it;
// 0: no swizzle, the box's inner dim 16 bytes, rows as desc_nosw reads them);
// `steps`, where given, each dim's element stride (TMA reads every steps[i]-th element of a
// box of box[i], steps[0] = 1), else 1.
// Returns a cudaError_t value.
template <typename T>
inline int encode_map(CUtensorMap* map, const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                      const cuuint32_t* box, int swizzle = 128, const cuuint32_t* steps = nullptr) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult found;
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      return static_cast<int>(cudaErrorNotSupported);
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  static_assert(sizeof(T) == 2 || std::is_same_v<T, float>, "bf16, fp16 or float32");
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same_v<T, float>    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                               : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  if (swizzle != 0 && swizzle != 32 && swizzle != 64 && swizzle != 128) return static_cast<int>(cudaErrorInvalidValue);
  const CUtensorMapSwizzle mode = swizzle == 128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                  : swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                  : swizzle == 32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                  : CU_TENSOR_MAP_SWIZZLE_NONE;
  const CUresult r = encode(map, type, rank, const_cast<void*>(base), dims, strides, box, steps != nullptr ? steps : ones,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, mode,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : static_cast<int>(cudaErrorInvalidValue);
}

// A 2-D tensor map over a row-major [rows, cols] matrix of T, boxes of box_rows x box_cols
// (box_cols * sizeof(T) == swizzle bytes).
template <typename T>
inline int encode_map_2d(CUtensorMap* map, const void* base, long long rows, long long cols, int box_rows,
                         int box_cols, int swizzle = 128) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * sizeof(T)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  return encode_map<T>(map, base, 2, dims, strides, box, swizzle);
}

}  // namespace sm90
}  // namespace fusedepi
