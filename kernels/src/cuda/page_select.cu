// Page-level sparse attention's selection on the GPU: page summaries (mean key per page and KV
// head), scores of query tiles against them, and the per-tile top-k with sinks. Memory-bound and
// small next to attention itself; written for clarity with coalesced bf16x2 accesses.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/cuda/check.h"

namespace ctxplan::kernels::cuda {
namespace {

constexpr int kThreads = 256;

void Require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("ctxplan::kernels::cuda page selection: " + what);
}

// --- summaries: grid (pages, H_kv); thread = a column pair x a subset of the page's tokens ---
__global__ void __launch_bounds__(kThreads)
    PageSummaryKernel(const bf16* __restrict__ pool, const int32_t* __restrict__ page_slot,
                      int64_t page_elems, int p, int hkv, int hd, bf16* __restrict__ summaries) {
  const int page = blockIdx.x, h = blockIdx.y;
  const int pairs = hd / 2;
  const int lanes = kThreads / pairs;  // token subsets
  const int cp = threadIdx.x % pairs, sub = threadIdx.x / pairs;
  __shared__ float2 part[kThreads];
  float2 acc = make_float2(0.0f, 0.0f);
  if (sub < lanes) {
    const int64_t slot = __ldg(page_slot + page);
    const bf16* base = pool + slot * page_elems + static_cast<int64_t>(h) * hd + 2 * cp;
    const int64_t row = static_cast<int64_t>(hkv) * hd;
    for (int tok = sub; tok < p; tok += lanes) {
      const float2 v =
          __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(base + tok * row));
      acc.x += v.x;
      acc.y += v.y;
    }
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  if (sub == 0) {
    for (int s = 1; s < lanes; ++s) {
      acc.x += part[s * pairs + cp].x;
      acc.y += part[s * pairs + cp].y;
    }
    const float inv = 1.0f / static_cast<float>(p);
    *reinterpret_cast<__nv_bfloat162*>(summaries + (static_cast<int64_t>(page) * hkv + h) * hd +
                                       2 * cp) = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  }
}

// --- scores, step 1: qg[tile][H_kv][d] = sum over the tile's queries and the group's heads ---
constexpr int kSumSplits = 8;  // partial sums per tile and KV head (the 16-byte kernel)
__global__ void __launch_bounds__(kThreads)
    QueryTileSumKernel(const bf16* __restrict__ q, int t, int hq, int hkv, int hd, int query_tile,
                       float* __restrict__ qg) {
  const int tile = blockIdx.x, g = blockIdx.y;
  const int group = hq / hkv;
  const int pairs = hd / 2;
  const int lanes = kThreads / pairs;
  const int cp = threadIdx.x % pairs, sub = threadIdx.x / pairs;
  const int i0 = tile * query_tile, i1 = min(t, i0 + query_tile);
  const int rows = (i1 - i0) * group;
  __shared__ float2 part[kThreads];
  float2 acc = make_float2(0.0f, 0.0f);
  if (sub < lanes) {
    for (int r = sub; r < rows; r += lanes) {
      const int i = i0 + r / group, h = g * group + r % group;
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(
          q + (static_cast<int64_t>(i) * hq + h) * hd + 2 * cp));
      acc.x += v.x;
      acc.y += v.y;
    }
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  if (sub == 0) {
    for (int s = 1; s < lanes; ++s) {
      acc.x += part[s * pairs + cp].x;
      acc.y += part[s * pairs + cp].y;
    }
    float* dst = qg + (static_cast<int64_t>(tile) * hkv + g) * hd + 2 * cp;
    dst[0] = acc.x;
    dst[1] = acc.y;
  }
}

// The same sums with 16-byte loads, eight in flight a thread: a row (one query, one head of the
// group) is chunks = d_h / 8 chunks, a thread takes chunk c of every kThreads / chunks-th row.
// The loop above issues one 4-byte load at a time and waits for it before the next (its add
// comes first in program order): ten times the bytes' time. Needs d_h / 8 a power of two (d_h 64
// ... 512) and q 16-byte aligned. Numbers in kernels/PERF.md.
// grid (tiles, H_kv, kSumSplits): split z sums its share of the tile's rows into partial z of
// qg ([kSumSplits][tiles][H_kv][d]); the score kernel adds the partials in order. One block per
// tile and KV head (128 blocks at t = 4096) waited out seven rounds of loads (kernels/PERF.md).
__global__ void __launch_bounds__(kThreads)
    QueryTileSumVecKernel(const bf16* __restrict__ q, int t, int hq, int hkv, int hd,
                          int query_tile, float* __restrict__ qg) {
  const int tile = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int group = hq / hkv;
  const int chunks = hd / 8;
  const int lanes = kThreads / chunks;
  const int c = threadIdx.x % chunks, sub = threadIdx.x / chunks;
  const int i0 = tile * query_tile, i1 = min(t, i0 + query_tile);
  const int rows = (i1 - i0) * group;
  const int per_split = (rows + gridDim.z - 1) / gridDim.z;
  const int r0 = split * per_split, r1 = min(rows, r0 + per_split);
  __shared__ float part[8][kThreads];
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 8
  for (int r = r0 + sub; r < r1; r += lanes) {
    const int i = i0 + r / group, h = g * group + r % group;
    const uint4 raw =
        __ldg(reinterpret_cast<const uint4*>(q + (static_cast<int64_t>(i) * hq + h) * hd) + c);
    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = __bfloat1622float2(v[e]);
      acc[2 * e] += f.x;
      acc[2 * e + 1] += f.y;
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) part[e][threadIdx.x] = acc[e];
  __syncthreads();
  if (sub == 0) {
    float* dst = qg + ((static_cast<int64_t>(split) * gridDim.x + tile) * hkv + g) * hd + c * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float total = 0.0f;
      for (int s = 0; s < lanes; ++s) total += part[e][s * chunks + c];
      dst[e] = total;
    }
  }
}

