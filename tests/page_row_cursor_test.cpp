// The attention forward's loader walks the earlier pages with PageRowCursor (one per thread, K
// and V each): on the GPU every row it gives is a 16-byte copy, so an address off by a row is a
// wrong attention output far from its cause. Walked here on the host against the direct formula
// (the page of virtual row v is v / p, its row v % p) for every page size the kernels accept.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "page_row_cursor.h"

namespace ctxplan::kernels::cuda::detail {
namespace {

struct Pool {
  std::vector<int> slots;  // logical page -> slot, a random permutation
  int64_t row_elements = 0;
  int64_t page_elements = 0;
  int column = 0;  // this thread's element within a row
  std::vector<uint16_t> storage;
};

TEST(PageRowCursor, WalksEveryRowOfEveryPageSize) {
  std::mt19937 rng(20261126);
  int walks = 0;
  for (const int page_rows : {16, 20, 32, 48, 64, 96, 128, 192, 256}) {
    for (const int stride : {8, 16}) {  // the loader's rows per pass at d_h 128 and 64
      for (const int pages : {1, 3, 17}) {
        Pool pool;
        pool.slots.resize(pages);
        std::iota(pool.slots.begin(), pool.slots.end(), 0);
        std::shuffle(pool.slots.begin(), pool.slots.end(), rng);
        pool.row_elements = 4 * 128;  // H_kv x d_h
        pool.page_elements = 2 * page_rows * pool.row_elements;
        pool.column = static_cast<int>(rng() % 64) * 8;
        pool.storage.assign(static_cast<size_t>(pages * pool.page_elements), 0);
        const uint16_t* base = pool.storage.data();
        for (const int which : {0, 1}) {  // K rows, then V rows (a page's second half)
          int lookups = 0;
          auto slot_of = [&](int page) {
            ++lookups;
            return page < pages ? pool.slots[page] : 0;
          };
          auto row_at = [&](int slot, int offset) {
            return base + pool.column + slot * pool.page_elements +
                   (which * page_rows + offset) * pool.row_elements;
          };
          const PageRowWalk walk{page_rows, stride, pool.row_elements};
          for (int first = 0; first < stride; ++first) {
            lookups = 0;
            PageRowCursor<uint16_t> cursor;
            cursor.Start(walk, first, slot_of, row_at);
            // Past the last page too: the kernel zero-fills those rows, telling them by the page.
            const int rows = pages * page_rows + 2 * stride;
            for (int v = first; v < rows; v += stride) {
              const int page = v / page_rows, offset = v % page_rows;
              ASSERT_EQ(cursor.page, page)
                  << "p " << page_rows << " stride " << stride << " v " << v;
              ASSERT_EQ(cursor.offset, offset);
              if (page < pages) {
                const uint16_t* expected = base + pool.column +
                                           pool.slots[page] * pool.page_elements +
                                           (which * page_rows + offset) * pool.row_elements;
                ASSERT_EQ(cursor.row, expected) << "p " << page_rows << " v " << v;
              }
              cursor.Advance(walk, slot_of, row_at);
            }
            // The page table is read once a page (plus the one ahead), not once a row.
            EXPECT_LE(lookups, rows / page_rows + 3) << "p " << page_rows;
            ++walks;
          }
        }
      }
    }
  }
  EXPECT_EQ(walks, 9 * (8 + 16) * 3 * 2);
}

}  // namespace
}  // namespace ctxplan::kernels::cuda::detail
