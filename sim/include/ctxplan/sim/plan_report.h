// A prediction turned into answers: memory three ways (our arena's allocations, what the arena
// reserves, what nvidia-smi shows), whether it fits, what binds, speed, and the cost of a run.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/prediction.h"

namespace ctxplan::sim {

enum class Bottleneck : uint8_t { kCompute, kPcie, kGpuMemory, kHostMemory };
std::string_view BottleneckName(Bottleneck bottleneck);

// What the GPU memory looks like at the peak, three ways.
struct GpuMemoryViews {
  int64_t allocated = 0;  // bytes our arena hands out at the peak
  int64_t reserved = 0;   // the arena, sized from the plan before the step
  int64_t device = 0;     // reserved + CUDA context and libraries: what nvidia-smi counts
};

struct RunCost {
  int64_t train_tokens = 0;
  double steps = 0.0;
  double gpu_hours = 0.0;
  std::optional<double> price_per_gpu_hour;
  std::optional<double> cost;
};

// ctxtrain's start-up before its first step (ctxtrain prints the same split): the CUDA context,
// the weights (random on the host, then uploaded), the arena's reservation and the pinned host
// memory (page stores, host optimizer state). From the kernel profile's host figures; zero where
// the profile has none (a GPU with spec values only).
struct StartupPrediction {
  double context_seconds = 0, weights_seconds = 0, arena_seconds = 0, pinning_seconds = 0;
  double total() const {
    return context_seconds + weights_seconds + arena_seconds + pinning_seconds;
  }
};

struct PlanReport {
  int64_t context_tokens = 0;
  int32_t gpus = 1;      // the step's GPUs (pipeline stages); memory below is per GPU
  int32_t machines = 1;  // the machines they fill; host memory below is per machine
  int32_t chunks = 0;
  StepPrediction prediction;
  GpuMemoryViews gpu_memory;
  int64_t gpu_capacity = 0;
  int64_t host_peak = 0;
  int64_t host_capacity = 0;  // usable: installed RAM less what the OS keeps
  bool fits_gpu = false;
  bool fits_host = false;
  Bottleneck bottleneck = Bottleneck::kCompute;
  double tokens_per_second = 0.0;
  double compute_utilisation = 0.0;  // compute stream busy / step time
  double h2d_utilisation = 0.0;
  double d2h_utilisation = 0.0;
  double achieved_tflops = 0.0;
  std::optional<RunCost> run_cost;
  StartupPrediction startup;

  bool fits() const { return fits_gpu && fits_host; }
};

// Reserved memory rounds the arena up to this granularity (CUDA's allocation granularity).
inline constexpr int64_t kArenaGranularity = int64_t{2} << 20;

PlanReport MakeReport(const PlanGeometry& geometry, const MachineSpec& machine,
                      const StepPrediction& prediction);
// Adds GPU-hours (and cost, with a price) of training on `train_tokens` tokens.
void AddRunCost(PlanReport& report, int64_t train_tokens, std::optional<double> price_per_gpu_hour);

}  // namespace ctxplan::sim
