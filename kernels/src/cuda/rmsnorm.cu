// RMSNorm forward (optionally fused with the residual add before it) and backward (optionally
// fused with the residual stream's gradient), Qwen2 / Llama: y = x * rstd * weight.
//
// Forward: one thread block per row; each thread keeps kChunks 16-byte chunks of the row in
// registers (chunk c = threadIdx.x + i * blockDim.x), so a row is read from memory once. Blocks
// of ~128 threads (4 chunks a thread at d = 3584) without the residual: more rows resident per
// multiprocessor than with ~256, hence more bytes in flight. With the residual (two rows of
// registers a thread) ~256 threads stay better. Numbers in kernels/PERF.md.
// Backward: a grid of resident blocks, each looping over rows; a thread always owns the same
// columns, so d_weight is summed over rows in its registers, written as one fp32 partial row per
// block into the scratch, and a second kernel adds the column sums of the partials into d_weight
// in a fixed order: deterministic, no atomics. The final norm's backward (once a chunk, no
// d_add) skips that second kernel: RmsNormBackwardIntoPartials adds to partial rows the caller
// keeps across the step's chunks, and RmsNormAddPartials sums them once a step (kernels/PERF.md).
// Rows of at most 512 16-byte chunks (hidden <= 4096) take the pipelined variant, which streams
// the next row into shared memory with cp.async and takes one barrier a row; wider rows prefetch
// the next row into registers (or, past 8 elements a thread, not at all).
// At t = 4096, d = 3584 the backward's row kernel runs within 4% of an elementwise kernel moving
// the same streams: the layout is at the memory bound, and the variants tried (kernels/PERF.md)
// were slower.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ops_util.cuh"

namespace ctxplan::kernels::cuda {
namespace {

using detail::BlockSum;
using detail::CeilDiv;
using detail::IsAligned;
using detail::LoadVec;
using detail::RoundBf16;
using detail::StoreVec;

constexpr const char* kForwardName = "RmsNormForward";
constexpr const char* kBackwardName = "RmsNormBackward";
constexpr int kMaxThreads = 1024;
constexpr int kForwardTargetThreads = 128;
constexpr int kResidualForwardTargetThreads = 256;
constexpr int kBackwardTargetThreads = 512;
// Row elements one thread keeps in registers: at most 16 (the widest row is 16 * 1024 = 16384
// wide in the forward, 16 * 512 = 8192 in the backward, which keeps ~5 floats per element), and
// 32 in the forward without the residual (4 16-byte chunks: its 128-thread blocks), whose blocks
// of more than 16 elements a thread then have at most 256 threads (up to 255 registers).
constexpr int kMaxElementsPerThread = 16;
constexpr int kForwardMaxElementsPerThread = 32;
constexpr int ForwardMaxThreads(int elements) {
  return elements > kMaxElementsPerThread ? 256 : kMaxThreads;
}
// The backward keeps ~7 floats per element (x, dy for this row and the next, d_add, weight,
// d_weight): at most 512 threads a block (128 registers).
constexpr int BackwardMaxThreads(int) {
  return 512;
}
// Rows of at most 8 elements per thread (hidden <= 4096 vectorised) fit 64 registers: two blocks
// of up to 512 threads per multiprocessor.
constexpr int BackwardMinBlocks(int elements) {
  return elements <= 8 ? 2 : 1;
}
constexpr int kMaxBackwardBlocks = kRmsNormMaxPartialRows;  // one fp32 scratch row per block
constexpr int kColumnSumTile = 32;
static_assert(kMaxThreads % detail::kWarpSize == 0);

// --- forward -----------------------------------------------------------------------------------
// grid: t blocks.
template <int kVec, int kChunks, bool kResidual>
__global__ void __launch_bounds__(ForwardMaxThreads(kVec* kChunks))
    RmsNormForwardKernel(const bf16* residual, const bf16* x, const bf16* __restrict__ weight,
                         int64_t hidden, float eps, bf16* h, bf16* __restrict__ y,
                         float* __restrict__ rstd) {
  __shared__ float shared[detail::kWarpSize];
  detail::GridDependencyWaitAndTrigger();
  const int chunks = static_cast<int>(hidden / kVec);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * hidden;
  float v[kChunks][kVec];
  float r[kChunks][kVec];
  // All loads first (h may alias residual, so no store may sit between them).
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < chunks) {
      LoadVec<kVec>(x + base + c * kVec, v[i]);
      if constexpr (kResidual) LoadVec<kVec>(residual + base + c * kVec, r[i]);
    }
  }
  float sum_sq = 0.0f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < chunks) {
      if constexpr (kResidual) {
        // The stored h is what the backward will see: normalise the rounded value.
#pragma unroll
        for (int e = 0; e < kVec; ++e) v[i][e] = RoundBf16(r[i][e] + v[i][e]);
        StoreVec<kVec>(h + base + c * kVec, v[i]);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) sum_sq = fmaf(v[i][e], v[i][e], sum_sq);
    }
  }
  const float total = BlockSum(sum_sq, shared);
  const float rs = rsqrtf(total / static_cast<float>(hidden) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < chunks) {
      float w[kVec];
      LoadVec<kVec>(weight + c * kVec, w);
      float out[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) out[e] = v[i][e] * rs * w[e];
      StoreVec<kVec>(y + base + c * kVec, out);
    }
  }
}