// --- scores, step 2: grid (page blocks of 32, tiles); a warp per page, 4 pages per warp; the
// tile's query sum is the sum of step 1's `splits` partials, added in order ---
constexpr int kPagesPerBlock = 32;
__global__ void __launch_bounds__(kThreads)
    PageScoreKernel(const float* __restrict__ qg, int splits, const bf16* __restrict__ summaries,
                    int pages, int kdim, float* __restrict__ scores) {
  extern __shared__ float s_q[];  // [kdim]
  const int tile = blockIdx.y;
  for (int i = threadIdx.x; i < kdim; i += kThreads) {
    float sum = 0.0f;
    for (int z = 0; z < splits; ++z)
      sum += qg[(static_cast<int64_t>(z) * gridDim.y + tile) * kdim + i];
    s_q[i] = sum;
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int k = 0; k < kPagesPerBlock / (kThreads / 32); ++k) {
    const int page = blockIdx.x * kPagesPerBlock + k * (kThreads / 32) + warp;
    if (page >= pages) break;
    const bf16* sp = summaries + static_cast<int64_t>(page) * kdim;
    float acc = 0.0f;
    for (int e = 2 * lane; e < kdim; e += 64) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(sp + e));
      acc = fmaf(s_q[e], v.x, acc);
      acc = fmaf(s_q[e + 1], v.y, acc);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) scores[static_cast<int64_t>(tile) * pages + page] = acc;
  }
}

