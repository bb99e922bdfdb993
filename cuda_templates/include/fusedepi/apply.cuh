// The apply kernels' shared device code: where a thread's segment lies, the staging of
// channels-last images, the loads and stage0 of a segment.
//
// Included by every rendered file with an apply kernel (cuda_templates/templates.py, KERNEL_FILE)
// inside its anonymous namespace, after the file has defined what this code reads:
//   T                     the element type;
//   kBlock, kTeam, kV, kNV, kL, kChunks, kChunkLen, kGroups, kChannels, kInner, kYRow,
//   kRow, kWrap, kPadK, kStaged, kStagedApply, kStage0Done, kBlockPerSegment
//                         the launch plan's constants (their meaning is at KERNEL_FILE);
//   Args                  the kernel arguments (y, out, ws, rows and the chain's operands);
//   stage0, stage0_chan, stage0_chan_of, stage0_cols
//                         the rendered steps before the chain's reduction (STAGE_FUNCTION).
// It is not a standalone header: the launch plan's constants differ per file.
#pragma once

// Which segment and which part of it this thread works on.
struct Place {
  long long seg;  // segment index over the whole tensor
  int first;      // offset of this team's part within the segment
  int rowpos;     // offset of the segment within its row
  int lane;
  bool live;
  long long at;   // the segment whose operands this thread reads: seg, or the last one when not live
};

__device__ __forceinline__ Place place(const Args& a) {
  Place p;
  if constexpr (kBlockPerSegment) {
    p.seg = blockIdx.x / kChunks;
    p.first = static_cast<int>((blockIdx.x % kChunks) * kChunkLen);
    p.lane = threadIdx.x;
  } else {
    p.seg = (long long)blockIdx.x * (kBlock / kTeam) + threadIdx.x / kTeam;
    p.first = 0;
    p.lane = threadIdx.x % kTeam;
  }
  p.live = kBlockPerSegment || p.seg < a.rows * kGroups;  // a block a segment: the grid has no spare blocks
  p.at = p.live ? p.seg : a.rows * kGroups - 1;
  p.rowpos = static_cast<int>((p.at % kGroups) * kL);
  return p;
}

// Where segment `seg` starts in y.
__device__ __forceinline__ long long y_start(long long seg) {
  if constexpr (kYRow == kGroups * kL) {
    return seg * kL;
  } else {
    return (seg / kGroups) * kYRow + (seg % kGroups) * kL;
  }
}

__device__ __forceinline__ int offset_of(const Place& p, int k) { return p.first + (k * kTeam + p.lane) * kV; }

// A channels-last y: copies this block's kStaged images into `img` in the output's
// order ([channels, inner] an image), then syncs the block. y is read in 16-byte
// vectors where an image is a whole number of them, all of a thread's loads in flight
// before the first store. The last block may have fewer images.
// kStagedApply: stage0 runs here, on y's channels-last vectors. A thread's vectors all
// start at the same channel (kBlock * kStageVec is a multiple of kChannels), so it
// loads its channels' operands once (and derives BatchNorm's rsqrt once) instead of
// per element, where the output's odd planes put two channels in a vector (two loads
// and a select an element per operand). `img` then holds the chain's result.
constexpr int kStageVec = (kRow * sizeof(T)) % 16 == 0 ? 16 / static_cast<int>(sizeof(T)) : 1;
constexpr int kStageLoads = kStaged > 0 ? (kStaged * kRow / kStageVec + kBlock - 1) / kBlock : 1;
static_assert(!kStagedApply || (kStaged > 0 && (kBlock * kStageVec) % kChannels == 0),
              "staging applies stage0 only where a thread's vectors share their channels");
// Staging waits on memory before any arithmetic: a staged apply kernel keeps at least
// 1024 threads an SM (registers capped to suit), so that other blocks' loads fill the wait.
constexpr int kMinBlocks = kStaged > 0 ? 1024 / kBlock : 1;

__device__ __forceinline__ void stage_images(const Args& a, T* img) {
  const long long first = (long long)blockIdx.x * kStaged;
  const int count = static_cast<int>((a.rows - first < kStaged ? a.rows - first : kStaged) * kRow);
  const T* src = a.y + first * kRow;
  fusedepi::Pack<T, kStageVec> pk[kStageLoads];
#pragma unroll
  for (int t = 0; t < kStageLoads; ++t) {
    const int i = (t * kBlock + static_cast<int>(threadIdx.x)) * kStageVec;
    if (i < count) pk[t] = *reinterpret_cast<const fusedepi::Pack<T, kStageVec>*>(src + i);
  }
  // kStagedApply: the operands of this thread's channels (element j's channel is that of
  // its first element plus j, modulo the channels)
  stage0_chan k[kStageVec];  // (unused, and dropped, unless kStagedApply)
  if constexpr (kStagedApply) {
    const int c0 = static_cast<int>((threadIdx.x * kStageVec) % kChannels);
#pragma unroll
    for (int j = 0; j < kStageVec; ++j) k[j] = stage0_chan_of(a, static_cast<int>((c0 + j) % kChannels));
  }
#pragma unroll
  for (int t = 0; t < kStageLoads; ++t) {
    const int i = (t * kBlock + static_cast<int>(threadIdx.x)) * kStageVec;
    if (i >= count) continue;
    if constexpr (kStagedApply) {
      float v[kStageVec];
#pragma unroll
      for (int j = 0; j < kStageVec; ++j) v[j] = fusedepi::to_float(pk[t].v[j]);
      stage0_cols<kStageVec>(v, k, 0, a);  // e0 unused: no full-tensor operand, no saves
#pragma unroll
      for (int j = 0; j < kStageVec; ++j) pk[t].v[j] = fusedepi::from_float<T>(v[j]);
    }
    // (image, pixel, channel) of y's element i, then stepped along the vector
    int image = i / static_cast<int>(kRow);
    const int at = i - image * static_cast<int>(kRow);
    int pixel = at / static_cast<int>(kChannels);
    int c = at - pixel * static_cast<int>(kChannels);
#pragma unroll
    for (int j = 0; j < kStageVec; ++j) {
      img[image * kRow + c * kInner + pixel] = pk[t].v[j];
      if (++c == kChannels) {
        c = 0;
        if (++pixel == kInner) pixel = 0, ++image;
      }
    }
  }
  __syncthreads();
}

