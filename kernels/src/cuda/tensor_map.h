// Tensor maps for the TMA unit (cp.async.bulk.tensor), encoded on the host.
//
// The driver's encoder is reached through the runtime's entry-point query, so nothing links
// libcuda: the test binaries still load on a machine without a GPU driver (CI). A map is a
// 128-byte opaque value passed to the kernel as a __grid_constant__ parameter.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <initializer_list>

namespace ctxplan::kernels::cuda::detail {

// A bf16 tensor of up to five dimensions, innermost first: extents[0] elements contiguous,
// strides_bytes[i] the step of dimension i + 1 (a multiple of 16). Boxes of `box` elements land
// in shared memory with the 128-byte swizzle (box[0] * 2 must be 128 bytes or less); coordinates
// outside the extents read as zeros.
CUtensorMap EncodeBf16TensorMap(const void* base, std::initializer_list<uint64_t> extents,
                                std::initializer_list<uint64_t> strides_bytes,
                                std::initializer_list<uint32_t> box);

// A [tokens][heads][head_dim] bf16 tensor (queries, keys, values, their gradients), boxes of 64
// columns x `box_tokens` tokens of one head.
CUtensorMap EncodeTokenHeadMap(const void* base, int64_t tokens, int64_t heads, int64_t head_dim,
                               uint32_t box_tokens);

}  // namespace ctxplan::kernels::cuda::detail
