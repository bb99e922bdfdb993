// fusedepi's C++ launcher: the CUDA implementation of `fusedepi::chain` without Python
// in the call.
//
// Python (`fusion_backend/launch.py`, class Launcher) stays the one place that decides how
// a spec runs: it builds the kernel, then hands this file a plan (which path, which
// outputs, which kernel entry points) through `fusedepi_native::plan`. A call whose
// spec has no plan here, or whose rows the in-kernel GEMM rule has not yet been asked
// about (`fusedepi_native::plan_rows`), goes to the Python implementation
// (`fusedepi::chain_py`), which answers and registers what the next call needs. Loading
// the library defines the `fusedepi_native` ops; `fusedepi_native::install` then makes
// this file `fusedepi::chain`'s CUDA kernel.
//
// The per-call work mirrors Launcher.__call__ line for line: the anchor (library GEMM or
// conv) unless the kernel computes it, the outputs, the workspace, the pointer list, and
// the kernel file's `fusedepi_run` on the current stream. Built by fusion_backend/native.py
// (the C++ compiler with torch's paths), once per torch version.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace {

// The C entry points every rendered kernel file exports (cuda_templates/templates.py).
using RunFn = int (*)(void** pointers, long long rows, int device, void* stream);
using WorkspaceFn = long long (*)(long long rows);
using ErrorFn = const char* (*)(int code);
using PadRowsFn = int (*)(const void* x, void* xp, long long rows, long long k, int device, void* stream);

// How a spec's anchor is computed (Launcher: `gemm`, `anchor_inside`).
enum class Path : int64_t {
  kLibraryAnchor = 0,  // cuBLAS / cuDNN first, then the file's epilogue kernels on its output
  kGemm = 1,           // the in-kernel GEMM, or the library GEMM + the file's epilogue kernel
  kDirectConv = 2,     // the file computes the conv itself
  kImplicitConv = 3,   // the file computes the conv as an implicit GEMM on channels-last operands
};

enum class Anchor : int64_t { kAddmm = 0, kMm = 1, kConv = 2, kBmm = 3 };

// An extra output (lowering.spec.Save): the anchor output itself, converted, or a new tensor.
struct Save {
  bool anchor_value;  // the value after 0 steps: a view of y, converted to `dtype`
  at::ScalarType dtype;
  int64_t per_row;  // elements per anchor row; 0: a fixed shape
  // per_row: the batch-sized dim is -1 (the first, or the one a view moved the batch
  // into: InstanceNorm's statistics [1, N * C, 1, 1]), sized at run time
  std::vector<int64_t> shape;

  std::vector<int64_t> sized(int64_t rows) const {
    std::vector<int64_t> out = shape;
    if (per_row) {
      size_t batch_dim = 0;
      for (size_t i = 0; i < shape.size(); ++i)
        if (shape[i] == -1) { batch_dim = i; break; }
      int64_t rest = 1;
      for (size_t i = 0; i < shape.size(); ++i)
        if (i != batch_dim) rest *= shape[i];
      out[batch_dim] = rows * per_row / std::max<int64_t>(rest, 1);
    }
    return out;
  }
};

struct Plan {
  std::string spec;
  int64_t device = 0;
  std::string name;  // for error messages: the kernel's cache entry
  RunFn run = nullptr;
  WorkspaceFn workspace_floats = nullptr;
  ErrorFn error_string = nullptr;
  PadRowsFn pad_rows = nullptr;

  Path path = Path::kLibraryAnchor;
  Anchor anchor = Anchor::kAddmm;
  int64_t n_operands = 0;
  bool gemm_auto = false;  // kGemm: in-kernel per rows (asked of Python), else every call
  bool row_output = false;
  int64_t out_rank = 0;  // a reduced output's dims after the rows (its tail), up to 4
  // The tail, 0 past out_rank: a spatial reduction's [C, 1, ...], a pool's [C, *pooled], ...
  int64_t out_d0 = 0, out_d1 = 0, out_d2 = 0, out_d3 = 0;
  bool out_spatial = false;  // then y's spatial dims (a reduction over a conv's channels)
  int64_t channels = 0;
  int64_t out_h = 0, out_w = 0;  // kDirectConv's output plane
  bool stores_pre_norm = false;  // kDirectConv: y is a buffer beside the output

