// `ctxplan recommend`: for a model, machine and context, the fastest configuration that fits,
// searched over the choices that decide speed and memory (chunk, page, offload and the GPU tier,
// keeping layer inputs, the optimizer's placement), with the trade-offs beside it: the one that
// reaches the longest context and the one that needs the least GPU memory. What the user trains
// stays theirs: the page budget, sinks, query tile, selection model, gradient dtype and LoRA rank
// come from the base options. (With page-sparse attention, chunk and page size also shape which
// earlier positions are attended: the output says so.)
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/plan_report.h"

namespace ctxplan::sim {

struct RecommendSpace {
  std::vector<int64_t> chunks = {1024, 2048, 4096, 8192, 16384};
  std::vector<int64_t> pages = {64, 128, 256};
  std::vector<bool> offload = {false, true};
  std::vector<bool> keep_layer_inputs = {false, true};
  // AdamW on the GPU or the host where the base trains with AdamW; else the base's optimizer.
  bool search_optimizer_placement = true;
  // The GPU tier settings tried with offload on; empty: the one Recommend is given.
  std::vector<GpuTierSetting> gpu_tiers;
};

// What recommend searches when the user names no GPU tier: none, and what the plan leaves free.
std::vector<GpuTierSetting> SearchedGpuTiers(std::string_view margin);

struct RecommendCandidate {
  RunOptions options;  // gpu_tier_pages resolved
  PlanReport report;   // at the context, analytic path
  int64_t max_context_tokens = 0;
  GpuTierSetting gpu_tier;  // what sized options' tier (its --gpu-tier text: GpuTierFlag)
};

struct Recommendation {
  int evaluated = 0;                               // configurations planned
  int fitting = 0;                                 // of them, those that fit at the context
  std::optional<RecommendCandidate> fastest;       // most tokens/s at the context
  std::optional<RecommendCandidate> longest;       // largest max context
  std::optional<RecommendCandidate> least_memory;  // least device memory at the context
};

// Every configuration of `space` around `base` (its context the one to plan for), planned on
// the analytic path; `gpu_tier` sizes the tier of the offloading ones.
Recommendation Recommend(const ModelSpec& model, const MachineSpec& machine, const RunOptions& base,
                         const GpuTierSetting& gpu_tier, const RecommendSpace& space = {});

// The ctxtrain command line that runs `options` (machine_flags: "--machine h200-125g" or
// "--gpu h100-sxm --host-ram 256GiB"; gpu_tier: what sized its tier, printed as --gpu-tier and,
// for auto with another margin than the default, --gpu-tier-margin).
std::string CtxtrainCommand(const ModelSpec& model, const std::string& machine_flags,
                            const RunOptions& options, const GpuTierSetting& gpu_tier);

}  // namespace ctxplan::sim
