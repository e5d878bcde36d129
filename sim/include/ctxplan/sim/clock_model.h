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
// where x is the clock as a fraction of the maximum (judged by the compute-bound kernels' speed,
// below), clock_joules what the compute-bound kernels draw above idle at the maximum clock over a
// step (each op's FLOPs at its kind's full rate x the kind's watts: a kernel on a slow path waits
// more and draws less, page-sparse attention excepted; at clock x an op draws x^g of it for 1/x
// as long), and fixed_joules the same for the memory-bound kernels, whose time
// does not move with the clock but whose draw does. The power is averaged over each pass of the
// step (PowerPass: the fill, the recompute, the backward with the loss and the optimizer), the
// time its compute stream takes, waits included: a pass that waits on PCIe copies between
// kernels is cooler (measured: offloading 7B steps hold 1790-1910 MHz where dense ones hold
// 1690-1730), and the limiter tells the passes apart within a chunk (the same GEMM 6% slower in
// the backward than in the recompute just before it: PowerPass below). Not so a step's tail of
// host work (AdamW on the host, seconds with the GPU idle): the limit acts over about a second,
// so the kernels before it run as hot as in a step without it (Llama-3.1-8B 32K, AdamW on the
// host, H200 calibration row: 1817 MHz measured at 437 W mean board power), and the tail is left
// out. Each pass's clock is the largest x whose power fits the limit; the planner then times the
// step again at those clocks, and reports their mean over the step's time.
//
// The clock is the kernels' speed, not NVML's reading. Under the limit an H100 reports 6-11%
// less clock than an H200 doing the same work a second at the same draw (ctxplan-measure's
// sustained loops, 2026-11-27: GEMM 1.43 ms at 1340 MHz against 1.45 ms at 1429, attention
// forward 4.38 ms at 1512 against 4.39 at 1669), and 1 / its reading misses those loops' times
// by 10.7% (median; the H200's 4.4%). So `ctxplan calibrate` takes a sustained kernel's clock
// from its speed against the profile's at the maximum clock (FitPower), and a predicted clock
// is comparable with NVML's only where the two agree (the H200).
#pragma once

#include <array>
#include <cstdint>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/runtime/plan/op.h"

namespace ctxplan::sim {

// Dynamic power goes as f V^2, and over the DVFS range the voltage follows the clock: f^3; against
// the kernels' speed, which falls less than the clock (a GEMM 1.2x slower at 0.68 of the clock),
// it rises faster. Chosen on the step time of the calibration runs of traces/recorded/matrix.csv
// alone (27 H200 runs, each judged by the profile of its kernels, watts refitted at each
// exponent; median / mean |error| at 3, 3.5, 4, 4.5, 5, 6: 3.8/4.8, 3.3/4.0, 3.0/3.6, 2.6/3.3,
// 3.1/3.2, 3.2/3.1%), never on a validation run. With NVML's reading as the clock the exponent
// was 3 (calibration runs 2.7/3.1%). Variants measured and not adopted: sim/MODEL-LOG.md.
inline constexpr double kPowerExponent = 4.5;
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
  StepEnergy operator-(const StepEnergy& o) const {
    return {clock_bound_seconds - o.clock_bound_seconds, clock_joules - o.clock_joules,
            fixed_joules - o.fixed_joules};
  }
  StepEnergy Times(double n) const {
    return {clock_bound_seconds * n, clock_joules * n, fixed_joules * n};
  }
};

// The clock fraction (kMinClockFraction .. 1) a step of `step_seconds` at the maximum clock
// holds; 1 when the profile has no power model or the step fits under the limit.
double SustainedClockFraction(const KernelProfile& profile, double step_seconds,
                              const StepEnergy& energy);

// The step's passes, each held at its own clock: the limiter acts within a fraction of a second,
// so a copy-bound fill or recompute (idle between kernels, cool) runs faster than the backward
// chunk beside it (Qwen2.5-7B 1M over 2 H200s, rank 0: the same gate/up GEMM 1.392 ms in the fill
// and the recompute, 1.480 ms in the backward's). The loss, the optimizer and the setup go with
// the backward.
enum class PowerPass : uint8_t { kFill, kRecompute, kBackward, kCount_ };
inline constexpr int kPowerPassCount = static_cast<int>(PowerPass::kCount_);
inline PowerPass PowerPassOf(Phase phase) {
  return phase == Phase::kFill        ? PowerPass::kFill
         : phase == Phase::kRecompute ? PowerPass::kRecompute
                                      : PowerPass::kBackward;
}
inline const char* PowerPassName(PowerPass pass) {
  return pass == PowerPass::kFill        ? "fill"
         : pass == PowerPass::kRecompute ? "recompute"
                                         : "backward";
}
using PassClocks = std::array<double, kPowerPassCount>;  // fractions of the maximum SM clock

}  // namespace ctxplan::sim
