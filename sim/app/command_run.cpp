#include "command_run.h"

#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/event_simulator.h"

namespace ctxplan::cli {

sim::GpuTierSetting GpuTierOf(const RunFlags& f) {
  return sim::ParseGpuTierSetting(f.gpu_tier, f.gpu_tier_margin, "--gpu-tier");
}

RunOptions ResolveWithTier(const RunFlags& f, const ModelSpec& model, const MachineSpec& machine,
                           bool with_context) {
  return sim::WithGpuTier(model, machine, ResolveOptions(f, model, with_context), GpuTierOf(f));
}

sim::StepPrediction Predict(const std::string& path, const StepPlan& plan,
                            const sim::KernelTimeModel& time_model) {
  if (path == "event") return sim::EventSimulator(time_model).Run(plan);
  return sim::AnalyticModel(time_model).Predict(plan.geometry());
}

}  // namespace ctxplan::cli
