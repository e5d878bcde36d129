// Token embedding: a row gather forward and a deterministic scatter-add backward.
//
// Forward: one thread block per row, up to kForwardChunks 16-byte chunks per thread. Backward: one
// thread block per (token, slice of hidden). A block whose token id already occurred earlier in the
// chunk exits (each block scans the chunk's ids once, from L1); the block of the FIRST occurrence
// sums the d_out rows of every occurrence of its id in token order (fp32 registers) and adds the
// sum into d_table once. No atomics: the result does not depend on scheduling, and a bf16 d_table
// is rounded once per chunk, not once per occurrence.
#include <cuda_runtime.h>

#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ops_util.cuh"

namespace ctxplan::kernels::cuda {
namespace {

using detail::CeilDiv;
using detail::IsAligned;
using detail::LoadVec;
using detail::StoreVec;

constexpr const char* kForwardName = "EmbeddingForward";
constexpr const char* kBackwardName = "EmbeddingBackward";
constexpr int kForwardThreads = 128;
constexpr int kForwardChunks = 4;  // chunks of a row per thread
constexpr int kBackwardThreads = 256;
constexpr int kBackwardChunks = 4;  // 16-byte chunks of a row per thread (registers)
static_assert(kForwardThreads % detail::kWarpSize == 0);
static_assert(kBackwardThreads % detail::kWarpSize == 0);

// grid: (t, ceil(d / kVec / (kForwardThreads * kForwardChunks))). One block per row (slice):
// the id is read once per thread, then each thread has kForwardChunks independent 16-byte loads
// in flight (the id -> row dependency costs one memory latency per row, not per chunk).
template <int kVec>
__global__ void __launch_bounds__(kForwardThreads)
    EmbeddingForwardKernel(const int32_t* __restrict__ tokens, const bf16* __restrict__ table,
                           int64_t vocab, int64_t hidden, bf16* __restrict__ out) {
  using Chunk = std::conditional_t<kVec == 8, uint4, bf16>;
  detail::GridDependencyWaitAndTrigger();
  const int64_t t = blockIdx.x;
  const int64_t chunks_per_row = hidden / kVec;
  const int64_t first_chunk = static_cast<int64_t>(blockIdx.y) * kForwardThreads * kForwardChunks;
  const int32_t id = tokens[t];
  const bool valid = id >= 0 && id < vocab;
  const Chunk* src = reinterpret_cast<const Chunk*>(table + (valid ? id : 0) * hidden);
  Chunk* dst = reinterpret_cast<Chunk*>(out + t * hidden);
  Chunk v[kForwardChunks];
#pragma unroll
  for (int i = 0; i < kForwardChunks; ++i) {
    const int64_t c = first_chunk + threadIdx.x + i * kForwardThreads;
    if (c < chunks_per_row) {
      if (valid) {
        v[i] = src[c];
      } else {  // NaN: a bad id shows
        if constexpr (kVec == 8) {
          v[i] = make_uint4(0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u, 0x7fc07fc0u);
        } else {
          v[i] = __ushort_as_bfloat16(0x7fc0);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kForwardChunks; ++i) {
    const int64_t c = first_chunk + threadIdx.x + i * kForwardThreads;
    if (c < chunks_per_row) dst[c] = v[i];
  }
}

// grid: (t, ceil(d / kVec / (kBackwardThreads * kBackwardChunks))).
template <int kVec, typename GradT>
__global__ void __launch_bounds__(kBackwardThreads)
    EmbeddingBackwardKernel(const int32_t* __restrict__ tokens, const bf16* __restrict__ d_out,
                            int64_t num_tokens, int64_t vocab, int64_t hidden,
                            GradT* __restrict__ d_table) {
  __shared__ uint32_t match_masks[kBackwardThreads / detail::kWarpSize];
  detail::GridDependencyWaitAndTrigger();
  const int64_t t = blockIdx.x;
  const int32_t id = tokens[t];
  if (id < 0 || id >= vocab) return;  // uniform over the block

  // One barrier-free pass over the other ids: does `id` occur before t (then the block of its
  // first occurrence does the work) or after t (then there are rows to gather)?
  int earlier = 0, later = 0;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < num_tokens; j += kBackwardThreads) {
    const bool same = tokens[j] == id && j != t;
    earlier |= same && j < t;
    later |= same && j > t;
  }
  if (__syncthreads_or(earlier)) return;
  const bool any_later = __syncthreads_or(later);

  const int64_t chunks_per_row = hidden / kVec;
  const int64_t first_chunk = static_cast<int64_t>(blockIdx.y) * kBackwardThreads * kBackwardChunks;
  float acc[kBackwardChunks][kVec];
#pragma unroll
  for (int i = 0; i < kBackwardChunks; ++i) {
    const int64_t c = first_chunk + threadIdx.x + i * kBackwardThreads;
    if (c < chunks_per_row) {
      LoadVec<kVec>(d_out + t * hidden + c * kVec, acc[i]);
    } else {
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[i][e] = 0.0f;
    }
  }

  // Later occurrences, in ascending token order, a window of kBackwardThreads ids at a time.
  const int lane = threadIdx.x % detail::kWarpSize;
  const int warp = threadIdx.x / detail::kWarpSize;
  for (int64_t base = t + 1; any_later && base < num_tokens; base += kBackwardThreads) {
    const int64_t j = base + threadIdx.x;
    const bool match = j < num_tokens && tokens[j] == id;
    if (!__syncthreads_or(match)) continue;
    const uint32_t mask = __ballot_sync(0xffffffffu, match);
    if (lane == 0) match_masks[warp] = mask;
    __syncthreads();
    for (int w = 0; w < kBackwardThreads / detail::kWarpSize; ++w) {
      uint32_t bits = match_masks[w];
      while (bits != 0) {
        const int b = __ffs(bits) - 1;
        bits &= bits - 1;
        const int64_t row = base + w * detail::kWarpSize + b;
#pragma unroll
        for (int i = 0; i < kBackwardChunks; ++i) {
          const int64_t c = first_chunk + threadIdx.x + i * kBackwardThreads;
          if (c < chunks_per_row) {
            float v[kVec];
            LoadVec<kVec>(d_out + row * hidden + c * kVec, v);
#pragma unroll
            for (int e = 0; e < kVec; ++e) acc[i][e] += v[e];
          }
        }
      }
    }
    __syncthreads();  // every thread has read match_masks before the next window writes it
  }

  GradT* dst = d_table + static_cast<int64_t>(id) * hidden;
#pragma unroll
  for (int i = 0; i < kBackwardChunks; ++i) {
    const int64_t c = first_chunk + threadIdx.x + i * kBackwardThreads;
    if (c < chunks_per_row) {
      float old[kVec];
      LoadVec<kVec>(dst + c * kVec, old);
#pragma unroll
      for (int e = 0; e < kVec; ++e) old[e] += acc[i][e];
      StoreVec<kVec>(dst + c * kVec, old);
    }
  }
}

void CheckShape(const char* name, int64_t num_tokens, int64_t vocab, int64_t hidden) {
  if (num_tokens < 0 || vocab <= 0 || hidden <= 0 ||
      num_tokens > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(std::string(name) + ": bad shape t=" + std::to_string(num_tokens) +
                                " V=" + std::to_string(vocab) + " d=" + std::to_string(hidden));
  }
}

template <typename GradT>
void LaunchBackward(const int32_t* tokens, const bf16* d_out, int64_t num_tokens, int64_t vocab,
                    int64_t hidden, GradT* d_table, cudaStream_t stream) {
  CheckShape(kBackwardName, num_tokens, vocab, hidden);
  if (num_tokens == 0) return;
  const bool vec = hidden % 8 == 0 && IsAligned(d_out, 16) && IsAligned(d_table, 16);
  const int vec_width = vec ? 8 : 1;
  const int64_t slices = CeilDiv(hidden / vec_width, int64_t{kBackwardThreads} * kBackwardChunks);
  if (slices > 65535) throw std::invalid_argument("EmbeddingBackward: hidden too large");
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(slices));
  if (vec) {
    detail::Launch(EmbeddingBackwardKernel<8, GradT>, grid, dim3(kBackwardThreads), stream, tokens,
                   d_out, num_tokens, vocab, hidden, d_table);
  } else {
    detail::Launch(EmbeddingBackwardKernel<1, GradT>, grid, dim3(kBackwardThreads), stream, tokens,
                   d_out, num_tokens, vocab, hidden, d_table);
  }
}

}  // namespace

void EmbeddingForward(const int32_t* tokens, const bf16* table, int64_t num_tokens, int64_t vocab,
                      int64_t hidden, bf16* out, cudaStream_t stream) {
  CheckShape(kForwardName, num_tokens, vocab, hidden);
  if (num_tokens == 0) return;
  const bool vec = hidden % 8 == 0 && IsAligned(table, 16) && IsAligned(out, 16);
  const int vec_width = vec ? 8 : 1;
  const int64_t slices = CeilDiv(hidden / vec_width, int64_t{kForwardThreads} * kForwardChunks);
  if (slices > 65535) throw std::invalid_argument("EmbeddingForward: hidden too large");
  const dim3 grid(static_cast<unsigned>(num_tokens), static_cast<unsigned>(slices));
  if (vec) {
    detail::Launch(EmbeddingForwardKernel<8>, grid, dim3(kForwardThreads), stream, tokens, table,
                   vocab, hidden, out);
  } else {
    detail::Launch(EmbeddingForwardKernel<1>, grid, dim3(kForwardThreads), stream, tokens, table,
                   vocab, hidden, out);
  }
}

void EmbeddingBackward(const int32_t* tokens, const bf16* d_out, int64_t num_tokens, int64_t vocab,
                       int64_t hidden, float* d_table, cudaStream_t stream) {
  LaunchBackward(tokens, d_out, num_tokens, vocab, hidden, d_table, stream);
}

void EmbeddingBackward(const int32_t* tokens, const bf16* d_out, int64_t num_tokens, int64_t vocab,
                       int64_t hidden, bf16* d_table, cudaStream_t stream) {
  LaunchBackward(tokens, d_out, num_tokens, vocab, hidden, d_table, stream);
}

}  // namespace ctxplan::kernels::cuda
