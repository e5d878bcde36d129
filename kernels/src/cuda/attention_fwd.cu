// Paged attention forward for sm_90a: bf16 operands, fp32 accumulation, online softmax.
//
// The keys a block of 128 queries sees form one virtual sequence: its earlier pages (every page, or
// the tile's selected pages, in list order) followed by the chunk's own positions
// 0..min(q0 + 128, t) - 1. That sequence is walked in key tiles gathered through the page table
// (by TMA or cp.async into an XOR-swizzled shared tile, K and V double-buffered, the next tiles'
// copies in flight while the current one is computed). Masking is applied only on
// the tiles that need it (the diagonal, the end of the chunk, a partial page list). Blocks are
// launched heaviest first (the last query tiles see the most own keys).
//
// AttnFwdWarpSpecializedKernel: a loader warpgroup and two (or, at d_h 64, three) compute
// warpgroups x 64 query rows on mbarriers, 128-key tiles, S = Q K^T and O += P V on wgmma (Hopper
// warpgroup MMA), P from registers, the compute warpgroups taking turns on the tensor cores. (A
// FlashAttention-2 style mma.sync kernel served as a fallback and comparison until 2026-11-27:
// kernels/PERF.md.) A key tile of earlier positions is gathered page by page, rows p-contiguous
// with stride H_kv * d_h within a page: TMA boxes of 32-128 rows when 32 divides p, cp.async groups
// of 16 rows when 16 does (their pages read a tile ahead), a per-thread cursor otherwise.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention_common.cuh"
#include "attention_wgmma.cuh"
#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ops_util.cuh"
#include "page_row_cursor.h"
#include "tensor_map.h"

