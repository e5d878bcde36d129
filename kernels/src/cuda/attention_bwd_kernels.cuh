// Paged attention backward for sm_90a: bf16 operands, fp32 accumulation.
//
// Three kernels:
//  1. preprocess: D = rowsum(dO * O) and the LSE in log2 units, both transposed to [H_q][t_pad]
//     (contiguous per head, so the main kernel copies them in 16-byte chunks); dQ's fp32
//     accumulator is zeroed with a memset.
//  2. main, KV-major: one block = 128 keys of one KV head, keys taken from the chunk's own
//     positions (the first blocks: own block 0 sees every query, so the heaviest go first) or from
//     the earlier pages. K and V stay in shared memory; the block loops over every query head of
//     the GQA group and every 64-query tile that sees its keys (causal for own keys; for
//     page-sparse attention only the tiles that selected one of its pages, and only pages some tile
//     selected are read or written), loading Q, dO, LSE and D ahead (by TMA with two
//     warpgroups, cp.async with one). Per tile:
//         S^T = K Q^T,  P^T = exp2(S^T scale log2e - LSE),  dV += P^T dO,
//         dP^T = V dO^T,  dS^T = P^T (dP^T - D),  dK += dS^T Q,  dQ += dS K.
//     Computing the transposed products keeps P^T and dS^T in the registers of the threads that
//     own the keys, so dV and dK take them as A operands directly; only dS goes through shared
//     memory (for dQ, whose rows are queries).
//     Page-sparse, the earlier keys are gathered instead: a block takes 128 of one selection
//     tile's selected positions (its pages in selection order) and loops over that tile's queries
//     only, so no item is masked at any page size; the tiles that selected a page add into its
//     dKV from different blocks, by atomics. At GQA groups 1-2 (AttentionBackwardOverUnion), where
//     a gathered block's few items do not carry its gather and atomics, the earlier blocks are the
//     union's pages instead, each serving the tiles that selected it (UnionKeyBlocksOf: 128-key
//     blocks, 64-key ones for pages up to 64, two 64-key halves of one page or two for pages of
//     192 at head_dim 64, whose warpgroups each take only their own half's items).
//     On wgmma: two warpgroups of 64 keys (AttnBwdWgmmaKernel; a FlashAttention-2 style mma.sync
//     kernel served as a comparison until 2026-11-27, kernels/PERF.md). dK and dV of a key are
//     complete in one block: they are written (own positions) or added (earlier pages,
//     read-add-write into the fp32 or bf16 dKV pool) without atomics, so the dKV accumulation is
//     deterministic and race-free (no two pages share a slot); gathered blocks excepted, and own
//     blocks split one a query head (SplitsOwnHeads: long chunks at head_dim 128, first chunks from
//     4096 tokens at either head dim up to a length, AttentionBackwardSplitsOwnHeads; their dK/dV
//     summed over the GQA group in an fp32 accumulator by atomics, then written by a second kernel,
//     AttnBwdOwnDkvPostKernel). dQ is summed over key blocks, into an fp32 workspace: by bulk
//     reduces in the two-warpgroup kernel (a tiled accumulator, DqTileOffset; one 16 KB (head_dim
//     64) or 32 KB reduce an item; the halves by fp32 atomics into it), by fp32 atomics in the
//     others.
//  3. postprocess: dQ = bf16(scale * accumulator) (and the split own blocks' dK/dV).
// An item is bound by its serial chain (S, exp, dV + dP, dS, dK, the block-wide dQ). With two
// computing warpgroups (operands loaded two items ahead; no block barrier an item) an item's
// whole dQ is one warpgroup's, alternating, while the other starts the next item. A third,
// producer warpgroup runs beside them (kProducer, cuDNN's layout): it issues the operands' loads
// and the dQ bulk reduces, so that the computing warpgroups wait on no bulk copy and no barrier
// of their own; 1.03-1.05x on 64K causal, 1.07-1.09x on the sweep's dense rows, 1.03x on its
// page-sparse ones (kernels/PERF.md). The blocks resident together walk the queries side by side
// (ItemOrder), so that Q, dO and dQ are served by the L2.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "attention_bwd_common.cuh"
#include "attention_wgmma.cuh"
#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/check.h"
#include "tensor_map.h"

namespace ctxplan::kernels::cuda {
namespace {

using namespace bwd;

// --- 1. preprocess -------------------------------------------------------------------------
template <int HD>
__global__ void AttnBwdPreKernel(const bf16* __restrict__ out, const bf16* __restrict__ d_out,
                                 const float* __restrict__ lse, int t, int t_pad, int hq,
                                 float* __restrict__ delta, float* __restrict__ lse2) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (warp >= t_pad * hq) return;
  const int i = warp / hq, h = warp % hq;
  float acc = 0.0f;
  if (i < t) {
    const int64_t base = (static_cast<int64_t>(i) * hq + h) * HD;
    constexpr int kPer = HD / 32;  // 2 or 4 elements per lane
#pragma unroll
    for (int e = 0; e < kPer; e += 2) {
      const __nv_bfloat162 o2 =
          *reinterpret_cast<const __nv_bfloat162*>(out + base + lane * kPer + e);
      const __nv_bfloat162 d2 =
          *reinterpret_cast<const __nv_bfloat162*>(d_out + base + lane * kPer + e);
      const float2 of = __bfloat1622float2(o2), df = __bfloat1622float2(d2);
      acc = fmaf(of.x, df.x, acc);
      acc = fmaf(of.y, df.y, acc);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) {
    delta[static_cast<int64_t>(h) * t_pad + i] = acc;
    lse2[static_cast<int64_t>(h) * t_pad + i] =
        i < t ? lse[static_cast<int64_t>(i) * hq + h] * kLog2e : 0.0f;
  }
}

// --- 3. postprocess ------------------------------------------------------------------------
// The tiled dQ accumulator of the pipelined kernel: [H_q][t_pad / 64][HD / 64][4096] fp32, each
// 64 x 64 tile in the wgmma accumulator's order (float4 chunk c of warpgroup thread w = 32 warp +
// 4 g + tq at 128 c + w: rows 16 warp + g and + 8, columns 8 c + 2 tq and + 1), so that a
// warpgroup's item dQ is one contiguous 16 KB bulk reduce. Offset in floats.
template <int HD>
__host__ __device__ __forceinline__ int64_t DqTileOffset(int n_q_tiles, int h, int q_tile,
                                                         int half) {
  return ((static_cast<int64_t>(h) * n_q_tiles + q_tile) * (HD / 64) + half) * 4096;
}

// dQ = bf16(scale * accumulator) from the tiled accumulator: one float4 chunk a thread (two rows'
// column pairs).
template <int HD>
__global__ void AttnBwdPostTiledKernel(const float* __restrict__ acc, int t, int hq, int n_q_tiles,
                                       float scale, bf16* __restrict__ dq) {
  const int64_t chunks = static_cast<int64_t>(hq) * n_q_tiles * (HD / 64) * 1024;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int w = static_cast<int>(i & 127), c = static_cast<int>((i >> 7) & 7);
    const int64_t tile = i >> 10;
    const int half = static_cast<int>(tile % (HD / 64));
    const int64_t head_tile = tile / (HD / 64);
    const int q_tile = static_cast<int>(head_tile % n_q_tiles);
    const int h = static_cast<int>(head_tile / n_q_tiles);
    const int lane = w & 31;
    const int row = q_tile * 64 + (w >> 5) * 16 + (lane >> 2);
    const int col = half * 64 + c * 8 + 2 * (lane & 3);
    const float4 v = reinterpret_cast<const float4*>(acc)[i];
    if (row < t)
      *reinterpret_cast<uint32_t*>(dq + (static_cast<int64_t>(row) * hq + h) * HD + col) =
          PackBf16(v.x * scale, v.y * scale);
    if (row + 8 < t)
      *reinterpret_cast<uint32_t*>(dq + (static_cast<int64_t>(row + 8) * hq + h) * HD + col) =
          PackBf16(v.z * scale, v.w * scale);
  }
}

__global__ void AttnBwdPostKernel(const float* __restrict__ acc, int64_t n4, float scale,
                                  bf16* __restrict__ dq) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = reinterpret_cast<const float4*>(acc)[i];
    uint2 packed;
    packed.x = PackBf16(v.x * scale, v.y * scale);
    packed.y = PackBf16(v.z * scale, v.w * scale);
    reinterpret_cast<uint2*>(dq)[i] = packed;
  }
}

