// CPU references of page-level sparse attention's selection: page summaries (mean keys), the
// scores of query tiles against them, and the per-tile top-k with sinks. Selection is not
// differentiated, so these have no backward.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {

void PageSummary(const PagedKv<const float>& kv, float* summaries) {
  const KvPageShape& s = kv.shape;
  const int64_t d = s.head_dim;
  std::vector<double> acc(d);
  for (int64_t page = 0; page < kv.num_pages; ++page) {
    const int64_t slot = kv.page_slot[page];
    for (int64_t h = 0; h < s.num_kv_heads; ++h) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t t = 0; t < s.page_tokens; ++t) {
        const float* k = kv.pool + s.Offset(slot, 0, t, h);
        for (int64_t x = 0; x < d; ++x) acc[x] += k[x];
      }
      float* dst = summaries + (page * s.num_kv_heads + h) * d;
      for (int64_t x = 0; x < d; ++x)
        dst[x] = static_cast<float>(acc[x] / static_cast<double>(s.page_tokens));
    }
  }
}

void PageScore(const float* q, int64_t tokens, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t query_tile, const float* summaries, int64_t pages,
               float* scores) {
  CTXPLAN_CHECK(query_tile > 0, "query tile");
  CTXPLAN_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0,
                "query heads must be a multiple of KV heads (GQA)");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t tiles = (tokens + query_tile - 1) / query_tile;
  // The score is linear in q: sum the tile's queries over its tokens and over the heads of each
  // GQA group first ([H_kv][d_h]), then one dot product per page and KV head.
  std::vector<double> qsum(num_kv_heads * head_dim);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    std::fill(qsum.begin(), qsum.end(), 0.0);
    const int64_t end = std::min(tokens, (tile + 1) * query_tile);  // a last tile may be partial
    for (int64_t i = tile * query_tile; i < end; ++i) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const float* qi = q + (i * num_heads + h) * head_dim;
        double* dst = qsum.data() + (h / group) * head_dim;
        for (int64_t x = 0; x < head_dim; ++x) dst[x] += qi[x];
      }
    }
    for (int64_t page = 0; page < pages; ++page) {
      const float* sp = summaries + page * num_kv_heads * head_dim;
      double acc = 0.0;
      for (int64_t x = 0; x < num_kv_heads * head_dim; ++x) acc += qsum[x] * sp[x];
      scores[tile * pages + page] = static_cast<float>(acc);
    }
  }
}

int64_t PageTopK(const float* scores, int64_t tiles, int64_t pages, int64_t budget, int64_t sinks,
                 int32_t* selected) {
  CTXPLAN_CHECK(tiles >= 0 && pages >= 0 && budget >= 0 && sinks >= 0, "top-k arguments");
  // pages <= sinks + budget, written so that a budget of "all" (INT64_MAX) cannot overflow.
  const bool every_page = sinks >= pages || budget >= pages - sinks;
  const int64_t per_tile = every_page ? pages : sinks + budget;
  if (every_page) {
    // Every page: dense in effect, and no scores need reading.
    for (int64_t tile = 0; tile < tiles; ++tile) {
      std::iota(selected + tile * per_tile, selected + (tile + 1) * per_tile, 0);
    }
    return per_tile;
  }
  // Here sinks < pages and budget < pages - sinks: the candidates are pages sinks..pages-1.
  std::vector<int32_t> candidates(pages - sinks);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const float* row = scores + tile * pages;
    // Best first; equal scores: the lower page first. A NaN score ranks below every number
    // (even -inf), so the order stays total and NaN is never preferred to a real score.
    auto better = [row](int32_t a, int32_t b) {
      const float sa = row[a], sb = row[b];
      const bool nan_a = std::isnan(sa), nan_b = std::isnan(sb);
      if (nan_a != nan_b) return nan_b;
      if (!nan_a && sa != sb) return sa > sb;
      return a < b;
    };
    std::iota(candidates.begin(), candidates.end(), static_cast<int32_t>(sinks));
    std::partial_sort(candidates.begin(), candidates.begin() + budget, candidates.end(), better);
    int32_t* dst = selected + tile * per_tile;
    std::iota(dst, dst + sinks, 0);
    std::copy_n(candidates.begin(), budget, dst + sinks);
    std::sort(dst + sinks, dst + per_tile);
  }
  return per_tile;
}

}  // namespace ctxplan::kernels::cpu
