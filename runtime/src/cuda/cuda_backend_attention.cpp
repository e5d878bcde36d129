// Attention over paged KV: the chunk's own pages written and summarised, the earlier pages scored
// and selected (page-sparse), attention forward and backward, and where each kernel finds the
// pages: in the device stores, in the offload's GPU slots, or in the GPU tier.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/sm_copy.h"
#include "cuda_backend_impl.h"

namespace ctxplan::cuda_backend_detail {

template <typename G>
void TypedImpl<G>::KvWrite(const Op& op) {
  PagedKv<bf16> own = OwnKv(op.layer);
  k::KvWrite(k_.get(), v_.get(), kv_dim_, T(), own, compute_);
}

template <typename G>
void TypedImpl<G>::PageSummary(const Op& op) {
  PagedKv<bf16> own = OwnKv(op.layer);
  k::PageSummary(PagedKv<const bf16>{own.shape, own.pool, own.page_slot, own.num_pages},
                 summaries_[static_cast<size_t>(op.layer)].get() + c_.earlier_pages * kv_dim_,
                 compute_);
}

template <typename G>
void TypedImpl<G>::PageScore(const Op& op) {
  k::PageScore(q_.get(), T(), m_.num_attention_heads, m_.num_key_value_heads, m_.head_dim,
               o_.query_tile, summaries_[static_cast<size_t>(op.layer)].get(), c_.earlier_pages,
               scores_.get(), score_ws_.get(), score_ws_.bytes(), compute_);
}

template <typename G>
void TypedImpl<G>::PageTopK(const Op& op) {
  pages_per_tile_ = k::PageTopK(scores_.get(), c_.tiles, c_.earlier_pages, o_.page_budget,
                                o_.sink_pages, selected_.get(), compute_);
  const size_t n = static_cast<size_t>(c_.tiles * pages_per_tile_);
  // The union's copies are issued from the host: the selections, written straight into
  // pinned memory (sm_copy.h: not queued on a copy engine behind the offload copies), and a
  // short sync. The backward's copy is queued before the sync: after it, it would wait for the
  // host to wake (the op's span was 25-58 us in recompute against 8 us in the fill).
  gpu::CopyBySms(selected_.get(), selected_host_.get(), static_cast<int64_t>(n), compute_);
  if (Saves(op))
    gpu::CopyBySms(selected_.get(), saved_selection_[S(op)].get(), static_cast<int64_t>(n),
                   compute_);
  HostWait(compute_);
  selection_host_.assign(selected_host_.get(), selected_host_.get() + n);
  if (Saves(op)) saved_selection_host_[S(op)] = selection_host_;
  selected_union_ = AttendedPages(c_, selection_host_);
  page_unions_.push_back(
      {op.phase, op.chunk, op.layer, static_cast<int64_t>(selected_union_.size())});
}

template <typename G>
PageSelection TypedImpl<G>::Selection(const Op& op) const {
  PageSelection s;
  s.query_tile = o_.query_tile;
  if (c_.sparse) {
    s.pages_per_tile = std::min(c_.earlier_pages, o_.page_budget + o_.sink_pages);
    s.pages = op.phase == Phase::kBackward ? saved_selection_[S(op)].get() : selected_.get();
  }
  return s;
}

// The pages the tiles' selections of `op`'s layer attend, at most the slots the plan provisioned
// (the staging copies and the backward's key-block launch both rely on that bound).
template <typename G>
std::vector<int32_t> TypedImpl<G>::UnionPages(const Op& op) const {
  // A sparse forward's union was taken when its selections came back (PageTopK).
  std::vector<int32_t> pages = op.phase == Phase::kBackward
                                   ? AttendedPages(c_, saved_selection_host_[S(op)])
                               : c_.sparse ? selected_union_
                                           : AttendedPages(c_, selection_host_);
  if (static_cast<int64_t>(pages.size()) > slot_capacity_)
    throw InputError("page selections of chunk " + std::to_string(c_.index) + " layer " +
                     std::to_string(op.layer) + " need " + std::to_string(pages.size()) +
                     " page slots but the plan provisioned " + std::to_string(slot_capacity_) +
                     "; accepted: a selection model that bounds the union (--selection "
                     "disjoint)");
  return pages;
}

template <typename G>
void TypedImpl<G>::AttentionForward(const Op& op) {
  if (!IsLastAttentionOp(op, c_)) return;
  if (c_.earlier_pages > 0) page_reads_.Add(op.layer, UnionPages(op));
  attn_ptr_ = Saves(op) ? saved_attn_[S(op)].get() : attn_.get();
  float* lse = Saves(op) ? saved_lse_[S(op)].get() : lse_.get();
  PagedKv<bf16> e = Earlier<bf16>(op.layer, false);
  k::AttentionForward(Shape(), q_.get(), k_.get(), v_.get(),
                      PagedKv<const bf16>{e.shape, e.pool, e.page_slot, e.num_pages}, Selection(op),
                      attn_ptr_, lse, compute_);
}

template <typename G>
void TypedImpl<G>::AttentionBackward(const Op& op) {
  if (!IsLastAttentionOp(op, c_)) return;
  const std::vector<int32_t> pages = c_.earlier_pages > 0 ? UnionPages(op) : std::vector<int32_t>{};
  page_reads_.Add(op.layer, pages);
  PagedKv<bf16> e = Earlier<bf16>(op.layer, false);
  PagedKv<G> de = Earlier<G>(op.layer, true);
  PageSelection selection = Selection(op);
  if (c_.sparse) {
    // The backward launches key blocks over the union of the tiles' selections only. Its
    // pinned staging was last read by the copy two layers ago: wait for that before rewriting.
    HostWait(union_copied_[parity_]);
    std::copy(pages.begin(), pages.end(), union_host_[parity_].get());
    gpu::CopyBySms(union_host_[parity_].get(), union_dev_[parity_].get(),
                   static_cast<int64_t>(pages.size()), compute_);
    CTXPLAN_CUDA_CHECK(cudaEventRecord(union_copied_[parity_], compute_));
    selection.union_pages = union_dev_[parity_].get();
    selection.num_union_pages = static_cast<int64_t>(pages.size());
  }
  // The layer's DkvAccumulate, fused: dK/dV of the own positions come out with what later
  // chunks left in their pages already added.
  own_dkv_added_layer_ = -1;
  PagedKv<const G> own_dkv{};
  if (op.adds_own_dkv) {
    const PagedKv<G> own = OwnDkv(op.layer);
    own_dkv = {own.shape, own.pool, own.page_slot, own.num_pages};
    own_dkv_added_layer_ = op.layer;
  }
  k::AttentionBackward(Shape(), q_.get(), k_.get(), v_.get(),
                       PagedKv<const bf16>{e.shape, e.pool, e.page_slot, e.num_pages}, selection,
                       saved_attn_[S(op)].get(), saved_lse_[S(op)].get(), d_attn_.get(), dq_.get(),
                       dk_.get(), dv_.get(), de, attention_ws_.get(), attention_ws_.bytes(),
                       compute_, op.adds_own_dkv ? &own_dkv : nullptr);
}

template <typename G>
void TypedImpl<G>::DkvAccumulate(const Op& op) {
  if (own_dkv_added_layer_ == op.layer) return;  // done by the attention backward
  PagedKv<G> own = OwnDkv(op.layer);
  k::DkvAccumulate(PagedKv<const G>{own.shape, own.pool, own.page_slot, own.num_pages}, T(),
                   dk_.get(), dv_.get(), kv_dim_, compute_);
}

// --- pages -------------------------------------------------------------------------------
template <typename G>
PagedKv<bf16> TypedImpl<G>::OwnKv(int32_t layer) {
  PagedKv<bf16> p;
  p.shape = shape_;
  p.num_pages = c_.own_pages;
  if (tier_pages_ > 0) {
    p.pool = tier_kv_pool_.get();
    p.page_slot = OwnTable(layer, own_parity_);
  } else if (o_.offload) {
    p.pool = own_kv_slots_[own_parity_].get();
    p.page_slot = own_identity_.get();
  } else {
    p.pool = device_kv_[static_cast<size_t>(layer)].get() + c_.earlier_pages * pe_;
    p.page_slot = own_identity_.get();
  }
  return p;
}

template <typename G>
PagedKv<G> TypedImpl<G>::OwnDkv(int32_t layer) {
  PagedKv<G> p;
  p.shape = shape_;
  p.num_pages = c_.own_pages;
  p.page_slot = own_identity_.get();
  p.pool = o_.offload ? own_dkv_slots_[parity_].get()
                      : device_dkv_[static_cast<size_t>(layer)].get() + c_.earlier_pages * pe_;
  if (tier_pages_ > 0) {
    p.pool = tier_dkv_pool_.get();
    p.page_slot = OwnTable(layer, parity_);
  }
  return p;
}

// The chunk's own pages in the pool, for `layer` on the buffers of `parity`: the tier's pages
// in place, the others in the own slots. Filled by a kernel on the compute stream, where every
// op that reads it runs.
template <typename G>
const int32_t* TypedImpl<G>::OwnTable(int32_t layer, int parity) {
  const std::array<int32_t, 3> key{c_.index, layer, parity};
  if (own_table_staged_[parity] != key) {
    own_table_staged_[parity] = key;
    gpu::FillPageTable(tier_own_table_[parity].get(), c_.own_pages, c_.earlier_pages, tier_pages_,
                       TierBase(layer), OwnSlotBase(parity), compute_);
  }
  return tier_own_table_[parity].get();
}

// The earlier pages of `layer` in the pool: the layer's copy in wrote the parity's table
// (CopyIn). A layer whose pages are all in the tier has no copy; its table is filled on the
// compute stream into a table of its own. Not into the parity's: the H2D stream may already be
// writing that one for a later layer's copy, which the plan orders after the last layer that
// copied, not after this one.
template <typename G>
template <typename T>
PagedKv<T> TypedImpl<G>::EarlierInTier(int32_t layer, bool dkv) {
  const int32_t* table = slot_table_[parity_].get();
  if (table_staged_[parity_] != layer_key_) {
    CTXPLAN_CHECK(c_.earlier_pages <= tier_pages_,
                  "CUDA backend: a layer with pages in the host tier attended before its copy");
    if (tier_table_staged_ != layer_key_) {
      tier_table_staged_ = layer_key_;
      gpu::FillPageTable(tier_table_.get(), c_.earlier_pages, 0, tier_pages_, TierBase(layer), 0,
                         compute_);
    }
    table = tier_table_.get();
  }
  PagedKv<T> p;
  p.shape = shape_;
  p.num_pages = c_.earlier_pages;
  p.pool = reinterpret_cast<T*>(dkv ? static_cast<void*>(tier_dkv_pool_.get())
                                    : static_cast<void*>(tier_kv_pool_.get()));
  p.page_slot = table;
  return p;
}

template <typename G>
template <typename T>
PagedKv<T> TypedImpl<G>::Earlier(int32_t layer, bool dkv) {
  if (tier_pages_ > 0) return EarlierInTier<T>(layer, dkv);
  PagedKv<T> p;
  p.shape = shape_;
  p.num_pages = c_.earlier_pages;
  if (o_.offload) {
    p.pool = reinterpret_cast<T*>(dkv ? static_cast<void*>(dkv_slots_[parity_].get())
                                      : static_cast<void*>(kv_slots_[parity_].get()));
    p.page_slot = slot_table_[parity_].get();
  } else {
    p.pool = reinterpret_cast<T*>(
        dkv ? static_cast<void*>(device_dkv_[static_cast<size_t>(layer)].get())
            : static_cast<void*>(device_kv_[static_cast<size_t>(layer)].get()));
    p.page_slot = identity_.get();
  }
  return p;
}

template class TypedImpl<float>;
template class TypedImpl<bf16>;

}  // namespace ctxplan::cuda_backend_detail
