#include "ctxplan/runtime/cuda/probe_kernel.h"

#include <cstdint>

#include "ctxplan/kernels/cuda/check.h"

namespace ctxplan::gpu {

namespace {

__global__ void ProbeKernel(float* data, int64_t n, float scale, float shift) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) data[i] = data[i] * scale + shift;
}

__global__ void EmptyKernel() {}

__device__ uint64_t GlobalTimerNs() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// Wall time, not SM cycles: the gap does not stretch when the clock sinks.
__global__ void IdleKernel(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) __nanosleep(2000);
}

}  // namespace

void LaunchProbeKernel(float* data, int64_t n, float scale, float shift, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  ProbeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(data, n, scale, shift);
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

void LaunchEmptyKernel(cudaStream_t stream) {
  EmptyKernel<<<1, 1, 0, stream>>>();
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

void LaunchIdleKernel(double seconds, cudaStream_t stream) {
  IdleKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(seconds * 1e9));
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

}  // namespace ctxplan::gpu
