#include "ctxplan/sim/clock_model.h"

#include <cmath>

namespace ctxplan::sim {

double SustainedClockFraction(const KernelProfile& k, double step_seconds,
                              const StepEnergy& energy) {
  if (!k.has_power() || step_seconds <= 0 || energy.clock_joules <= 0) return 1.0;
  const double budget = k.power_limit_w - k.idle_w;  // watts above idle the limit allows
  // Power above idle at clock fraction x; it rises with x (more energy a second, shorter step).
  constexpr double g = kPowerExponent;
  auto power = [&](double x) {
    const double seconds = step_seconds + energy.clock_bound_seconds * (1.0 / x - 1.0);
    return (std::pow(x, g) * energy.fixed_joules + std::pow(x, g - 1.0) * energy.clock_joules) /
           seconds;
  };
  if (power(1.0) <= budget) return 1.0;
  if (power(kMinClockFraction) >= budget) return kMinClockFraction;
  double lo = kMinClockFraction, hi = 1.0;
  for (int i = 0; i < 40; ++i) {
    const double mid = 0.5 * (lo + hi);
    (power(mid) > budget ? hi : lo) = mid;
  }
  return lo;
}

}  // namespace ctxplan::sim
