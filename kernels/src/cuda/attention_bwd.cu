// The paged attention backward's launches: the preprocess, then the key blocks a chunk takes
// (its own positions; earlier pages dense, gathered or over the union's pages; own blocks split a
// query head) on the kernel that fits them (two warpgroups, beside a producer or not, or one),
// then the postprocess. The kernels, and how they work: attention_bwd_kernels.cuh.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "attention_bwd_kernels.cuh"
#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/check.h"
#include "tensor_map.h"

namespace ctxplan::kernels::cuda {
namespace {

using namespace bwd;

template <int HD>
void LaunchBwd(const BwdParams& prm, const bf16* out, const float* lse, bf16* dq, float* dq_acc,
               float* delta, float* lse2, bool split_own, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(prm.t_pad) * prm.hq;
  {
    const int threads = 256;
    const int64_t blocks = (rows * 32 + threads - 1) / threads;
    AttnBwdPreKernel<HD><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        out, prm.d_out, lse, prm.t, prm.t_pad, prm.hq, delta, lse2);
    CTXPLAN_CUDA_CHECK_LAUNCH();
  }
  // Earlier key blocks of `bn` keys: over the union's pages, page by page, when the selection
  // gives a union and a page's blocks are at least three quarters full (pages of 96 or 192 in
  // 128-key blocks, 48 in 64-key ones); else over every earlier position, a block across pages
  // (16 or 32 in 64-key blocks: one page a block would leave most of it masked).
  // CTXPLAN_ATTN_BWD_SPARSE=positions keeps the blocks of before 2026-11-26, to compare: over
  // the union only where pages are whole blocks, 64-key blocks for every page under 128.
  const char* sparse_blocks = std::getenv("CTXPLAN_ATTN_BWD_SPARSE");
  auto sparse_mode = [&](const char* mode) {
    return sparse_blocks != nullptr && std::strcmp(sparse_blocks, mode) == 0;
  };
  const bool positions = sparse_mode("positions");
  auto with_blocks = [&](int bn, int own_bn) {
    BwdParams q = prm;
    const int per_page = (prm.p + bn - 1) / bn;
    const bool over_union = prm.sel != nullptr && prm.union_pages != nullptr &&
                            (prm.p % bn == 0 || (!positions && 4 * prm.p >= 3 * per_page * bn));
    q.union_pages = over_union ? prm.union_pages : nullptr;
    q.own_first = over_union ? 0 : 1;
    const int64_t n_e = static_cast<int64_t>(prm.num_pages) * prm.p;
    q.n_earlier_blocks =
        over_union ? prm.n_union * per_page : static_cast<int>((n_e + bn - 1) / bn);
    const int64_t blocks = q.n_earlier_blocks + (static_cast<int64_t>(prm.t) + own_bn - 1) / own_bn;
    Require(blocks * prm.hkv < (int64_t{1} << 31), "too many key blocks for one launch");
    return std::pair{q, dim3(static_cast<unsigned>(blocks * prm.hkv))};
  };
  // `used` bytes of shared memory from a 1024-byte aligned base (WbSmem::Bytes).
  // The two-warpgroup kernel's item operands, by TMA.
  BwdTensorMaps maps{};
  maps.q = EncodeTokenHeadMap(prm.q, prm.t, prm.hq, HD, kBwdBM);
  maps.d_out = EncodeTokenHeadMap(prm.d_out, prm.t, prm.hq, HD, kBwdBM);
  auto launch = [&](auto kernel, dim3 grid, int threads, int used, BwdParams q) {
    Require(used <= kMaxBwdSmem, "too many selection tiles for the backward's shared memory");
    const int smem = std::min(used + 1024, kMaxBwdSmem);
    CTXPLAN_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel<<<grid, threads, smem, stream>>>(q, maps);
    CTXPLAN_CUDA_CHECK_LAUNCH();
  };
  const int sel_tiles = prm.sel ? prm.sel_tiles : 0, q_tiles = prm.sel ? prm.n_q_tiles : 0;
  bool dq_tiled = false;  // the two-warpgroup kernel adds dQ into the tiled accumulator
  // The two-warpgroup kernel over key blocks (gather: gathered earlier blocks) on `blocks` (the
  // grid with one own block a KV head). Where SplitsOwnHeads asked for it (own_first only) its
  // own blocks go one a query head instead, hq / hkv times as many, on the
  // kSplitOwn instantiation, their dK/dV accumulator zeroed first.
  bool own_split = false;
  // A producer warpgroup beside the two computing ones (kProducer) over dense key blocks and
  // gathered ones; CTXPLAN_ATTN_BWD_PRODUCER=dense keeps gathered blocks on their item barrier
  // and =off every block on two warpgroups alone, to compare.
  const char* producer_env = std::getenv("CTXPLAN_ATTN_BWD_PRODUCER");
  const bool producer = producer_env == nullptr || std::strcmp(producer_env, "off") != 0;
  const bool producer_gathered =
      producer && (producer_env == nullptr || std::strcmp(producer_env, "dense") != 0);
  auto launch_two_warpgroups = [&](auto gather, const BwdParams& q, int64_t blocks, int smem) {
    constexpr bool kGather = decltype(gather)::value;
    const bool with_producer = kGather ? producer_gathered : producer && q.sel == nullptr;
    if (split_own && q.own_first) {
      const int64_t own_blocks = (static_cast<int64_t>(prm.t) + kBwdBN - 1) / kBwdBN;
      blocks += own_blocks * (prm.hq - prm.hkv);
      Require(blocks < (int64_t{1} << 31), "too many key blocks for one launch");
      own_split = true;
      CTXPLAN_CUDA_CHECK(
          cudaMemsetAsync(prm.own_dkv_acc, 0,
                          2 * static_cast<size_t>(prm.t) * prm.hkv * HD * sizeof(float), stream));
      if (with_producer) {
        launch(AttnBwdWgmmaKernel<HD, 2, false, kGather, true, true>,
               dim3(static_cast<unsigned>(blocks)), 384, smem, q);
        return;
      }
      launch(AttnBwdWgmmaKernel<HD, 2, false, kGather, true>, dim3(static_cast<unsigned>(blocks)),
             256, smem, q);
      return;
    }
    if (with_producer) {
      launch(AttnBwdWgmmaKernel<HD, 2, false, kGather, false, true>,
             dim3(static_cast<unsigned>(blocks)), 384, smem, q);
      return;
    }
    launch(AttnBwdWgmmaKernel<HD, 2, false, kGather>, dim3(static_cast<unsigned>(blocks)), 256,
           smem, q);
  };
  // 128-key blocks (two warpgroups) at both head dims: at head_dim 64 1.27-1.29x the 64-key
  // blocks two a multiprocessor (kernels/PERF.md). Page-sparse launches take gathered blocks;
  // the key blocks below serve them only under CTXPLAN_ATTN_BWD_SPARSE=union / =positions, to
  // compare (64 keys for pages of 64 or fewer). CTXPLAN_ATTN_BWD_KEYS=64 puts head_dim 64 dense
  // on the 64-key blocks, to compare.
  const char* keys = std::getenv("CTXPLAN_ATTN_BWD_KEYS");
  const bool keys_64 = keys != nullptr && std::strcmp(keys, "64") == 0;
  const bool small_pages = positions ? prm.p < kBwdBN : prm.p <= 64;
  // (Key blocks over a selection: the 128-key blocks' dQ staging leaves room for the selection
  // lists of chunks up to ~24K tokens; longer ones take the 64-key blocks.)
  const bool lists_fit = WbSmem<HD, 2>::Bytes(sel_tiles, q_tiles) <= kMaxBwdSmem;
  // Gathered blocks (a selection tile's selected positions, 128 keys at a time) for every
  // page-sparse chunk from GQA groups of 3: no item masked at any page size, and at pages of 128
  // and 256 1.10-1.26x the key blocks over the union's pages (kernels/PERF.md). At groups 1-2,
  // where AttentionBackwardOverUnion says, the key blocks over the union (a gathered block's fixed
  // cost, its K/V gather and dKV atomics, is carried by 2 x group items there), in one launch with
  // the own blocks (the own blocks apart, beside the producer, ran 0.87-0.99x at chunks of 4096).
  // CTXPLAN_ATTN_BWD_SPARSE=union (or =positions) keeps key blocks everywhere, =gather gathered
  // blocks everywhere, to compare.
  const bool union_by_group =
      prm.union_pages != nullptr && lists_fit &&
      AttentionBackwardOverUnion(prm.t, prm.hq, prm.hkv, HD, prm.p, prm.dkv_f32 != 0);
  const bool gather = prm.sel != nullptr && !positions && !sparse_mode("union") &&
                      (sparse_mode("gather") || !union_by_group);
  // Pages over 64 keys that are an odd number of 64-key halves (192) at head_dim 64 take the
  // union in halves: two halves a block, of one page or two, none part full (at group 1 0.91 of
  // page 128's rate, where the 128-key blocks, one of two half full, ran 0.80). Pages of 64 keep
  // the one-warpgroup 64-key blocks, two a multiprocessor, which ran 0.81-0.88 of page 128's rate
  // against the halves' 0.78-0.87 (the two warpgroups walk every item of either page and wait
  // for its operands); at head_dim 128 the halves spilled registers beside the own blocks' loop
  // (0.53-0.56) and apart from it ran no faster than the 64-key blocks (kernels/PERF.md).
  const bool halves = HD == 64 && prm.sel != nullptr && !gather && !positions &&
                      prm.union_pages != nullptr && lists_fit && prm.p > 64 && prm.p % 64 == 0 &&
                      prm.p % kBwdBN != 0;
  if (gather) {
    BwdParams q = prm;
    q.union_pages = nullptr;
    q.gather_groups = static_cast<int>((prm.sel_stride * prm.p + kBwdBN - 1) / kBwdBN);
    const int64_t earlier_blocks = static_cast<int64_t>(prm.sel_tiles) * q.gather_groups;
    const int64_t blocks = earlier_blocks + (static_cast<int64_t>(prm.t) + kBwdBN - 1) / kBwdBN;
    Require(blocks * prm.hkv < (int64_t{1} << 31), "too many key blocks for one launch");
    q.n_earlier_blocks = static_cast<int>(earlier_blocks);
    q.own_first = 1;
    dq_tiled = true;
    launch_two_warpgroups(std::true_type{}, q, blocks * prm.hkv, WbSmem<HD, 2, true>::Bytes(0, 0));
  } else if (halves) {
    BwdParams q = prm;
    q.own_first = 0;
    q.n_earlier_blocks = static_cast<int>((prm.n_union * (prm.p / 64) + 1) / 2);
    const int64_t blocks = q.n_earlier_blocks + (static_cast<int64_t>(prm.t) + kBwdBN - 1) / kBwdBN;
    Require(blocks * prm.hkv < (int64_t{1} << 31), "too many key blocks for one launch");
    dq_tiled = true;
    if constexpr (HD == 64) {
      launch(AttnBwdWgmmaKernel<HD, 2, true, false, false, false, true>,
             dim3(static_cast<unsigned>(blocks * prm.hkv)), 256,
             WbSmem<HD, 2>::Bytes(sel_tiles, q_tiles), q);
    }
  } else if ((HD == 64 && keys_64) || (prm.sel != nullptr && small_pages) || !lists_fit) {
    const auto [q, grid] = with_blocks(64, 64);
    const int smem = WbSmem<HD, 1>::Bytes(sel_tiles, q_tiles);
    if (q.union_pages != nullptr) {
      launch(AttnBwdWgmmaKernel<HD, 1, true>, grid, 128, smem, q);
    } else {
      launch(AttnBwdWgmmaKernel<HD, 1, false>, grid, 128, smem, q);
    }
  } else {
    const auto [q, grid] = with_blocks(128, 128);
    const int smem = WbSmem<HD, 2>::Bytes(sel_tiles, q_tiles);
    dq_tiled = true;
    if (q.union_pages != nullptr) {
      launch(AttnBwdWgmmaKernel<HD, 2, true>, grid, 256, smem, q);
    } else {
      launch_two_warpgroups(std::false_type{}, q, grid.x, smem);
    }
  }
  {
    const int threads = 256;
    if (dq_tiled) {
      const int64_t n4 = static_cast<int64_t>(prm.t_pad) * prm.hq * HD / 4;
      const int64_t blocks = std::min<int64_t>((n4 + threads - 1) / threads, 132 * 16);
      AttnBwdPostTiledKernel<HD><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
          dq_acc, prm.t, prm.hq, prm.n_q_tiles, prm.scale, dq);
    } else {
      const int64_t n4 = static_cast<int64_t>(prm.t) * prm.hq * HD / 4;
      const int64_t blocks = std::min<int64_t>((n4 + threads - 1) / threads, 132 * 16);
      AttnBwdPostKernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(dq_acc, n4,
                                                                               prm.scale, dq);
    }
    CTXPLAN_CUDA_CHECK_LAUNCH();
    if (own_split) {
      const int64_t n = static_cast<int64_t>(prm.t) * prm.hkv * 4;
      const int64_t blocks = std::min<int64_t>((n + threads - 1) / threads, 132 * 16);
      AttnBwdOwnDkvPostKernel<HD><<<static_cast<unsigned>(blocks), threads, 0, stream>>>(prm);
      CTXPLAN_CUDA_CHECK_LAUNCH();
    }
  }
}