// Where segment p.seg starts: in y, or in the block's staged images.
__device__ __forceinline__ const T* seg_source(const Args& a, const Place& p, const T* img) {
  if constexpr (kStaged > 0) {
    return img + (p.seg - (long long)blockIdx.x * kStaged * kGroups) * kL;
  } else {
    return a.y + y_start(p.seg);
  }
}

// A segment that fills its team's slots exactly: no slot is past its end.
constexpr bool kExactFit = kChunks == 1 && kChunkLen == kL;

__device__ __forceinline__ bool valid(const Place& p, int k) { return p.live && (kExactFit || offset_of(p, k) < kL); }

// kDense: a team's slots are nearly all (7/8) inside its segment. Then every slot runs
// the steps, dead ones on zeros and with operands read at a live position
// (`safe_offset`, Place::at), and only live slots are stored or folded: no branch
// around each slot's steps (an odd row's 127 elements in 128 slots branched around
// every element). With more dead slots the branches cost less than the dead slots'
// steps (a log_softmax over 4100 in 5120 slots: 871 us dense, 783 not).
constexpr bool kDense = kChunks == 1 && 8 * kL >= 7 * kChunkLen;

__device__ __forceinline__ bool runs(const Place& p, int k) { return kDense || valid(p, k); }

// Where slot k reads its operands: its own offset, or the segment's last vector.
__device__ __forceinline__ int safe_offset(const Place& p, int k) {
  const int o = offset_of(p, k);
  return o < kL ? o : static_cast<int>(kL) - kV;
}

// Loads this thread's share of the segment and applies stage0; masked lanes hold 0.
// All loads are issued before any arithmetic, so they are in flight together.
// src: where the segment starts (seg_source). save: this kernel writes the values
// stage0 saves (one kernel of those that run it).
__device__ __forceinline__ void load_stage0(const Args& a, const Place& p, const T* src, float (&v)[kNV][kV],
                                            bool save) {
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    if (valid(p, k)) {
      fusedepi::load_vec<T, kV>(src + offset_of(p, k), v[k]);
    } else {
#pragma unroll
      for (int j = 0; j < kV; ++j) v[k][j] = 0.f;
    }
  }
  if constexpr (!kStage0Done && !kStagedApply) {
#pragma unroll
    for (int k = 0; k < kNV; ++k)
      if (runs(p, k))
        stage0<kV>(v[k], p.rowpos + safe_offset(p, k), p.at * kL + safe_offset(p, k), a, save && valid(p, k));
  }
}

// The apply kernel of a pointwise chain whose rows do not split into whole 16-byte
// vectors over busy lanes (odd or narrow rows; not a padded GEMM's y): y and the
// output taken as one flat array, kNV vectors of kV elements a thread, consecutive
// threads on consecutive vectors (kBlock a block). A vector may cross rows (kWrap: each
// element's channel from its own position); the tensor's last vector may be partial.
__device__ __forceinline__ void flat_apply(const Args& a) {
  const long long total = a.rows * kRow;
  const long long first = ((long long)blockIdx.x * kNV * kBlock + threadIdx.x) * kV;
  float v[kNV][kV];
  int pos[kNV];  // each vector's position in its row
#pragma unroll
  for (int k = 0; k < kNV; ++k) {  // every load in flight before any arithmetic
    const long long e = first + (long long)k * kBlock * kV;
    pos[k] = static_cast<int>(e % kRow);
    if (e + kV <= total) {
      fusedepi::load_vec<T, kV>(a.y + e, v[k]);
    } else {  // the tensor's last vector, element by element
#pragma unroll
      for (int j = 0; j < kV; ++j) v[k][j] = e + j < total ? fusedepi::to_float(a.y[e + j]) : 0.f;
    }
  }
#pragma unroll
  for (int k = 0; k < kNV; ++k) {
    const long long e = first + (long long)k * kBlock * kV;
    if (e + kV <= total) {
      if constexpr (!kStage0Done) stage0<kV>(v[k], pos[k], e, a, true);
      fusedepi::store_vec<T, kV>(a.out + e, v[k]);
    } else {
      for (int j = 0; j < kV && e + j < total; ++j) {  // the tensor's last, partial vector
        float one[1] = {v[k][j]};
        if constexpr (!kStage0Done) stage0<1>(one, static_cast<int>((pos[k] + j) % kRow), e + j, a, true);
        fusedepi::store_vec<T, 1>(a.out + e + j, one);
      }
    }
  }
}