// --- backward ----------------------------------------------------------------------------------
// grid: min(t, resident blocks) blocks, each looping over rows blockIdx.x + k * gridDim.x.
// partial [gridDim.x][d] fp32: this block's sum over its rows of dy * x * rstd.
// kPrefetch (rows of at most 8 elements per thread): the next row's x and dy are loaded before
// the current row's reduction, so the loads of one row overlap the barriers of the previous.
template <int kVec, int kChunks, bool kAdd>
__global__ void __launch_bounds__(BackwardMaxThreads(kVec* kChunks),
                                  BackwardMinBlocks(kVec* kChunks))
    RmsNormBackwardKernel(const bf16* __restrict__ x, const bf16* __restrict__ weight,
                          const float* __restrict__ rstd, const bf16* __restrict__ dy,
                          const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx,
                          float* __restrict__ partial, bool add_to_partial) {
  constexpr bool kPrefetch = kVec * kChunks <= 8;
  __shared__ float shared[detail::kWarpSize];
  detail::GridDependencyWaitAndTrigger();
  const int chunks = static_cast<int>(hidden / kVec);
  float* my_partial = partial + static_cast<int64_t>(blockIdx.x) * hidden;
  float dw[kChunks][kVec];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (add_to_partial && c < chunks) {
      LoadVec<kVec>(my_partial + c * kVec, dw[i]);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) dw[i][e] = 0.0f;
    }
  }
  auto load_row = [&](int64_t row, float(&xv)[kChunks][kVec], float(&g)[kChunks][kVec]) {
    const int64_t base = row * hidden;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < chunks) {
        LoadVec<kVec>(x + base + c * kVec, xv[i]);
        LoadVec<kVec>(dy + base + c * kVec, g[i]);
      }
    }
  };
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  float xv[kChunks][kVec], g[kChunks][kVec];
  if constexpr (kPrefetch) {
    if (blockIdx.x < tokens) load_row(blockIdx.x, xv, g);
  }
  for (int64_t row = blockIdx.x; row < tokens; row += gridDim.x) {
    const int64_t base = row * hidden;
    float next_x[kChunks][kVec], next_g[kChunks][kVec];
    if constexpr (kPrefetch) {
      if (row + gridDim.x < tokens) load_row(row + gridDim.x, next_x, next_g);
    } else {
      load_row(row, xv, g);
    }
    float add[kChunks][kVec];
    if constexpr (kAdd) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < chunks) LoadVec<kVec>(d_add + base + c * kVec, add[i]);
      }
    }
    const float rs = rstd[row];
    float w[kChunks][kVec];  // re-read each row: 2 d bytes, L1-resident
    float dot = 0.0f;        // sum of dy * w * x over the row
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < chunks) {
        LoadVec<kVec>(weight + c * kVec, w[i]);
#pragma unroll
        for (int e = 0; e < kVec; ++e) dot = fmaf(g[i][e] * w[i][e], xv[i][e], dot);
      }
    }
    const float total = BlockSum(dot, shared);
    const float coupling = rs * rs * rs * total * inv_hidden;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = threadIdx.x + i * blockDim.x;
      if (c < chunks) {
        float out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          out[e] = rs * g[i][e] * w[i][e] - coupling * xv[i][e];
          if constexpr (kAdd) out[e] += add[i][e];
          dw[i][e] = fmaf(g[i][e], xv[i][e] * rs, dw[i][e]);
        }
        StoreVec<kVec>(dx + base + c * kVec, out);
      }
    }
    if constexpr (kPrefetch) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          xv[i][e] = next_x[i][e];
          g[i][e] = next_g[i][e];
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = threadIdx.x + i * blockDim.x;
    if (c < chunks) StoreVec<kVec>(my_partial + c * kVec, dw[i]);
  }
}

