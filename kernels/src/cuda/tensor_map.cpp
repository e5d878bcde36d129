#include "tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"

namespace ctxplan::kernels::cuda::detail {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 Encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    CTXPLAN_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                        cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw CudaError("cuTensorMapEncodeTiled: not provided by this driver");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

}  // namespace

CUtensorMap EncodeBf16TensorMap(const void* base, std::initializer_list<uint64_t> extents,
                                std::initializer_list<uint64_t> strides_bytes,
                                std::initializer_list<uint32_t> box) {
  const std::vector<cuuint64_t> dims(extents.begin(), extents.end());
  const std::vector<cuuint64_t> strides(strides_bytes.begin(), strides_bytes.end());
  const std::vector<cuuint32_t> boxes(box.begin(), box.end());
  const auto rank = static_cast<cuuint32_t>(dims.size());
  if (rank < 1 || rank > 5 || strides.size() + 1 != rank || boxes.size() != rank) {
    throw CudaError("EncodeBf16TensorMap: rank " + std::to_string(rank) +
                    " with mismatched strides or box");
  }
  const std::vector<cuuint32_t> element_strides(rank, 1);
  CUtensorMap map{};
  const CUresult status =
      Encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), dims.data(),
                strides.data(), boxes.data(), element_strides.data(), CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    throw CudaError("cuTensorMapEncodeTiled: CUresult " + std::to_string(static_cast<int>(status)) +
                    " (rank " + std::to_string(rank) + ", inner extent " + std::to_string(dims[0]) +
                    ", box " + std::to_string(boxes[0]) + ")");
  }
  return map;
}

CUtensorMap EncodeTokenHeadMap(const void* base, int64_t tokens, int64_t heads, int64_t head_dim,
                               uint32_t box_tokens) {
  const auto t = static_cast<uint64_t>(tokens), h = static_cast<uint64_t>(heads),
             d = static_cast<uint64_t>(head_dim);
  const uint64_t row_bytes = d * 2;
  return EncodeBf16TensorMap(base, {d, h, t}, {row_bytes, h * row_bytes}, {64, 1, box_tokens});
}

}  // namespace ctxplan::kernels::cuda::detail
