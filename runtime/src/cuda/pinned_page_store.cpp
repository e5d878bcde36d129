#include "ctxplan/runtime/cuda/pinned_page_store.h"

#include <algorithm>
#include <limits>
#include <ostream>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::gpu {

PinnedMemoryError::PinnedMemoryError(uint64_t requested_bytes, uint64_t already_pinned_bytes,
                                     const std::string& cuda_error)
    : std::runtime_error("cannot pin host memory: cudaHostAlloc(" +
                         std::to_string(requested_bytes) + " bytes, " +
                         FormatBytes(requested_bytes) + ") failed: " + cuda_error + " (" +
                         FormatBytes(already_pinned_bytes) +
                         " already pinned by this store); the host has too little RAM for the "
                         "offloaded KV/dKV pages: shorten the context, use sparse attention, or "
                         "run with offload off"),
      requested_bytes_(requested_bytes),
      cuda_error_(cuda_error) {}

PinnedPageStore::PinnedPageStore(const PinnedPageStoreOptions& options, std::ostream* log)
    : page_bytes_(options.page_bytes),
      capacity_pages_(0),
      growable_(options.growable),
      category_(options.category),
      log_(log) {
  CTXPLAN_CHECK(page_bytes_ > 0, "pinned page store: page_bytes must be positive");
  pages_per_block_ = std::max<uint64_t>(1, options.block_bytes / page_bytes_);
  // Page ids are 32-bit; keep every id (partial blocks leave gaps) representable.
  CTXPLAN_CHECK(options.capacity_pages < std::numeric_limits<PageId>::max() - pages_per_block_,
                "pinned page store: too many pages for 32-bit page ids");
  uint64_t remaining = options.capacity_pages;
  try {
    while (remaining > 0) {
      const uint64_t pages = std::min(remaining, pages_per_block_);
      PinBlock(pages);
      remaining -= pages;
    }
  } catch (...) {
    // The destructor does not run for a throwing constructor: unpin what was pinned.
    for (const Block& b : blocks_) (void)cudaFreeHost(b.ptr);
    blocks_.clear();
    throw;
  }
  if (log_)
    *log_ << "pinned " << MemCategoryName(category_) << " store: " << capacity_pages_
          << " pages of " << FormatBytes(page_bytes_) << " = " << FormatBytes(pinned_bytes_)
          << " pinned in " << blocks_.size() << " block(s)\n"
          << std::flush;
}

PinnedPageStore::~PinnedPageStore() {
  for (const Block& b : blocks_) (void)cudaFreeHost(b.ptr);
}

void PinnedPageStore::PinBlock(uint64_t pages) {
  const uint64_t bytes = pages * page_bytes_;
  void* ptr = nullptr;
  const cudaError_t status = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; keep it out of the next launch check
    throw PinnedMemoryError(
        bytes, pinned_bytes_,
        std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status));
  }
  const uint64_t first = blocks_.size() * pages_per_block_;
  blocks_.push_back({static_cast<std::byte*>(ptr), pages});
  refcount_.resize(blocks_.size() * pages_per_block_, 0);
  // The new ids go to the bottom of the free stack, in descending order, so the stack hands out
  // the pages already free first and then the new ones in ascending order. (Growth happens only
  // when the stack is empty; the constructor's blocks come in ascending order.)
  std::vector<PageId> fresh;
  fresh.reserve(pages + free_.size());
  for (uint64_t i = pages; i-- > 0;) fresh.push_back(static_cast<PageId>(first + i));
  fresh.insert(fresh.end(), free_.begin(), free_.end());
  free_.swap(fresh);
  capacity_pages_ += pages;
  pinned_bytes_ += bytes;
  peak_pinned_bytes_ = std::max(peak_pinned_bytes_, pinned_bytes_);
}

PageId PinnedPageStore::Allocate() {
  if (free_.empty()) {
    if (!growable_)
      throw PageStoreExhaustedError(
          "pinned " + std::string(MemCategoryName(category_)) + " store exhausted: all " +
          std::to_string(capacity_pages_) + " pages of " + FormatBytes(page_bytes_) + " (" +
          FormatBytes(pinned_bytes_) + " pinned) are in use; the plan under-sized it");
    PinBlock(pages_per_block_);
    if (log_)
      *log_ << "pinned " << MemCategoryName(category_) << " store grew to "
            << FormatBytes(pinned_bytes_) << "\n"
            << std::flush;
  }
  const PageId page = free_.back();
  free_.pop_back();
  refcount_[page] = 1;
  peak_pages_in_use_ = std::max(peak_pages_in_use_, pages_in_use());
  if (listener_)
    listener_->OnMemoryEvent(MemSpace::kHost, category_, static_cast<int64_t>(in_use_bytes()));
  return page;
}

void PinnedPageStore::CheckInUse(PageId page, const char* what) const {
  CTXPLAN_CHECK(page < refcount_.size() && refcount_[page] > 0,
                std::string("pinned page store: ") + what + " of page " + std::to_string(page) +
                    ", which is not in use");
}

void PinnedPageStore::Retain(PageId page) {
  CheckInUse(page, "Retain");
  ++refcount_[page];
}