// --- backward, pipelined (16-byte rows of at most one chunk per thread: hidden <= 4096) --------
// The same computation; each thread streams ITS OWN chunks of the next kStages - 1 rows (x, dy,
// d_add) into shared memory with cp.async, so two rows are in flight per block without holding
// registers, and no barrier guards the staging buffers (a thread only ever reads back what it
// copied itself; cp.async.wait_group orders that).
constexpr int kStages = 2;
constexpr int kPipelinedMaxThreads = 512;

__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Dynamic shared memory: [kStages][arrays][blockDim.x] 16-byte chunks (arrays: x, dy, d_add).
// One barrier a row: the row sums of consecutive rows go to alternating halves of row_sums
// (BlockSumAlternating), so no second barrier guards their reuse.
template <bool kAdd>
__global__ void __launch_bounds__(kPipelinedMaxThreads, 2)
    RmsNormBackwardPipelinedKernel(const bf16* __restrict__ x, const bf16* __restrict__ weight,
                                   const float* __restrict__ rstd, const bf16* __restrict__ dy,
                                   const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx,
                                   float* __restrict__ partial, bool add_to_partial) {
  constexpr int kVec = 8;
  constexpr int kArrays = kAdd ? 3 : 2;
  extern __shared__ uint4 staged[];
  __shared__ float row_sums[2][detail::kWarpSize];
  detail::GridDependencyWaitAndTrigger();
  const int chunks = static_cast<int>(hidden / kVec);
  const int c = threadIdx.x;  // this thread's chunk of every row
  const bool active = c < chunks;
  auto slot = [&](int stage, int array) {
    return staged + (stage * kArrays + array) * blockDim.x + threadIdx.x;
  };
  auto issue = [&](int64_t row, int stage) {
    if (active && row < tokens) {
      const int64_t at = row * hidden + c * kVec;
      CpAsync16(slot(stage, 0), x + at);
      CpAsync16(slot(stage, 1), dy + at);
      if constexpr (kAdd) CpAsync16(slot(stage, 2), d_add + at);
    }
    CpAsyncCommit();  // possibly empty: keeps one group per row for wait_group
  };
  float* my_partial = partial + static_cast<int64_t>(blockIdx.x) * hidden + c * kVec;
  float w[kVec], dw[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) dw[e] = 0.0f;
  if (active) LoadVec<kVec>(weight + c * kVec, w);
  if (active && add_to_partial) LoadVec<kVec>(my_partial, dw);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) issue(blockIdx.x + static_cast<int64_t>(s) * gridDim.x, s);
  const float inv_hidden = 1.0f / static_cast<float>(hidden);
  int stage = 0, parity = 0;
  for (int64_t row = blockIdx.x; row < tokens; row += gridDim.x) {
    issue(row + static_cast<int64_t>(kStages - 1) * gridDim.x, (stage + kStages - 1) % kStages);
    const float rs = rstd[row];
    CpAsyncWait<kStages - 1>();  // this row's group has landed (groups complete in order)
    float xv[kVec], g[kVec], add[kVec];
    float dot = 0.0f;
    if (active) {
      LoadVec<kVec>(reinterpret_cast<const bf16*>(slot(stage, 0)), xv);
      LoadVec<kVec>(reinterpret_cast<const bf16*>(slot(stage, 1)), g);
      if constexpr (kAdd) LoadVec<kVec>(reinterpret_cast<const bf16*>(slot(stage, 2)), add);
#pragma unroll
      for (int e = 0; e < kVec; ++e) dot = fmaf(g[e] * w[e], xv[e], dot);
    }
    const float total = detail::BlockSumAlternating(dot, row_sums, parity);
    const float coupling = rs * rs * rs * total * inv_hidden;
    if (active) {
      float out[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        out[e] = rs * g[e] * w[e] - coupling * xv[e];
        if constexpr (kAdd) out[e] += add[e];
        dw[e] = fmaf(g[e], xv[e] * rs, dw[e]);
      }
      StoreVec<kVec>(dx + row * hidden + c * kVec, out);
    }
    parity ^= 1;
    stage = (stage + 1) % kStages;
  }
  CpAsyncWait<0>();
  if (active) StoreVec<kVec>(my_partial, dw);
}

