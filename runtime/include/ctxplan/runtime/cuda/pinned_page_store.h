// The host home of KV and dKV pages when offload is on, and the engine that moves pages between
// it and the GPU's page slots (DESIGN.md, "Paging and offload").
//
// PinnedPageStore. Pinned host memory (cudaHostAlloc) is reserved up front in large blocks:
// pinning costs ~0.3 s per GiB and synchronises the device, so it never happens per page or inside
// a step. Pages of one fixed size are handed out from a free list and reference-counted, in the
// style of vLLM's block manager: Allocate() gives a page with count 1, Retain() adds a holder,
// Release() drops one and returns the page to the free list at zero. A fresh store hands pages out
// in ascending order, so the pages of one chunk and layer are usually contiguous in host memory and
// their copies coalesce.
//
//   block b (pages_per_block() pages, the last block possibly fewer):
//   | page b*ppb | page b*ppb+1 | ... |      each page_bytes long, page i at
//                                            block[i / ppb] + (i % ppb) * page_bytes
//
// One store holds pages of one size; a run keeps one for KV pages and one for dKV pages (whose
// element type may differ). Pinned-allocation failure throws PinnedMemoryError; running out of
// pages throws PageStoreExhaustedError (or, with `growable`, pins one more block first).
//
// OffloadEngine. Two copy streams, H2D and D2H, each ordered after an optional event and
// signalling a returned event when its copies are done. A call takes a list of (host page, device
// slot) pairs and issues one cudaMemcpyAsync per run of pairs that are contiguous on both sides.
//
// Neither class is thread-safe: the runtime's host thread drives them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ctxplan/runtime/cuda/memory_events.h"
#include "ctxplan/runtime/plan/op.h"

namespace ctxplan::gpu {

// cudaHostAlloc failed: the host cannot pin `requested_bytes` more.
class PinnedMemoryError : public std::runtime_error {
 public:
  PinnedMemoryError(uint64_t requested_bytes, uint64_t already_pinned_bytes,
                    const std::string& cuda_error);
  uint64_t requested_bytes() const { return requested_bytes_; }
  const std::string& cuda_error() const { return cuda_error_; }

 private:
  uint64_t requested_bytes_;
  std::string cuda_error_;
};

// Every page of the store is in use and the store may not grow.
class PageStoreExhaustedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

using PageId = uint32_t;
inline constexpr PageId kNoPage = ~PageId{0};

struct PinnedPageStoreOptions {
  uint64_t page_bytes = 0;      // one page: K and V of p positions, all KV heads, one layer
  uint64_t capacity_pages = 0;  // pinned up front
  uint64_t block_bytes = uint64_t{1} << 30;  // pinned in blocks of about this size (whole pages)
  bool growable = false;  // when full, pin one more block instead of throwing (slow: avoid)
  MemCategory category = MemCategory::kKvPages;  // of the memory events it raises
};

class PinnedPageStore {
 public:
  // Pins capacity_pages pages in blocks; prints a line on `log` (nullptr: silent).
  explicit PinnedPageStore(const PinnedPageStoreOptions& options, std::ostream* log = nullptr);
  ~PinnedPageStore();
  PinnedPageStore(const PinnedPageStore&) = delete;
  PinnedPageStore& operator=(const PinnedPageStore&) = delete;

  // A free page, reference count 1.
  PageId Allocate();
  // Adds a holder / drops one; a page whose count reaches 0 is free again. Either on a free
  // page, or an id the store never handed out, throws InternalError.
  void Retain(PageId page);
  void Release(PageId page);
  uint32_t RefCount(PageId page) const;

  // The page's bytes: page_bytes() of pinned host memory, usable by cudaMemcpyAsync.
  std::byte* HostPtr(PageId page) const;
  // Whether `b`'s bytes start where `a`'s end (same block, b == a + 1).
  bool Adjacent(PageId a, PageId b) const;