// --- 2. main, wgmma (sm_90a) ----------------------------------------------------------------
// Two warpgroups, each owning 64 of the block's 128 keys (one warpgroup of 64 keys: the comparison
// switches' NWG = 1). Per 64-query tile, at head_dim 128:
//   S^T  = K_wg Q^T      wgmma SS (K and Q K-major in shared memory)          64 x 64
//   dV  += P^T dO        wgmma RS (P^T from registers, dO N-major)            64 x 128
//   dP^T = V_wg dO^T     wgmma SS                                              64 x 64
//   dK  += dS^T Q        wgmma RS (dS^T from registers, Q N-major)            64 x 128
//   dQ   = dS K          wgmma SS (dS^T in shared memory read M-major, K N-major): two
//                        warpgroups, 64 x d_h by one of them an item, then a bulk reduce; one
//                        warpgroup, 64 x 64 at a time, then fp32 atomics

// The order of the two-warpgroup kernel's items (query head hl of the GQA group, i-th of the
// block's n_tiles query tiles, ascending), chosen for the L2: the blocks resident together should
// read the same Q and dO and add into the same dQ while these are still in the L2, yet not the
// same item at the same moment (their dQ adds would queue on the same lines). Tiles outer,
// descending, so that blocks started together walk the queries side by side; the group's heads
// inner. Each block starts at its own head and (for sixteen groups of blocks) its own tile a few
// tiles down, wrapping round to the top at the end, which spreads a wave of blocks over ~100 items
// a few tiles wide. Under ncu (32K causal, H200) the L2 hit rate went from 64% to 87% and DRAM
// traffic from 35% to 12% of its peak against heads outer with tiles ascending (kernels/PERF.md).
// The rotations are fixed by the block's first key and by absolute query tiles, not by the
// block's index, so that a key's items come in one order in blocks over the union or over every
// position where these start at the same key (dK and dV bit for bit).
struct ItemCursor {
  int hl;  // query head of the group
  int i;   // index into the block's ascending tiles
};
struct ItemOrder {
  int n_tiles, group, head_rot;
  ItemCursor first;
  // tiles(i): the block's i-th tile (ascending); n_q_tiles: the chunk's tiles.
  template <typename Tiles>
  __device__ ItemOrder(int n_tiles_, int group_, int key0, int n_q_tiles, Tiles tiles)
      : n_tiles(n_tiles_), group(group_) {
    const int key_unit = key0 / 128;  // 128-key blocks
    head_rot = key_unit % group;
    const int start = n_q_tiles - 1 - (key_unit / group) % 16;  // absolute tile
    int lo = 0, hi = n_tiles;  // the tiles <= start: a prefix of the ascending list
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (tiles(mid) <= start) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    first = {head_rot, lo > 0 ? lo - 1 : n_tiles - 1};
  }
  // The next item: the next head; after the group's last, the next tile down (from the lowest,
  // the highest). As cheap as a plain counter: the one-warpgroup kernel's items are small.
  __device__ __forceinline__ void Next(ItemCursor& c) const {
    if (++c.hl == group) c.hl = 0;
    if (c.hl == head_rot) c.i = c.i == 0 ? n_tiles - 1 : c.i - 1;
  }
};

// All tiles use the 128-byte-swizzled [d/64][rows][64] layout (Sw128), written by cp.async or TMA.
// NWG = 1 (one warpgroup, 64-key blocks, two blocks per SM) serves only the comparison switches
// now: key blocks over a page-sparse selection's pages of fewer than 128 tokens
// (CTXPLAN_ATTN_BWD_SPARSE=union / =positions; a 128-key block would hold pages that query tiles
// select independently, half of its work masked) and head_dim 64 dense under
// CTXPLAN_ATTN_BWD_KEYS=64 (kernels/PERF.md).
template <int HD, int NWG, bool kItemBarrier = false>
struct WbSmem {  // 64 * NWG keys, 64 queries
  static constexpr int BN = 64 * NWG;
  // Two warpgroups (the pipelined loop of AttnBwdWgmmaKernel): operands loaded two items ahead,
  // into two buffers (three under the item barrier, which frees a buffer an item later), dS^T
  // alternating between two. One warpgroup (two blocks a multiprocessor): two operand buffers,
  // one dS^T buffer.
  static constexpr bool kPipelined = NWG == 2;
  static constexpr int kStages = kPipelined && kItemBarrier ? 3 : 2;
  static constexpr int kdSBuffers = kPipelined ? 2 : 1;
  static constexpr int kKvBytes = BN * HD * 2;     // one of K, V: [HD / 64][BN][64] bf16
  static constexpr int kQBytes = kBwdBM * HD * 2;  // one buffer of Q or dO: [HD / 64][64][64]
  static constexpr int kdSBytes = BN * 128;        // one buffer of dS^T: [BN keys][64 q] bf16
  // One 64-column half of an item's dQ [64 q][64 d] fp32 on its way to the bulk reduce (two
  // warpgroups; the one-warpgroup kernel adds dQ by atomics, kernels/PERF.md), in the
  // accumulator's own order: float4 chunk c of thread w (of 128) at (128 c + w) * 16 bytes, which
  // is also its order in the tiled dQ accumulator (DqTileOffset).
  static constexpr int kdQBytes = kPipelined ? kBwdBM * 64 * 4 : 0;
  // Head dim 64 beside the producer stages items' dQ in two buffers, alternately (the loops
  // without a producer use the first).
  static constexpr int kdQBuffers = HD == 64 && kPipelined ? 2 : 1;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKvBytes;
  static constexpr int kQ = kV + kKvBytes;                 // kStages buffers
  static constexpr int kdO = kQ + kStages * kQBytes;       // kStages buffers
  static constexpr int kdS = kdO + kStages * kQBytes;      // kdSBuffers buffers
  static constexpr int kdQ = kdS + kdSBuffers * kdSBytes;  // kdQBuffers stagings of HD / 64 halves
  static constexpr int kL = kdQ + kdQBuffers * HD / 64 * kdQBytes;  // [kStages][64] fp32
  static constexpr int kD = kL + kStages * kBwdBM * 4;              // [kStages][64] fp32
  static constexpr int kBars = kD + kStages * kBwdBM * 4;  // [kStages] operands-landed mbarriers
  static constexpr int kStagingBar = kBars + 8 * kStages;  // [2] the dQ staging read
  static constexpr int kRelease = kStagingBar + 16;        // [kStages] uint32 release counts
  // With a producer warpgroup: [kStages] operands-released mbarriers, then [2] dQ-staged.
  static constexpr int kEmptyBars = (kRelease + 4 * kStages + 7) & ~7;
  static constexpr int kStagedBar = kEmptyBars + 8 * kStages;
  // Gathered blocks: [BN] int64, where each key's dK row starts in the dKV pool (DkvPoolRow), found
  // by the producer's idle warp at the block's start for the epilogue.
  static constexpr int kDkvRows = kStagedBar + 16;
  static constexpr int kUnion =
      kPipelined ? kDkvRows + 8 * BN : kBars;  // uint32 union, int32 count
  // [sel_tiles] uint32, then [n_q_tiles] TileIndex: 16-bit where the dQ staging leaves little room
  // (a chunk of 16384 tokens page-sparse), 32-bit in the one-warpgroup kernel as it was measured.
  using TileIndex = std::conditional_t<kPipelined, uint16_t, int32_t>;
  static constexpr int kMask = kUnion + (kPipelined ? 8 : 16);
  // What the kernel uses from a 1024-byte aligned base. The launch asks for 1024 bytes more when
  // they fit, in case the dynamic shared memory does not start aligned (on sm_90 it does: after
  // the 1 KB the system reserves; an access past the block's shared memory faults).
  __host__ __device__ static int Bytes(int sel_tiles, int q_tiles) {
    return kMask + 4 * sel_tiles + static_cast<int>(sizeof(TileIndex)) * q_tiles;
  }
};

// kGather (two warpgroups only): the earlier keys of a page-sparse chunk in gathered blocks, one
// selection tile's selected positions 128 at a time (kernels/PERF.md): the block's items are that
// tile's queries only, none masked, and its dK/dV are added into the dKV pages by atomics.
// The pipelined kernel's item operands by TMA: Q and dO [t][H_q][d_h], boxes of 64 columns x 64
// queries of one head (unused by the one-warpgroup kernel).
// Named barriers 3-6: item n's dS^T written by the warpgroup without its dQ (n % 4).
constexpr int kDsReady = 3;
// Named barrier 7 (gathered blocks beside a producer): the producer's warp 10 has found the
// block's dKV rows (s_dkv_rows); the computing warpgroups sync on it before their epilogue.
constexpr int kDkvRowsReady = 7;