// d_weight[col] += sum over the `rows` partial rows, in a fixed order.
// grid: ceil(d / 32) blocks of (32, 32) threads.
// (What it adds to the backward is the kernel boundary; the variants tried: kernels/PERF.md.)
template <typename GradT>
__global__ void __launch_bounds__(kColumnSumTile* kColumnSumTile)
    ColumnSumKernel(const float* __restrict__ partial, int rows, int64_t hidden,
                    GradT* __restrict__ d_weight) {
  __shared__ float sums[kColumnSumTile][kColumnSumTile + 1];
  detail::GridDependencyWaitAndTrigger();
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kColumnSumTile + threadIdx.x;
  float sum = 0.0f;
  if (col < hidden) {
    for (int r = threadIdx.y; r < rows; r += kColumnSumTile) sum += partial[r * hidden + col];
  }
  sums[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < hidden) {
    float total = 0.0f;
#pragma unroll 8
    for (int k = 0; k < kColumnSumTile; ++k) total += sums[k][threadIdx.x];
    d_weight[col] = detail::FromFloat<GradT>(detail::ToFloat(d_weight[col]) + total);
  }
}

// --- launch configuration ----------------------------------------------------------------------
struct RowConfig {
  int threads = 0;
  int chunks = 0;  // per thread
};

// The fewest chunks per thread (1, 2, 4, 8, 16; at most max_elements elements) that covers a
// row of `row_chunks` kVec-wide chunks with at most `target_threads` threads, else with as many
// threads as the kernel allows (max_threads(elements)).
template <typename MaxThreads>
RowConfig ChooseRowConfig(const char* name, int64_t row_chunks, int vec, int target_threads,
                          int max_elements, MaxThreads max_threads) {
  for (bool relaxed : {false, true}) {
    for (int chunks : {1, 2, 4, 8, 16}) {
      if (chunks * vec > max_elements) break;
      const int limit =
          relaxed ? max_threads(chunks * vec) : std::min(target_threads, max_threads(chunks * vec));
      const int64_t threads =
          CeilDiv(CeilDiv(row_chunks, chunks), detail::kWarpSize) * detail::kWarpSize;
      if (threads <= limit) return {static_cast<int>(threads), chunks};
    }
  }
  throw std::invalid_argument(std::string(name) + ": hidden " + std::to_string(row_chunks * vec) +
                              " too wide for the register-cached row kernel");
}

void CheckShape(const char* name, int64_t tokens, int64_t hidden) {
  if (tokens < 0 || hidden <= 0 || tokens > 0x7fffffff) {
    throw std::invalid_argument(std::string(name) + ": bad shape t=" + std::to_string(tokens) +
                                " d=" + std::to_string(hidden));
  }
}

