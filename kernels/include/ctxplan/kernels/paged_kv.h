// The layout of the paged KV and dKV stores, shared by the CPU references and the CUDA kernels.
//
// A page holds K and V of `page_tokens` consecutive positions for ONE layer and all KV heads:
//   page [2][page_tokens][num_kv_heads][head_dim]   (index 0 = K, 1 = V), row-major.
// Pages live in a pool of slots; a page table maps a logical page (position / page_tokens) to its
// slot. Offsets are 64-bit: a pool of many GiB is normal. dKV pages have the same layout in the
// gradient dtype. K is stored after RoPE.
//
// Sparse attention: each query tile of `query_tile` queries attends a list of logical pages
// (sinks first, then its top-k, ascending), `pages_per_tile` entries per tile, plus the chunk's
// own positions causally. Dense attention lists every earlier page for every tile.
#pragma once

#include <cstdint>

namespace ctxplan::kernels {

struct KvPageShape {
  int64_t page_tokens = 0;   // p
  int64_t num_kv_heads = 0;  // H_kv
  int64_t head_dim = 0;      // d_h

  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  int64_t page_elements() const { return 2 * page_tokens * kv_dim(); }
  // Element offset of K (which = 0) or V (which = 1) of token `t` of slot `slot`, head `h`.
  int64_t Offset(int64_t slot, int which, int64_t t, int64_t h) const {
    return slot * page_elements() + (static_cast<int64_t>(which) * page_tokens + t) * kv_dim() +
           h * head_dim;
  }
};

// Earlier positions of one layer, in pages. `num_pages` logical pages precede the chunk; all are
// full (chunks start on page boundaries).
template <typename T>
struct PagedKv {
  KvPageShape shape;
  T* pool = nullptr;                   // [slots][2][p][H_kv][d_h]
  const int32_t* page_slot = nullptr;  // [num_pages]: logical page -> slot
  int64_t num_pages = 0;
};

// Which earlier pages each query tile attends. pages == nullptr means dense: every tile attends
// every earlier page.
struct PageSelection {
  int64_t query_tile = 128;        // b
  int64_t pages_per_tile = 0;      // entries per tile
  const int32_t* pages = nullptr;  // [tiles][pages_per_tile] logical page ids, ascending
  // Optional, for the CUDA backward: the union of the tiles' selections, ascending, in device
  // memory. Given, key blocks are launched for these pages only instead of for every earlier page
  // (a block of a page no tile selected has nothing to do, but at 1M tokens there are 65K of them
  // per call). Ignored by the forward and by the CPU reference.
  const int32_t* union_pages = nullptr;  // [num_union_pages]
  int64_t num_union_pages = 0;
};

}  // namespace ctxplan::kernels
