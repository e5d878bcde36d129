// The CPU reference of chunk attention (dense and page-sparse, forward and backward) and of page
// selection, against independent float64 oracles: a naive attention over the materialised
// sequence (earlier keys then the chunk's own, an explicit mask, a plain softmax), its backward
// derived by hand, and central finite differences of the naive forward on tiny shapes.
//
// Every output is poisoned with NaN before each call, and slots of the page pool that no page
// uses hold NaN: reading a wrong slot or skipping a write cannot pass.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/kernels/paged_kv.h"

namespace ctxplan::kernels::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> Random(std::mt19937& rng, int64_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<float> Poisoned(int64_t n) {
  return std::vector<float>(n, kNaN);
}

std::vector<double> ToDouble(std::span<const float> v) {
  return {v.begin(), v.end()};
}

// ||got - ref|| / ||ref||; infinite when anything is not finite (NaN never passes).
template <typename A, typename B>
double RelErr(std::span<const A> got, std::span<const B> ref) {
  if (got.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(static_cast<double>(got[i]))) return std::numeric_limits<double>::infinity();
    const double e = static_cast<double>(got[i]) - static_cast<double>(ref[i]);
    num += e * e;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}
template <typename A, typename B>
double RelErr(const std::vector<A>& got, const std::vector<B>& ref) {
  return RelErr(std::span<const A>(got), std::span<const B>(ref));
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// --- the problem: a chunk of t queries after `pages` full pages of p tokens ---

struct Dims {
  int64_t t = 0, hq = 0, hkv = 0, d = 0, p = 0, pages = 0;
  int64_t group() const { return hq / hkv; }
  int64_t earlier() const { return pages * p; }  // E, earlier positions
  int64_t kv_row() const { return hkv * d; }
  int64_t q_size() const { return t * hq * d; }
};

struct Problem {
  Dims dims;
  float scale = 0.0f;
  std::vector<float> q, d_out;          // [t][H_q][d_h]
  std::vector<float> k_own, v_own;      // [t][H_kv][d_h]
  std::vector<float> k_early, v_early;  // [E][H_kv][d_h], logical order
  std::vector<int32_t> page_slot;       // [pages]
  int64_t slots = 0;
  std::vector<float> pool;  // [slots][2][p][H_kv][d_h], unused slots NaN

  KvPageShape page_shape() const { return {dims.p, dims.hkv, dims.d}; }
  AttentionShape shape() const { return {dims.t, dims.hq, dims.hkv, dims.d, scale}; }
  PagedKv<const float> Earlier() const {
    return {page_shape(), pool.data(), page_slot.data(), dims.pages};
  }
  // Lays the logical earlier pages out in the pool by `page_slot`.
  void BuildPool() {
    const KvPageShape s = page_shape();
    pool.assign(std::max<int64_t>(slots, 1) * s.page_elements(), kNaN);
    for (int64_t j = 0; j < dims.earlier(); ++j) {
      const int64_t slot = page_slot[j / dims.p];
      std::copy_n(&k_early[j * dims.kv_row()], dims.kv_row(),
                  &pool[s.Offset(slot, 0, j % dims.p, 0)]);
      std::copy_n(&v_early[j * dims.kv_row()], dims.kv_row(),
                  &pool[s.Offset(slot, 1, j % dims.p, 0)]);
    }
  }
  // A dKV pool like `pool`: used slots hold `fill` (random, or zeros), unused ones NaN.
  std::vector<float> DkvPool(std::mt19937* rng) const {
    std::vector<float> dkv(pool.size(), kNaN);
    const int64_t elems = page_shape().page_elements();
    for (int64_t page = 0; page < dims.pages; ++page) {
      float* dst = &dkv[page_slot[page] * elems];
      if (rng == nullptr) {
        std::fill_n(dst, elems, 0.0f);
      } else {
        const std::vector<float> r = Random(*rng, elems);
        std::copy(r.begin(), r.end(), dst);
      }
    }
    return dkv;
  }
  // dK (which = 0) or dV (1) of the earlier positions, logical order [E][H_kv][d_h], read from a
  // dKV pool laid out like `pool`.
  std::vector<float> Logical(const std::vector<float>& dkv, int which) const {
    std::vector<float> out(dims.earlier() * dims.kv_row());
    for (int64_t j = 0; j < dims.earlier(); ++j) {
      std::copy_n(&dkv[page_shape().Offset(page_slot[j / dims.p], which, j % dims.p, 0)],
                  dims.kv_row(), &out[j * dims.kv_row()]);
    }
    return out;
  }
};

// Fresh random inputs; with `shuffle`, pages sit in a random order among `extra` unused slots.
Problem MakeProblem(const Dims& dims, uint32_t seed, bool shuffle = true, int64_t extra = 3) {
  std::mt19937 rng(seed);
  Problem pr;
  pr.dims = dims;
  pr.scale = 1.0f / std::sqrt(static_cast<float>(dims.d));
  // Queries a little larger than keys, so softmax rows are not nearly uniform.
  pr.q = Random(rng, dims.q_size(), -2.0f, 2.0f);
  pr.d_out = Random(rng, dims.q_size());
  pr.k_own = Random(rng, dims.t * dims.kv_row());
  pr.v_own = Random(rng, dims.t * dims.kv_row());
  pr.k_early = Random(rng, dims.earlier() * dims.kv_row());
  pr.v_early = Random(rng, dims.earlier() * dims.kv_row());
  pr.slots = dims.pages + (shuffle ? extra : 0);
  std::vector<int32_t> slots(pr.slots);
  std::iota(slots.begin(), slots.end(), 0);
  if (shuffle) std::shuffle(slots.begin(), slots.end(), rng);
  pr.page_slot.assign(slots.begin(), slots.begin() + dims.pages);
  pr.BuildPool();
  return pr;
}

// --- the kernel under test, outputs poisoned ---

struct Fwd {
  std::vector<float> out, lse;
};
Fwd RunForward(const Problem& pr, const PageSelection& sel) {
  Fwd f{Poisoned(pr.dims.q_size()), Poisoned(pr.dims.t * pr.dims.hq)};
  AttentionForward(pr.shape(), pr.q.data(), pr.k_own.data(), pr.v_own.data(), pr.Earlier(), sel,
                   f.out.data(), f.lse.data());
  return f;
}

struct Bwd {
  std::vector<float> dq, dk_own, dv_own, dkv;  // dkv: the whole pool after accumulation
};
Bwd RunBackward(const Problem& pr, const PageSelection& sel, const Fwd& f,
                std::vector<float> dkv_init) {
  Bwd b{Poisoned(pr.dims.q_size()), Poisoned(pr.dims.t * pr.dims.kv_row()),
        Poisoned(pr.dims.t * pr.dims.kv_row()), std::move(dkv_init)};
  const PagedKv<float> dkv{pr.page_shape(), b.dkv.data(), pr.page_slot.data(), pr.dims.pages};
  AttentionBackward(pr.shape(), pr.q.data(), pr.k_own.data(), pr.v_own.data(), pr.Earlier(), sel,
                    f.out.data(), f.lse.data(), pr.d_out.data(), b.dq.data(), b.dk_own.data(),
                    b.dv_own.data(), dkv);
  return b;
}

// --- the float64 oracle: naive attention over the materialised sequence ---

// Whether query i may attend earlier page `page` (own positions are always causal).
using Allowed = std::function<bool(int64_t query, int64_t page)>;
bool Dense(int64_t, int64_t) {
  return true;
}

Allowed FromSelection(const PageSelection& sel) {
  return [sel](int64_t i, int64_t page) {
    const int32_t* list = sel.pages + (i / sel.query_tile) * sel.pages_per_tile;
    return std::find(list, list + sel.pages_per_tile, page) != list + sel.pages_per_tile;
  };
}

// Inputs in float64; k, v = earlier keys then own keys, [E + t][H_kv][d_h].
struct Naive {
  Dims dims;
  double scale = 0.0;
  std::vector<double> q, k, v, d_out;
  Allowed allowed = Dense;

  explicit Naive(const Problem& pr, Allowed a = Dense)
      : dims(pr.dims),
        scale(pr.scale),
        q(ToDouble(pr.q)),
        d_out(ToDouble(pr.d_out)),
        allowed(std::move(a)) {
    k = ToDouble(pr.k_early);
    k.insert(k.end(), pr.k_own.begin(), pr.k_own.end());
    v = ToDouble(pr.v_early);
    v.insert(v.end(), pr.v_own.begin(), pr.v_own.end());
  }
  bool Visible(int64_t i, int64_t j) const {
    return j < dims.earlier() ? allowed(i, j / dims.p) : j - dims.earlier() <= i;
  }
  int64_t keys() const { return dims.earlier() + dims.t; }
  const double* Q(int64_t i, int64_t h) const { return &q[(i * dims.hq + h) * dims.d]; }
  const double* K(int64_t j, int64_t h) const {
    return &k[(j * dims.hkv + h / dims.group()) * dims.d];
  }
  const double* V(int64_t j, int64_t h) const {
    return &v[(j * dims.hkv + h / dims.group()) * dims.d];
  }
  double Dot(const double* a, const double* b) const {
    double s = 0.0;
    for (int64_t x = 0; x < dims.d; ++x) s += a[x] * b[x];
    return s;
  }
  // Softmax row of (i, h) over all keys, zero where masked; and its log-normaliser.
  std::vector<double> Probs(int64_t i, int64_t h, double* lse) const {
    std::vector<double> s(keys(), -std::numeric_limits<double>::infinity());
    double m = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < keys(); ++j) {
      if (Visible(i, j)) m = std::max(m, s[j] = scale * Dot(Q(i, h), K(j, h)));
    }
    double sum = 0.0;
    for (double& x : s) sum += (x = std::exp(x - m));
    for (double& x : s) x /= sum;
    if (lse != nullptr) *lse = m + std::log(sum);
    return s;
  }
  void Forward(std::vector<double>* out, std::vector<double>* lse) const {
    out->assign(dims.q_size(), 0.0);
    lse->assign(dims.t * dims.hq, 0.0);
    for (int64_t i = 0; i < dims.t; ++i) {
      for (int64_t h = 0; h < dims.hq; ++h) {
        const std::vector<double> pr = Probs(i, h, &(*lse)[i * dims.hq + h]);
        double* o = &(*out)[(i * dims.hq + h) * dims.d];
        for (int64_t j = 0; j < keys(); ++j) {
          for (int64_t x = 0; x < dims.d; ++x) o[x] += pr[j] * V(j, h)[x];
        }
      }
    }
  }
  // The scalar whose gradients backward computes: L = sum(dO * O).
  double Loss() const {
    std::vector<double> out, lse;
    Forward(&out, &lse);
    double l = 0.0;
    for (size_t e = 0; e < out.size(); ++e) l += d_out[e] * out[e];
    return l;
  }
  // By hand, per (i, h): o = sum_j P_j v_j, P = softmax(s), s_j = scale q.k_j, so
  // dv_j += P_j dO; dP_j = dO.v_j; ds_j = P_j (dP_j - sum_l P_l dP_l); dq = scale sum_j ds_j k_j;
  // dk_j += scale ds_j q.
  void Backward(std::vector<double>* dq, std::vector<double>* dk, std::vector<double>* dv) const {
    dq->assign(dims.q_size(), 0.0);
    dk->assign(keys() * dims.kv_row(), 0.0);
    dv->assign(keys() * dims.kv_row(), 0.0);
    for (int64_t i = 0; i < dims.t; ++i) {
      for (int64_t h = 0; h < dims.hq; ++h) {
        const std::vector<double> pr = Probs(i, h, nullptr);
        const double* go = &d_out[(i * dims.hq + h) * dims.d];
        std::vector<double> dp(keys());
        double mean = 0.0;
        for (int64_t j = 0; j < keys(); ++j) mean += pr[j] * (dp[j] = Dot(go, V(j, h)));
        for (int64_t j = 0; j < keys(); ++j) {
          const double ds = pr[j] * (dp[j] - mean);
          const int64_t kv = (j * dims.hkv + h / dims.group()) * dims.d;
          for (int64_t x = 0; x < dims.d; ++x) {
            (*dq)[(i * dims.hq + h) * dims.d + x] += scale * ds * K(j, h)[x];
            (*dk)[kv + x] += scale * ds * Q(i, h)[x];
            (*dv)[kv + x] += pr[j] * go[x];
          }
        }
      }
    }
  }
};

// Rows [from, to) of a [rows][row] array.
template <typename T>
std::vector<T> Rows(const std::vector<T>& v, int64_t row, int64_t from, int64_t to) {
  return {v.begin() + from * row, v.begin() + to * row};
}

// The dKV pool after accumulating into `init` must be `init + g` for the gradient g that a run
// from zero left (`zero_run`), up to rounding: the kernel rounds init + g once from float64, which
// can differ from the float sum of init and rounded g by a unit in the last place or so. Slots
// `init` marks unused (NaN) must stay NaN: neither read nor written.
void ExpectAccumulated(const std::vector<float>& init, const std::vector<float>& got,
                       const std::vector<float>& zero_run) {
  int64_t bad = 0;
  double worst = 0.0;
  for (size_t e = 0; e < got.size(); ++e) {
    if (std::isnan(init[e])) {
      bad += !std::isnan(got[e]);
      continue;
    }
    const double want = static_cast<double>(init[e]) + zero_run[e];
    const double ulp =
        std::max(std::abs(init[e]), std::abs(zero_run[e])) * std::numeric_limits<float>::epsilon();
    const double err = std::abs(got[e] - want) / ulp;
    worst = std::isnan(err) ? std::numeric_limits<double>::infinity() : std::max(worst, err);
  }
  EXPECT_EQ(bad, 0) << "unused slots touched, of " << got.size() << " dKV pool elements";
  EXPECT_LE(worst, 1.0) << "in units of the larger operand's epsilon";
}

// --- forward and backward against the naive oracle, over the shapes that matter ---

struct Case {
  const char* name;
  Dims dims;
  int64_t query_tile;
};

class AttentionVsNaive : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionVsNaive, DenseForwardAndBackward) {
  const Case& c = GetParam();
  const Problem pr = MakeProblem(c.dims, 1234);
  PageSelection dense;
  dense.query_tile = c.query_tile;
  const Naive naive(pr);
  std::vector<double> out, lse, dq, dk, dv;
  naive.Forward(&out, &lse);
  naive.Backward(&dq, &dk, &dv);

