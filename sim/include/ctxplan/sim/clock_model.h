// The SM clock a training step holds under the board's power limit.
//
// An H100 or H200 running a training step back to back draws its full power limit (700 W): the
// SM clock sinks from its maximum (1980 MHz) to ~1740 MHz until the draw fits, and every
// compute-bound kernel (GEMMs, the fused loss, attention) slows with it, ~10% against the same
// kernels timed alone. Memory-bound kernels and copies keep their speed (HBM and PCIe clocks do
// not move). The model, with the profile's measured powers (KernelProfile, `ctxplan calibrate`'s
// power group):
//
//   power(x) = idle_w + (x^g * fixed_joules + x^(g - 1) * clock_joules) / step_seconds(x)
//   step_seconds(x) = step_seconds(1) + clock_bound_seconds * (1 / x - 1),  g = kPowerExponent
//
// where x is the clock as a fraction of the maximum, clock_joules what the compute-bound kernels
// draw above idle at the maximum clock over a step (each op's FLOPs at its kind's full rate x
// the kind's watts: a kernel on a slow path waits more and draws less; at clock x an op draws
// x^g of it for 1/x as long), and fixed_joules the same for the memory-bound kernels, whose time
// does not move with the clock but whose draw does. The power is averaged over the whole step:
// a step that waits on PCIe copies between kernels is cooler (measured: offloading 7B steps hold
// 1790-1910 MHz where dense ones hold 1690-1730). Not so a step's tail of host work (AdamW on the
// host, seconds with the GPU idle): the limit acts over about a second, so the kernels before it
// run as hot as in a step without it (Llama-3.1-8B 32K, AdamW on the host, H200 calibration
// row: 1817 MHz measured at 437 W mean board power), and the tail is left out of the average.
// The step's clock is the largest x whose power fits the limit; the planner then times the step
// again at that clock.
#pragma once

#include "ctxplan/models/gpu_spec.h"

namespace ctxplan::sim {

// Dynamic power goes as f V^2, and over the DVFS range the voltage follows the clock: f^3.
// Checked against the SM clock NVML measured in the calibration runs of
// traces/recorded/matrix.csv alone (11 H200 runs; median / max clock error with exponents 1, 2,
// 3, 4: 3.1/15.4%, 2.9/10.9%, 2.4/4.6%, 3.7/8.4%), never on a validation run.
// Variants measured and not adopted (the duty-cycle exponent, a clock-bound share of a GEMM's
// time, watts anchored at a duty-cycled run, sparse attention drawing its watts for its whole
// time): sim/MODEL-LOG.md.
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

// The clock fraction (kMinClockFraction .. 1) a step of `step_seconds` at the maximum clock
// holds; 1 when the profile has no power model or the step fits under the limit.
double SustainedClockFraction(const KernelProfile& profile, double step_seconds,
                              const StepEnergy& energy);

}  // namespace ctxplan::sim
