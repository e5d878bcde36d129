// Device helpers shared by the paged attention kernels (attention_fwd.cu, attention_bwd.cu):
// PTX wrappers for cp.async, ldmatrix and mma.sync m16n8k16 (bf16 in, fp32 accumulate), the
// XOR-swizzled shared-memory tile layout, and host-side argument checks.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16), lane = 4 * g + tq:
//   A 16x16 (row): a0 = (g, 2tq..2tq+1), a1 = (g+8, 2tq..), a2 = (g, 2tq+8..), a3 = (g+8, 2tq+8..)
//   B 16x8  (col): b0 = (k 2tq..2tq+1, n g), b1 = (k 2tq+8.., n g)
//   C 16x8       : c0,c1 = (g, 2tq..2tq+1), c2,c3 = (g+8, 2tq..2tq+1)
// Shared tiles are [rows][D] bf16 with D*2-byte rows cut into 16-byte chunks; chunk c of row r is
// stored at chunk c ^ (r & 7): eight rows read at one logical chunk (one ldmatrix 8x8 matrix)
// hit eight distinct 16-byte bank groups, and 16-byte cp.async writes stay conflict-free.
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

__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b, m16n8k16, bf16 operands, fp32 accumulators.
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> bf16x2 (lo in the low half, i.e. the lower column index).
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile with D columns.
template <int D>
__device__ __forceinline__ uint32_t SwzOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
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