  const Fwd f = RunForward(pr, dense);
  EXPECT_LE(RelErr(f.out, out), 1e-5);
  EXPECT_LE(RelErr(f.lse, lse), 1e-5);

  // Zero-initialised dKV checks the gradient itself; a random start checks it is added to.
  const Bwd b = RunBackward(pr, dense, f, pr.DkvPool(nullptr));
  const int64_t e = c.dims.earlier(), n = e + c.dims.t, row = c.dims.kv_row();
  EXPECT_LE(RelErr(b.dq, dq), 1e-5);
  EXPECT_LE(RelErr(b.dk_own, Rows(dk, row, e, n)), 1e-5);
  EXPECT_LE(RelErr(b.dv_own, Rows(dv, row, e, n)), 1e-5);
  if (e > 0) {
    EXPECT_LE(RelErr(pr.Logical(b.dkv, 0), Rows(dk, row, 0, e)), 1e-5);
    EXPECT_LE(RelErr(pr.Logical(b.dkv, 1), Rows(dv, row, 0, e)), 1e-5);
  }
  std::mt19937 rng(99);
  const std::vector<float> init = pr.DkvPool(&rng);
  const Bwd b2 = RunBackward(pr, dense, f, init);
  ExpectAccumulated(init, b2.dkv, b.dkv);
  EXPECT_TRUE(BitwiseEqual(b2.dq, b.dq));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionVsNaive,
    ::testing::Values(
        // GQA 7, d_h 64, 50 queries in tiles of 16 (last tile partial).
        Case{"Gqa7D64", {.t = 50, .hq = 7, .hkv = 1, .d = 64, .p = 16, .pages = 5}, 16},
        // GQA 4, d_h 128.
        Case{"Gqa4D128", {.t = 70, .hq = 8, .hkv = 2, .d = 128, .p = 32, .pages = 3}, 32},
        // GQA 1 (MHA), a single earlier page.
        Case{"Mha1Page", {.t = 33, .hq = 4, .hkv = 4, .d = 64, .p = 8, .pages = 1}, 16},
        // The first chunk: no earlier pages.
        Case{"FirstChunk", {.t = 40, .hq = 8, .hkv = 2, .d = 64, .p = 16, .pages = 0}, 16},
        // Many pages, the query tile larger than the chunk.
        Case{"ManyPages", {.t = 37, .hq = 4, .hkv = 1, .d = 128, .p = 8, .pages = 96}, 64},
        // A small odd head dim, tiles of 1 query.
        Case{"SmallD16", {.t = 9, .hq = 6, .hkv = 3, .d = 16, .p = 4, .pages = 4}, 1}),
    [](const ::testing::TestParamInfo<Case>& param) { return param.param.name; });

