// CPU reference of rotary position embedding, Hugging Face Qwen2 / Llama convention
// (rotate_half): element j of a head is paired with element j + d_h/2, for j < d_h/2, and the pair
// is rotated by angle = position * theta^(-2j/d_h):
//   out[j]         = x[j] cos - x[j + d_h/2] sin
//   out[j + d_h/2] = x[j + d_h/2] cos + x[j] sin
// Angles are computed in double: at positions in the millions, an fp32 product position * inv_freq
// loses whole radians.
#include <cmath>
#include <vector>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {
namespace {

// Rotates every head of every row by +angle (direction = 1) or -angle (direction = -1). The
// rotation is orthogonal, so its transpose (the backward) is its inverse: rotation by -angle.
void Rotate(float* x /*[t][H][d_h]*/, int64_t tokens, int64_t heads, int64_t head_dim,
            int64_t first_position, double theta, double direction) {
  CTXPLAN_CHECK(tokens >= 0 && heads >= 0, "negative RoPE shape");
  CTXPLAN_CHECK(head_dim > 0 && head_dim % 2 == 0, "RoPE needs an even head_dim");
  CTXPLAN_CHECK(theta > 0.0, "RoPE theta must be positive");
  const int64_t half = head_dim / 2;
  std::vector<double> inv_freq(static_cast<size_t>(half));
  for (int64_t j = 0; j < half; ++j) {
    inv_freq[j] = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(head_dim));
  }
  std::vector<double> cos_row(static_cast<size_t>(half)), sin_row(static_cast<size_t>(half));
  for (int64_t t = 0; t < tokens; ++t) {
    // One table per row, shared by all its heads.
    const double position = static_cast<double>(first_position + t);
    for (int64_t j = 0; j < half; ++j) {
      const double angle = position * inv_freq[j];
      cos_row[j] = std::cos(angle);
      sin_row[j] = direction * std::sin(angle);
    }
    for (int64_t h = 0; h < heads; ++h) {
      float* head = x + (t * heads + h) * head_dim;  // [d_h]
      for (int64_t j = 0; j < half; ++j) {
        const double x1 = head[j];
        const double x2 = head[j + half];
        head[j] = static_cast<float>(x1 * cos_row[j] - x2 * sin_row[j]);
        head[j + half] = static_cast<float>(x2 * cos_row[j] + x1 * sin_row[j]);
      }
    }
  }
}

}  // namespace

void RopeForward(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t first_position,
                 double theta) {
  Rotate(x, tokens, heads, head_dim, first_position, theta, 1.0);
}

void RopeBackward(float* dx, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t first_position, double theta) {
  Rotate(dx, tokens, heads, head_dim, first_position, theta, -1.0);
}

}  // namespace ctxplan::kernels::cpu
