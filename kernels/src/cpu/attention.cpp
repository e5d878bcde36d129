// CPU reference of chunk attention: a chunk's queries attend its own positions causally and the
// earlier positions held in KV pages (every page, or the pages each query tile selected).
//
// Formulation: per query tile and KV head, gather the keys the tile may see (its earlier pages in
// logical order, then the chunk's own positions 0..last query of the tile) into one contiguous
// matrix, and run a two-pass softmax over whole score rows. The matrix products are fp32 (Eigen):
// in float64 they cost twice as much on the baseline SSE2 build and the references must stay fast
// at thousands of positions. The precision that matters is kept in float64: the softmax max, sum
// and LSE, the exp arguments, D = rowsum(dO * O) and dP - D, the scale, and the key gradients
// summed across tiles (rounded to fp32 once). Against a float64 oracle the norm-wise relative
// error is a few 1e-7 at ~3K keys.
//
// Processing by tiles even when dense means dense attention and "every page listed for every
// tile" run the very same operations: identical bits.
#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {
namespace {

using MatF = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Query tile used when attention is dense and the selection names none: tiles only bound the
// size of the score matrix then, they do not change which keys a query sees.
constexpr int64_t kDenseTile = 128;

int64_t TileSize(const PageSelection& selection) {
  return selection.query_tile > 0 ? selection.query_tile : kDenseTile;
}

void Validate(const AttentionShape& shape, const PagedKv<const float>& earlier,
              const PageSelection& selection) {
  CTXPLAN_CHECK(shape.tokens >= 0 && shape.head_dim > 0, "attention shape");
  CTXPLAN_CHECK(shape.num_kv_heads > 0 && shape.num_heads % shape.num_kv_heads == 0,
                "query heads must be a multiple of KV heads (GQA)");
  CTXPLAN_CHECK(earlier.num_pages >= 0, "negative page count");
  if (earlier.num_pages > 0) {
    CTXPLAN_CHECK(earlier.pool != nullptr && earlier.page_slot != nullptr, "earlier pages");
    CTXPLAN_CHECK(earlier.shape.page_tokens > 0, "page size");
    CTXPLAN_CHECK(earlier.shape.num_kv_heads == shape.num_kv_heads &&
                      earlier.shape.head_dim == shape.head_dim,
                  "page shape differs from the attention shape");
  }
  if (selection.pages == nullptr) return;
  CTXPLAN_CHECK(selection.query_tile > 0 && selection.pages_per_tile >= 0, "page selection");
  // Strictly ascending ids in range: a repeated page would be attended twice.
  const int64_t tiles = (shape.tokens + selection.query_tile - 1) / selection.query_tile;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int32_t* list = selection.pages + tile * selection.pages_per_tile;
    for (int64_t j = 0; j < selection.pages_per_tile; ++j) {
      CTXPLAN_CHECK(list[j] >= 0 && list[j] < earlier.num_pages,
                    "selected page " + std::to_string(list[j]) + " out of range");
      CTXPLAN_CHECK(j == 0 || list[j] > list[j - 1], "selected pages not strictly ascending");
    }
  }
}

// The logical earlier pages tile `tile` attends; `all` lists 0..num_pages-1 (dense).
std::span<const int32_t> TilePages(const PageSelection& selection, int64_t tile,
                                   const std::vector<int32_t>& all) {
  if (selection.pages == nullptr) return all;
  return {selection.pages + tile * selection.pages_per_tile,
          static_cast<size_t>(selection.pages_per_tile)};
}

// Geometry of one (tile, KV head) block: queries [i0, i1) of every query head of the group, keys
// = the tile's earlier pages (E keys) then own positions 0..i1-1. Row r of the block is query
// i0 + r % rows() of query head kv_head * group + r / rows().
struct Block {
  int64_t i0 = 0, i1 = 0;
  int64_t kv_head = 0;
  int64_t earlier_keys = 0;  // E
  int64_t rows() const { return i1 - i0; }
  // Keys row r may see: all earlier ones, and own keys 0..i (causal).
  int64_t Visible(int64_t r) const { return earlier_keys + i0 + r % rows() + 1; }
};

// K and V of the block's keys, [E + i1][d_h] each: gathered pages in logical order, then own.
void GatherKv(const AttentionShape& shape, const PagedKv<const float>& earlier,
              std::span<const int32_t> pages, const float* k_own, const float* v_own,
              const Block& b, MatF* k, MatF* v) {
  const int64_t d = shape.head_dim;
  const int64_t p = earlier.shape.page_tokens;
  const int64_t n = b.earlier_keys + b.i1;
  k->resize(n, d);
  v->resize(n, d);
  int64_t row = 0;
  for (const int32_t page : pages) {
    const int64_t slot = earlier.page_slot[page];
    for (int64_t t = 0; t < p; ++t, ++row) {
      const float* ks = earlier.pool + earlier.shape.Offset(slot, 0, t, b.kv_head);
      const float* vs = earlier.pool + earlier.shape.Offset(slot, 1, t, b.kv_head);
      for (int64_t x = 0; x < d; ++x) {
        (*k)(row, x) = ks[x];
        (*v)(row, x) = vs[x];
      }
    }
  }
  const int64_t own_row = shape.num_kv_heads * d;
  for (int64_t t = 0; t < b.i1; ++t, ++row) {
    const float* ks = k_own + t * own_row + b.kv_head * d;
    const float* vs = v_own + t * own_row + b.kv_head * d;
    for (int64_t x = 0; x < d; ++x) {
      (*k)(row, x) = ks[x];
      (*v)(row, x) = vs[x];
    }
  }
}

