// The empty kernel whose back-to-back launches give the per-launch cost. The only device code of
// ctxplan-measure: everything else it times is a kernel of kernels/.
#include "ctxplan/kernels/cuda/check.h"
#include "measure_groups.h"

namespace ctxplan::calibrate {

namespace {
__global__ void EmptyKernel() {}
}  // namespace

void LaunchEmptyKernel(cudaStream_t stream) {
  EmptyKernel<<<1, 1, 0, stream>>>();
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

}  // namespace ctxplan::calibrate