// --- top-k ---
// Order-preserving map of a score to uint32 (larger = better); NaN ranks as -inf, -0 as +0.
__device__ __forceinline__ uint32_t OrderKey(float f) {
  if (isnan(f)) f = -INFINITY;
  if (f == 0.0f) f = 0.0f;
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__global__ void IotaKernel(int64_t tiles, int per_tile, int32_t* __restrict__ selected) {
  const int64_t n = tiles * per_tile;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    selected[i] = static_cast<int32_t>(i % per_tile);
}

constexpr int kTopKThreads = 512;

// One block per tile. The budget-th best candidate key is found by a 4-pass radix select (8 bits
// a pass, histograms in shared memory); then one ordered pass keeps every candidate above it and
// the lowest-indexed ones equal to it, writing them ascending after the sinks.
__global__ void __launch_bounds__(kTopKThreads)
    TopKKernel(const float* __restrict__ scores, int pages, int budget, int sinks, int per_tile,
               int32_t* __restrict__ selected) {
  using Scan = cub::BlockScan<int, kTopKThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ uint32_t hist[256];
  __shared__ uint32_t s_prefix, s_krem;
  const int tile = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const float* row = scores + static_cast<int64_t>(tile) * pages;
  int32_t* dst = selected + static_cast<int64_t>(tile) * per_tile;
  for (int i = tid; i < sinks; i += kTopKThreads) dst[i] = i;
  if (budget == 0) return;

  uint32_t prefix = 0u, mask = 0u, krem = static_cast<uint32_t>(budget);
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < 256; i += kTopKThreads) hist[i] = 0u;
    __syncthreads();
    for (int i = sinks + tid; i < pages; i += kTopKThreads) {
      const uint32_t k = OrderKey(row[i]);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 0xffu], 1u);
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l holds bins 255 - 8l .. 248 - 8l (best first).
      uint32_t c[8], sum = 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - lane * 8 - j];
        sum += c[j];
      }
      uint32_t incl = sum;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const uint32_t v = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += v;
      }
      const uint32_t excl = incl - sum;
      const unsigned ballot = __ballot_sync(0xffffffffu, excl < krem && krem <= incl);
      if (lane == __ffs(ballot) - 1) {
        uint32_t cum = excl;
        for (int j = 0; j < 8; ++j) {
          if (cum + c[j] >= krem) {
            s_prefix = prefix | (static_cast<uint32_t>(255 - lane * 8 - j) << shift);
            s_krem = krem - cum;
            break;
          }
          cum += c[j];
        }
      }
    }
    __syncthreads();
    prefix = s_prefix;
    krem = s_krem;
    mask |= 0xffu << shift;
  }
  // prefix = the key of the budget-th best; take krem of the keys equal to it (lowest first).
  int base_sel = 0, base_eq = 0;
  for (int start = sinks; start < pages; start += kTopKThreads) {
    const int i = start + tid;
    const uint32_t k = i < pages ? OrderKey(row[i]) : 0u;
    const int is_eq = (i < pages && k == prefix) ? 1 : 0;
    const int is_gt = (i < pages && k > prefix) ? 1 : 0;
    int eq_excl = 0, eq_total = 0;
    Scan(scan_tmp).ExclusiveSum(is_eq, eq_excl, eq_total);
    __syncthreads();
    const int sel = (is_gt || (is_eq && base_eq + eq_excl < static_cast<int>(krem))) ? 1 : 0;
    int sel_excl = 0, sel_total = 0;
    Scan(scan_tmp).ExclusiveSum(sel, sel_excl, sel_total);
    __syncthreads();
    if (sel) dst[sinks + base_sel + sel_excl] = i;
    base_sel += sel_total;
    base_eq += eq_total;
  }
}

}  // namespace

