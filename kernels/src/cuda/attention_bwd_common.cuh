// Paged attention backward: what its kernels (attention_bwd_kernels.cuh) and launch
// (attention_bwd.cu) share: the launch parameters, which keys a block owns, the copies into shared
// memory, the page-sparse selection's scan, and the dK/dV epilogue's row adders. The method is
// told at the top of attention_bwd_kernels.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "attention_common.cuh"
#include "ctxplan/kernels/cuda/attention.h"

namespace ctxplan::kernels::cuda::bwd {

using namespace detail;

constexpr int kBwdBN = 128;  // keys per block
constexpr int kBwdBM = 64;   // queries per inner tile
constexpr int kBwdThreads = 256;
constexpr int kMaxBwdSmem = 227 * 1024;  // a block's dynamic shared memory on sm_90

inline int64_t PadTokens(int64_t t) {
  return (t + kBwdBM - 1) / kBwdBM * kBwdBM;
}
inline size_t Align256(size_t x) {
  return (x + 255) / 256 * 256;
}

struct BwdParams {
  const bf16* q;
  const bf16* k_own;
  const bf16* v_own;
  const bf16* pool;
  const int32_t* page_slot;
  const int32_t* sel;  // [sel_tiles][sel_stride] or nullptr
  const bf16* d_out;
  const float* lse2;   // [hq][t_pad], lse * log2(e)
  const float* delta;  // [hq][t_pad]
  float* dq_acc;       // [t_pad][hq][HD], or tiled (DqTileOffset) in the pipelined kernel
  bf16* dk_own;
  bf16* dv_own;
  void* dkv_pool;
  const int32_t* dkv_slot;
  int64_t page_elems;
  int64_t sel_stride;
  int dkv_f32;
  int t, t_pad, hq, hkv, group;
  int p, num_pages, query_tile, sel_tiles;
  int n_earlier_blocks, n_q_tiles;
  float scale, scale_log2;
  const int32_t* union_pages;  // [n_union] or nullptr: earlier key blocks cover these pages only
  int n_union;
  // Page-sparse earlier keys gathered by selection tile (AttnBwdWgmmaKernel's kGather): the
  // 128-key groups of one tile's selected positions (sel_stride * p keys) a tile has.
  int gather_groups;
  // Optional: the dKV that later chunks left in the own positions' pages (fp32 or bf16 as
  // dkv_f32), added into dk_own / dv_own as they are written (DkvAccumulate, fused).
  const void* own_dkv_pool;
  const int32_t* own_dkv_slot;  // [own pages]
  int own_p;
  int64_t own_page_elems;
  int own_first;  // every KV head's own blocks before any earlier block (LocateKeyBlock)
  // Own key blocks one a query head (the kernels' kSplitOwn, with own_first; SplitsOwnHeads):
  // their dK (scaled) and dV added by fp32 atomics into own_dkv_acc, [2][t][hkv][HD] (dK, then
  // dV), which a second kernel writes out as an unsplit block would have.
  float* own_dkv_acc;
};

// The key block a thread block owns (a one-dimensional grid): with own_first, every KV head's own
// key blocks first (own block 0 sees every query: the heaviest), then KV head by KV head the
// earlier ones; else KV head by KV head, own blocks then earlier ones. Own blocks first
// measured 1.12-1.23x for gathered blocks at head dim 128 and 1.02-1.04x dense at 64 (each KV
// head's heaviest own blocks no longer wait for the earlier KV heads' page blocks), but 0.87-0.97x
// for key blocks over the union's pages, which keep KV head by KV head (kernels/PERF.md). Earlier
// blocks lie over every earlier position, the union's pages only, or gathered. Over the union a
// block never holds two pages: a page is ceil(p / BN) blocks, the last one cut at the page's end
// (pages of 96 keys are one 128-key block three quarters full), because tiles select pages
// independently: a block across two pages computes every item of either page, half of it masked. KV
// heads outermost keep the blocks resident at one time on one head's queries (Q, dO and the dQ
// accumulator of one head group: 29 MB at t = 4096, within the L2). Other orders (KV head fastest,
// heaviest blocks first) measured no better (kernels/PERF.md).
struct KeyBlock {
  int hkv;
  bool earlier;
  int kb0;  // first key: an own position, or an index into the earlier positions
  int end;  // keys from `end` on are not this block's (past the chunk, the pages or its page)
  // A gathered block: the selection tile's page list [sel_stride]; kb0 and end then index the
  // tile's selected positions (page gathered[i / p], row i % p). nullptr otherwise.
  const int32_t* gathered = nullptr;
  int sel_tile = 0;
  // An own block of one query head (kSplitOwn), -1 for the whole GQA group.
  int head = -1;
  // Over the union's 64-key halves (kHalves): the first key of warpgroup w's half, -1 past the
  // union's last half. The two may lie on different pages.
  int half_key0[2] = {-1, -1};
  __device__ int FirstHead(int group) const { return head >= 0 ? head : hkv * group; }
};
// Over the union (kOverUnion) is a template parameter: reading the union's page list at the
// block's start, even behind a branch never taken, made the dense backward's main loop compile
// slower (kernels/PERF.md).
// Gathered (kGather): the earlier blocks are the selection tiles' 128-key groups, a tile's
// groups side by side (they read the same Q and dO and add into the same dQ in the L2).
// Halves (kHalves: at head_dim 64, pages of an odd number of 64-key halves past 64, i.e. 192): the
// union's pages cut into 64-key halves, a block two consecutive halves (one a warpgroup), so that
// no block is part full; the two halves of a block may be of two pages.
template <int BN, bool kOverUnion, bool kGather = false, bool kSplitOwn = false,
          bool kHalves = false>
__device__ __forceinline__ KeyBlock LocateKeyBlock(const BwdParams& prm) {
  const int own_blocks = (prm.t + BN - 1) / BN;
  int b = static_cast<int>(blockIdx.x), hkv = 0;
  if (prm.own_first) {
    // Split, the own blocks go query head by query head: the blocks resident together add into
    // one head's dQ and read one head's Q and dO, which stay in the L2.
    const int own_units = kSplitOwn ? prm.hq : prm.hkv;
    const int own_all = own_blocks * own_units;
    if (b < own_all) {
      const int unit = b / own_blocks;
      KeyBlock own{kSplitOwn ? unit / prm.group : unit, false, (b - unit * own_blocks) * BN, prm.t};
      if (kSplitOwn) own.head = unit;
      return own;
    }
    hkv = (b - own_all) / prm.n_earlier_blocks;
    b = b - own_all - hkv * prm.n_earlier_blocks + own_blocks;
  } else {
    const int per_head = own_blocks + prm.n_earlier_blocks;
    hkv = b / per_head;
    b -= hkv * per_head;
    if (b < own_blocks) return {hkv, false, b * BN, prm.t};
  }
  const int eb = b - own_blocks;
  if constexpr (kGather) {
    const int st = eb / prm.gather_groups;
    return {hkv,
            true,
            (eb - st * prm.gather_groups) * BN,
            static_cast<int>(prm.sel_stride) * prm.p,
            prm.sel + static_cast<int64_t>(st) * prm.sel_stride,
            st};
  } else if constexpr (!kOverUnion) {
    return {hkv, true, eb * BN, prm.num_pages * prm.p};
  } else if constexpr (kHalves) {
    static_assert(BN == 128, "two 64-key halves a block");
    const int per_page = prm.p / 64;
    const int n_halves = prm.n_union * per_page;
    KeyBlock halves{hkv, true, 0, 0};
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const int half = 2 * eb + w;
      halves.half_key0[w] = half < n_halves ? __ldg(prm.union_pages + half / per_page) * prm.p +
                                                  (half % per_page) * 64
                                            : -1;
    }
    halves.kb0 = halves.half_key0[0];
    halves.end = halves.kb0 + 64;
    return halves;
  } else {
    const int per_page = (prm.p + BN - 1) / BN;
    const int page_start = __ldg(prm.union_pages + eb / per_page) * prm.p;
    return {hkv, true, page_start + (eb % per_page) * BN, page_start + prm.p};
  }
}