  bool has_bias = false;  // a library conv's bias operand
  int64_t pad_k = 0, pad_n = 0;  // a padded library GEMM's K and N (Anchor.pad), else 0
  bool channels_last = false;  // a library conv on channels-last operands (Anchor.channels_last)
  bool permuted = false;  // a library conv whose output is read as [N x spatial, C] rows (Anchor.permuted)
  bool gemm_tf32 = false;  // kGemm in float32: the GEMM in the kernel only while matmuls may use TF32
  bool reads_conv_tf32 = false;  // a float32 conv the file may compute: a plan for each cuDNN TF32 flag
  bool conv_tf32 = false;  // ... this one for the flag on
  // kImplicitConv: x [rows, in_c, in_h, in_w] and the weight [channels, in_c, k_h, k_w],
  // read as [channels, k_h, k_w, in_c_pad] (zeros past in_c).
  int64_t in_c = 0, in_h = 0, in_w = 0, k_h = 0, k_w = 0, in_c_pad = 0;
  // The call's first two inputs are x and the weight rounded to TF32, its last two
  // themselves (Anchor.rounded): kImplicitConv reads the first, any other path the last.
  bool rounded = false;
  bool in_nchw = false;  // kImplicitConv reads x in its NCHW layout, not channels-last
  // A Conv1d computed as the 2-D conv of one row (Anchor.as_2d; x and the weight reach the op
  // as [N, C, 1, L] and [O, C, 1, k] views): the output is the graph's [rows, channels, L_out],
  // the same bytes as the plane of one row (the library conv's squeezed, the kernels' so allocated).
  bool one_row = false;
  // kImplicitConv of a 3-D conv: x [rows, in_c, in_d, in_h, in_w], the weight [channels, in_c,
  // k_d, k_h, k_w] (read as [channels, k_d, k_h, k_w, in_c_pad]), the output [rows, channels,
  // out_d, out_h, out_w]; 0 for a 2-D conv.
  int64_t in_d = 0, k_d = 0, out_d = 0;
  // kImplicitConv: the elements between two pixels of the channels-last x it reads (in_c
  // to whole 16 bytes: launch.padded_pixels; in_c where x is read NCHW).
  int64_t in_pitch = 0;
  int64_t alpha = 0;  // a baddbmm's alpha: a double's bits (native.alpha_bits; double_of)
  std::vector<int64_t> stride, padding, dilation, output_padding;
  bool transposed = false;
  int64_t groups = 1;

  // What every call's inputs must be before a kernel reads them (native._checks).
  at::ScalarType dtype = at::kFloat;
  int64_t y_row = 0;  // elements of a row of the anchor output as the kernels read it
  std::vector<std::pair<int64_t, int64_t>> anchor_sizes;  // (a row, whole) of operands kernels read
  struct Param {
    at::ScalarType dtype;
    // elements: `whole`, or `per_group` for every `group` rows of the anchor output (a
    // row's worth a row: group 1; lowering/spec.py, operand_numel)
    int64_t whole, per_group, group;
    bool fits(int64_t numel, int64_t rows) const {
      return whole ? numel == whole : rows % group == 0 && numel == per_group * (rows / group);
    }
  };
  std::vector<Param> params;

  std::vector<int64_t> running_stats;  // BatchNorm (training): indices into the params
  std::vector<Save> saves;
  std::unordered_map<int64_t, bool> in_kernel_rows;  // kGemm with gemm_auto: Python's answers
};

// Plans by the hash of their spec; a bucket holds one plan per (spec, device), or per
// (spec, device, cuDNN TF32 flag) where the spec's kernel file follows that flag.
std::shared_mutex plans_mutex;
std::unordered_map<size_t, std::vector<std::shared_ptr<Plan>>> plans;

