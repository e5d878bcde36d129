// Plan reports as text for people and as JSON for scripts.
#pragma once

#include <string>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"
#include "ctxplan/sim/capacity.h"
#include "ctxplan/sim/plan_report.h"
#include "json_out.h"

namespace ctxplan::cli {

struct PlanContext {
  const ModelSpec& model;
  const MachineSpec& machine;
  const RunOptions& options;  // context_tokens as planned
  std::string path;           // "event" or "analytic"
};

std::string PlanText(const PlanContext& context, const sim::PlanReport& report);
void PlanJson(JsonOut& json, const PlanContext& context, const sim::PlanReport& report);

std::string CapacityText(const PlanContext& context, const sim::CapacityResult& result,
                         double slope_mb_per_10k, int64_t slope_from, int64_t slope_to);

}  // namespace ctxplan::cli
