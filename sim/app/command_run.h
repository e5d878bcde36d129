// What the commands that plan a run share: its options with the GPU tier sized for the machine,
// and its step predicted by the event simulator or the analytic model.
#pragma once

#include <string>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/prediction.h"
#include "run_flags.h"

namespace ctxplan::cli {

// The run options of the flags with the GPU tier sized for the machine (sim/gpu_tier.h).
sim::GpuTierSetting GpuTierOf(const RunFlags& f);
RunOptions ResolveWithTier(const RunFlags& f, const ModelSpec& model, const MachineSpec& machine,
                           bool with_context);

// `path`: "event" (op by op), else the analytic model.
sim::StepPrediction Predict(const std::string& path, const StepPlan& plan,
                            const sim::KernelTimeModel& time_model);

}  // namespace ctxplan::cli
