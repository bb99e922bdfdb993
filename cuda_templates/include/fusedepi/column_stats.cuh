// BatchNorm (training) statistics after a Linear, or over a channels-last conv output read
// as a matrix of pixels x channels: partial (mean, M2) of each column over chunks of rows
// (column_stats), then their merge per column (column_final).
//
// Included by the rendered file (cuda_templates/templates.py, COLUMN_STATS_KERNELS)
// inside its anonymous namespace, after the file has defined what this code reads:
//   T, Args, kChannels, kYRow (KERNEL_FILE's constants); kColV, kColRows, kColStride,
//   kRowLanes, kLaneRows, kColsPerBlock,
//   kRowWarps, kRowsPerThread, kBatches, kRowStep, kRowsPerBatch, kPartials
//   (the column statistics' tiling, COLUMN_STATS_KERNELS).
// column_final's `finish` writes the normalize's scale/shift and the running stats
// (BATCH_NORM_FINISH).
// It is not a standalone header: those constants differ per file.
#pragma once

// The matrix's rows: the output's, or its pixels (kColRows a row).
__device__ __forceinline__ long long column_rows(const Args& a) { return a.rows * kColRows; }

// Blocks a column block of column_stats takes (its partials a column): one per kBatches
// batches of rows, each taking every gridDim.x-th batch. (At most two an SM over a
// conv's pixels, each looping over its share, measured slower on an H100 for bf16: 34
// against 26 us, 32 channels of 524,288 pixels; 33 against 35 for float32.)
__host__ __device__ __forceinline__ long long column_parts(long long rows) {
  const long long batches = (rows + kRowsPerBatch - 1) / kRowsPerBatch;
  return (batches + kBatches - 1) / kBatches;
}

// One block: kColsPerBlock columns (blockIdx.y) x the batches blockIdx.x, + gridDim.x, ...
// (a batch: kRowsPerBatch rows) -> (mean, M2, count) per column.
// A thread takes batches of 6 rows: the next batch's loads are issued before this
// batch's arithmetic (two batches in flight, kept as loaded), each batch is reduced in
// two passes over its loaded copy (mean, then the squares about it) and merged into the
// thread's moments (Chan et al.), as are the threads' moments after. (One pass of sums
// about the first row's value ran 10% faster but lost digits where that row lies far
// out in a skewed column, a ReLU's output for one.)
__device__ __forceinline__ void column_stats(const Args& a) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int sub = kLaneRows > 1 ? lane / kRowLanes : 0;  // row within the warp's kLaneRows
  const long long c0 = kLaneRows > 1 ? (lane % kRowLanes) * kColV : (long long)blockIdx.y * kColsPerBlock + lane * kColV;
  // Out-of-range rows and columns read a valid element (row rows-1, column 0) and
  // are left out of the sums: every load is unconditional, so they are all issued
  // at once and stage0's per-column operands are loaded once, not once per row.
  const bool col_ok = c0 < kChannels;
  const long long c = col_ok ? c0 : 0;
  const long long rows = column_rows(a);
  const long long batches = (rows + kRowsPerBatch - 1) / kRowsPerBatch;
  const long long lead = warp * kLaneRows + sub;  // this thread's first row of a batch; then + kRowStep t
  // Row t of batch g, or the last row for those past it (loaded, left out of the sums).
  const auto row_of = [&](long long g, int t) { return min(g * kRowsPerBatch + lead + (long long)t * kRowStep, rows - 1); };
  using Raw = fusedepi::Pack<T, kColV>;  // 16-bit values stay packed until used
  const auto load_batch = [&](long long g, Raw (&v)[kRowsPerThread]) {
#pragma unroll
    for (int t = 0; t < kRowsPerThread; ++t) v[t] = *reinterpret_cast<const Raw*>(a.y + row_of(g, t) * kColStride + c);
  };
  // A channels-last conv's columns are channels whose positions in the output's row are
  // kInner apart: stage0's per-channel operands are loaded once, by channel (its _cols form;
  // the planner leaves no operand read by element before the norm there).
  stage0_chan k[kColV];
  if constexpr (kColRows > 1) {
#pragma unroll
    for (int j = 0; j < kColV; ++j) k[j] = stage0_chan_of(a, static_cast<int>(c) + j);
  }
  float mean[kColV], m2[kColV], n = 0.f;  // this thread's rows so far, merged
