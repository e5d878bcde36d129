// The numbers of a chunk-recurrent step that both the op stream (step_plan.h) and the planner's
// analytic path derive from: chunk and page counts, page selections and their union, buffer
// sizes, and which dKV pages exist when. One place, so the two paths cannot disagree on them.
//
// Notation (DESIGN.md): n context, c chunk, N = ceil(n/c) chunks, p page, k budget, s sinks,
// b query tile, L layers. "Pages" below are pages of ONE layer; every layer has the same.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"

namespace ctxplan {

// The query tiles of a chunk do not select pages independently: neighbouring queries score the
// same pages alike, so a chunk's union of selected pages is what fewer tiles would draw
// independently, and the fewer the more pages there are to choose from per selected one. The
// first tile draws its k pages; the others add what this many independent draws would:
//   draws = 1 + scale * (tiles - 1)^tile_exp * (candidates / k)^draw_exp, at most `tiles`
// (kUnionDrawScale, kUnionTileExponent, kUnionDrawExponent). Least squares (each trace weighted
// alike) over the per-chunk unions of the calibration traces alone
// (traces/recorded/matrix/unions.csv: Llama-3.2-1B 128K k128 and 256K k16, Qwen2.5-7B 128K p64
// k64 and 1M k64; matrix_test refits them): each trace's union within 4%, where one fraction of
// the tiles (0.49) left them 8-9% off with 7x the squared error. Their chunks have 32 and 64
// tiles; anchored at one tile the rule holds at two (chunk 256, in no set: x1.06-1.07 of the
// measured unions, where draws = scale * tiles^0.8 * ..., fitted alike, gave x0.84). The
// validation traces: Qwen2.5-7B on the H100 x1.04, Llama-3.1-8B x0.83-0.93: its tiles draw more
// independently, at a scale 1.7x the default on each of its traces. The scale is the model's and
// the data's: `--selection disjoint:S` gives the plan one measured (FitUnionDrawScale below,
// `ctxplan selection TRACE`).
inline constexpr double kUnionDrawScale = 0.54;
inline constexpr double kUnionTileExponent = 0.8;
inline constexpr double kUnionDrawExponent = 0.16;
// The expected union of `tiles` query tiles each selecting `k` of `candidates` pages (sinks
// excluded), by the rule above at draw scale `scale`.
double ExpectedUnionPages(int64_t candidates, int64_t k, int64_t tiles,
                          double scale = kUnionDrawScale);

// One chunk's measured union (a traced run's union records, mean over its layers).
struct UnionSample {
  int64_t candidates = 0;  // earlier pages less the sinks
  int64_t k = 0;           // pages a tile selects
  int64_t tiles = 0;       // query tiles of the chunk
  double pages = 0;        // the union's non-sink pages
  int64_t chunk = 0;       // which chunk, and over how many layers `pages` is the mean
  int64_t layers = 0;
  int64_t sinks = 0;  // taken off `pages` and `candidates`
};
// The draw scale whose ExpectedUnionPages fits `samples` best (least squares of the relative
// error, each sample alike; the exponents kept). Samples whose union is all the candidates or
// where k >= candidates carry no information and are skipped; throws InputError when none is
// left.
double FitUnionDrawScale(std::span<const UnionSample> samples);

class PlanGeometry;
// One layer's union of a chunk's tile selections in the fill pass, as a run drew it.
struct DrawnUnion {
  int32_t chunk = -1;
  int64_t pages = 0;  // sinks included
};
// The drawn unions chunk by chunk, each the mean over its layers: only the chunks `g` plans
// page-sparse, sinks taken off (FitUnionDrawScale's samples).
std::vector<UnionSample> UnionSamplesOf(const PlanGeometry& g, std::span<const DrawnUnion> drawn);

struct ChunkGeometry {
  int32_t index = 0;
  int64_t start = 0;           // first position
  int64_t tokens = 0;          // c, or less for the last chunk
  int64_t own_pages = 0;       // pages holding this chunk's positions (last one maybe partial)
  int64_t earlier_pages = 0;   // E_i: pages of earlier positions (all full)
  int64_t tiles = 0;           // query tiles of b queries
  bool sparse = false;         // page selection applies (budget < earlier pages)
  int64_t pages_per_tile = 0;  // earlier pages one query tile attends (sinks included)
  int64_t union_pages = 0;     // U_i: pages any tile attends: what crosses PCIe per layer
  // What crosses PCIe and what the backward's key blocks span on average, for time: under the
  // disjoint selection model, ExpectedUnionPages (memory and slots keep union_pages).
  int64_t expected_union_pages = 0;
  // With offload, the host tier's part (RunOptions::gpu_tier_pages): what crosses PCIe. All of
  // the above without a GPU tier.
  int64_t own_host_pages = 0;             // own pages whose home is the host
  int64_t host_union_pages = 0;           // union pages in the host tier, bound (the slots)
  int64_t expected_host_union_pages = 0;  // ... expected, for time
  double pairs_own = 0.0;                 // causal (query, key) pairs inside the chunk
  double pairs_paged = 0.0;               // (query, key) pairs against earlier pages
};

// dKV pages in the reverse pass. A dKV page is allocated on first write and dies with its chunk.
// Which pages the sparse selections touch is unknown before the run, so the plan assumes the
// conservative case: every page the reverse pass has selected so far is a different one, up to
// all pages that exist (exact for dense attention). T_i = sum over j >= i of U_j.
struct DkvState {
  int64_t live_pages = 0;        // dKV pages allocated while chunk i runs its backward
  int64_t live_after_pages = 0;  // ... after chunk i's own pages die
  int64_t pretouched_union = 0;  // pages of U_i that already hold dKV (copied in, not zeroed)
  int64_t own_touched = 0;       // own pages holding dKV from later chunks
  // The host tier's part of each (offload with a GPU tier), bounds: the host holds as many of
  // the live pages as its tier has, the union's pretouched pages are the host's first.
  int64_t live_host_pages = 0;
  int64_t live_after_host_pages = 0;
  int64_t pretouched_host_union = 0;
  int64_t own_touched_host = 0;
  // What times the backward's copies: the pretouched host pages of the union at its expected
  // size (ChunkGeometry::expected_host_union_pages), as the KV pages of that union are timed.
  int64_t expected_pretouched_host_union = 0;
};

// The earlier pages one layer of a chunk attends, ascending: every earlier page when the chunk
// is dense, else the union of its tiles' selections ([tiles][pages_per_tile] logical pages).
// What the backends copy in and out for that layer.
std::vector<int32_t> AttendedPages(const ChunkGeometry& chunk, std::span<const int32_t> selection);

// The first layer of each of `stages` pipeline stages, and the layer count last ([stages + 1]):
// PlanGeometry's split, which checkpoints of one stage need without a whole plan.
std::vector<int32_t> PipelineStageFirstLayers(const ModelSpec& model, int32_t stages);

class PlanGeometry {
 public:
  // Throws InputError if the options are invalid for the model.
  PlanGeometry(const ModelSpec& model, const RunOptions& options);