namespace ctxplan::kernels::cuda {
namespace {

using namespace detail;

// The page size passed where a chunk has no earlier pages: any nonzero value (the loaders divide
// by it).
constexpr int kNoPageTokens = 64;

struct FwdParams {
  const bf16* q;
  const bf16* k_own;
  const bf16* v_own;
  const bf16* pool;          // earlier pages [slots][2][p][H_kv][d_h]
  const int32_t* page_slot;  // [num_pages]
  const int32_t* sel;        // [tiles][sel_stride] or nullptr (dense)
  bf16* out;
  float* lse;
  int64_t page_elems;  // 2 * p * H_kv * d_h
  int64_t sel_stride;  // pages_per_tile
  int t, hq, hkv, group;
  int p, num_pages, query_tile;
  int q_tiles;
  int slice_blocks;  // kSlices: blocks a KV head of a 128-query tile (ForwardSliceBlocks)
  float scale_log2;
  float rescale_log2;  // a row's stabiliser moves where its max passes it by more (log2 units)
};

// --- warp-specialised wgmma forward (sm_90a, FlashAttention-3 style) -----------------------------
// One block = 64 queries a consumer of one head; keys in tiles of 128. Warpgroup 0 only
// loads (Q, then K_j and V_j into two buffers each; a tile's `full` mbarrier completes when its
// TMA bytes and its loader threads' cp.async copies have landed), warpgroups 1.. only compute,
// 64 query rows each, and release a buffer through its `empty` mbarrier as soon as their GEMM on it
// has completed; no block-wide barrier after the prologue. S = Q K^T and O += P V run on wgmma: Q
// and K from shared memory (K-major), P from registers (the S accumulators converted in place to
// the A-operand layout), V from shared memory as a transposed (MN-major) B operand. Tiles are [d_h
// / 64][rows][64] with the 128-byte swizzle (16-byte chunk c of row r at c ^ (r & 7)), the
// canonical wgmma layout. Per consumer, iteration j: issue S_j and P_{j-1} V_{j-1}, wait for S_j,
// softmax while P_{j-1} V_{j-1} runs, then rescale O and pack P_j; a named barrier each makes the
// consumers take turns issuing, in a ring ("ping-pong"), so one's softmax runs while the others'
// GEMMs use the tensor cores. The loader gives registers to the consumers (setmaxnreg). Q and the
// chunk's own keys come by TMA (one copy a block's rows or 128 keys, 64 columns, a box), issued by
// loader warp 0. Earlier pages, by the loader kind (FwdPageLoader): when 32 divides p (16, under
// three consumers), a TMA box a group of the largest power of two dividing p (up to the tile), lane
// g of warp 0 reading group g's page a tile ahead; else when 16 divides p, eight 16-row groups
// copied by all four loader warps with cp.async, their row pointers computed by lanes 0-7 from
// page-table reads issued a tile ahead and handed to the warp by shuffle; other p (>= 16) walked by
// a cursor per thread (page_row_cursor.h) that reads the page table once a page, a page ahead. The
// cp.async copies must stay cheap (a running pointer or a shuffled one, not the row address
// recomputed per copy, and no page-table read waited on inside a tile): the four loader warps were
// the bound otherwise; and loader warps with nothing to copy leave rather than spin on the
// barriers. Numbers in kernels/PERF.md. Consumers: two (128 queries a block), or three (192
// queries) at d_h 64 without a page selection where their longer blocks still fill the waves
// (AttentionForwardQueryRows, cost.h, the rule the planner shares). At d_h 64 a tile's exponentials
// take the MUFU units as long as its GEMMs take the tensor cores, and each consumer's S -> softmax
// -> next S chain must hide under the others' GEMMs: two left no slack (FlashAttention-3 takes 192
// x 128 tiles at d_h 64 too). Three hold 160 registers a consumer thread (s, P and O alone are
// 128), leaving the loader 32.
constexpr int kWsBM = 128, kWsBN = 128;
constexpr int kWsLoaderThreads = 128;
template <int NC>
struct FwdRoles {
  static constexpr int kBM = 64 * NC;  // query rows of a block, 64 a consumer
  static constexpr int kThreads = kWsLoaderThreads + 128 * NC;
  static constexpr int kLoaderRegisters = NC == 2 ? 56 : 32;
  static constexpr int kConsumerRegisters = NC == 2 ? 224 : 160;
  static_assert(NC == 2 || NC == 3, "two or three consumer warpgroups");
  static_assert(kLoaderRegisters * kWsLoaderThreads +
                        kConsumerRegisters * (kThreads - kWsLoaderThreads) <=
                    65536,
                "the register file holds both roles");
};
constexpr int kTurnBarrier = 1;    // + consumer index: that consumer may issue its GEMMs
constexpr int kTurnThreads = 256;  // the consumer taking its turn and the one handing it over
// kTurnBarrier + NC + consumer index: the consumer's 128 threads, around the O staging

template <int HD, int BM>
struct WsSmem {  // tiles [HD / 64][rows][64] bf16, 128-byte swizzle
  static constexpr int kQBytes = BM * HD * 2;
  static constexpr int kTile = kWsBN * HD * 2;
  static constexpr int kQ = 0;                         // Q [HD / 64][BM queries][64]
  static constexpr int kK = kQBytes;                   // K [2 buffers][HD / 64][128 keys][64]
  static constexpr int kV = kK + 2 * kTile;            // V [2 buffers][HD / 64][128 keys][64]
  static constexpr int kBars = kV + 2 * kTile;         // full K, full V, empty K, empty V: 2 each
  static constexpr int kBytes = kBars + 8 * 8 + 1024;  // + alignment slack
};

enum class FwdPageLoader { kTmaGroups, kGroupsOf16, kRowCursor };
constexpr int kGroupRows = 16;  // kGroupsOf16: rows of a tile that share one page
// kTmaGroups: the largest power of two dividing p, up to a tile; 16-row boxes ran at 0.89x of the
// cp.async groups (kernels/PERF.md), so pages need a multiple of 32.
constexpr int kTmaMinGroupRows = 32;
__host__ __device__ constexpr int TmaGroupRows(int p) {
  return (p & -p) < 128 ? (p & -p) : 128;
}

// The loader's tensor maps (pool: kTmaGroups only). Boxes of 64 columns (128 bytes, the
// swizzle's row):
struct FwdTensorMaps {
  CUtensorMap q;      // [t][H_q][d_h], box 128 queries of one head
  CUtensorMap k_own;  // [t][H_kv][d_h], box 128 keys of one KV head
  CUtensorMap v_own;  // same
  CUtensorMap pool;   // [slots * 2][p][H_kv][d_h] (K of slot s at 2 s, V at 2 s + 1), box a group
};

// kSlices (d_h 64 page-sparse, three consumers): a block's consumers take 64-query slices of one
// 128-query tile (so one page selection) from the query heads of one GQA group, blocks of two or
// three (ForwardSliceBlockAt, cost.h), consumer c taking the block's slice c. The keys (the
// tile's pages, then the own positions to the tile's end) are the same for every slice, loaded
// once for the block.
template <int HD, int NC, FwdPageLoader kLoader, bool kSlices = false>
__global__ void __launch_bounds__(FwdRoles<NC>::kThreads, 1)
    AttnFwdWarpSpecializedKernel(const FwdParams prm, const __grid_constant__ FwdTensorMaps maps) {
  static_assert(!kSlices || (HD == 64 && NC == 3), "query-head slices: d_h 64, three consumers");
  constexpr int BM = FwdRoles<NC>::kBM, BN = kWsBN;
  using L = WsSmem<HD, BM>;
  constexpr int kChunks = HD / 8;
  constexpr int kRowsPerPass = kWsLoaderThreads / kChunks;
  constexpr int kOn = HD / 2;  // O accumulators per thread
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = SmemAddr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t sQ = base + L::kQ, sK = base + L::kK, sV = base + L::kV;
  auto full_k = [&](int b) { return base + L::kBars + 8 * b; };
  auto full_v = [&](int b) { return base + L::kBars + 16 + 8 * b; };
  auto empty_k = [&](int b) { return base + L::kBars + 32 + 8 * b; };
  auto empty_v = [&](int b) { return base + L::kBars + 48 + 8 * b; };

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int role = warp >> 2;                                       // 0 loader, 1.. consumers
  const int tile = prm.q_tiles - 1 - static_cast<int>(blockIdx.x);  // heaviest first
  // The block's query rows: BM of head h, or (kSlices) 64-row slices of one 128-query tile.
  constexpr int kTileRows = kSlices ? kWsBM : BM;
  const int hkv = kSlices ? static_cast<int>(blockIdx.y) / prm.slice_blocks
                          : static_cast<int>(blockIdx.y) / prm.group;
  const ForwardSliceBlock slices =
      kSlices ? ForwardSliceBlockAt(prm.group, static_cast<int>(blockIdx.y) % prm.slice_blocks)
              : ForwardSliceBlock{0, NC};
  const int active = slices.slices, first_slice = slices.first_slice;
  // Consumer c's query head and first row within the tile.
  auto head_of = [&](int c) {
    return kSlices ? hkv * prm.group + (first_slice + c) / 2 : static_cast<int>(blockIdx.y);
  };
  auto rows_of = [&](int c) { return kSlices ? 64 * ((first_slice + c) & 1) : 64 * c; };
  const int q0 = tile * kTileRows;
  const int t = prm.t;
  const int64_t kv_row = static_cast<int64_t>(prm.hkv) * HD;

  const int32_t* sel_list =
      prm.sel ? prm.sel + static_cast<int64_t>(q0 / prm.query_tile) * prm.sel_stride : nullptr;
  const int n_pages_b = prm.sel ? static_cast<int>(prm.sel_stride) : prm.num_pages;
  const int n_e = n_pages_b * prm.p;
  const int own_end = min(q0 + kTileRows, t);
  const int ne_tiles = (n_e + BN - 1) / BN;
  const int n_tiles = ne_tiles + (own_end + BN - 1) / BN;

  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      MbarInit(full_k(b), kWsLoaderThreads);
      MbarInit(full_v(b), kWsLoaderThreads);
      MbarInit(empty_k(b), 128 * active);
      MbarInit(empty_v(b), 128 * active);
    }
  }
  __syncthreads();

