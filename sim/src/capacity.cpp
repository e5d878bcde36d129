#include "ctxplan/sim/capacity.h"

#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/kernel_time_model.h"

namespace ctxplan::sim {

std::string_view CapacityLimitName(CapacityLimit limit) {
  switch (limit) {
    case CapacityLimit::kGpuMemory:
      return "gpu-memory";
    case CapacityLimit::kHostMemory:
      return "host-memory";
    case CapacityLimit::kBoth:
      return "gpu-and-host-memory";
    case CapacityLimit::kPlannerCap:
      return "planner-range";
    case CapacityLimit::kNothingFits:
      return "nothing-fits";
  }
  return "?";
}

namespace {

class Search {
 public:
  Search(const ModelSpec& model, const MachineSpec& machine, const RunOptions& options,
         const GpuTierSetting& gpu_tier)
      : model_(model), machine_(machine), options_(options), gpu_tier_(gpu_tier) {}

  PlanReport MemoryReport(int64_t context) {
    ++probes_;
    RunOptions o = options_;
    o.context_tokens = context;
    PlanGeometry geometry(model_, WithGpuTier(model_, machine_, o, gpu_tier_));
    const MemoryPrediction memory = AnalyticModel::PredictMemory(geometry, machine_.gpus);
    StepPrediction prediction;
    prediction.gpu = memory.gpu;
    prediction.host = memory.host;
    return MakeReport(geometry, machine_, prediction);
  }
  bool Fits(int64_t context) { return MemoryReport(context).fits(); }
  int probes() const { return probes_; }

 private:
  const ModelSpec& model_;
  const MachineSpec& machine_;
  const RunOptions& options_;
  const GpuTierSetting& gpu_tier_;
  int probes_ = 0;
};

}  // namespace

CapacityResult FindMaxContext(const ModelSpec& model, const MachineSpec& machine,
                              const RunOptions& options, const GpuTierSetting& gpu_tier) {
  options.Validate(model);
  Search search(model, machine, options, gpu_tier);
  CapacityResult result;
  constexpr int64_t kCap = RunOptions::kMaxContextTokens;

  int64_t good = 0;  // largest context known to fit (0: none yet)
  int64_t bad = 0;   // smallest context known not to fit (0: none yet)
  if (!search.Fits(1)) {
    bad = 1;
  } else {
    good = 1;
    // Grow by doubling from one chunk until something does not fit, then bisect.
    int64_t probe = options.chunk_tokens;
    while (probe < kCap && search.Fits(probe)) {
      good = probe;
      probe *= 2;
    }
    if (probe >= kCap) {
      if (search.Fits(kCap))
        good = kCap;
      else
        bad = kCap;
    } else {
      bad = probe;
    }
    while (bad != 0 && bad - good > 1) {
      const int64_t mid = good + (bad - good) / 2;
      (search.Fits(mid) ? good : bad) = mid;
    }
  }

  const KernelTimeModel time_model(machine);
  const AnalyticModel analytic(time_model);
  auto full_report = [&](int64_t context) {
    RunOptions o = options;
    o.context_tokens = context;
    PlanGeometry geometry(model, WithGpuTier(model, machine, o, gpu_tier));
    return MakeReport(geometry, machine, analytic.Predict(geometry));
  };

  result.max_context_tokens = good;
  result.at_max = full_report(good > 0 ? good : 1);
  if (good == 0) {
    result.limit = CapacityLimit::kNothingFits;
  } else if (bad == 0) {
    result.limit = CapacityLimit::kPlannerCap;
  } else {
    result.just_over = search.MemoryReport(bad);
    const bool gpu = !result.just_over.fits_gpu, host = !result.just_over.fits_host;
    result.limit = gpu && host ? CapacityLimit::kBoth
                   : gpu       ? CapacityLimit::kGpuMemory
                               : CapacityLimit::kHostMemory;
  }
  result.probes = search.probes();
  return result;
}

}  // namespace ctxplan::sim