void PinnedPageStore::Release(PageId page) {
  CheckInUse(page, "Release");
  if (--refcount_[page] > 0) return;
  free_.push_back(page);
  if (listener_)
    listener_->OnMemoryEvent(MemSpace::kHost, category_, static_cast<int64_t>(in_use_bytes()));
}

uint32_t PinnedPageStore::RefCount(PageId page) const {
  CTXPLAN_CHECK(page < refcount_.size(), "pinned page store: unknown page " + std::to_string(page));
  return refcount_[page];
}

std::byte* PinnedPageStore::HostPtr(PageId page) const {
  const uint64_t block = page / pages_per_block_;
  const uint64_t index = page % pages_per_block_;
  CTXPLAN_CHECK(block < blocks_.size() && index < blocks_[block].pages,
                "pinned page store: unknown page " + std::to_string(page));
  return blocks_[block].ptr + index * page_bytes_;
}

bool PinnedPageStore::Adjacent(PageId a, PageId b) const {
  return b == a + 1 && a / pages_per_block_ == b / pages_per_block_;
}

// --- OffloadEngine ----------------------------------------------------------------------------

OffloadEngine::OffloadEngine(const PinnedPageStore& store, DeviceSlots slots, int event_ring)
    : store_(store), slots_(slots) {
  CTXPLAN_CHECK(slots_.slot_bytes >= store_.page_bytes(),
                "offload engine: device slots of " + std::to_string(slots_.slot_bytes) +
                    " bytes cannot hold pages of " + std::to_string(store_.page_bytes()));
  CTXPLAN_CHECK(event_ring > 0, "offload engine: event ring must be positive");
  for (int d = 0; d < 2; ++d) {
    CTXPLAN_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[d], cudaStreamNonBlocking));
    events_[d].resize(static_cast<size_t>(event_ring), nullptr);
    for (cudaEvent_t& e : events_[d])
      CTXPLAN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
}

OffloadEngine::~OffloadEngine() {
  for (int d = 0; d < 2; ++d) {
    if (streams_[d]) (void)cudaStreamSynchronize(streams_[d]);
    for (cudaEvent_t e : events_[d])
      if (e) (void)cudaEventDestroy(e);
    if (streams_[d]) (void)cudaStreamDestroy(streams_[d]);
  }
}

cudaEvent_t OffloadEngine::CopyIn(std::span<const PageCopy> copies, cudaEvent_t after) {
  return Copy(0, copies, after);
}

cudaEvent_t OffloadEngine::CopyOut(std::span<const PageCopy> copies, cudaEvent_t after) {
  return Copy(1, copies, after);
}

cudaEvent_t OffloadEngine::Copy(int direction, std::span<const PageCopy> copies,
                                cudaEvent_t after) {
  cudaStream_t stream = streams_[direction];
  CopyStats& stats = stats_[direction];
  if (after) CTXPLAN_CUDA_CHECK(cudaStreamWaitEvent(stream, after, 0));

  scratch_.assign(copies.begin(), copies.end());
  for (const PageCopy& c : scratch_) {
    CTXPLAN_CHECK(store_.RefCount(c.page) > 0,
                  "offload engine: copy of page " + std::to_string(c.page) + ", which is free");
    CTXPLAN_CHECK(c.slot < slots_.count, "offload engine: slot " + std::to_string(c.slot) +
                                             " out of " + std::to_string(slots_.count));
  }
  std::stable_sort(scratch_.begin(), scratch_.end(),
                   [](const PageCopy& a, const PageCopy& b) { return a.page < b.page; });

  const uint64_t page_bytes = store_.page_bytes();
  // Slots are contiguous only if a slot is exactly one page long.
  const bool slots_pack = slots_.slot_bytes == page_bytes;
  const cudaMemcpyKind kind = direction == 0 ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  size_t i = 0;
  while (i < scratch_.size()) {
    size_t j = i + 1;
    while (slots_pack && j < scratch_.size() &&
           store_.Adjacent(scratch_[j - 1].page, scratch_[j].page) &&
           scratch_[j].slot == scratch_[j - 1].slot + 1)
      ++j;
    const uint64_t bytes = (j - i) * page_bytes;
    std::byte* host = store_.HostPtr(scratch_[i].page);
    std::byte* device = slots_.base + scratch_[i].slot * slots_.slot_bytes;
    if (direction == 0)
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(device, host, bytes, kind, stream));
    else
      CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, kind, stream));
    ++stats.memcpy_calls;
    stats.bytes += bytes;
    i = j;
  }
  stats.pages += scratch_.size();
  ++stats.calls;

  std::vector<cudaEvent_t>& ring = events_[direction];
  cudaEvent_t done = ring[next_event_[direction]];
  next_event_[direction] = (next_event_[direction] + 1) % ring.size();
  CTXPLAN_CUDA_CHECK(cudaEventRecord(done, stream));
  return done;
}

void OffloadEngine::Synchronize() {
  for (cudaStream_t s : streams_) CTXPLAN_CUDA_CHECK(cudaStreamSynchronize(s));
}

}  // namespace ctxplan::gpu