#pragma unroll
  for (int j = 0; j < kColV; ++j) mean[j] = m2[j] = 0.f;
  // Batch g from its loaded copy `raw`, after issuing the loads of the block's next batch
  // into `next`.
  const auto batch = [&](long long g, const Raw (&raw)[kRowsPerThread], Raw (&next)[kRowsPerThread]) {
    if (g + gridDim.x < batches) load_batch(g + gridDim.x, next);
    // One row's values after stage0 (read again from the loaded copy for each pass).
    const auto values = [&](int t, float (&v)[kColV]) {
#pragma unroll
      for (int j = 0; j < kColV; ++j) v[j] = fusedepi::to_float(raw[t].v[j]);
      if constexpr (kColRows > 1) {
        stage0_cols<kColV>(v, k, 0, a);
      } else {
        stage0<kColV>(v, static_cast<int>(c), row_of(g, t) * kChannels + c, a);
      }
    };
    // The batch's rows below the matrix rows, two passes: its mean, then its M2.
    const long long r0 = g * kRowsPerBatch + lead;
    const int rows_b = static_cast<int>(
        max(0LL, min(static_cast<long long>(kRowsPerThread), (rows - r0 + kRowStep - 1) / kRowStep)));
    if (rows_b == 0) return;
    float bmean[kColV], q[kColV];
#pragma unroll
    for (int j = 0; j < kColV; ++j) bmean[j] = q[j] = 0.f;
    // Folds column j's values of the batch's live rows into r[j] by update(r[j], e, j).
    const auto fold = [&](float (&r)[kColV], auto update) {
#pragma unroll
      for (int t = 0; t < kRowsPerThread; ++t) {
        float v[kColV];
        values(t, v);
        if (t < rows_b) {
#pragma unroll
          for (int j = 0; j < kColV; ++j) r[j] = update(r[j], v[j], j);
        }
      }
    };
    fold(bmean, [](float r, float e, int) { return r + e; });
    const float nb = static_cast<float>(rows_b), inv_nb = 1.f / nb;
#pragma unroll
    for (int j = 0; j < kColV; ++j) bmean[j] *= inv_nb;
    fold(q, [&bmean](float r, float e, int j) { return fmaf(e - bmean[j], e - bmean[j], r); });
    // Chan et al.'s merge (fusedepi::merge), the counts shared by every column.
    const float total = n + nb, wb = nb / total;
#pragma unroll
    for (int j = 0; j < kColV; ++j) {
      const float delta = bmean[j] - mean[j];
      mean[j] += delta * wb;
      m2[j] += q[j] + delta * delta * n * wb;
    }
    n = total;
  };
  Raw raw0[kRowsPerThread], raw1[kRowsPerThread];  // this batch and the next, as loaded
  long long g = blockIdx.x;
  if (g < batches) load_batch(g, raw0);
  while (g < batches) {  // two batches an iteration: the buffers swap roles
    batch(g, raw0, raw1);
    g += gridDim.x;
    if (g >= batches) break;
    batch(g, raw1, raw0);
    g += gridDim.x;
  }
  fusedepi::Moments acc[kColV];
#pragma unroll
  for (int j = 0; j < kColV; ++j) acc[j] = {n, mean[j], m2[j]};
  __shared__ fusedepi::Moments sm[kRowWarps][32 * kColV];
#pragma unroll
  for (int j = 0; j < kColV; ++j) sm[warp][lane * kColV + j] = acc[j];
  __syncthreads();
  for (int col = threadIdx.x; col < kColsPerBlock; col += blockDim.x) {
    const long long c = (long long)blockIdx.y * kColsPerBlock + col;
    if (c >= kChannels) continue;
    fusedepi::Moments m = {0.f, 0.f, 0.f};  // merge(empty, b) is b
    for (int w = 0; w < kRowWarps; ++w)
      for (int s = 0; s < kLaneRows; ++s) m = fusedepi::merge(m, sm[w][s * kColsPerBlock + col]);
    float* part = a.ws + kPartials + ((long long)blockIdx.x * kChannels + c) * 3;
    part[0] = m.mean;
    part[1] = m.m2;
    part[2] = m.n;
  }
}

// Merges the `parts` partials of each column (column_parts): kFinalCols columns x
// kFinalRows lanes a block (a block a column when narrow, and over a conv's pixels:
// 1,365 partials 8 lanes a column took 47 us on an H100), then the lanes' moments in a
// tree; then finish(c, m) with column c's merged moments (the normalize scale/shift,
// the new running stats).
constexpr int kFinalCols = kLaneRows > 1 || kColRows > 1 ? 1 : 32;
constexpr int kFinalRows = 256 / kFinalCols;

template <class Finish>
__device__ __forceinline__ void column_final(const Args& a, long long parts, Finish finish) {
  const long long c = (long long)blockIdx.x * kFinalCols + threadIdx.x;
  fusedepi::Moments m = {0.f, 0.f, 0.f};
  if (c < kChannels) {
    for (long long t = threadIdx.y; t < parts; t += kFinalRows) {
      const float* part = a.ws + kPartials + (t * kChannels + c) * 3;
      m = fusedepi::merge(m, {part[2], part[0], part[1]});
    }
  }
  __shared__ fusedepi::Moments sm[kFinalRows][kFinalCols];
  sm[threadIdx.y][threadIdx.x] = m;
  __syncthreads();
#pragma unroll
  for (int s = kFinalRows / 2; s > 0; s /= 2) {
    if (threadIdx.y < s) sm[threadIdx.y][threadIdx.x] = fusedepi::merge(sm[threadIdx.y][threadIdx.x], sm[threadIdx.y + s][threadIdx.x]);
    __syncthreads();
  }
  if (threadIdx.y != 0 || c >= kChannels) return;
  finish(c, sm[0][threadIdx.x]);
}