struct BwdTensorMaps {
  CUtensorMap q;
  CUtensorMap d_out;
};

// kProducer (key blocks and gathered blocks, either head dim): a third warpgroup (threads
// 256-383) only loads each item's operands (thread 256, on an empty mbarrier a buffer that every
// computing thread arrives on once its item's wgmmas are done) and adds the staged dQ into the
// accumulator (thread 288, on a staged mbarrier the owner's 128 threads arrive on); it gives its
// registers to the two computing warpgroups (setmaxnreg 24 / 240), which then never wait on a
// named barrier of their own nor on a bulk copy (cuDNN's backward does the same, ncu,
// kernels/PERF.md).
template <int HD, int NWG, bool kOverUnion, bool kGather = false, bool kSplitOwn = false,
          bool kProducer = false, bool kHalves = false>
__global__ void __launch_bounds__(kProducer ? 384 : 128 * NWG, NWG == 1 ? 2 : 1)
    AttnBwdWgmmaKernel(const BwdParams prm, const __grid_constant__ BwdTensorMaps maps) {
  static_assert(!kGather || (NWG == 2 && !kOverUnion), "gathered blocks: two warpgroups");
  static_assert(!kSplitOwn || (NWG == 2 && !kOverUnion), "split own blocks: two warpgroups");
  static_assert(HD == 64 || HD == 128, "head_dim 64 or 128");
  static_assert(!kProducer || (NWG == 2 && !kOverUnion),
                "a producer warpgroup: two computing warpgroups");
  static_assert(!kHalves || (NWG == 2 && kOverUnion), "halves: two warpgroups over the union");
  // Gathered blocks (a few items each) keep a block barrier an item (kItemBarrier, below) unless
  // a producer loads their items.
  constexpr bool kItemBarrier = kGather && !kProducer;
  using L = WbSmem<HD, NWG, kItemBarrier>;
  static_assert(!kProducer || L::kStages == 2, "the producer preloads two items");
  constexpr int kWbThreads = 128 * NWG;
  constexpr int BN = 64 * NWG, BM = kBwdBM;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = SmemAddr(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  uint8_t* smem = smem_raw + (base - raw);
  const uint32_t sK = base + L::kK, sV = base + L::kV, sQ = base + L::kQ, sdO = base + L::kdO;
  const uint32_t sdS = base + L::kdS, sL = base + L::kL, sD = base + L::kD;
  const float* sLf = reinterpret_cast<const float*>(smem + L::kL);
  const float* sDf = reinterpret_cast<const float*>(smem + L::kD);
  uint32_t* s_union = reinterpret_cast<uint32_t*>(smem + L::kUnion);
  uint32_t* s_mask = reinterpret_cast<uint32_t*>(smem + L::kMask);
  int* s_count = reinterpret_cast<int*>(smem + L::kUnion + 4);
  int64_t* s_dkv_rows = reinterpret_cast<int64_t*>(smem + L::kDkvRows);
  typename L::TileIndex* s_tiles = reinterpret_cast<typename L::TileIndex*>(s_mask + prm.sel_tiles);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, tq = lane & 3;
  const int wg = warp >> 2, wwarp = warp & 3;
  const KeyBlock block = LocateKeyBlock<BN, kOverUnion, kGather, kSplitOwn, kHalves>(prm);
  const int hkv = block.hkv;
  // The query heads whose items the block takes: the GQA group, or one head (kSplitOwn: every
  // own block is one head's). Apart from kSplitOwn the kernel keeps the KV head's arithmetic:
  // with the split's in its loop the unsplit kernel ran 1-2.5% slower (kernels/PERF.md).
  const int item_heads = kSplitOwn && !block.earlier ? 1 : prm.group;
  const int head0 = kSplitOwn ? block.FirstHead(prm.group) : hkv * prm.group;
  const bool earlier = block.earlier;
  const int kb0 = block.kb0;
  const int t = prm.t;
  const int region_end = block.end;
  const int64_t kv_row = static_cast<int64_t>(prm.hkv) * HD;
  const bool gathered = kGather && earlier;
  // Selection masks (bit i: the block's page first_page + i) for key blocks over positions.
  // (kProducer: dense launches' key blocks and gathered blocks, never selection masks.)
  const bool sparse = !kProducer && !kGather && earlier && prm.sel != nullptr;
  const int first_page = earlier && !kGather ? kb0 / prm.p : 0;
  // Over the union's halves: each warpgroup's keys are its own half (of its own page).
  const bool halves = kHalves && earlier;

  uint32_t union_mask = 0xffffffffu;
  if (sparse) {
    union_mask =
        halves ? ScanHalves<kWbThreads>(prm, block.half_key0, s_mask, s_union)
               : ScanSelections<kWbThreads, BN>(prm, kb0, region_end, first_page, s_mask, s_union);
    if (union_mask == 0u) return;
  }
  const int tiles_per_sel = prm.query_tile / BM;
  const int qt_begin = gathered ? block.sel_tile * tiles_per_sel : earlier ? 0 : kb0 / BM;
  const int n_tiles =
      sparse     ? CollectSelectedTiles(s_mask, prm.n_q_tiles, tiles_per_sel, s_tiles, s_count)
      : gathered ? min(tiles_per_sel, prm.n_q_tiles - qt_begin)
                 : prm.n_q_tiles - qt_begin;

  // Key rows of this thread (accumulator rows): 64 wg + 16 wwarp + g (+ 8), key row_key0 + row.
  const int kr0 = wg * 64 + wwarp * 16 + g;
  const int my_half_key0 = wg == 0 ? block.half_key0[0] : block.half_key0[1];
  const int row_key0 = halves ? my_half_key0 - 64 * wg : kb0;
  bool key_ok[2];
  int key_bit[2];
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const int kidx = row_key0 + kr0 + hf * 8;
    if (halves) {
      key_bit[hf] = wg;
      key_ok[hf] = my_half_key0 >= 0;
      continue;
    }
    key_bit[hf] = earlier && !kGather ? kidx / prm.p - first_page : 0;
    key_ok[hf] = kidx < region_end && ((union_mask >> key_bit[hf]) & 1u);
  }

  if (halves) {
    LoadHalvesKv<HD, kWbThreads>(prm, block.half_key0, hkv, kv_row, sK, sV,
                                 [](int row, int c) { return Sw128<BN>(row, c); });
  } else if (!kProducer || tid < kWbThreads) {
    LoadKeyBlockKv<HD, BN, kWbThreads>(
        prm, kb0, earlier, region_end, union_mask, first_page, hkv, kv_row, sK, sV,
        [](int row, int c) { return Sw128<BN>(row, c); }, block.gathered);
  }

  // Items: every query head of the group times the block's query tiles (ascending: all from
  // qt_begin, or the selected ones). Item (hl, i) is head hkv * group + hl, tile tile_at(i). The
  // two-warpgroup kernel takes them in ItemOrder; the one-warpgroup kernel heads outer, tiles
  // ascending, as it was measured (with ItemOrder's cursor and a 16-bit tile list it ran 4%
  // slower, kernels/PERF.md).
  auto tile_at = [&](int i) { return sparse ? static_cast<int>(s_tiles[i]) : qt_begin + i; };
  auto advance = [&](int& hl, int& i) {
    if (++i >= n_tiles) {
      i = 0;
      ++hl;
    }
  };
  auto load_item = [&](int hl, int qt, int buf) {
    LoadItemOperands<HD, BM, kWbThreads, L::kQBytes>(
        prm, head0 + hl, qt * BM, sQ, sdO, sL, sD, buf,
        [](int row, int c) { return Sw128<BM>(row, c); });
  };

  float dk[HD / 2], dv[HD / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) {
    dk[i] = 0.0f;
    dv[i] = 0.0f;
  }
  // The pipelined kernel computes an item's whole dQ [64 q][d_h] in one warpgroup (below); the
  // one-warpgroup kernel one 64-column half at a time.
  constexpr int kDqRegs = L::kPipelined ? HD / 2 : BM / 2;
  float s[BM / 2], dp_[BM / 2], dq[kDqRegs];
#pragma unroll
  for (int i = 0; i < BM / 2; ++i) {
    s[i] = 0.0f;
    dp_[i] = 0.0f;
  }
#pragma unroll
  for (int i = 0; i < kDqRegs; ++i) dq[i] = 0.0f;
  const uint32_t k_wg = sK + wg * 64 * 128, v_wg = sV + wg * 64 * 128;
  // Head dim 64 on two warpgroups: the block's K and V rows of this warpgroup held in registers
  // (kKvRegs: 16 registers each), so that S^T and dP^T read only Q and dO from shared memory; an
  // m64n64 wgmma with both operands there reads 4 KB a 32-clock step, all that shared memory
  // gives (1.03x on the head dim 64 sweep, kernels/PERF.md). At head dim 128 they would need 64
  // registers the kernel does not have.
  constexpr bool kKvRegs = HD == 64 && L::kPipelined;
  uint32_t k_frag[kKvRegs ? HD / 16 : 1][4], v_frag[kKvRegs ? HD / 16 : 1][4];

  if constexpr (L::kPipelined) {
    // dQ's bulk reduce: one thread of the warpgroup whose turn it is issues it, from the one
    // staging buffer (this thread's float4 chunks at dq_stage_mine + 2048 c, a 64-column half
    // every kdQBytes).
    const bool dq_issuer = (tid & 127) == 0;
    const uint32_t dq_stage_mine = base + L::kdQ + (tid & 127) * 16;
    // Two stagings (head dim 64 beside the producer): item m's dQ in staging m % 2, with its own
    // staged and free mbarriers, so that an owner waits for the reduce of its own item two back
    // rather than the other warpgroup's just before (64K causal 1.015x, kernels/PERF.md).
    constexpr bool kDqDouble = kProducer && L::kdQBuffers == 2;
    constexpr uint32_t kStagingBytes = HD / 64 * L::kdQBytes;
    auto staging_of = [&](int m) { return kDqDouble ? (m & 1) * kStagingBytes : 0u; };
    auto bar_of = [&](int m) { return kDqDouble ? 8u * (m & 1) : 0u; };
    ItemOrder order(n_tiles, item_heads, kb0, prm.n_q_tiles, tile_at);
    // A tile's gathered blocks run side by side: each starts at its own head and query tile.
    if (gathered) order.first.i = (kb0 / BN / prm.group) % n_tiles;
    const int n_items = n_tiles * item_heads;
    auto item_at = [&](const ItemCursor& c, int& h, int& q0) {
      h = head0 + c.hl;
      q0 = tile_at(c.i) * BM;
    };
    auto next_item = [&](ItemCursor& c) { order.Next(c); };
    // Item n: S^T and dP^T issued together, then the softmax's backward. Every wgmma is waited
    // within its iteration: one in flight across the loop's back edge makes the compiler
    // serialise them all. Operands (Q, dO, LSE2, D) land by TMA on their buffer's mbarrier, two
    // items ahead, waited just before the item's S^T. dS^T alternates between two buffers. Item
    // n's whole dQ [64 q][d_h] is warpgroup n % 2's (its owner's), from both warpgroups' dS^T,
    // and the owners pass one staging buffer between them (two at head dim 64 beside the
    // producer, one each). At head_dim 64 this ran 1.08x the loop in which each warpgroup added
    // its own keys' share from its own staging (PERF.md).
    // How the two warpgroups meet:
    //  - Without a block barrier (key blocks over own positions or pages): each warpgroup
    //    releases an operands buffer once its item's wgmmas are done (its own named barrier, then
    //    one thread's count on s_release); the second to release loads item n + 2 into it, and
    //    nobody waits for a release. The warpgroup without item n's dQ arrives on named barrier
    //    kDsReady + n % 4 once its dS^T is written; the owner syncs there after its own dV and dK.
    //    Item n + 2's dS^T (the same buffer) is written by the other warpgroup only after it has
    //    synced on item n + 1's barrier, where the owner of item n arrives after its dQ. The owner
    //    of item n waits on staging_free for item n - 1's reduce to have read the staging, which
    //    that owner's issuing thread signals once its next S^T and dP^T are issued. 1.03x the
    //    block barrier's rate on 64K causal, 1.035x on the sweep's dense rows (kernels/PERF.md).
    //  - kProducer (key blocks over own positions or every page, gathered blocks): the same,
    //    but the producer's thread 256 loads item n + 2 once every computing thread has arrived
    //    on the buffer's empty mbarrier, and its thread 288 issues item n's reduce once the
    //    owner's 128 threads have arrived on dq_staged, then signals staging_free when the
    //    reduce has read the staging.
    //  - kItemBarrier (gathered blocks without a producer, CTXPLAN_ATTN_BWD_PRODUCER=dense or
    //    =off): one block barrier an item (both dS^T written, the staging read, item n - 1 done);
    //    thread 0 then loads item n + 2 into item n - 1's buffer, of three. Without the barrier
    //    (and the producer) these blocks ran 0.92x (two buffers) and 0.85x (three). Beside the
    //    producer the barrier cost registers: at head_dim 128 ptxas serialised the wgmmas
    //    (C7512) and the blocks ran 0.87x (kernels/PERF.md).
    const uint32_t item_bars = base + L::kBars, staging_free = base + L::kStagingBar;
    const uint32_t empty_bars = base + L::kEmptyBars, dq_staged = base + L::kStagedBar;
    uint32_t* s_release = reinterpret_cast<uint32_t*>(smem + L::kRelease);
    // The thread that loads the items' operands (the producer's first, kProducer) initialises the
    // barriers and issues the first two items' loads under the key block's.
    const int loader_tid = kProducer ? kWbThreads : 0;
    if (tid == loader_tid) {
      for (int b = 0; b < L::kStages; ++b) {
        MbarInit(item_bars + 8 * b, 1);
        MbarInit(empty_bars + 8 * b, kWbThreads);  // every computing thread
        s_release[b] = 0;
      }
      MbarInit(staging_free, 1);
      MbarInit(dq_staged, 128);
      MbarInit(staging_free + 8, 1);
      MbarInit(dq_staged + 8, 128);
      FenceMbarInit();
      TmaPrefetchMap(&maps.q);
      TmaPrefetchMap(&maps.d_out);
    }
    // Item c's operands into buffer buf, issued by the calling thread.
    auto load_cursor = [&](const ItemCursor& c, int buf) {
      const int h = head0 + c.hl, q0 = tile_at(c.i) * BM;
      const uint32_t bar = item_bars + 8 * buf;
      MbarArriveExpectTx(bar, 2 * L::kQBytes + 2 * BM * 4);
#pragma unroll
      for (int cb = 0; cb < HD / 64; ++cb) {
        TmaLoad3d(sQ + buf * L::kQBytes + cb * (BM * 128), &maps.q, bar, cb * 64, h, q0);
        TmaLoad3d(sdO + buf * L::kQBytes + cb * (BM * 128), &maps.d_out, bar, cb * 64, h, q0);
      }
      const int64_t lse_at = static_cast<int64_t>(h) * prm.t_pad + q0;
      BulkLoad(sL + buf * BM * 4, prm.lse2 + lse_at, BM * 4, bar);
      BulkLoad(sD + buf * BM * 4, prm.delta + lse_at, BM * 4, bar);
    };
    auto wait_operands = [&](int n) {
      MbarWait(item_bars + 8 * (n % L::kStages), (n / L::kStages) & 1);
    };

    // acc [64 keys][64 queries] = keys_wg [64][d_h] x queries [64][d_h]^T, one commit group.
    auto key_query_product = [&](float(&acc)[BM / 2], uint32_t keys_wg, uint32_t queries) {
      const SmemTileDesc keys(keys_wg, 16, 1024), rows(queries, 16, 1024);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        WgmmaSS_m64n64<0, 0>(acc, keys.At((kk >> 2) * (BN * 128) + (kk & 3) * 32),
                             rows.At((kk >> 2) * (BM * 128) + (kk & 3) * 32), kk > 0 ? 1 : 0);
      }
      WgmmaCommit();
    };
    // The same from the warpgroup's keys held in registers (kKvRegs).
    auto key_query_product_rs = [&](float(&acc)[BM / 2], const auto& frag, uint32_t queries) {
      const SmemTileDesc rows(queries, 16, 1024);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        WgmmaRS_m64n64<0>(acc, frag[kk], rows.At((kk >> 2) * (BM * 128) + (kk & 3) * 32),
                          kk > 0 ? 1 : 0);
      }
      WgmmaCommit();
    };
    // S^T = K_wg Q^T, then dP^T = V_wg dO^T (which needs no P), from operand buffer `buf`: the
    // tensor cores run dP^T while this warpgroup exponentiates S^T, and later dV += P^T dO while it
    // forms dS^T. Two commit groups.
    auto issue_s_dp = [&](int buf) {
      WgmmaFence();
      if constexpr (kKvRegs) {
        key_query_product_rs(s, k_frag, sQ + buf * L::kQBytes);
        key_query_product_rs(dp_, v_frag, sdO + buf * L::kQBytes);
      } else {
        key_query_product(s, k_wg, sQ + buf * L::kQBytes);
        key_query_product(dp_, v_wg, sdO + buf * L::kQBytes);
      }
    };

    // With S^T done and dP^T in flight: P^T, dV += P^T dO, dS^T = P^T (dP^T - D) (into the dS
    // buffer ds, for dQ), dK += dS^T Q. Leaves dV and dK in flight, two commit groups.
    auto softmax_backward = [&](int q0, int buf, uint32_t ds) {
      const uint32_t qb = sQ + buf * L::kQBytes, dob = sdO + buf * L::kQBytes;
      // Q and dO N-major for dK and dV: 16-query steps, the two 64-column halves BM * 128 apart.
      const SmemTileDesc qb_desc(qb, BM * 128, 1024), dob_desc(dob, BM * 128, 1024);
      const float* lrow = sLf + buf * BM;
      const float* drow = sDf + buf * BM;
      const uint32_t tile_bits = sparse ? s_mask[q0 / prm.query_tile] : 0xffffffffu;

      // P^T = exp2(S^T scale log2e - LSE2[q]), masked.
      bool row_ok[2] = {key_ok[0], key_ok[1]};
      if (sparse) {
        row_ok[0] = row_ok[0] && ((tile_bits >> key_bit[0]) & 1u);
        row_ok[1] = row_ok[1] && ((tile_bits >> key_bit[1]) & 1u);
      }
      const bool full = row_ok[0] && row_ok[1] && q0 + BM <= t && (earlier || q0 >= kb0 + BN);
      // Two copies of the loop, the unmasked one (most items) without the mask arithmetic. Written
      // out: left to the compiler, the all-blocks variant was unswitched and the over-the-union one
      // was not, which ran slower (kernels/PERF.md).
      auto exponentiate = [&](auto masked) {
#pragma unroll
        for (int i = 0; i < BM / 8; ++i) {
          const float2 l2 = *reinterpret_cast<const float2*>(lrow + i * 8 + 2 * tq);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float lv = (e & 1) ? l2.y : l2.x;
            float pv = Exp2(fmaf(s[4 * i + e], prm.scale_log2, -lv));
            if constexpr (decltype(masked)::value) {
              const int qi = q0 + i * 8 + 2 * tq + (e & 1);
              const int kidx = kb0 + kr0 + (e >> 1) * 8;
              const bool ok = row_ok[e >> 1] && qi < t && (earlier || kidx <= qi);
              pv = ok ? pv : 0.0f;
            }
            s[4 * i + e] = pv;
          }
        }
      };
      if (full) {
        exponentiate(std::false_type{});
      } else {
        exponentiate(std::true_type{});
      }
      uint32_t pa[BM / 16][4];
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        pa[kq][0] = PackBf16(s[8 * kq + 0], s[8 * kq + 1]);
        pa[kq][1] = PackBf16(s[8 * kq + 2], s[8 * kq + 3]);
        pa[kq][2] = PackBf16(s[8 * kq + 4], s[8 * kq + 5]);
        pa[kq][3] = PackBf16(s[8 * kq + 6], s[8 * kq + 7]);
      }

      // dV += P^T dO.
      WgmmaFence();
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        if constexpr (HD == 128) {
          WgmmaRS_m64n128<1>(dv, pa[kq], dob_desc.At(kq * 16 * 128));
        } else {
          WgmmaRS_m64n64<1>(dv, pa[kq], dob_desc.At(kq * 16 * 128));
        }
      }
      WgmmaCommit();
      WgmmaWait<1>();  // dP^T done; dV may still run
      FenceAcc(dp_);

      // dS^T = P^T (dP^T - D[q]): packed for dK, stored for dQ.
      uint32_t da[BM / 16][4];