// The earlier page of a block's key kidx: of the position, or of a gathered block's kidx-th
// selected position (its row is kidx % p either way).
__device__ __forceinline__ int EarlierPage(const BwdParams& prm, const int32_t* gathered,
                                           int kidx) {
  return gathered != nullptr ? __ldg(gathered + kidx / prm.p) : kidx / prm.p;
}

// Where key kidx's dK row of KV head kv_head starts in the dKV pool (elements; kv_row = H_kv d_h);
// its dV row is p * kv_row further, in the same page slot.
__device__ __forceinline__ int64_t DkvPoolRow(const BwdParams& prm, const int32_t* gathered,
                                              int kidx, int kv_head, int64_t kv_row, int head_dim) {
  const int64_t slot = __ldg(prm.dkv_slot + EarlierPage(prm, gathered, kidx));
  return slot * prm.page_elems + (kidx % prm.p) * kv_row + kv_head * head_dim;
}

// Where key kidx's K row of KV head kv_head starts in the KV pool (elements), its page `page`;
// its V row is p * kv_row further, in the same page slot (as DkvPoolRow in the dKV pool).
__device__ __forceinline__ int64_t KvPoolRow(const BwdParams& prm, int page, int kidx, int kv_head,
                                             int64_t kv_row, int head_dim) {
  const int64_t slot = __ldg(prm.page_slot + page);
  return slot * prm.page_elems + (kidx % prm.p) * kv_row + kv_head * head_dim;
}