// The TF32 settings as eager reads them at every call, through the getters Python's
// launcher reads (fusion_backend/ops.py: matmul_allows_tf32, conv_allows_tf32); nullopt
// where torch refuses to answer (the legacy and the newer precision API mixed), and
// Python's launcher, which knows the newer API's answer, runs the call.
std::optional<bool> matmul_allows_tf32() {
  try {
    return at::globalContext().float32MatmulPrecision() != at::Float32MatmulPrecision::HIGHEST;
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

std::optional<bool> conv_allows_tf32() {
  try {
    return at::globalContext().allowTF32CuDNN();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

// The plan of (spec, device); of the variant for cuDNN's TF32 flag as it is now, where the
// spec follows it (read once, and only then); null where there is none, or where the flag
// cannot be read.
std::shared_ptr<Plan> find_locked(std::string_view spec, int64_t device) {
  auto bucket = plans.find(std::hash<std::string_view>{}(spec));
  if (bucket == plans.end()) return nullptr;
  std::optional<bool> flag;
  bool flag_read = false;
  for (const auto& plan : bucket->second) {
    if (plan->device != device || plan->spec != spec) continue;
    if (!plan->reads_conv_tf32) return plan;
    if (!flag_read) {
      flag = conv_allows_tf32();
      flag_read = true;
    }
    if (!flag) return nullptr;
    if (plan->conv_tf32 == *flag) return plan;
  }
  return nullptr;
}

// A save's dtype as fusion_backend/native.py numbers it (DTYPE_CODES).
at::ScalarType dtype_of(int64_t code) {
  switch (code) {
    case 0: return at::kFloat;
    case 1: return at::kHalf;
    case 2: return at::kBFloat16;
    case 3: return at::kDouble;
  }
  TORCH_CHECK(false, "fusedepi_native: unknown dtype code ", code);
}

template <typename T>
T symbol(void* handle, const char* name, const std::string& library) {
  void* found = dlsym(handle, name);
  TORCH_CHECK(found != nullptr, "fusedepi_native: ", library, " has no ", name);
  return reinterpret_cast<T>(found);
}

// layout: [path, anchor, n_operands, gemm_auto, row_output, out_rank, out_d0 .. out_d3,
//          out_spatial, channels, out_h, out_w, stores_pre_norm, has_bias, pad_k, pad_n,
//          channels_last, permuted, gemm_tf32, reads_conv_tf32, conv_tf32,
//          in_c, in_h, in_w, k_h, k_w, in_c_pad, rounded, in_nchw, one_row, in_d, k_d, out_d, in_pitch,
//          alpha]
// conv: empty, or [nd, stride x nd, padding x nd, dilation x nd, transposed,
//       output_padding x nd, groups]
// saves: per save [anchor_value, dtype code, per_row, ndim, dims x ndim] (native.SaveLayout).
// checks: [dtype code, y_row, n, (a row, whole) x n, m, (dtype code, whole, per_group, group) x m]
//         (native.CheckLayout).
// The fields of native.LaunchLayout, read below in its order (plan->field = layout[i]).
constexpr size_t kLayoutFields = 37;

void set_plan(std::string_view spec, int64_t device, std::string_view library, std::string_view name,
              at::IntArrayRef layout, at::IntArrayRef running_stats, at::IntArrayRef conv,
              at::IntArrayRef saves, at::IntArrayRef checks) {
  TORCH_CHECK(layout.size() == kLayoutFields, "fusedepi_native.plan: layout has ", layout.size(), " entries, not ",
              kLayoutFields);
  auto plan = std::make_shared<Plan>();
  plan->spec = std::string(spec);
  plan->device = device;
  plan->name = std::string(name);
  const std::string path(library);
  // The library is already loaded (ctypes): this takes a reference that is never dropped,
  // so the entry points stay valid for the life of the process.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  TORCH_CHECK(handle != nullptr, "fusedepi_native: cannot load ", path, ": ", dlerror());
  plan->run = symbol<RunFn>(handle, "fusedepi_run", path);
  plan->workspace_floats = symbol<WorkspaceFn>(handle, "fusedepi_workspace_floats", path);
  plan->error_string = symbol<ErrorFn>(handle, "fusedepi_error_string", path);
  plan->pad_rows = symbol<PadRowsFn>(handle, "fusedepi_pad_rows", path);

  plan->path = static_cast<Path>(layout[0]);
  plan->anchor = static_cast<Anchor>(layout[1]);
  plan->n_operands = layout[2];
  plan->gemm_auto = layout[3] != 0;
  plan->row_output = layout[4] != 0;
  plan->out_rank = layout[5];
  plan->out_d0 = layout[6];
  plan->out_d1 = layout[7];
  plan->out_d2 = layout[8];
  plan->out_d3 = layout[9];
  plan->out_spatial = layout[10] != 0;
  plan->channels = layout[11];
  plan->out_h = layout[12];
  plan->out_w = layout[13];
  plan->stores_pre_norm = layout[14] != 0;
  plan->has_bias = layout[15] != 0;
  plan->pad_k = layout[16];
  plan->pad_n = layout[17];
  plan->channels_last = layout[18] != 0;
  plan->permuted = layout[19] != 0;
  plan->gemm_tf32 = layout[20] != 0;
  plan->reads_conv_tf32 = layout[21] != 0;
  plan->conv_tf32 = layout[22] != 0;
  plan->in_c = layout[23];
  plan->in_h = layout[24];
  plan->in_w = layout[25];
  plan->k_h = layout[26];
  plan->k_w = layout[27];
  plan->in_c_pad = layout[28];
  plan->rounded = layout[29] != 0;
  plan->in_nchw = layout[30] != 0;
  plan->one_row = layout[31] != 0;
  plan->in_d = layout[32];
  plan->k_d = layout[33];
  plan->out_d = layout[34];
  plan->in_pitch = layout[35];
  plan->alpha = layout[36];
  TORCH_CHECK(plan->out_rank >= 0 && plan->out_rank <= 4, "fusedepi_native.plan: a reduced output's tail of ",
              plan->out_rank, " dims");
  TORCH_CHECK(layout[0] >= 0 && layout[0] <= 3 && layout[1] >= 0 && layout[1] <= 3,
              "fusedepi_native.plan: bad path or anchor in the layout");
  TORCH_CHECK((plan->pad_k == 0) == (plan->pad_n == 0) &&
                  (plan->pad_k == 0 || (plan->path == Path::kLibraryAnchor && plan->anchor != Anchor::kConv)),
              "fusedepi_native.plan: padding is for a library GEMM, and needs both K and N");
  plan->running_stats.assign(running_stats.begin(), running_stats.end());

  if (!conv.empty()) {
    const int64_t nd = conv[0];
    TORCH_CHECK(static_cast<int64_t>(conv.size()) == 4 * nd + 3, "fusedepi_native.plan: conv has ",
                conv.size(), " entries for ", nd, " dims");
    auto take = [&](int64_t at) { return std::vector<int64_t>(conv.begin() + at, conv.begin() + at + nd); };
    plan->stride = take(1);
    plan->padding = take(1 + nd);
    plan->dilation = take(1 + 2 * nd);
    plan->transposed = conv[1 + 3 * nd] != 0;
    plan->output_padding = take(2 + 3 * nd);
    plan->groups = conv[2 + 4 * nd];
  }
  TORCH_CHECK(plan->anchor != Anchor::kConv || plan->path != Path::kLibraryAnchor || !conv.empty(),
              "fusedepi_native.plan: a library conv needs its parameters");
  TORCH_CHECK(!plan->channels_last || (plan->anchor == Anchor::kConv && plan->path == Path::kLibraryAnchor &&
                                       (conv[0] == 2 || conv[0] == 3)),
              "fusedepi_native.plan: channels-last is for a 2-D or 3-D library conv");
  TORCH_CHECK(!plan->permuted || (plan->anchor == Anchor::kConv && plan->path == Path::kLibraryAnchor &&
                                  !plan->channels_last),
              "fusedepi_native.plan: a permuted output is a library conv's");
  TORCH_CHECK(!plan->gemm_tf32 || plan->path == Path::kGemm, "fusedepi_native.plan: gemm_tf32 is an in-kernel GEMM's");
  TORCH_CHECK(plan->path != Path::kImplicitConv ||
                  (plan->anchor == Anchor::kConv && !plan->has_bias && plan->in_c > 0 && plan->in_h > 0 &&
                   plan->in_w > 0 && plan->k_h > 0 && plan->k_w > 0 && plan->in_c_pad >= plan->in_c &&
                   plan->in_pitch >= plan->in_c && (!plan->in_nchw || plan->in_pitch == plan->in_c) &&
                   plan->out_h > 0 && plan->out_w > 0 && plan->n_operands == 2),
              "fusedepi_native.plan: the in-kernel conv needs its input's and weight's shapes");
  TORCH_CHECK((plan->in_d == 0 && plan->k_d == 0 && plan->out_d == 0) ||
                  (plan->path == Path::kImplicitConv && plan->in_d > 0 && plan->k_d > 0 && plan->out_d > 0 &&
                   !plan->in_nchw && !plan->one_row),
              "fusedepi_native.plan: a depth is a 3-D in-kernel conv's");
  TORCH_CHECK(!plan->one_row || (plan->anchor == Anchor::kConv && !plan->channels_last && !plan->permuted &&
                                 (plan->path == Path::kLibraryAnchor || plan->out_h == 1)),
              "fusedepi_native.plan: a conv of one row is a conv's in the graph's layout, its output one row high");
  TORCH_CHECK((!plan->reads_conv_tf32 || plan->anchor == Anchor::kConv) && (plan->reads_conv_tf32 || !plan->conv_tf32),
              "fusedepi_native.plan: a TF32 variant is a conv's");
  TORCH_CHECK(!plan->rounded || (plan->anchor == Anchor::kConv && plan->reads_conv_tf32 && plan->n_operands == 2),
              "fusedepi_native.plan: operands rounded to TF32 are a float32 conv's x and weight");

  for (size_t at = 0; at < saves.size();) {
    TORCH_CHECK(at + 4 <= saves.size(), "fusedepi_native.plan: a save is cut short");
    Save save;
    save.anchor_value = saves[at] != 0;
    save.dtype = dtype_of(saves[at + 1]);
    save.per_row = saves[at + 2];
    const int64_t ndim = saves[at + 3];
    TORCH_CHECK(ndim >= (save.per_row ? 1 : 0) && at + 4 + ndim <= saves.size(),
                "fusedepi_native.plan: a save is cut short");
    save.shape.assign(saves.begin() + at + 4, saves.begin() + at + 4 + ndim);
    plan->saves.push_back(std::move(save));
    at += 4 + ndim;
  }

  TORCH_CHECK(checks.size() >= 4, "fusedepi_native.plan: checks are cut short");
  plan->dtype = dtype_of(checks[0]);
  plan->y_row = checks[1];
  size_t at = 3;
  for (int64_t i = 0; i < checks[2]; ++i, at += 2) {
    TORCH_CHECK(at + 2 <= checks.size(), "fusedepi_native.plan: checks are cut short");
    plan->anchor_sizes.emplace_back(checks[at], checks[at + 1]);
  }
  TORCH_CHECK(at < checks.size(), "fusedepi_native.plan: checks are cut short");
  const int64_t n_params = checks[at++];
  for (int64_t i = 0; i < n_params; ++i, at += 4) {
    TORCH_CHECK(at + 4 <= checks.size(), "fusedepi_native.plan: checks are cut short");
    TORCH_CHECK(checks[at + 3] >= 1, "fusedepi_native.plan: an operand's group of rows is ", checks[at + 3]);
    plan->params.push_back({dtype_of(checks[at]), checks[at + 1], checks[at + 2], checks[at + 3]});
  }

  std::unique_lock lock(plans_mutex);
  auto& bucket = plans[std::hash<std::string_view>{}(spec)];
  for (auto& existing : bucket) {
    if (existing->device == device && existing->spec == spec && existing->conv_tf32 == plan->conv_tf32) {
      plan->in_kernel_rows = existing->in_kernel_rows;
      existing = plan;
      return;
    }
  }
  bucket.push_back(plan);
}

// A spec without a plan (dropped by `forget` meanwhile) keeps asking Python: nothing to do.
void set_rows(std::string_view spec, int64_t device, int64_t rows, bool in_kernel) {
  std::unique_lock lock(plans_mutex);
  auto plan = find_locked(spec, device);
  if (plan) plan->in_kernel_rows[rows] = in_kernel;
}

void forget() {
  std::unique_lock lock(plans_mutex);
  plans.clear();
}

int64_t plan_count() {
  std::shared_lock lock(plans_mutex);
  int64_t count = 0;
  for (const auto& bucket : plans) count += static_cast<int64_t>(bucket.second.size());
  return count;
}

// Contiguous and 32-byte aligned: the kernels read operands as whole vectors.
at::Tensor aligned(const at::Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 32 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// A reducing chain's output: [rows], then its tail (the channels of a spatial reduction or
// a pool, the kept dims of 1, a pool's pooled sizes), then the spatial dims of `spatial_of`
// (y: a reduction over a conv's channels).
std::vector<int64_t> row_shape(const Plan& plan, int64_t rows, at::IntArrayRef spatial_of = {}) {
  std::vector<int64_t> shape{rows};
  const int64_t tail[4] = {plan.out_d0, plan.out_d1, plan.out_d2, plan.out_d3};
  shape.insert(shape.end(), tail, tail + plan.out_rank);
  if (plan.out_spatial && spatial_of.size() > 2) shape.insert(shape.end(), spatial_of.begin() + 2, spatial_of.end());
  return shape;
}

// The direct or in-kernel conv's output as the graph has it: [rows, channels, out_h, out_w],
// or a Conv1d's [rows, channels, out_w] (one_row).
std::vector<int64_t> conv_output_shape(const Plan& plan, int64_t rows) {
  if (plan.one_row) return {rows, plan.channels, plan.out_w};
  if (plan.out_d > 0) return {rows, plan.channels, plan.out_d, plan.out_h, plan.out_w};
  return {rows, plan.channels, plan.out_h, plan.out_w};
}

// Raises with the kernel file's message when one of its entry points returned an error.
void check_code(const Plan& plan, int code, const char* what) {
  if (code == 0) return;
  const char* message = plan.error_string(code);
  TORCH_CHECK(false, "fusedepi kernel ", plan.name, " ", what, ": ", message ? message : "unknown error");
}

// ops.padded_gemm: x[M, K] @ w^T on operands padded with zeros to K = pad_k and
// N = pad_n; y[M, pad_n], whose first N columns are the product.
at::Tensor padded_gemm(const Plan& plan, const std::vector<at::Tensor>& operands) {
  const at::Tensor& x = operands[operands.size() - 2];
  const at::Tensor& wt = operands.back();
  const int64_t m = x.size(0), k = x.size(1), n = wt.size(1);
  at::Tensor xp = x;
  if (plan.pad_k != k) {  // the kernel file's pad kernel: x's rows and the zeros, one pass
    xp = at::empty({m, plan.pad_k}, x.options());
    const at::Tensor xc = x.contiguous();
    const auto device = static_cast<c10::DeviceIndex>(plan.device);
    const int code = plan.pad_rows(xc.data_ptr(), xp.data_ptr(), m, k, static_cast<int>(plan.device),
                                   c10::cuda::getCurrentCUDAStream(device).stream());
    check_code(plan, code, "failed to pad x");
  }
  at::Tensor wp = at::zeros({plan.pad_n, plan.pad_k}, wt.options());
  wp.narrow(0, 0, n).narrow(1, 0, k).copy_(wt.t());
  if (plan.anchor == Anchor::kMm) return at::mm(xp, wp.t());
  at::Tensor bp = at::zeros({plan.pad_n}, operands[0].options());
  bp.narrow(0, 0, n).copy_(operands[0]);
  return at::addmm(bp, xp, wp.t());
}

// A double from the 64 bits a layout entry carries (native.alpha_bits).
double double_of(int64_t bits) {
  double value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// The channels-last memory format of a 2-D or 3-D conv's input x.
at::MemoryFormat channels_last_format(const at::Tensor& x) {
  return x.dim() == 5 ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::ChannelsLast;
}

// The anchor op exactly as the graph had it (ops.run_anchor), as the epilogue kernels
// read it: in padded rows if padded, in channels-last memory if channels-last, as
// [N x spatial, C] rows if permuted (a view of a 2-D or 3-D conv's channels-last output).
at::Tensor run_anchor(const Plan& plan, const std::vector<at::Tensor>& operands) {
  if (plan.pad_k) return padded_gemm(plan, operands);
  switch (plan.anchor) {
    case Anchor::kAddmm:
      return at::addmm(operands[0], operands[1], operands[2]);
    case Anchor::kMm:
      return at::mm(operands[0], operands[1]);
    case Anchor::kBmm:  // a baddbmm: input + alpha * (b1 @ b2), rounded once
      if (plan.has_bias) return at::baddbmm(operands[2], operands[0], operands[1], 1, double_of(plan.alpha));
      return at::bmm(operands[0], operands[1]);
    case Anchor::kConv:
      break;
  }
  std::optional<at::Tensor> bias;
  if (plan.has_bias) bias = operands[2];
  if (plan.permuted) {
    at::Tensor x = operands[0], w = operands[1];
    if (x.dim() == 4 || x.dim() == 5) {
      const at::MemoryFormat layout = channels_last_format(x);
      x = x.contiguous(layout);
      w = w.contiguous(layout);
    }
    const at::Tensor y = at::convolution(x, w, bias, plan.stride, plan.padding, plan.dilation, plan.transposed,
                                         plan.output_padding, plan.groups);
    return y.movedim(1, -1).reshape({-1, y.size(1)});
  }
  if (plan.channels_last) {
    const at::MemoryFormat layout = channels_last_format(operands[0]);
    return at::convolution(operands[0].contiguous(layout), operands[1].contiguous(layout), bias, plan.stride,
                           plan.padding, plan.dilation, plan.transposed, plan.output_padding, plan.groups)
        .contiguous(layout);
  }
  const at::Tensor y = at::convolution(operands[0], operands[1], bias, plan.stride, plan.padding, plan.dilation,
                                       plan.transposed, plan.output_padding, plan.groups);
  return plan.one_row ? y.squeeze(2) : y;  // a Conv1d's [N, C, L_out], as ops.run_anchor gives it
}

// Whether the inputs are what the kernels were built for: every input on the plan's GPU,
// the anchor's operands in the chain's dtype (and, where a kernel computes the anchor,
// of the sizes it was built for), every other operand of its dtype and size. A call
// that does not fit goes to Python's launcher, whose checks (fusion_backend/launch.py,
// check_*) raise an error that names the operand.
bool inputs_fit(const Plan& plan, at::TensorList inputs) {
  const size_t n = static_cast<size_t>(plan.n_operands);
  if (inputs.size() != n + plan.params.size()) return false;
  for (const auto& t : inputs)
    if (!t.is_cuda() || t.device().index() != plan.device) return false;
  // x's rows (conv: images; bmm: mat1's batch)
  const int64_t rows = inputs[plan.anchor == Anchor::kConv || plan.anchor == Anchor::kBmm ? 0 : n - 2].size(0);
  for (size_t i = 0; i < n; ++i) {
    if (inputs[i].scalar_type() != plan.dtype) return false;
    if (!plan.anchor_sizes.empty()) {
      const auto [a_row, whole] = plan.anchor_sizes[i];
      if (inputs[i].numel() != (a_row ? a_row * rows : whole)) return false;
    }
  }
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const Plan::Param& want = plan.params[i];
    const at::Tensor& t = inputs[n + i];
    if (t.scalar_type() != want.dtype) return false;
    // (a permuted conv's rows are its output's pixels: `launch` checks those once y is known)
    if ((want.whole || !plan.permuted) && !want.fits(t.numel(), rows)) return false;
  }
  return true;
}

// Whether the library's anchor output holds the rows of y_row elements the kernels read.
bool anchor_output_fits(const Plan& plan, const at::Tensor& y, int64_t rows) {
  return y.numel() == rows * plan.y_row && y.scalar_type() == plan.dtype;
}

std::vector<at::Tensor> python_chain(at::TensorList inputs, c10::string_view spec);

// As launch.padded_pixels: x [rows, C, *spatial] channels-last with its pixels `pitch`
// elements apart (a view of a fresh [rows, *spatial, pitch] buffer), x's values copied in,
// the channels from C to `pitch` not written; x itself where it is so already.
at::Tensor padded_pixels(const at::Tensor& x, int64_t pitch) {
  const int64_t n = x.dim();
  std::vector<int64_t> sizes{x.size(0)}, strides(n), perm{0, n - 1};
  for (int64_t d = 2; d < n; ++d) sizes.push_back(x.size(d));
  sizes.push_back(pitch);
  for (int64_t d = 1; d < n - 1; ++d) perm.push_back(d);
  int64_t step = pitch;
  for (int64_t d = n - 1; d >= 2; --d) strides[d] = step, step *= x.size(d);
  strides[0] = step;
  strides[1] = 1;
  if (x.strides() == at::IntArrayRef(strides) && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0) return x;
  at::Tensor padded = at::empty(sizes, x.options()).narrow(n - 1, 0, x.size(1)).permute(perm);
  padded.copy_(x);
  return padded;
}

// Runs a call whose inputs fit (inputs_fit).
// `call` is the op's inputs as given, which a call that does not fit hands to Python;
// `inputs` those the plan's path reads (they differ for a rounded plan: chain_cuda).
std::vector<at::Tensor> launch(const Plan& plan, at::TensorList call, at::TensorList inputs, bool in_kernel) {
  const int64_t n = plan.n_operands;
  std::vector<at::Tensor> operands(inputs.begin(), inputs.begin() + n);
  std::vector<at::Tensor> params;
  params.reserve(inputs.size() - n);
  for (size_t i = n; i < inputs.size(); ++i) params.push_back(aligned(inputs[i]));

  const bool library_gemm = plan.path == Path::kGemm && !in_kernel;
  at::Tensor y, out;
  if (in_kernel) {
    // x, and the weight w[N, K] that mat2 = w^T transposes, as the bulk copies read them.
    operands.back() = operands.back().t();
    for (auto& t : operands) t = aligned(t);
    const at::Tensor& x = operands[n - 2];
    const int64_t rows = x.size(0);
    out = y = plan.row_output ? at::empty(row_shape(plan, rows), x.options())
                              : at::empty({rows, plan.channels}, x.options());
  } else if (plan.path == Path::kImplicitConv) {
    // As launch.channels_last_operands: x channels-last (in_nchw: contiguous), the weight
    // as [C_out, kh, kw, C_in'] with zeros past C_in, each 16-byte aligned; the shapes the
    // file was built for.
    // A 3-D conv's (in_d > 0): x [rows, in_c, in_d, in_h, in_w] channels-last, the weight as
    // [C_out, k_d, kh, kw, C_in'].
    const at::Tensor& x0 = operands[0];
    const at::Tensor& w0 = operands[1];
    const bool depth = plan.in_d > 0;
    std::vector<int64_t> x_row{plan.in_c}, w_shape{plan.channels, plan.in_c};
    if (depth) x_row.push_back(plan.in_d), w_shape.push_back(plan.k_d);
    x_row.insert(x_row.end(), {plan.in_h, plan.in_w});
    w_shape.insert(w_shape.end(), {plan.k_h, plan.k_w});
    if (x0.dim() != static_cast<int64_t>(x_row.size()) + 1 || x0.sizes().slice(1) != at::IntArrayRef(x_row) ||
        w0.sizes() != at::IntArrayRef(w_shape)) {
      return python_chain(call, plan.spec);  // which raises, naming the shapes
    }
    const at::MemoryFormat x_layout = plan.in_nchw ? at::MemoryFormat::Contiguous
                                      : depth      ? at::MemoryFormat::ChannelsLast3d
                                                   : at::MemoryFormat::ChannelsLast;
    at::Tensor x;
    if (plan.in_pitch != plan.in_c) {
      x = padded_pixels(x0, plan.in_pitch);
    } else {
      x = x0.contiguous(x_layout);
      if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 16) x = x.clone(x_layout);
    }
    std::vector<int64_t> channels_last{0};  // the weight's dims, C_in last
    for (int64_t d = 2; d < w0.dim(); ++d) channels_last.push_back(d);
    channels_last.push_back(1);
    at::Tensor w;
    if (plan.in_c_pad == plan.in_c) {
      w = w0.permute(channels_last).contiguous();
      if (reinterpret_cast<uintptr_t>(w.data_ptr()) % 16) w = w.clone();
    } else {
      std::vector<int64_t> padded(w_shape.begin(), w_shape.end());
      padded.erase(padded.begin() + 1);
      padded.push_back(plan.in_c_pad);
      w = at::zeros(padded, w0.options());
      w.narrow(w0.dim() - 1, 0, plan.in_c).copy_(w0.permute(channels_last));
    }
    operands = {x, w};
    // A reduction or a pool in the tiles (ConvGemmPlan.reduce, .pixel_reduce, .pool) writes its output only
    // (a reduction over each pixel's channels keeps the output's spatial dims).
    const std::vector<int64_t> conv_out = conv_output_shape(plan, x.size(0));
    out = y = plan.row_output ? at::empty(row_shape(plan, x.size(0), conv_out), x.options())
                              : at::empty(conv_out, x.options());
  } else if (plan.path == Path::kDirectConv) {
    for (auto& t : operands) t = aligned(t);
    const at::Tensor& x = operands[0];
    out = at::empty(conv_output_shape(plan, x.size(0)), x.options());
    y = plan.stores_pre_norm ? at::empty_like(out) : out;
  } else {
    // A channels-last conv's y stays channels-last; the kernel writes the output contiguous.
    y = run_anchor(plan, operands);
    if (!plan.channels_last) y = y.contiguous();
    if (plan.row_output) {
      out = at::empty(row_shape(plan, y.size(0), y.sizes()), y.options());
    } else if (plan.pad_k) {
      out = at::empty({y.size(0), plan.channels}, y.options());
    } else {
      out = at::empty(y.sizes(), y.options());
    }
  }
  const int64_t rows = y.size(0);
  if ((plan.path == Path::kLibraryAnchor || library_gemm) && !anchor_output_fits(plan, y, rows)) {
    return python_chain(call, plan.spec);  // which raises, naming what the anchor gave
  }
  if (plan.permuted) {  // the operands of a row's worth each, now that the rows are known
    for (size_t i = 0; i < plan.params.size(); ++i) {
      const Plan::Param& want = plan.params[i];
      if (!want.fits(params[i].numel(), rows)) return python_chain(call, plan.spec);
    }
  }

  std::vector<at::Tensor> result;
  result.reserve(1 + plan.running_stats.size() + plan.saves.size());
  result.push_back(out);
  for (int64_t i : plan.running_stats) result.push_back(at::empty_like(params.at(i)));
  for (const Save& save : plan.saves) {
    const std::vector<int64_t> shape = save.sized(rows);
    result.push_back(save.anchor_value ? y.view(shape).to(save.dtype)
                                       : at::empty(shape, y.options().dtype(save.dtype)));
  }
  // Pointwise chains need no workspace, nor does the epilogue kernel of an in-kernel GEMM
  // file (the workspace its library asks for holds the in-kernel GEMM's row partials).
  const long long ws_floats = plan.workspace_floats(rows);
  at::Tensor ws;
  if (ws_floats > 0 && !library_gemm) ws = at::empty({ws_floats}, y.options().dtype(at::kFloat));

  std::vector<void*> pointers;
  pointers.reserve(3 + result.size() + params.size() + operands.size());
  pointers.push_back(y.data_ptr());
  for (const auto& t : result) pointers.push_back(t.data_ptr());
  for (const auto& t : params) pointers.push_back(t.data_ptr());
  pointers.push_back(ws.defined() ? ws.data_ptr() : nullptr);
  if (library_gemm) {  // null operands: the file runs its epilogue kernel on y
    pointers.insert(pointers.end(), operands.size(), nullptr);
  } else if (plan.path != Path::kLibraryAnchor) {
    for (const auto& t : operands) pointers.push_back(t.data_ptr());
  }
  const auto device = static_cast<c10::DeviceIndex>(plan.device);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  const int code = plan.run(pointers.data(), rows, static_cast<int>(plan.device), stream);
  check_code(plan, code, "failed");
  return result;
}

std::vector<at::Tensor> python_chain(at::TensorList inputs, c10::string_view spec) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("fusedepi::chain_py", "")
                       .typed<std::vector<at::Tensor>(at::TensorList, c10::string_view)>();
  return op.call(inputs, spec);
}

std::vector<at::Tensor> chain_cuda(at::TensorList inputs, c10::string_view spec) {
  TORCH_CHECK(!inputs.empty(), "fusedepi::chain: no inputs");
  const std::string_view key(spec.data(), spec.size());
  std::shared_ptr<Plan> plan;
  bool in_kernel = false;
  std::vector<at::Tensor> picked;  // a rounded plan's inputs as its path reads them
  at::TensorList use = inputs;
  {
    std::shared_lock lock(plans_mutex);
    plan = find_locked(key, inputs[0].device().index());
    if (plan && plan->rounded) {
      // As ops.anchor_inputs: the rounded x and weight for the in-kernel conv, else x and
      // the weight themselves from the end in their place.
      const size_t n = static_cast<size_t>(plan->n_operands);
      if (inputs.size() < n + 2) {
        plan = nullptr;  // Python's launcher raises for it
      } else if (plan->path == Path::kImplicitConv) {
        use = inputs.slice(0, inputs.size() - 2);
      } else {
        picked.assign(inputs.end() - 2, inputs.end());
        picked.insert(picked.end(), inputs.begin() + 2, inputs.end() - 2);
        use = picked;
      }
    }
    if (plan && !inputs_fit(*plan, use)) plan = nullptr;  // Python's checks raise for it
    if (plan && plan->path == Path::kGemm) {
      // As Launcher.in_kernel_gemm: a float32 file computes the GEMM in TF32 only while
      // matmuls may use TF32; else the library GEMM, whatever the rows.
      const std::optional<bool> tf32 = plan->gemm_tf32 ? matmul_allows_tf32() : std::optional<bool>(true);
      in_kernel = tf32.value_or(false);
      if (!tf32) {
        plan = nullptr;  // the setting cannot be read here: Python's launcher can
      } else if (in_kernel && plan->gemm_auto) {
        const at::Tensor& x = inputs[plan->n_operands - 2];
        auto known = plan->in_kernel_rows.find(x.size(0));
        if (known == plan->in_kernel_rows.end()) {
          plan = nullptr;  // Python's rule answers for these rows
        } else {
          in_kernel = known->second;
        }
      }
    }
  }
  if (!plan) return python_chain(inputs, spec);
  return launch(*plan, inputs, use, in_kernel);
}

// `fusedepi::chain`'s CUDA kernel, registered when Python asks (`install`), not when the
// library loads: Python first takes its own kernel back, and loading may happen long
// before (a build) or fail without leaving the op without a CUDA kernel.
std::unique_ptr<torch::Library> chain_kernel;
std::mutex chain_kernel_mutex;

void install() {
  std::lock_guard lock(chain_kernel_mutex);
  if (chain_kernel) return;
  auto library = std::make_unique<torch::Library>(torch::Library::IMPL, "fusedepi", c10::DispatchKey::CUDA,
                                                  __FILE__, __LINE__);
  library->impl("chain", TORCH_FN(chain_cuda));
  chain_kernel = std::move(library);
}

}  // namespace

TORCH_LIBRARY(fusedepi_native, m) {
  m.def(
      "plan(str spec, int device, str library, str name, int[] layout, int[] running_stats, int[] conv, "
      "int[] saves, int[] checks) -> ()",
      [](c10::string_view spec, int64_t device, c10::string_view library, c10::string_view name,
         at::IntArrayRef layout, at::IntArrayRef running_stats, at::IntArrayRef conv, at::IntArrayRef saves,
         at::IntArrayRef checks) {
        set_plan(std::string_view(spec.data(), spec.size()), device,
                 std::string_view(library.data(), library.size()), std::string_view(name.data(), name.size()),
                 layout, running_stats, conv, saves, checks);
      });
  m.def("plan_rows(str spec, int device, int rows, bool in_kernel) -> ()",
        [](c10::string_view spec, int64_t device, int64_t rows, bool in_kernel) {
          set_rows(std::string_view(spec.data(), spec.size()), device, rows, in_kernel);
        });
  m.def("install() -> ()", &install);
  // Raises as `plan` does on bad arguments, so that the build can check that this
  // library's errors reach Python (fusion_backend/native.py, _errors_reach_python).
  m.def("raises(str what, int[] sizes) -> ()", [](c10::string_view what, at::IntArrayRef sizes) {
    TORCH_CHECK(sizes.size() == 14, "fusedepi_native: a test error: ", std::string(what.data(), what.size()),
                " has ", sizes.size(), " entries, not 14");
  });
  m.def("forget() -> ()", &forget);
  m.def("plan_count() -> int", &plan_count);
}