// Paged equals contiguous: the same keys in slots 0..pages-1 in order, and in shuffled slots among
// NaN-filled unused ones, give identical bits.
TEST(AttentionReference, PagedEqualsContiguous) {
  const Dims dims{.t = 45, .hq = 8, .hkv = 2, .d = 64, .p = 8, .pages = 11};
  const Problem shuffled = MakeProblem(dims, 77, /*shuffle=*/true, /*extra=*/5);
  Problem contiguous = shuffled;
  contiguous.slots = dims.pages;
  std::iota(contiguous.page_slot.begin(), contiguous.page_slot.end(), 0);
  contiguous.BuildPool();
  ASSERT_NE(shuffled.page_slot, contiguous.page_slot);

  PageSelection dense;
  dense.query_tile = 16;
  const Fwd fs = RunForward(shuffled, dense), fc = RunForward(contiguous, dense);
  EXPECT_TRUE(BitwiseEqual(fs.out, fc.out));
  EXPECT_TRUE(BitwiseEqual(fs.lse, fc.lse));
  const Bwd bs = RunBackward(shuffled, dense, fs, shuffled.DkvPool(nullptr));
  const Bwd bc = RunBackward(contiguous, dense, fc, contiguous.DkvPool(nullptr));
  EXPECT_TRUE(BitwiseEqual(bs.dq, bc.dq));
  EXPECT_TRUE(BitwiseEqual(bs.dk_own, bc.dk_own));
  EXPECT_TRUE(BitwiseEqual(bs.dv_own, bc.dv_own));
  EXPECT_TRUE(BitwiseEqual(shuffled.Logical(bs.dkv, 0), contiguous.Logical(bc.dkv, 0)));
  EXPECT_TRUE(BitwiseEqual(shuffled.Logical(bs.dkv, 1), contiguous.Logical(bc.dkv, 1)));
  // Unused slots of the shuffled dKV pool (NaN) were not written.
  const int64_t elems = shuffled.page_shape().page_elements();
  for (int64_t slot = 0; slot < shuffled.slots; ++slot) {
    if (std::count(shuffled.page_slot.begin(), shuffled.page_slot.end(), slot) > 0) continue;
    EXPECT_TRUE(std::all_of(&bs.dkv[slot * elems], &bs.dkv[(slot + 1) * elems],
                            [](float x) { return std::isnan(x); }))
        << "slot " << slot;
  }
}

