// AdamW on the CPU (--optimizer adamw-host): torch.optim.AdamW semantics as the GPU kernel and the
// CPU reference, over the host copies of the weights (bf16) and the staged gradients (bf16 or
// fp32), with fp32 moments. One function so that the CUDA backend runs it and ctxplan-measure
// times exactly it (the planner's host_adamw_gparams).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace ctxplan {

struct HostAdamWParams {
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  int64_t step = 1;  // this update's step number (bias corrections), from 1
};

// One tensor's element offsets into the weights, gradients and moments, and its length.
struct HostAdamWTensor {
  size_t weight = 0, grad = 0, moment = 0, n = 0;
};

// Updates every tensor in place on `threads` threads (each takes a slice of every tensor).
//   weights: bf16 bits   grads: bf16 bits (uint16_t) or fp32   m, v: fp32 moments
template <typename Grad>
void HostAdamWStep(const HostAdamWParams& params, std::span<const HostAdamWTensor> tensors,
                   uint16_t* weights, const Grad* grads, float* m, float* v, unsigned threads);

}  // namespace ctxplan
