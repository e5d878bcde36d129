// A trivial kernel for the runtime's own tests and measurements (tracer correctness, tracing
// overhead): not part of any training step.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ctxplan::gpu {

// data[i] = data[i] * scale + shift for i < n, on `stream`; launch errors are checked.
void LaunchProbeKernel(float* data, int64_t n, float scale, float shift, cudaStream_t stream);

}  // namespace ctxplan::gpu
