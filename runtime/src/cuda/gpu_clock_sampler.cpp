#include "ctxplan/runtime/cuda/gpu_clock_sampler.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <chrono>
#include <utility>

namespace ctxplan::gpu {

namespace {

// The few NVML entry points used, with NVML's C ABI (nvml.h: nvmlReturn_t is an enum, 0 is
// NVML_SUCCESS; nvmlDevice_t an opaque pointer; NVML_CLOCK_SM is 1).
using NvmlDevice = void*;
using InitFn = int (*)();
using ShutdownFn = int (*)();
using HandleByPciFn = int (*)(const char*, NvmlDevice*);
using ClockFn = int (*)(NvmlDevice, int, unsigned*);
using PowerFn = int (*)(NvmlDevice, unsigned*);
constexpr int kNvmlSuccess = 0;
constexpr int kNvmlClockSm = 1;
// Often enough that a 10 ms sample window gets a few readings; NVML's calls take ~0.1 ms.
constexpr auto kPeriod = std::chrono::milliseconds(2);

struct Nvml {
  InitFn init = nullptr;
  ShutdownFn shutdown = nullptr;
  HandleByPciFn handle_by_pci = nullptr;
  ClockFn clock = nullptr;
  ClockFn max_clock = nullptr;
  PowerFn power = nullptr;
  PowerFn power_limit = nullptr;
};
Nvml nvml;  // one sampler a process

template <typename Fn>
bool Resolve(void* library, const char* name, Fn& fn) {
  fn = reinterpret_cast<Fn>(dlsym(library, name));
  return fn != nullptr;
}

}  // namespace

GpuClockSampler::GpuClockSampler(int cuda_device) {
  library_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) return;
  const bool resolved = Resolve(library_, "nvmlInit_v2", nvml.init) &&
                        Resolve(library_, "nvmlShutdown", nvml.shutdown) &&
                        Resolve(library_, "nvmlDeviceGetHandleByPciBusId_v2", nvml.handle_by_pci) &&
                        Resolve(library_, "nvmlDeviceGetClockInfo", nvml.clock) &&
                        Resolve(library_, "nvmlDeviceGetMaxClockInfo", nvml.max_clock) &&
                        Resolve(library_, "nvmlDeviceGetPowerUsage", nvml.power) &&
                        Resolve(library_, "nvmlDeviceGetEnforcedPowerLimit", nvml.power_limit);
  if (!resolved || nvml.init() != kNvmlSuccess) return;
  // The CUDA device's NVML handle by PCI bus id: CUDA and NVML may number devices differently.
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), cuda_device) != cudaSuccess) return;
  NvmlDevice device = nullptr;
  if (nvml.handle_by_pci(bus_id, &device) != kNvmlSuccess) return;
  unsigned mhz = 0, milliwatts = 0;
  if (nvml.max_clock(device, kNvmlClockSm, &mhz) == kNvmlSuccess) max_sm_clock_mhz_ = mhz;
  if (nvml.power_limit(device, &milliwatts) == kNvmlSuccess) power_limit_watts_ = milliwatts / 1e3;
  device_ = device;
  thread_ = std::thread([this] { Poll(); });
}

GpuClockSampler::~GpuClockSampler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (device_ != nullptr) (void)nvml.shutdown();
  if (library_ != nullptr) dlclose(library_);
}

ClockReading GpuClockSampler::Read() const {
  ClockReading r;
  if (device_ == nullptr) return r;
  unsigned mhz = 0, milliwatts = 0;
  if (nvml.clock(device_, kNvmlClockSm, &mhz) == kNvmlSuccess) r.sm_clock_mhz = mhz;
  if (nvml.power(device_, &milliwatts) == kNvmlSuccess) r.watts = milliwatts / 1e3;
  return r;
}

void GpuClockSampler::Poll() {
  while (!stop_) {
    const ClockReading r = Read();
    const auto at = std::chrono::steady_clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (in_window_) window_.push_back(r);
      if (recording_) recorded_.push_back({at, r});
    }
    std::this_thread::sleep_for(kPeriod);
  }
}

void GpuClockSampler::Begin() {
  std::lock_guard<std::mutex> lock(mutex_);
  window_.clear();
  in_window_ = true;
}

ClockReading GpuClockSampler::End() {
  const ClockReading last = Read();
  std::lock_guard<std::mutex> lock(mutex_);
  in_window_ = false;
  window_.push_back(last);
  ClockReading mean;
  for (const ClockReading& r : window_) {
    mean.sm_clock_mhz += r.sm_clock_mhz / static_cast<double>(window_.size());
    mean.watts += r.watts / static_cast<double>(window_.size());
  }
  return mean;
}

ClockReading GpuClockSampler::Now() const {
  return Read();
}

void GpuClockSampler::StartRecording() {
  std::lock_guard<std::mutex> lock(mutex_);
  recorded_.clear();
  recording_ = true;
}

std::vector<TimedClockReading> GpuClockSampler::StopRecording() {
  std::lock_guard<std::mutex> lock(mutex_);
  recording_ = false;
  return std::move(recorded_);
}

}  // namespace ctxplan::gpu
