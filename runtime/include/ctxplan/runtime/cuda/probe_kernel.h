// Trivial kernels for the runtime's own tests and for measurements (tracer correctness, tracing
// overhead, ctxplan-measure's launch cost and duty cycles, attention_bench's timed regions): not
// part of any training step.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ctxplan::gpu {

// data[i] = data[i] * scale + shift for i < n, on `stream`; launch errors are checked.
void LaunchProbeKernel(float* data, int64_t n, float scale, float shift, cudaStream_t stream);

// An empty kernel <<<1, 1>>> on `stream` (the per-launch cost of back-to-back launches).
void LaunchEmptyKernel(cudaStream_t stream);

// A kernel <<<1, 1>>> asleep on the global timer for `seconds` of wall time on `stream`, drawing
// next to nothing: an idle gap (duty cycles), or a hold ahead of a timed region so that the host
// enqueues the region's launches before the first runs.
void LaunchIdleKernel(double seconds, cudaStream_t stream);

}  // namespace ctxplan::gpu
