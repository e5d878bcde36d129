// Groups attention and select: the paged attention forward and backward (dense, over the chunk's
// own positions and earlier pages, and page-sparse), and the page selection kernels (summaries,
// scores, top-k), called as the runtime's CUDA backend calls them
// (runtime/src/cuda/cuda_backend_attention.cpp: AttentionForward, AttentionBackward, UnionPages).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/paged_kv.h"
#include "ctxplan/runtime/cuda/sm_copy.h"
#include "measure_common.h"
#include "measure_groups.h"

namespace ctxplan::calibrate {

namespace cu = ctxplan::kernels::cuda;
using kernels::KvPageShape;
using kernels::PagedKv;
using kernels::PageSelection;

namespace {

constexpr int64_t kQueryTile = 128;  // the runtime's default query tile
constexpr int64_t kSinkPages = 1;

struct Heads {
  int64_t heads, kv_heads, head_dim;
};
constexpr Heads kQwen7b{28, 4, 128};   // Qwen2.5-7B
constexpr Heads kLlama8b{32, 8, 128};  // Llama-3-8B
constexpr Heads kHeadDim64{32, 8, 64};
constexpr Heads kHeadDim64Group7{28, 4, 64};  // page-sparse rows only: d_h 64's second GQA group
// Page-sparse rows only: GQA groups 1 and 2, whose backward takes key blocks over the union
// (AttentionBackwardOverUnion) and fits their block cost.
constexpr Heads kGroup1{16, 16, 128}, kGroup1HeadDim64{16, 16, 64};
constexpr Heads kGroup2{16, 8, 128}, kGroup2HeadDim64{16, 8, 64};
// Group 2's long chunk (head dim 128 on an fp32 dKV pool takes the union from there), and the
// union's chunk range's ends.
constexpr int64_t kGroup2Tokens = 16384;
constexpr int64_t kUnionShortTokens = 1024, kUnionLongTokens = 16384;
const std::vector<Heads> kAllHeads = {kQwen7b, kLlama8b, kHeadDim64};

// a) the chunk's own positions only
const std::vector<int64_t> kOwnTokens = {1024, 2048, 4096, 8192, 16384};
const std::vector<int64_t> kOwnTokensQuick = {4096};
// b) dense over earlier pages: 4096 queries, 32768 earlier positions, by page size
constexpr int64_t kChunkTokens = 4096;
constexpr int64_t kDenseEarlier = 32768;
// (24: the forward's row cursor, 48: its cp.async groups, the rest its TMA groups: each loader
// measured, so that no planned page size takes a rate from another loader's.)
const std::vector<int64_t> kDensePages = {24, 32, 48, 64, 96, 128, 192, 256};
const std::vector<int64_t> kDensePagesQuick = {64, 96, 128};
// c) dense, page 128, by chunk size
const std::vector<int64_t> kDenseChunkTokens = {1024, 2048, 8192};
constexpr int64_t kDefaultPage = 128;
// d) page-sparse: 4096 queries over 65536 earlier positions, by page size and budget
constexpr int64_t kSparseEarlier = 65536;
const std::vector<int64_t> kSparsePages = {64, 128, 256};
const std::vector<int64_t> kSparseBudgets = {16, 64, 128};
// ... and over the other page sizes at both head dims (head dim 64's backward runs its own block
// size: sparse_*_page_efficiency_d64), each tile attending the default budget's tokens
// (kEqualTokens / p pages): a page size's table entry then tells its rate apart from the
// selection's length, which the model's per-token time does not follow exactly (at 64 pages a
// tile, pages of 32 attended 2048 tokens where page 128's 8192, and the fitted forward entries
// came out 0.79 at 32 against 0.94 at 128, where a sweep at equal tokens ran page 32 at 0.96-0.99
// of page 128's rate: sim/MODEL-LOG.md).
const std::vector<int64_t> kSparseOtherPages = {32, 48, 96, 192};
constexpr int64_t kDefaultBudget = 64;
constexpr int64_t kEqualTokens = kDefaultBudget * 128;
constexpr int64_t EqualTokensBudget(int64_t page_tokens) {
  return kEqualTokens / page_tokens;
}
// e) a long context: 262144 earlier positions
constexpr int64_t kLongEarlier = 262144;

// --- select ---
const std::vector<int64_t> kSummaryPages = {32, 256};
const std::vector<int64_t> kSummaryPageTokens = {64, 128};
constexpr Heads kSummaryHeads{0, 8, 128};
const std::vector<int64_t> kScorePages = {32, 128, 512, 2048, 8192};
// The query tiles' sums: by chunk size and summed-query width (512: Qwen2.5-7B, Llama-3.2-1B;
// 1024: Llama-3-8B), at these pages.
const std::vector<int64_t> kScoreChunkTokens = {1024, 2048, 8192, 16384};
const std::vector<int64_t> kScoreChunkPages = {32, 512};
const std::vector<int64_t> kScoreHeadDim64Pages = {32, 512, 2048};
const std::vector<int64_t> kTopKTiles = {8, 32, 64};
const std::vector<int64_t> kTopKPages = {64, 256, 1024, 4096, 8192};
constexpr int64_t kTopKBudgetTiles = 32;
constexpr int64_t kTopKBudgetPages = 2048;
const std::vector<int64_t> kTopKOtherBudgets = {16, 128};

// One attention launch: `tokens` queries (and own positions) over `pages` earlier pages of
// `page_tokens`, every page (budget 0: dense) or each query tile's sink plus `budget` pages.
struct AttentionCase {
  int64_t tokens;
  Heads h;
  int64_t page_tokens;  // 0 without earlier pages
  int64_t pages;
  int64_t budget;  // 0: dense
  int64_t pages_per_tile() const { return budget > 0 ? budget + kSinkPages : 0; }
};

std::vector<AttentionCase> AttentionCases(bool quick) {
  std::vector<AttentionCase> cases;
  auto paged = [&](int64_t tokens, Heads h, int64_t p, int64_t earlier, int64_t budget) {
    // Chunks start on page boundaries: earlier positions not a multiple of p round down.
    cases.push_back({tokens, h, p, earlier / p, budget});
  };
  for (const Heads& h : kAllHeads)  // a)
    for (const int64_t t : quick ? kOwnTokensQuick : kOwnTokens) cases.push_back({t, h, 0, 0, 0});
  for (const Heads& h : quick ? std::vector<Heads>{kQwen7b, kHeadDim64} : kAllHeads)  // b)
    for (const int64_t p : quick ? kDensePagesQuick : kDensePages)
      paged(kChunkTokens, h, p, kDenseEarlier, 0);
  if (!quick) {
    for (const Heads& h : {kQwen7b, kHeadDim64})  // c)
      for (const int64_t t : kDenseChunkTokens) paged(t, h, kDefaultPage, kDenseEarlier, 0);
    for (const int64_t p : kSparsePages)  // d)
      for (const int64_t k : kSparseBudgets) paged(kChunkTokens, kQwen7b, p, kSparseEarlier, k);
    for (const int64_t p : kSparseOtherPages) {
      paged(kChunkTokens, kQwen7b, p, kSparseEarlier, EqualTokensBudget(p));
      paged(kChunkTokens, kHeadDim64, p, kSparseEarlier, EqualTokensBudget(p));
    }
    paged(kChunkTokens, kHeadDim64, 64, kSparseEarlier, EqualTokensBudget(64));  // d_h 64's table
    for (const int64_t k : {int64_t{16}, int64_t{64}}) {
      paged(kChunkTokens, kHeadDim64, kDefaultPage, kSparseEarlier, k);
      // A GQA group of 4 at head dim 128: a gathered backward block serves 8 items where
      // Qwen2.5-7B's serves 14 (its Llama-3.1-8B trace's backward read x0.80 without these rows).
      paged(kChunkTokens, kLlama8b, kDefaultPage, kSparseEarlier, k);
      // And a group of 7 at head dim 64, beside its group of 4 (kHeadDim64): with one group the
      // H200's profile put group 8's page-sparse backward 12-20% above what it ran.
      paged(kChunkTokens, kHeadDim64Group7, kDefaultPage, kSparseEarlier, k);
    }
    for (const int64_t k : {int64_t{16}, int64_t{64}}) {  // f)
      paged(kChunkTokens, kGroup1, kDefaultPage, kSparseEarlier, k);
      paged(kChunkTokens, kGroup1HeadDim64, kDefaultPage, kSparseEarlier, k);
      paged(kChunkTokens, kGroup2HeadDim64, kDefaultPage, kSparseEarlier, k);
    }
    paged(kChunkTokens, kGroup1, 256, kSparseEarlier, kDefaultBudget);
    paged(kChunkTokens, kGroup1HeadDim64, 256, kSparseEarlier, kDefaultBudget);
    // Group 1 over pages that are not whole 128-key blocks (UnionKeyBlocksOf): 64-key blocks
    // (48, 64; and 64 at head dim 128), 128-key blocks three quarters full (96), halves (192).
    for (const int64_t k : {int64_t{16}, int64_t{64}}) {
      paged(kChunkTokens, kGroup1HeadDim64, 64, kSparseEarlier, k);
      paged(kChunkTokens, kGroup1, 64, kSparseEarlier, k);
    }
    for (const int64_t p : {48, 96, 192})
      paged(kChunkTokens, kGroup1HeadDim64, p, kSparseEarlier, kDefaultBudget);
    paged(kGroup2Tokens, kGroup2, kDefaultPage, kSparseEarlier, kDefaultBudget);
    // The union's launch at the chunk range's ends: its own key blocks (on the two warpgroups
    // without the producer, 64-key where its union blocks are) grow as the chunk squared, its
    // union blocks' count and items as the chunk, so that the union's block cost, its per-pair
    // rate and the own blocks' are told apart (at 4096 alone they were not: sim/MODEL-LOG.md).
    for (const int64_t t : {kUnionShortTokens, kUnionLongTokens}) {
      paged(t, kGroup1, kDefaultPage, kSparseEarlier, kDefaultBudget);
      paged(t, kGroup1HeadDim64, kDefaultPage, kSparseEarlier, kDefaultBudget);
      paged(t, kGroup1, 64, kSparseEarlier, kDefaultBudget);
      paged(t, kGroup1HeadDim64, 64, kSparseEarlier, kDefaultBudget);
    }
    paged(kUnionLongTokens, kGroup1, kDefaultPage, kSparseEarlier, 16);
    paged(kUnionLongTokens, kGroup1HeadDim64, kDefaultPage, kSparseEarlier, 16);
    paged(kUnionLongTokens, kGroup2HeadDim64, kDefaultPage, kSparseEarlier, kDefaultBudget);
    // Group 2 over the union on a bf16 pool below 16384 tokens (whole pages at head dim 128, and
    // the 64-key blocks at 64, three-quarter-full 128-key blocks at 128 over pages of 96).
    for (const int64_t k : {int64_t{16}, int64_t{64}})
      paged(kChunkTokens, kGroup2, kDefaultPage, kSparseEarlier, k);
    paged(kUnionShortTokens, kGroup2, kDefaultPage, kSparseEarlier, kDefaultBudget);
    paged(kChunkTokens, kGroup2HeadDim64, 64, kSparseEarlier, kDefaultBudget);
    paged(kChunkTokens, kGroup2, 96, kSparseEarlier, kDefaultBudget);
    // g) Gathered blocks at groups 1-2, over the pages the union leaves them on a bf16 pool
    // (pages of 32 at group 1; 32, 48 and 64 at group 2 and head dim 128, 32, 48 and 96 at 64):
    // a block of two or four items pays its gather and dKV atomics for several pages, where the
    // page tables' rows (groups 4 and 7) spread a page's cost over 8-14 items.
    for (const Heads& h : {kGroup1, kGroup1HeadDim64})
      paged(kChunkTokens, h, 32, kSparseEarlier, EqualTokensBudget(32));
    for (const int64_t p : {32, 48, 64})
      paged(kChunkTokens, kGroup2, p, kSparseEarlier, EqualTokensBudget(p));
    for (const int64_t p : {32, 48, 96})
      paged(kChunkTokens, kGroup2HeadDim64, p, kSparseEarlier, EqualTokensBudget(p));
    paged(kChunkTokens, kQwen7b, kDefaultPage, kLongEarlier, 0);  // e)
    paged(kChunkTokens, kQwen7b, kDefaultPage, kLongEarlier, kDefaultBudget);
  } else {
    paged(kChunkTokens, kQwen7b, kDefaultPage, kSparseEarlier, kDefaultBudget);  // d)
  }
  return cases;
}

// Each query tile's selection: the sink (page 0) and `budget` other pages drawn at random from
// 1 .. pages - 1, ascending. [tiles][budget + 1]
std::vector<int32_t> RandomSelection(int64_t tiles, int64_t pages, int64_t budget, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> candidates(static_cast<size_t>(pages - 1));
  std::vector<int32_t> selection;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    std::iota(candidates.begin(), candidates.end(), 1);
    std::shuffle(candidates.begin(), candidates.end(), rng);
    std::vector<int32_t> pick(candidates.begin(), candidates.begin() + budget);
    pick.push_back(0);
    std::sort(pick.begin(), pick.end());
    selection.insert(selection.end(), pick.begin(), pick.end());
  }
  return selection;
}

DeviceArray<int32_t> ToDevice(const std::vector<int32_t>& host) {
  DeviceArray<int32_t> d(host.size());
  if (!host.empty())
    CTXPLAN_CUDA_CHECK(cudaMemcpy(d.get(), host.data(), d.bytes(), cudaMemcpyHostToDevice));
  return d;
}

std::vector<int32_t> Identity(int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// The descriptors of the launch: the own positions' op plus the earlier pages' op, as the
// planner splits one launch into two ops (runtime/src/plan/plan_geometry.cpp), summed.
OpCost AttentionCost(const AttentionCase& c, bool backward) {
  const int64_t t = c.tokens, kv_dim = c.h.kv_heads * c.h.head_dim;
  const double own_pairs = static_cast<double>(t) * (t + 1) / 2.0;
  OpCost own =
      backward ? AttentionBackwardCost(own_pairs, t, t, c.h.heads, kv_dim, c.h.head_dim, kBf16Bytes)
               : AttentionForwardCost(own_pairs, t, t, c.h.heads, kv_dim, c.h.head_dim);
  if (c.pages == 0) return own;
  const bool sparse = c.budget > 0;
  const int64_t tiles = (t + kQueryTile - 1) / kQueryTile;
  const int64_t per_tile = sparse ? c.pages_per_tile() : c.pages;
  const double pairs = static_cast<double>(t) * static_cast<double>(per_tile * c.page_tokens);
  const int64_t read = (sparse ? tiles : 1) * per_tile * c.page_tokens;  // paged_tokens_read
  const OpCost paged = backward
                           ? AttentionBackwardCost(pairs, t, read, c.h.heads, kv_dim, c.h.head_dim,
                                                   kBf16Bytes, sparse, c.page_tokens, per_tile)
                           : AttentionForwardCost(pairs, t, read, c.h.heads, kv_dim, c.h.head_dim,
                                                  sparse, c.page_tokens, per_tile);
  own.flops += paged.flops;
  own.bytes += paged.bytes;
  return own;
}

// Forward and backward of one case: two rows.
void MeasureAttentionCase(Session& session, const AttentionCase& c) {
  const int64_t t = c.tokens, hq = c.h.heads, hkv = c.h.kv_heads, dh = c.h.head_dim;
  const cu::AttentionShape shape{t, hq, hkv, dh, 1.0f / std::sqrt(static_cast<float>(dh))};
  const KvPageShape page_shape{c.page_tokens, hkv, dh};
  const bool sparse = c.budget > 0;
  const int64_t tiles = (t + kQueryTile - 1) / kQueryTile;

  // Which earlier pages live where. Dense: every page, identity slots (offload off, and offload
  // on where the union is every page). Sparse: the union of the tiles' selections in slots
  // 0 .. union-1, as the offloaded runtime stages them (CopyIn: table[union[j]] = j; the other
  // entries are never read).
  std::vector<int32_t> selection, union_pages = Identity(c.pages), page_slot = Identity(c.pages);
  if (sparse) {
    selection =
        RandomSelection(tiles, c.pages, c.budget, static_cast<uint32_t>(c.pages + c.budget));
    union_pages = selection;
    std::sort(union_pages.begin(), union_pages.end());
    union_pages.erase(std::unique(union_pages.begin(), union_pages.end()), union_pages.end());
    std::fill(page_slot.begin(), page_slot.end(), -1);
    for (size_t j = 0; j < union_pages.size(); ++j)
      page_slot[union_pages[j]] = static_cast<int32_t>(j);
  }
  const auto slots = static_cast<int64_t>(union_pages.size());
  auto q = RandomArray<bf16>(t * hq * dh, -1, 1, 101);           // [t][H_q][d_h]
  auto k_own = RandomArray<bf16>(t * hkv * dh, -1, 1, 102);      // [t][H_kv][d_h]
  auto v_own = RandomArray<bf16>(t * hkv * dh, -1, 1, 103);      // [t][H_kv][d_h]
  auto d_out = RandomArray<bf16>(t * hq * dh, -1, 1, 104);       // [t][H_q][d_h]
  DeviceArray<bf16> out(t * hq * dh);                            // [t][H_q][d_h]
  DeviceArray<float> lse(t * hq);                                // [t][H_q]
  DeviceArray<bf16> dq(t * hq * dh);                             // [t][H_q][d_h]
  DeviceArray<bf16> dk_own(t * hkv * dh), dv_own(t * hkv * dh);  // [t][H_kv][d_h]
  // The earlier pages' K/V and dKV (bf16, accumulated): [slots][2][p][H_kv][d_h].
  auto kv_pool = RandomArray<bf16>(slots * page_shape.page_elements(), -1, 1, 105);
  auto dkv_pool = RandomArray<bf16>(slots * page_shape.page_elements(), -1e-2, 1e-2, 106);
  const DeviceArray<int32_t> page_slot_d = ToDevice(page_slot);  // [pages]
  const DeviceArray<int32_t> selection_d = ToDevice(selection);  // [tiles][pages_per_tile]
  const DeviceArray<int32_t> union_d = ToDevice(union_pages);    // [union]
  const size_t workspace_bytes = cu::AttentionBackwardWorkspaceBytes(shape);
  DeviceArray<std::byte> workspace(workspace_bytes);

  const PagedKv<const bf16> earlier{page_shape, kv_pool.get(), page_slot_d.get(), c.pages};
  const PagedKv<bf16> dkv{page_shape, dkv_pool.get(), page_slot_d.get(), c.pages};
  PageSelection sel;  // dense: pages == nullptr
  sel.query_tile = kQueryTile;
  if (sparse) {
    sel.pages_per_tile = c.pages_per_tile();
    sel.pages = selection_d.get();
    sel.union_pages = union_d.get();  // the backward's key blocks over the union only
    sel.num_union_pages = slots;
  }

  Sample row;
  row.m = t;
  row.heads = hq;
  row.kv_heads = hkv;
  row.head_dim = dh;
  row.page_tokens = c.page_tokens;
  row.pages = c.pages;
  row.pages_per_tile = c.pages_per_tile();
  Sample fwd = row;
  fwd.op = "attention_fwd";
  fwd.Cost(AttentionCost(c, false));
  fwd.seconds = MedianSecondsPerCall(session, [&](int64_t) {
    cu::AttentionForward(shape, q.get(), k_own.get(), v_own.get(), earlier, sel, out.get(),
                         lse.get(), session.stream);
  });
  session.Add(fwd);
  // The backward reads the forward's out and lse: the last timed forward left them.
  Sample bwd = row;
  bwd.op = "attention_bwd";
  bwd.grad_bytes = kBf16Bytes;
  bwd.Cost(AttentionCost(c, true));
  bwd.seconds = MedianSecondsPerCall(session, [&](int64_t) {
    cu::AttentionBackward(shape, q.get(), k_own.get(), v_own.get(), earlier, sel, out.get(),
                          lse.get(), d_out.get(), dq.get(), dk_own.get(), dv_own.get(), dkv,
                          workspace.get(), workspace_bytes, session.stream);
  });
  session.Add(bwd);
}

}  // namespace

void MeasureAttention(Session& session) {
  const std::vector<AttentionCase> cases = AttentionCases(session.quick);
  Progress progress("attention", cases.size());
  for (const AttentionCase& c : cases) {
    const std::string what = Describe("attention", {{"m", c.tokens},
                                                    {"heads", c.h.heads},
                                                    {"kv_heads", c.h.kv_heads},
                                                    {"head_dim", c.h.head_dim},
                                                    {"page_tokens", c.page_tokens},
                                                    {"pages", c.pages},
                                                    {"pages_per_tile", c.pages_per_tile()}});
    progress.Step(what);
    try {
      MeasureAttentionCase(session, c);
    } catch (const std::invalid_argument& e) {
      progress.Note("skipped " + what + ": " + e.what());
    }
  }
}

// =================================================================================================
namespace {

// Mean key of each of `pages` full pages of the chunk's own (identity-mapped) pages.
Sample PageSummaryRow(Session& session, int64_t pages, int64_t p) {
  const Heads h = kSummaryHeads;
  const KvPageShape shape{p, h.kv_heads, h.head_dim};
  Rotating<bf16> pool(pages * shape.page_elements(), -1, 1, 111);    // [pages][2][p][H_kv][d_h]
  Rotating<bf16> summaries(pages * shape.kv_dim(), -1, 1, 112);      // [pages][H_kv][d_h]
  const DeviceArray<int32_t> page_slot = ToDevice(Identity(pages));  // [pages]
  Sample s;
  s.op = "page_summary";
  s.kv_heads = h.kv_heads;
  s.head_dim = h.head_dim;
  s.page_tokens = p;
  s.pages = pages;
  s.Cost(PageSummaryCost(pages, p, shape.kv_dim()));
  s.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
    cu::PageSummary(PagedKv<const bf16>{shape, pool[i], page_slot.get(), pages}, summaries[i],
                    session.stream);
  });
  return s;
}

