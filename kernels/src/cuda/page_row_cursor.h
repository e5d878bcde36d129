// One loader thread's walk over the rows of the earlier pages' virtual sequence (the pages a block
// of queries attends, in list order, each p rows): rows r0, r0 + stride, r0 + 2 stride, ...
//
// The warp-specialised forward's loader issues every copy of a key tile, so its cost per copy
// bounds the kernel. Where 16 divides p it loads groups of 16 rows instead (no group crosses a
// page); this cursor serves the other page sizes (p >= 16, e.g. 24 or 40), whose pages end
// anywhere within a tile: the next row is the previous plus a fixed step, and the page table is
// read only when the walk leaves a page, for the page after the one it enters.
//
// Plain C++ (host and device), so the CPU tests walk it against the direct formula.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define CTXPLAN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CTXPLAN_HOST_DEVICE inline
#endif

namespace ctxplan::kernels::cuda::detail {

// The walk's constants. Precondition: 0 < stride <= page_rows (one step crosses at most one
// page's end).
struct PageRowWalk {
  int page_rows;         // p
  int stride;            // rows between one copy of this thread and its next
  int64_t row_elements;  // elements between consecutive rows of one page (H_kv * d_h)
};

// Two callables say where rows are: slot_of(page) is the slot of logical page `page` (any slot
// when `page` is past the list: it is asked for the page after the one the walk is on), and
// row_at(slot, offset) the address of row `offset` of that slot at this thread's column (K or
// V, its head and 16-byte chunk). The cursor keeps the next page's slot, not its address: one
// register, where the loader warps have few (setmaxnreg).
template <typename T>
struct PageRowCursor {
  const T* row = nullptr;  // the current row at this thread's column
  int next_slot = 0;       // the slot of page + 1
  int page = 0;            // the current row's logical page
  int offset = 0;          // its row within that page

  template <typename SlotOf, typename RowAt>
  CTXPLAN_HOST_DEVICE void Start(const PageRowWalk& walk, int first_row, SlotOf slot_of,
                                 RowAt row_at) {
    page = first_row / walk.page_rows;
    offset = first_row - page * walk.page_rows;
    row = row_at(slot_of(page), offset);
    next_slot = slot_of(page + 1);
  }

  // To the row `walk.stride` further on.
  template <typename SlotOf, typename RowAt>
  CTXPLAN_HOST_DEVICE void Advance(const PageRowWalk& walk, SlotOf slot_of, RowAt row_at) {
    offset += walk.stride;
    if (offset < walk.page_rows) {
      row += walk.stride * walk.row_elements;
      return;
    }
    offset -= walk.page_rows;
    ++page;
    row = row_at(next_slot, offset);
    next_slot = slot_of(page + 1);
  }
};

}  // namespace ctxplan::kernels::cuda::detail