  const ModelSpec& model() const { return model_; }
  const RunOptions& options() const { return options_; }

  int32_t num_chunks() const { return num_chunks_; }
  // Chunks pass 1 runs: all but the last, or all of them when layer inputs are kept.
  int32_t fill_chunks() const { return options_.keep_layer_inputs ? num_chunks_ : num_chunks_ - 1; }
  // Whether pass 1 writes this chunk's KV pages: a later chunk reads them (never the last's).
  bool writes_pages(int32_t chunk) const { return chunk < num_chunks_ - 1; }
  int32_t num_layers() const { return static_cast<int32_t>(model_.num_hidden_layers); }

  // --- pipeline stages (RunOptions::pipeline_stages; one stage with one GPU) ---
  // Stage r runs layers [stage_first_layer(r), stage_first_layer(r + 1)); stage 0 also the
  // embedding, the last stage the final norm and the loss. The split balances each stage's
  // matmul work, the loss's LM head counted as the layers it weighs (kLossLayerWeight).
  int32_t stages() const { return options_.pipeline_stages; }
  int32_t stage_first_layer(int32_t stage) const {
    return stage_first_layer_[static_cast<size_t>(stage)];
  }
  int32_t stage_layers(int32_t stage) const {
    return stage_first_layer(stage + 1) - stage_first_layer(stage);
  }
  int32_t stage_of_layer(int32_t layer) const;
  int32_t last_stage() const { return stages() - 1; }
  // Chunks whose layer inputs a stage holds at once in pass 2: stage r recomputes
  // stages - 1 - r chunks ahead of its backward (PipelineSchedule); the first stage holds the
  // most. 1 with one GPU or with the layer inputs kept (each chunk its own then).
  int32_t chunks_in_flight(int32_t stage = 0) const {
    if (options_.keep_layer_inputs) return 1;
    return std::min(stages() - stage, num_chunks_);
  }
  // Pages of every layer whose home is the GPU tier with offload on, at most the context's (0 with
  // offload off: then every page is on the GPU and nothing is copied).
  int64_t gpu_tier_pages() const {
    return options_.offload ? std::min(options_.gpu_tier_pages, total_pages()) : 0;
  }
  // Pages of one layer the whole context fills.
  int64_t total_pages() const;
  // Pages of one layer with a home in the host page stores: with offload every page a chunk
  // writes (all but the last chunk's) past the GPU tier's; 0 without offload. The runtime pins
  // the KV and dKV stores for all of them up front, whichever pages a sparse step touches.
  int64_t host_home_pages() const;
  // Pages of one layer each host page store (KV, dKV) is pinned for: host_home_pages(), and
  // never less than one with offload (a store holds a page); 0 without offload.
  int64_t host_store_pages() const {
    return options_.offload ? std::max<int64_t>(host_home_pages(), 1) : 0;
  }
  // Bytes of stage `stage`'s KV and dKV host page stores (host_store_pages of each of its layers).
  int64_t kv_host_store_bytes(int32_t stage) const {
    return host_store_pages() * stage_layers(stage) * kv_page_bytes();
  }
  int64_t dkv_host_store_bytes(int32_t stage) const {
    return host_store_pages() * stage_layers(stage) * dkv_page_bytes();
  }
  ChunkGeometry Chunk(int32_t index) const;
  // Reverse-pass dKV bookkeeping for chunk i, given T_{i+1} (pages selected by later chunks).
  DkvState Dkv(const ChunkGeometry& chunk, int64_t selected_by_later_chunks) const;