// Whether the two-warpgroup kernel's own key blocks go one a query head (their dK and dV summed
// over the group by fp32 atomics, in an order that varies from run to run) instead of one a KV
// head: the rule the planner shares (AttentionBackwardSplitsOwnHeads, cost.h). Besides the L2,
// the split evens the launch's blocks: a chunk of 8192 at 28 / 4 heads ran 1.29x (H200).
// own_only: the launch has no earlier pages. CTXPLAN_ATTN_BWD_SPLIT=on / off decides instead
// (tests, comparisons).
bool SplitsOwnHeads(const AttentionShape& shape, bool own_only) {
  const char* forced = std::getenv("CTXPLAN_ATTN_BWD_SPLIT");
  if (forced != nullptr && std::strcmp(forced, "on") == 0) return true;
  if (forced != nullptr && std::strcmp(forced, "off") == 0) return false;
  return AttentionBackwardSplitsOwnHeads(shape.tokens, shape.num_heads, shape.num_kv_heads,
                                         shape.head_dim, own_only);
}

template <typename G>
void Backward(const AttentionShape& shape, const bf16* q, const bf16* k_own, const bf16* v_own,
              const PagedKv<const bf16>& earlier, const PageSelection& selection, const bf16* out,
              const float* lse, const bf16* d_out, bf16* dq, bf16* dk_own, bf16* dv_own,
              const PagedKv<G>& dkv, bool dkv_f32, void* workspace, size_t workspace_bytes,
              cudaStream_t stream, const PagedKv<const G>* own_dkv) {
  RequireAttentionInputs(shape, shape.num_kv_heads, earlier, selection);
  if (earlier.num_pages > 0) {
    Require(dkv.pool != nullptr && dkv.page_slot != nullptr, "dKV pages missing");
    Require(
        dkv.num_pages == earlier.num_pages && dkv.shape.page_tokens == earlier.shape.page_tokens &&
            dkv.shape.num_kv_heads == shape.num_kv_heads && dkv.shape.head_dim == shape.head_dim,
        "dKV pages differ from the KV pages");
  }
  if (shape.tokens == 0) return;
  Require(q && k_own && v_own && out && lse && d_out && dq && dk_own && dv_own, "null tensor");
  Require(workspace != nullptr && workspace_bytes >= AttentionBackwardWorkspaceBytes(shape) &&
              reinterpret_cast<uintptr_t>(workspace) % 256 == 0,
          "workspace too small or misaligned");

  const int64_t t = shape.tokens, hq = shape.num_heads, hd = shape.head_dim;
  const int64_t t_pad = PadTokens(t);
  uint8_t* ws = static_cast<uint8_t*>(workspace);
  float* dq_acc = reinterpret_cast<float*>(ws);
  float* delta = reinterpret_cast<float*>(ws + Align256(t_pad * hq * hd * 4));
  float* lse2 = delta + Align256(hq * t_pad * 4) / 4;
  CTXPLAN_CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, t_pad * hq * hd * 4, stream));
  const bool split_own = SplitsOwnHeads(shape, earlier.num_pages == 0);

  BwdParams prm{};
  prm.q = q;
  prm.k_own = k_own;
  prm.v_own = v_own;
  prm.pool = earlier.pool;
  prm.page_slot = earlier.page_slot;
  prm.sel = earlier.num_pages > 0 ? selection.pages : nullptr;
  prm.d_out = d_out;
  prm.lse2 = lse2;
  prm.delta = delta;
  prm.dq_acc = dq_acc;
  prm.dk_own = dk_own;
  prm.dv_own = dv_own;
  prm.dkv_pool = dkv.pool;
  prm.dkv_slot = dkv.page_slot;
  prm.page_elems = earlier.num_pages > 0 ? earlier.shape.page_elements() : 0;
  prm.sel_stride = prm.sel ? selection.pages_per_tile : 0;
  prm.dkv_f32 = dkv_f32 ? 1 : 0;
  prm.t = static_cast<int>(t);
  prm.t_pad = static_cast<int>(t_pad);
  prm.hq = static_cast<int>(hq);
  prm.hkv = static_cast<int>(shape.num_kv_heads);
  prm.group = prm.hq / prm.hkv;
  prm.p = earlier.num_pages > 0 ? static_cast<int>(earlier.shape.page_tokens) : kBwdBN;
  prm.num_pages = static_cast<int>(earlier.num_pages);
  prm.query_tile = prm.sel ? static_cast<int>(selection.query_tile) : 128;
  prm.sel_tiles =
      prm.sel ? static_cast<int>((t + selection.query_tile - 1) / selection.query_tile) : 0;
  const int64_t n_e = earlier.num_pages * (earlier.num_pages > 0 ? earlier.shape.page_tokens : 0);
  prm.n_earlier_blocks = static_cast<int>((n_e + kBwdBN - 1) / kBwdBN);
  prm.n_q_tiles = static_cast<int>(t_pad / kBwdBM);
  prm.scale = shape.scale;
  prm.scale_log2 = shape.scale * kLog2e;
  if (prm.sel != nullptr && selection.union_pages != nullptr) {
    Require(selection.num_union_pages >= 0 && selection.num_union_pages <= earlier.num_pages,
            "union page count out of range");
    prm.union_pages = selection.union_pages;
    prm.n_union = static_cast<int>(selection.num_union_pages);
  }
  if (own_dkv != nullptr) {
    const KvPageShape& os = own_dkv->shape;
    Require(own_dkv->pool != nullptr && own_dkv->page_slot != nullptr, "own dKV pages missing");
    Require(os.num_kv_heads == shape.num_kv_heads && os.head_dim == shape.head_dim &&
                os.page_tokens > 0 && own_dkv->num_pages * os.page_tokens >= t,
            "own dKV pages do not cover the chunk's positions");
    prm.own_dkv_pool = own_dkv->pool;
    prm.own_dkv_slot = own_dkv->page_slot;
    prm.own_p = static_cast<int>(os.page_tokens);
    prm.own_page_elems = os.page_elements();
  }
  if (split_own) {
    prm.own_dkv_acc = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(lse2) +
                                               Align256(static_cast<size_t>(hq * t_pad * 4)));
  }
  if (hd == 128) {
    LaunchBwd<128>(prm, out, lse, dq, dq_acc, delta, lse2, split_own, stream);
  } else {
    LaunchBwd<64>(prm, out, lse, dq, dq_acc, delta, lse2, split_own, stream);
  }
}

}  // namespace

