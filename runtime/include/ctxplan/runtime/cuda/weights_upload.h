// The start-up's weights upload: an fp32 host tensor rounded to bf16 on the host's threads, then
// copied to the device from pageable staging. ctxtrain's CUDA backend uploads every weight this
// way, and ctxplan-measure's host group times it (weights_upload) for the planner's start-up.
#pragma once

#include <cstdint>
#include <vector>

namespace ctxplan::gpu {

// device_bf16[i] = bf16(host[i]) for every i, synchronously; `staging` is reused between calls
// (resized as needed). CUDA errors throw.
void UploadAsBf16(const std::vector<float>& host, void* device_bf16,
                  std::vector<uint16_t>& staging);

}  // namespace ctxplan::gpu
