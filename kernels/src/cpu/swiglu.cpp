// CPU reference of the SwiGLU gate: out = silu(gate) * up, silu(g) = g * sigmoid(g), with each row
// of gate_up laid out [gate (I) | up (I)] as the fused gate_up projection writes it.
#include <cmath>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {
namespace {

// 1 / (1 + e^-g) is safe at both ends in double: e^-g overflows to inf for g << 0 and the result
// is then exactly 0, the right limit.
double Sigmoid(double g) {
  return 1.0 / (1.0 + std::exp(-g));
}

}  // namespace

void SwigluForward(const float* gate_up, int64_t tokens, int64_t intermediate, float* out) {
  CTXPLAN_CHECK(tokens >= 0 && intermediate >= 0, "negative SwiGLU shape");
  for (int64_t t = 0; t < tokens; ++t) {
    const float* gate = gate_up + t * 2 * intermediate;  // [I]
    const float* up = gate + intermediate;               // [I]
    float* o = out + t * intermediate;                   // [I]
    for (int64_t i = 0; i < intermediate; ++i) {
      const double g = gate[i];
      o[i] = static_cast<float>(g * Sigmoid(g) * up[i]);
    }
  }
}

// d silu(g) / dg = s + g s (1 - s), s = sigmoid(g).
void SwigluBackward(const float* gate_up, const float* d_out, int64_t tokens, int64_t intermediate,
                    float* d_gate_up) {
  CTXPLAN_CHECK(tokens >= 0 && intermediate >= 0, "negative SwiGLU shape");
  for (int64_t t = 0; t < tokens; ++t) {
    const float* gate = gate_up + t * 2 * intermediate;
    const float* up = gate + intermediate;
    const float* dout = d_out + t * intermediate;
    float* d_gate = d_gate_up + t * 2 * intermediate;
    float* d_up = d_gate + intermediate;
    for (int64_t i = 0; i < intermediate; ++i) {
      const double g = gate[i];
      const double s = Sigmoid(g);
      d_gate[i] = static_cast<float>(dout[i] * up[i] * (s + g * s * (1.0 - s)));
      d_up[i] = static_cast<float>(dout[i] * g * s);
    }
  }
}

}  // namespace ctxplan::kernels::cpu
