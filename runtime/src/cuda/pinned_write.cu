#include <algorithm>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/pinned_write.h"

namespace ctxplan::gpu {

namespace {

constexpr int kThreads = 256;

__global__ void WriteToPinnedHostKernel(const int32_t* __restrict__ device,
                                        int32_t* __restrict__ pinned_host, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    pinned_host[i] = device[i];
}

}  // namespace

void WriteToPinnedHost(const int32_t* device, int32_t* pinned_host, int64_t n,
                       cudaStream_t stream) {
  if (n <= 0) return;
  // A few blocks: the selections are KiBs, and PCIe, not the SMs, bounds the stores.
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 32);
  WriteToPinnedHostKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      device, pinned_host, n);
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

}  // namespace ctxplan::gpu
