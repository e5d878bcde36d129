// Offload: KV and dKV pages between their pinned host homes (PinnedPageStore) and the GPU's
// slots. CopyIn stages a layer's union of attended pages, and in the backward its dKV, on the H2D
// stream; CopyOut sends the fill's fresh KV and the accumulated dKV home on the D2H stream. With
// the GPU tier only the host tier's pages move. The host optimizer's gradients and weights cross
// on the same two ops.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "cuda_backend_impl.h"

namespace ctxplan::cuda_backend_detail {

template <typename G>
void TypedImpl<G>::CopyIn(const Op& op) {
  if (op.phase == Phase::kOptimizer) {  // the host optimizer's new weights
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(Region(MemCategory::kWeights), host_weights_.get(),
                                       host_weights_.size() * sizeof(bf16), cudaMemcpyHostToDevice,
                                       h2d_));
    return;
  }
  if (tier_pages_ > 0) return CopyInTiered(op);
  const auto l = static_cast<size_t>(op.layer);
  union_ = UnionPages(op);
  // The host staging of this parity's table was last read by a copy two layers ago: it must
  // have finished before the host rewrites the table.
  const OpId previous = table_user_[parity_];
  if (previous != kNoOp && event_op_[previous % kEventRing] == previous)
    HostWait(events_[previous % kEventRing]);
  table_user_[parity_] = op.id;
  int32_t* table = slot_table_host_[parity_].get();
  std::fill(table, table + std::max<int64_t>(c_.earlier_pages, 0), -1);
  for (size_t j = 0; j < union_.size(); ++j) table[union_[j]] = static_cast<int32_t>(j);
  if (c_.earlier_pages > 0)
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(slot_table_[parity_].get(), table,
                                       static_cast<size_t>(c_.earlier_pages) * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, h2d_));
  StageUnionKv(l, reinterpret_cast<std::byte*>(kv_slots_[parity_].get()));
  if (op.phase != Phase::kBackward) return;

  StageDkv(l, reinterpret_cast<std::byte*>(dkv_slots_[parity_].get()),
           reinterpret_cast<std::byte*>(own_dkv_slots_[parity_].get()));
}

// CopyIn with the GPU tier: the layer's table maps each attended page to its tier page or to a
// union slot; only the host tier's pages (union_) and the host tier's own dKV come in.
template <typename G>
void TypedImpl<G>::CopyInTiered(const Op& op) {
  const auto l = static_cast<size_t>(op.layer);
  const std::vector<int32_t> attended = UnionPages(op);
  const OpId previous = table_user_[parity_];
  if (previous != kNoOp && event_op_[previous % kEventRing] == previous)
    HostWait(events_[previous % kEventRing]);
  table_user_[parity_] = op.id;
  table_staged_[parity_] = layer_key_;
  int32_t* table = slot_table_host_[parity_].get();
  std::fill(table, table + std::max<int64_t>(c_.earlier_pages, 0), -1);
  union_.clear();
  for (const int32_t page : attended) {
    if (page < tier_pages_) {
      table[page] = static_cast<int32_t>(TierBase(op.layer) + page);
    } else {
      table[page] =
          static_cast<int32_t>(UnionSlotBase(parity_) + static_cast<int64_t>(union_.size()));
      union_.push_back(page);
    }
  }
  CTXPLAN_CHECK(static_cast<int64_t>(union_.size()) <= host_slot_capacity_,
                "CUDA backend: the host tier's union of chunk " + std::to_string(c_.index) +
                    " layer " + std::to_string(l) + " exceeds its slots");
  if (c_.earlier_pages > 0)
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(slot_table_[parity_].get(), table,
                                       static_cast<size_t>(c_.earlier_pages) * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, h2d_));
  StageUnionKv(l, reinterpret_cast<std::byte*>(tier_kv_pool_.get()) +
                      static_cast<size_t>(UnionSlotBase(parity_) * pe_) * sizeof(bf16));
  if (op.phase != Phase::kBackward) return;

  auto* pool = reinterpret_cast<std::byte*>(tier_dkv_pool_.get());
  const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
  StageDkv(l, pool + static_cast<size_t>(UnionSlotBase(parity_)) * dkv_bytes,
           pool + static_cast<size_t>(OwnSlotBase(parity_)) * dkv_bytes);
}

