// The GPU arena: all of a run's GPU memory in one cudaMalloc made at start, sized from the plan.
// Nothing is cudaMalloc'ed inside a step: named buffers (weights, gradients, layer inputs, ...)
// and lazily allocated ones (dKV pages, on first write) are carved out of it.
//
// Layout. The arena is one device allocation of reserved_bytes() bytes. It is split into one
// region per MemCategory (op.h), in category order, each reserved up front:
//
//   base                                                                  base + reserved_bytes()
//   | weights | grads | optimizer | layer inputs | activations | page slots | ... | grad staging |
//
// Every region starts at a multiple of kArenaAlignment (256 B) from the base and every
// allocation's size is rounded up to it, so every buffer is 256-byte aligned (cudaMalloc's base
// is). Offsets and sizes are 64-bit. A region hands out its bytes first-fit from a free list kept
// sorted by offset; a free coalesces with its free neighbours, so freeing everything leaves one
// block per region again.
//
// Accounting: allocated = sum of live allocations (rounded sizes), its peak since start (or the
// last ResetPeak), reserved = the arena's size; the device-level figure is what nvidia-smi shows
// (cudaMemGetInfo: total - free), CUDA context and libraries included. The statistics are also
// kept per category. A request a region cannot satisfy throws ArenaExhaustedError naming the
// request, its category and the region's free bytes.
//
// Not thread-safe: one host thread (the runtime's) allocates and frees.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>

#include "ctxplan/runtime/cuda/memory_events.h"
#include "ctxplan/runtime/plan/op.h"

namespace ctxplan::gpu {

inline constexpr uint64_t kArenaAlignment = 256;

constexpr uint64_t AlignUp(uint64_t bytes, uint64_t alignment = kArenaAlignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

// A request the arena cannot satisfy (its category's region has too few free bytes, or none
// contiguous). The fields name what was asked and what was left.
class ArenaExhaustedError : public std::runtime_error {
 public:
  ArenaExhaustedError(std::string request, MemCategory category, uint64_t requested_bytes,
                      uint64_t free_bytes, uint64_t largest_free_block, uint64_t reserved_bytes);
  const std::string& request() const { return request_; }
  MemCategory category() const { return category_; }
  uint64_t requested_bytes() const { return requested_bytes_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free_block() const { return largest_free_block_; }

 private:
  std::string request_;
  MemCategory category_;
  uint64_t requested_bytes_, free_bytes_, largest_free_block_;
};

// A piece of the arena. Plain value: copying it does not copy or own memory.
struct DeviceBuffer {
  std::byte* ptr = nullptr;  // device pointer = arena base + offset; nullptr for an empty buffer
  uint64_t offset = 0;       // from the arena's base; a multiple of kArenaAlignment
  uint64_t bytes = 0;        // usable size: the request rounded up to kArenaAlignment
  MemCategory category = MemCategory::kWorkspace;

  bool empty() const { return bytes == 0; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(ptr);
  }
};

struct ArenaCategoryStats {
  uint64_t reserved_bytes = 0;   // the region's size
  uint64_t allocated_bytes = 0;  // live allocations now
  uint64_t peak_allocated_bytes = 0;
  uint64_t live_allocations = 0;
  uint64_t free_bytes = 0;          // reserved - allocated
  uint64_t largest_free_block = 0;  // the biggest request that would succeed now
};

struct DeviceMemoryInfo {
  uint64_t total_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t used_bytes() const { return total_bytes - free_bytes; }  // what nvidia-smi counts
};

// cudaMemGetInfo of the current device.
DeviceMemoryInfo QueryDeviceMemory();

class DeviceArena {
 public:
  using Reservations = std::array<uint64_t, kMemCategoryCount>;  // bytes, indexed by MemCategory

  // Reserves the arena with one cudaMalloc on the current device: the sum of the reservations,
  // each rounded up to kArenaAlignment. Prints the total and each non-empty category's
  // reservation on `log` (nullptr: silent), as llm.c does. A failing cudaMalloc throws
  // kernels::CudaError naming the size and the device's free memory.
  explicit DeviceArena(const Reservations& reservations, std::ostream* log = nullptr);
  ~DeviceArena();
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  // First-fit allocation of `bytes` (rounded up to 256) in `category`'s region. `name` only
  // labels the request in an ArenaExhaustedError. Zero bytes gives an empty buffer.
  DeviceBuffer Allocate(MemCategory category, uint64_t bytes, std::string_view name);
  // Returns a buffer from Allocate(). Freeing anything else (twice, a named buffer, a
  // hand-made DeviceBuffer) throws InternalError. An empty buffer is ignored.
  void Free(const DeviceBuffer& buffer);

  // Named buffers: allocated once (usually before the first step), looked up by name, freed by
  // FreeNamed. A duplicate name or an unknown one throws InternalError.
  DeviceBuffer AllocateNamed(MemCategory category, std::string name, uint64_t bytes);
  const DeviceBuffer& Named(std::string_view name) const;
  bool HasNamed(std::string_view name) const;
  void FreeNamed(std::string_view name);

  std::byte* base() const { return base_; }
  uint64_t reserved_bytes() const { return reserved_; }
  uint64_t allocated_bytes() const { return allocated_; }
  uint64_t peak_allocated_bytes() const { return peak_allocated_; }
  ArenaCategoryStats category_stats(MemCategory category) const;
  // Where `category`'s region starts: base() + region_offset(category).
  uint64_t region_offset(MemCategory category) const { return region(category).begin; }
  // Restarts peak tracking (overall and per category) at the current allocated figures.
  void ResetPeak();

  // Device-level memory (cudaMemGetInfo; a synchronous driver call of a few microseconds, so not
  // per allocation): queries it now and folds it into the peak.
  uint64_t SampleDeviceUsed();
  uint64_t peak_device_used_bytes() const { return peak_device_used_; }

  // Receives an event after every allocation and free (not owned; nullptr: none).
  void SetListener(MemoryEventListener* listener) { listener_ = listener; }

  // The start-up table: total and per-category reservations.
  std::string Describe() const;

 private:
  struct Region {
    uint64_t begin = 0, size = 0;
    uint64_t allocated = 0, peak = 0, live = 0;
    std::map<uint64_t, uint64_t> free_blocks;  // offset -> size, sorted by offset, coalesced
  };
  Region& region(MemCategory category) { return regions_[static_cast<size_t>(category)]; }
  const Region& region(MemCategory category) const {
    return regions_[static_cast<size_t>(category)];
  }
  static uint64_t LargestFree(const Region& r);
  void Notify(MemCategory category);

  std::byte* base_ = nullptr;
  uint64_t reserved_ = 0;
  uint64_t allocated_ = 0, peak_allocated_ = 0;
  uint64_t peak_device_used_ = 0;
  std::array<Region, kMemCategoryCount> regions_{};
  std::unordered_map<uint64_t, std::pair<uint64_t, MemCategory>> live_;  // offset -> size, category
  std::map<std::string, DeviceBuffer, std::less<>> named_;
  MemoryEventListener* listener_ = nullptr;
};

}  // namespace ctxplan::gpu