  // --- bytes of one page of one layer ---
  int64_t kv_page_bytes() const;       // K and V, bf16
  int64_t dkv_page_bytes() const;      // dK and dV, grad dtype
  int64_t summary_page_bytes() const;  // mean key, bf16

  // --- parameter-sized buffers: of the whole model (kAllStages), or of one stage's GPU ---
  static constexpr int32_t kAllStages = -1;
  int64_t trainable_params(int32_t stage = kAllStages) const;
  int64_t weight_bytes(int32_t stage = kAllStages) const;
  int64_t grad_bytes(int32_t stage = kAllStages) const;  // on the GPU (accumulated across chunks)
  int64_t optimizer_state_bytes(int32_t stage = kAllStages) const;  // fp32 moments
  // AdamW on the host: the moments and the host's bf16 copy of the parameters it updates.
  int64_t host_optimizer_bytes(int32_t stage = kAllStages) const;
  // The bytes a stage boundary passes per chunk: forward, the residual stream and the pending
  // residual add ([c][d] each, bf16: the next stage finishes the add bit for bit as one GPU
  // would); backward, the residual gradient [c][d].
  int64_t boundary_forward_bytes(const ChunkGeometry& chunk) const;
  int64_t boundary_backward_bytes(const ChunkGeometry& chunk) const;
  // A stage's send and receive buffers at its boundaries, two of each (double-buffered): 0 with
  // one GPU.
  int64_t boundary_buffer_bytes(int32_t stage) const;