#pragma unroll
      for (int i = 0; i < BM / 8; ++i) {
        const float2 d2 = *reinterpret_cast<const float2*>(drow + i * 8 + 2 * tq);
        const float x0 = s[4 * i + 0] * (dp_[4 * i + 0] - d2.x);
        const float x1 = s[4 * i + 1] * (dp_[4 * i + 1] - d2.y);
        const float x2 = s[4 * i + 2] * (dp_[4 * i + 2] - d2.x);
        const float x3 = s[4 * i + 3] * (dp_[4 * i + 3] - d2.y);
        const uint32_t lo = PackBf16(x0, x1), hi = PackBf16(x2, x3);
        da[i >> 1][(i & 1) * 2 + 0] = lo;
        da[i >> 1][(i & 1) * 2 + 1] = hi;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ds + Sw128<BN>(kr0, i) + tq * 4), "r"(lo)
                     : "memory");
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(ds + Sw128<BN>(kr0 + 8, i) + tq * 4), "r"(hi)
                     : "memory");
      }
      FenceProxyAsync();

      // dK += dS^T Q.
      WgmmaFence();
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        if constexpr (HD == 128) {
          WgmmaRS_m64n128<1>(dk, da[kq], qb_desc.At(kq * 16 * 128));
        } else {
          WgmmaRS_m64n64<1>(dk, da[kq], qb_desc.At(kq * 16 * 128));
        }
      }
      WgmmaCommit();
    };

    // dQ = dS K over the block's 128 keys (both warpgroups' dS^T), one commit group: [64 q][d_h]
    // by the warpgroup whose turn it is, items alternating between the two. At head_dim 128 as
    // m64n128 wgmmas: 48 KB of shared-memory operands an item where two m64n64 halves, one a
    // warpgroup, read 64 KB (cuDNN's backward does the same, ncu, kernels/PERF.md).
    // (Over the kKeys keys from `keys`, dS^T's rows from `ds`: the halves' loop takes its own 64.)
    auto issue_dq_over = [&](auto keys_n, uint32_t ds, uint32_t keys) {
      constexpr int kKeys = decltype(keys_n)::value;
      const SmemTileDesc dq_scores(ds, BN * 128, 1024);
      const SmemTileDesc dq_keys(keys, BN * 128, 1024);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        if constexpr (HD == 128) {
          WgmmaSS_m64n128<1, 1>(dq, dq_scores.At(kk * 16 * 128), dq_keys.At(kk * 16 * 128),
                                kk > 0 ? 1 : 0);
        } else {
          WgmmaSS_m64n64<1, 1>(dq, dq_scores.At(kk * 16 * 128), dq_keys.At(kk * 16 * 128),
                               kk > 0 ? 1 : 0);
        }
      }
      WgmmaCommit();
    };
    auto issue_dq = [&](uint32_t ds) { issue_dq_over(std::integral_constant<int, BN>{}, ds, sK); };
    // dQ into the tiled fp32 accumulator by one bulk reduce an item (16 KB a 64-column half,
    // added in the L2 line by line), from a staging buffer in the accumulator's own order: the
    // per-thread fp32 atomics (16 a thread an item) held each warp until the memory system took
    // their operands, a fifth of the kernel's stall samples under ncu (kernels/PERF.md). The
    // halves go to the staging buffer's halves, which the accumulator holds side by side
    // (DqTileOffset). The staging buffer is free again once the bulk copy has read it: its issuing
    // thread waits for that before the next item's barrier (kItemBarrier) or its signal on
    // staging_free.
    // The staging's reduce into item (h, q0)'s dQ tile, committed (by the owner's issuing thread,
    // or the producer's thread 288).
    auto reduce_staged_dq = [&](int h, int q0, uint32_t staging) {
      BulkReduceAddF32(prm.dq_acc + DqTileOffset<HD>(prm.n_q_tiles, h, q0 / BM, 0),
                       base + L::kdQ + staging, HD / 64 * L::kdQBytes);
      BulkCommit();
    };
    auto add_dq = [&](int m, int h, int q0) {
#pragma unroll
      for (int c = 0; c < kDqRegs / 4; ++c)
        StShared4(dq_stage_mine + staging_of(m) + (c >> 3) * L::kdQBytes + (c & 7) * 128 * 16,
                  dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]);
      FenceProxyAsync();
      if constexpr (kProducer) {
        MbarArrive(dq_staged + bar_of(m));  // the producer's warp 9 issues the reduce
        return;
      }
      NamedBarrierSync(1 + wg, 128);
      if (dq_issuer) reduce_staged_dq(h, q0, staging_of(m));
    };

    ItemCursor cur = order.first, ahead = order.first;  // items n and n + 2
    for (int b = 0; b < 2; ++b) {
      if (tid == loader_tid && b < n_items) load_cursor(ahead, b);
      next_item(ahead);
    }
    CpAsyncWait<0>();  // the key block (LoadKeyBlockKv commits its copies)
    FenceProxyAsync();
    __syncthreads();  // the key block; the mbarriers initialised

    if constexpr (kProducer) {
      if (tid >= kWbThreads) {
        SetMaxRegistersDec<24>();
        if (tid == loader_tid) {
          // Item n's operands into buffer n % 2 once both warpgroups have released item n - 2.
          ItemCursor c = ahead;
          for (int n = L::kStages; n < n_items; ++n) {
            const int b = n % L::kStages;
            MbarWait(empty_bars + 8 * b, ((n - L::kStages) / L::kStages) & 1);
            load_cursor(c, b);
            next_item(c);
          }
        } else if (warp == 9 && lane == 0) {
          // Item m's dQ, once its owner has staged it, into the accumulator; the staging is free
          // again once read.
          ItemCursor c = order.first;
          for (int m = 0; m < n_items; ++m) {
            int h, q0;
            item_at(c, h, q0);
            next_item(c);
            MbarWait(dq_staged + bar_of(m), (kDqDouble ? m >> 1 : m) & 1);
            reduce_staged_dq(h, q0, staging_of(m));
            BulkWaitRead<0>();
            MbarArrive(staging_free + bar_of(m));
          }
          BulkWait<0>();  // the reduces done before the block's shared memory goes
        } else if (kGather && warp == 10 && gathered) {
          // The dKV rows the block adds into at its end: found now for the epilogue, in
          // s_dkv_rows (two dependent page-table reads and a division a key, which the epilogue
          // waited out: ~4% of a gathered launch's stall samples under ncu), and brought into
          // the L2, so that its atomics find them there (1.01-1.02x; kernels/PERF.md). A row of
          // K and one of V a key, the keys over the warp's lanes.
          const int64_t elem = prm.dkv_f32 ? 4 : 2;
          const uint32_t row_bytes = static_cast<uint32_t>(HD * elem);
          const char* pool = static_cast<const char*>(prm.dkv_pool);
          for (int r = lane; r < BN && kb0 + r < region_end; r += 32) {
            const int64_t kofs = DkvPoolRow(prm, block.gathered, kb0 + r, hkv, kv_row, HD);
            s_dkv_rows[r] = kofs;
            BulkPrefetchL2(pool + kofs * elem, row_bytes);
            BulkPrefetchL2(pool + (kofs + prm.p * kv_row) * elem, row_bytes);
          }
          NamedBarrierArrive(kDkvRowsReady, kWbThreads + 32);
        }
        return;
      }
      SetMaxRegistersInc<240>();
    }
    if constexpr (kKvRegs) {
      const int row = wwarp * 16 + (lane & 15);
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        LdMatrixX4(k_frag[kk], k_wg + Sw128<BN>(row, 2 * kk + (lane >> 4)));
        LdMatrixX4(v_frag[kk], v_wg + Sw128<BN>(row, 2 * kk + (lane >> 4)));
      }
    }

    // Without a producer, after item n's release: the issuing thread of the warpgroup whose
    // count on s_release comes second waits for that phase of the buffer's empty mbarrier (every
    // computing thread's arrival) and loads item n + 2 into the buffer.
    auto second_releaser_loads = [&](int n, int buf) {
      __threadfence_block();
      if ((atomicAdd(s_release + buf, 1u) & 1u) != 0u && n + 2 < n_items) {
        __threadfence_block();
        MbarWait(empty_bars + 8 * buf, (n / L::kStages) & 1);
        load_cursor(ahead, buf);
      }
    };
    if (halves) {
      // Over the union's halves: a warpgroup takes only the items whose tile selected its half's
      // page (a block's two halves may be two pages, which tiles select independently), each
      // item whole: S^T, dP^T, dV, dK and the dQ of its own 64 keys, added by fp32 atomics into
      // the tiled accumulator (one staging a warpgroup would not fit beside the own blocks' at
      // head_dim 128). Neither warpgroup waits for the other's dS^T, so one dS^T buffer serves:
      // each writes its own 64 rows, and rewrites them only after its barrier below, when all its
      // warps' dQ reads are done. The operand buffers go round as in the loop below: every thread
      // releases every item, the second warpgroup to release loads item n + 2; a warpgroup
      // without the item still waits for its operands (below).
      for (int n = 0; n < n_items; ++n) {
        const int buf = n % L::kStages;
        int h, q0;
        item_at(cur, h, q0);
        next_item(cur);
        const bool active = (s_mask[q0 / prm.query_tile] >> wg) & 1u;
        // Waited active or not: item n's operands land only once both warpgroups have released
        // item n - 2, so no warpgroup arrives twice in one phase of the buffer's empty mbarrier.
        wait_operands(n);
        if (active) {
          issue_s_dp(buf);
          WgmmaWait<1>();  // S^T done; dP^T may still run
          FenceAcc(s);
          softmax_backward(q0, buf, sdS);
          NamedBarrierSync(1 + wg, 128);  // this warpgroup's dS^T
          issue_dq_over(std::integral_constant<int, 64>{}, sdS + wg * 64 * 128, sK + wg * 64 * 128);
          WgmmaWait<0>();  // dQ, dV and dK
          FenceAcc(dv);
          FenceAcc(dk);
          FenceAcc(dq);
          // In the accumulator's own order, as add_dq's staging holds it (DqTileOffset).
          float* tile =
              prm.dq_acc + DqTileOffset<HD>(prm.n_q_tiles, h, q0 / BM, 0) + 4 * (tid & 127);
#pragma unroll
          for (int c = 0; c < kDqRegs / 4; ++c)
            atomicAdd(reinterpret_cast<float4*>(tile + (c >> 3) * 4096 + (c & 7) * 512),
                      make_float4(dq[4 * c], dq[4 * c + 1], dq[4 * c + 2], dq[4 * c + 3]));
        }
        MbarArrive(empty_bars + 8 * buf);
        if (active) NamedBarrierSync(1 + wg, 128);  // every warp's dS^T and operand reads done
        if (dq_issuer) second_releaser_loads(n, buf);
        next_item(ahead);
      }
    } else {
      // Without kItemBarrier: whether this warpgroup's last reduce is yet to be signalled read
      // (staging_free).
      bool staging_owed = false;
      auto signal_staging = [&] {
        if (staging_owed && dq_issuer) {
          BulkWaitRead<0>();
          MbarArrive(staging_free);
        }
        staging_owed = false;
      };
      // Before staging item m's dQ: the staging's last reduce (item m - 1's, or m - 2's with two
      // stagings) has read it.
      auto wait_staging = [&](int m) {
        if constexpr (kDqDouble) {
          if (m > 1) MbarWait(staging_free + bar_of(m), ((m - 2) >> 1) & 1);
        } else {
          if (m > 0) MbarWait(staging_free, (m - 1) & 1);
        }
      };
      // Item m's whole dQ by its owner, from its issue to the bulk reduce.
      auto whole_dq = [&](int m, int h, int q0, uint32_t ds) {
        issue_dq(ds);
        WgmmaWait<0>();  // dQ (and dV, dK)
        FenceAcc(dv);
        FenceAcc(dk);
        FenceAcc(dq);
        if constexpr (!kItemBarrier) wait_staging(m);
        add_dq(m, h, q0);
        staging_owed = !kProducer;
      };
      // kDeferDq (head_dim 64, without the item barrier): the owner of item n - 1 issues its whole
      // dQ at the top of item n, ahead of n's S^T and dP^T, and stages it once they are issued, so
      // that the tensor cores run dQ while the loads and issues go on (head_dim 64 has the
      // registers, beside kKvRegs' 32; at 128 dQ's 64 would not fit beside S^T and
      // dP^T). 1.085-1.090x on the sweep's dense rows (H100, kernels/PERF.md). Item n + 2's dS^T is
      // still written only after dQ(n) is done: the owner waits for it before its softmax of n + 1,
      // so before its arrival at n + 1's kDsReady, where the other warpgroup syncs before it
      // reaches n + 2.
      constexpr bool kDeferDq = HD == 64 && !kItemBarrier;
      int prev_h = 0, prev_q0 = 0;
      for (int n = 0; n < n_items; ++n) {
        const int buf = n % L::kStages;
        int h, q0;
        item_at(cur, h, q0);
        next_item(cur);
        const uint32_t ds = sdS + (n & 1) * L::kdSBytes;
        const bool dq_owed = kDeferDq && n > 0 && ((n - 1) & 1) == wg;
        if constexpr (kDeferDq) {
          if (dq_owed) issue_dq(sdS + ((n - 1) & 1) * L::kdSBytes);
        }
        wait_operands(n);
        issue_s_dp(buf);
        if constexpr (!kItemBarrier) signal_staging();
        if constexpr (kDeferDq) {
          WgmmaWait<2>();  // item n - 1's dQ (where this warpgroup owes it)
          if (dq_owed) {
            FenceAcc(dq);
            wait_staging(n - 1);
            add_dq(n - 1, prev_h, prev_q0);
            staging_owed = !kProducer;
          }
        }
        WgmmaWait<1>();  // S^T done; dP^T may still run
        FenceAcc(s);
        softmax_backward(q0, buf, ds);
        if constexpr (kItemBarrier) {
          if (dq_issuer) BulkWaitRead<0>();  // the last dQ staging read
          __syncthreads();                   // both warpgroups' dS^T; item n - 1 done
          if (tid == 0 && n + 2 < n_items) load_cursor(ahead, (n + 2) % L::kStages);
          next_item(ahead);
          if ((n & 1) == wg) {
            // Its dQ, while the other warpgroup goes on to the next item's S^T and dP^T.
            whole_dq(n, h, q0, ds);
            continue;
          }
          WgmmaWait<0>();  // dV and dK
          FenceAcc(dv);
          FenceAcc(dk);
          continue;
        }
        if ((n & 1) != wg) NamedBarrierArrive(kDsReady + (n & 3), 256);
        WgmmaWait<0>();  // dV and dK
        FenceAcc(dv);
        FenceAcc(dk);
        // Release the operands buffer; the second warpgroup to do so loads item n + 2 into it.
        // kProducer: every thread, its reads of the buffer's LSE2 and D done (the wgmmas that read
        // Q and dO are), arrives on the buffer's empty mbarrier, which the producer waits on (one
        // thread a warp after __syncwarp is as safe, but racecheck cannot follow it).
        // Without one, every thread arrives there too, and the warpgroup whose count on s_release
        // comes second waits for that phase (complete by then) before it loads item n + 2: the
        // count picks the loader without a wait, the mbarrier orders the reads before the load in
        // a way racecheck follows (the count alone it reported as 3 races).
        MbarArrive(empty_bars + 8 * buf);
        if constexpr (!kProducer) NamedBarrierSync(1 + wg, 128);
        if (!kProducer && dq_issuer) second_releaser_loads(n, buf);
        next_item(ahead);
        if ((n & 1) == wg) {
          NamedBarrierSync(kDsReady + (n & 3), 256);  // the other warpgroup's dS^T
          if constexpr (kDeferDq) {
            prev_h = h;
            prev_q0 = q0;
          } else {
            whole_dq(n, h, q0, ds);
          }
        }
      }
      if constexpr (kDeferDq) {
        if (n_items > 0 && ((n_items - 1) & 1) == wg) {
          signal_staging();
          whole_dq(n_items - 1, prev_h, prev_q0, sdS + ((n_items - 1) & 1) * L::kdSBytes);
        }
      }
      if constexpr (!kItemBarrier) signal_staging();
      if (!kProducer && dq_issuer) BulkWait<0>();  // the reduces done before the shared memory goes
    }
  } else {
    // One warpgroup, two blocks a multiprocessor (which overlap each other's chains): every
    // item's wgmmas waited within it. Written out apart from the pipelined loop's pieces: built
    // from them, this loop ran 2-3% slower (kernels/PERF.md).
    int hl = 0, item = 0;
    load_item(hl, tile_at(item), 0);
    CpAsyncCommit();

    for (int n = 0; hl < item_heads; ++n) {
      const int buf = n & 1;
      const int h = head0 + hl;
      const int q0 = tile_at(item) * BM;
      CpAsyncWait<0>();
      FenceProxyAsync();
      __syncthreads();
      {
        int nhl = hl, nitem = item;
        advance(nhl, nitem);
        if (nhl < item_heads) load_item(nhl, tile_at(nitem), buf ^ 1);
        CpAsyncCommit();
      }
      const uint32_t qb = sQ + buf * L::kQBytes, dob = sdO + buf * L::kQBytes;
      // Q and dO N-major for dK and dV: 16-query steps, the two 64-column halves BM * 128 apart.
      const SmemTileDesc qb_desc(qb, BM * 128, 1024), dob_desc(dob, BM * 128, 1024);
      const float* lrow = sLf + buf * BM;
      const float* drow = sDf + buf * BM;

      const uint32_t tile_bits = sparse ? s_mask[q0 / prm.query_tile] : 0xffffffffu;

      // S^T = K_wg Q^T, then dP^T = V_wg dO^T (which needs no P): the tensor cores run dP^T while
      // this warpgroup exponentiates S^T, and later dV += P^T dO while it forms dS^T.
      // acc [64 keys][64 queries] = keys_wg [64][d_h] x queries [64][d_h]^T, one commit group.
      auto key_query_product = [&](float(&acc)[BM / 2], uint32_t keys_wg, uint32_t queries) {
        const SmemTileDesc keys(keys_wg, 16, 1024), rows(queries, 16, 1024);
#pragma unroll
        for (int kk = 0; kk < HD / 16; ++kk) {
          WgmmaSS_m64n64<0, 0>(acc, keys.At((kk >> 2) * (BN * 128) + (kk & 3) * 32),
                               rows.At((kk >> 2) * (BM * 128) + (kk & 3) * 32), kk > 0 ? 1 : 0);
        }
        WgmmaCommit();
      };
      WgmmaFence();
      key_query_product(s, k_wg, qb);
      key_query_product(dp_, v_wg, dob);
      WgmmaWait<1>();  // S^T done; dP^T may still run
      FenceAcc(s);

      // P^T = exp2(S^T scale log2e - LSE2[q]), masked.
      bool row_ok[2] = {key_ok[0], key_ok[1]};
      if (sparse) {
        row_ok[0] = row_ok[0] && ((tile_bits >> key_bit[0]) & 1u);
        row_ok[1] = row_ok[1] && ((tile_bits >> key_bit[1]) & 1u);
      }
      const bool full = row_ok[0] && row_ok[1] && q0 + BM <= t && (earlier || q0 >= kb0 + BN);
      // Two copies of the loop, the unmasked one (most items) without the mask arithmetic. Written
      // out: left to the compiler, the all-blocks variant was unswitched and the over-the-union one
      // was not, which ran slower (kernels/PERF.md).
      auto exponentiate = [&](auto masked) {
#pragma unroll
        for (int i = 0; i < BM / 8; ++i) {
          const float2 l2 = *reinterpret_cast<const float2*>(lrow + i * 8 + 2 * tq);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float lv = (e & 1) ? l2.y : l2.x;
            float pv = Exp2(fmaf(s[4 * i + e], prm.scale_log2, -lv));
            if constexpr (decltype(masked)::value) {
              const int qi = q0 + i * 8 + 2 * tq + (e & 1);
              const int kidx = kb0 + kr0 + (e >> 1) * 8;
              const bool ok = row_ok[e >> 1] && qi < t && (earlier || kidx <= qi);
              pv = ok ? pv : 0.0f;
            }
            s[4 * i + e] = pv;
          }
        }
      };
      if (full) {
        exponentiate(std::false_type{});
      } else {
        exponentiate(std::true_type{});
      }
      uint32_t pa[BM / 16][4];
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        pa[kq][0] = PackBf16(s[8 * kq + 0], s[8 * kq + 1]);
        pa[kq][1] = PackBf16(s[8 * kq + 2], s[8 * kq + 3]);
        pa[kq][2] = PackBf16(s[8 * kq + 4], s[8 * kq + 5]);
        pa[kq][3] = PackBf16(s[8 * kq + 6], s[8 * kq + 7]);
      }

      // dV += P^T dO.
      WgmmaFence();
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        if constexpr (HD == 128) {
          WgmmaRS_m64n128<1>(dv, pa[kq], dob_desc.At(kq * 16 * 128));
        } else {
          WgmmaRS_m64n64<1>(dv, pa[kq], dob_desc.At(kq * 16 * 128));
        }
      }
      WgmmaCommit();
      WgmmaWait<1>();  // dP^T done; dV may still run
      FenceAcc(dp_);

      // dS^T = P^T (dP^T - D[q]): packed for dK, stored for dQ.
      uint32_t da[BM / 16][4];