  if (role == 0) {  // --- loader ---
    SetMaxRegistersDec<FwdRoles<NC>::kLoaderRegisters>();
    constexpr bool kTmaPages = kLoader == FwdPageLoader::kTmaGroups;
    const int pg = prm.p;
    // Q, the chunk's own K/V tiles and (kTmaGroups) earlier pages come by TMA: loader warp 0
    // issues the copies (a 64-column half a copy), thread 0 adds their bytes to the tile's `full`
    // barrier and arrives for all 128 loader threads. Other earlier tiles are copied by cp.async
    // from all 128 threads, each arriving when its copies land; warps 1-3 leave once those tiles
    // are issued (spinning on the `empty` barriers, they took issue slots from the consumers).
    const int cp_tiles = kTmaPages ? 0 : ne_tiles;
    if (warp != 0 && cp_tiles == 0) return;
    auto slot_of = [&](int li) -> int {
      const int page = sel_list ? __ldg(sel_list + li) : li;
      return __ldg(prm.page_slot + page);
    };
    if (tid == 0) {
      TmaPrefetchMap(&maps.q);
      TmaPrefetchMap(&maps.k_own);
      TmaPrefetchMap(&maps.v_own);
      if (kTmaPages && n_e > 0) TmaPrefetchMap(&maps.pool);
    }
    // The loader's issue rate bounds the kernel where the 128 threads copy (4 warps issue every
    // copy): a row's address is a pointer handed over (or the previous one) plus a fixed step,
    // its shared offset a constant.
    const int c = tid % kChunks, r0 = tid / kChunks;
    const int64_t step = static_cast<int64_t>(kRowsPerPass) * kv_row;
    // Groups of a tile's rows that lie in one page: kGroupsOf16 (p a multiple of 16) 16 rows, lane
    // g of every loader warp (g = lane % 8) holding group g's pointer (K row 0 of the group, head
    // hkv) for the tile of K being loaded (group_k) and for the tile of V (group_v, the one
    // before), nullptr past the pages; kTmaGroups (p a multiple of 32) groups of the largest
    // power of two dividing p (up to 128), lane g of warp 0 holding group g's slot and offset.
    // The page-table reads for the next tile are issued a tile before their use.
    const int group_rows = kTmaPages ? TmaGroupRows(pg) : kGroupRows;
    const int n_groups = BN / group_rows;
    const int group = kTmaPages ? lane : lane & (BN / kGroupRows - 1);
    int pending_slot = -1, pending_offset = 0;
    auto fetch_group = [&](int jt) {  // issue the read of this lane's group of tile jt
      pending_slot = -1;
      pending_offset = pg;  // past the pages: TMA reads zeros there
      const int v = jt * BN + group * group_rows;
      if (jt >= ne_tiles || v >= n_e || group >= n_groups) return;
      const int li = v / pg;
      pending_offset = v - li * pg;
      pending_slot = slot_of(li);
    };
    auto pending_group = [&]() -> const bf16* {
      if (pending_slot < 0) return nullptr;
      return prm.pool + static_cast<int64_t>(pending_slot) * prm.page_elems +
             static_cast<int64_t>(pending_offset) * kv_row + hkv * HD;
    };
    int slot_k = -1, offset_k = pg, slot_v = -1, offset_v = pg;  // kTmaGroups
    const bf16* group_k = nullptr;                               // kGroupsOf16
    const bf16* group_v = nullptr;
    const int64_t thread_offset = static_cast<int64_t>(r0) * kv_row + c * 8;
    auto copy_groups = [&](uint32_t dst, const bf16* lane_group, int64_t v_offset) {
#pragma unroll
      for (int g = 0; g < BN / kGroupRows; ++g) {
        const bf16* base = reinterpret_cast<const bf16*>(
            __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(lane_group), g));
        const bool valid = base != nullptr;
        const bf16* src = base + v_offset + thread_offset;
#pragma unroll
        for (int i = 0; i < kGroupRows / kRowsPerPass; ++i) {
          CpAsync16(dst + Sw128<BN>(g * kGroupRows + i * kRowsPerPass + r0, c),
                    valid ? src + i * step : prm.pool, valid);
        }
      }
    };
    // kRowCursor (other page sizes): this thread's rows r0, r0 + kRowsPerPass, ... of the earlier
    // keys, K and V each walked by a cursor over the tiles in the order they are loaded.
    const PageRowWalk walk{pg, kRowsPerPass, kv_row};
    auto slot_or_0 = [&](int li) { return li < n_pages_b ? slot_of(li) : 0; };
    const bf16* column = prm.pool + hkv * HD + c * 8;
    auto k_row = [&](int slot, int off) {
      return column + static_cast<int64_t>(slot) * prm.page_elems + off * kv_row;
    };
    auto v_row = [&](int slot, int off) {
      return column + static_cast<int64_t>(slot) * prm.page_elems + (pg + off) * kv_row;
    };
    PageRowCursor<bf16> k_rows, v_rows;
    if constexpr (kLoader == FwdPageLoader::kRowCursor) {
      k_rows.Start(walk, r0, slot_or_0, k_row);
      v_rows.Start(walk, r0, slot_or_0, v_row);
    }
    auto walk_tile = [&](uint32_t dst, PageRowCursor<bf16>& rows, auto row_at) {
#pragma unroll
      for (int i = 0; i < BN / kRowsPerPass; ++i) {
        const bool valid = rows.page < n_pages_b;  // past the last page: zero-filled
        CpAsync16(dst + Sw128<BN>(i * kRowsPerPass + r0, c), valid ? rows.row : prm.pool, valid);
        rows.Advance(walk, slot_or_0, row_at);
      }
    };
    // Tile j of K (which = 0) or V (1) onto barrier bar.
    auto load_kv = [&](int j, int which, uint32_t bar) {
      const uint32_t dst = (which ? sV : sK) + (j & 1) * L::kTile;
      if (j >= cp_tiles) {  // by TMA: warp 0 alone
        if (warp != 0) return;
        if (lane == 0) MbarExpectTx(bar, L::kTile);
        if (j >= ne_tiles) {
          if (lane == 0) {
            const int kbase = (j - ne_tiles) * BN;
#pragma unroll
            for (int cb = 0; cb < HD / 64; ++cb) {
              TmaLoad3d(dst + cb * (BN * 128), which ? &maps.v_own : &maps.k_own, bar, cb * 64, hkv,
                        kbase);
            }
          }
        } else if (group < n_groups) {
          const int slot = which ? slot_v : slot_k;
          const int offset = which ? offset_v : offset_k;
          const int row = slot < 0 ? 0 : 2 * slot + which;
#pragma unroll
          for (int cb = 0; cb < HD / 64; ++cb) {
            TmaLoad4d(dst + cb * (BN * 128) + group * group_rows * 128, &maps.pool, bar, cb * 64,
                      hkv, offset, row);
          }
        }
        if (lane == 0) MbarArriveCount(bar, kWsLoaderThreads);
        return;
      }
      if constexpr (kLoader == FwdPageLoader::kGroupsOf16) {
        copy_groups(dst, which ? group_v : group_k,
                    which ? static_cast<int64_t>(pg) * kv_row : int64_t{0});
      } else if constexpr (kLoader == FwdPageLoader::kRowCursor) {
        if (which) {
          walk_tile(dst, v_rows, v_row);
        } else {
          walk_tile(dst, k_rows, k_row);
        }
      }
      MbarArriveOnCpAsync(bar);
    };
    constexpr bool kReadsAhead =
        kLoader == FwdPageLoader::kGroupsOf16 || kLoader == FwdPageLoader::kTmaGroups;
    auto take_pending = [&] {  // the next K tile's groups, from the reads issued a tile before
      if constexpr (kLoader == FwdPageLoader::kGroupsOf16) group_k = pending_group();
      slot_k = pending_slot;
      offset_k = pending_offset;
    };
    // Tiles in the order the consumers need them: Q + K_0, K_1, V_0, K_2, V_1, ..., V_{n-1}. The
    // consumers fence the proxies after each tile's barrier (for the cp.async writes).
    if constexpr (kReadsAhead) {
      fetch_group(0);
      take_pending();  // the first tile waits on its read once
      fetch_group(1);
    }
    if (tid == 0) {  // Q, on K_0's barrier (kSlices: a 64-row box a consumer)
      if constexpr (kSlices) {
        MbarExpectTx(full_k(0), active * 64 * HD * 2);
        for (int c = 0; c < active; ++c) {
          TmaLoad3d(sQ + c * 64 * 128, &maps.q, full_k(0), 0, head_of(c), q0 + rows_of(c));
        }
      } else {
        MbarExpectTx(full_k(0), L::kQBytes);
#pragma unroll
        for (int cb = 0; cb < HD / 64; ++cb) {
          TmaLoad3d(sQ + cb * (BM * 128), &maps.q, full_k(0), cb * 64, head_of(0), q0);
        }
      }
    }
    load_kv(0, 0, full_k(0));
    for (int j = 1; j <= n_tiles; ++j) {
      if (warp != 0 && j > cp_tiles) break;  // warps 1-3: their last V tile is issued
      group_v = group_k;
      slot_v = slot_k;
      offset_v = offset_k;
      if (j < n_tiles) {  // K_j into the buffer of K_{j-2}, once both consumers' S_{j-2} are done
        if (j >= 2) MbarWait(empty_k(j & 1), ((j >> 1) - 1) & 1);
        if constexpr (kReadsAhead) {
          take_pending();
          fetch_group(j + 1);
        }
        load_kv(j, 0, full_k(j & 1));
      }
      const int jv = j - 1;  // V_{j-1} into the buffer of V_{j-3}
      if (jv >= 2) MbarWait(empty_v(jv & 1), ((jv >> 1) - 1) & 1);
      load_kv(jv, 1, full_v(jv & 1));
    }
    CpAsyncWait<0>();  // nothing outstanding when the loader exits
    return;
  }

  // --- consumers ---
  SetMaxRegistersInc<FwdRoles<NC>::kConsumerRegisters>();
  const int cw = role - 1;
  if (cw >= active) return;  // kSlices: a block of two slices
  const int h = head_of(cw);
  const int wwarp = warp & 3;
  const int g = lane >> 2, tq = lane & 3;
  float o[kOn];
