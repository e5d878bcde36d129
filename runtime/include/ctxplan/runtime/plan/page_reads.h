// Which pages a step attends, and how often: one count per attention op (fill, recompute,
// backward) whose pages included the page. With offload each count is a copy of the page over
// PCIe, so these counts say which pages the GPU tier should hold (issue 12: measure, don't
// guess): the earliest ones (the plan's choice) or others.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace ctxplan {

struct PageReads {
  int64_t layers = 0, pages = 0;  // pages of one layer
  std::vector<uint32_t> counts;   // [layers][pages]

  void Reset(int64_t num_layers, int64_t num_pages);
  // One attention op of `layer` over `attended` (logical page ids).
  void Add(int32_t layer, std::span<const int32_t> attended);
  uint64_t total() const;
};

// The share of all reads that a tier of `fraction` of each layer's pages would keep off PCIe:
// the earliest pages of every layer (what the plan keeps), the most-read pages of every layer
// (the best with the same count in each layer), and the most-read pages overall (the best with
// the same total, layers free to differ). 0 when nothing was read.
struct PageReadShares {
  double earliest = 0, most_read_per_layer = 0, most_read = 0;
};
PageReadShares ShareOfReads(const PageReads& reads, double fraction);

}  // namespace ctxplan
