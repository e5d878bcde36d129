// CPU reference of AdamW, torch.optim.AdamW semantics (decoupled weight decay, bias correction):
//   p -= lr * wd * p
//   m  = b1 m + (1 - b1) g
//   v  = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^step)) / (sqrt(v / (1 - b2^step)) + eps)
// As in PyTorch, eps is added after the square root of the bias-corrected second moment.
#include <cmath>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {

void AdamW(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& p) {
  CTXPLAN_CHECK(n >= 0, "negative AdamW size");
  CTXPLAN_CHECK(p.step >= 1, "AdamW step is 1-based");
  // Bias corrections in double: 1 - 0.95^step in fp32 is coarse for the first steps.
  const double correction1 = 1.0 - std::pow(static_cast<double>(p.beta1), p.step);
  const double correction2 = 1.0 - std::pow(static_cast<double>(p.beta2), p.step);
  const double decay = 1.0 - static_cast<double>(p.lr) * p.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const double g = grad[i];
    const double mi = p.beta1 * static_cast<double>(m[i]) + (1.0 - p.beta1) * g;
    const double vi = p.beta2 * static_cast<double>(v[i]) + (1.0 - p.beta2) * g * g;
    // The moments are stored in fp32; the update uses what is stored, as the next step will.
    m[i] = static_cast<float>(mi);
    v[i] = static_cast<float>(vi);
    const double m_hat = static_cast<double>(m[i]) / correction1;
    const double v_hat = static_cast<double>(v[i]) / correction2;
    const double update = p.lr * m_hat / (std::sqrt(v_hat) + p.eps);
    param[i] = static_cast<float>(static_cast<double>(param[i]) * decay - update);
  }
}

}  // namespace ctxplan::kernels::cpu
