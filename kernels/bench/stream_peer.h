// The elementwise peer of kernels_bench (stream_peer.cu): n bf16 read streams, one write stream.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace ctxplan::kernels::bench {

inline constexpr int kMaxStreamPeerInputs = 3;

struct StreamPeerInputs {
  const __nv_bfloat16* in[kMaxStreamPeerInputs] = {};  // [elements] each, 16-byte aligned
};

// out[i] = sum of in[k][i] over the first `count` inputs (fp32 sum, bf16 out), elements % 8 == 0.
void LaunchElementwiseSum(const StreamPeerInputs& inputs, int count, int64_t elements,
                          __nv_bfloat16* out, cudaStream_t stream);

}  // namespace ctxplan::kernels::bench
