// The analytic path: the same prediction as the event path without ops or events, for sweeps
// and the max-context search.
//
// Memory is closed-form: every allocation of the plan happens at a chunk boundary, so the peak
// is the largest of a few per-chunk states. Time uses the plan's structure: all layers of a
// chunk are alike, so the ops of a layer collapse into a few segments between the points where
// streams wait for each other, and a small max-plus recurrence over (chunk, layer) gives the
// completion time of each stream. Once two consecutive layers shift every active stream by the
// same amount, the rest of the chunk's layers are extrapolated exactly (the recurrence is
// shift-invariant). The event path is the reference; tests hold the two together.
#pragma once

#include <vector>

#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/prediction.h"

namespace ctxplan::sim {

struct LayerCache;  // analytic_model.cpp

struct MemoryPrediction {
  MemoryPeak gpu;                           // with several GPUs, the one with the highest peak
  MemoryPeak host;                          // with several machines, the one holding the most
  std::vector<int64_t> gpu_peak_by_stage;   // several GPUs: each stage's peak
  std::vector<int64_t> host_peak_by_stage;  // and its own host memory's
};

class AnalyticModel {
 public:
  explicit AnalyticModel(const KernelTimeModel& time_model) : time_model_(time_model) {}

  // Memory and time; the time at the SM clock the step holds under the power limit.
  StepPrediction Predict(const PlanGeometry& geometry) const;
  // Memory and time at a given SM clock (a fraction of the maximum) instead of the one the
  // power model predicts: to tell a run's clock error from its kernel-time error (matrix_test).
  StepPrediction PredictAtClock(const PlanGeometry& geometry, double clock_fraction) const;
  // The clock each pass holds, as a fraction of the maximum (1: the pass fits under the limit).
  PassClocks SustainedClocks(const PlanGeometry& geometry) const;
  // The kernel-time model `geometry`'s ops are timed with at `clocks`: its GPUs sharing the
  // host's links (KernelTimeModel::ForStages), each pass at its clock. The event path uses it too.
  KernelTimeModel ForRun(const PlanGeometry& geometry, const PassClocks& clocks) const;
  // Memory only: O(chunks x stages) integer arithmetic, for the max-context search. Pipeline
  // stages fill machines of `gpus_per_machine` GPUs in order, sharing their host memory.
  static MemoryPrediction PredictMemory(const PlanGeometry& geometry, int gpus_per_machine = 1);

 private:
  // The step's time at the maximum clock into `result` (memory kept), building `layers`; returns
  // each pass's clock fraction whose power fits the limit.
  PassClocks TimeAtMaxClock(const PlanGeometry& geometry, StepPrediction& result,
                            LayerCache& layers) const;
  // The step's time with `time_model` (memory in `result` kept). A pass without `reuse` builds
  // `layers` at the maximum clock; one with `reuse` slows them to time_model's clocks.
  static void PredictTime(const PlanGeometry& geometry, const KernelTimeModel& time_model,
                          StepPrediction& result, LayerCache& layers, bool reuse);

  const KernelTimeModel& time_model_;
};

}  // namespace ctxplan::sim