void PageSummary(const PagedKv<const bf16>& kv, bf16* summaries, cudaStream_t stream) {
  Require(kv.num_pages >= 0 && kv.num_pages < (int64_t{1} << 31), "page count");
  if (kv.num_pages == 0) return;
  const int hd = static_cast<int>(kv.shape.head_dim);
  Require(hd > 0 && hd % 2 == 0 && hd <= 2 * kThreads, "head_dim must be even and <= 512");
  Require(kv.shape.num_kv_heads > 0 && kv.shape.num_kv_heads < 65536 && kv.shape.page_tokens > 0,
          "page shape");
  Require(kv.pool != nullptr && kv.page_slot != nullptr && summaries != nullptr, "null pointer");
  const dim3 grid(static_cast<unsigned>(kv.num_pages),
                  static_cast<unsigned>(kv.shape.num_kv_heads));
  PageSummaryKernel<<<grid, kThreads, 0, stream>>>(
      kv.pool, kv.page_slot, kv.shape.page_elements(), static_cast<int>(kv.shape.page_tokens),
      static_cast<int>(kv.shape.num_kv_heads), hd, summaries);
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

size_t PageScoreWorkspaceBytes(int64_t tokens, int64_t num_kv_heads, int64_t head_dim,
                               int64_t query_tile) {
  if (tokens <= 0 || query_tile <= 0) return 0;
  const int64_t tiles = (tokens + query_tile - 1) / query_tile;
  return static_cast<size_t>(kSumSplits * tiles * num_kv_heads * head_dim) * sizeof(float);
}

void PageScore(const bf16* q, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t query_tile, const bf16* summaries, int64_t pages,
               float* scores, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  Require(query_tile > 0 && tokens >= 0 && tokens < (int64_t{1} << 31), "tokens / query tile");
  Require(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_kv_heads < 65536,
          "query heads must be a multiple of KV heads (GQA)");
  Require(head_dim > 0 && head_dim % 2 == 0 && head_dim <= 2 * kThreads,
          "head_dim must be even and <= 512");
  Require(pages >= 0 && pages < (int64_t{1} << 31), "page count");
  const int64_t tiles = (tokens + query_tile - 1) / query_tile;
  if (tiles == 0 || pages == 0) return;
  Require(q && summaries && scores && workspace, "null pointer");
  Require(workspace_bytes >= PageScoreWorkspaceBytes(tokens, num_kv_heads, head_dim, query_tile),
          "workspace too small");
  Require(tiles < 65536, "too many query tiles");
  float* qg = static_cast<float*>(workspace);
  const int64_t chunks = head_dim / 8;
  const bool vec =
      head_dim % 8 == 0 && (chunks & (chunks - 1)) == 0 && reinterpret_cast<uintptr_t>(q) % 16 == 0;
  const int splits = vec ? kSumSplits : 1;
  const dim3 sum_grid(static_cast<unsigned>(tiles), static_cast<unsigned>(num_kv_heads),
                      static_cast<unsigned>(splits));
  if (vec) {
    QueryTileSumVecKernel<<<sum_grid, kThreads, 0, stream>>>(
        q, static_cast<int>(tokens), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
        static_cast<int>(head_dim), static_cast<int>(query_tile), qg);
  } else {
    QueryTileSumKernel<<<sum_grid, kThreads, 0, stream>>>(
        q, static_cast<int>(tokens), static_cast<int>(num_heads), static_cast<int>(num_kv_heads),
        static_cast<int>(head_dim), static_cast<int>(query_tile), qg);
  }
  CTXPLAN_CUDA_CHECK_LAUNCH();
  const int kdim = static_cast<int>(num_kv_heads * head_dim);
  const size_t smem = static_cast<size_t>(kdim) * sizeof(float);
  Require(smem <= 48 * 1024, "H_kv * head_dim too large");
  const dim3 grid(static_cast<unsigned>((pages + kPagesPerBlock - 1) / kPagesPerBlock),
                  static_cast<unsigned>(tiles));
  PageScoreKernel<<<grid, kThreads, smem, stream>>>(qg, splits, summaries, static_cast<int>(pages),
                                                    kdim, scores);
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

int64_t PageTopK(const float* scores, int64_t tiles, int64_t pages, int64_t budget, int64_t sinks,
                 int32_t* selected, cudaStream_t stream) {
  Require(tiles >= 0 && pages >= 0 && budget >= 0 && sinks >= 0, "top-k arguments");
  Require(pages < (int64_t{1} << 31) && tiles < (int64_t{1} << 31), "top-k size");
  const int64_t per_tile = std::min(pages, sinks + budget);
  if (tiles == 0 || per_tile == 0) return per_tile;
  Require(selected != nullptr, "null selection");
  if (pages <= sinks + budget) {
    const int64_t n = tiles * per_tile;
    const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 4096);
    IotaKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
        tiles, static_cast<int>(per_tile), selected);
    CTXPLAN_CUDA_CHECK_LAUNCH();
    return per_tile;
  }
  Require(scores != nullptr, "null scores");
  TopKKernel<<<static_cast<unsigned>(tiles), kTopKThreads, 0, stream>>>(
      scores, static_cast<int>(pages), static_cast<int>(budget), static_cast<int>(sinks),
      static_cast<int>(per_tile), selected);
  CTXPLAN_CUDA_CHECK_LAUNCH();
  return per_tile;
}

}  // namespace ctxplan::kernels::cuda
