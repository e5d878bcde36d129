// Many small copies between pinned host pages and device slots, handed to the driver in one
// call. The offload path copies a layer's selected pages as runs of contiguous pages; with sparse
// selections at small pages a layer takes hundreds of runs, and one cudaMemcpyAsync each costs
// the host thread that also launches the compute stream a few microseconds a copy.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

namespace ctxplan::gpu {

// The copies of one batch: dsts[i] <- srcs[i], sizes[i] bytes; they must not overlap.
struct CopyBatch {
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;

  void Clear() {
    dsts.clear();
    srcs.clear();
    sizes.clear();
  }
  void Add(void* dst, const void* src, size_t bytes) {
    dsts.push_back(dst);
    srcs.push_back(src);
    sizes.push_back(bytes);
  }
  size_t size() const { return dsts.size(); }
};

// Issues the batch on `stream` (stream ordered, sources read in stream order): one
// cudaMemcpyBatchAsync where the runtime has it (CUDA 12.8+), else one cudaMemcpyAsync a copy.
// Every call is checked.
void IssueCopyBatch(CopyBatch& batch, cudaStream_t stream);

}  // namespace ctxplan::gpu