// The union's host pages (union_) of layer `l` into consecutive slots from `slots`.
template <typename G>
void TypedImpl<G>::StageUnionKv(size_t l, std::byte* slots) {
  const size_t kv_bytes = static_cast<size_t>(pe_) * sizeof(bf16);
  pairs_.clear();
  for (size_t j = 0; j < union_.size(); ++j) {
    const gpu::PageId home = kv_page_[l][static_cast<size_t>(union_[j])];
    CTXPLAN_CHECK(home != gpu::kNoPage, "CUDA backend: KV page " + std::to_string(union_[j]) +
                                            " of layer " + std::to_string(l) +
                                            " is read before the fill wrote it home");
    pairs_.push_back({slots + j * kv_bytes, kv_store_->HostPtr(home)});
  }
  CopyRuns(pairs_, kv_bytes, h2d_);
}

// dKV: the union's host pages written earlier this step come in, the others start at zero;
// then the same for the chunk's own pages (own page j into own slot j). Pages of the GPU tier
// accumulate in place and are skipped.
template <typename G>
void TypedImpl<G>::StageDkv(size_t l, std::byte* union_slots, std::byte* own_slots) {
  const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
  for (int own = 0; own < 2; ++own) {
    std::byte* slots = own ? own_slots : union_slots;
    const size_t count = own ? static_cast<size_t>(c_.own_pages) : union_.size();
    pairs_.clear();
    zero_.clear();
    for (size_t j = 0; j < count; ++j) {
      const int64_t page = own ? c_.earlier_pages + static_cast<int64_t>(j) : union_[j];
      if (page < tier_pages_) continue;
      const gpu::PageId home = dkv_page_[l][static_cast<size_t>(page)];
      if (home == gpu::kNoPage)
        zero_.push_back(static_cast<int64_t>(j));
      else
        pairs_.push_back({slots + j * dkv_bytes, dkv_store_->HostPtr(home)});
    }
    ZeroSlots(slots, zero_, dkv_bytes, h2d_);
    CopyRuns(pairs_, dkv_bytes, h2d_);
  }
}

// Fresh dKV slots are zeroed when the backward's copy stages the union.
template <typename G>
void TypedImpl<G>::ZeroFill(const Op&) {}

template <typename G>
void TypedImpl<G>::CopyOut(const Op& op) {
  if (op.phase == Phase::kOptimizer) {  // the gradients go home to the host optimizer
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(host_grads_.get(), Region(MemCategory::kGrads),
                                       host_grads_.size() * sizeof(G), cudaMemcpyDeviceToHost,
                                       d2h_));
    return;
  }
  if (tier_pages_ > 0) return CopyOutTiered(op);
  const auto l = static_cast<size_t>(op.layer);
  pairs_.clear();
  if (op.phase == Phase::kFill) {  // the chunk's fresh KV pages go home
    const size_t kv_bytes = static_cast<size_t>(pe_) * sizeof(bf16);
    auto* slots = reinterpret_cast<std::byte*>(own_kv_slots_[own_parity_].get());
    for (int64_t j = 0; j < c_.own_pages; ++j) {
      gpu::PageId& home = kv_page_[l][static_cast<size_t>(c_.earlier_pages + j)];
      if (home == gpu::kNoPage) home = kv_store_->Allocate();  // kept for every later step
      pairs_.push_back({kv_store_->HostPtr(home), slots + static_cast<size_t>(j) * kv_bytes});
    }
    CopyRuns(pairs_, kv_bytes, d2h_);
    return;
  }
  const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
  auto* slots = reinterpret_cast<std::byte*>(dkv_slots_[parity_].get());
  for (size_t j = 0; j < union_.size(); ++j)
    pairs_.push_back({dkv_store_->HostPtr(DkvHome(l, union_[j])), slots + j * dkv_bytes});
  CopyRuns(pairs_, dkv_bytes, d2h_);
}

