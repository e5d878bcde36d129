// What a simulation of one step predicts: time, stream utilisation and memory peaks. The event
// path and the analytic path both produce it, so they can be compared field by field.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/sim/clock_model.h"
#include "ctxplan/sim/tick.h"

namespace ctxplan::sim {

using CategoryBytes = std::array<int64_t, kMemCategoryCount>;

// Bytes allocated over time in one memory space. `at_peak` is the breakdown at the first moment
// the total reached its peak.
class MemoryTracker {
 public:
  void Apply(MemCategory category, int64_t delta) {
    const size_t c = static_cast<size_t>(category);
    const int64_t before = Counted(c);
    live_[c] += delta;
    CTXPLAN_CHECK(live_[c] >= 0, "memory category freed below zero");
    Count(c, before);
  }
  // A floor under a category: memory held whatever its ops allocate (the runtime's host page
  // stores, pinned up front for every page with a home there). A category counts the larger.
  void Reserve(MemCategory category, int64_t bytes) {
    const size_t c = static_cast<size_t>(category);
    const int64_t before = Counted(c);
    reserved_[c] += bytes;
    Count(c, before);
  }
  int64_t total() const { return total_; }
  int64_t peak() const { return peak_; }
  const CategoryBytes& by_category() const { return by_category_; }
  const CategoryBytes& at_peak() const { return at_peak_; }

 private:
  int64_t Counted(size_t c) const { return std::max(live_[c], reserved_[c]); }
  void Count(size_t c, int64_t before) {
    by_category_[c] = Counted(c);
    total_ += by_category_[c] - before;
    if (total_ > peak_) {
      peak_ = total_;
      at_peak_ = by_category_;
    }
  }

  int64_t total_ = 0;
  int64_t peak_ = 0;
  CategoryBytes live_{}, reserved_{};
  CategoryBytes by_category_{};  // counted: live or reserved, whichever is larger
  CategoryBytes at_peak_{};
};

struct MemoryPeak {
  int64_t peak_bytes = 0;
  CategoryBytes at_peak{};
  int64_t end_bytes = 0;  // still allocated when the step ends (fixed buffers)
};

struct StepPrediction {
  Tick step_ticks = 0;
  // Time each stream spent running ops; with several GPUs, the busiest rank's.
  std::array<Tick, kStreamCount> busy_ticks{};
  MemoryPeak gpu;   // our arena: allocated bytes; with several GPUs the one with the highest peak
  MemoryPeak host;  // pinned host memory; with several machines the one with the most
  std::vector<int64_t> gpu_peak_by_rank;  // each GPU's arena peak (pipeline stage order)
  // Each GPU's own share of its machine's pinned host memory at that share's peak (its page
  // stores and staging): what one rank's trace measures (`host` is the machine's sum).
  std::vector<int64_t> host_peak_by_rank;
  double flops = 0.0;
  double h2d_bytes = 0.0;
  double d2h_bytes = 0.0;
  uint64_t op_count = 0;
  // The SM clock the step holds under the power limit, as a fraction of the maximum (the passes'
  // clocks weighted by their time), and what its ops draw at those clocks (clock_model.h).
  double sm_clock_fraction = 1.0;
  StepEnergy energy;
  // Of the busiest GPU, by pass (clock_model.h, PowerPass): what its ops draw and how long its
  // compute stream takes (waits included), which set each pass's clock; and those clocks.
  std::array<StepEnergy, kPowerPassCount> energy_by_pass{};
  std::array<double, kPowerPassCount> seconds_by_pass{};
  PassClocks pass_clocks = {1.0, 1.0, 1.0};
  // The step's tail after the GPU's last kernel (AdamW on the host and its copies): seconds of an
  // idle GPU that the board's power limit, acting over about a second, does not average into the
  // kernels' draw (clock_model.h).
  Tick gpu_idle_tail_ticks = 0;

  double step_seconds() const { return TicksToSeconds(step_ticks); }
};

}  // namespace ctxplan::sim