// K and V rows of a key block into shared memory (cp.async, once per block): the own positions
// from k_own / v_own, earlier ones through the page table (gathered: the tile's selected
// positions); rows past the region or on pages no tile of the block selected are zero-filled.
// offset(row, c): the byte offset of 16-byte chunk c of row `row` in the kernel's tile layout.
// The copies are committed as a group of their own: cp.async.wait_group waits for committed
// groups only (uncommitted, a block read K and V before they had landed, and dK and dV at d_h 128
// differed run to run: GpuAttention.DenseBackwardRepeatsItself).
template <int HD, int BN, int kThreads, typename Offset>
__device__ __forceinline__ void LoadKeyBlockKv(const BwdParams& prm, int kb0, bool earlier,
                                               int region_end, uint32_t union_mask, int first_page,
                                               int hkv, int64_t kv_row, uint32_t sK, uint32_t sV,
                                               Offset offset, const int32_t* gathered = nullptr) {
  constexpr int kChunks = HD / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  const int tid = threadIdx.x;
  const int c = tid % kChunks;
#pragma unroll 4
  for (int i = 0; i < BN / kRowsPerPass; ++i) {
    const int row = i * kRowsPerPass + tid / kChunks;
    const int kidx = kb0 + row;
    bool valid = kidx < region_end;
    const bf16* ksrc = prm.k_own;
    const bf16* vsrc = prm.v_own;
    if (earlier) {
      const int pg = valid ? EarlierPage(prm, gathered, kidx) : 0;
      valid = valid && (gathered != nullptr || ((union_mask >> (pg - first_page)) & 1u));
      if (valid) {
        ksrc = prm.pool + KvPoolRow(prm, pg, kidx, hkv, kv_row, HD) + c * 8;
        vsrc = ksrc + prm.p * kv_row;
      }
    } else if (valid) {
      ksrc = prm.k_own + kidx * kv_row + hkv * HD + c * 8;
      vsrc = prm.v_own + kidx * kv_row + hkv * HD + c * 8;
    }
    CpAsync16(sK + offset(row, c), ksrc, valid);
    CpAsync16(sV + offset(row, c), vsrc, valid);
  }
  CpAsyncCommit();
}