template <int kVec, bool kResidual>
void LaunchForward(const bf16* residual, const bf16* x, const bf16* weight, int64_t tokens,
                   int64_t hidden, float eps, bf16* h, bf16* y, float* rstd, cudaStream_t stream) {
  const RowConfig cfg = ChooseRowConfig(
      kForwardName, hidden / kVec, kVec,
      kResidual ? kResidualForwardTargetThreads : kForwardTargetThreads,
      kResidual ? kMaxElementsPerThread : kForwardMaxElementsPerThread, ForwardMaxThreads);
  const unsigned grid = static_cast<unsigned>(tokens);
#define CTXPLAN_RMSNORM_FWD(CHUNKS)                                                                \
  case CHUNKS:                                                                                     \
    if constexpr (kVec * CHUNKS <=                                                                 \
                  (kResidual ? kMaxElementsPerThread : kForwardMaxElementsPerThread)) {            \
      detail::Launch(RmsNormForwardKernel<kVec, CHUNKS, kResidual>, dim3(grid), dim3(cfg.threads), \
                     stream, residual, x, weight, hidden, eps, h, y, rstd);                        \
    }                                                                                              \
    break;
  switch (cfg.chunks) {
    CTXPLAN_RMSNORM_FWD(1)
    CTXPLAN_RMSNORM_FWD(2)
    CTXPLAN_RMSNORM_FWD(4)
    CTXPLAN_RMSNORM_FWD(8)
    CTXPLAN_RMSNORM_FWD(16)
    default:
      throw std::logic_error("RmsNormForward: bad chunk count");
  }
#undef CTXPLAN_RMSNORM_FWD
}

void Forward(const bf16* residual, const bf16* x, const bf16* weight, int64_t tokens,
             int64_t hidden, float eps, bf16* h, bf16* y, float* rstd, cudaStream_t stream) {
  CheckShape(kForwardName, tokens, hidden);
  if (tokens == 0) return;
  bool vec = hidden % 8 == 0 && IsAligned(x, 16) && IsAligned(weight, 16) && IsAligned(y, 16);
  if (residual != nullptr) vec = vec && IsAligned(residual, 16) && IsAligned(h, 16);
  if (residual != nullptr) {
    if (vec) {
      LaunchForward<8, true>(residual, x, weight, tokens, hidden, eps, h, y, rstd, stream);
    } else {
      LaunchForward<1, true>(residual, x, weight, tokens, hidden, eps, h, y, rstd, stream);
    }
  } else {
    if (vec) {
      LaunchForward<8, false>(residual, x, weight, tokens, hidden, eps, h, y, rstd, stream);
    } else {
      LaunchForward<1, false>(residual, x, weight, tokens, hidden, eps, h, y, rstd, stream);
    }
  }
}

// Blocks of `kernel` resident per multiprocessor at `threads` threads and `smem` bytes of
// dynamic shared memory (cached, at least 1). Raises the kernel's dynamic shared memory limit
// (and asks for the largest shared memory carveout) when it needs more than 48 KB.
int ResidentBlocks(const void* kernel, int threads, size_t smem = 0) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, size_t>, int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, threads, smem);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  // The limit is on static + dynamic shared memory together: raised for any dynamic size (48 KB
  // of dynamic memory alone failed to launch beside the kernel's static row sums).
  if (smem > 0) {
    CTXPLAN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem)));
    CTXPLAN_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
  }
  int per_sm = 0;
  CTXPLAN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  per_sm = std::max(1, per_sm);
  cache.emplace(key, per_sm);
  return per_sm;
}

// CTXPLAN_RMSNORM_PIPELINE=0 selects the register-prefetch backward for every width.
bool PipelinedBackwardEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("CTXPLAN_RMSNORM_PIPELINE");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

int64_t BackwardBlocks(int64_t tokens) {
  return std::min<int64_t>(tokens, kMaxBackwardBlocks);
}