// --- sparse ---

// Budget = every page: a selection listing all pages for every tile is dense attention.
TEST(AttentionReference, FullSelectionEqualsDense) {
  const Dims dims{.t = 53, .hq = 8, .hkv = 2, .d = 64, .p = 8, .pages = 9};
  const Problem pr = MakeProblem(dims, 5);
  const int64_t tile = 16, tiles = (dims.t + tile - 1) / tile;
  std::vector<int32_t> all(tiles * dims.pages);
  for (int64_t i = 0; i < tiles; ++i)
    std::iota(&all[i * dims.pages], &all[(i + 1) * dims.pages], 0);
  PageSelection dense, full;
  dense.query_tile = full.query_tile = tile;
  full.pages_per_tile = dims.pages;
  full.pages = all.data();

  const Fwd fd = RunForward(pr, dense), ff = RunForward(pr, full);
  EXPECT_LE(RelErr(ff.out, fd.out), 1e-7);
  EXPECT_LE(RelErr(ff.lse, fd.lse), 1e-7);
  std::mt19937 rng(3);
  const std::vector<float> init = pr.DkvPool(&rng);
  const Bwd bd = RunBackward(pr, dense, fd, init), bf = RunBackward(pr, full, ff, init);
  EXPECT_LE(RelErr(bf.dq, bd.dq), 1e-7);
  EXPECT_LE(RelErr(bf.dk_own, bd.dk_own), 1e-7);
  EXPECT_LE(RelErr(bf.dv_own, bd.dv_own), 1e-7);
  EXPECT_LE(RelErr(pr.Logical(bf.dkv, 0), pr.Logical(bd.dkv, 0)), 1e-7);
  EXPECT_LE(RelErr(pr.Logical(bf.dkv, 1), pr.Logical(bd.dkv, 1)), 1e-7);
  // In fact the same operations run: identical bits.
  EXPECT_TRUE(BitwiseEqual(ff.out, fd.out));
  EXPECT_TRUE(BitwiseEqual(bf.dkv, bd.dkv));  // unused slots: the same NaN bits
}

