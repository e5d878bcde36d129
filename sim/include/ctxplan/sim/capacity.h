// The max-context search: the largest context whose step fits in GPU memory and in host RAM,
// and which of the two binds.
#pragma once

#include <cstdint>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/plan_report.h"

namespace ctxplan::sim {

enum class CapacityLimit : uint8_t {
  kGpuMemory,    // one more token and the GPU runs out
  kHostMemory,   // one more token and pinned host memory runs out
  kBoth,         // both run out at the same token
  kPlannerCap,   // fits up to RunOptions::kMaxContextTokens: the planner's own range ends
  kNothingFits,  // not even one token: the fixed buffers alone exceed a capacity
};
std::string_view CapacityLimitName(CapacityLimit limit);

struct CapacityResult {
  int64_t max_context_tokens = 0;  // 0 when nothing fits
  CapacityLimit limit = CapacityLimit::kNothingFits;
  PlanReport at_max;     // the plan at max_context_tokens (or at 1 token when nothing fits)
  PlanReport just_over;  // the plan one token further, showing what breaks (if searched)
  int probes = 0;        // memory evaluations the search made
};

// Memory is monotone in the context (tests hold it so), so an exponential then binary search
// on the analytic memory model finds the largest fitting context exactly. With a GPU tier each
// context sizes its own (auto: what that context leaves free), so GPU and host hold the pages
// together.
CapacityResult FindMaxContext(const ModelSpec& model, const MachineSpec& machine,
                              const RunOptions& options, const GpuTierSetting& gpu_tier = {});

}  // namespace ctxplan::sim
