#include "ctxplan/runtime/cpu/host_adamw.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "ctxplan/runtime/bf16.h"

namespace ctxplan {

namespace {

float ToFloat(float x) {
  return x;
}
float ToFloat(uint16_t bits) {
  return Bf16ToFp32(bits);
}

}  // namespace

template <typename Grad>
void HostAdamWStep(const HostAdamWParams& params, std::span<const HostAdamWTensor> tensors,
                   uint16_t* weights, const Grad* grads, float* m, float* v, unsigned threads) {
  const double correction1 = 1.0 - std::pow(static_cast<double>(params.beta1), params.step);
  const double correction2 = 1.0 - std::pow(static_cast<double>(params.beta2), params.step);
  const double decay = 1.0 - static_cast<double>(params.lr) * params.weight_decay;
  // fp32 arithmetic as the GPU kernel, bias corrections folded in once (in double): the update
  // streams ~22 bytes per parameter and must run at host memory speed, not at the speed of
  // double-precision divisions (7.6B parameters at 7B).
  //   (m / c1) / (sqrt(v / c2) + eps) = (1 / c1) * m / (sqrt(v) / sqrt(c2) + eps)
  const float beta1 = params.beta1, beta2 = params.beta2, eps = params.eps;
  const auto step_size = static_cast<float>(params.lr / correction1);
  const auto inv_sqrt_c2 = static_cast<float>(1.0 / std::sqrt(correction2));
  const auto keep = static_cast<float>(decay);
  auto update = [&](const HostAdamWTensor& t, size_t begin, size_t end) {
    uint16_t* w = weights + t.weight;
    const Grad* g = grads + t.grad;
    float* mt = m + t.moment;
    float* vt = v + t.moment;
    for (size_t j = begin; j < end; ++j) {
      const float grad = ToFloat(g[j]);
      const float mj = beta1 * mt[j] + (1.0f - beta1) * grad;
      const float vj = beta2 * vt[j] + (1.0f - beta2) * grad * grad;
      mt[j] = mj;
      vt[j] = vj;
      w[j] = Fp32ToBf16(Bf16ToFp32(w[j]) * keep -
                        step_size * mj / (std::sqrt(vj) * inv_sqrt_c2 + eps));
    }
  };
  threads = std::max(1u, threads);
  std::vector<std::thread> pool;
  for (unsigned p = 0; p < threads; ++p)
    pool.emplace_back([&, p] {
      for (const HostAdamWTensor& t : tensors) {
        const size_t per = (t.n + threads - 1) / threads;
        update(t, std::min(t.n, p * per), std::min(t.n, (p + 1) * per));
      }
    });
  for (std::thread& thread : pool) thread.join();
}

template void HostAdamWStep<uint16_t>(const HostAdamWParams&, std::span<const HostAdamWTensor>,
                                      uint16_t*, const uint16_t*, float*, float*, unsigned);
template void HostAdamWStep<float>(const HostAdamWParams&, std::span<const HostAdamWTensor>,
                                   uint16_t*, const float*, float*, float*, unsigned);

}  // namespace ctxplan
