#include "ctxplan/runtime/plan/plan_geometry.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"

namespace ctxplan {

namespace {
int64_t CeilDiv(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}
}  // namespace

std::vector<int32_t> AttendedPages(const ChunkGeometry& chunk, std::span<const int32_t> selection) {
  if (!chunk.sparse) {
    std::vector<int32_t> all(static_cast<size_t>(chunk.earlier_pages));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
    return all;
  }
  // A bit a page, then the set bits in order: linear in the pages and the entries. Sorting the
  // entries cost ~60 ns an entry on the host while the GPU waited for the union (ctxplan-measure
  // readback, 2x H200 host: 0.46-0.52 ms at 128 tiles x 65, 2.0-2.6 ms at 128 x 257).
  const int64_t n = chunk.earlier_pages;
  std::vector<uint64_t> bits(static_cast<size_t>((n + 63) / 64), 0);
  for (const int32_t page : selection) {
    CTXPLAN_CHECK(page >= 0 && page < n, "a page selection names page " + std::to_string(page) +
                                             " of " + std::to_string(n) + " earlier pages");
    bits[static_cast<size_t>(page) / 64] |= uint64_t{1} << (page % 64);
  }
  std::vector<int32_t> pages;
  pages.reserve(std::min(selection.size(), static_cast<size_t>(n)));
  for (size_t w = 0; w < bits.size(); ++w)
    for (uint64_t word = bits[w]; word != 0; word &= word - 1)
      pages.push_back(static_cast<int32_t>(w * 64 + static_cast<size_t>(std::countr_zero(word))));
  return pages;
}

PlanGeometry::PlanGeometry(const ModelSpec& model, const RunOptions& options)
    : model_(model), options_(options) {
  options_.Validate(model_);
  num_chunks_ = static_cast<int32_t>(CeilDiv(options_.context_tokens, options_.chunk_tokens));
  stage_first_layer_ = PipelineStageFirstLayers(model_, options_.pipeline_stages);
  if (num_chunks_ <= kCachedChunks) {
    chunks_.reserve(static_cast<size_t>(num_chunks_));
    for (int32_t i = 0; i < num_chunks_; ++i) chunks_.push_back(ComputeChunk(i));
  }
}

std::vector<int32_t> PipelineStageFirstLayers(const ModelSpec& model, int32_t stages) {
  // The last stage takes what leaves it level with the others after the loss; the first stages
  // share the rest, the earlier ones the remainder (the embedding weighs nothing).
  const int32_t g = stages, layers = static_cast<int32_t>(model.num_hidden_layers);
  CTXPLAN_CHECK(g >= 1 && g <= layers, "pipeline stages out of range");
  const double loss = PlanGeometry::kLossLayerWeight *
                      static_cast<double>(model.vocab_size * model.hidden_size) /
                      static_cast<double>(std::max<int64_t>(model.layer_matmul_params(), 1));
  int32_t last = layers;
  if (g > 1) {
    const double level = (layers + loss) / g;
    last = std::clamp(static_cast<int32_t>(std::lround(level - loss)), 1, layers - (g - 1));
  }
  std::vector<int32_t> first(static_cast<size_t>(g) + 1, 0);
  const int32_t rest = layers - last;
  for (int32_t r = 0; r + 1 < g; ++r)
    first[static_cast<size_t>(r) + 1] =
        first[static_cast<size_t>(r)] + rest / (g - 1) + (r < rest % (g - 1) ? 1 : 0);
  first[static_cast<size_t>(g)] = layers;
  return first;
}

int32_t PlanGeometry::stage_of_layer(int32_t layer) const {
  CTXPLAN_CHECK(layer >= 0 && layer < num_layers(), "layer out of range");
  int32_t r = 0;
  while (layer >= stage_first_layer(r + 1)) ++r;
  return r;
}

int32_t PlanGeometry::Layers(int32_t stage) const {
  return stage == kAllStages ? num_layers() : stage_layers(stage);
}

int64_t PlanGeometry::boundary_forward_bytes(const ChunkGeometry& chunk) const {
  return 2 * chunk.tokens * model_.hidden_size * kBf16Bytes;
}
int64_t PlanGeometry::boundary_backward_bytes(const ChunkGeometry& chunk) const {
  return chunk.tokens * model_.hidden_size * kBf16Bytes;
}
int64_t PlanGeometry::boundary_buffer_bytes(int32_t stage) const {
  const int64_t full = options_.chunk_tokens * model_.hidden_size * kBf16Bytes;  // [c][d]
  int64_t per_buffer = 0;
  if (stage > 0) per_buffer += 2 * full + full;             // activations in, their gradient out
  if (stage < last_stage()) per_buffer += 2 * full + full;  // activations out, gradient in
  return 2 * per_buffer;
}

double ExpectedUnionPages(int64_t candidates, int64_t k, int64_t tiles, double scale) {
  if (candidates <= 0 || k <= 0 || tiles <= 0) return 0;
  if (k >= candidates) return static_cast<double>(candidates);
  const double f = static_cast<double>(candidates);
  const double t = static_cast<double>(tiles);
  const double draws =
      std::clamp(1.0 + scale * std::pow(t - 1.0, kUnionTileExponent) *
                           std::pow(f / static_cast<double>(k), kUnionDrawExponent),
                 1.0, t);
  return f * (1.0 - std::pow(1.0 - static_cast<double>(k) / f, draws));
}

double FitUnionDrawScale(std::span<const UnionSample> samples) {
  std::vector<UnionSample> informative;
  for (const UnionSample& s : samples) {
    if (s.k > 0 && s.tiles > 1 && s.k < s.candidates && s.pages > 0 &&
        s.pages < 0.999 * static_cast<double>(s.candidates))
      informative.push_back(s);
  }
  if (informative.empty()) {
    throw InputError(
        "no chunk whose page union says how its tiles overlap: every traced chunk is dense, "
        "has one tile, or selected all its candidate pages; accepted: a page-sparse run whose "
        "chunks have more earlier pages than the budget");
  }
  auto loss = [&](double log_scale) {
    const double scale = std::exp(log_scale);
    double sum = 0;
    for (const UnionSample& s : informative) {
      const double e = ExpectedUnionPages(s.candidates, s.k, s.tiles, scale) / s.pages - 1.0;
      sum += e * e;
    }
    return sum;
  };
  // The loss is flat where every chunk's draws clamp to 1 or to its tiles, so a coarse scan over
  // the scale's whole range finds the basin before a golden-section search narrows it.
  constexpr double kLow = -4.6, kHigh = 4.6;  // ln 0.01 .. ln 100
  constexpr int kScan = 200;
  double best = kLow, best_loss = loss(kLow);
  for (int i = 1; i <= kScan; ++i) {
    const double x = kLow + (kHigh - kLow) * i / kScan;
    if (const double l = loss(x); l < best_loss) best = x, best_loss = l;
  }
  const double step = (kHigh - kLow) / kScan;
  double a = best - step, b = best + step;
  const double r = (std::sqrt(5.0) - 1.0) / 2.0;
  for (int i = 0; i < 60; ++i) {
    const double c = b - r * (b - a), d = a + r * (b - a);
    if (loss(c) < loss(d)) {
      b = d;
    } else {
      a = c;
    }
  }
  return std::exp(0.5 * (a + b));
}

std::vector<UnionSample> UnionSamplesOf(const PlanGeometry& g, std::span<const DrawnUnion> drawn) {
  std::map<int32_t, std::pair<double, int64_t>> by_chunk;  // pages summed over layers, layers
  for (const DrawnUnion& u : drawn) {
    if (u.chunk < 0 || u.chunk >= g.num_chunks() || !g.Chunk(u.chunk).sparse) continue;
    by_chunk[u.chunk].first += static_cast<double>(u.pages);
    ++by_chunk[u.chunk].second;
  }
  std::vector<UnionSample> samples;
  for (const auto& [chunk, sum] : by_chunk) {
    const ChunkGeometry c = g.Chunk(chunk);
    const int64_t sinks = std::min(g.options().sink_pages, c.earlier_pages);
    samples.push_back({c.earlier_pages - sinks, g.options().page_budget, c.tiles,
                       sum.first / static_cast<double>(sum.second) - static_cast<double>(sinks),
                       chunk, sum.second, sinks});
  }
  return samples;
}

ChunkGeometry PlanGeometry::Chunk(int32_t index) const {
  CTXPLAN_CHECK(index >= 0 && index < num_chunks_, "chunk index out of range");
  return chunks_.empty() ? ComputeChunk(index) : chunks_[static_cast<size_t>(index)];
}

ChunkGeometry PlanGeometry::ComputeChunk(int32_t index) const {
  const RunOptions& o = options_;
  ChunkGeometry g;
  g.index = index;
  g.start = int64_t{index} * o.chunk_tokens;
  g.tokens = std::min(o.chunk_tokens, o.context_tokens - g.start);
  g.own_pages = CeilDiv(g.tokens, o.page_tokens);
  g.earlier_pages = g.start / o.page_tokens;  // chunks start on page boundaries
  g.tiles = CeilDiv(g.tokens, o.query_tile);
  const int64_t budget = o.page_budget + o.sink_pages;
  g.sparse = !o.dense() && g.earlier_pages > budget;
  if (!g.sparse) {
    g.pages_per_tile = g.earlier_pages;
    g.union_pages = g.earlier_pages;
  } else {
    g.pages_per_tile = budget;
    double further_tiles = static_cast<double>(g.tiles - 1);
    double union_pages = static_cast<double>(budget);
    switch (o.selection.kind) {
      case SelectionModelKind::kShared:
        break;
      case SelectionModelKind::kDisjoint:
        union_pages += further_tiles * static_cast<double>(o.page_budget);
        break;
      case SelectionModelKind::kOverlap:
        union_pages += further_tiles * static_cast<double>(o.page_budget) *
                       (1.0 - o.selection.overlap_fraction);
        break;
    }
    g.union_pages = std::min(g.earlier_pages, static_cast<int64_t>(std::ceil(union_pages)));
  }
  // The union's expected size (ExpectedUnionPages): the worst case bounds memory, this times the
  // copies and the backward's key blocks.
  g.expected_union_pages = g.union_pages;
  if (g.sparse && o.selection.kind == SelectionModelKind::kDisjoint) {
    const double expected =
        ExpectedUnionPages(g.earlier_pages - o.sink_pages, o.page_budget, g.tiles,
                           o.selection.draw_scale > 0 ? o.selection.draw_scale : kUnionDrawScale);
    g.expected_union_pages =
        std::min(g.union_pages, o.sink_pages + static_cast<int64_t>(std::llround(expected)));
  }
  // The host tier: pages from gpu_tier_pages() on. The union's bound takes host pages first;
  // its expected size spreads the non-sink selections evenly over the non-sink candidates.
  const int64_t tier = gpu_tier_pages();
  g.own_host_pages = std::clamp(g.earlier_pages + g.own_pages - tier, int64_t{0}, g.own_pages);
  const int64_t host_earlier = std::max<int64_t>(0, g.earlier_pages - tier);
  g.host_union_pages = std::min(g.union_pages, host_earlier);
  g.expected_host_union_pages = g.host_union_pages;
  if (g.sparse) {
    const int64_t sinks = std::min(o.sink_pages, g.earlier_pages);
    const int64_t host_sinks = std::max<int64_t>(0, sinks - tier);
    const double host_share = static_cast<double>(host_earlier - host_sinks) /
                              static_cast<double>(std::max<int64_t>(1, g.earlier_pages - sinks));
    g.expected_host_union_pages = std::min(
        g.host_union_pages,
        host_sinks + static_cast<int64_t>(std::llround(
                         static_cast<double>(g.expected_union_pages - sinks) * host_share)));
  }
  const double t = static_cast<double>(g.tokens);
  g.pairs_own = t * (t + 1.0) / 2.0;
  g.pairs_paged = t * static_cast<double>(g.pages_per_tile * o.page_tokens);
  return g;
}

DkvState PlanGeometry::Dkv(const ChunkGeometry& chunk, int64_t selected_by_later_chunks) const {
  const bool last = chunk.index == num_chunks_ - 1;
  const int64_t selected_so_far = selected_by_later_chunks + chunk.union_pages;
  // Pages that may hold dKV while this chunk runs: its own (unless nobody comes after it) and
  // every earlier one.
  const int64_t candidate_pages = chunk.earlier_pages + (last ? 0 : chunk.own_pages);
  DkvState s;
  s.live_pages = std::min(candidate_pages, selected_so_far);
  s.live_after_pages = std::min(chunk.earlier_pages, selected_so_far);
  s.pretouched_union = std::min(chunk.union_pages, selected_by_later_chunks);
  s.own_touched = last ? 0 : std::min(chunk.own_pages, selected_by_later_chunks);
  const int64_t tier = gpu_tier_pages();
  s.live_host_pages = std::min(s.live_pages, std::max<int64_t>(0, candidate_pages - tier));
  s.live_after_host_pages =
      std::min(s.live_after_pages, std::max<int64_t>(0, chunk.earlier_pages - tier));
  s.pretouched_host_union = std::min(s.pretouched_union, chunk.host_union_pages);
  s.expected_pretouched_host_union =
      std::min(s.pretouched_host_union, chunk.expected_host_union_pages);
  s.own_touched_host = std::min(s.own_touched, chunk.own_host_pages);
  return s;
}

int64_t PlanGeometry::total_pages() const {
  return CeilDiv(options_.context_tokens, options_.page_tokens);
}

int64_t PlanGeometry::host_home_pages() const {
  if (!options_.offload) return 0;
  return std::max<int64_t>(0, total_pages() - Chunk(num_chunks_ - 1).own_pages - gpu_tier_pages());
}

int64_t PlanGeometry::kv_page_bytes() const {
  return options_.page_tokens * 2 * model_.kv_dim() * kBf16Bytes;
}
int64_t PlanGeometry::dkv_page_bytes() const {
  return options_.page_tokens * 2 * model_.kv_dim() * options_.grad_bytes();
}
int64_t PlanGeometry::summary_page_bytes() const {
  return model_.kv_dim() * kBf16Bytes;
}

namespace {
// The parameters a stage holds: its layers, the embedding on the first, the final norm and the
// LM head on the last (a tied head: the last stage keeps its own copy of the embedding).
int64_t StageParams(const ModelSpec& m, int32_t layers, bool first, bool last, bool pipelined) {
  int64_t params = layers * m.layer_params();
  if (first) params += m.embedding_params();
  if (last) {
    params += m.hidden_size + m.lm_head_params();
    if (pipelined && m.tie_word_embeddings) params += m.embedding_params();
  }
  return params;
}
}  // namespace

int64_t PlanGeometry::trainable_params(int32_t stage) const {
  const ModelSpec& m = model_;
  if (options_.lora_rank == 0) {
    if (stage == kAllStages) return m.total_params();
    return StageParams(m, Layers(stage), stage == 0, stage == last_stage(), stages() > 1);
  }
  const int64_t d = m.hidden_size, q = m.q_dim(), kv = m.kv_dim(), i = m.intermediate_size;
  // Adapters A [in x r] and B [r x out] on every projection of every layer.
  const int64_t per_layer = (d + q) + 2 * (d + kv) + (q + d) + 2 * (d + i) + (i + d);
  return options_.lora_rank * per_layer * Layers(stage);
}

int64_t PlanGeometry::weight_bytes(int32_t stage) const {
  const int64_t adapters = options_.lora_rank > 0 ? trainable_params(stage) : 0;
  const int64_t base = stage == kAllStages ? model_.total_params()
                                           : StageParams(model_, Layers(stage), stage == 0,
                                                         stage == last_stage(), stages() > 1);
  return (base + adapters) * kBf16Bytes;
}
int64_t PlanGeometry::grad_bytes(int32_t stage) const {
  return trainable_params(stage) * options_.grad_bytes();
}
int64_t PlanGeometry::optimizer_state_bytes(int32_t stage) const {
  return trainable_params(stage) * 2 * kFp32Bytes;
}
int64_t PlanGeometry::host_optimizer_bytes(int32_t stage) const {
  return optimizer_state_bytes(stage) + trainable_params(stage) * kBf16Bytes;
}

int64_t PlanGeometry::layer_inputs_bytes(const ChunkGeometry& chunk, int32_t stage) const {
  const ModelSpec& m = model_;
  const int64_t per_layer = chunk.tokens * (m.hidden_size + m.q_dim()) * kBf16Bytes +
                            chunk.tokens * m.num_attention_heads * kFp32Bytes;
  // Each query tile's page list (int32), kept so the backward can prefetch what the recompute
  // selected. One paged-attention kernel serves dense and sparse runs, so a dense tile lists
  // every earlier page.
  const int64_t page_lists = chunk.tiles * chunk.pages_per_tile * 4;
  // Kept from the fill, the top layer's output too: the loss reads it in pass 2.
  const int64_t top = options_.keep_layer_inputs ? chunk.tokens * m.hidden_size * kBf16Bytes : 0;
  return (per_layer + page_lists) * Layers(stage) + top;
}

int64_t PlanGeometry::activation_bytes() const {
  // The CUDA backend's buffers of one layer for c tokens, each its own (cuda_backend.cpp, "One
  // layer's activations"): counting fewer, as a liveness analysis would, put the arena 0.28 GiB
  // above the plan at Llama-3.1-8B chunk 4096 (device memory 0.8-2.3% under on the matrix).
  const ModelSpec& m = model_;
  const int64_t c = options_.chunk_tokens;
  const int64_t d = m.hidden_size, q = m.q_dim(), kv = m.kv_dim(), i = m.intermediate_size;
  // 14 [c][d]: the residual stream (h, its alternate, the pending residual add), norm outputs and
  // their gradients, attention and MLP outputs, the final norm's; qkv and its gradient; q, the
  // attention output and their gradients; k, v and theirs; gate/up, SwiGLU and their gradients.
  const int64_t bf16_elements = c * (14 * d + 2 * (q + 2 * kv) + 4 * q + 4 * kv + 6 * i);
  const int64_t fp32_elements = c * (m.num_attention_heads + 3);  // LSE, three norms' 1/rms
  // The page scores, fp32 per query tile and page of the context, dense or not. The selections
  // and the union tables are KiBs and left out: a budget covering every page plans as dense.
  const int64_t total_pages = CeilDiv(options_.context_tokens, options_.page_tokens);
  const int64_t scores =
      CeilDiv(c, options_.query_tile) * std::max<int64_t>(total_pages, 1) * kFp32Bytes;
  const int64_t lora = options_.lora_rank > 0 ? 2 * c * options_.lora_rank * kBf16Bytes : 0;
  return bf16_elements * kBf16Bytes + fp32_elements * kFp32Bytes + scores + lora;
}

int64_t PlanGeometry::workspace_bytes() const {
  const ModelSpec& m = model_;
  const int64_t c = options_.chunk_tokens;
  // The fused linear + cross-entropy over a chunk: a tile of fp32 logits and of their bf16
  // gradient, and the fp32 dX accumulator of its tokens (kernels/src/cuda/linear_cross_entropy.cu).
  const int64_t vocab_tile = std::min(kLossVocabTile, m.vocab_size);
  const int64_t loss = c * vocab_tile * (kFp32Bytes + kBf16Bytes) + c * m.hidden_size * kFp32Bytes;
  // The RMSNorm backward's d_weight partial rows: the layers' norms', and unless the norms are
  // frozen (LoRA) the final norm's, kept across the step's chunks (cuda_backend_layers.cpp,
  // FinalNormBackward).
  const int64_t norm_partial_sets = options_.lora_rank > 0 ? 1 : 2;
  const int64_t norm_partials =
      norm_partial_sets * std::min(c, kRmsNormMaxPartialRows) * m.hidden_size * kFp32Bytes;
  return kCublasWorkspaceBytes + loss + attention_workspace_bytes() + norm_partials;
}

int64_t PlanGeometry::attention_workspace_bytes() const {
  const ModelSpec& m = model_;
  const int64_t c = options_.chunk_tokens;
  // dQ accumulated in fp32, and each row's softmax correction and LSE, tokens padded to the
  // 64-query tile (kernels/src/cuda/attention_bwd.cu, AttentionBackwardWorkspaceBytes).
  // Chunks whose own key blocks go one a query head (SplitsOwnHeads: long ones, and from 4096
  // tokens a sequence's first, own positions only) add the own positions' dK and dV in fp32.
  const int64_t padded = CeilDiv(c, 64) * 64;
  const bool split_own =
      AttentionBackwardSplitsOwnHeads(c, m.num_attention_heads, m.num_key_value_heads, m.head_dim,
                                      /*own_only=*/true);
  return padded * m.num_attention_heads * m.head_dim * kFp32Bytes +
         2 * m.num_attention_heads * padded * kFp32Bytes +
         (split_own ? 2 * c * m.num_key_value_heads * m.head_dim * kFp32Bytes : 0);
}

int64_t PlanGeometry::paged_tokens_read(const ChunkGeometry& chunk) const {
  const int64_t per_tile = chunk.pages_per_tile * options_.page_tokens;
  return chunk.sparse ? chunk.tiles * per_tile : per_tile;
}

OpCost PlanGeometry::own_attention_forward_cost(const ChunkGeometry& c) const {
  OpCost cost = AttentionForwardCost(c.pairs_own, c.tokens, c.tokens, model_.num_attention_heads,
                                     model_.kv_dim(), model_.head_dim);
  cost.shape.merged = c.earlier_pages > 0;
  return cost;
}
OpCost PlanGeometry::paged_attention_forward_cost(const ChunkGeometry& c) const {
  return AttentionForwardCost(c.pairs_paged, c.tokens, paged_tokens_read(c),
                              model_.num_attention_heads, model_.kv_dim(), model_.head_dim,
                              c.sparse, options_.page_tokens, c.pages_per_tile, c.union_pages);
}
OpCost PlanGeometry::own_attention_backward_cost(const ChunkGeometry& c) const {
  OpCost cost = AttentionBackwardCost(c.pairs_own, c.tokens, c.tokens, model_.num_attention_heads,
                                      model_.kv_dim(), model_.head_dim, options_.grad_bytes());
  cost.shape.merged = c.earlier_pages > 0;
  return cost;
}
OpCost PlanGeometry::paged_attention_backward_cost(const ChunkGeometry& c) const {
  return AttentionBackwardCost(c.pairs_paged, c.tokens, paged_tokens_read(c),
                               model_.num_attention_heads, model_.kv_dim(), model_.head_dim,
                               options_.grad_bytes(), c.sparse, options_.page_tokens,
                               c.pages_per_tile, c.expected_union_pages);
}

int64_t PlanGeometry::union_copy_runs(const ChunkGeometry& c, int64_t pages) const {
  if (pages <= 0) return 0;
  const int64_t pages_per_chunk =
      std::max<int64_t>(1, options_.chunk_tokens / options_.page_tokens);
  const int64_t earlier_chunks = CeilDiv(std::max<int64_t>(c.earlier_pages, 1), pages_per_chunk);
  if (!c.sparse) return std::min(pages, earlier_chunks + 1);
  // The fraction of earlier pages copied: where it is small, the pages are scattered runs.
  const double selected = std::min(
      1.0, static_cast<double>(pages) / static_cast<double>(std::max<int64_t>(c.earlier_pages, 1)));
  const double runs =
      static_cast<double>(pages) * (1.0 - selected) + static_cast<double>(earlier_chunks);
  return std::clamp<int64_t>(static_cast<int64_t>(std::ceil(runs)), 1, pages);
}

int64_t PlanGeometry::max_union_pages() const {
  int64_t pages = Chunk(num_chunks_ - 1).union_pages;
  if (num_chunks_ >= 2) pages = std::max(pages, Chunk(num_chunks_ - 2).union_pages);
  return pages;
}

int64_t PlanGeometry::max_host_union_pages() const {
  int64_t pages = Chunk(num_chunks_ - 1).host_union_pages;
  if (num_chunks_ >= 2) pages = std::max(pages, Chunk(num_chunks_ - 2).host_union_pages);
  return pages;
}

int64_t PlanGeometry::page_slot_bytes() const {
  if (!options_.offload) return 0;
  const int64_t own = options_.chunk_tokens / options_.page_tokens;
  return 2 * (max_host_union_pages() + own) * (kv_page_bytes() + dkv_page_bytes());
}

int64_t PlanGeometry::tier_page_bytes(int32_t stage) const {
  return Layers(stage) * (kv_page_bytes() + dkv_page_bytes());
}

int64_t PlanGeometry::gpu_tier_bytes(int32_t stage) const {
  return gpu_tier_pages() * tier_page_bytes(stage);
}

}  // namespace ctxplan
