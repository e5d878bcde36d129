// Writes a simulated step as a compact op trace, the same format ctxtrain records, so that a
// prediction can be replayed, diffed or loaded like a measurement.
#pragma once

#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan::sim {

class TraceRecorder final : public SimObserver {
 public:
  explicit TraceRecorder(OpTraceWriter& writer) : writer_(writer) {}

  void OnOpComplete(const Op& op, Tick start, Tick end) override;
  void OnMemory(MemSpace space, int where, Tick when, const MemoryTracker& memory) override;

 private:
  OpTraceWriter& writer_;
};

}  // namespace ctxplan::sim
