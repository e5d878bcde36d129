// SwiGLU: out = silu(gate) * up with gate_up rows laid out [gate (I) | up (I)], and its backward
//   d_gate = d_out * up * s (1 + g (1 - s)),  d_up = d_out * g * s,  s = sigmoid(g).
// Elementwise: one thread per chunk of kVec consecutive columns of one row (16-byte accesses).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ops_util.cuh"

namespace ctxplan::kernels::cuda {
namespace {

using detail::CeilDiv;
using detail::IsAligned;
using detail::LoadVec;
using detail::StoreVec;

constexpr const char* kName = "Swiglu";
constexpr int kThreads = 256;
static_assert(kThreads % detail::kWarpSize == 0);

__device__ __forceinline__ float Sigmoid(float g) {
  return 1.0f / (1.0f + __expf(-g));
}

// grid: ceil(t * I / kVec / kThreads).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    SwigluForwardKernel(const bf16* __restrict__ gate_up, int64_t tokens, int64_t intermediate,
                        bf16* __restrict__ out) {
  detail::GridDependencyWaitAndTrigger();
  const int64_t chunks_per_row = intermediate / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * chunks_per_row) return;
  const int64_t t = i / chunks_per_row;
  const int64_t c = (i - t * chunks_per_row) * kVec;
  const bf16* gate = gate_up + t * 2 * intermediate + c;
  float g[kVec], u[kVec], o[kVec];
  LoadVec<kVec>(gate, g);
  LoadVec<kVec>(gate + intermediate, u);
#pragma unroll
  for (int e = 0; e < kVec; ++e) o[e] = g[e] * Sigmoid(g[e]) * u[e];
  StoreVec<kVec>(out + t * intermediate + c, o);
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    SwigluBackwardKernel(const bf16* gate_up, const bf16* __restrict__ d_out, int64_t tokens,
                         int64_t intermediate, bf16* d_gate_up) {
  detail::GridDependencyWaitAndTrigger();
  const int64_t chunks_per_row = intermediate / kVec;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * chunks_per_row) return;
  const int64_t t = i / chunks_per_row;
  const int64_t c = (i - t * chunks_per_row) * kVec;
  const int64_t offset = t * 2 * intermediate + c;
  float g[kVec], u[kVec], d[kVec], dg[kVec], du[kVec];
  LoadVec<kVec>(gate_up + offset, g);
  LoadVec<kVec>(gate_up + offset + intermediate, u);
  LoadVec<kVec>(d_out + t * intermediate + c, d);
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float s = Sigmoid(g[e]);
    dg[e] = d[e] * u[e] * (s * (1.0f + g[e] * (1.0f - s)));
    du[e] = d[e] * g[e] * s;
  }
  StoreVec<kVec>(d_gate_up + offset, dg);
  StoreVec<kVec>(d_gate_up + offset + intermediate, du);
}

void CheckShape(int64_t tokens, int64_t intermediate) {
  if (tokens < 0 || intermediate <= 0) {
    throw std::invalid_argument(std::string(kName) + ": bad shape t=" + std::to_string(tokens) +
                                " I=" + std::to_string(intermediate));
  }
}

}  // namespace

void SwigluForward(const bf16* gate_up, int64_t tokens, int64_t intermediate, bf16* out,
                   cudaStream_t stream) {
  CheckShape(tokens, intermediate);
  if (tokens == 0) return;
  if (intermediate % 8 == 0 && IsAligned(gate_up, 16) && IsAligned(out, 16)) {
    const int64_t blocks = CeilDiv(tokens * intermediate / 8, kThreads);
    detail::Launch(SwigluForwardKernel<8>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                   stream, gate_up, tokens, intermediate, out);
  } else {
    const int64_t blocks = CeilDiv(tokens * intermediate, kThreads);
    detail::Launch(SwigluForwardKernel<1>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                   stream, gate_up, tokens, intermediate, out);
  }
}

void SwigluBackward(const bf16* gate_up, const bf16* d_out, int64_t tokens, int64_t intermediate,
                    bf16* d_gate_up, cudaStream_t stream) {
  CheckShape(tokens, intermediate);
  if (tokens == 0) return;
  if (intermediate % 8 == 0 && IsAligned(gate_up, 16) && IsAligned(d_out, 16) &&
      IsAligned(d_gate_up, 16)) {
    const int64_t blocks = CeilDiv(tokens * intermediate / 8, kThreads);
    detail::Launch(SwigluBackwardKernel<8>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                   stream, gate_up, d_out, tokens, intermediate, d_gate_up);
  } else {
    const int64_t blocks = CeilDiv(tokens * intermediate, kThreads);
    detail::Launch(SwigluBackwardKernel<1>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                   stream, gate_up, d_out, tokens, intermediate, d_gate_up);
  }
}

}  // namespace ctxplan::kernels::cuda