#pragma unroll
      for (int i = 0; i < BM / 8; ++i) {
        const float2 d2 = *reinterpret_cast<const float2*>(drow + i * 8 + 2 * tq);
        const float x0 = s[4 * i + 0] * (dp_[4 * i + 0] - d2.x);
        const float x1 = s[4 * i + 1] * (dp_[4 * i + 1] - d2.y);
        const float x2 = s[4 * i + 2] * (dp_[4 * i + 2] - d2.x);
        const float x3 = s[4 * i + 3] * (dp_[4 * i + 3] - d2.y);
        const uint32_t lo = PackBf16(x0, x1), hi = PackBf16(x2, x3);
        da[i >> 1][(i & 1) * 2 + 0] = lo;
        da[i >> 1][(i & 1) * 2 + 1] = hi;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sdS + Sw128<BN>(kr0, i) + tq * 4), "r"(lo)
                     : "memory");
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(sdS + Sw128<BN>(kr0 + 8, i) + tq * 4),
                     "r"(hi)
                     : "memory");
      }
      FenceProxyAsync();

      // dK += dS^T Q.
      WgmmaFence();
#pragma unroll
      for (int kq = 0; kq < BM / 16; ++kq) {
        if constexpr (HD == 128) {
          WgmmaRS_m64n128<1>(dk, da[kq], qb_desc.At(kq * 16 * 128));
        } else {
          WgmmaRS_m64n64<1>(dk, da[kq], qb_desc.At(kq * 16 * 128));
        }
      }
      WgmmaCommit();

      // dQ[64 q][64 d] = dS K. Head_dim 128: with two warpgroups each takes one 64-column half of
      // d over all the block's keys (both warpgroups' dS^T), with one it does both halves in turn.
      // Head_dim 64: each warpgroup its own 64 keys' share of the one half.
      constexpr int kPasses = HD == 64 ? 1 : 3 - NWG;
      constexpr int kDqKeys = HD == 64 ? 64 : BN;
      const int dq_key0 = HD == 64 ? wg * 64 : 0;
      if (HD == 128 && NWG == 2) {
        __syncthreads();  // dS^T of both warpgroups in shared memory
      } else {
        NamedBarrierSync(1 + wg, 128);  // this warpgroup's dS^T
      }