// Each query tile's score for every earlier page.
Sample PageScoreRow(Session& session, int64_t t, Heads h, int64_t pages) {
  const int64_t tiles = (t + kQueryTile - 1) / kQueryTile;
  Rotating<bf16> q(t * h.heads * h.head_dim, -1, 1, 121);                 // [t][H_q][d_h]
  Rotating<bf16> summaries(pages * h.kv_heads * h.head_dim, -1, 1, 122);  // [pages][H_kv][d_h]
  Rotating<float> scores(tiles * pages, -1, 1, 123);                      // [tiles][pages]
  const size_t workspace_bytes = cu::PageScoreWorkspaceBytes(t, h.kv_heads, h.head_dim, kQueryTile);
  DeviceArray<std::byte> workspace(workspace_bytes);
  Sample s;
  s.op = "page_score";
  s.m = t;
  s.heads = h.heads;
  s.kv_heads = h.kv_heads;
  s.head_dim = h.head_dim;
  s.pages = pages;
  s.Cost(PageScoreCost(t, kQueryTile, pages, h.heads * h.head_dim, h.kv_heads * h.head_dim));
  s.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
    cu::PageScore(q[i], t, h.heads, h.kv_heads, h.head_dim, kQueryTile, summaries[i], pages,
                  scores[i], workspace.get(), workspace_bytes, session.stream);
  });
  return s;
}

