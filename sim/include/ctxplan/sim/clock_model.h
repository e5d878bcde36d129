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
// Measured and not adopted (2026-11-25, H200): a GEMM run with idle gaps (power group,
// "power_duty_gemm_fwd") draws as clock^1.38 between 1437 and 1980 MHz; with that exponent the
// model holds the calibration runs' clock at 1980 MHz where NVML read 1716-1920 (clock median /
// max error 2.4/6.4% -> 3.1/15.4%, step time median 2.3% -> 5.8%). The step-averaged power
// this model assumes is not how the board's limit acts on a mix of kernels; `ctxplan calibrate`
// prints the duty-cycle exponent for the record.
// Also measured and not adopted (2026-11-25): the same GEMM runs 1.21x slower at 1437 MHz than
// at 1980 (H200; 1.17x at 1355 on the H100), not 1.38x: as if 56% (H200) / 38% (H100) of a
// compute-bound kernel's time went as 1 / clock. With that share in the kernel model and the
// samples' clock normalisation, calibration runs at their measured clock: 3.6% -> 2.7% median,
// but predicted end to end 2.0% -> 2.6% (exponent 3), and with the exponent re-chosen on their
// clock (2.5: clock median 1.7%) 2.8% / 14.5%; the H100 from the scaled H200 profile went from
// max 5.4% to 8.4%. Rejected on the calibration runs' step time.
// Also measured and not adopted (2026-11-25): the GEMM's watts anchored at its duty-cycled run
// (500 us gaps: 1735-1755 MHz, near where steps run) instead of its sustained run (1355-1437
// MHz): both GPUs then draw ~806 W above idle there, and the H100's own profile predicts its runs
// within 2.2% / 7.8% (5.2% / 9.2%), but the calibration runs' step time goes 2.0% -> 2.9% median
// (exponents 2-5 re-chosen on them: 3.3-3.7%); energy by kernel time rather than by FLOPs at
// the full rate: 4.2-5.9%. Rejected on the calibration runs.
// Also tried and not adopted (2026-11-25, after the GPU-tier rows, whose clocks the model puts
// 4-5% above NVML's: 1671 / 1588 MHz at 1M): sparse attention drawing its kind's watts for its
// whole time (not only its FLOPs at the full rate): calibration step time 2.1% -> 2.3% median;
// at 0.8 of the time 3.1%; the attention kinds' watts x1.4: 3.3%. The GPU-tier steps' clock gap
// is still open.
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
