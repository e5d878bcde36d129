// Small int32 tables on the offload path (page selections, the union of a layer's pages) copied
// by a kernel rather than by cudaMemcpyAsync. A memcpy between host and device, or within the
// device, queues on a copy engine behind the offload streams' page copies, whatever stream it was
// issued on: a 2 KiB read-back of the selections waited for megabytes of KV pages (replays
// measured page_topk up to 11x its kernels' time), and the backward's 8 KiB union table held the
// attention backward until the next layer's pages were in (8-10 ms a layer, Llama-3.1-8B 128K
// k64 on the H200). Pinned host memory is mapped into the device's address space (unified
// addressing), so SMs load and store it over PCIe directly.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace ctxplan::gpu {

// to[i] = from[i] for i < n, by a kernel on `stream`. Either side may be device memory or pinned
// host memory from cudaMallocHost / cudaHostAlloc (mapped under unified addressing); a host side
// is coherent with the host once the stream has been synchronised. Launch errors are checked.
void CopyBySms(const int32_t* from, int32_t* to, int64_t n, cudaStream_t stream);

// A page table of the GPU tier's pool, written by a kernel on `stream` (no host staging to keep
// alive): table[j] = tier_base + first_page + j where first_page + j < tier_pages (the page lives
// in the tier), else slot_base + j (it is staged in a slot). `table` is device memory.
void FillPageTable(int32_t* table, int64_t n, int64_t first_page, int64_t tier_pages,
                   int64_t tier_base, int64_t slot_base, cudaStream_t stream);

}  // namespace ctxplan::gpu
