// The step plan and its geometry: the arithmetic DESIGN.md pins for Qwen2.5-7B, the invariants
// of the op stream, and the selection models.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/runtime/plan/step_plan.h"

namespace ctxplan {
namespace {

RunOptions Options(int64_t context, int64_t budget = 64, bool offload = true) {
  RunOptions o;
  o.context_tokens = context;
  o.page_budget = budget;
  o.offload = offload;
  return o;
}

const ModelSpec& Qwen7B() {
  static const ModelSpec model = LoadModel("qwen2.5-7b");
  return model;
}

TEST(PlanGeometry, Qwen7BArithmetic) {
  const PlanGeometry g(Qwen7B(), Options(1 << 20));
  const int64_t layers = Qwen7B().num_hidden_layers;
  // KV of one token over all layers, bf16: 2 (K, V) x 28 layers x 4 heads x 128 x 2 bytes.
  EXPECT_EQ(g.kv_page_bytes() * layers / 128, 57344);
  EXPECT_EQ(Qwen7B().kv_bytes_per_token(), 57344);
  // bf16 weights: 7.6B parameters.
  EXPECT_GT(g.weight_bytes(), 15.22e9);
  EXPECT_LT(g.weight_bytes(), 15.24e9);
  // Page summaries: one bf16 mean key per page, layer and KV head: 28 x 512 x 2 / 128 tokens.
  EXPECT_EQ(g.summary_page_bytes() * layers / 128, 224);
  // Gradients as weights in bf16, twice in fp32; AdamW moments 8 bytes per parameter.
  EXPECT_EQ(g.grad_bytes(), g.weight_bytes());
  EXPECT_EQ(g.optimizer_state_bytes(), 4 * g.weight_bytes());
}

// The RMSNorm backward's d_weight partial rows are part of the workspace: one fp32 row of hidden
// per block (at most 1024 blocks), for the layers' norms and, unless the norms are frozen (LoRA),
// a second set for the final norm's, kept across the step's chunks.
TEST(PlanGeometry, WorkspaceCountsTheNormPartials) {
  RunOptions o = Options(1 << 20);
  const int64_t hidden = Qwen7B().hidden_size;
  const int64_t full = PlanGeometry(Qwen7B(), o).workspace_bytes();
  o.lora_rank = 16;
  const int64_t lora = PlanGeometry(Qwen7B(), o).workspace_bytes();
  EXPECT_EQ(full - lora, std::min<int64_t>(o.chunk_tokens, 1024) * hidden * 4);
  EXPECT_GE(lora, PlanGeometry::kCublasWorkspaceBytes +
                      std::min<int64_t>(o.chunk_tokens, 1024) * hidden * 4);
}

// Chunks whose own key blocks may go one a query head (Qwen2.5-7B, group 7: a first chunk's from
// 4096 tokens, every chunk's once the group's queries outgrow the L2, above ~4.7K) add the own
// positions' dK and dV in fp32 to the attention workspace. Every other term is linear in the chunk
// or constant: the difference from twice the half chunk's workspace is the split's bytes less the
// constant terms.
TEST(PlanGeometry, WorkspaceCountsTheSplitOwnDkv) {
  const ModelSpec m = Qwen7B();
  auto workspace = [&](int64_t chunk) {
    RunOptions o = Options(1 << 20);
    o.chunk_tokens = chunk;
    return PlanGeometry(m, o).workspace_bytes();
  };
  const int64_t constant = PlanGeometry::kCublasWorkspaceBytes + 2 * 1024 * m.hidden_size * 4;
  const int64_t own_dkv = 2 * m.num_key_value_heads * m.head_dim * 4;  // a token's fp32 dK, dV
  EXPECT_EQ(workspace(2048) - 2 * workspace(1024) + constant, 0);      // neither splits
  // From 4096 tokens a sequence's first chunk (own positions alone) splits; from ~4.7K every one.
  EXPECT_EQ(workspace(4096) - 2 * workspace(2048) + constant, 4096 * own_dkv);
  EXPECT_EQ(workspace(8192) - 2 * workspace(4096) + constant, 0);
}

TEST(PlanGeometry, ChunksAndPages) {
  RunOptions o = Options(10000);
  o.chunk_tokens = 4096;
  const PlanGeometry g(Qwen7B(), o);
  ASSERT_EQ(g.num_chunks(), 3);
  const ChunkGeometry last = g.Chunk(2);
  EXPECT_EQ(last.start, 8192);
  EXPECT_EQ(last.tokens, 10000 - 8192);
  EXPECT_EQ(last.own_pages, 15);  // 1808 tokens: 14 full pages and one partial
  EXPECT_EQ(last.earlier_pages, 64);
  EXPECT_EQ(last.tiles, 15);
  EXPECT_FALSE(last.sparse);  // 64 earlier pages <= 64 + 1 sink: dense
  EXPECT_EQ(last.union_pages, 64);
  EXPECT_DOUBLE_EQ(last.pairs_own, 1808.0 * 1809.0 / 2.0);
  EXPECT_DOUBLE_EQ(last.pairs_paged, 1808.0 * 8192.0);
}

TEST(PlanGeometry, SelectionModelsBoundTheUnion) {
  RunOptions o = Options(1 << 20);
  const int32_t i = 200;  // 200 x 32 = 6400 earlier pages
  o.selection = ParseSelectionModel("shared", "test");
  const ChunkGeometry shared = PlanGeometry(Qwen7B(), o).Chunk(i);
  o.selection = ParseSelectionModel("disjoint", "test");
  const ChunkGeometry disjoint = PlanGeometry(Qwen7B(), o).Chunk(i);
  o.selection = ParseSelectionModel("overlap:0.75", "test");
  const ChunkGeometry overlap = PlanGeometry(Qwen7B(), o).Chunk(i);
  ASSERT_TRUE(shared.sparse);
  EXPECT_EQ(shared.union_pages, 65);             // k + s
  EXPECT_EQ(disjoint.union_pages, 1 + 32 * 64);  // s + tiles x k
  EXPECT_EQ(overlap.union_pages, 65 + 31 * 16);  // each further tile adds 25% of k
  EXPECT_EQ(shared.pages_per_tile, 65);
  EXPECT_DOUBLE_EQ(shared.pairs_paged, disjoint.pairs_paged);  // same work, different traffic
  // Never more pages than exist.
  o.selection = ParseSelectionModel("disjoint", "test");
  EXPECT_EQ(PlanGeometry(Qwen7B(), o).Chunk(40).union_pages, 40 * 32);
}

// `disjoint:S` moves the expected union (what times copies), never the bound (what sizes memory).
TEST(PlanGeometry, MeasuredDrawScaleSetsTheExpectedUnion) {
  RunOptions o = Options(1 << 20);
  const ChunkGeometry rule = PlanGeometry(Qwen7B(), o).Chunk(200);
  o.selection = ParseSelectionModel("disjoint:0.965", "test");
  EXPECT_EQ(SelectionModelName(o.selection), "disjoint:0.965");
  const ChunkGeometry measured = PlanGeometry(Qwen7B(), o).Chunk(200);
  ASSERT_TRUE(measured.sparse);
  EXPECT_EQ(measured.union_pages, rule.union_pages);
  EXPECT_GT(measured.expected_union_pages, rule.expected_union_pages);
  EXPECT_NEAR(static_cast<double>(measured.expected_union_pages),
              1.0 + ExpectedUnionPages(6399, 64, 32, 0.965), 1.0);
  for (const char* bad : {"disjoint:0", "disjoint:-1", "disjoint:x", "disjoint:", "disjoint:101"})
    EXPECT_THROW(ParseSelectionModel(bad, "test"), InputError) << bad;
}

// The fit gives back the scale that made the unions, whatever the chunks' shapes; chunks that
// say nothing (every candidate taken, one tile) are left out, and none at all is an input error.
TEST(PlanGeometry, FitUnionDrawScaleRecoversTheScale) {
  for (const double truth : {0.3, 0.56, 0.97, 1.2}) {  // above ~1.6 every draw clamps to tiles
    std::vector<UnionSample> samples;
    for (int64_t candidates = 100; candidates <= 3000; candidates += 290)
      for (const int64_t k : {16, 64})
        for (const int64_t tiles : {24, 32, 64})
          samples.push_back(
              {candidates, k, tiles, ExpectedUnionPages(candidates, k, tiles, truth)});
    samples.push_back({50, 64, 32, 50.0});    // k >= candidates
    samples.push_back({500, 16, 1, 16.0});    // one tile
    samples.push_back({200, 64, 32, 200.0});  // all taken
    EXPECT_NEAR(FitUnionDrawScale(samples), truth, 1e-3 * truth) << truth;
  }
  const std::vector<UnionSample> none = {{50, 64, 32, 50.0}, {200, 64, 32, 200.0}};
  EXPECT_THROW(FitUnionDrawScale(none), InputError);
}

TEST(PlanGeometry, DenseDkvTouchesEveryEarlierPage) {
  const PlanGeometry g(Qwen7B(), Options(64 * 1024, RunOptions::kAllPages));
  const int32_t n = g.num_chunks();
  int64_t later = 0;
  for (int32_t i = n - 1; i >= 0; --i) {
    const ChunkGeometry c = g.Chunk(i);
    const DkvState s = g.Dkv(c, later);
    EXPECT_EQ(s.live_pages, i == n - 1 ? c.earlier_pages : c.earlier_pages + c.own_pages) << i;
    EXPECT_EQ(s.live_after_pages, c.earlier_pages);
    EXPECT_EQ(s.pretouched_union, i == n - 1 ? 0 : c.earlier_pages);
    EXPECT_EQ(s.own_touched, i == n - 1 ? 0 : c.own_pages);
    later += c.union_pages;
  }
}

// A sparse layer's union: its tiles' selections without repeats, ascending, at page counts about
// a 64-page word's edges and at 4M tokens' 32,768; a dense layer attends every earlier page; a
// page past the earlier ones is a bug named, not a write out of bounds.
TEST(PlanGeometry, AttendedPagesIsTheSortedUnion) {
  std::mt19937 rng(5);
  for (const int64_t earlier : {1, 63, 64, 65, 130, 4096, 32768}) {
    ChunkGeometry c;
    c.sparse = true;
    c.earlier_pages = earlier;
    std::uniform_int_distribution<int32_t> page(0, static_cast<int32_t>(earlier - 1));
    for (const int entries : {1, 65, 2080, 8320}) {
      std::vector<int32_t> selection(static_cast<size_t>(entries));
      for (int32_t& p : selection) p = page(rng);
      const std::set<int32_t> expected(selection.begin(), selection.end());
      EXPECT_EQ(AttendedPages(c, selection), std::vector<int32_t>(expected.begin(), expected.end()))
          << entries << " entries over " << earlier << " pages";
    }
  }
  ChunkGeometry dense;
  dense.earlier_pages = 5;
  EXPECT_EQ(AttendedPages(dense, {}), (std::vector<int32_t>{0, 1, 2, 3, 4}));
  ChunkGeometry sparse;
  sparse.sparse = true;
  sparse.earlier_pages = 64;
  const std::vector<int32_t> past = {3, 64};
  EXPECT_THROW(AttendedPages(sparse, past), InternalError);
  const std::vector<int32_t> negative = {-1};
  EXPECT_THROW(AttendedPages(sparse, negative), InternalError);
}

TEST(PlanGeometry, InvalidOptionsAreInputErrors) {
  RunOptions o = Options(1 << 20);
  o.chunk_tokens = 1000;  // not a multiple of 128
  EXPECT_THROW(PlanGeometry(Qwen7B(), o), InputError);
  o = Options(0);
  EXPECT_THROW(PlanGeometry(Qwen7B(), o), InputError);
  o = Options(RunOptions::kMaxContextTokens + 1);
  EXPECT_THROW(PlanGeometry(Qwen7B(), o), InputError);
  o = Options(1 << 20);
  o.query_tile = 8192;  // larger than the chunk
  EXPECT_THROW(PlanGeometry(Qwen7B(), o), InputError);
  o = Options(1 << 20);
  o.page_budget = -3;
  EXPECT_THROW(PlanGeometry(Qwen7B(), o), InputError);
}

// Walks a whole plan and checks what every consumer relies on.
struct PlanWalk {
  uint64_t ops = 0;
  std::map<std::pair<MemSpace, MemCategory>, int64_t> live;
  std::map<OpKind, double> flops_by_kind;
  double h2d_bytes = 0, d2h_bytes = 0;
};

PlanWalk Walk(const StepPlan& plan) {
  PlanWalk walk;
  auto ops = plan.Ops();
  std::set<OpId> seen_recent;
  while (ops.Next()) {
    const Op& op = ops.Current();
    EXPECT_EQ(op.id, walk.ops) << "ids number the ops in order";
    for (int d = 0; d < op.num_deps; ++d) {
      EXPECT_LT(op.deps[d], op.id);
      EXPECT_LE(op.id - op.deps[d], StepPlan::kMaxDependencyDistance);
    }
    if (op.kind == OpKind::kAlloc) walk.live[{op.space, op.category}] += op.bytes;
    if (op.kind == OpKind::kFree) {
      walk.live[{op.space, op.category}] -= op.bytes;
      const int64_t left = walk.live[{op.space, op.category}];
      EXPECT_GE(left, 0) << MemCategoryName(op.category);
    }
    if (IsCompute(op.kind)) {
      EXPECT_EQ(op.stream, op.kind == OpKind::kAdamW && op.stream == Stream::kHost
                               ? Stream::kHost
                               : Stream::kCompute);
      EXPECT_GT(op.cost.bytes, 0.0) << OpKindName(op.kind);
    }
    if (op.kind == OpKind::kCopyH2D) walk.h2d_bytes += op.cost.bytes;
    if (op.kind == OpKind::kCopyD2H) walk.d2h_bytes += op.cost.bytes;
    walk.flops_by_kind[op.kind] += op.cost.flops;
    ++walk.ops;
  }
  return walk;
}

TEST(StepPlan, EveryStepAllocationDiesWithItsChunk) {
  for (bool offload : {true, false}) {
    for (int64_t budget : {int64_t{64}, RunOptions::kAllPages}) {
      const StepPlan plan(Qwen7B(), Options(100'000, budget, offload));
      const PlanWalk walk = Walk(plan);
      for (const auto& [key, bytes] : walk.live) {
        const MemCategory c = key.second;
        const bool fixed = c == MemCategory::kWeights || c == MemCategory::kGrads ||
                           c == MemCategory::kOptimizer || c == MemCategory::kActivations ||
                           c == MemCategory::kWorkspace || c == MemCategory::kPageSlots ||
                           c == MemCategory::kGradStaging;
        if (!fixed) {
          EXPECT_EQ(bytes, 0) << MemCategoryName(c) << " offload " << offload;
        }
      }
    }
  }
}

// Every layer-chunk whose own pages hold dKV from later chunks has exactly one attention backward
// marked to add it (adds_own_dkv), before its kDkvAccumulate; with offload that op waits for the
// layer's copy in, which brings those pages. The first chunk (no earlier pages) included.
TEST(StepPlan, OwnDkvAccumulateRidesOnOneAttentionBackward) {
  for (bool offload : {true, false}) {
    for (int64_t budget : {int64_t{64}, RunOptions::kAllPages}) {
      const StepPlan plan(Qwen7B(), Options(40'000, budget, offload));
      std::map<OpId, OpKind> kind_of;
      std::map<std::pair<int32_t, int32_t>, int> marked;  // (chunk, layer) -> marked attention ops
      int accumulates = 0;
      auto ops = plan.Ops();
      while (ops.Next()) {
        const Op& op = ops.Current();
        kind_of[op.id] = op.kind;
        const auto key = std::make_pair(op.chunk, op.layer);
        if (op.adds_own_dkv) {
          ASSERT_EQ(op.kind, OpKind::kAttentionBackward);
          ++marked[key];
          if (offload) {
            bool waits_for_copy = false;
            for (int d = 0; d < op.num_deps; ++d)
              waits_for_copy = waits_for_copy || kind_of[op.deps[d]] == OpKind::kCopyH2D;
            EXPECT_TRUE(waits_for_copy) << "chunk " << op.chunk << " layer " << op.layer;
          }
        }
        if (op.kind == OpKind::kDkvAccumulate) {
          ++accumulates;
          EXPECT_EQ(marked[key], 1) << "chunk " << op.chunk << " layer " << op.layer;
        }
      }
      // Chunks 0 .. N-2 of 10 (the last chunk's own pages meet no later chunk), every layer.
      EXPECT_EQ(accumulates, 9 * Qwen7B().num_hidden_layers) << "offload " << offload;
      int total_marked = 0;
      for (const auto& [key, count] : marked) total_marked += count;
      EXPECT_EQ(total_marked, accumulates);
    }
  }
}

TEST(StepPlan, OffloadOffMovesNothingOverPcie) {
  const PlanWalk walk = Walk(StepPlan(Qwen7B(), Options(64 * 1024, 64, false)));
  EXPECT_EQ(walk.h2d_bytes, 0.0);
  EXPECT_EQ(walk.d2h_bytes, 0.0);
}

TEST(StepPlan, DenseOffloadCopiesEveryEarlierPage) {
  // Fill and recompute bring in every earlier page once per layer; the backward brings KV and
  // dKV in and sends dKV home.
  const int64_t n = 32 * 1024, c = 4096;
  const StepPlan plan(Qwen7B(), Options(n, RunOptions::kAllPages, true));
  const PlanWalk walk = Walk(plan);
  const double kv_token = 57344.0;  // all layers
  double earlier_tokens_fill = 0, earlier_tokens_bwd = 0;
  for (int64_t i = 0; i < n / c; ++i) {
    if (i < n / c - 1) earlier_tokens_fill += i * c;
    earlier_tokens_bwd += i * c;
  }
  // Fill: KV in for chunks 0..N-2, own KV out for the same chunks.
  // Recompute: KV in for all chunks. Backward: KV + dKV in (dKV for all but the last chunk,
  // plus own dKV), dKV out.
  const double fill_in = earlier_tokens_fill * kv_token;
  const double recompute_in = earlier_tokens_bwd * kv_token;
  const double last_earlier = (n / c - 1) * c;
  const double backward_in = earlier_tokens_bwd * kv_token +                   // KV
                             (earlier_tokens_bwd - last_earlier) * kv_token +  // dKV pretouched
                             (n - 2 * c) * kv_token + (c)*kv_token;  // own dKV, chunks < N-1
  EXPECT_DOUBLE_EQ(walk.h2d_bytes, fill_in + recompute_in + backward_in);
  EXPECT_DOUBLE_EQ(walk.d2h_bytes, (n - c) * kv_token + earlier_tokens_bwd * kv_token);
}

// Page-sparse at 1M: the copies are timed at the expected union of the tiles' selections. The
// backward brings back KV and the dKV of pages of that same union (bf16 gradients: a dKV page is
// a KV page's size), so it moves at most twice the recompute's bytes, plus the own pages' dKV.
// (With the dKV half at its worst-case union it moved 3.0x: 5.1 TB where the runtime, traced on
// an H100, moved ~3.4 TB.)
TEST(StepPlan, SparseBackwardCopiesTheExpectedUnionsDkv) {
  const StepPlan plan(Qwen7B(), Options(int64_t{1} << 20, 64, true));
  std::map<Phase, double> h2d;
  auto ops = plan.Ops();
  while (ops.Next())
    if (ops.Current().kind == OpKind::kCopyH2D)
      h2d[ops.Current().phase] += ops.Current().cost.bytes;
  const PlanGeometry& g = plan.geometry();
  ASSERT_EQ(g.kv_page_bytes(), g.dkv_page_bytes());
  double own_dkv = 0;  // at most every chunk's own pages, every layer
  for (int64_t i = 0; i < g.num_chunks(); ++i)
    own_dkv += static_cast<double>(g.Chunk(i).own_pages * g.dkv_page_bytes() * g.num_layers());
  EXPECT_GT(h2d[Phase::kBackward], 1.5 * h2d[Phase::kRecompute]);
  EXPECT_LE(h2d[Phase::kBackward], 2.0 * h2d[Phase::kRecompute] + own_dkv);
}

// The GPU tier keeps pages [0, G) of every layer on the GPU: only the host tier's pages cross.
// Dense, 32K in chunks of 4096 (8 chunks of 32 pages), G = 64 pages = the first two chunks'.
TEST(StepPlan, DenseGpuTierCopiesOnlyTheHostPages) {
  RunOptions o = Options(32 * 1024, RunOptions::kAllPages, true);
  o.gpu_tier_pages = 64;
  const PlanWalk walk = Walk(StepPlan(Qwen7B(), o));
  const double kv_token = 57344.0;  // all layers
  // Earlier positions in the host tier, chunk i: max(0, 4096 i - 8192).
  const double host_earlier_fill = 0 + 0 + 0 + 4096 + 8192 + 12288 + 16384;  // chunks 0..6
  const double host_earlier_all = host_earlier_fill + 20480;                 // chunks 0..7
  const double own_host = 5 * 4096.0;  // chunks 2..6 write host pages (the last writes none)
  // Fill: KV in, own KV out; recompute: KV in; backward: KV, pretouched dKV (all but the last
  // chunk) and own dKV in, dKV out.
  EXPECT_DOUBLE_EQ(walk.h2d_bytes, (host_earlier_fill + host_earlier_all + host_earlier_all +
                                    host_earlier_fill + own_host) *
                                       kv_token);
  EXPECT_DOUBLE_EQ(walk.d2h_bytes, (own_host + host_earlier_all) * kv_token);
}

TEST(StepPlan, GpuTierHoldingEveryPageMovesNothing) {
  for (int64_t budget : {int64_t{16}, RunOptions::kAllPages}) {
    RunOptions o = Options(64 * 1024, budget, true);
    o.gpu_tier_pages = 512;  // every page of 64K at page 128
    const PlanGeometry g(Qwen7B(), o);
    const PlanWalk walk = Walk(StepPlan(Qwen7B(), o));
    EXPECT_EQ(walk.h2d_bytes, 0.0) << budget;
    EXPECT_EQ(walk.d2h_bytes, 0.0) << budget;
    // Nothing lives on the host, the tier lives on the GPU to the step's end.
    EXPECT_EQ(walk.live.count({MemSpace::kHost, MemCategory::kKvPages}), 0u);
    EXPECT_EQ(walk.live.count({MemSpace::kHost, MemCategory::kDkvPages}), 0u);
    const int64_t layers = Qwen7B().num_hidden_layers;
    EXPECT_EQ((walk.live.at({MemSpace::kGpu, MemCategory::kKvPages})),
              512 * layers * g.kv_page_bytes());
    EXPECT_EQ((walk.live.at({MemSpace::kGpu, MemCategory::kDkvPages})),
              512 * layers * g.dkv_page_bytes());
    // The slots stage no union: only the own pages' slots remain.
    EXPECT_EQ(g.max_host_union_pages(), 0);
  }
}

// Part of the context in the GPU tier: the host's pages die with their chunks, as without one.
TEST(StepPlan, GpuTierHostPagesDieWithTheirChunks) {
  for (int64_t budget : {int64_t{16}, RunOptions::kAllPages}) {
    RunOptions o = Options(100'000, budget, true);
    o.gpu_tier_pages = 300;
    const PlanWalk walk = Walk(StepPlan(Qwen7B(), o));
    for (const auto& [key, bytes] : walk.live)
      if (key.first == MemSpace::kHost) {
        EXPECT_EQ(bytes, 0) << MemCategoryName(key.second) << " budget " << budget;
      }
  }
}

TEST(StepPlan, AttentionFlopsFollowDesignFormula) {
  // DESIGN.md: attention FLOPs per step with recompute ~ 9 A n^2 dense, A = L H_q d_h
  // (fill 2, recompute 2, backward 5, each A n^2 for causal attention over n).
  const int64_t n = 64 * 1024;
  const PlanWalk walk = Walk(StepPlan(Qwen7B(), Options(n, RunOptions::kAllPages)));
  const double a = 28.0 * 28.0 * 128.0;
  const double attention = walk.flops_by_kind.at(OpKind::kAttentionForward) +
                           walk.flops_by_kind.at(OpKind::kAttentionBackward);
  const double formula = 9.0 * a * static_cast<double>(n) * static_cast<double>(n);
  // The fill skips the last chunk, so a little less than the formula.
  EXPECT_GT(attention / formula, 0.85);
  EXPECT_LT(attention / formula, 1.01);
  // Matmuls: fill (2), recompute (2), backward (4), x N_mm per token, less the fill's last
  // chunk; the backward recomputes the internals (2) except the down projection, whose output
  // nothing needs; the LM head's 4 GEMMs count once per token.
  const double layer_mm = static_cast<double>(Qwen7B().layer_matmul_params()) * 28.0;
  const double down = 3584.0 * 18944.0 * 28.0;
  const double head = 152064.0 * 3584.0;
  const double matmul = walk.flops_by_kind.at(OpKind::kLinearForward) +
                        walk.flops_by_kind.at(OpKind::kLinearBackwardInput) +
                        walk.flops_by_kind.at(OpKind::kLinearBackwardWeight) +
                        walk.flops_by_kind.at(OpKind::kLossForwardBackward);
  const double expected =
      layer_mm * (2.0 * (n - 4096) + 6.0 * n) + (layer_mm - down) * 2.0 * n + head * 8.0 * n;
  EXPECT_NEAR(matmul / expected, 1.0, 1e-9);
}

TEST(StepPlan, BudgetAllEqualsDenseOpForOp) {
  // A budget that covers every page must produce the very same ops as dense attention.
  const int64_t n = 48 * 1024;
  const StepPlan dense(Qwen7B(), Options(n, RunOptions::kAllPages));
  const StepPlan covering(Qwen7B(), Options(n, n / 128));
  auto a = dense.Ops();
  auto b = covering.Ops();
  uint64_t count = 0;
  while (true) {
    const bool more_a = a.Next(), more_b = b.Next();
    ASSERT_EQ(more_a, more_b);
    if (!more_a) break;
    const Op& x = a.Current();
    const Op& y = b.Current();
    ASSERT_EQ(x.kind, y.kind) << count;
    ASSERT_EQ(x.stream, y.stream);
    ASSERT_EQ(x.num_deps, y.num_deps);
    ASSERT_EQ(x.pages, y.pages);
    ASSERT_EQ(x.bytes, y.bytes);
    ASSERT_EQ(x.cost.flops, y.cost.flops);
    ASSERT_EQ(x.cost.bytes, y.cost.bytes);
    ++count;
  }
  EXPECT_GT(count, 1000u);
}

// Issue 13: the layers split over pipeline stages balancing matmul work (the LM head weighs
// about two of Qwen2.5-7B's layers, so the last stage takes fewer), every op on the stage of its
// layer, the embedding on the first, the loss on the last; each receive waits for its own send
// (same chunk, pass and bytes, from the neighbour); each stage's allocations return to its fixed
// buffers, and the stages' weights add up to the model's.
TEST(StepPlan, PipelineStagesOwnTheirLayersAndPassTheirBoundaries) {
  for (int32_t stages : {2, 3, 4, 7}) {
    RunOptions o = Options(150'000, 16);
    o.pipeline_stages = stages;
    const PlanGeometry g(Qwen7B(), o);
    ASSERT_EQ(g.stage_first_layer(0), 0);
    ASSERT_EQ(g.stage_first_layer(stages), 28);
    int64_t weights = 0;
    for (int32_t r = 0; r < stages; ++r) {
      EXPECT_GE(g.stage_layers(r), 1);
      weights += g.weight_bytes(r);
    }
    EXPECT_EQ(weights, g.weight_bytes());
    if (stages == 2) {
      EXPECT_EQ(g.stage_layers(0), 15);
      EXPECT_EQ(g.stage_layers(1), 13);
    }
    std::map<OpId, Op> sends;
    std::vector<int64_t> gpu(static_cast<size_t>(stages), 0), fixed(gpu);
    int receives = 0;
    const StepPlan plan(Qwen7B(), o);
    auto ops = plan.Ops();
    while (ops.Next()) {
      const Op& op = ops.Current();
      ASSERT_GE(op.rank, 0);
      ASSERT_LT(op.rank, stages);
      if (op.layer >= 0) {
        EXPECT_EQ(op.rank, g.stage_of_layer(op.layer)) << op.id;
      }
      if (op.kind == OpKind::kEmbeddingForward || op.kind == OpKind::kEmbeddingBackward) {
        EXPECT_EQ(op.rank, 0);
      }
      if (op.kind == OpKind::kLossForwardBackward) {
        EXPECT_EQ(op.rank, stages - 1);
      }
      for (int d = 0; d < op.num_deps; ++d) EXPECT_LT(op.deps[d], op.id);
      if (op.kind == OpKind::kPeerSend) sends[op.id] = op;
      if (op.kind == OpKind::kPeerRecv) {
        ++receives;
        ASSERT_GE(op.num_deps, 1);
        const auto send = sends.find(op.deps[0]);
        ASSERT_NE(send, sends.end()) << "receive " << op.id << " waits for no send";
        const bool forward = op.stream == Stream::kRecvPrev;
        EXPECT_EQ(send->second.rank, forward ? op.rank - 1 : op.rank + 1);
        EXPECT_EQ(send->second.stream, forward ? Stream::kSendNext : Stream::kSendPrev);
        EXPECT_EQ(send->second.chunk, op.chunk);
        EXPECT_EQ(send->second.phase, op.phase);
        EXPECT_EQ(send->second.bytes, op.bytes);
        sends.erase(send);
      }
      if (IsMemory(op.kind) && op.space == MemSpace::kGpu) {
        gpu[static_cast<size_t>(op.rank)] += op.kind == OpKind::kAlloc ? op.bytes : -op.bytes;
        if (op.phase == Phase::kSetup) fixed[static_cast<size_t>(op.rank)] = gpu[op.rank];
      }
    }
    EXPECT_TRUE(sends.empty());
    // Fill, recompute and backward: one crossing a chunk and boundary each.
    EXPECT_EQ(receives, (stages - 1) * (2 * g.num_chunks() - 1 + g.num_chunks()));
    EXPECT_EQ(gpu, fixed);
  }
}

}  // namespace
}  // namespace ctxplan
