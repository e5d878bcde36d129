#include "ctxplan/sim/plan_report.h"

#include "ctxplan/sim/kernel_time_model.h"

#include <algorithm>
#include <cmath>

namespace ctxplan::sim {

std::string_view BottleneckName(Bottleneck bottleneck) {
  switch (bottleneck) {
    case Bottleneck::kCompute:
      return "compute";
    case Bottleneck::kPcie:
      return "pcie";
    case Bottleneck::kGpuMemory:
      return "gpu-memory";
    case Bottleneck::kHostMemory:
      return "host-memory";
  }
  return "?";
}

namespace {

// ctxtrain's CUDA context and cuBLAS handles (0.2-0.3 s in every recorded run's start-up line):
// not a microbenchmark of calibrate, a named estimate.
constexpr double kCudaContextSeconds = 0.25;

StartupPrediction PredictStartup(const PlanGeometry& geometry, const MachineSpec& machine,
                                 const PlanReport& r) {
  const KernelProfile k = EffectiveKernelProfile(machine.gpu);
  StartupPrediction s;
  s.context_seconds = kCudaContextSeconds;
  // Every rank makes and uploads its own stage's weights, side by side: the largest stage's.
  double params = static_cast<double>(geometry.model().total_params());
  if (geometry.stages() > 1) {
    int64_t largest = 0;
    for (int32_t r = 0; r < geometry.stages(); ++r)
      largest = std::max(largest, geometry.weight_bytes(r) / kBf16Bytes);
    params = static_cast<double>(largest);
  }
  if (k.weights_init_gparams > 0)
    s.weights_seconds =
        params / (k.weights_init_gparams * 1e9) +
        (k.weights_upload_gparams > 0 ? params / (k.weights_upload_gparams * 1e9)
                                      : 2.0 * params / (machine.gpu.host_h2d_gbs.value * 1e9));
  if (k.device_alloc_gbs > 0)
    s.arena_seconds = static_cast<double>(r.gpu_memory.reserved) / (k.device_alloc_gbs * 1e9);
  if (k.pin_gbs > 0) s.pinning_seconds = static_cast<double>(r.host_peak) / (k.pin_gbs * 1e9);
  return s;
}

}  // namespace

PlanReport MakeReport(const PlanGeometry& geometry, const MachineSpec& machine,
                      const StepPrediction& prediction) {
  PlanReport r;
  r.context_tokens = geometry.options().context_tokens;
  r.chunks = geometry.num_chunks();
  r.gpus = geometry.stages();
  r.machines = (r.gpus + std::max(1, machine.gpus) - 1) / std::max(1, machine.gpus);
  r.prediction = prediction;
  r.gpu_memory.allocated = prediction.gpu.peak_bytes;
  r.gpu_memory.reserved =
      (prediction.gpu.peak_bytes + kArenaGranularity - 1) / kArenaGranularity * kArenaGranularity;
  r.gpu_memory.device = r.gpu_memory.reserved +
                        static_cast<int64_t>(machine.gpu.cuda_context_gib.value * 1073741824.0);
  r.gpu_capacity = machine.gpu.memory_bytes();
  r.host_peak = prediction.host.peak_bytes;
  r.host_capacity = machine.host_usable_bytes();
  r.fits_gpu = r.gpu_memory.device <= r.gpu_capacity;
  r.fits_host = r.host_peak <= r.host_capacity;

  const double seconds = prediction.step_seconds();
  if (seconds > 0) {
    r.tokens_per_second = static_cast<double>(r.context_tokens) / seconds;
    auto share = [&](Stream s) {
      return TicksToSeconds(prediction.busy_ticks[static_cast<size_t>(s)]) / seconds;
    };
    r.compute_utilisation = share(Stream::kCompute);
    r.h2d_utilisation = share(Stream::kH2D);
    r.d2h_utilisation = share(Stream::kD2H);
    r.achieved_tflops = prediction.flops / seconds / 1e12;
  }
  r.startup = PredictStartup(geometry, machine, r);
  // What binds: memory first (the plan cannot run at all), else whichever resource the compute
  // stream waits for. Compute stalls beyond 10% of the step are time spent waiting on PCIe.
  if (!r.fits_gpu)
    r.bottleneck = Bottleneck::kGpuMemory;
  else if (!r.fits_host)
    r.bottleneck = Bottleneck::kHostMemory;
  else if (r.compute_utilisation < 0.9)
    r.bottleneck = Bottleneck::kPcie;
  else
    r.bottleneck = Bottleneck::kCompute;
  return r;
}

void AddRunCost(PlanReport& report, int64_t train_tokens,
                std::optional<double> price_per_gpu_hour) {
  RunCost c;
  c.train_tokens = train_tokens;
  c.steps = static_cast<double>(train_tokens) / static_cast<double>(report.context_tokens);
  c.gpu_hours = c.steps * report.prediction.step_seconds() * report.gpus / 3600.0;
  c.price_per_gpu_hour = price_per_gpu_hour;
  if (price_per_gpu_hour) c.cost = c.gpu_hours * *price_per_gpu_hour;
  report.run_cost = c;
}

}  // namespace ctxplan::sim