// A real top-k selection (summaries, scores, top-k with a sink) against the naive attention with
// the unselected pages masked; pages no tile selected are never written.
TEST(AttentionReference, TopKSelectionEqualsMaskedNaive) {
  const Dims dims{.t = 75, .hq = 8, .hkv = 2, .d = 64, .p = 8, .pages = 14};
  const Problem pr = MakeProblem(dims, 21);
  const int64_t tile = 16, tiles = (dims.t + tile - 1) / tile, budget = 3, sinks = 1;
  std::vector<float> summaries = Poisoned(dims.pages * dims.kv_row());
  PageSummary(pr.Earlier(), summaries.data());
  std::vector<float> scores = Poisoned(tiles * dims.pages);
  PageScore(pr.q.data(), dims.t, dims.hq, dims.hkv, dims.d, tile, summaries.data(), dims.pages,
            scores.data());
  std::vector<int32_t> selected(tiles * (sinks + budget), -1);
  const int64_t per_tile =
      PageTopK(scores.data(), tiles, dims.pages, budget, sinks, selected.data());
  ASSERT_EQ(per_tile, sinks + budget);
  PageSelection sel{.query_tile = tile, .pages_per_tile = per_tile, .pages = selected.data()};
  // Tiles differ in what they select, and some page is selected by none.
  std::vector<bool> used(dims.pages, false);
  for (int32_t page : selected) used[page] = true;
  const int64_t unused = std::count(used.begin(), used.end(), false);
  ASSERT_GT(unused, 0);
  ASSERT_FALSE(
      std::equal(selected.begin(), selected.begin() + per_tile, selected.begin() + per_tile));

  const Naive naive(pr, FromSelection(sel));
  std::vector<double> out, lse, dq, dk, dv;
  naive.Forward(&out, &lse);
  naive.Backward(&dq, &dk, &dv);
  const Fwd f = RunForward(pr, sel);
  EXPECT_LE(RelErr(f.out, out), 1e-5);
  EXPECT_LE(RelErr(f.lse, lse), 1e-5);
  // The mask matters: dense attention is far from it.
  PageSelection dense;
  dense.query_tile = tile;
  EXPECT_GT(RelErr(RunForward(pr, dense).out, out), 1e-2);

  const Bwd b = RunBackward(pr, sel, f, pr.DkvPool(nullptr));
  const int64_t e = dims.earlier(), n = e + dims.t, row = dims.kv_row();
  EXPECT_LE(RelErr(b.dq, dq), 1e-5);
  EXPECT_LE(RelErr(b.dk_own, Rows(dk, row, e, n)), 1e-5);
  EXPECT_LE(RelErr(b.dv_own, Rows(dv, row, e, n)), 1e-5);
  EXPECT_LE(RelErr(pr.Logical(b.dkv, 0), Rows(dk, row, 0, e)), 1e-5);
  EXPECT_LE(RelErr(pr.Logical(b.dkv, 1), Rows(dv, row, 0, e)), 1e-5);
  // Unselected pages keep their start values exactly (backward touches only selected pages).
  std::mt19937 rng(8);
  const std::vector<float> init = pr.DkvPool(&rng);
  const Bwd b2 = RunBackward(pr, sel, f, init);
  ExpectAccumulated(init, b2.dkv, b.dkv);
  const int64_t elems = pr.page_shape().page_elements();
  for (int64_t page = 0; page < dims.pages; ++page) {
    if (used[page]) continue;
    const int64_t at = pr.page_slot[page] * elems;
    EXPECT_EQ(std::memcmp(&b2.dkv[at], &init[at], elems * sizeof(float)), 0) << "page " << page;
  }
}

// --- finite differences of the float64 forward, on a tiny problem ---

// Central differences of L = sum(dO * O) with respect to every element of `x`.
std::vector<double> FiniteDiff(Naive* naive, std::vector<double>* x) {
  constexpr double kStep = 1e-5;
  std::vector<double> g(x->size());
  for (size_t e = 0; e < x->size(); ++e) {
    const double saved = (*x)[e];
    (*x)[e] = saved + kStep;
    const double up = naive->Loss();
    (*x)[e] = saved - kStep;
    const double down = naive->Loss();
    (*x)[e] = saved;
    g[e] = (up - down) / (2 * kStep);
  }
  return g;
}

void CheckFiniteDifferences(const Problem& pr, const PageSelection& sel, const Allowed& allowed) {
  const Dims& dims = pr.dims;
  Naive naive(pr, allowed);
  const std::vector<double> fd_q = FiniteDiff(&naive, &naive.q);
  const std::vector<double> fd_k = FiniteDiff(&naive, &naive.k);
  const std::vector<double> fd_v = FiniteDiff(&naive, &naive.v);
  // The hand-derived oracle agrees with the differences...
  std::vector<double> dq, dk, dv;
  naive.Backward(&dq, &dk, &dv);
  EXPECT_LE(RelErr(dq, fd_q), 1e-7);
  EXPECT_LE(RelErr(dk, fd_k), 1e-7);
  EXPECT_LE(RelErr(dv, fd_v), 1e-7);
  // ...and so does the kernel, with dKV pre-filled: the result minus the start is the gradient.
  std::mt19937 rng(4);
  const std::vector<float> init = pr.DkvPool(&rng);
  const Bwd b = RunBackward(pr, sel, RunForward(pr, sel), init);
  const int64_t e = dims.earlier(), n = e + dims.t, row = dims.kv_row();
  EXPECT_LE(RelErr(b.dq, fd_q), 1e-5);
  EXPECT_LE(RelErr(b.dk_own, Rows(fd_k, row, e, n)), 1e-5);
  EXPECT_LE(RelErr(b.dv_own, Rows(fd_v, row, e, n)), 1e-5);
  const std::vector<float> k0 = pr.Logical(init, 0), k1 = pr.Logical(b.dkv, 0);
  const std::vector<float> v0 = pr.Logical(init, 1), v1 = pr.Logical(b.dkv, 1);
  std::vector<double> added_k(k0.size()), added_v(v0.size());
  for (size_t i = 0; i < k0.size(); ++i) {
    added_k[i] = static_cast<double>(k1[i]) - k0[i];
    added_v[i] = static_cast<double>(v1[i]) - v0[i];
  }
  EXPECT_LE(RelErr(added_k, Rows(fd_k, row, 0, e)), 1e-5);
  EXPECT_LE(RelErr(added_v, Rows(fd_v, row, 0, e)), 1e-5);
}