  uint64_t page_bytes() const { return page_bytes_; }
  uint64_t pages_per_block() const { return pages_per_block_; }
  uint64_t capacity_pages() const { return capacity_pages_; }
  uint64_t free_pages() const { return free_.size(); }
  uint64_t pages_in_use() const { return capacity_pages_ - free_.size(); }
  uint64_t peak_pages_in_use() const { return peak_pages_in_use_; }
  uint64_t in_use_bytes() const { return pages_in_use() * page_bytes_; }
  uint64_t peak_in_use_bytes() const { return peak_pages_in_use_ * page_bytes_; }
  // Pinned now (all blocks) and at the peak (the same unless blocks were ever released: they are
  // not, so this is the high-water mark of pinning, growth included).
  uint64_t pinned_bytes() const { return pinned_bytes_; }
  uint64_t peak_pinned_bytes() const { return peak_pinned_bytes_; }
  size_t blocks() const { return blocks_.size(); }

  void SetListener(MemoryEventListener* listener) { listener_ = listener; }

 private:
  struct Block {
    std::byte* ptr = nullptr;  // cudaHostAlloc'ed
    uint64_t pages = 0;
  };
  void PinBlock(uint64_t pages);
  void CheckInUse(PageId page, const char* what) const;

  uint64_t page_bytes_ = 0;
  uint64_t pages_per_block_ = 0;
  uint64_t capacity_pages_ = 0;
  bool growable_ = false;
  MemCategory category_;
  std::ostream* log_ = nullptr;
  std::vector<Block> blocks_;
  std::vector<uint32_t> refcount_;  // indexed by PageId; block b's ids are [b*ppb, b*ppb+pages)
  std::vector<PageId> free_;        // a stack; the top is handed out next
  uint64_t peak_pages_in_use_ = 0;
  uint64_t pinned_bytes_ = 0, peak_pinned_bytes_ = 0;
  MemoryEventListener* listener_ = nullptr;
};

// The GPU side of the copies: `count` slots of `slot_bytes` each from `base` (normally the arena's
// kPageSlots buffer). slot_bytes must be at least the store's page size.
struct DeviceSlots {
  std::byte* base = nullptr;
  uint64_t slot_bytes = 0;
  uint64_t count = 0;
};

struct PageCopy {
  PageId page = kNoPage;  // host page (must be in use)
  uint64_t slot = 0;      // device slot index
};

struct CopyStats {
  uint64_t calls = 0;         // CopyIn / CopyOut calls
  uint64_t memcpy_calls = 0;  // cudaMemcpyAsync calls they issued (after coalescing)
  uint64_t pages = 0;
  uint64_t bytes = 0;
};

class OffloadEngine {
 public:
  // Creates the two non-blocking copy streams and a ring of `event_ring` events per direction
  // (created without timing: cheaper to record and wait on).
  OffloadEngine(const PinnedPageStore& store, DeviceSlots slots, int event_ring = 256);
  ~OffloadEngine();
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  // Copies each pair's host page into its device slot (CopyIn) or back (CopyOut), on the H2D /
  // D2H stream, after `after` (nullptr: no wait) completes. Pairs are sorted by host page and
  // runs contiguous in both host memory and slots go in one cudaMemcpyAsync. Returns an event
  // that completes when all of them have; it stays valid until event_ring further calls in the
  // same direction (wait on it, or copy it into cudaStreamWaitEvent, before then). An empty list
  // still orders the stream after `after` and returns an event.
  cudaEvent_t CopyIn(std::span<const PageCopy> copies, cudaEvent_t after = nullptr);
  cudaEvent_t CopyOut(std::span<const PageCopy> copies, cudaEvent_t after = nullptr);

  cudaStream_t h2d_stream() const { return streams_[0]; }
  cudaStream_t d2h_stream() const { return streams_[1]; }
  // Waits for both streams.
  void Synchronize();

  const CopyStats& h2d_stats() const { return stats_[0]; }
  const CopyStats& d2h_stats() const { return stats_[1]; }

 private:
  cudaEvent_t Copy(int direction, std::span<const PageCopy> copies, cudaEvent_t after);

  const PinnedPageStore& store_;
  DeviceSlots slots_;
  cudaStream_t streams_[2] = {nullptr, nullptr};
  std::vector<cudaEvent_t> events_[2];
  size_t next_event_[2] = {0, 0};
  CopyStats stats_[2];
  std::vector<PageCopy> scratch_;  // sorted copy of a call's pairs, reused
};

}  // namespace ctxplan::gpu