size_t AttentionBackwardWorkspaceBytes(const AttentionShape& shape) {
  const int64_t t = std::max<int64_t>(shape.tokens, 0);
  const int64_t t_pad = PadTokens(t);
  // The split own blocks' accumulator wherever a launch of this shape could split: over its own
  // positions alone, the looser rule.
  const size_t own_dkv =
      SplitsOwnHeads(shape, /*own_only=*/true)
          ? Align256(2 * static_cast<size_t>(t * shape.num_kv_heads * shape.head_dim * 4))
          : 0;
  return Align256(static_cast<size_t>(t_pad * shape.num_heads * shape.head_dim * 4)) +
         2 * Align256(static_cast<size_t>(shape.num_heads * t_pad * 4)) + own_dkv;
}

void AttentionBackward(const AttentionShape& shape, const bf16* q, const bf16* k_own,
                       const bf16* v_own, const PagedKv<const bf16>& earlier,
                       const PageSelection& selection, const bf16* out, const float* lse,
                       const bf16* d_out, bf16* dq, bf16* dk_own, bf16* dv_own,
                       const PagedKv<float>& dkv, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream, const PagedKv<const float>* own_dkv) {
  Backward(shape, q, k_own, v_own, earlier, selection, out, lse, d_out, dq, dk_own, dv_own, dkv,
           true, workspace, workspace_bytes, stream, own_dkv);
}

void AttentionBackward(const AttentionShape& shape, const bf16* q, const bf16* k_own,
                       const bf16* v_own, const PagedKv<const bf16>& earlier,
                       const PageSelection& selection, const bf16* out, const float* lse,
                       const bf16* d_out, bf16* dq, bf16* dk_own, bf16* dv_own,
                       const PagedKv<bf16>& dkv, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream, const PagedKv<const bf16>* own_dkv) {
  Backward(shape, q, k_own, v_own, earlier, selection, out, lse, d_out, dq, dk_own, dv_own, dkv,
           false, workspace, workspace_bytes, stream, own_dkv);
}

}  // namespace ctxplan::kernels::cuda
