// The SM clock each of a traced step's passes ran at, as the planner predicts it per pass
// (clock_model.h, PowerPass): NVML readings taken through the step, each given to the pass of the
// compute-stream op running when it was taken. A reading between ops (the compute stream idle)
// belongs to no pass. The step's mean clock alone cannot tell which pass the power model misses.
#pragma once

#include <array>
#include <vector>

#include "ctxplan/sim/clock_model.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan::sim {

struct ClockSampleAt {
  int64_t time_ns = 0;      // on the trace's clock (OpRecord's start_ns / end_ns)
  double sm_clock_mhz = 0;  // NVML's reading; 0: not known (skipped)
  double watts = 0;         // board power (NVML's average over its last second on Hopper)
};

struct MeasuredPassClock {
  int samples = 0;
  double sm_clock_mhz = 0;  // mean of the pass's readings; 0 with none
  double watts = 0;
};
using MeasuredPassClocks = std::array<MeasuredPassClock, kPowerPassCount>;
inline bool HasReadings(const MeasuredPassClocks& clocks) {
  for (const MeasuredPassClock& c : clocks)
    if (c.samples > 0) return true;
  return false;
}

// `ops`: a traced step's op records (any order; those off the compute stream are ignored);
// `samples`: readings in any order.
MeasuredPassClocks MeasurePassClocks(const std::vector<OpRecord>& ops,
                                     const std::vector<ClockSampleAt>& samples);

}  // namespace ctxplan::sim
