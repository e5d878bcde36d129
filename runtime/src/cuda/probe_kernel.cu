#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/probe_kernel.h"

namespace ctxplan::gpu {

namespace {

__global__ void ProbeKernel(float* data, int64_t n, float scale, float shift) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) data[i] = data[i] * scale + shift;
}

}  // namespace

void LaunchProbeKernel(float* data, int64_t n, float scale, float shift, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  ProbeKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(data, n, scale, shift);
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

}  // namespace ctxplan::gpu