// K and V of a block over the union's halves (kHalves): rows 64 w.. from half_key0[w]'s page,
// zero-filled past the union's last half. Committed as LoadKeyBlockKv's are.
template <int HD, int kThreads, typename Offset>
__device__ __forceinline__ void LoadHalvesKv(const BwdParams& prm, const int (&half_key0)[2],
                                             int hkv, int64_t kv_row, uint32_t sK, uint32_t sV,
                                             Offset offset) {
  constexpr int kChunks = HD / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  const int tid = threadIdx.x;
  const int c = tid % kChunks;
#pragma unroll 4
  for (int i = 0; i < 128 / kRowsPerPass; ++i) {
    const int row = i * kRowsPerPass + tid / kChunks;
    const int key0 = row < 64 ? half_key0[0] : half_key0[1];
    const bool valid = key0 >= 0;
    const bf16* ksrc = prm.pool;
    const bf16* vsrc = prm.pool;
    if (valid) {
      const int kidx = key0 + (row & 63);
      ksrc = prm.pool + KvPoolRow(prm, kidx / prm.p, kidx, hkv, kv_row, HD) + c * 8;
      vsrc = ksrc + prm.p * kv_row;
    }
    CpAsync16(sK + offset(row, c), ksrc, valid);
    CpAsync16(sV + offset(row, c), vsrc, valid);
  }
  CpAsyncCommit();
}

// One item's operands into buffer `buf`: the Q and dO rows of the 64 queries from q0 of query head
// h (rows past t zero-filled; at sQ / sdO + buf * kBufBytes), and their LSE2 and D (16 chunks
// each, at sL / sD + buf * BM * 4). offset(row, c) as in LoadKeyBlockKv.
template <int HD, int BM, int kThreads, int kBufBytes, typename Offset>
__device__ __forceinline__ void LoadItemOperands(const BwdParams& prm, int h, int q0, uint32_t sQ,
                                                 uint32_t sdO, uint32_t sL, uint32_t sD, int buf,
                                                 Offset offset) {
  constexpr int kChunks = HD / 8;
  constexpr int kRowsPerPass = kThreads / kChunks;
  const int tid = threadIdx.x;
  const int c = tid % kChunks;
#pragma unroll
  for (int i = 0; i < BM / kRowsPerPass; ++i) {
    const int row = i * kRowsPerPass + tid / kChunks;
    const int qi = q0 + row;
    const bool valid = qi < prm.t;
    const int64_t off = valid ? (static_cast<int64_t>(qi) * prm.hq + h) * HD + c * 8 : 0;
    CpAsync16(sQ + buf * kBufBytes + offset(row, c), prm.q + off, valid);
    CpAsync16(sdO + buf * kBufBytes + offset(row, c), prm.d_out + off, valid);
  }
  if (tid < 2 * (BM / 4)) {  // 16 chunks of LSE, 16 of D
    const int which = tid / (BM / 4), c4 = tid % (BM / 4);
    const float* src =
        (which ? prm.delta : prm.lse2) + static_cast<int64_t>(h) * prm.t_pad + q0 + c4 * 4;
    CpAsync16((which ? sD : sL) + buf * BM * 4 + c4 * 16, src, true);
  }
}

__device__ __forceinline__ bool ListContains(const int32_t* list, int n, int page) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    const int v = __ldg(list + mid);
    if (v < page) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo < n && __ldg(list + lo) == page;
}

// Page-sparse key block: which of its pages each selection tile selected (s_mask[tile], bit i =
// page first_page + i) and their union, which it returns (0: no tile attends these keys).
template <int kThreads, int BN>
__device__ __forceinline__ uint32_t ScanSelections(const BwdParams& prm, int kb0, int end,
                                                   int first_page, uint32_t* s_mask,
                                                   uint32_t* s_union) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) *s_union = 0u;
  __syncthreads();
  const int last_page = (min(kb0 + BN, end) - 1) / prm.p;
  uint32_t local_union = 0u;
  for (int st = tid; st < prm.sel_tiles; st += kThreads) {
    const int32_t* list = prm.sel + static_cast<int64_t>(st) * prm.sel_stride;
    uint32_t m = 0u;
    for (int pg = first_page; pg <= last_page; ++pg)
      if (ListContains(list, static_cast<int>(prm.sel_stride), pg)) m |= 1u << (pg - first_page);
    s_mask[st] = m;
    local_union |= m;
  }
  if (local_union) atomicOr(s_union, local_union);
  __syncthreads();
  return *s_union;
}

