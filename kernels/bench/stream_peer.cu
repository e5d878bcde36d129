// An elementwise "STREAM triad"-style peer for the memory-bound kernels of kernels_bench: out =
// in[0] + ... + in[n-1] over bf16, 16-byte vectors, a grid-stride loop with four vectors in flight
// a thread. It moves the same kind of traffic as a row kernel (n read streams, one write stream)
// without any reduction or dependency, so its rate at a kernel's size is what an ideal kernel of
// that traffic could reach there: the fill / drain of a ~100 MB launch costs a few microseconds
// that a 1 GiB copy does not pay.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>

#include "ctxplan/kernels/cuda/check.h"
#include "stream_peer.h"

namespace ctxplan::kernels::bench {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kVecElements = 8;  // bf16 in 16 bytes

template <int kInputs>
__global__ void __launch_bounds__(kThreads)
    ElementwiseSumKernel(StreamPeerInputs inputs, int64_t vectors, __nv_bfloat16* out) {
  static_assert(kInputs >= 1 && kInputs <= kMaxStreamPeerInputs);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; base < vectors;
       base += stride * kUnroll) {
    uint4 raw[kInputs][kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = base + u * stride;
#pragma unroll
      for (int k = 0; k < kInputs; ++k) {
        if (v < vectors) raw[k][u] = reinterpret_cast<const uint4*>(inputs.in[k])[v];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = base + u * stride;
      if (v >= vectors) continue;
      float sum[kVecElements] = {};
#pragma unroll
      for (int k = 0; k < kInputs; ++k) {
        const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw[k][u]);
#pragma unroll
        for (int e = 0; e < kVecElements / 2; ++e) {
          const float2 f = __bfloat1622float2(h[e]);
          sum[2 * e] += f.x;
          sum[2 * e + 1] += f.y;
        }
      }
      uint4 packed;
      auto* o = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
      for (int e = 0; e < kVecElements / 2; ++e) {
        o[e] = __floats2bfloat162_rn(sum[2 * e], sum[2 * e + 1]);
      }
      reinterpret_cast<uint4*>(out)[v] = packed;
    }
  }
}

}  // namespace

void LaunchElementwiseSum(const StreamPeerInputs& inputs, int count, int64_t elements,
                          __nv_bfloat16* out, cudaStream_t stream) {
  if (elements % kVecElements != 0) {
    throw std::invalid_argument("ElementwiseSum: elements must be a multiple of 8");
  }
  const int64_t vectors = elements / kVecElements;
  // Blocks resident at once on the device (asked once: the peer runs inside timed loops).
  static const int64_t resident = [] {
    int device = 0, sms = 0, per_sm = 0;
    CTXPLAN_CUDA_CHECK(cudaGetDevice(&device));
    CTXPLAN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    CTXPLAN_CUDA_CHECK(
        cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device));
    return int64_t{sms} * (per_sm / kThreads);
  }();
  const int64_t wanted =
      (vectors + int64_t{kThreads} * kUnroll - 1) / (int64_t{kThreads} * kUnroll);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, resident)));
  switch (count) {
    case 1:
      ElementwiseSumKernel<1><<<grid, kThreads, 0, stream>>>(inputs, vectors, out);
      break;
    case 2:
      ElementwiseSumKernel<2><<<grid, kThreads, 0, stream>>>(inputs, vectors, out);
      break;
    case 3:
      ElementwiseSumKernel<3><<<grid, kThreads, 0, stream>>>(inputs, vectors, out);
      break;
    default:
      throw std::invalid_argument("ElementwiseSum: 1 to 3 inputs");
  }
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

}  // namespace ctxplan::kernels::bench
