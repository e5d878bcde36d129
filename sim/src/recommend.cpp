#include "ctxplan/sim/recommend.h"

#include <algorithm>

#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/capacity.h"
#include "ctxplan/sim/kernel_time_model.h"

namespace ctxplan::sim {

Recommendation Recommend(const ModelSpec& model, const MachineSpec& machine, const RunOptions& base,
                         const GpuTierSetting& gpu_tier, const RecommendSpace& space) {
  base.Validate(model);
  std::vector<OptimizerKind> optimizers = {base.optimizer};
  if (space.search_optimizer_placement && base.optimizer != OptimizerKind::kNone)
    optimizers = {OptimizerKind::kAdamWGpu, OptimizerKind::kAdamWHost};
  const KernelTimeModel time_model(machine);
  const AnalyticModel analytic(time_model);
  std::vector<GpuTierSetting> tiers = space.gpu_tiers;
  if (tiers.empty()) tiers.push_back(gpu_tier);
  Recommendation r;
  for (const int64_t chunk : space.chunks)
    for (const int64_t page : space.pages)
      for (const bool offload : space.offload)
        for (const bool keep : space.keep_layer_inputs)
          for (const OptimizerKind optimizer : optimizers)
            for (const GpuTierSetting& tier : tiers) {
              // Without offload every page is on the GPU: one plan, whatever the tier; and a
              // tier of every page is offload off.
              if (!offload && &tier != &tiers.front()) continue;
              if (offload && tier.kind == GpuTierSetting::Kind::kAll) continue;
              // Several GPUs recompute the layer inputs (the pipeline keeps none yet).
              if (keep && base.pipeline_stages > 1) continue;
              RunOptions o = base;
              o.chunk_tokens = chunk;
              o.page_tokens = page;
              o.offload = offload;
              o.keep_layer_inputs = keep;
              o.optimizer = optimizer;
              o.query_tile = std::min(base.query_tile, chunk);
              if (chunk % page != 0) continue;
              // A chunk beyond the context is the same plan as one of the context's length.
              if (chunk > base.context_tokens && chunk != space.chunks.front()) continue;
              o = WithGpuTier(model, machine, o, tier);
              const PlanGeometry geometry(model, o);
              ++r.evaluated;
              const PlanReport report = MakeReport(geometry, machine, analytic.Predict(geometry));
              if (!report.fits()) continue;
              ++r.fitting;
              RecommendCandidate c{o, report, 0, tier};
              c.max_context_tokens = FindMaxContext(model, machine, o, tier).max_context_tokens;
              if (!r.fastest || report.tokens_per_second > r.fastest->report.tokens_per_second)
                r.fastest = c;
              if (!r.longest || c.max_context_tokens > r.longest->max_context_tokens ||
                  (c.max_context_tokens == r.longest->max_context_tokens &&
                   report.tokens_per_second > r.longest->report.tokens_per_second))
                r.longest = c;
              if (!r.least_memory ||
                  report.gpu_memory.device < r.least_memory->report.gpu_memory.device ||
                  (report.gpu_memory.device == r.least_memory->report.gpu_memory.device &&
                   report.tokens_per_second > r.least_memory->report.tokens_per_second))
                r.least_memory = c;
            }
  return r;
}

std::vector<GpuTierSetting> SearchedGpuTiers(std::string_view margin) {
  return {ParseGpuTierSetting("off", margin, "--gpu-tier"),
          ParseGpuTierSetting("auto", margin, "--gpu-tier")};
}

std::string CtxtrainCommand(const ModelSpec& model, const std::string& machine_flags,
                            const RunOptions& o, const GpuTierSetting& gpu_tier) {
  std::string s = "ctxtrain --backend cuda --model " + model.name + " " + machine_flags +
                  " --context " + std::to_string(o.context_tokens) + " --chunk " +
                  std::to_string(o.chunk_tokens) + " --page " + std::to_string(o.page_tokens) +
                  " --budget " + (o.dense() ? std::string("all") : std::to_string(o.page_budget)) +
                  " --sinks " + std::to_string(o.sink_pages) + " --query-tile " +
                  std::to_string(o.query_tile) + " --offload " + (o.offload ? "on" : "off") +
                  " --keep-layer-inputs " + (o.keep_layer_inputs ? "on" : "off") +
                  " --grad-dtype " + std::string(GradDtypeName(o.grad_dtype)) + " --optimizer " +
                  std::string(OptimizerName(o.optimizer));
  if (o.lora_rank > 0) s += " --lora-rank " + std::to_string(o.lora_rank);
  if (o.offload && o.gpu_tier_pages > 0) {
    s += " --gpu-tier " + GpuTierFlag(gpu_tier);
    if (gpu_tier.kind == GpuTierSetting::Kind::kAuto &&
        gpu_tier.margin_bytes != GpuTierSetting{}.margin_bytes)
      s += " --gpu-tier-margin " + std::to_string(gpu_tier.margin_bytes) + "B";
  }
  if (o.pipeline_stages > 1) s += " --gpus " + std::to_string(o.pipeline_stages);
  return s;
}

}  // namespace ctxplan::sim