// Rows of a [t][H_q][d_h] tensor for the block: [group * rows][d_h].
MatF GatherRows(const AttentionShape& shape, const float* x, const Block& b) {
  const int64_t d = shape.head_dim;
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  MatF m(group * b.rows(), d);
  for (int64_t r = 0; r < m.rows(); ++r) {
    const int64_t h = b.kv_head * group + r / b.rows();
    const float* src = x + ((b.i0 + r % b.rows()) * shape.num_heads + h) * d;
    for (int64_t c = 0; c < d; ++c) m(r, c) = src[c];
  }
  return m;
}

// Index of row r's (query, head) in a [t][H_q] array.
int64_t RowIndex(const AttentionShape& shape, const Block& b, int64_t r) {
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  return (b.i0 + r % b.rows()) * shape.num_heads + b.kv_head * group + r / b.rows();
}

// Calls fn(block, pages) for every (query tile, KV head).
template <typename Fn>
void ForEachBlock(const AttentionShape& shape, const PagedKv<const float>& earlier,
                  const PageSelection& selection, Fn&& fn) {
  std::vector<int32_t> all(selection.pages == nullptr ? earlier.num_pages : 0);
  for (size_t j = 0; j < all.size(); ++j) all[j] = static_cast<int32_t>(j);
  const int64_t tile_size = TileSize(selection);
  for (int64_t i0 = 0, tile = 0; i0 < shape.tokens; i0 += tile_size, ++tile) {
    const std::span<const int32_t> pages = TilePages(selection, tile, all);
    for (int64_t g = 0; g < shape.num_kv_heads; ++g) {
      Block b;
      b.i0 = i0;
      b.i1 = std::min(shape.tokens, i0 + tile_size);
      b.kv_head = g;
      b.earlier_keys = static_cast<int64_t>(pages.size()) * earlier.shape.page_tokens;
      fn(b, pages);
    }
  }
}

}  // namespace

void AttentionForward(const AttentionShape& shape, const float* q, const float* k_own,
                      const float* v_own, const PagedKv<const float>& earlier,
                      const PageSelection& selection, float* out, float* lse) {
  Validate(shape, earlier, selection);
  const int64_t d = shape.head_dim;
  ForEachBlock(shape, earlier, selection, [&](const Block& b, std::span<const int32_t> pages) {
    MatF k, v;
    GatherKv(shape, earlier, pages, k_own, v_own, b, &k, &v);
    const MatF qm = GatherRows(shape, q, b);
    const double scale = shape.scale;
    // s: [group * rows][E + i1], scores then unnormalised probabilities exp(scale s - max).
    // Columns past Visible(r) are masked (causal): zeroed, so the product below skips them.
    MatF s;
    s.noalias() = qm * k.transpose();
    std::vector<double> row_sum(s.rows());
    for (int64_t r = 0; r < s.rows(); ++r) {
      const int64_t visible = b.Visible(r);  // >= 1: query i always sees its own key
      double m = -std::numeric_limits<double>::infinity();
      for (int64_t c = 0; c < visible; ++c) m = std::max(m, scale * s(r, c));
      double sum = 0.0;
      for (int64_t c = 0; c < visible; ++c) {
        const double e = std::exp(scale * s(r, c) - m);
        s(r, c) = static_cast<float>(e);
        sum += e;
      }
      s.row(r).tail(s.cols() - visible).setZero();
      row_sum[r] = sum;
      lse[RowIndex(shape, b, r)] = static_cast<float>(m + std::log(sum));
    }
    MatF o;
    o.noalias() = s * v;  // [group * rows][d_h], normalised on the way out
    for (int64_t r = 0; r < o.rows(); ++r) {
      float* dst = out + RowIndex(shape, b, r) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(o(r, c) / row_sum[r]);
    }
  });
}