// CopyOut with the GPU tier: the host tier's fresh KV (fill) and accumulated dKV go home.
template <typename G>
void TypedImpl<G>::CopyOutTiered(const Op& op) {
  const auto l = static_cast<size_t>(op.layer);
  pairs_.clear();
  if (op.phase == Phase::kFill) {
    const size_t kv_bytes = static_cast<size_t>(pe_) * sizeof(bf16);
    auto* slots = reinterpret_cast<std::byte*>(tier_kv_pool_.get()) +
                  static_cast<size_t>(OwnSlotBase(own_parity_)) * kv_bytes;
    for (int64_t j = 0; j < c_.own_pages; ++j) {
      const int64_t page = c_.earlier_pages + j;
      if (page < tier_pages_) continue;  // written in place in the tier
      gpu::PageId& home = kv_page_[l][static_cast<size_t>(page)];
      if (home == gpu::kNoPage) home = kv_store_->Allocate();  // kept for every later step
      pairs_.push_back({kv_store_->HostPtr(home), slots + static_cast<size_t>(j) * kv_bytes});
    }
    CopyRuns(pairs_, kv_bytes, d2h_);
    return;
  }
  const size_t dkv_bytes = static_cast<size_t>(pe_) * sizeof(G);
  auto* slots = reinterpret_cast<std::byte*>(tier_dkv_pool_.get()) +
                static_cast<size_t>(UnionSlotBase(parity_)) * dkv_bytes;
  for (size_t j = 0; j < union_.size(); ++j)
    pairs_.push_back({dkv_store_->HostPtr(DkvHome(l, union_[j])), slots + j * dkv_bytes});
  CopyRuns(pairs_, dkv_bytes, d2h_);
}

// The host page of dKV page `page` of layer `l`, allocated on its first write of the step.
template <typename G>
gpu::PageId TypedImpl<G>::DkvHome(size_t l, int64_t page) {
  gpu::PageId& home = dkv_page_[l][static_cast<size_t>(page)];
  if (home == gpu::kNoPage) {
    home = dkv_store_->Allocate();
    dkv_allocated_.push_back(home);
  }
  return home;
}

// One copy per run of pages that are contiguous on both sides, the runs issued as one batch.
template <typename G>
void TypedImpl<G>::CopyRuns(const std::vector<PagePair>& pairs, size_t page_bytes,
                            cudaStream_t stream) {
  copy_batch_.Clear();
  size_t i = 0;
  while (i < pairs.size()) {
    size_t run = 1;
    while (i + run < pairs.size() && pairs[i + run].dst == pairs[i].dst + run * page_bytes &&
           pairs[i + run].src == pairs[i].src + run * page_bytes)
      ++run;
    copy_batch_.Add(pairs[i].dst, pairs[i].src, run * page_bytes);
    i += run;
  }
  if (freed_device_memory_ != nullptr && stream == d2h_ && copy_batch_.size() > 0) {
    // copy-error: the first copy home reads a freed device block instead of its slot (named a
    // device address, so the copy engine, not the host, reads it).
    const void* freed = std::exchange(freed_device_memory_, nullptr);
    CTXPLAN_CUDA_CHECK(cudaMemcpyAsync(copy_batch_.dsts[0], freed,
                                       std::min(copy_batch_.sizes[0], kFreedBytes),
                                       cudaMemcpyDeviceToHost, stream));
  }
  gpu::IssueCopyBatch(copy_batch_, stream);
}

// Zeroes the slots listed (ascending), one memset per run of consecutive slots.
template <typename G>
void TypedImpl<G>::ZeroSlots(std::byte* base, const std::vector<int64_t>& slots, size_t slot_bytes,
                             cudaStream_t stream) {
  size_t i = 0;
  while (i < slots.size()) {
    size_t run = 1;
    while (i + run < slots.size() && slots[i + run] == slots[i] + static_cast<int64_t>(run)) ++run;
    CTXPLAN_CUDA_CHECK(cudaMemsetAsync(base + static_cast<size_t>(slots[i]) * slot_bytes, 0,
                                       run * slot_bytes, stream));
    i += run;
  }
}

template class TypedImpl<float>;
template class TypedImpl<bf16>;

}  // namespace ctxplan::cuda_backend_detail
