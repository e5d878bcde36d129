#include <algorithm>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/sm_copy.h"

namespace ctxplan::gpu {

namespace {

constexpr int kThreads = 256;

__global__ void CopyBySmsKernel(const int32_t* __restrict__ from, int32_t* __restrict__ to,
                                int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    to[i] = from[i];
}

__global__ void FillPageTableKernel(int32_t* __restrict__ table, int64_t n, int64_t first_page,
                                    int64_t tier_pages, int64_t tier_base, int64_t slot_base) {
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x)
    table[j] = static_cast<int32_t>(first_page + j < tier_pages ? tier_base + first_page + j
                                                                : slot_base + j);
}

}  // namespace

void FillPageTable(int32_t* table, int64_t n, int64_t first_page, int64_t tier_pages,
                   int64_t tier_base, int64_t slot_base, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 64);
  FillPageTableKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      table, n, first_page, tier_pages, tier_base, slot_base);
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

void CopyBySms(const int32_t* from, int32_t* to, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  // A few blocks: the tables are KiBs, and PCIe, not the SMs, bounds a host side's traffic.
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 32);
  CopyBySmsKernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(from, to, n);
  CTXPLAN_CUDA_CHECK_LAUNCH();
}

}  // namespace ctxplan::gpu
