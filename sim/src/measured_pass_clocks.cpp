#include "ctxplan/sim/measured_pass_clocks.h"

#include <algorithm>

#include "ctxplan/runtime/plan/op.h"

namespace ctxplan::sim {

MeasuredPassClocks MeasurePassClocks(const std::vector<OpRecord>& ops,
                                     const std::vector<ClockSampleAt>& samples) {
  std::vector<const OpRecord*> compute;
  for (const OpRecord& r : ops)
    if (r.stream == static_cast<uint8_t>(Stream::kCompute) && r.end_ns > r.start_ns &&
        r.phase < static_cast<uint8_t>(Phase::kCount_))
      compute.push_back(&r);
  std::sort(compute.begin(), compute.end(),
            [](const OpRecord* a, const OpRecord* b) { return a->start_ns < b->start_ns; });
  // The longest end among the ops starting at or before each one: an op nested in another (a
  // plan op around its kernels' ops) still finds the outer one.
  std::vector<int64_t> reach(compute.size());
  for (size_t i = 0; i < compute.size(); ++i)
    reach[i] = std::max(compute[i]->end_ns, i > 0 ? reach[i - 1] : compute[i]->end_ns);

  MeasuredPassClocks out{};
  for (const ClockSampleAt& s : samples) {
    if (s.sm_clock_mhz <= 0) continue;
    // The last op starting at or before the sample; walk back while an earlier one may cover it.
    auto it = std::upper_bound(compute.begin(), compute.end(), s.time_ns,
                               [](int64_t t, const OpRecord* r) { return t < r->start_ns; });
    const OpRecord* owner = nullptr;
    for (auto i = static_cast<size_t>(it - compute.begin()); i > 0; --i) {
      if (reach[i - 1] <= s.time_ns) break;  // nothing at or before i - 1 reaches the sample
      if (compute[i - 1]->end_ns > s.time_ns) {
        owner = compute[i - 1];
        break;
      }
    }
    if (owner == nullptr) continue;
    MeasuredPassClock& pass =
        out[static_cast<size_t>(PowerPassOf(static_cast<Phase>(owner->phase)))];
    ++pass.samples;
    pass.sm_clock_mhz += s.sm_clock_mhz;
    pass.watts += s.watts;
  }
  for (MeasuredPassClock& pass : out) {
    if (pass.samples == 0) continue;
    pass.sm_clock_mhz /= pass.samples;
    pass.watts /= pass.samples;
  }
  return out;
}

}  // namespace ctxplan::sim