  // --- per-chunk buffers (O(1) in n) ---
  // Of every layer (kAllStages) or of one stage's layers.
  int64_t layer_inputs_bytes(const ChunkGeometry& chunk, int32_t stage = kAllStages) const;
  int64_t activation_bytes() const;  // the CUDA backend's: one layer, c tokens, and gradients
  int64_t workspace_bytes() const;   // cuBLAS workspace, loss tiles
  // Its attention backward share: what the kernels' AttentionBackwardWorkspaceBytes asks for a
  // chunk (up to its three 256-byte alignments).
  int64_t attention_workspace_bytes() const;
  // GPU page-slot pool with offload on: KV + dKV slots for two layers' unions of host pages (one
  // attending, one prefetching) and two layers' own pages (one written, one copied out).
  int64_t page_slot_bytes() const;

  // K/V positions a paged-attention op loads: each query tile loads its own pages.
  int64_t paged_tokens_read(const ChunkGeometry& chunk) const;

  // The attention ops of one layer of a chunk, with their launch shapes: among the chunk's own
  // positions (causal), and against its earlier pages (every one, or the tiles' selections).
  OpCost own_attention_forward_cost(const ChunkGeometry& chunk) const;
  OpCost paged_attention_forward_cost(const ChunkGeometry& chunk) const;
  OpCost own_attention_backward_cost(const ChunkGeometry& chunk) const;
  OpCost paged_attention_backward_cost(const ChunkGeometry& chunk) const;

  // cudaMemcpyAsync calls a copy of `pages` of the chunk's union takes: the backends copy runs of
  // pages contiguous on both sides. Host pages are handed out chunk by chunk, so a dense union is
  // one run per earlier chunk; a sparse one breaks wherever a selected page's neighbour is not
  // selected (for selections spread evenly, a fraction 1 - U/E of its pages).
  int64_t union_copy_runs(const ChunkGeometry& chunk, int64_t pages) const;

  // The largest union of any chunk: the last chunk's, or the last full chunk's when the last
  // one is short (fewer query tiles select fewer pages).
  int64_t max_union_pages() const;
  // The same in the host tier: the union pages the slots stage.
  int64_t max_host_union_pages() const;
  // One page position in a tier: its KV and dKV in every layer (of one stage).
  int64_t tier_page_bytes(int32_t stage = kAllStages) const;
  // The GPU tier with offload on: KV and dKV of its pages of every layer (of one stage),
  // allocated up front.
  int64_t gpu_tier_bytes(int32_t stage = kAllStages) const;

  static constexpr int64_t kCublasWorkspaceBytes = 32ll << 20;
  // The loss's share of a stage's work, in layers of the model, per LM-head parameter over a
  // layer's matmul parameters: the loss runs the head four times (logits twice, dX, dW), a layer
  // five times (fill, recompute, the backward's recompute, dX, dW).
  static constexpr double kLossLayerWeight = 4.0 / 5.0;

 private:
  ModelSpec model_;
  RunOptions options_;
  int32_t num_chunks_ = 0;
  std::vector<int32_t> stage_first_layer_;  // [stages + 1]
  // Every chunk's geometry, computed once: a prediction reads each chunk's several times (memory,
  // then time at two clocks, three passes each) and the expected union takes three pow()s. Past
  // kCachedChunks (tiny chunks of a huge context) each call computes its chunk instead.
  static constexpr int32_t kCachedChunks = 1 << 16;
  std::vector<ChunkGeometry> chunks_;
  ChunkGeometry ComputeChunk(int32_t index) const;
  int32_t Layers(int32_t stage) const;  // layers of a stage, or of all
};

}  // namespace ctxplan
