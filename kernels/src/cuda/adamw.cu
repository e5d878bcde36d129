// AdamW, torch.optim.AdamW semantics (decoupled weight decay, bias correction), fp32 moments,
// bf16 or fp32 parameters and gradients:
//   p = p * (1 - lr wd);  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)
// The bias corrections and the decay factor are formed on the host in double. One thread per
// 4 parameters (16-byte fp32 accesses, 8-byte bf16); the last thread takes the tail scalar.
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ops_util.cuh"

namespace ctxplan::kernels::cuda {
namespace {

using detail::CeilDiv;
using detail::FromFloat;
using detail::IsAligned;
using detail::LoadVec;
using detail::StoreVec;
using detail::ToFloat;

constexpr const char* kName = "AdamW";
constexpr int kThreads = 256;
constexpr int kVec = 4;
static_assert(kThreads % detail::kWarpSize == 0);

struct Coefficients {
  float lr, beta1, beta2, eps, decay, correction1, correction2;
};

__device__ __forceinline__ void Update(float& p, float g, float& m, float& v,
                                       const Coefficients& k) {
  m = k.beta1 * m + (1.0f - k.beta1) * g;
  v = k.beta2 * v + (1.0f - k.beta2) * g * g;
  const float m_hat = m / k.correction1;
  const float v_hat = v / k.correction2;
  p = p * k.decay - k.lr * m_hat / (sqrtf(v_hat) + k.eps);
}

// grid: ceil(n / kVec / kThreads). kVectorised: every pointer aligned for kVec-wide accesses.
template <bool kVectorised, typename P, typename G>
__global__ void __launch_bounds__(kThreads)
    AdamWKernel(P* __restrict__ param, const G* __restrict__ grad, float* __restrict__ m,
                float* __restrict__ v, int64_t n, Coefficients k) {
  detail::GridDependencyWaitAndTrigger();
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (first >= n) return;
  if (kVectorised && first + kVec <= n) {
    float p4[kVec], g4[kVec], m4[kVec], v4[kVec];
    LoadVec<kVec>(param + first, p4);
    LoadVec<kVec>(grad + first, g4);
    LoadVec<kVec>(m + first, m4);
    LoadVec<kVec>(v + first, v4);
#pragma unroll
    for (int e = 0; e < kVec; ++e) Update(p4[e], g4[e], m4[e], v4[e], k);
    StoreVec<kVec>(param + first, p4);
    StoreVec<kVec>(m + first, m4);
    StoreVec<kVec>(v + first, v4);
  } else {
    for (int64_t i = first; i < first + kVec && i < n; ++i) {
      float p = ToFloat(param[i]), mi = m[i], vi = v[i];
      Update(p, ToFloat(grad[i]), mi, vi, k);
      param[i] = FromFloat<P>(p);
      m[i] = mi;
      v[i] = vi;
    }
  }
}

template <typename P, typename G>
void Launch(P* param, const G* grad, float* m, float* v, int64_t n, const AdamWParams& p,
            cudaStream_t stream) {
  if (n < 0 || p.step < 1) {
    throw std::invalid_argument(std::string(kName) + ": bad size or step (n=" + std::to_string(n) +
                                ", step=" + std::to_string(p.step) + ")");
  }
  if (n == 0) return;
  Coefficients k{};
  k.lr = p.lr;
  k.beta1 = p.beta1;
  k.beta2 = p.beta2;
  k.eps = p.eps;
  k.decay = static_cast<float>(1.0 - static_cast<double>(p.lr) * p.weight_decay);
  k.correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta1), p.step));
  k.correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(p.beta2), p.step));
  const bool vec = IsAligned(param, kVec * sizeof(P)) && IsAligned(grad, kVec * sizeof(G)) &&
                   IsAligned(m, 16) && IsAligned(v, 16);
  const unsigned blocks = static_cast<unsigned>(CeilDiv(CeilDiv(n, kVec), kThreads));
  if (vec) {
    detail::Launch(AdamWKernel<true, P, G>, dim3(blocks), dim3(kThreads), stream, param, grad, m, v,
                   n, k);
  } else {
    detail::Launch(AdamWKernel<false, P, G>, dim3(blocks), dim3(kThreads), stream, param, grad, m,
                   v, n, k);
  }
}

}  // namespace

void AdamW(bf16* param, const bf16* grad, float* m, float* v, int64_t n, const AdamWParams& p,
           cudaStream_t stream) {
  Launch(param, grad, m, v, n, p, stream);
}

void AdamW(bf16* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p,
           cudaStream_t stream) {
  Launch(param, grad, m, v, n, p, stream);
}

void AdamW(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p,
           cudaStream_t stream) {
  Launch(param, grad, m, v, n, p, stream);
}

}  // namespace ctxplan::kernels::cuda
