// Group power: what the board draws, and the SM clock it holds, while one kind of kernel runs on
// (a GEMM, attention forward and backward at d_h 128 and 64, an HBM-bound kernel), and when the
// GPU idles. A training step runs such kernels back to back for seconds; at the board's power
// limit the clock sinks until the draw fits, and every compute-bound kernel slows with it
// (sim/src/clock_model.cpp). The rows are the kernels' usual rows with the op prefixed "power_",
// their clock and watts from the sustained window; "power_idle" has watts and clock alone. The
// "power_duty_gemm_fwd" rows run a GEMM with idle gaps: its draw at the higher clocks the limit
// then allows gives the exponent of power against clock. "power_copy_duplex": PCIe copies both
// ways with the SMs idle, what the link and the copies' HBM traffic draw (not fitted yet: the
// planner counts no energy for copies; sim/MODEL-LOG.md says why one is wanted).
#include <chrono>
#include <thread>

#include "measure_common.h"
#include "measure_groups.h"

namespace ctxplan::calibrate {

namespace {
constexpr double kSustainSeconds = 3.0;  // heat 1.5 s, then 1.5 s timed: NVML averages power
                                         // over its last second on Hopper
constexpr double kIdleSettleSeconds = 2.0;
}  // namespace

void MeasurePower(Session& session) {
  if (session.clocks == nullptr || !session.clocks->available()) {
    Progress("power", 0).Note("skipped: NVML (libnvidia-ml.so.1) is not available");
    return;
  }
  Progress progress("power", 5);
  progress.Step("idle");
  CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(session.stream));
  std::this_thread::sleep_for(std::chrono::duration<double>(kIdleSettleSeconds));
  Sample idle;
  idle.op = "power_idle";
  idle.clock = session.clocks->Now();
  session.samples.push_back(idle);

  const size_t first = session.samples.size();
  session.sustain_seconds = kSustainSeconds;
  progress.Step("gemm and memory-bound, sustained");
  MeasurePowerKernels(session);
  progress.Step("attention, sustained");
  MeasurePowerAttention(session);
  progress.Step("gemm with idle gaps, sustained");
  MeasurePowerDuty(session);
  progress.Step("copies both ways, sustained");
  MeasurePowerCopy(session);
  session.sustain_seconds = 0;
  for (size_t i = first; i < session.samples.size(); ++i)
    session.samples[i].op = "power_" + session.samples[i].op;
}

}  // namespace ctxplan::calibrate