#pragma unroll
  for (int i = 0; i < kOn; ++i) o[i] = 0.0f;
  float s[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
  uint32_t pa[BN / 16][4];
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
  // row_max: each row's stabiliser, the largest score seen unless a lazy rescale kept an older
  // one up to prm.rescale_log2 below it (softmax is the same for any stabiliser; P and O then
  // hold values up to 2^rescale_log2 larger, far inside fp32 and bf16's range).
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  float corr[2] = {1.0f, 1.0f};
  bool rescale_o = false;  // warp-uniform: some row of the warp moved its stabiliser
  const float scale_log2 = prm.scale_log2;
  const int row_local0 = cw * 64 + wwarp * 16 + g;           // + 8 * hf, in the Q tile
  const int q_row0 = rows_of(cw) + wwarp * 16 + g;           // + 8 * hf, from q0
  const SmemTileDesc queries(sQ + cw * 64 * 128, 16, 1024);  // this warpgroup's 64 rows

  auto issue_s = [&](int j) {  // S_j = Q K_j^T : [64 rows][128 keys] per warpgroup
    const SmemTileDesc keys(sK + (j & 1) * L::kTile, 16, 1024);
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk) {
      WgmmaSS_m64n128(s, queries.At((kk >> 2) * (BM * 128) + (kk & 3) * 32),
                      keys.At((kk >> 2) * (BN * 128) + (kk & 3) * 32), kk > 0 ? 1 : 0);
    }
    WgmmaCommit();
  };
  auto issue_pv = [&](int j) {  // O += P_j V_j
    const SmemTileDesc values(sV + (j & 1) * L::kTile, BN * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      if constexpr (HD == 128) {
        WgmmaRS_m64n128<1>(o, pa[kk], values.At(kk * 16 * 128));
      } else {
        WgmmaRS_m64n64<1>(o, pa[kk], values.At(kk * 16 * 128));
      }
    }
    WgmmaCommit();
  };
  auto softmax = [&](int j) {  // mask S_j, online softmax; O is rescaled in rescale_pack
    if (j < ne_tiles) {
      const int v0 = j * BN;
      if (v0 + BN > n_e) {
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (v0 + i * 8 + 2 * tq + (e & 1) >= n_e) s[4 * i + e] = -INFINITY;
      }
    } else {
      const int kbase = (j - ne_tiles) * BN;
      if (kbase + BN > q0 + 1 || kbase + BN > t) {
#pragma unroll
        for (int i = 0; i < BN / 8; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int k = kbase + i * 8 + 2 * tq + (e & 1);
            const int qi = q0 + q_row0 + (e >> 1) * 8;
            if (k > qi || k >= t) s[4 * i + e] = -INFINITY;
          }
      }
    }
    float mx[2];
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      mx[hf] = -INFINITY;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i)
        mx[hf] = fmaxf(mx[hf], fmaxf(s[4 * i + 2 * hf], s[4 * i + 2 * hf + 1]));
      mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 1));
      mx[hf] = fmaxf(mx[hf], __shfl_xor_sync(0xffffffffu, mx[hf], 2));
    }
    // A row moves its stabiliser only where the tile's max passes it by more than rescale_log2
    // (log2 units; 0: wherever it passes it), and then the whole warp does: the O rescale is
    // skipped, not predicated, on most tiles past a row's first few.
    const bool grows = (mx[0] - row_max[0]) * scale_log2 > prm.rescale_log2 ||
                       (mx[1] - row_max[1]) * scale_log2 > prm.rescale_log2;  // NaN: no
    rescale_o = __any_sync(0xffffffffu, grows);
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      if (rescale_o) {
        const float m_new = fmaxf(row_max[hf], mx[hf]);
        const float ms_new = m_new == -INFINITY ? 0.0f : m_new * scale_log2;
        corr[hf] = Exp2(row_max[hf] * scale_log2 - ms_new);
        row_max[hf] = m_new;
      }
      const float ms = row_max[hf] == -INFINITY ? 0.0f : row_max[hf] * scale_log2;
      float rs = 0.0f;
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x = Exp2(fmaf(s[4 * i + 2 * hf + e], scale_log2, -ms));
          s[4 * i + 2 * hf + e] = x;
          rs += x;
        }
      }
      row_sum[hf] = rescale_o ? row_sum[hf] * corr[hf] + rs : row_sum[hf] + rs;
    }
  };
  auto rescale_pack = [&]() {
    if (rescale_o) {
#pragma unroll
      for (int i = 0; i < HD / 8; ++i) {
        o[4 * i + 0] *= corr[0];
        o[4 * i + 1] *= corr[0];
        o[4 * i + 2] *= corr[1];
        o[4 * i + 3] *= corr[1];
      }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      pa[kk][0] = PackBf16(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = PackBf16(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = PackBf16(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = PackBf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  // Turns in a ring: each consumer takes n_tiles + 1 turns (S_0; S_j with P_{j-1} V_{j-1}; the
  // last P V), consumer 0 first; the last turn of the last consumer hands over to nobody.
  const int my_turn = kTurnBarrier + cw, next_turn = kTurnBarrier + (cw + 1) % active;
  auto take_turn = [&] { NamedBarrierSync(my_turn, kTurnThreads); };
  auto pass_turn = [&] { NamedBarrierArrive(next_turn, kTurnThreads); };
  if (cw == active - 1) pass_turn();

  MbarWait(full_k(0), 0);
  FenceProxyAsync();  // the loader's cp.async writes, to the tensor cores' async proxy
  take_turn();
  WgmmaFence();
  issue_s(0);
  pass_turn();
  WgmmaWait<0>();
  FenceAcc(s);
  MbarArrive(empty_k(0));
  softmax(0);
  rescale_pack();
  for (int j = 1; j < n_tiles; ++j) {
    MbarWait(full_k(j & 1), (j >> 1) & 1);
    MbarWait(full_v((j - 1) & 1), ((j - 1) >> 1) & 1);
    FenceProxyAsync();
    take_turn();
    WgmmaFence();
    issue_s(j);
    issue_pv(j - 1);
    pass_turn();
    WgmmaWait<1>();  // S_j done; P_{j-1} V_{j-1} may still run
    FenceAcc(s);
    MbarArrive(empty_k(j & 1));
    softmax(j);
    WgmmaWait<0>();
    FenceAcc(o);
    MbarArrive(empty_v((j - 1) & 1));
    rescale_pack();
  }
  const int last = n_tiles - 1;
  MbarWait(full_v(last & 1), (last >> 1) & 1);
  FenceProxyAsync();
  take_turn();
  WgmmaFence();
  issue_pv(last);
  if (cw != active - 1) pass_turn();
  WgmmaWait<0>();
  FenceAcc(o);

  // --- epilogue: normalise, LSE, O through this consumer's own rows of the Q tile ---
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float l = row_sum[hf];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int row_local = row_local0 + hf * 8;
    const int qi = q0 + q_row0 + hf * 8;
    if (tq == 0 && qi < t) {
      prm.lse[static_cast<int64_t>(qi) * prm.hq + h] = (row_max[hf] * scale_log2 + log2f(l)) * kLn2;
    }
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) {
      const uint32_t packed = PackBf16(o[4 * i + 2 * hf] * inv, o[4 * i + 2 * hf + 1] * inv);
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sQ + Sw128<BM>(row_local, i) + tq * 4),
                   "r"(packed)
                   : "memory");
    }
  }
  NamedBarrierSync(kTurnBarrier + NC + cw, 128);
  constexpr int kRowsPerConsumerPass = 128 / kChunks;
  const int ctid = tid % 128;
#pragma unroll
  for (int i = 0; i < 64 / kRowsPerConsumerPass; ++i) {
    const int row = cw * 64 + i * kRowsPerConsumerPass + ctid / kChunks, c = ctid % kChunks;
    const int qi = q0 + rows_of(cw) + (row - cw * 64);
    if (qi < t) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(sQ + Sw128<BM>(row, c))
                   : "memory");
      *reinterpret_cast<uint4*>(prm.out + (static_cast<int64_t>(qi) * prm.hq + h) * HD + c * 8) = v;
    }
  }
}

