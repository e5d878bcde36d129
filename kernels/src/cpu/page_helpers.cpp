// CPU references of the plan's page helpers: writing a chunk's K/V into its pages, and adding
// the dKV that later chunks left in them back into the chunk's own gradients.
#include <algorithm>

#include "ctxplan/kernels/cpu/reference.h"

namespace ctxplan::kernels::cpu {

void KvWrite(const float* k, const float* v, int64_t tokens, const PagedKv<float>& own_pages) {
  const KvPageShape& s = own_pages.shape;
  const int64_t row = s.kv_dim();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = own_pages.page_slot[t / s.page_tokens];
    const int64_t in_page = t % s.page_tokens;
    std::copy_n(k + t * row, row, own_pages.pool + s.Offset(slot, 0, in_page, 0));
    std::copy_n(v + t * row, row, own_pages.pool + s.Offset(slot, 1, in_page, 0));
  }
}

void DkvAccumulate(const PagedKv<const float>& own_dkv, int64_t tokens, float* dk_own,
                   float* dv_own) {
  const KvPageShape& s = own_dkv.shape;
  const int64_t row = s.kv_dim();
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = own_dkv.page_slot[t / s.page_tokens];
    const int64_t in_page = t % s.page_tokens;
    const float* dk = own_dkv.pool + s.Offset(slot, 0, in_page, 0);
    const float* dv = own_dkv.pool + s.Offset(slot, 1, in_page, 0);
    for (int64_t i = 0; i < row; ++i) {
      dk_own[t * row + i] += dk[i];
      dv_own[t * row + i] += dv[i];
    }
  }
}

}  // namespace ctxplan::kernels::cpu
