// Memory events of the CUDA runtime's own allocators (the GPU arena, the pinned page store).
// CUPTI sees only driver-level allocations (one cudaMalloc for the whole arena, a few
// cudaHostAlloc blocks), so the runtime reports its sub-allocations itself: the allocators call a
// listener after every allocation and free, and the tracer (cupti_tracer.h) stamps them on its
// clock and writes them as memory records.
#pragma once

#include <cstdint>
#include <string>

#include "ctxplan/runtime/plan/op.h"

namespace ctxplan::gpu {

class MemoryEventListener {
 public:
  virtual ~MemoryEventListener() = default;
  // `space_total_bytes`: what the allocator that raised the event has allocated in `space` after
  // it (the arena's allocated bytes, or the page store's pages in use times the page size).
  virtual void OnMemoryEvent(MemSpace space, MemCategory category, int64_t space_total_bytes) = 0;
};

// "1.50 GiB", "12.0 MiB", "256 B": for start-up tables and error messages.
std::string FormatBytes(uint64_t bytes);

}  // namespace ctxplan::gpu