// TMA groups where 32 divides p (16, under three consumers: there the cp.async groups spill at the
// loader's 32 registers), cp.async groups of 16 rows where 16 does, the row cursor otherwise;
// CTXPLAN_ATTN_FWD_PAGES=groups or =cursor picks that loader wherever it can serve, for comparison
// (attention_bench, the tests).
FwdPageLoader ChooseFwdPageLoader(int p, int consumers) {
  const char* v = std::getenv("CTXPLAN_ATTN_FWD_PAGES");
  if (v != nullptr && std::strcmp(v, "cursor") == 0) return FwdPageLoader::kRowCursor;
  if (p % kGroupRows != 0) return FwdPageLoader::kRowCursor;
  if (consumers == 3 && (v == nullptr || std::strcmp(v, "groups") != 0)) {
    return FwdPageLoader::kTmaGroups;
  }
  if (p % kTmaMinGroupRows != 0 || (v != nullptr && std::strcmp(v, "groups") == 0)) {
    return FwdPageLoader::kGroupsOf16;
  }
  return FwdPageLoader::kTmaGroups;
}

// The pool's slot count is not known here: its outer extent is set far past any slot the page
// table can name (only named slots are read).
constexpr uint64_t kPoolRowsBound = uint64_t{1} << 30;

template <int HD>
FwdTensorMaps EncodeFwdMaps(const FwdParams& prm, FwdPageLoader loader, int query_rows) {
  FwdTensorMaps maps{};
  maps.q = EncodeTokenHeadMap(prm.q, prm.t, prm.hq, HD, query_rows);
  maps.k_own = EncodeTokenHeadMap(prm.k_own, prm.t, prm.hkv, HD, kWsBN);
  maps.v_own = EncodeTokenHeadMap(prm.v_own, prm.t, prm.hkv, HD, kWsBN);
  if (prm.num_pages > 0 && loader == FwdPageLoader::kTmaGroups) {
    const auto p = static_cast<uint64_t>(prm.p), hkv = static_cast<uint64_t>(prm.hkv);
    constexpr uint64_t kRowBytes = HD * 2;
    maps.pool = EncodeBf16TensorMap(prm.pool, {HD, hkv, p, kPoolRowsBound},
                                    {kRowBytes, hkv * kRowBytes, p * hkv * kRowBytes},
                                    {64, 1, static_cast<uint32_t>(TmaGroupRows(prm.p)), 1});
  }
  return maps;
}