template <int kVec, bool kAdd>
int LaunchBackwardRows(const bf16* x, const bf16* weight, const float* rstd, const bf16* dy,
                       const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx, float* partial,
                       bool add_to_partial, cudaStream_t stream) {
  if constexpr (kVec == 8) {
    if (hidden / kVec <= kPipelinedMaxThreads && PipelinedBackwardEnabled()) {
      const int threads =
          static_cast<int>(CeilDiv(hidden / kVec, detail::kWarpSize)) * detail::kWarpSize;
      constexpr int kArrays = kAdd ? 3 : 2;
      const size_t smem = size_t{kStages} * kArrays * threads * 16;
      auto kernel = RmsNormBackwardPipelinedKernel<kAdd>;
      const int per_sm = ResidentBlocks(reinterpret_cast<const void*>(kernel), threads, smem);
      const int grid = static_cast<int>(std::min<int64_t>(
          BackwardBlocks(tokens), int64_t{per_sm} * detail::MultiprocessorCount()));
      detail::Launch(kernel, dim3(grid), dim3(threads), smem, stream, x, weight, rstd, dy, d_add,
                     tokens, hidden, dx, partial, add_to_partial);
      return grid;
    }
  }
  const RowConfig cfg = ChooseRowConfig(kBackwardName, hidden / kVec, kVec, kBackwardTargetThreads,
                                        kMaxElementsPerThread, BackwardMaxThreads);
  const int64_t sms = detail::MultiprocessorCount();
  int grid = 0;
#define CTXPLAN_RMSNORM_BWD(CHUNKS)                                                             \
  case CHUNKS:                                                                                  \
    if constexpr (kVec * CHUNKS <= kMaxElementsPerThread) {                                     \
      auto kernel = RmsNormBackwardKernel<kVec, CHUNKS, kAdd>;                                  \
      const int per_sm = ResidentBlocks(reinterpret_cast<const void*>(kernel), cfg.threads);    \
      grid = static_cast<int>(std::min<int64_t>(BackwardBlocks(tokens), per_sm * sms));         \
      detail::Launch(kernel, dim3(grid), dim3(cfg.threads), stream, x, weight, rstd, dy, d_add, \
                     tokens, hidden, dx, partial, add_to_partial);                              \
    }                                                                                           \
    break;
  switch (cfg.chunks) {
    CTXPLAN_RMSNORM_BWD(1)
    CTXPLAN_RMSNORM_BWD(2)
    CTXPLAN_RMSNORM_BWD(4)
    CTXPLAN_RMSNORM_BWD(8)
    CTXPLAN_RMSNORM_BWD(16)
    default:
      throw std::logic_error("RmsNormBackward: bad chunk count");
  }
#undef CTXPLAN_RMSNORM_BWD
  return grid;
}

// The row kernel for any width and alignment; returns its grid (the partial rows it wrote).
int BackwardRows(const bf16* x, const bf16* weight, const float* rstd, const bf16* dy,
                 const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx, float* partial,
                 bool add_to_partial, cudaStream_t stream) {
  bool vec = hidden % 8 == 0 && IsAligned(x, 16) && IsAligned(weight, 16) && IsAligned(dy, 16) &&
             IsAligned(dx, 16);  // partial: 16-byte aligned (CheckPartials)
  if (d_add != nullptr) {
    vec = vec && IsAligned(d_add, 16);
    return vec ? LaunchBackwardRows<8, true>(x, weight, rstd, dy, d_add, tokens, hidden, dx,
                                             partial, add_to_partial, stream)
               : LaunchBackwardRows<1, true>(x, weight, rstd, dy, d_add, tokens, hidden, dx,
                                             partial, add_to_partial, stream);
  }
  return vec ? LaunchBackwardRows<8, false>(x, weight, rstd, dy, d_add, tokens, hidden, dx, partial,
                                            add_to_partial, stream)
             : LaunchBackwardRows<1, false>(x, weight, rstd, dy, d_add, tokens, hidden, dx, partial,
                                            add_to_partial, stream);
}

void CheckPartials(const char* name, const void* partials) {
  if (partials == nullptr || !IsAligned(partials, 16)) {
    throw std::invalid_argument(std::string(name) +
                                ": partial rows must be 16-byte aligned device memory");
  }
}

