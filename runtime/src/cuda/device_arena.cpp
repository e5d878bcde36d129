#include "ctxplan/runtime/cuda/device_arena.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <ostream>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::gpu {

std::string FormatBytes(uint64_t bytes) {
  char text[64];
  const double b = static_cast<double>(bytes);
  if (bytes >= (uint64_t{1} << 30))
    std::snprintf(text, sizeof text, "%.2f GiB", b / 1073741824.0);
  else if (bytes >= (uint64_t{1} << 20))
    std::snprintf(text, sizeof text, "%.1f MiB", b / 1048576.0);
  else if (bytes >= (uint64_t{1} << 10))
    std::snprintf(text, sizeof text, "%.1f KiB", b / 1024.0);
  else
    std::snprintf(text, sizeof text, "%llu B", static_cast<unsigned long long>(bytes));
  return text;
}

ArenaExhaustedError::ArenaExhaustedError(std::string request, MemCategory category,
                                         uint64_t requested_bytes, uint64_t free_bytes,
                                         uint64_t largest_free_block, uint64_t reserved_bytes)
    : std::runtime_error(
          "GPU arena exhausted: '" + request + "' asks for " + std::to_string(requested_bytes) +
          " bytes (" + FormatBytes(requested_bytes) + ") of category " +
          std::string(MemCategoryName(category)) + ", which has " + std::to_string(free_bytes) +
          " bytes free (" + FormatBytes(free_bytes) + ") of " + FormatBytes(reserved_bytes) +
          " reserved, the largest free block " + std::to_string(largest_free_block) +
          " bytes; the plan under-sized this category (or the run leaks its buffers)"),
      request_(std::move(request)),
      category_(category),
      requested_bytes_(requested_bytes),
      free_bytes_(free_bytes),
      largest_free_block_(largest_free_block) {}

DeviceMemoryInfo QueryDeviceMemory() {
  size_t free = 0, total = 0;
  CTXPLAN_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return {static_cast<uint64_t>(total), static_cast<uint64_t>(free)};
}

DeviceArena::DeviceArena(const Reservations& reservations, std::ostream* log) {
  uint64_t offset = 0;
  for (size_t c = 0; c < regions_.size(); ++c) {
    Region& r = regions_[c];
    r.begin = offset;
    r.size = AlignUp(reservations[c]);
    if (r.size > 0) r.free_blocks.emplace(r.begin, r.size);
    offset += r.size;
  }
  reserved_ = offset;
  if (reserved_ > 0) {
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, reserved_);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky; keep it out of the next launch check
      size_t free = 0, total = 0;
      const bool have_info = cudaMemGetInfo(&free, &total) == cudaSuccess;
      throw kernels::CudaError(
          "cannot reserve the GPU arena: cudaMalloc(" + std::to_string(reserved_) + " bytes, " +
          FormatBytes(reserved_) + ") failed: " + cudaGetErrorName(status) + ": " +
          cudaGetErrorString(status) +
          (have_info ? "; the device has " + FormatBytes(free) + " free of " + FormatBytes(total)
                     : std::string()));
    }
    base_ = static_cast<std::byte*>(ptr);
  }
  SampleDeviceUsed();
  if (log) *log << Describe() << std::flush;
}

DeviceArena::~DeviceArena() {
  if (base_) (void)cudaFree(base_);  // never throws; an error here has nobody to report to
}

uint64_t DeviceArena::LargestFree(const Region& r) {
  uint64_t largest = 0;
  for (const auto& [offset, size] : r.free_blocks) largest = std::max(largest, size);
  return largest;
}

void DeviceArena::Notify(MemCategory category) {
  if (listener_)
    listener_->OnMemoryEvent(MemSpace::kGpu, category, static_cast<int64_t>(allocated_));
}