// Three consumers where AttentionForwardQueryRows says 192, or (over a page selection) where
// AttentionForwardSlices takes query-head slices; CTXPLAN_ATTN_FWD_CONSUMERS=2 or =3 takes that
// count wherever it can serve (d_h 64 without a page selection), CTXPLAN_ATTN_FWD_SLICES=on or
// =off the slices or not over every selection, for comparison (attention_bench, the tests).
// O is rescaled where a row's max passes its stabiliser by more than 2^8 (FlashAttention-4's
// threshold); CTXPLAN_ATTN_FWD_RESCALE=always wherever it passes it, for comparison.
float FwdRescaleLog2() {
  const char* v = std::getenv("CTXPLAN_ATTN_FWD_RESCALE");
  return v != nullptr && std::strcmp(v, "always") == 0 ? 0.0f : 8.0f;
}

int ChooseFwdConsumers(const FwdParams& prm, int head_dim) {
  if (head_dim != 64) return 2;
  const bool selected = prm.sel != nullptr;
  const char* v = std::getenv(selected ? "CTXPLAN_ATTN_FWD_SLICES" : "CTXPLAN_ATTN_FWD_CONSUMERS");
  if (selected && v != nullptr && std::strcmp(v, "on") == 0) return 3;
  if (selected && v != nullptr && std::strcmp(v, "off") == 0) return 2;
  if (!selected && v != nullptr && (std::strcmp(v, "2") == 0 || std::strcmp(v, "3") == 0))
    return v[0] - '0';
  const int sms = detail::MultiprocessorCount();
  if (selected) return AttentionForwardSlices(prm.t, prm.hq, prm.hkv, 64, true, sms) ? 3 : 2;
  return AttentionForwardQueryRows(prm.t, prm.hq, head_dim, false, sms) == 192 ? 3 : 2;
}