TEST(AttentionReference, BackwardMatchesFiniteDifferencesDense) {
  const Problem pr = MakeProblem({.t = 5, .hq = 2, .hkv = 1, .d = 4, .p = 2, .pages = 3}, 11);
  PageSelection dense;
  dense.query_tile = 2;
  CheckFiniteDifferences(pr, dense, Dense);
}

TEST(AttentionReference, BackwardMatchesFiniteDifferencesSparse) {
  const Problem pr = MakeProblem({.t = 5, .hq = 2, .hkv = 1, .d = 4, .p = 2, .pages = 3}, 12);
  // Tiles of 2 queries: {0, 2}, {0, 1}, {1, 2}.
  const std::vector<int32_t> pages = {0, 2, 0, 1, 1, 2};
  const PageSelection sel{.query_tile = 2, .pages_per_tile = 2, .pages = pages.data()};
  CheckFiniteDifferences(pr, sel, FromSelection(sel));
}

// --- two chunks through the page helpers equal full-sequence attention ---

// A 15-token sequence in chunks of 8 and 7 tokens (p = 4): chunk A fills 2 pages by KvWrite;
// chunk B attends them and writes its own 2 pages, the last one partly filled. Forward outputs,
// and gradients after B's backward accumulates into A's dKV pages and A adds them back by
// DkvAccumulate, equal the naive causal attention of the whole sequence.
TEST(AttentionReference, TwoChunksThroughPagesEqualFullSequence) {
  const int64_t p = 4, n = 15, ta = 8, tb = 7;
  const Dims full{.t = n, .hq = 4, .hkv = 2, .d = 16, .p = p, .pages = 0};
  const Problem seq = MakeProblem(full, 31);
  const Naive naive(seq);
  std::vector<double> out, lse, dq, dk, dv;
  naive.Forward(&out, &lse);
  naive.Backward(&dq, &dk, &dv);

  const int64_t row = full.kv_row(), qrow = full.hq * full.d;
  const KvPageShape ps{p, full.hkv, full.d};
  const std::vector<int32_t> page_slot = {3, 0, 4, 1};  // A: pages 0, 1; B: pages 2, 3
  std::vector<float> pool(6 * ps.page_elements(), kNaN);
  const float* q = seq.q.data();
  const float* k = seq.k_own.data();
  const float* v = seq.v_own.data();
  const AttentionShape sa{ta, full.hq, full.hkv, full.d, seq.scale};
  const AttentionShape sb{tb, full.hq, full.hkv, full.d, seq.scale};
  PageSelection dense;
  dense.query_tile = 3;

  // Forward: A then B.
  KvWrite(k, v, ta, PagedKv<float>{ps, pool.data(), page_slot.data(), 2});
  std::vector<float> o = Poisoned(n * qrow), l = Poisoned(n * full.hq);
  AttentionForward(sa, q, k, v, PagedKv<const float>{ps, pool.data(), page_slot.data(), 0}, dense,
                   o.data(), l.data());
  const PagedKv<const float> a_pages{ps, pool.data(), page_slot.data(), 2};
  AttentionForward(sb, q + ta * qrow, k + ta * row, v + ta * row, a_pages, dense,
                   o.data() + ta * qrow, l.data() + ta * full.hq);
  EXPECT_LE(RelErr(o, out), 1e-5);
  EXPECT_LE(RelErr(l, lse), 1e-5);

  // B's own pages: written where the page table says, the partial page's tail untouched.
  KvWrite(k + ta * row, v + ta * row, tb, PagedKv<float>{ps, pool.data(), page_slot.data() + 2, 2});
  for (int64_t t = 0; t < 2 * p; ++t) {
    const int64_t slot = page_slot[2 + t / p];
    const float* kp = &pool[ps.Offset(slot, 0, t % p, 0)];
    const float* vp = &pool[ps.Offset(slot, 1, t % p, 0)];
    for (int64_t x = 0; x < row; ++x) {
      if (t < tb) {
        ASSERT_EQ(kp[x], k[(ta + t) * row + x]);
        ASSERT_EQ(vp[x], v[(ta + t) * row + x]);
      } else {
        ASSERT_TRUE(std::isnan(kp[x]) && std::isnan(vp[x])) << "wrote past the chunk's end";
      }
    }
  }

  // Backward: B then A; dKV pages start at zero.
  std::vector<float> dkv(pool.size(), kNaN);
  for (int32_t slot : page_slot) {
    std::fill_n(&dkv[slot * ps.page_elements()], ps.page_elements(), 0.0f);
  }
  std::vector<float> gq = Poisoned(n * qrow), gk = Poisoned(n * row), gv = Poisoned(n * row);
  const float* go = seq.d_out.data();
  AttentionBackward(sb, q + ta * qrow, k + ta * row, v + ta * row, a_pages, dense,
                    o.data() + ta * qrow, l.data() + ta * full.hq, go + ta * qrow,
                    gq.data() + ta * qrow, gk.data() + ta * row, gv.data() + ta * row,
                    PagedKv<float>{ps, dkv.data(), page_slot.data(), 2});
  // B's own dKV (from "later chunks": none here, so zero) adds nothing.
  const std::vector<float> gk_b(gk.begin() + ta * row, gk.end()),
      gv_b(gv.begin() + ta * row, gv.end());
  DkvAccumulate(PagedKv<const float>{ps, dkv.data(), page_slot.data() + 2, 2}, tb,
                gk.data() + ta * row, gv.data() + ta * row);
  EXPECT_TRUE(std::equal(gk_b.begin(), gk_b.end(), gk.begin() + ta * row));
  EXPECT_TRUE(std::equal(gv_b.begin(), gv_b.end(), gv.begin() + ta * row));

  AttentionBackward(sa, q, k, v, PagedKv<const float>{ps, pool.data(), page_slot.data(), 0}, dense,
                    o.data(), l.data(), go, gq.data(), gk.data(), gv.data(),
                    PagedKv<float>{ps, dkv.data(), page_slot.data(), 0});
  DkvAccumulate(PagedKv<const float>{ps, dkv.data(), page_slot.data(), 2}, ta, gk.data(),
                gv.data());
  EXPECT_LE(RelErr(gq, dq), 1e-5);
  EXPECT_LE(RelErr(gk, dk), 1e-5);
  EXPECT_LE(RelErr(gv, dv), 1e-5);
}

