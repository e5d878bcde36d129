// Writes a simulated step as a Chrome trace (Perfetto opens it): one track per stream, every op
// a span carrying its plan id, and GPU and host memory as counters.
#pragma once

#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/traces/chrome_trace_writer.h"

namespace ctxplan::sim {

class TimelineWriter final : public SimObserver {
 public:
  static constexpr int64_t kPid = 1;

  explicit TimelineWriter(ChromeTraceWriter& writer);

  void OnOpComplete(const Op& op, Tick start, Tick end) override;
  void OnMemory(MemSpace space, int where, Tick when, const MemoryTracker& memory) override;

 private:
  // Each rank (GPU) its own process in the viewer, its streams as threads; named on first use.
  int64_t Pid(int rank);

  ChromeTraceWriter& writer_;
  std::string name_;         // reused per op
  std::vector<bool> named_;  // [rank]
};

}  // namespace ctxplan::sim