template <typename GradT>
void AddPartials(const float* partial, int rows, int64_t hidden, GradT* d_weight,
                 cudaStream_t stream) {
  if (rows <= 0) return;
  const dim3 block(kColumnSumTile, kColumnSumTile);
  const unsigned grid = static_cast<unsigned>(CeilDiv(hidden, kColumnSumTile));
  detail::Launch(ColumnSumKernel<GradT>, dim3(grid), block, stream, partial, rows, hidden,
                 d_weight);
}

template <typename GradT>
void Backward(const bf16* x, const bf16* weight, const float* rstd, const bf16* dy,
              const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx, GradT* d_weight,
              void* scratch, cudaStream_t stream) {
  CheckShape(kBackwardName, tokens, hidden);
  if (tokens == 0) return;
  CheckPartials(kBackwardName, scratch);
  float* partial = static_cast<float*>(scratch);
  const int rows = BackwardRows(x, weight, rstd, dy, d_add, tokens, hidden, dx, partial,
                                /*add_to_partial=*/false, stream);
  AddPartials(partial, rows, hidden, d_weight, stream);
}

}  // namespace

void RmsNormForward(const bf16* x, const bf16* weight, int64_t tokens, int64_t hidden, float eps,
                    bf16* y, float* rstd, cudaStream_t stream) {
  Forward(nullptr, x, weight, tokens, hidden, eps, nullptr, y, rstd, stream);
}

void RmsNormResidualForward(const bf16* residual, const bf16* x, const bf16* weight, int64_t tokens,
                            int64_t hidden, float eps, bf16* h, bf16* y, float* rstd,
                            cudaStream_t stream) {
  if (residual == nullptr || h == nullptr) {
    throw std::invalid_argument("RmsNormResidualForward: residual and h are required");
  }
  Forward(residual, x, weight, tokens, hidden, eps, h, y, rstd, stream);
}

size_t RmsNormBackwardScratchBytes(int64_t tokens, int64_t hidden) {
  return static_cast<size_t>(std::max<int64_t>(BackwardBlocks(tokens), 1)) *
         static_cast<size_t>(hidden) * sizeof(float);
}

void RmsNormBackward(const bf16* x, const bf16* weight, const float* rstd, const bf16* dy,
                     const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx, float* d_weight,
                     void* scratch, cudaStream_t stream) {
  Backward(x, weight, rstd, dy, d_add, tokens, hidden, dx, d_weight, scratch, stream);
}

void RmsNormBackward(const bf16* x, const bf16* weight, const float* rstd, const bf16* dy,
                     const bf16* d_add, int64_t tokens, int64_t hidden, bf16* dx, bf16* d_weight,
                     void* scratch, cudaStream_t stream) {
  Backward(x, weight, rstd, dy, d_add, tokens, hidden, dx, d_weight, scratch, stream);
}

int RmsNormBackwardIntoPartials(const bf16* x, const bf16* weight, const float* rstd,
                                const bf16* dy, int64_t tokens, int64_t hidden, bf16* dx,
                                float* partials, cudaStream_t stream) {
  CheckShape(kBackwardName, tokens, hidden);
  if (tokens == 0) return 0;
  CheckPartials(kBackwardName, partials);
  return BackwardRows(x, weight, rstd, dy, nullptr, tokens, hidden, dx, partials,
                      /*add_to_partial=*/true, stream);
}

void RmsNormAddPartials(const float* partials, int rows, int64_t hidden, float* d_weight,
                        cudaStream_t stream) {
  CheckShape(kBackwardName, rows, hidden);
  if (rows > 0) CheckPartials(kBackwardName, partials);
  AddPartials(partials, rows, hidden, d_weight, stream);
}

void RmsNormAddPartials(const float* partials, int rows, int64_t hidden, bf16* d_weight,
                        cudaStream_t stream) {
  CheckShape(kBackwardName, rows, hidden);
  if (rows > 0) CheckPartials(kBackwardName, partials);
  AddPartials(partials, rows, hidden, d_weight, stream);
}

}  // namespace ctxplan::kernels::cuda
