// What a user chooses for one training run: context, chunking, paging, sparsity, offload,
// gradient precision, optimizer and LoRA. The step plan is a pure function of these, the model
// and nothing else.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ctxplan/models/model_spec.h"

namespace ctxplan {

enum class GradDtype : uint8_t { kBf16, kFp32 };
enum class OptimizerKind : uint8_t { kAdamWGpu, kAdamWHost, kNone };

// How the query tiles of one chunk and layer overlap in the pages they select. Only the union
// crosses PCIe, and it cannot be known before the run, so the planner bounds it:
//   shared   — every tile picks the same pages (best case): union = k + sinks;
//   disjoint — tiles pick disjoint pages (worst case): union = sinks + tiles * k;
//   overlap  — each further tile shares a measured fraction f of its k pages with the union.
// Always capped by the pages that exist. The default is the worst case: a plan must not promise
// a context that the real selection could break.
// What the union is expected to be (for time, not memory) depends on the model and the data:
// under `disjoint` it is PlanGeometry's draw rule, whose scale `disjoint:S` sets from a
// measurement of the model's selection (`ctxplan selection TRACE` fits S from a traced run).
enum class SelectionModelKind : uint8_t { kShared, kDisjoint, kOverlap };

struct SelectionModel {
  SelectionModelKind kind = SelectionModelKind::kDisjoint;
  double overlap_fraction = 0.0;  // used by kOverlap, in [0, 1]
  // kDisjoint: the draw rule's scale (plan_geometry.h), measured for the model and data; 0 takes
  // the rule's default (kUnionDrawScale).
  double draw_scale = 0.0;
};

struct RunOptions {
  static constexpr int64_t kAllPages = 0;  // page_budget meaning "every earlier page": dense
  static constexpr int64_t kMaxContextTokens = int64_t{1} << 31;

  int64_t context_tokens = int64_t{1} << 20;  // n
  int64_t chunk_tokens = 4096;                // c, a multiple of page_tokens
  int64_t page_tokens = 128;                  // p
  int64_t page_budget = 64;                   // k pages per query tile, or kAllPages
  int64_t sink_pages = 1;                     // s pages always attended
  int64_t query_tile = 128;                   // b queries share one page selection
  bool offload = true;                        // KV/dKV pages live in pinned host memory
  // With offload: the GPU tier of the page store, in pages of every layer. Pages [0, G) of each
  // layer keep their KV and dKV on the GPU and never cross PCIe; the rest live in pinned host
  // memory. The earliest pages: every later chunk is a candidate to read them, so they are read
  // the most (dense: page j by N - j p / c chunks). 0: every page on the host.
  int64_t gpu_tier_pages = 0;
  GradDtype grad_dtype = GradDtype::kBf16;  // parameter gradients and dKV pages
  OptimizerKind optimizer = OptimizerKind::kAdamWGpu;
  int64_t lora_rank = 0;  // 0 = full fine-tune
  SelectionModel selection;
  // Keep every chunk's layer inputs from the fill pass instead of recomputing them in pass 2:
  // one forward less per step, at O(n) GPU memory (worth it at short contexts).
  bool keep_layer_inputs = false;
  // GPUs the layers are pipelined over (DESIGN.md, "Ranks"): stage r holds a contiguous run of
  // layers (PlanGeometry::stage_first_layer), their weights, gradients, optimizer state and
  // pages; chunks are the micro-batches. 1: one GPU.
  int32_t pipeline_stages = 1;

  bool dense() const { return page_budget == kAllPages; }
  int64_t grad_bytes() const { return grad_dtype == GradDtype::kFp32 ? 4 : 2; }

  // Throws InputError with one line naming the option and what is accepted.
  void Validate(const ModelSpec& model) const;
};

std::string_view GradDtypeName(GradDtype dtype);
std::string_view OptimizerName(OptimizerKind optimizer);
std::string SelectionModelName(const SelectionModel& model);
// "bf16" | "fp32"; "adamw-gpu" | "adamw-host" | "none"; "shared" | "disjoint" | "overlap:0.5".
// Each throws InputError naming `what` and the accepted values.
GradDtype ParseGradDtype(std::string_view text, std::string_view what);
OptimizerKind ParseOptimizer(std::string_view text, std::string_view what);
SelectionModel ParseSelectionModel(std::string_view text, std::string_view what);
// "all" -> kAllPages, else a positive integer.
int64_t ParsePageBudget(std::string_view text, std::string_view what);

}  // namespace ctxplan
