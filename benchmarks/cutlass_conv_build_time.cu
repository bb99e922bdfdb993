// The in-kernel conv's dependency decision (README "In-kernel conv"): one CUTLASS 3.x sm_90
// implicit-GEMM conv fprop (bf16 NHWC, float32 accumulation, a ReLU epilogue; 128 x 128 x 64
// tile, CUTLASS's collective builders), instantiated to time its cold build against the
// in-kernel conv's rendered file. Not built or run by the project. With the `nvidia-cutlass`
// wheel (4.2.0.0) unpacked at $W:
//   I=$W/cutlass_library/source/include
//   time nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I $I --expt-relaxed-constexpr \
//     -Xcompiler -fPIC -shared benchmarks/cutlass_conv_build_time.cu -o /tmp/cutlass_conv.so
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/conv/convolution.h"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/activation.h"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cute/tensor.hpp"
#include "cutlass/device_kernel.h"

using namespace cute;
using T = cutlass::bfloat16_t;
constexpr auto kOp = cutlass::conv::Operator::kFprop;
using TileShape_ = Shape<_128, _128, Shape<_64>>;
using Cluster = Shape<_1, _1, _1>;
using Fusion = cutlass::epilogue::fusion::LinCombEltAct<cutlass::epilogue::thread::ReLu, T, float, T, float>;
using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape_, Cluster,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float,
    T, cutlass::layout::TensorNHWC, 8, T, cutlass::layout::TensorNHWC, 8,
    cutlass::epilogue::TmaWarpSpecialized, Fusion>::CollectiveOp;
using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, kOp,
    T, cutlass::layout::TensorNHWC, 8, T, cutlass::layout::TensorNHWC, 8, float, TileShape_, Cluster,
    cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
    cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
using Problem = cutlass::conv::ConvProblemShape<kOp, 2>;
using Kernel = cutlass::conv::kernel::ConvUniversal<Problem, Mainloop, Epilogue>;
using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;

// The kernel instantiated (its address taken): what a build compiles. Not run here.
extern "C" const void* conv_kernel() {
  return reinterpret_cast<const void*>(&cutlass::device_kernel<Kernel>);
}
