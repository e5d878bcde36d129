// Device helpers shared by the paged attention kernels (attention_fwd.cu,
// attention_bwd_kernels.cuh): PTX wrappers for cp.async, bf16 packing and the flushed exponential,
// and host-side argument checks. (The wgmma layouts and wrappers: attention_wgmma.cuh.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "ctxplan/kernels/cuda/attention.h"

namespace ctxplan::kernels::cuda::detail {

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; when !valid the 16 bytes are zero-filled and nothing is read.
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two floats -> bf16x2 (lo in the low half, i.e. the lower column index).
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 2^x on the MUFU unit with results under 2^-126 flushed to zero: exp2f, compiled without -ftz,
// wraps each ex2 in a compare and two multiplies to keep subnormal results (3 of the forward
// softmax's ~12 instructions a score, kernels/PERF.md); a probability under 2^-126 beside the
// row's largest (1) adds nothing. ex2(-inf) = +0, as the masks need.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// --- host-side checks ----------------------------------------------------------------------
inline void Require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("ctxplan::kernels::cuda attention: " + what);
}

// The checks the forward and the backward share: the shape, the earlier pages, the selection.
// grid_y_heads: the heads a launch puts on the grid's y dimension (at most 65535).
inline void RequireAttentionInputs(const AttentionShape& shape, int64_t grid_y_heads,
                                   const PagedKv<const bf16>& earlier,
                                   const PageSelection& selection) {
  Require(shape.head_dim == 64 || shape.head_dim == 128, "head_dim must be 64 or 128");
  Require(shape.tokens >= 0 && shape.tokens < (1 << 30), "tokens out of range");
  Require(shape.num_kv_heads > 0 && shape.num_heads > 0 &&
              shape.num_heads % shape.num_kv_heads == 0 && grid_y_heads < 65536,
          "query heads must be a positive multiple of KV heads");
  Require(earlier.num_pages >= 0, "negative page count");
  if (earlier.num_pages > 0) {
    Require(earlier.pool != nullptr && earlier.page_slot != nullptr, "earlier pages missing");
    Require(earlier.shape.num_kv_heads == shape.num_kv_heads &&
                earlier.shape.head_dim == shape.head_dim,
            "page shape differs from the attention shape");
    Require(earlier.shape.page_tokens >= 16, "page_tokens must be >= 16");
    Require(earlier.num_pages * earlier.shape.page_tokens < (int64_t{1} << 30),
            "too many earlier positions");
  }
  if (selection.pages != nullptr) {
    Require(selection.query_tile > 0 && selection.query_tile % 128 == 0,
            "page-sparse attention needs query_tile a multiple of 128");
    Require(selection.pages_per_tile >= 0 && selection.pages_per_tile <= earlier.num_pages,
            "pages_per_tile out of range");
  }
}

}  // namespace ctxplan::kernels::cuda::detail