template <int HD, int NC, bool kSlices = false>
void LaunchFwd(FwdParams prm, cudaStream_t stream) {
  constexpr int kBM = FwdRoles<NC>::kBM;
  // kSlices: a 128-query tile's 2 x group slices of 64 rows in blocks of two or three.
  constexpr int kTileRows = kSlices ? kWsBM : kBM;
  prm.q_tiles = (prm.t + kTileRows - 1) / kTileRows;
  prm.slice_blocks = ForwardSliceBlocks(prm.group);
  const dim3 grid(prm.q_tiles, kSlices ? prm.hkv * prm.slice_blocks : prm.hq);
  constexpr int smem = WsSmem<HD, kBM>::kBytes;
  FwdPageLoader loader = ChooseFwdPageLoader(prm.p, NC);
  // kSlices: two instantiations, not three: the TMA boxes serve every p % 16 == 0.
  if (kSlices && loader == FwdPageLoader::kGroupsOf16) loader = FwdPageLoader::kTmaGroups;
  const FwdTensorMaps maps = EncodeFwdMaps<HD>(prm, loader, kSlices ? 64 : kBM);
  auto launch = [&](auto kernel) {
    CTXPLAN_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, FwdRoles<NC>::kThreads, smem, stream>>>(prm, maps);
    CTXPLAN_CUDA_CHECK_LAUNCH();
  };
  // A page walk's step must not cross two pages' ends: p >= the loader's rows per pass.
  static_assert(kWsLoaderThreads / (HD / 8) <= 16, "pages of 16 rows and up are walked");
  switch (loader) {
    case FwdPageLoader::kTmaGroups:
      launch(AttnFwdWarpSpecializedKernel<HD, NC, FwdPageLoader::kTmaGroups, kSlices>);
      break;
    case FwdPageLoader::kGroupsOf16:
      if constexpr (!kSlices)
        launch(AttnFwdWarpSpecializedKernel<HD, NC, FwdPageLoader::kGroupsOf16>);
      break;
    case FwdPageLoader::kRowCursor:
      launch(AttnFwdWarpSpecializedKernel<HD, NC, FwdPageLoader::kRowCursor, kSlices>);
      break;
  }
}

}  // namespace

