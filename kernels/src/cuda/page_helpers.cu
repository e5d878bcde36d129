// The plan's page helpers (layout in paged_kv.h):
//   KvWrite        the chunk's post-RoPE K and V rows into its own KV pages;
//   DkvAccumulate  dk_own / dv_own += the dKV that later chunks left in the chunk's own pages.
// One thread per kVec-element chunk of a token's kv_dim row, K and V together.
#include <cuda_runtime.h>

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

constexpr const char* kKvWriteName = "KvWrite";
constexpr const char* kDkvAccumulateName = "DkvAccumulate";
constexpr int kThreads = 256;
static_assert(kThreads % detail::kWarpSize == 0);

// Element offset of row `in_page` of K (V: + page_tokens * kv_dim) in slot `slot`.
__device__ __forceinline__ int64_t PageRowOffset(int64_t slot, int64_t in_page, int64_t page_tokens,
                                                 int64_t kv_dim) {
  return slot * 2 * page_tokens * kv_dim + in_page * kv_dim;
}

template <int kVec>
__device__ __forceinline__ void CopyVec(bf16* dst, const bf16* src) {
  if constexpr (kVec == 8) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    static_assert(kVec == 1);
    *dst = *src;
  }
}

// grid: ceil(t * kv_dim / kVec / kThreads).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    KvWriteKernel(const bf16* __restrict__ k, const bf16* __restrict__ v, int64_t row_stride,
                  int64_t tokens, int64_t kv_dim, int64_t page_tokens,
                  const int32_t* __restrict__ page_slot, bf16* __restrict__ pool) {
  detail::GridDependencyWaitAndTrigger();
  const int64_t chunks_per_row = kv_dim / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * chunks_per_row) return;
  const int64_t t = i / chunks_per_row;
  const int64_t c = (i - t * chunks_per_row) * kVec;
  const int64_t page = t / page_tokens;
  const int64_t dst =
      PageRowOffset(page_slot[page], t - page * page_tokens, page_tokens, kv_dim) + c;
  CopyVec<kVec>(pool + dst, k + t * row_stride + c);
  CopyVec<kVec>(pool + dst + page_tokens * kv_dim, v + t * row_stride + c);
}

template <int kVec, typename PageT>
__global__ void __launch_bounds__(kThreads)
    DkvAccumulateKernel(const PageT* __restrict__ pool, const int32_t* __restrict__ page_slot,
                        int64_t tokens, int64_t kv_dim, int64_t page_tokens, bf16* dk_own,
                        bf16* dv_own, int64_t row_stride) {
  detail::GridDependencyWaitAndTrigger();
  const int64_t chunks_per_row = kv_dim / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * chunks_per_row) return;
  const int64_t t = i / chunks_per_row;
  const int64_t c = (i - t * chunks_per_row) * kVec;
  const int64_t page = t / page_tokens;
  const int64_t src =
      PageRowOffset(page_slot[page], t - page * page_tokens, page_tokens, kv_dim) + c;
  const int64_t own = t * row_stride + c;
  float pk[kVec], pv[kVec], ok[kVec], ov[kVec];
  LoadVec<kVec>(pool + src, pk);
  LoadVec<kVec>(pool + src + page_tokens * kv_dim, pv);
  LoadVec<kVec>(dk_own + own, ok);
  LoadVec<kVec>(dv_own + own, ov);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    ok[e] += pk[e];
    ov[e] += pv[e];
  }
  StoreVec<kVec>(dk_own + own, ok);
  StoreVec<kVec>(dv_own + own, ov);
}

