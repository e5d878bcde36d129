#include "ctxplan/runtime/plan/page_reads.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "ctxplan/models/errors.h"

namespace ctxplan {

void PageReads::Reset(int64_t num_layers, int64_t num_pages) {
  layers = num_layers;
  pages = num_pages;
  counts.assign(static_cast<size_t>(std::max<int64_t>(0, layers * pages)), 0);
}

void PageReads::Add(int32_t layer, std::span<const int32_t> attended) {
  CTXPLAN_CHECK(layer >= 0 && layer < layers, "page reads: layer out of range");
  uint32_t* row = counts.data() + static_cast<size_t>(layer) * static_cast<size_t>(pages);
  for (const int32_t page : attended) {
    CTXPLAN_CHECK(page >= 0 && page < pages, "page reads: page out of range");
    ++row[page];
  }
}

uint64_t PageReads::total() const {
  return std::accumulate(counts.begin(), counts.end(), uint64_t{0});
}

PageReadShares ShareOfReads(const PageReads& reads, double fraction) {
  PageReadShares s;
  const uint64_t total = reads.total();
  if (total == 0 || reads.pages <= 0) return s;
  const auto keep = static_cast<size_t>(std::clamp<int64_t>(
      std::llround(fraction * static_cast<double>(reads.pages)), 0, reads.pages));
  uint64_t earliest = 0, per_layer = 0;
  std::vector<uint32_t> row;
  for (int64_t l = 0; l < reads.layers; ++l) {
    const auto begin = reads.counts.begin() + l * reads.pages;
    earliest += std::accumulate(begin, begin + static_cast<int64_t>(keep), uint64_t{0});
    row.assign(begin, begin + reads.pages);
    std::partial_sort(row.begin(), row.begin() + static_cast<int64_t>(keep), row.end(),
                      std::greater<>());
    per_layer +=
        std::accumulate(row.begin(), row.begin() + static_cast<int64_t>(keep), uint64_t{0});
  }
  std::vector<uint32_t> all = reads.counts;
  const size_t keep_all = keep * static_cast<size_t>(reads.layers);
  std::partial_sort(all.begin(), all.begin() + static_cast<int64_t>(keep_all), all.end(),
                    std::greater<>());
  const uint64_t overall =
      std::accumulate(all.begin(), all.begin() + static_cast<int64_t>(keep_all), uint64_t{0});
  const double t = static_cast<double>(total);
  s.earliest = static_cast<double>(earliest) / t;
  s.most_read_per_layer = static_cast<double>(per_layer) / t;
  s.most_read = static_cast<double>(overall) / t;
  return s;
}

}  // namespace ctxplan