void AttentionForward(const AttentionShape& shape, const bf16* q, const bf16* k_own,
                      const bf16* v_own, const PagedKv<const bf16>& earlier,
                      const PageSelection& selection, bf16* out, float* lse, cudaStream_t stream) {
  static_assert(kWsBM == 128, "the shared check wants query tiles a multiple of 128");
  RequireAttentionInputs(shape, shape.num_heads, earlier, selection);
  if (shape.tokens == 0) return;
  Require(q && k_own && v_own && out && lse, "null tensor");

  FwdParams prm{};
  prm.q = q;
  prm.k_own = k_own;
  prm.v_own = v_own;
  prm.pool = earlier.pool;
  prm.page_slot = earlier.page_slot;
  prm.sel = earlier.num_pages > 0 ? selection.pages : nullptr;
  prm.out = out;
  prm.lse = lse;
  prm.page_elems = earlier.num_pages > 0 ? earlier.shape.page_elements() : 0;
  prm.sel_stride = prm.sel ? selection.pages_per_tile : 0;
  prm.t = static_cast<int>(shape.tokens);
  prm.hq = static_cast<int>(shape.num_heads);
  prm.hkv = static_cast<int>(shape.num_kv_heads);
  prm.group = prm.hq / prm.hkv;
  prm.p = earlier.num_pages > 0 ? static_cast<int>(earlier.shape.page_tokens) : kNoPageTokens;
  prm.num_pages = static_cast<int>(earlier.num_pages);
  prm.query_tile = prm.sel ? static_cast<int>(selection.query_tile) : kWsBM;
  prm.scale_log2 = shape.scale * kLog2e;
  prm.rescale_log2 = FwdRescaleLog2();
  if (shape.head_dim == 128) {
    LaunchFwd<128, 2>(prm, stream);
  } else if (ChooseFwdConsumers(prm, 64) == 3) {
    if (prm.sel != nullptr) {
      LaunchFwd<64, 3, true>(prm, stream);
    } else {
      LaunchFwd<64, 3>(prm, stream);
    }
  } else {
    LaunchFwd<64, 2>(prm, stream);
  }
}

}  // namespace ctxplan::kernels::cuda