void CheckPages(const char* name, const KvPageShape& s, int64_t tokens, int64_t row_stride,
                const void* pool, const int32_t* page_slot) {
  if (tokens < 0 || s.page_tokens <= 0 || s.num_kv_heads <= 0 || s.head_dim <= 0 ||
      row_stride < s.kv_dim()) {
    throw std::invalid_argument(std::string(name) + ": bad shape t=" + std::to_string(tokens) +
                                " p=" + std::to_string(s.page_tokens) +
                                " kv_dim=" + std::to_string(s.kv_dim()) +
                                " stride=" + std::to_string(row_stride));
  }
  if (tokens > 0 && (pool == nullptr || page_slot == nullptr)) {
    throw std::invalid_argument(std::string(name) + ": null pool or page table");
  }
}

template <typename PageT>
void LaunchDkvAccumulate(const PagedKv<const PageT>& own_dkv, int64_t tokens, bf16* dk_own,
                         bf16* dv_own, int64_t row_stride, cudaStream_t stream) {
  const KvPageShape& s = own_dkv.shape;
  CheckPages(kDkvAccumulateName, s, tokens, row_stride, own_dkv.pool, own_dkv.page_slot);
  if (tokens == 0) return;
  const int64_t kv_dim = s.kv_dim();
  const bool vec = kv_dim % 8 == 0 && row_stride % 8 == 0 && IsAligned(own_dkv.pool, 16) &&
                   IsAligned(dk_own, 16) && IsAligned(dv_own, 16);
  if (vec) {
    const int64_t blocks = CeilDiv(tokens * kv_dim / 8, kThreads);
    detail::Launch(DkvAccumulateKernel<8, PageT>, dim3(static_cast<unsigned>(blocks)),
                   dim3(kThreads), stream, own_dkv.pool, own_dkv.page_slot, tokens, kv_dim,
                   s.page_tokens, dk_own, dv_own, row_stride);
  } else {
    const int64_t blocks = CeilDiv(tokens * kv_dim, kThreads);
    detail::Launch(DkvAccumulateKernel<1, PageT>, dim3(static_cast<unsigned>(blocks)),
                   dim3(kThreads), stream, own_dkv.pool, own_dkv.page_slot, tokens, kv_dim,
                   s.page_tokens, dk_own, dv_own, row_stride);
  }
}

}  // namespace

void KvWrite(const bf16* k, const bf16* v, int64_t row_stride, int64_t tokens,
             const PagedKv<bf16>& own_pages, cudaStream_t stream) {
  const KvPageShape& s = own_pages.shape;
  CheckPages(kKvWriteName, s, tokens, row_stride, own_pages.pool, own_pages.page_slot);
  if (tokens == 0) return;
  const int64_t kv_dim = s.kv_dim();
  const bool vec = kv_dim % 8 == 0 && row_stride % 8 == 0 && IsAligned(own_pages.pool, 16) &&
                   IsAligned(k, 16) && IsAligned(v, 16);
  if (vec) {
    const int64_t blocks = CeilDiv(tokens * kv_dim / 8, kThreads);
    detail::Launch(KvWriteKernel<8>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, k,
                   v, row_stride, tokens, kv_dim, s.page_tokens, own_pages.page_slot,
                   own_pages.pool);
  } else {
    const int64_t blocks = CeilDiv(tokens * kv_dim, kThreads);
    detail::Launch(KvWriteKernel<1>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, k,
                   v, row_stride, tokens, kv_dim, s.page_tokens, own_pages.page_slot,
                   own_pages.pool);
  }
}

void DkvAccumulate(const PagedKv<const float>& own_dkv, int64_t tokens, bf16* dk_own, bf16* dv_own,
                   int64_t row_stride, cudaStream_t stream) {
  LaunchDkvAccumulate(own_dkv, tokens, dk_own, dv_own, row_stride, stream);
}

void DkvAccumulate(const PagedKv<const bf16>& own_dkv, int64_t tokens, bf16* dk_own, bf16* dv_own,
                   int64_t row_stride, cudaStream_t stream) {
  LaunchDkvAccumulate(own_dkv, tokens, dk_own, dv_own, row_stride, stream);
}

}  // namespace ctxplan::kernels::cuda
