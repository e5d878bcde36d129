// The empty kernel whose back-to-back launches give the per-launch cost, and an idle kernel that
// holds its stream for a set time while drawing next to nothing (the power group's duty cycles).
// The only device code of ctxplan-measure: everything else it times is a kernel of kernels/.
#include "ctxplan/kernels/cuda/check.h"
#include "measure_groups.h"

namespace ctxplan::calibrate {

namespace {
__global__ void EmptyKernel() {}

__device__ uint64_t GlobalTimerNs() {
  uint64_t ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// One thread asleep until `ns` have passed on the global timer (wall time, not SM cycles: the
// gap does not stretch when the clock sinks).
__global__ void IdleKernel(uint64_t ns) {
  const uint64_t start = GlobalTimerNs();
  while (GlobalTimerNs() - start < ns) __nanosleep(2000);
}
}  // namespace

void LaunchEmptyKernel(cudaStream_t stream) {
  EmptyKernel<<<1, 1, 0, stream>>>();
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

void LaunchIdleKernel(double seconds, cudaStream_t stream) {
  IdleKernel<<<1, 1, 0, stream>>>(static_cast<uint64_t>(seconds * 1e9));
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

}  // namespace ctxplan::calibrate
