// The SM clock and board power over a window of GPU work. A training step on an H100 or H200 is
// held at the board's power limit: the SM clock sinks from its maximum (1980 MHz) to ~1740 MHz,
// while a microbenchmark of a few milliseconds runs at whatever the last load left. So
// ctxplan-measure records the clock of every timed window (the fitter scales compute-bound
// samples to the maximum clock) and what each kind of kernel draws when it runs on, and ctxtrain
// reports the clock and power its steps held (the planner predicts them: sim/clock_model.h).
//
// NVML is opened at run time (dlopen of the driver's libnvidia-ml.so.1): nothing links against
// it, and a machine without it measures as before, with clock and power left 0. Never throws.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace ctxplan::gpu {

struct ClockReading {
  double sm_clock_mhz = 0;  // mean SM clock over the window; 0: not known
  double watts = 0;         // mean board power over the window; 0: not known
};

// A reading and when it was taken.
struct TimedClockReading {
  std::chrono::steady_clock::time_point at;
  ClockReading reading;
};

class GpuClockSampler {
 public:
  // Samples the CUDA device `cuda_device` every kPeriod on a thread of its own, if NVML opens.
  explicit GpuClockSampler(int cuda_device);
  ~GpuClockSampler();
  GpuClockSampler(const GpuClockSampler&) = delete;
  GpuClockSampler& operator=(const GpuClockSampler&) = delete;

  bool available() const { return device_ != nullptr; }
  double max_sm_clock_mhz() const { return max_sm_clock_mhz_; }
  double power_limit_watts() const { return power_limit_watts_; }

  // A window: readings from Begin() to End() are averaged (at least the one taken at End()).
  void Begin();
  ClockReading End();
  // The power right now (NVML's own average over its last second on Hopper).
  ClockReading Now() const;
  // Every reading from StartRecording() to StopRecording(), each with its time: a traced step's
  // clock op by op (sim/measured_pass_clocks.h). Independent of the Begin / End window.
  void StartRecording();
  std::vector<TimedClockReading> StopRecording();

 private:
  void Poll();
  ClockReading Read() const;

  void* library_ = nullptr;
  void* device_ = nullptr;  // nvmlDevice_t
  double max_sm_clock_mhz_ = 0;
  double power_limit_watts_ = 0;
  std::mutex mutex_;
  std::vector<ClockReading> window_;
  bool in_window_ = false;
  std::vector<TimedClockReading> recorded_;
  bool recording_ = false;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace ctxplan::gpu
