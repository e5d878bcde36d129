// The event path: executes the step plan op by op on modelled resources — in-order streams
// (compute, H2D and D2H copy engines, host), GPU and pinned host memory — driven by a gem5-style
// event queue. It pulls ops from the plan's generator as it goes, keeping a bounded window, so
// a step of millions of ops runs in bounded memory.
#pragma once

#include <cstdint>

#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/prediction.h"

namespace ctxplan::sim {

// Sees the simulation as it happens (the timeline writer, tests). Callbacks arrive in
// simulated-time order.
class SimObserver {
 public:
  virtual ~SimObserver() = default;
  virtual void OnOpComplete(const Op& /*op*/, Tick /*start*/, Tick /*end*/) {}
  // `where`: the GPU's rank (pipeline stage) for GPU memory, the machine for host memory.
  virtual void OnMemory(MemSpace /*space*/, int /*where*/, Tick /*when*/,
                        const MemoryTracker& /*memory*/) {}
};

class EventSimulator {
 public:
  // Ops pulled ahead of the oldest unfinished op: enough that copy engines run as far ahead as
  // their slot buffers let them.
  static constexpr size_t kLookaheadOps = 8192;

  explicit EventSimulator(const KernelTimeModel& time_model) : time_model_(time_model) {}

  StepPrediction Run(const StepPlan& plan, SimObserver* observer = nullptr) const;

 private:
  const KernelTimeModel& time_model_;
};

}  // namespace ctxplan::sim