// DkvAccumulate reads a partly filled last page by the page table and adds exactly.
TEST(AttentionReference, DkvAccumulatePartialLastPage) {
  const int64_t p = 4, t = 7;
  const KvPageShape ps{p, 2, 8};
  const int64_t row = ps.kv_dim();
  std::mt19937 rng(17);
  const std::vector<int32_t> page_slot = {2, 0};
  std::vector<float> dkv = Random(rng, 3 * ps.page_elements());
  const std::vector<float> dk0 = Random(rng, t * row), dv0 = Random(rng, t * row);
  std::vector<float> dk = dk0, dv = dv0;
  DkvAccumulate(PagedKv<const float>{ps, dkv.data(), page_slot.data(), 2}, t, dk.data(), dv.data());
  for (int64_t i = 0; i < t; ++i) {
    const int64_t slot = page_slot[i / p];
    for (int64_t x = 0; x < row; ++x) {
      ASSERT_EQ(dk[i * row + x], dk0[i * row + x] + dkv[ps.Offset(slot, 0, i % p, 0) + x]);
      ASSERT_EQ(dv[i * row + x], dv0[i * row + x] + dkv[ps.Offset(slot, 1, i % p, 0) + x]);
    }
  }
}

// --- page selection ---

TEST(PageSelect, SummaryIsMeanKeyPerPageAndHead) {
  const Problem pr = MakeProblem({.t = 1, .hq = 6, .hkv = 3, .d = 16, .p = 8, .pages = 7}, 41);
  std::vector<float> got = Poisoned(pr.dims.pages * pr.dims.kv_row());
  PageSummary(pr.Earlier(), got.data());
  std::vector<double> want(got.size(), 0.0);
  for (int64_t j = 0; j < pr.dims.earlier(); ++j) {
    for (int64_t x = 0; x < pr.dims.kv_row(); ++x) {
      want[(j / pr.dims.p) * pr.dims.kv_row() + x] += pr.k_early[j * pr.dims.kv_row() + x] / 8.0;
    }
  }
  EXPECT_LE(RelErr(got, want), 1e-6);
}

TEST(PageSelect, ScoreSumsTileQueriesAndGroupHeads) {
  // 37 queries in tiles of 16: the last tile has 5.
  const int64_t t = 37, hq = 8, hkv = 2, d = 16, tile = 16, pages = 9, tiles = 3;
  std::mt19937 rng(43);
  const std::vector<float> q = Random(rng, t * hq * d), summaries = Random(rng, pages * hkv * d);
  std::vector<float> got = Poisoned(tiles * pages);
  PageScore(q.data(), t, hq, hkv, d, tile, summaries.data(), pages, got.data());
  std::vector<double> want(tiles * pages, 0.0);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t h = 0; h < hq; ++h) {
      for (int64_t page = 0; page < pages; ++page) {
        for (int64_t x = 0; x < d; ++x) {
          want[(i / tile) * pages + page] += static_cast<double>(q[(i * hq + h) * d + x]) *
                                             summaries[(page * hkv + h / (hq / hkv)) * d + x];
        }
      }
    }
  }
  EXPECT_LE(RelErr(got, want), 1e-6);
}

