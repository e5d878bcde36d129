#include "ctxplan/runtime/cuda/memcpy_batch.h"

#include "ctxplan/kernels/cuda/check.h"

namespace ctxplan::gpu {

void IssueCopyBatch(CopyBatch& batch, cudaStream_t stream) {
  if (batch.size() == 0) return;
#if CUDART_VERSION >= 12080
  // One attribute for every copy: pinned host and device pointers, read when the stream gets
  // there (the page slots are written by kernels earlier in stream order).
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t first = 0;
  CTXPLAN_CUDA_CHECK(cudaMemcpyBatchAsync(batch.dsts.data(), batch.srcs.data(), batch.sizes.data(),
                                          batch.size(), &attributes, &first, 1, stream));
#else
  for (size_t i = 0; i < batch.size(); ++i)
    CTXPLAN_CUDA_CHECK(
        cudaMemcpyAsync(batch.dsts[i], batch.srcs[i], batch.sizes[i], cudaMemcpyDefault, stream));
#endif
}

}  // namespace ctxplan::gpu
