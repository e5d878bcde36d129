// Small results the host waits on (the page selections the union's copies are issued from),
// written by a kernel straight into pinned host memory rather than copied by a copy engine.
// A cudaMemcpyAsync device-to-host queues on the copy engine behind the offload stream's page
// copies: a 2 KiB read-back waited for megabytes of KV pages (replays measured page_topk up to
// 11x its kernels' time with offload on). Pinned host memory is mapped into the device's
// address space (unified addressing), so SMs can store to it over PCIe directly.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ctxplan::gpu {

// pinned_host[i] = device[i] for i < n, on `stream`: `pinned_host` from cudaMallocHost /
// cudaHostAlloc (mapped under unified addressing). Visible to the host once the stream has
// been synchronised. Launch errors are checked.
void WriteToPinnedHost(const int32_t* device, int32_t* pinned_host, int64_t n, cudaStream_t stream);

}  // namespace ctxplan::gpu