void AttentionBackward(const AttentionShape& shape, const float* q, const float* k_own,
                       const float* v_own, const PagedKv<const float>& earlier,
                       const PageSelection& selection, const float* out, const float* lse,
                       const float* d_out, float* dq, float* dk_own, float* dv_own,
                       const PagedKv<float>& dkv) {
  Validate(shape, earlier, selection);
  const int64_t d = shape.head_dim;
  const int64_t p = earlier.shape.page_tokens;
  const int64_t kv_row = shape.num_kv_heads * d;
  if (earlier.num_pages > 0) {
    CTXPLAN_CHECK(dkv.pool != nullptr && dkv.page_slot != nullptr, "dKV pages");
    CTXPLAN_CHECK(dkv.num_pages == earlier.num_pages && dkv.shape.page_tokens == p &&
                      dkv.shape.num_kv_heads == shape.num_kv_heads && dkv.shape.head_dim == d,
                  "dKV pages differ from the KV pages");
  }

  // D[i][h] = dO . O, the softmax backward's row correction.
  std::vector<double> delta(shape.tokens * shape.num_heads);
  for (size_t i = 0; i < delta.size(); ++i) {
    double acc = 0.0;
    for (int64_t c = 0; c < d; ++c) acc += static_cast<double>(d_out[i * d + c]) * out[i * d + c];
    delta[i] = acc;
  }

  // Key gradients gather contributions from every tile (and, for a page, every tile selecting
  // it): accumulate in float64 and round once. Earlier pages by logical page, each
  // [2][p][H_kv][d_h] like a KV page, allocated when a tile first selects it: backward then
  // reads and writes only the selected pages of dkv.
  std::vector<double> dk_acc(shape.tokens * kv_row, 0.0), dv_acc(shape.tokens * kv_row, 0.0);
  const int64_t page_elems = 2 * p * kv_row;
  std::vector<std::vector<double>> dpage(earlier.num_pages);

  ForEachBlock(shape, earlier, selection, [&](const Block& b, std::span<const int32_t> pages) {
    MatF k, v;
    GatherKv(shape, earlier, pages, k_own, v_own, b, &k, &v);
    const MatF qm = GatherRows(shape, q, b);
    const MatF dom = GatherRows(shape, d_out, b);
    const double scale = shape.scale;
    // P recomputed from the forward's LSE: P = exp(scale q.k - lse), zero where masked.
    MatF pm;
    pm.noalias() = qm * k.transpose();
    for (int64_t r = 0; r < pm.rows(); ++r) {
      const int64_t visible = b.Visible(r);
      const double l = lse[RowIndex(shape, b, r)];
      for (int64_t c = 0; c < visible; ++c) {
        pm(r, c) = static_cast<float>(std::exp(scale * pm(r, c) - l));
      }
      pm.row(r).tail(pm.cols() - visible).setZero();
    }
    // dS = P * (dO V^T - D); masked entries stay zero because P is zero there.
    MatF ds;
    ds.noalias() = dom * v.transpose();
    for (int64_t r = 0; r < ds.rows(); ++r) {
      const double dr = delta[RowIndex(shape, b, r)];
      for (int64_t c = 0; c < ds.cols(); ++c) {
        ds(r, c) = static_cast<float>(pm(r, c) * (static_cast<double>(ds(r, c)) - dr));
      }
    }
    // Unscaled products; `scale` is applied in float64 where they are stored.
    MatF dqm, dkm, dvm;
    dqm.noalias() = ds * k;                // [group * rows][d_h]
    dkm.noalias() = ds.transpose() * qm;   // [E + i1][d_h]
    dvm.noalias() = pm.transpose() * dom;  // [E + i1][d_h]
    for (int64_t r = 0; r < dqm.rows(); ++r) {
      float* dst = dq + RowIndex(shape, b, r) * d;
      for (int64_t c = 0; c < d; ++c) dst[c] = static_cast<float>(scale * dqm(r, c));
    }
    int64_t row = 0;
    for (const int32_t page : pages) {
      if (dpage[page].empty()) dpage[page].assign(page_elems, 0.0);
      double* base = dpage[page].data();
      for (int64_t t = 0; t < p; ++t, ++row) {
        double* dks = base + t * kv_row + b.kv_head * d;
        double* dvs = base + (p + t) * kv_row + b.kv_head * d;
        for (int64_t c = 0; c < d; ++c) {
          dks[c] += scale * dkm(row, c);
          dvs[c] += dvm(row, c);
        }
      }
    }
    for (int64_t t = 0; t < b.i1; ++t, ++row) {
      for (int64_t c = 0; c < d; ++c) {
        dk_acc[t * kv_row + b.kv_head * d + c] += scale * dkm(row, c);
        dv_acc[t * kv_row + b.kv_head * d + c] += dvm(row, c);
      }
    }
  });

  for (size_t i = 0; i < dk_acc.size(); ++i) {
    dk_own[i] = static_cast<float>(dk_acc[i]);
    dv_own[i] = static_cast<float>(dv_acc[i]);
  }
  for (int64_t page = 0; page < earlier.num_pages; ++page) {
    if (dpage[page].empty()) continue;  // no tile selected it
    // Same layout as a KV page: K rows then V rows, so the logical page adds straight in.
    float* dst = dkv.pool + dkv.shape.Offset(dkv.page_slot[page], 0, 0, 0);
    const double* src = dpage[page].data();
    for (int64_t e = 0; e < page_elems; ++e) dst[e] = static_cast<float>(dst[e] + src[e]);
  }
}

}  // namespace ctxplan::kernels::cpu
