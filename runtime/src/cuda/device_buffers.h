// The CUDA backend's memory: typed views of the one GPU arena, asked for while the backend is
// built and carved out together (ArenaPlan), and pinned host arrays.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cuda/device_arena.h"
#include "ctxplan/runtime/plan/op.h"

namespace ctxplan::gpu {

// A typed piece of the GPU arena. The backend asks for every buffer while it is built (Want), then
// carves them all out of one DeviceArena (Commit): one cudaMalloc, sized up front, printed at
// start; nothing is allocated inside a step.
template <typename T>
class DeviceArray {
 public:
  using value_type = T;
  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }

 private:
  friend class ArenaPlan;
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

class ArenaPlan {
 public:
  template <typename T>
  void Want(DeviceArray<T>& array, size_t n, MemCategory category, const char* name) {
    array.n_ = n;
    array.ptr_ = nullptr;
    requests_.push_back({reinterpret_cast<void**>(&array.ptr_), n * sizeof(T), category, name});
  }

  // Bytes reserved beyond the arrays' (a fault injection's oversized request).
  void ReserveExtra(uint64_t bytes, MemCategory category) {
    extra_bytes_ = bytes;
    extra_category_ = category;
  }

  // Reserves the arena for everything asked for and points every array into it. The arrays must
  // not have moved since Want.
  std::unique_ptr<gpu::DeviceArena> Commit(std::ostream* log) {
    gpu::DeviceArena::Reservations reservations{};
    for (const Request& r : requests_)
      reservations[static_cast<size_t>(r.category)] += gpu::AlignUp(r.bytes);
    reservations[static_cast<size_t>(extra_category_)] += gpu::AlignUp(extra_bytes_);
    auto arena = std::make_unique<gpu::DeviceArena>(reservations, log);
    for (const Request& r : requests_) *r.slot = arena->Allocate(r.category, r.bytes, r.name).ptr;
    requests_.clear();
    return arena;
  }

 private:
  struct Request {
    void** slot;
    uint64_t bytes;
    MemCategory category;
    const char* name;
  };
  std::vector<Request> requests_;
  uint64_t extra_bytes_ = 0;
  MemCategory extra_category_ = MemCategory::kWorkspace;
};

// Pinned host memory: the home of offloaded pages and the staging of small tables.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;
  PinnedArray(PinnedArray&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  ~PinnedArray() {
    if (ptr_) cudaFreeHost(ptr_);
  }
  void Resize(size_t n) {
    if (ptr_) CTXPLAN_CUDA_CHECK(cudaFreeHost(ptr_));
    ptr_ = nullptr;
    n_ = n;
    if (n > 0) {
      const cudaError_t status =
          cudaHostAlloc(reinterpret_cast<void**>(&ptr_), n * sizeof(T), cudaHostAllocDefault);
      if (status != cudaSuccess)
        throw TrainingError("pinning " + std::to_string(n * sizeof(T)) +
                            " bytes of host memory failed: " + cudaGetErrorString(status));
    }
  }
  T* get() const { return ptr_; }
  size_t size() const { return n_; }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

}  // namespace ctxplan::gpu
