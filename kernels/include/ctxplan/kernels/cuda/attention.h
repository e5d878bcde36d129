// CUDA paged attention for chunk-recurrent training (sm_90a): bf16 storage, fp32 accumulation.
//
// These compute exactly what the CPU references in ctxplan/kernels/cpu/reference.h define
// (AttentionForward, AttentionBackward, PageSummary, PageScore, PageTopK), up to the rounding of
// bf16 operands and fp32 accumulation. A chunk's t queries attend
//   - the earlier positions held in KV pages (layout in ctxplan/kernels/paged_kv.h), every page or
//     the pages the query tile selected (sinks first, then its top-k, ascending), and
//   - the chunk's own positions 0..i, causally.
// GQA: query head h reads KV head h / (H_q / H_kv).
//
// Every pointer is DEVICE memory (page tables and page lists too) unless marked otherwise; all
// work is enqueued on `stream` and nothing synchronises. Launch errors throw CudaError (check.h);
// arguments that break a precondition throw std::invalid_argument before anything is enqueued.
// Supported: head_dim 64 or 128; page_tokens >= 16 (the forward runs at one rate wherever 16
// divides it); H_q a multiple of H_kv; for page-sparse selection, query_tile a multiple of 128.
//
// This header is plain C++ (g++ includes it; the kernels live in kernels/src/cuda/attention_*.cu
// and page_select.cu). Kernels: Hopper wgmma (warpgroup MMA) forward and backward for head_dim
// 64 and 128.
// Measured on an H200 (bf16, d_h 128, 28/4 heads, causal 64K, 2026-11-27): forward 579 TFLOP/s,
// backward 470-479 (kernels/bench/attention_bench.cpp; PyTorch SDPA flash 350 / 324, cuDNN 598 /
// 540 in the same run; kernels/PERF.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ctxplan/kernels/paged_kv.h"