// Naive top-k: sinks, then the best `budget` of the rest by (score desc, page asc), sorted.
std::vector<int32_t> NaiveTopK(const std::vector<float>& row, int64_t budget, int64_t sinks) {
  const int64_t pages = row.size();
  std::vector<int32_t> order;
  for (int64_t j = sinks; j < pages; ++j) order.push_back(j);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return row[a] > row[b]; });
  std::vector<int32_t> out;
  for (int64_t j = 0; j < std::min(sinks, pages); ++j) out.push_back(j);
  for (int64_t j = 0; j < budget && j < static_cast<int64_t>(order.size()); ++j) {
    out.push_back(order[j]);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(PageSelect, TopKTiesGoToTheLowerPage) {
  const std::vector<float> scores = {5, 2, 7, 7, 2, 7, 1};
  std::vector<int32_t> sel(3, -1);
  ASSERT_EQ(PageTopK(scores.data(), 1, 7, 2, 1, sel.data()), 3);
  EXPECT_EQ(sel, (std::vector<int32_t>{0, 2, 3}));
  // All equal: the lowest non-sink pages.
  const std::vector<float> flat(8, 1.0f);
  sel.assign(4, -1);
  ASSERT_EQ(PageTopK(flat.data(), 1, 8, 3, 1, sel.data()), 4);
  EXPECT_EQ(sel, (std::vector<int32_t>{0, 1, 2, 3}));
  // A NaN score ranks below every number, even -inf.
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> odd = {0, kNaN, -inf, kNaN, 3};
  sel.assign(3, -1);
  ASSERT_EQ(PageTopK(odd.data(), 1, 5, 2, 1, sel.data()), 3);
  EXPECT_EQ(sel, (std::vector<int32_t>{0, 2, 4}));
}

TEST(PageSelect, TopKKeepsSinksWhateverTheirScore) {
  const std::vector<float> scores = {-100, -100, 3, 9, 1, 8, 2};
  std::vector<int32_t> sel(4, -1);
  ASSERT_EQ(PageTopK(scores.data(), 1, 7, 2, 2, sel.data()), 4);
  EXPECT_EQ(sel, (std::vector<int32_t>{0, 1, 3, 5}));
  // Budget 0: only the sinks.
  sel.assign(2, -1);
  ASSERT_EQ(PageTopK(scores.data(), 1, 7, 0, 2, sel.data()), 2);
  EXPECT_EQ(sel, (std::vector<int32_t>{0, 1}));
  // No sinks: only the best.
  sel.assign(2, -1);
  ASSERT_EQ(PageTopK(scores.data(), 1, 7, 2, 0, sel.data()), 2);
  EXPECT_EQ(sel, (std::vector<int32_t>{3, 5}));
}

TEST(PageSelect, TopKSelectsEveryPageWhenBudgetCoversThem) {
  // Scores are not even read: NaN poison would otherwise matter.
  const std::vector<float> scores(2 * 5, kNaN);
  for (const auto& [budget, sinks] :
       {std::pair{4, 1}, std::pair{5, 0}, std::pair{0, 5}, std::pair{10, 3}, std::pair{0, 9}}) {
    std::vector<int32_t> sel(10, -1);
    ASSERT_EQ(PageTopK(scores.data(), 2, 5, budget, sinks, sel.data()), 5);
    EXPECT_EQ(sel, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
  }
  // A budget meaning "all" does not overflow.
  std::vector<int32_t> all(10, -1);
  ASSERT_EQ(PageTopK(scores.data(), 2, 5, std::numeric_limits<int64_t>::max(), 1, all.data()), 5);
  EXPECT_EQ(all, (std::vector<int32_t>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
  // No earlier pages: nothing to select.
  EXPECT_EQ(PageTopK(nullptr, 3, 0, 4, 1, nullptr), 0);
}

TEST(PageSelect, TopKMatchesNaiveAndIsSorted) {
  const int64_t tiles = 6, pages = 40, budget = 7, sinks = 2;
  std::mt19937 rng(47);
  std::vector<float> scores = Random(rng, tiles * pages);
  // Some exact ties among the candidates.
  scores[5] = scores[9] = scores[30] = 0.99f;
  scores[pages + 11] = scores[pages + 12] = 2.0f;
  std::vector<int32_t> sel(tiles * (budget + sinks), -1);
  ASSERT_EQ(PageTopK(scores.data(), tiles, pages, budget, sinks, sel.data()), budget + sinks);
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const std::vector<float> row(scores.begin() + tile * pages,
                                 scores.begin() + (tile + 1) * pages);
    const std::vector<int32_t> got(sel.begin() + tile * (budget + sinks),
                                   sel.begin() + (tile + 1) * (budget + sinks));
    EXPECT_EQ(got, NaiveTopK(row, budget, sinks)) << "tile " << tile;
    EXPECT_TRUE(std::is_sorted(got.begin(), got.end()));
    EXPECT_EQ(std::adjacent_find(got.begin(), got.end()), got.end());
  }
}

// --- size: a few thousand positions run well under a second ---

TEST(AttentionReference, FewThousandPositionsMatchTheOracle) {
  // 256 queries after 3072 earlier positions, GQA 4, d_h 128.
  const Dims dims{.t = 256, .hq = 8, .hkv = 2, .d = 128, .p = 128, .pages = 24};
  const Problem pr = MakeProblem(dims, 53);
  PageSelection dense;
  const auto start = std::chrono::steady_clock::now();
  const Fwd f = RunForward(pr, dense);
  const Bwd b = RunBackward(pr, dense, f, pr.DkvPool(nullptr));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // ~0.6 s on one core of the dev machine: printed, not asserted (CI never fails on time; a
  // loaded runner took 4.3 s).
  std::printf("  256 queries over 3,328 positions, forward and backward: %.2f s\n", seconds);
  // Spot-check the first and last queries, every head, against the oracle (all of it would take
  // seconds).
  const Naive naive(pr);
  for (const int64_t i : {int64_t{0}, dims.t - 1}) {
    for (int64_t h = 0; h < dims.hq; ++h) {
      double lse = 0.0;
      const std::vector<double> probs = naive.Probs(i, h, &lse);
      std::vector<double> o(dims.d, 0.0);
      for (int64_t j = 0; j < naive.keys(); ++j) {
        for (int64_t x = 0; x < dims.d; ++x) o[x] += probs[j] * naive.V(j, h)[x];
      }
      const std::span<const float> got(&f.out[(i * dims.hq + h) * dims.d], dims.d);
      EXPECT_LE(RelErr(got, std::span<const double>(o)), 1e-5);
      EXPECT_NEAR(f.lse[i * dims.hq + h], lse, 1e-5 * std::abs(lse) + 1e-6);
    }
  }
  for (const std::vector<float>* v : {&b.dq, &b.dk_own, &b.dv_own}) {
    EXPECT_TRUE(std::all_of(v->begin(), v->end(), [](float x) { return std::isfinite(x); }));
  }
}

}  // namespace
}  // namespace ctxplan::kernels::cpu
