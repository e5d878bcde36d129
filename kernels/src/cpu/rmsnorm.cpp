// CPU reference of RMSNorm (Qwen2 / Llama): y = x * rstd * weight,
// rstd = 1 / sqrt(mean(x^2) + eps). Row sums run in double: hidden is thousands wide and the
// reference must not be the noisy side.
#include <cmath>
#include <vector>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {

void RmsNormForward(const float* x, const float* weight, int64_t tokens, int64_t hidden, float eps,
                    float* y, float* rstd) {
  CTXPLAN_CHECK(tokens >= 0 && hidden > 0, "bad RMSNorm shape");
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xr = x + t * hidden;  // [d]
    float* yr = y + t * hidden;        // [d]
    double sum_sq = 0.0;
    for (int64_t i = 0; i < hidden; ++i) sum_sq += static_cast<double>(xr[i]) * xr[i];
    const double r = 1.0 / std::sqrt(sum_sq / static_cast<double>(hidden) + eps);
    // rstd is saved for the backward in fp32, as a kernel would; the forward itself uses the
    // double value.
    rstd[t] = static_cast<float>(r);
    for (int64_t i = 0; i < hidden; ++i) yr[i] = static_cast<float>(xr[i] * r * weight[i]);
  }
}

// With g = dy * weight (elementwise) and r = rstd:
//   dx = r * g - r^3 * x * (g . x) / d        (the normalisation couples every element of a row)
//   d_weight += dy * x * r, summed over tokens
void RmsNormBackward(const float* x, const float* weight, const float* rstd, const float* dy,
                     int64_t tokens, int64_t hidden, float* dx, float* d_weight) {
  CTXPLAN_CHECK(tokens >= 0 && hidden > 0, "bad RMSNorm shape");
  // d_weight sums over every token of the chunk: accumulate in double, add to the fp32 output once.
  std::vector<double> dw(static_cast<size_t>(hidden), 0.0);
  for (int64_t t = 0; t < tokens; ++t) {
    const float* xr = x + t * hidden;
    const float* dyr = dy + t * hidden;
    float* dxr = dx + t * hidden;
    const double r = rstd[t];
    double g_dot_x = 0.0;
    for (int64_t i = 0; i < hidden; ++i) {
      g_dot_x += static_cast<double>(dyr[i]) * weight[i] * xr[i];
    }
    const double coupling = r * r * r * g_dot_x / static_cast<double>(hidden);
    for (int64_t i = 0; i < hidden; ++i) {
      dxr[i] = static_cast<float>(r * dyr[i] * weight[i] - coupling * xr[i]);
      dw[i] += static_cast<double>(dyr[i]) * xr[i] * r;
    }
  }
  for (int64_t i = 0; i < hidden; ++i) d_weight[i] += static_cast<float>(dw[i]);
}

}  // namespace ctxplan::kernels::cpu
