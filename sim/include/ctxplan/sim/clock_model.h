// The SM clock a training step holds under the board's power limit.
//
// An H100 or H200 running a training step back to back draws its full power limit (700 W): the
// SM clock sinks from its maximum (1980 MHz) to ~1740 MHz until the draw fits, and every
// compute-bound kernel (GEMMs, the fused loss, attention) slows with it, ~10% against the same
// kernels timed alone. Memory-bound kernels and copies keep their speed (HBM and PCIe clocks do
// not move). The model, with the profile's measured powers (KernelProfile, `ctxplan calibrate`'s
// power group):
//
//   power(x) = idle_w + (x^g * fixed_joules + x^(g - 1) * clock_joules) / busy_seconds(x)
//   busy_seconds(x) = busy_seconds(1) + clock_bound_seconds * (1 / x - 1),  g = kPowerExponent
//
// busy_seconds is the compute stream's busy time: the limit holds while kernels run (the board
// reacts within milliseconds), so a step that waits on PCIe copies is not cooler for it.
//
// where x is the clock as a fraction of the maximum, clock_joules what the compute-bound kernels
// draw above idle at the maximum clock over a step (their seconds x their kind's watts: at
// clock x they draw x^g of it for 1/x as long), and fixed_joules the same for the memory-bound
// kernels, whose time does not move with the clock but whose draw does. The step's clock is the
// largest x whose power fits the limit; the planner then times the step again at that clock.
#pragma once

#include "ctxplan/models/gpu_spec.h"

namespace ctxplan::sim {

// Dynamic power goes as f V^2, and over the DVFS range the voltage follows the clock: f^3.
// Checked on the calibration runs of traces/recorded/matrix.csv alone (median step-time error
// with exponents 1, 2, 3, 4: 9.0%, 5.0%, 3.7%, 4.4%), never on a validation run.
inline constexpr double kPowerExponent = 3.0;
// No step is predicted slower than this fraction of the maximum clock.
inline constexpr double kMinClockFraction = 0.5;

// What a step draws, summed op by op at the maximum clock.
struct StepEnergy {
  double clock_bound_seconds = 0;  // compute-bound kernel time, which scales as 1 / clock
  double clock_joules = 0;         // their dynamic energy above idle
  double fixed_joules = 0;         // memory-bound kernels' dynamic energy above idle

  StepEnergy& operator+=(const StepEnergy& o) {
    clock_bound_seconds += o.clock_bound_seconds;
    clock_joules += o.clock_joules;
    fixed_joules += o.fixed_joules;
    return *this;
  }
  StepEnergy Times(double n) const {
    return {clock_bound_seconds * n, clock_joules * n, fixed_joules * n};
  }
};

// The clock fraction (kMinClockFraction .. 1) a step whose kernels keep the GPU busy for
// `busy_seconds` at the maximum clock holds; 1 when the profile has no power model or the step
// fits under the limit.
double SustainedClockFraction(const KernelProfile& profile, double busy_seconds,
                              const StepEnergy& energy);

}  // namespace ctxplan::sim
