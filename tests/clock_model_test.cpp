// The SM clock under the board's power limit (sim/include/ctxplan/sim/clock_model.h) and the
// time model at a clock: compute-bound work slows as 1 / clock, memory-bound work and copies do
// not, and a step is timed at the largest clock whose power fits the limit.
#include <gtest/gtest.h>

#include <cmath>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/clock_model.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/measured_pass_clocks.h"

namespace ctxplan::sim {
namespace {

KernelProfile PowerProfile() {
  KernelProfile k;
  k.gemm_tflops = 800;
  k.max_sm_clock_mhz = 1980;
  k.power_limit_w = 700;
  k.idle_w = 100;
  k.gemm_w = 900;
  k.memory_w = 300;
  return k;
}

// The power above idle at clock fraction x, as clock_model.h writes it.
double PowerAbove(double x, double step, const StepEnergy& e) {
  const double seconds = step + e.clock_bound_seconds * (1 / x - 1);
  return (std::pow(x, kPowerExponent) * e.fixed_joules +
          std::pow(x, kPowerExponent - 1) * e.clock_joules) /
         seconds;
}

TEST(ClockModel, AStepUnderTheLimitKeepsTheMaximumClock) {
  const StepEnergy light{1.0, 1.0 * 400, 0};  // 400 W above idle: 500 W < 700 W
  EXPECT_DOUBLE_EQ(SustainedClockFraction(PowerProfile(), 1.0, light), 1.0);
}

TEST(ClockModel, AHeavyStepSinksToTheClockWhosePowerFitsTheLimit) {
  const StepEnergy heavy{0.8, 0.8 * 900, 0.2 * 300};  // 780 W above idle at the maximum clock
  const double x = SustainedClockFraction(PowerProfile(), 1.0, heavy);
  EXPECT_LT(x, 1.0);
  EXPECT_GT(x, kMinClockFraction);
  EXPECT_NEAR(PowerAbove(x, 1.0, heavy), 600.0, 0.5);
  // More of the same work a second draws more: a lower clock.
  const StepEnergy heavier{0.95, 0.95 * 900, 0.05 * 300};
  EXPECT_LT(SustainedClockFraction(PowerProfile(), 1.0, heavier), x);
}

TEST(ClockModel, NoPowerModelNoThrottle) {
  KernelProfile k = PowerProfile();
  k.power_limit_w = 0;
  EXPECT_DOUBLE_EQ(SustainedClockFraction(k, 1.0, {1.0, 5000, 0}), 1.0);
}

TEST(ClockModel, ComputeBoundOpsSlowWithTheClockMemoryBoundOpsDoNot) {
  const MachineSpec machine = LoadMachine("h200-125g");
  const KernelTimeModel at_max = KernelTimeModel(machine).AtClock(1.0);
  const KernelTimeModel slower = at_max.AtClock(0.8);
  const OpCost gemm = LinearForwardCost(4096, 28672, 4096);
  const double launch = at_max.profile().launch_us * 1e-6;
  EXPECT_NEAR(
      (slower.Seconds(gemm, Phase::kFill) - launch) / (at_max.Seconds(gemm, Phase::kFill) - launch),
      1.25, 1e-9);
  const OpCost norm = RmsNormForwardCost(4096, 4096);
  EXPECT_DOUBLE_EQ(slower.Seconds(norm, Phase::kFill), at_max.Seconds(norm, Phase::kFill));
  const OpCost copy = CopyCost(int64_t{1} << 30, true);
  EXPECT_DOUBLE_EQ(slower.Seconds(copy, Phase::kFill), at_max.Seconds(copy, Phase::kFill));
  // A GEMM's energy goes with its FLOPs at the full rate, not with its (longer) time.
  EXPECT_NEAR(slower.Time(gemm, Phase::kFill).energy.clock_joules,
              at_max.Time(gemm, Phase::kFill).energy.clock_joules, 1e-12);
}

// Attention draws its head dim's watts: the power group timed head dim 64 apart (H200: ~0.65 of
// 128's at the same clock), and a profile without that row gives both head dims one value.
TEST(ClockModel, AttentionDrawsTheWattsOfItsHeadDim) {
  const MachineSpec machine = LoadMachine("h200-125g");
  const KernelProfile& k = machine.gpu.kernels;
  ASSERT_GT(k.attention_fwd_w_d64, 0);
  ASSERT_GT(k.attention_bwd_w_d64, 0);
  EXPECT_LT(k.attention_fwd_w_d64, k.attention_fwd_w);
  const KernelTimeModel model = KernelTimeModel(machine).AtClock(1.0);
  const double pairs = 4096.0 * 4097.0 / 2;
  for (const bool backward : {false, true}) {
    for (const int64_t d : {64, 128}) {
      const int64_t heads = 8192 / d;  // the same hidden width at both head dims
      const OpCost cost = backward ? AttentionBackwardCost(pairs, 4096, 4096, heads, 0, d, 2)
                                   : AttentionForwardCost(pairs, 4096, 4096, heads, 0, d);
      const double full_seconds = cost.flops / (k.attention_tflops(backward, d == 64) * 1e12);
      const double joules = model.Time(cost, Phase::kFill).energy.clock_joules;
      EXPECT_NEAR(joules / full_seconds, k.attention_w(backward, d == 64), 1e-6)
          << backward << " " << d;
    }
  }
  KernelProfile shared = k;
  shared.attention_fwd_w_d64 = 0;
  EXPECT_DOUBLE_EQ(shared.attention_w(false, true), k.attention_fwd_w);
}

// A GPU known only by its datasheet takes a calibrated sibling's powers scaled to its own limit
// and work rate; without a datasheet limit it has no power model (its clock stays at maximum).
TEST(ClockModel, AnEstimateScalesItsSiblingsPowers) {
  const GpuSpec h200 = LoadGpu("h200");
  ASSERT_TRUE(h200.kernels.has_power());
  GpuSpec target = LoadGpu("l40s");
  ASSERT_GT(target.tdp_w, 0);
  const KernelProfile k = ScaleKernelProfile(h200, target);
  EXPECT_DOUBLE_EQ(k.power_limit_w, target.tdp_w);
  EXPECT_NEAR(k.idle_w, h200.kernels.idle_w * target.tdp_w / h200.tdp_w, 1e-9);
  EXPECT_NEAR(k.gemm_w / h200.kernels.gemm_w,
              target.bf16_dense_tflops.value / h200.bf16_dense_tflops.value, 1e-9);
  target.tdp_w = 0;
  EXPECT_FALSE(ScaleKernelProfile(h200, target).has_power());
}

TEST(ClockModel, ThePlannerTimesAHeavyStepAtItsSustainedClock) {
  const MachineSpec machine = LoadMachine("h200-125g");
  ASSERT_TRUE(machine.gpu.kernels.has_power());
  RunOptions o;
  o.context_tokens = 32768;
  o.chunk_tokens = 4096;
  const ModelSpec model = LoadModel("qwen2.5-7b");
  o.Validate(model);
  const PlanGeometry g(model, o);
  const KernelTimeModel time_model(machine);
  const StepPrediction p = AnalyticModel(time_model).Predict(g);
  EXPECT_LT(p.sm_clock_fraction, 0.95);  // a dense 7B step holds the board at its limit
  EXPECT_EQ(p.pass_clocks, AnalyticModel(time_model).SustainedClocks(g));
  // Each pass's power at its clock is the limit. Its energy is counted at the maximum clock; at
  // clock x each op draws x^g of its power for 1/x as long (clock-bound) or as long
  // (memory-bound), over the pass's time at x.
  const KernelProfile& k = time_model.profile();
  double seconds = 0, weighted = 0;
  for (const PowerPass pass : {PowerPass::kFill, PowerPass::kRecompute, PowerPass::kBackward}) {
    const auto i = static_cast<size_t>(pass);
    const double x = p.pass_clocks[i];
    const StepEnergy& e = p.energy_by_pass[i];
    ASSERT_GT(p.seconds_by_pass[i], 0);
    EXPECT_LT(x, 1.0);
    const double at_clock = k.idle_w + (e.fixed_joules * std::pow(x, kPowerExponent) +
                                        e.clock_joules * std::pow(x, kPowerExponent - 1)) /
                                           p.seconds_by_pass[i];
    EXPECT_NEAR(at_clock, k.power_limit_w, 0.05 * k.power_limit_w) << static_cast<int>(pass);
    seconds += p.seconds_by_pass[i];
    weighted += x * p.seconds_by_pass[i];
  }
  // The step's clock is theirs weighted by time, and the passes fill the step.
  EXPECT_NEAR(p.sm_clock_fraction, weighted / seconds, 1e-12);
  EXPECT_NEAR(seconds, p.step_seconds(), 0.01 * p.step_seconds());
}

// A traced step's NVML readings go to the pass of the compute op running when each was taken:
// the loss and the optimizer with the backward, an op nested in another to the inner one, a
// reading while the compute stream is idle or only a copy runs to none.
TEST(ClockModel, MeasuredPassClocksTakeTheComputeOpRunning) {
  auto op = [](Phase phase, Stream stream, int64_t start, int64_t end) {
    OpRecord r;
    r.phase = static_cast<uint8_t>(phase);
    r.stream = static_cast<uint8_t>(stream);
    r.start_ns = start;
    r.end_ns = end;
    return r;
  };
  const std::vector<OpRecord> ops = {
      op(Phase::kBackward, Stream::kCompute, 400, 500),  // out of order
      op(Phase::kFill, Stream::kCompute, 0, 100),
      op(Phase::kFill, Stream::kCompute, 100, 200),
      op(Phase::kRecompute, Stream::kCompute, 250, 350),
      op(Phase::kLoss, Stream::kCompute, 360, 380),
      op(Phase::kRecompute, Stream::kCompute, 300, 320),  // inside the one before
      op(Phase::kFill, Stream::kH2D, 200, 260),           // a copy: no pass of its own
      op(Phase::kOptimizer, Stream::kCompute, 600, 700),
  };
  const std::vector<ClockSampleAt> samples = {
      {50, 1900, 600},  {150, 1800, 640}, {225, 1000, 100},  // idle: the copy alone
      {260, 1700, 690}, {310, 1600, 690}, {340, 1650, 700},
      {370, 1500, 700}, {450, 1400, 700}, {550, 1200, 200},  // idle
      {650, 1300, 650}, {120, 0, 0}};                        // no reading
  const MeasuredPassClocks clocks = MeasurePassClocks(ops, samples);
  const auto& fill = clocks[static_cast<size_t>(PowerPass::kFill)];
  const auto& recompute = clocks[static_cast<size_t>(PowerPass::kRecompute)];
  const auto& backward = clocks[static_cast<size_t>(PowerPass::kBackward)];
  EXPECT_EQ(fill.samples, 2);
  EXPECT_DOUBLE_EQ(fill.sm_clock_mhz, 1850);
  EXPECT_DOUBLE_EQ(fill.watts, 620);
  EXPECT_EQ(recompute.samples, 3);
  EXPECT_DOUBLE_EQ(recompute.sm_clock_mhz, 1650);
  EXPECT_EQ(backward.samples, 3);  // the loss, the backward and the optimizer
  EXPECT_DOUBLE_EQ(backward.sm_clock_mhz, 1400);
  EXPECT_EQ(MeasurePassClocks({}, samples)[0].samples, 0);
}

}  // namespace
}  // namespace ctxplan::sim