DeviceBuffer DeviceArena::Allocate(MemCategory category, uint64_t bytes, std::string_view name) {
  CTXPLAN_CHECK(static_cast<int>(category) < kMemCategoryCount, "bad memory category");
  DeviceBuffer buffer;
  buffer.category = category;
  if (bytes == 0) return buffer;
  const uint64_t size = AlignUp(bytes);
  Region& r = region(category);
  auto it = r.free_blocks.begin();
  while (it != r.free_blocks.end() && it->second < size) ++it;
  if (it == r.free_blocks.end())
    throw ArenaExhaustedError(std::string(name), category, bytes, r.size - r.allocated,
                              LargestFree(r), r.size);
  const uint64_t offset = it->first;
  const uint64_t block = it->second;
  r.free_blocks.erase(it);
  if (block > size) r.free_blocks.emplace(offset + size, block - size);

  r.allocated += size;
  r.peak = std::max(r.peak, r.allocated);
  ++r.live;
  allocated_ += size;
  peak_allocated_ = std::max(peak_allocated_, allocated_);
  live_.emplace(offset, std::make_pair(size, category));

  buffer.ptr = base_ + offset;
  buffer.offset = offset;
  buffer.bytes = size;
  Notify(category);
  return buffer;
}

void DeviceArena::Free(const DeviceBuffer& buffer) {
  if (buffer.empty()) return;
  const auto live = live_.find(buffer.offset);
  CTXPLAN_CHECK(live != live_.end() && buffer.ptr == base_ + buffer.offset &&
                    live->second.first == buffer.bytes && live->second.second == buffer.category,
                "DeviceArena::Free of a buffer it did not hand out (freed twice?) at offset " +
                    std::to_string(buffer.offset));
  live_.erase(live);
  Region& r = region(buffer.category);
  uint64_t offset = buffer.offset;
  uint64_t size = buffer.bytes;
  // Coalesce with the free block after, then with the one before.
  auto next = r.free_blocks.lower_bound(offset);
  if (next != r.free_blocks.end() && offset + size == next->first) {
    size += next->second;
    next = r.free_blocks.erase(next);
  }
  if (next != r.free_blocks.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      r.free_blocks.erase(prev);
    }
  }
  r.free_blocks.emplace(offset, size);
  r.allocated -= buffer.bytes;
  --r.live;
  allocated_ -= buffer.bytes;
  Notify(buffer.category);
}

DeviceBuffer DeviceArena::AllocateNamed(MemCategory category, std::string name, uint64_t bytes) {
  CTXPLAN_CHECK(!named_.contains(name), "arena buffer '" + name + "' allocated twice");
  DeviceBuffer buffer = Allocate(category, bytes, name);
  named_.emplace(std::move(name), buffer);
  return buffer;
}

const DeviceBuffer& DeviceArena::Named(std::string_view name) const {
  const auto it = named_.find(name);
  CTXPLAN_CHECK(it != named_.end(), "no arena buffer named '" + std::string(name) + "'");
  return it->second;
}

bool DeviceArena::HasNamed(std::string_view name) const {
  return named_.find(name) != named_.end();
}

void DeviceArena::FreeNamed(std::string_view name) {
  const auto it = named_.find(name);
  CTXPLAN_CHECK(it != named_.end(), "no arena buffer named '" + std::string(name) + "'");
  Free(it->second);
  named_.erase(it);
}

ArenaCategoryStats DeviceArena::category_stats(MemCategory category) const {
  const Region& r = region(category);
  ArenaCategoryStats s;
  s.reserved_bytes = r.size;
  s.allocated_bytes = r.allocated;
  s.peak_allocated_bytes = r.peak;
  s.live_allocations = r.live;
  s.free_bytes = r.size - r.allocated;
  s.largest_free_block = LargestFree(r);
  return s;
}

void DeviceArena::ResetPeak() {
  peak_allocated_ = allocated_;
  for (Region& r : regions_) r.peak = r.allocated;
}

uint64_t DeviceArena::SampleDeviceUsed() {
  const uint64_t used = QueryDeviceMemory().used_bytes();
  peak_device_used_ = std::max(peak_device_used_, used);
  return used;
}

std::string DeviceArena::Describe() const {
  std::string out = "GPU arena: " + FormatBytes(reserved_) + " (" + std::to_string(reserved_) +
                    " bytes) reserved in one cudaMalloc\n";
  char line[160];
  for (size_t c = 0; c < regions_.size(); ++c) {
    const Region& r = regions_[c];
    if (r.size == 0) continue;
    std::snprintf(line, sizeof line, "  %-15s %12s  (%llu bytes at offset %llu)\n",
                  std::string(MemCategoryName(static_cast<MemCategory>(c))).c_str(),
                  FormatBytes(r.size).c_str(), static_cast<unsigned long long>(r.size),
                  static_cast<unsigned long long>(r.begin));
    out += line;
  }
  return out;
}

}  // namespace ctxplan::gpu