// The same for a block over the union's halves (kHalves): bit w, tile selected warpgroup w's
// half's page.
template <int kThreads>
__device__ __forceinline__ uint32_t ScanHalves(const BwdParams& prm, const int (&half_key0)[2],
                                               uint32_t* s_mask, uint32_t* s_union) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) *s_union = 0u;
  __syncthreads();
  const int page0 = half_key0[0] / prm.p;
  const int page1 = half_key0[1] >= 0 ? half_key0[1] / prm.p : -1;
  const int n = static_cast<int>(prm.sel_stride);
  uint32_t local_union = 0u;
  for (int st = tid; st < prm.sel_tiles; st += kThreads) {
    const int32_t* list = prm.sel + static_cast<int64_t>(st) * prm.sel_stride;
    uint32_t m = ListContains(list, n, page0) ? 1u : 0u;
    if (page1 == page0) {
      m |= m << 1;
    } else if (page1 >= 0 && ListContains(list, n, page1)) {
      m |= 2u;
    }
    s_mask[st] = m;
    local_union |= m;
  }
  if (local_union) atomicOr(s_union, local_union);
  __syncthreads();
  return *s_union;
}

// The 64-query tiles a page-sparse key block serves, ascending: those whose selection tile
// picked one of its pages (s_mask[selection tile] != 0). Warp 0 compacts them into s_tiles with
// ballots; every thread gets the count after the barrier. The block then steps through the list
// in O(1) per item: scanning the tiles one by one (with an integer division each) for the next
// selected one cost ~45 instructions per skipped tile, twice per item; at a 64K context's last
// chunk, 64 pages per tile out of 480, that was a third of the sparse backward's instructions.
template <typename TileIndex>
__device__ int CollectSelectedTiles(const uint32_t* s_mask, int n_q_tiles, int tiles_per_sel,
                                    TileIndex* s_tiles, int* s_count) {
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x);
    int count = 0;
    for (int base = 0; base < n_q_tiles; base += 32) {
      const int qt = base + lane;
      const bool take = qt < n_q_tiles && s_mask[qt / tiles_per_sel] != 0u;
      const uint32_t ballot = __ballot_sync(0xffffffffu, take);
      if (take) s_tiles[count + __popc(ballot & ((1u << lane) - 1u))] = static_cast<TileIndex>(qt);
      count += __popc(ballot);
    }
    if (lane == 0) *s_count = count;
  }
  __syncthreads();
  return *s_count;
}

