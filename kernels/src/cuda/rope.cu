// Rotary position embedding, Hugging Face rotate_half convention, in place:
//   out[j]         = x[j] cos - x[j + d_h/2] sin
//   out[j + d_h/2] = x[j + d_h/2] cos + x[j] sin,   angle = position * theta^(-2j/d_h)
// The backward is the transpose: the same with sin negated.
//
// Precision: inv_freq is computed on the host in double and the angle position * inv_freq is
// formed and reduced to [-pi, pi] in double on the device (4 fp64 operations per angle); only
// the reduced angle goes through the fp32 sine and cosine. An fp32 product would lose whole
// radians at positions in the millions (the CPU reference works in double for the same reason).
//
// One thread per (token, group of kHeadsPerThread heads, chunk of kVec pairs): it computes its
// kVec angles once and rotates them for each head of its group, 16-byte loads of both halves.
#include <cuda_runtime.h>

#include <cmath>
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

constexpr const char* kName = "Rope";
constexpr int kThreads = 256;
constexpr int kHeadsPerThread = 4;
constexpr int kMaxHalf = 256;  // head_dim <= 512
constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInvTwoPi = 0.15915494309189533576888376337251;
static_assert(kThreads % detail::kWarpSize == 0);

struct InvFreq {
  double v[kMaxHalf];  // theta^(-2j/d_h), j < d_h / 2
};

// grid: ceil(t * ceil(H / kHeadsPerThread) * (d_h / 2 / kVec) / kThreads).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    RopeKernel(bf16* x, int64_t tokens, int heads, int half, int64_t row_stride,
               int64_t first_position, float sin_sign, const __grid_constant__ InvFreq inv_freq) {
  detail::GridDependencyWaitAndTrigger();
  const int pair_chunks = half / kVec;
  const int groups = (heads + kHeadsPerThread - 1) / kHeadsPerThread;
  const int64_t per_token = static_cast<int64_t>(groups) * pair_chunks;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= tokens * per_token) return;
  const int64_t t = i / per_token;
  const int rem = static_cast<int>(i - t * per_token);
  const int group = rem / pair_chunks;
  const int j0 = (rem - group * pair_chunks) * kVec;

  const double position = static_cast<double>(first_position + t);
  float cos_v[kVec], sin_v[kVec];
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const double angle = position * inv_freq.v[j0 + e];
    const double turns = rint(angle * kInvTwoPi);
    const float reduced = static_cast<float>(fma(-turns, kTwoPi, angle));  // [-pi, pi]
    float s, c;
    __sincosf(reduced, &s, &c);
    cos_v[e] = c;
    sin_v[e] = sin_sign * s;
  }

  bf16* row = x + t * row_stride;
  const int head_dim = 2 * half;
  float x1[kHeadsPerThread][kVec], x2[kHeadsPerThread][kVec];
#pragma unroll
  for (int k = 0; k < kHeadsPerThread; ++k) {
    const int h = group * kHeadsPerThread + k;
    if (h < heads) {
      LoadVec<kVec>(row + h * head_dim + j0, x1[k]);
      LoadVec<kVec>(row + h * head_dim + half + j0, x2[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kHeadsPerThread; ++k) {
    const int h = group * kHeadsPerThread + k;
    if (h < heads) {
      float o1[kVec], o2[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        o1[e] = x1[k][e] * cos_v[e] - x2[k][e] * sin_v[e];
        o2[e] = x2[k][e] * cos_v[e] + x1[k][e] * sin_v[e];
      }
      StoreVec<kVec>(row + h * head_dim + j0, o1);
      StoreVec<kVec>(row + h * head_dim + half + j0, o2);
    }
  }
}

void Launch(bf16* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride,
            int64_t first_position, double theta, float sin_sign, cudaStream_t stream) {
  if (tokens < 0 || heads < 0 || head_dim <= 0 || head_dim % 2 != 0 || head_dim / 2 > kMaxHalf ||
      row_stride < heads * head_dim || !(theta > 0.0) || heads > 0x7fffffff) {
    throw std::invalid_argument(std::string(kName) + ": bad shape t=" + std::to_string(tokens) +
                                " H=" + std::to_string(heads) + " d_h=" + std::to_string(head_dim) +
                                " stride=" + std::to_string(row_stride));
  }
  if (tokens == 0 || heads == 0) return;
  const int half = static_cast<int>(head_dim / 2);
  InvFreq inv_freq{};
  for (int j = 0; j < half; ++j) {
    inv_freq.v[j] = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(head_dim));
  }
  const int64_t groups = CeilDiv(heads, kHeadsPerThread);
  const bool vec = half % 8 == 0 && row_stride % 8 == 0 && IsAligned(x, 16);
  if (vec) {
    const int64_t blocks = CeilDiv(tokens * groups * (half / 8), kThreads);
    detail::Launch(RopeKernel<8>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, x,
                   tokens, static_cast<int>(heads), half, row_stride, first_position, sin_sign,
                   inv_freq);
  } else {
    const int64_t blocks = CeilDiv(tokens * groups * half, kThreads);
    detail::Launch(RopeKernel<1>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), stream, x,
                   tokens, static_cast<int>(heads), half, row_stride, first_position, sin_sign,
                   inv_freq);
  }
}

}  // namespace

void RopeForward(bf16* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride,
                 int64_t first_position, double theta, cudaStream_t stream) {
  Launch(x, tokens, heads, head_dim, row_stride, first_position, theta, 1.0f, stream);
}

void RopeBackward(bf16* dx, int64_t tokens, int64_t heads, int64_t head_dim, int64_t row_stride,
                  int64_t first_position, double theta, cudaStream_t stream) {
  Launch(dx, tokens, heads, head_dim, row_stride, first_position, theta, -1.0f, stream);
}

}  // namespace ctxplan::kernels::cuda