#pragma unroll
      for (int pass = 0; pass < kPasses; ++pass) {
        const int half = HD == 64 ? 0 : NWG == 2 ? wg : pass;
        const SmemTileDesc scores(sdS + dq_key0 * 128, BN * 128, 1024);
        const SmemTileDesc keys(sK + half * (BN * 128) + dq_key0 * 128, BN * 128, 1024);
        WgmmaFence();
#pragma unroll
        for (int kk = 0; kk < kDqKeys / 16; ++kk) {
          WgmmaSS_m64n64<1, 1>(dq, scores.At(kk * 16 * 128), keys.At(kk * 16 * 128),
                               kk > 0 ? 1 : 0);
        }
        WgmmaCommit();
        WgmmaWait<0>();  // dQ, and (first pass) this warpgroup's dV and dK
        FenceAcc(dv);
        FenceAcc(dk);
        FenceAcc(dq);
        // dQ by fp32 atomics, not a shared-memory stage and TMA bulk reduce: the stage adds a
        // barrier per item to a loop the atomics never stall (kernels/PERF.md).
        if constexpr (NWG == 1) {
          // Lanes tq and tq ^ 1 swap halves so that each adds four adjacent columns of one row
          // (the even lane row g, the odd lane row g + 8): half the atomic instructions, 1.03-1.12x
          // in 64-key blocks; in 128-key blocks 0.90-1.01x (kernels/PERF.md).
          const bool odd = tq & 1;
          const int qi = q0 + wwarp * 16 + g + (odd ? 8 : 0);
          float* dst =
              prm.dq_acc + (static_cast<int64_t>(qi) * prm.hq + h) * HD + half * 64 + 2 * (tq & 2);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float give0 = odd ? dq[4 * i] : dq[4 * i + 2];
            const float give1 = odd ? dq[4 * i + 1] : dq[4 * i + 3];
            const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
            const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
            const float4 v = odd ? make_float4(got0, got1, dq[4 * i + 2], dq[4 * i + 3])
                                 : make_float4(dq[4 * i], dq[4 * i + 1], got0, got1);
            if (qi < t) atomicAdd(reinterpret_cast<float4*>(dst + i * 8), v);
          }
        } else {
#pragma unroll
          for (int hf = 0; hf < 2; ++hf) {
            const int qi = q0 + wwarp * 16 + g + hf * 8;
            if (qi < t) {
              float* dst =
                  prm.dq_acc + (static_cast<int64_t>(qi) * prm.hq + h) * HD + half * 64 + 2 * tq;
#pragma unroll
              for (int i = 0; i < 8; ++i)
                atomicAdd(reinterpret_cast<float2*>(dst + i * 8),
                          make_float2(dq[4 * i + 2 * hf], dq[4 * i + 2 * hf + 1]));
            }
          }
        }
      }
      advance(hl, item);
    }
  }
  CpAsyncWait<0>();

  // --- epilogue: dK (scaled) and dV of this thread's key rows ---
  if constexpr (kGather && kProducer) {
    if (gathered) NamedBarrierSync(kDkvRowsReady, kWbThreads + 32);  // s_dkv_rows
  }
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    if (!key_ok[hf]) continue;
    const int kidx = row_key0 + kr0 + hf * 8;
    auto dk_pair = [&](int i) {
      return make_float2(dk[4 * i + 2 * hf] * prm.scale, dk[4 * i + 2 * hf + 1] * prm.scale);
    };
    auto dv_pair = [&](int i) { return make_float2(dv[4 * i + 2 * hf], dv[4 * i + 2 * hf + 1]); };
    // (hkv, recomputed in the split kernel: one register fewer live through its loop.)
    const int kv_head = kSplitOwn ? head0 / prm.group : hkv;
    if (kSplitOwn && !earlier) {
      // One query head's share: the group's heads add into the fp32 accumulator.
      const int64_t kofs = kidx * kv_row + kv_head * HD + 2 * tq;
      AtomicAddRowIntoPool<HD / 8>(prm.own_dkv_acc, kofs, kofs + static_cast<int64_t>(t) * kv_row,
                                   dk_pair, dv_pair);
    } else if (!earlier) {
      StoreOwnRow<HD / 8>(prm, kidx, kv_head * HD + 2 * tq, dk_pair, dv_pair);
    } else {
      const int64_t kofs = (kGather && kProducer && gathered
                                ? s_dkv_rows[kr0 + hf * 8]
                                : DkvPoolRow(prm, block.gathered, kidx, kv_head, kv_row, HD)) +
                           2 * tq;
      const int64_t vofs = kofs + prm.p * kv_row;
      if (gathered) {
        if (prm.dkv_f32) {
          AtomicAddRowIntoPool<HD / 8>(static_cast<float*>(prm.dkv_pool), kofs, vofs, dk_pair,
                                       dv_pair);
        } else {
          AtomicAddRowIntoPool<HD / 8>(static_cast<bf16*>(prm.dkv_pool), kofs, vofs, dk_pair,
                                       dv_pair);
        }
      } else if (prm.dkv_f32) {
        AddRowIntoPool<HD / 8>(static_cast<float*>(prm.dkv_pool), kofs, vofs, dk_pair, dv_pair);
      } else {
        AddRowIntoPool<HD / 8>(static_cast<bf16*>(prm.dkv_pool), kofs, vofs, dk_pair, dv_pair);
      }
    }
  }
}

// dK and dV of the own positions from split own blocks' fp32 accumulator, written (and added to
// the own pages' dKV) as an unsplit block writes them: one thread a row's KV head and column
// quarter (StoreOwnRow's access pattern).
template <int HD>
__global__ void AttnBwdOwnDkvPostKernel(const BwdParams prm) {
  const int64_t kv_row = static_cast<int64_t>(prm.hkv) * HD;
  const int64_t n = static_cast<int64_t>(prm.t) * prm.hkv * 4;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int tq = static_cast<int>(i & 3);
    const int64_t row_head = i >> 2;
    const int kidx = static_cast<int>(row_head / prm.hkv);
    const int64_t col = (row_head % prm.hkv) * HD + 2 * tq;
    const float* acc_k = prm.own_dkv_acc + kidx * kv_row + col;
    const float* acc_v = acc_k + static_cast<int64_t>(prm.t) * kv_row;
    StoreOwnRow<HD / 8>(
        prm, kidx, col, [&](int j) { return *reinterpret_cast<const float2*>(acc_k + j * 8); },
        [&](int j) { return *reinterpret_cast<const float2*>(acc_v + j * 8); });
  }
}

}  // namespace
}  // namespace ctxplan::kernels::cuda