// One key row's dK (already scaled) and dV, kPairs pairs each (pair i at element 8 i), added to
// the values at ksrc / vsrc and stored at kdst / vdst (fp32 or bf16 each; the same place for the
// dKV pool's read-add-write). The old values of a pass are all loaded before any is stored: the
// compiler may not move a load above a store that may alias it (V's offset is a runtime page
// stride), so pair by pair each load waited a full memory round trip, 32 in a row per key row.
__device__ __forceinline__ float2 LoadPair(const float* p) {
  return *reinterpret_cast<const float2*>(p);
}
__device__ __forceinline__ float2 LoadPair(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ void StorePair(float* p, float2 v) {
  *reinterpret_cast<float2*>(p) = v;
}
__device__ __forceinline__ void StorePair(bf16* p, float2 v) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(v.x, v.y);
}
template <int kPairs, typename Src, typename Dst, typename KPair, typename VPair>
__device__ __forceinline__ void AddRow(const Src* ksrc, const Src* vsrc, Dst* kdst, Dst* vdst,
                                       KPair dk, VPair dv) {
  constexpr int kPass = 8;
  static_assert(kPairs % kPass == 0);
#pragma unroll
  for (int i0 = 0; i0 < kPairs; i0 += kPass) {
    float2 ko[kPass], vo[kPass];
#pragma unroll
    for (int j = 0; j < kPass; ++j) {
      ko[j] = LoadPair(ksrc + (i0 + j) * 8);
      vo[j] = LoadPair(vsrc + (i0 + j) * 8);
    }
#pragma unroll
    for (int j = 0; j < kPass; ++j) {
      const float2 k = dk(i0 + j), v = dv(i0 + j);
      StorePair(kdst + (i0 + j) * 8, make_float2(ko[j].x + k.x, ko[j].y + k.y));
      StorePair(vdst + (i0 + j) * 8, make_float2(vo[j].x + v.x, vo[j].y + v.y));
    }
  }
}
template <int kPairs, typename T, typename KPair, typename VPair>
__device__ __forceinline__ void AddRowIntoPool(T* pool, int64_t kofs, int64_t vofs, KPair dk,
                                               VPair dv) {
  AddRow<kPairs>(pool + kofs, pool + vofs, pool + kofs, pool + vofs, dk, dv);
}
// The same by atomic adds, for gathered blocks: the tiles that selected a page add into its dKV
// from different blocks (in an order that varies from run to run; a bf16 pool rounds each add).
__device__ __forceinline__ void AtomicAddPair(float* p, float2 v) {
  atomicAdd(reinterpret_cast<float2*>(p), v);
}
__device__ __forceinline__ void AtomicAddPair(bf16* p, float2 v) {
  atomicAdd(reinterpret_cast<__nv_bfloat162*>(p), __floats2bfloat162_rn(v.x, v.y));
}
template <int kPairs, typename T, typename KPair, typename VPair>
__device__ __forceinline__ void AtomicAddRowIntoPool(T* pool, int64_t kofs, int64_t vofs, KPair dk,
                                                     VPair dv) {
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    AtomicAddPair(pool + kofs + i * 8, dk(i));
    AtomicAddPair(pool + vofs + i * 8, dv(i));
  }
}

// Writes one own key row's dK (already scaled) and dV, kPairs bf16 pairs each, adding the dKV
// that later chunks left in the row's own page when prm.own_dkv_pool is set: the fused
// DkvAccumulate, rounded once to bf16 instead of twice.
template <int kPairs, typename KPair, typename VPair>
__device__ __forceinline__ void StoreOwnRow(const BwdParams& prm, int kidx, int64_t col, KPair dk,
                                            VPair dv) {
  const int64_t kv_row = static_cast<int64_t>(prm.hkv) * (kPairs * 8);
  bf16* dkr = prm.dk_own + kidx * kv_row + col;
  bf16* dvr = prm.dv_own + kidx * kv_row + col;
  if (prm.own_dkv_pool == nullptr) {
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      StorePair(dkr + i * 8, dk(i));
      StorePair(dvr + i * 8, dv(i));
    }
    return;
  }
  const int pg = kidx / prm.own_p, off = kidx - pg * prm.own_p;
  const int64_t kofs =
      static_cast<int64_t>(__ldg(prm.own_dkv_slot + pg)) * prm.own_page_elems + off * kv_row + col;
  const int64_t vofs = kofs + static_cast<int64_t>(prm.own_p) * kv_row;
  if (prm.dkv_f32) {
    const float* pool = static_cast<const float*>(prm.own_dkv_pool);
    AddRow<kPairs>(pool + kofs, pool + vofs, dkr, dvr, dk, dv);
  } else {
    const bf16* pool = static_cast<const bf16*>(prm.own_dkv_pool);
    AddRow<kPairs>(pool + kofs, pool + vofs, dkr, dvr, dk, dv);
  }
}

}  // namespace ctxplan::kernels::cuda::bwd