// The sink and the `budget` best-scoring pages of each tile, from fresh random scores, then the
// selections written into pinned host memory, as the runtime's page_topk op does. Its stream
// sync (the union's page copies are issued from the host) is left out: it is no GPU work of the
// op, and timed in the batch it added the host's wake-up to every call (a traced step's
// page_topk spans ~8 us where this row said ~17).
Sample PageTopKRow(Session& session, int64_t tiles, int64_t pages, int64_t budget) {
  Rotating<float> scores(tiles * pages, -1, 1, static_cast<uint32_t>(131 + pages + tiles));
  Rotating<int32_t> selected(tiles * (budget + kSinkPages), 0, 1, 132);  // [tiles][per tile]
  const PinnedHost pinned(static_cast<size_t>(tiles * (budget + kSinkPages)) * sizeof(int32_t));
  auto* host = reinterpret_cast<int32_t*>(pinned.get());  // [tiles][per tile]
  int64_t per_tile = 0;
  Sample s;
  s.op = "page_topk";
  s.m = tiles;
  s.pages = pages;
  s.Cost(PageTopKCost(tiles, pages, std::min(pages, budget + kSinkPages)));
  s.seconds = MedianSecondsPerCall(session, [&](int64_t i) {
    per_tile =
        cu::PageTopK(scores[i], tiles, pages, budget, kSinkPages, selected[i], session.stream);
    gpu::CopyBySms(selected[i], host, tiles * per_tile, session.stream);
  });
  s.pages_per_tile = per_tile;  // min(pages, sinks + budget)
  return s;
}

}  // namespace

