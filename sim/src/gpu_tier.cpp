#include "ctxplan/sim/gpu_tier.h"

#include <algorithm>

#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/plan_report.h"

namespace ctxplan::sim {

GpuTierSetting ParseGpuTierSetting(std::string_view text, std::string_view margin,
                                   std::string_view flag) {
  GpuTierSetting s;
  s.margin_bytes = ParseBytes(margin, std::string(flag) + "-margin");
  if (text == "off") return s;
  if (text == "auto") {
    s.kind = GpuTierSetting::Kind::kAuto;
    return s;
  }
  if (text == "all") {
    s.kind = GpuTierSetting::Kind::kAll;
    return s;
  }
  s.kind = GpuTierSetting::Kind::kSize;
  try {
    s.size_bytes = ParseBytes(text, flag);
  } catch (const InputError&) {
    throw InputError(std::string(flag) + ": '" + std::string(text) +
                     "' is not a setting; accepted: off, auto, all or a size such as 40GiB");
  }
  return s;
}

std::string DescribeGpuTierSetting(const GpuTierSetting& s) {
  switch (s.kind) {
    case GpuTierSetting::Kind::kOff:
      return "off";
    case GpuTierSetting::Kind::kAuto:
      return "auto (margin " + FormatGiB(s.margin_bytes) + ")";
    case GpuTierSetting::Kind::kSize:
      return FormatGiB(s.size_bytes);
    case GpuTierSetting::Kind::kAll:
      return "all (offload off)";
  }
  return "?";
}

std::string GpuTierFlag(const GpuTierSetting& s) {
  switch (s.kind) {
    case GpuTierSetting::Kind::kOff:
      return "off";
    case GpuTierSetting::Kind::kAuto:
      return "auto";
    case GpuTierSetting::Kind::kSize:
      return std::to_string(s.size_bytes) + "B";
    case GpuTierSetting::Kind::kAll:
      return "all";
  }
  return "off";
}

RunOptions WithGpuTier(const ModelSpec& model, const MachineSpec& machine, RunOptions options,
                       const GpuTierSetting& setting) {
  options.gpu_tier_pages = 0;
  if (setting.kind == GpuTierSetting::Kind::kAll) {
    // Every page on the GPU: the plain device page store, with no host homes and no copies.
    options.offload = false;
    return options;
  }
  if (setting.off() || !options.offload) return options;
  const PlanGeometry plain(model, options);
  // One page position on the GPU with the most layers (each GPU holds its stage's).
  int64_t page_bytes = 0;
  for (int32_t r = 0; r < plain.stages(); ++r)
    page_bytes = std::max(page_bytes, plain.tier_page_bytes(r));
  if (setting.kind == GpuTierSetting::Kind::kSize) {
    options.gpu_tier_pages =
        std::clamp<int64_t>(setting.size_bytes / page_bytes, 0, plain.total_pages());
    return options;
  }
  // Auto: the tier takes what the plan leaves free. A larger tier leaves fewer pages in the host
  // tier, so fewer staging slots: what the first sizing freed is taken again, until less than a
  // page is left. Growing by the free bytes never overshoots, since the slots only shrink.
  for (int round = 0; round < 8; ++round) {
    StepPrediction memory_only;
    const PlanGeometry geometry(model, options);
    const MemoryPrediction memory = AnalyticModel::PredictMemory(geometry, machine.gpus);
    memory_only.gpu = memory.gpu;
    memory_only.host = memory.host;
    const PlanReport report = MakeReport(geometry, machine, memory_only);
    const int64_t free = report.gpu_capacity - report.gpu_memory.device - setting.margin_bytes;
    const int64_t grown =
        std::clamp<int64_t>(options.gpu_tier_pages + free / page_bytes, 0, plain.total_pages());
    if (grown == options.gpu_tier_pages) break;  // also: nothing free even without a tier
    options.gpu_tier_pages = grown;
  }
  return options;
}

}  // namespace ctxplan::sim