namespace ctxplan::kernels::cuda {

using bf16 = __nv_bfloat16;

struct AttentionShape {
  int64_t tokens = 0;        // t, queries (and own positions) of the chunk
  int64_t num_heads = 0;     // H_q
  int64_t num_kv_heads = 0;  // H_kv (divides H_q)
  int64_t head_dim = 0;      // d_h: 64 or 128
  float scale = 0.0f;        // softmax scale, 1/sqrt(d_h) typically
};

// --- forward -------------------------------------------------------------------------------
// out = softmax(scale q k^T) v over the keys each query sees; lse = the natural log-sum-exp of
// the scaled scores (kept for the backward).
//   q      [t][H_q][d_h]      bf16, post-RoPE
//   k_own  [t][H_kv][d_h]     bf16, post-RoPE; v_own likewise
//   earlier.pool [slots][2][p][H_kv][d_h] bf16; earlier.page_slot [num_pages] int32 (device);
//          num_pages may be 0 (pool and page_slot then unused)
//   selection.pages [ceil(t/b)][pages_per_tile] int32 logical pages, strictly ascending (device),
//          or nullptr for dense (every earlier page for every query)
//   out    [t][H_q][d_h]      bf16 (overwritten)
//   lse    [t][H_q]           fp32 (overwritten)
void AttentionForward(const AttentionShape& shape, const bf16* q, const bf16* k_own,
                      const bf16* v_own, const PagedKv<const bf16>& earlier,
                      const PageSelection& selection, bf16* out, float* lse, cudaStream_t stream);

// --- backward ------------------------------------------------------------------------------
// Device scratch the backward needs, in bytes (dQ accumulated in fp32, the softmax row
// correction D = dO . O and the LSE in log2 units): about t * H_q * (d_h + 2) * 4, and where
// the shape's own key blocks may go one a query head (AttentionBackwardSplitsOwnHeads, for a
// launch over its own positions alone or not) their dK/dV in fp32, 2 * t * H_kv * d_h * 4.
size_t AttentionBackwardWorkspaceBytes(const AttentionShape& shape);

// dq, dk_own, dv_own are overwritten; dK/dV of the earlier positions are ADDED into the dKV pages
// (same page table shape as `earlier`, its own slots: dkv.page_slot[page] is the dKV slot of
// logical page `page`). With a page selection only pages that some tile selected are read from
// `earlier` and written in `dkv` (page_slot entries of the other pages are never read).
//   q, k_own, v_own, earlier, selection: as for the forward (the same values)
//   out    [t][H_q][d_h] bf16, lse [t][H_q] fp32: the forward's outputs
//   d_out  [t][H_q][d_h] bf16
//   dq     [t][H_q][d_h] bf16; dk_own, dv_own [t][H_kv][d_h] bf16
//   dkv.pool [slots][2][p][H_kv][d_h] fp32 (or bf16, second overload), accumulated
//   workspace: AttentionBackwardWorkspaceBytes(shape) bytes of device memory, 256-byte aligned
//   own_dkv (optional): the dKV pages of the chunk's own positions, [slots][2][p][H_kv][d_h] in
//     the dKV pool's type, covering the t positions; given, dk_own / dv_own are this backward's
//     plus what later chunks left there (DkvAccumulate fused: rounded to bf16 once, not twice)
// Determinism: dK/dV (own and pages) of a key are computed by one thread block (128 keys, or 64
// for page-sparse selection over pages < 128 tokens) and KV head that loops over every query of
// the GQA group: plain read-add-write into the pool, deterministic, no atomics, race-free since
// no two pages share a slot. Except page-sparse: there each selection tile's selected positions
// are gathered into blocks, and the earlier pages' dK/dV are added by fp32 (or bf16x2) atomics, in
// an order that varies from run to run (a bf16 pool rounds once per selecting tile rather than
// once per chunk).
// dQ is summed over key blocks in fp32 in the workspace, by atomics or
// bulk reduces in the L2 (summation order not deterministic: run-to-run differences at fp32
// rounding level).
void AttentionBackward(const AttentionShape& shape, const bf16* q, const bf16* k_own,
                       const bf16* v_own, const PagedKv<const bf16>& earlier,
                       const PageSelection& selection, const bf16* out, const float* lse,
                       const bf16* d_out, bf16* dq, bf16* dk_own, bf16* dv_own,
                       const PagedKv<float>& dkv, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream, const PagedKv<const float>* own_dkv = nullptr);
void AttentionBackward(const AttentionShape& shape, const bf16* q, const bf16* k_own,
                       const bf16* v_own, const PagedKv<const bf16>& earlier,
                       const PageSelection& selection, const bf16* out, const float* lse,
                       const bf16* d_out, bf16* dq, bf16* dk_own, bf16* dv_own,
                       const PagedKv<bf16>& dkv, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream, const PagedKv<const bf16>* own_dkv = nullptr);

// --- page selection ------------------------------------------------------------------------
// Mean key of each of kv.num_pages full pages per KV head (fp32 sum, rounded once to bf16).
//   kv.pool [slots][2][p][H_kv][d_h] bf16, kv.page_slot [num_pages] int32
//   summaries [num_pages][H_kv][d_h] bf16 (overwritten)
// To summarise pages first..first+n-1 only, pass page_slot + first, num_pages = n and
// summaries + first * H_kv * d_h.
void PageSummary(const PagedKv<const bf16>& kv, bf16* summaries, cudaStream_t stream);

// Device scratch PageScore needs: ceil(t / query_tile) * H_kv * d_h * 4 bytes.
size_t PageScoreWorkspaceBytes(int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                               int64_t query_tile);
// scores[tile][page] = sum over the tile's queries and all query heads of q . summary of the
// query head's KV head (the tile's queries and each GQA group's heads are summed first, fp32).
//   q [t][H_q][d_h] bf16; summaries [pages][H_kv][d_h] bf16
//   scores [ceil(t / query_tile)][pages] fp32 (overwritten)
//   workspace: PageScoreWorkspaceBytes(...) bytes of device memory
void PageScore(const bf16* q, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t query_tile, const bf16* summaries, int64_t pages,
               float* scores, void* workspace, size_t workspace_bytes, cudaStream_t stream);

// selected[tile] = the first `sinks` pages, then the `budget` best-scoring other pages (ties:
// the lower page; NaN ranks as -inf), ascending; every page when pages <= sinks + budget.
//   scores [tiles][pages] fp32; selected [tiles][pages_per_tile] int32 (overwritten)
// Returns pages_per_tile = min(pages, sinks + budget) (computed on the host, no sync).
int64_t PageTopK(const float* scores, int64_t tiles, int64_t pages, int64_t budget, int64_t sinks,
                 int32_t* selected, cudaStream_t stream);

}  // namespace ctxplan::kernels::cuda
