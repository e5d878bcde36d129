// Traces a step executed synchronously (the CPU backend): each op's wall-clock start and end,
// with its plan id, into a compact op trace and/or a Chrome trace. The CUDA backend's ops run
// asynchronously and are timed by the CUPTI tracer instead.
#pragma once

#include <chrono>
#include <cstdint>

#include "ctxplan/runtime/plan/step_backend.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan {

class WallClockTracer final : public StepObserver {
 public:
  // Either writer may be null. Times count from construction, in nanoseconds.
  WallClockTracer(OpTraceWriter* compact, ChromeTraceWriter* chrome);

  void BeforeOp(const Op& op) override;
  void AfterOp(const Op& op) override;

 private:
  int64_t Now() const;

  OpTraceWriter* compact_;
  ChromeTraceWriter* chrome_;
  std::chrono::steady_clock::time_point origin_;
  int64_t started_ns_ = 0;
  PlanMemoryTally memory_;
  std::string name_;
};

}  // namespace ctxplan