void MeasureSelect(Session& session) {
  struct Case {
    std::string what;
    std::function<Sample()> measure;
  };
  std::vector<Case> cases;
  for (const int64_t pages : kSummaryPages)
    for (const int64_t p : kSummaryPageTokens)
      cases.push_back({Describe("page_summary", {{"pages", pages}, {"page_tokens", p}}),
                       [&session, pages, p] { return PageSummaryRow(session, pages, p); }});
  for (const int64_t pages : kScorePages)
    cases.push_back(
        {Describe("page_score", {{"pages", pages}, {"heads", kQwen7b.heads}}),
         [&session, pages] { return PageScoreRow(session, kChunkTokens, kQwen7b, pages); }});
  for (const int64_t pages : kScoreHeadDim64Pages)
    cases.push_back(
        {Describe("page_score", {{"pages", pages}, {"heads", kHeadDim64.heads}}),
         [&session, pages] { return PageScoreRow(session, kChunkTokens, kHeadDim64, pages); }});
  for (const int64_t t : kScoreChunkTokens)
    for (const int64_t pages : kScoreChunkPages)
      for (const Heads h : {kQwen7b, kLlama8b, kHeadDim64})
        cases.push_back({Describe("page_score", {{"m", t}, {"pages", pages}, {"heads", h.heads}}),
                         [&session, t, h, pages] { return PageScoreRow(session, t, h, pages); }});
  for (const int64_t tiles : kTopKTiles)
    for (const int64_t pages : kTopKPages)
      cases.push_back(
          {Describe("page_topk", {{"m", tiles}, {"pages", pages}}), [&session, tiles, pages] {
             return PageTopKRow(session, tiles, pages, kDefaultBudget);
           }});
  for (const int64_t budget : kTopKOtherBudgets)
    cases.push_back(
        {Describe("page_topk",
                  {{"m", kTopKBudgetTiles}, {"pages", kTopKBudgetPages}, {"budget", budget}}),
         [&session, budget] {
           return PageTopKRow(session, kTopKBudgetTiles, kTopKBudgetPages, budget);
         }});

  Progress progress("select", cases.size());
  for (const Case& c : cases) {
    progress.Step(c.what);
    try {
      session.Add(c.measure());
    } catch (const std::invalid_argument& e) {
      progress.Note("skipped " + c.what + ": " + e.what());
    }
  }
}

// =================================================================================================
// Sustained (session.sustain_seconds): the forward and backward of a Llama-3-8B-shaped (d_h 128)
// and a d_h 64 chunk of 4096 queries over 32768 earlier positions in pages of 128.
void MeasurePowerAttention(Session& session) {
  MeasureAttentionCase(session,
                       {kChunkTokens, kLlama8b, kDefaultPage, kDenseEarlier / kDefaultPage, 0});
  MeasureAttentionCase(session,
                       {kChunkTokens, kHeadDim64, kDefaultPage, kDenseEarlier / kDefaultPage, 0});
}

}  // namespace ctxplan::calibrate
