// CUDA paged attention and page selection against the CPU references (ctxplan/kernels/cpu),
// on the same bf16-rounded inputs. Norm-wise relative error ||out - ref|| / ||ref|| <= 1e-2 for
// bf16 outputs; NaN never passes; every output is poisoned with NaN bytes before each run.
// Skips itself when no GPU is present.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "support/gpu.h"

namespace ctxplan::kernels {
namespace {

using cuda::bf16;

// --- host bf16 ---
uint16_t ToBf16Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}
float FromBf16Bits(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
float RoundBf16(float f) {
  return FromBf16Bits(ToBf16Bits(f));
}

// --- device buffers ---
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n > 0) CTXPLAN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
  }
  ~DeviceBuffer() {
    if (p_) cudaFree(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  T* get() const { return p_; }
  size_t size() const { return n_; }
  void Poison() {
    if (p_) CTXPLAN_CUDA_CHECK(cudaMemset(p_, 0xff, n_ * sizeof(T)));
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

DeviceBuffer<bf16> UploadBf16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t i = 0; i < x.size(); ++i) h[i] = ToBf16Bits(x[i]);
  DeviceBuffer<bf16> d(x.size());
  if (!x.empty())
    CTXPLAN_CUDA_CHECK(cudaMemcpy(d.get(), h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return d;
}
template <typename T>
DeviceBuffer<T> Upload(const std::vector<T>& x) {
  DeviceBuffer<T> d(x.size());
  if (!x.empty())
    CTXPLAN_CUDA_CHECK(cudaMemcpy(d.get(), x.data(), x.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}
std::vector<float> DownloadBf16(const DeviceBuffer<bf16>& d) {
  std::vector<uint16_t> h(d.size());
  if (!h.empty())
    CTXPLAN_CUDA_CHECK(cudaMemcpy(h.data(), d.get(), h.size() * 2, cudaMemcpyDeviceToHost));
  std::vector<float> x(h.size());
  for (size_t i = 0; i < h.size(); ++i) x[i] = FromBf16Bits(h[i]);
  return x;
}
template <typename T>
std::vector<T> Download(const DeviceBuffer<T>& d) {
  std::vector<T> h(d.size());
  if (!h.empty())
    CTXPLAN_CUDA_CHECK(cudaMemcpy(h.data(), d.get(), h.size() * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// ||out - ref|| / ||ref||; +inf when anything is NaN/inf or sizes differ.
double RelErr(const std::vector<float>& out, const std::vector<float>& ref) {
  if (out.size() != ref.size()) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i]) || !std::isfinite(ref[i])) return INFINITY;
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  if (den == 0.0) return num == 0.0 ? 0.0 : INFINITY;
  return std::sqrt(num / den);
}

std::vector<float> Sub(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

std::vector<float> RandomBf16(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(n);
  for (auto& v : x) v = RoundBf16(dist(rng));
  return x;
}

constexpr double kTol = 1e-2;

// --- one attention problem: inputs on host (bf16-rounded floats) and device ---
struct Problem {
  int64_t t = 0, hq = 0, hkv = 0, hd = 0, p = 64, pages = 0, extra_slots = 3;
  bool shuffle = true;
  // sparse selection (host); empty = dense
  int64_t query_tile = 128, per_tile = 0;
  std::vector<int32_t> sel;

  float q_scale = 1.5f;  // the queries' amplitude: wider scores move a row's max by more
  std::vector<float> q, k, v, pool, d_out;
  std::vector<int32_t> slots, dkv_slots;
  int64_t num_slots = 0;

  KvPageShape PageShape() const { return {p, hkv, hd}; }
  cpu::AttentionShape CpuShape() const {
    return {t, hq, hkv, hd, 1.0f / std::sqrt(static_cast<float>(hd))};
  }
  cuda::AttentionShape GpuShape() const {
    return {t, hq, hkv, hd, 1.0f / std::sqrt(static_cast<float>(hd))};
  }
  PageSelection CpuSelection() const {
    PageSelection s;
    s.query_tile = query_tile;
    s.pages_per_tile = per_tile;
    s.pages = sel.empty() ? nullptr : sel.data();
    return s;
  }
  bool Sparse() const { return !sel.empty(); }

  void Generate(uint32_t seed) {
    std::mt19937 rng(seed);
    q = RandomBf16(t * hq * hd, rng, q_scale);
    k = RandomBf16(t * hkv * hd, rng);
    v = RandomBf16(t * hkv * hd, rng);
    num_slots = pages + extra_slots;
    pool = RandomBf16(num_slots * PageShape().page_elements(), rng);
    d_out = RandomBf16(t * hq * hd, rng);
    std::vector<int32_t> perm(num_slots);
    std::iota(perm.begin(), perm.end(), 0);
    if (shuffle) std::shuffle(perm.begin(), perm.end(), rng);
    slots.assign(perm.begin(), perm.begin() + pages);
    if (shuffle) std::shuffle(perm.begin(), perm.end(), rng);
    dkv_slots.assign(perm.begin(), perm.begin() + pages);
  }
};

struct FwdResult {
  std::vector<float> out, lse;
};

FwdResult CpuForward(const Problem& pr) {
  FwdResult r;
  r.out.assign(pr.t * pr.hq * pr.hd, 0.0f);
  r.lse.assign(pr.t * pr.hq, 0.0f);
  const PagedKv<const float> earlier{pr.PageShape(), pr.pool.data(), pr.slots.data(), pr.pages};
  cpu::AttentionForward(pr.CpuShape(), pr.q.data(), pr.k.data(), pr.v.data(), earlier,
                        pr.CpuSelection(), r.out.data(), r.lse.data());
  return r;
}

// Device copies of a problem's inputs.
struct DeviceProblem {
  DeviceBuffer<bf16> q, k, v, pool, d_out;
  DeviceBuffer<int32_t> slots, dkv_slots, sel;
  explicit DeviceProblem(const Problem& pr)
      : q(UploadBf16(pr.q)),
        k(UploadBf16(pr.k)),
        v(UploadBf16(pr.v)),
        pool(UploadBf16(pr.pool)),
        d_out(UploadBf16(pr.d_out)),
        slots(Upload(pr.slots)),
        dkv_slots(Upload(pr.dkv_slots)),
        sel(Upload(pr.sel)) {}
  PagedKv<const bf16> Earlier(const Problem& pr) const {
    return {pr.PageShape(), pool.get(), slots.get(), pr.pages};
  }
  PageSelection Selection(const Problem& pr) const {
    PageSelection s;
    s.query_tile = pr.query_tile;
    if (pr.Sparse()) {
      s.pages_per_tile = pr.per_tile;
      s.pages = sel.get();
    }
    return s;
  }
};

FwdResult GpuForward(const Problem& pr, const DeviceProblem& dp) {
  DeviceBuffer<bf16> out(pr.t * pr.hq * pr.hd);
  DeviceBuffer<float> lse(pr.t * pr.hq);
  out.Poison();
  lse.Poison();
  cuda::AttentionForward(pr.GpuShape(), dp.q.get(), dp.k.get(), dp.v.get(), dp.Earlier(pr),
                         dp.Selection(pr), out.get(), lse.get(), nullptr);
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  return {DownloadBf16(out), Download(lse)};
}

struct BwdResult {
  std::vector<float> dq, dk, dv, dkv;  // dkv: the whole pool after accumulation
};

// CPU backward on (out rounded to bf16, lse) from the CPU forward; dkv starts at `dkv_init`.
BwdResult CpuBackward(const Problem& pr, const std::vector<float>& out_b,
                      const std::vector<float>& lse, const std::vector<float>& dkv_init) {
  BwdResult r;
  r.dq.assign(pr.t * pr.hq * pr.hd, 0.0f);
  r.dk.assign(pr.t * pr.hkv * pr.hd, 0.0f);
  r.dv.assign(pr.t * pr.hkv * pr.hd, 0.0f);
  r.dkv = dkv_init;
  const PagedKv<const float> earlier{pr.PageShape(), pr.pool.data(), pr.slots.data(), pr.pages};
  const PagedKv<float> dkv{pr.PageShape(), r.dkv.data(), pr.dkv_slots.data(), pr.pages};
  cpu::AttentionBackward(pr.CpuShape(), pr.q.data(), pr.k.data(), pr.v.data(), earlier,
                         pr.CpuSelection(), out_b.data(), lse.data(), pr.d_out.data(), r.dq.data(),
                         r.dk.data(), r.dv.data(), dkv);
  return r;
}

// The own positions' dKV pages for the fused DkvAccumulate: `pool` values (slots of the problem's
// page shape) and the slot of each own page.
struct OwnDkv {
  std::vector<float> pool;
  std::vector<int32_t> slots;
};

// GPU backward; the dKV pool is fp32 (bf16_pool = false) or bf16, starting at `dkv_init`; the own
// dKV pages, when given, in the same type.
BwdResult GpuBackward(const Problem& pr, const DeviceProblem& dp, const std::vector<float>& out_b,
                      const std::vector<float>& lse, const std::vector<float>& dkv_init,
                      bool bf16_pool, const DeviceBuffer<int32_t>* union_pages = nullptr,
                      int64_t num_union_pages = 0, const OwnDkv* own = nullptr) {
  PageSelection selection = dp.Selection(pr);
  if (union_pages != nullptr) {
    selection.union_pages = union_pages->get();
    selection.num_union_pages = num_union_pages;
  }
  DeviceBuffer<bf16> out = UploadBf16(out_b);
  DeviceBuffer<float> lse_d = Upload(lse);
  DeviceBuffer<bf16> dq(pr.t * pr.hq * pr.hd), dk(pr.t * pr.hkv * pr.hd), dv(pr.t * pr.hkv * pr.hd);
  dq.Poison();
  dk.Poison();
  dv.Poison();
  const size_t ws_bytes = cuda::AttentionBackwardWorkspaceBytes(pr.GpuShape());
  DeviceBuffer<uint8_t> ws(ws_bytes);
  ws.Poison();
  BwdResult r;
  const DeviceBuffer<int32_t> own_slots = Upload(own ? own->slots : std::vector<int32_t>{0});
  const int64_t own_pages = own ? static_cast<int64_t>(own->slots.size()) : 0;
  if (bf16_pool) {
    DeviceBuffer<bf16> pool = UploadBf16(dkv_init);
    DeviceBuffer<bf16> own_pool = UploadBf16(own ? own->pool : std::vector<float>{0.0f});
    const PagedKv<bf16> dkv{pr.PageShape(), pool.get(), dp.dkv_slots.get(), pr.pages};
    const PagedKv<const bf16> own_dkv{pr.PageShape(), own_pool.get(), own_slots.get(), own_pages};
    cuda::AttentionBackward(pr.GpuShape(), dp.q.get(), dp.k.get(), dp.v.get(), dp.Earlier(pr),
                            selection, out.get(), lse_d.get(), dp.d_out.get(), dq.get(), dk.get(),
                            dv.get(), dkv, ws.get(), ws_bytes, nullptr, own ? &own_dkv : nullptr);
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    r.dkv = DownloadBf16(pool);
  } else {
    DeviceBuffer<float> pool = Upload(dkv_init);
    DeviceBuffer<float> own_pool = Upload(own ? own->pool : std::vector<float>{0.0f});
    const PagedKv<float> dkv{pr.PageShape(), pool.get(), dp.dkv_slots.get(), pr.pages};
    const PagedKv<const float> own_dkv{pr.PageShape(), own_pool.get(), own_slots.get(), own_pages};
    cuda::AttentionBackward(pr.GpuShape(), dp.q.get(), dp.k.get(), dp.v.get(), dp.Earlier(pr),
                            selection, out.get(), lse_d.get(), dp.d_out.get(), dq.get(), dk.get(),
                            dv.get(), dkv, ws.get(), ws_bytes, nullptr, own ? &own_dkv : nullptr);
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    r.dkv = Download(pool);
  }
  r.dq = DownloadBf16(dq);
  r.dk = DownloadBf16(dk);
  r.dv = DownloadBf16(dv);
  return r;
}

// Every entry of the dKV pool outside the listed (and touched) slots must be bit-identical.
void ExpectUntouched(const Problem& pr, const std::vector<float>& before,
                     const std::vector<float>& after, const std::vector<bool>& touched_page) {
  const int64_t pe = pr.PageShape().page_elements();
  std::vector<bool> written(pr.num_slots, false);
  for (int64_t pg = 0; pg < pr.pages; ++pg)
    if (touched_page[pg]) written[pr.dkv_slots[pg]] = true;
  int64_t bad = 0;
  for (int64_t s = 0; s < pr.num_slots; ++s) {
    if (written[s]) continue;
    for (int64_t e = 0; e < pe; ++e)
      if (std::memcmp(&before[s * pe + e], &after[s * pe + e], 4) != 0) ++bad;
  }
  EXPECT_EQ(bad, 0) << "dKV entries changed outside the touched pages";
}

std::vector<bool> TouchedPages(const Problem& pr) {
  std::vector<bool> touched(pr.pages, !pr.Sparse());
  for (int32_t pg : pr.sel) touched[pg] = true;
  return touched;
}

// Full check of one problem: forward (out, lse) and backward (dq, dk, dv, dkv accumulation).
void CheckProblem(Problem pr, uint32_t seed, bool backward = true, bool bf16_pool = false) {
  pr.Generate(seed);
  SCOPED_TRACE("t=" + std::to_string(pr.t) + " hq=" + std::to_string(pr.hq) +
               " hkv=" + std::to_string(pr.hkv) + " hd=" + std::to_string(pr.hd) +
               " p=" + std::to_string(pr.p) + " pages=" + std::to_string(pr.pages) +
               (pr.Sparse() ? " sparse" : " dense"));
  const DeviceProblem dp(pr);
  const FwdResult ref = CpuForward(pr);
  const FwdResult got = GpuForward(pr, dp);
  EXPECT_LE(RelErr(got.out, ref.out), kTol) << "forward out";
  EXPECT_LE(RelErr(got.lse, ref.lse), kTol) << "forward lse";
  // LSE is absolute: also bound it element-wise.
  double max_lse = 0.0;
  for (size_t i = 0; i < ref.lse.size(); ++i)
    max_lse = std::max(max_lse, std::abs(static_cast<double>(got.lse[i]) - ref.lse[i]));
  EXPECT_LE(max_lse, 2e-2) << "forward lse max abs error";
  if (!backward) return;

  std::vector<float> out_b(ref.out.size());
  for (size_t i = 0; i < out_b.size(); ++i) out_b[i] = RoundBf16(ref.out[i]);
  const int64_t pool_elems = pr.num_slots * pr.PageShape().page_elements();
  const std::vector<float> zeros(pool_elems, 0.0f);
  const BwdResult grad = CpuBackward(pr, out_b, ref.lse, zeros);  // dkv = the increment
  // dKV starts non-zero, of the increment's size: the kernel must add, not overwrite.
  double rms = 0.0;
  for (float x : grad.dkv) rms += static_cast<double>(x) * x;
  rms = pr.pages > 0 ? std::sqrt(rms / std::max<int64_t>(1, pool_elems)) : 1.0;
  std::mt19937 rng(seed + 7);
  std::vector<float> init = RandomBf16(pool_elems, rng, static_cast<float>(std::max(rms, 1e-3)));
  std::vector<float> expect(pool_elems);
  for (int64_t i = 0; i < pool_elems; ++i) expect[i] = init[i] + grad.dkv[i];

  const BwdResult g = GpuBackward(pr, dp, out_b, ref.lse, init, bf16_pool);
  EXPECT_LE(RelErr(g.dq, grad.dq), kTol) << "dq";
  EXPECT_LE(RelErr(g.dk, grad.dk), kTol) << "dk own";
  EXPECT_LE(RelErr(g.dv, grad.dv), kTol) << "dv own";
  if (pr.pages > 0) {
    // The increment, measured against the reference increment.
    EXPECT_LE(RelErr(Sub(g.dkv, init), grad.dkv), kTol) << "dkv accumulation";
    EXPECT_LE(RelErr(g.dkv, expect), kTol) << "dkv final";
    ExpectUntouched(pr, init, g.dkv, TouchedPages(pr));
  }
}

Problem Make(int64_t t, int64_t hq, int64_t hkv, int64_t hd, int64_t p, int64_t pages) {
  Problem pr;
  pr.t = t;
  pr.hq = hq;
  pr.hkv = hkv;
  pr.hd = hd;
  pr.p = p;
  pr.pages = pages;
  return pr;
}

// --- forward + backward vs the CPU reference ---
TEST(GpuAttention, Gqa7Hd128Paged) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(300, 14, 2, 128, 64, 5), 1);  // t not a multiple of the tile
}
TEST(GpuAttention, Gqa1Hd64SmallPages) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(200, 3, 3, 64, 16, 9), 2);  // p = 16: tiles span pages
}
TEST(GpuAttention, Gqa4Hd128SinglePage) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(130, 8, 2, 128, 128, 1), 3);
}
TEST(GpuAttention, Gqa4Hd64NoEarlierPages) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(257, 8, 2, 64, 64, 0), 4);
}
TEST(GpuAttention, Gqa7Hd64Page32) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(77, 7, 1, 64, 32, 7), 5);  // p = 32, t < one tile
}
TEST(GpuAttention, Gqa1Hd128Page128) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(384, 2, 2, 128, 128, 3), 6);
}
TEST(GpuAttention, BackwardBf16DkvPool) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(190, 8, 2, 128, 64, 3), 7, true, /*bf16_pool=*/true);
}
// Page sizes off the powers of two (chunks of 3072 and 6144 take them): the kernels' blocks of 64
// or 128 keys then straddle pages.
TEST(GpuAttention, PagesOf48And96And192) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(300, 14, 2, 128, 96, 5), 10);
  CheckProblem(Make(200, 8, 2, 64, 48, 7), 11);
  CheckProblem(Make(384, 28, 4, 128, 192, 3), 12);
  // Page-sparse over them: the forward's loader walks each tile's selected pages by a cursor.
  Problem sparse96 = Make(256, 8, 2, 128, 96, 10);
  sparse96.per_tile = 3;
  sparse96.sel = {1, 4, 7, 0, 2, 9};  // 2 tiles of 128 queries
  CheckProblem(sparse96, 13);
  Problem sparse48 = Make(384, 8, 4, 64, 48, 9);
  sparse48.per_tile = 2;
  sparse48.sel = {0, 5, 3, 8, 1, 2};  // 3 tiles
  CheckProblem(sparse48, 14);
  Problem sparse32 = Make(256, 14, 2, 128, 32, 12);
  sparse32.per_tile = 5;
  sparse32.sel = {0, 2, 3, 7, 11, 1, 4, 5, 6, 10};
  CheckProblem(sparse32, 15);
}
// The forward's page loaders: TMA groups (p a multiple of 32), cp.async groups of 16 rows (of
// 16; any such p under CTXPLAN_ATTN_FWD_PAGES=groups) and the row cursor (the rest, or any p
// under =cursor).
TEST(GpuAttention, EveryForwardPageLoader) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(300, 8, 2, 128, 80, 6), 16, /*backward=*/false);  // groups: 80 = 5 x 16
  CheckProblem(Make(260, 8, 4, 64, 24, 9), 17, /*backward=*/false);   // cursor: 24
  Problem sparse80 = Make(256, 8, 2, 128, 80, 9);
  sparse80.per_tile = 3;
  sparse80.sel = {1, 4, 8, 0, 2, 6};  // 2 tiles of 128 queries
  CheckProblem(sparse80, 18, /*backward=*/false);
  CheckProblem(Make(300, 8, 2, 64, 256, 3), 31, /*backward=*/false);  // TMA: whole pages
  Problem sparse128 = Make(256, 8, 2, 128, 128, 6);
  sparse128.per_tile = 2;
  sparse128.sel = {1, 5, 0, 3};
  CheckProblem(sparse128, 32, /*backward=*/false);
  Problem sparse96 = Make(256, 8, 2, 128, 96, 9);  // TMA groups of 32: 288 keys, 2.25 tiles
  sparse96.per_tile = 3;
  sparse96.sel = {1, 4, 8, 0, 2, 6};
  CheckProblem(sparse96, 35, /*backward=*/false);
  setenv("CTXPLAN_ATTN_FWD_PAGES", "groups", 1);  // cp.async groups at multiples of 32 too
  CheckProblem(Make(300, 8, 2, 64, 256, 3), 33, /*backward=*/false);
  CheckProblem(sparse128, 34, /*backward=*/false);
  CheckProblem(sparse96, 36, /*backward=*/false);
  setenv("CTXPLAN_ATTN_FWD_PAGES", "cursor", 1);
  CheckProblem(Make(300, 14, 2, 128, 96, 5), 22, /*backward=*/false);
  CheckProblem(Make(384, 8, 2, 64, 128, 4), 23, /*backward=*/false);
  Problem sparse64 = Make(256, 8, 2, 128, 64, 10);
  sparse64.per_tile = 4;
  sparse64.sel = {0, 3, 4, 8, 0, 1, 5, 9};
  CheckProblem(sparse64, 24, /*backward=*/false);
  unsetenv("CTXPLAN_ATTN_FWD_PAGES");
}
// Head_dim 64 forward without a page selection on three consumer warpgroups and 192-query blocks
// (CTXPLAN_ATTN_FWD_CONSUMERS=3: at these few blocks AttentionForwardQueryRows keeps 128): whole
// and partial blocks, a page list ending inside a key tile, every page loader (16-row TMA boxes
// where 16 divides p, cp.async groups under CTXPLAN_ATTN_FWD_PAGES=groups, the row cursor); and
// the two-consumer blocks the rule takes elsewhere (page-sparse d_h 64 runs them always).
TEST(GpuAttention, HeadDim64ForwardOnThreeConsumers) {
  SKIP_WITHOUT_GPU();
  setenv("CTXPLAN_ATTN_FWD_CONSUMERS", "3", 1);
  CheckProblem(Make(576, 8, 2, 64, 128, 0), 70, /*backward=*/false);  // 3 whole blocks
  CheckProblem(Make(1000, 8, 2, 64, 64, 3), 71, /*backward=*/false);  // 5 whole + 40 rows
  CheckProblem(Make(450, 12, 4, 64, 48, 5), 72, /*backward=*/false);  // TMA boxes of 16 rows
  CheckProblem(Make(390, 4, 4, 64, 40, 7), 73, /*backward=*/false);   // row cursor, 280 keys
  setenv("CTXPLAN_ATTN_FWD_PAGES", "groups", 1);
  CheckProblem(Make(450, 12, 4, 64, 48, 5), 75, /*backward=*/false);  // cp.async groups
  unsetenv("CTXPLAN_ATTN_FWD_PAGES");
  setenv("CTXPLAN_ATTN_FWD_CONSUMERS", "2", 1);
  CheckProblem(Make(1000, 8, 2, 64, 64, 3), 74, /*backward=*/false);
  unsetenv("CTXPLAN_ATTN_FWD_CONSUMERS");
}
// Page-sparse head_dim 64 forward on three consumers over query-head slices
// (CTXPLAN_ATTN_FWD_SLICES=on): GQA groups 1-5 and 7 (blocks of two and three 64-query slices
// of one tile, from two heads), a partial last tile, a selection of 256 queries (two 128-query
// tiles on one page list), TMA boxes of 64 and 16 rows and the row cursor.
TEST(GpuAttention, HeadDim64SparseForwardOnQueryHeadSlices) {
  SKIP_WITHOUT_GPU();
  setenv("CTXPLAN_ATTN_FWD_SLICES", "on", 1);
  auto sparse = [](int64_t t, int64_t group, int64_t p, int64_t pages, int64_t query_tile) {
    Problem pr = Make(t, 2 * group, 2, 64, p, pages);
    pr.query_tile = query_tile;
    pr.per_tile = 3;
    for (int64_t i = 0; i < (t + query_tile - 1) / query_tile; ++i) {
      std::vector<int32_t> tile;  // 3 distinct pages (pages is not a multiple of 3)
      for (int64_t j = 0; j < pr.per_tile; ++j) tile.push_back((i + 3 * j) % pages);
      std::sort(tile.begin(), tile.end());
      pr.sel.insert(pr.sel.end(), tile.begin(), tile.end());
    }
    return pr;
  };
  for (const int64_t group : {1, 2, 3, 4, 5, 7}) {
    SCOPED_TRACE(group);
    CheckProblem(sparse(300, group, 64, 7, 128), 110 + group, /*backward=*/false);
  }
  CheckProblem(sparse(500, 4, 128, 5, 256), 120, /*backward=*/false);  // selections of 256
  CheckProblem(sparse(260, 3, 48, 8, 128), 121, /*backward=*/false);   // 16-row TMA boxes
  CheckProblem(sparse(200, 4, 40, 10, 128), 122, /*backward=*/false);  // the row cursor
  setenv("CTXPLAN_ATTN_FWD_PAGES", "groups", 1);  // the slices take TMA boxes even so
  CheckProblem(sparse(260, 3, 48, 8, 128), 123, /*backward=*/false);
  unsetenv("CTXPLAN_ATTN_FWD_PAGES");
  unsetenv("CTXPLAN_ATTN_FWD_SLICES");
}
// The forward's lazy rescale (a row's stabiliser moves only where its max passes it by more than
// 2^8) against the CPU reference and under CTXPLAN_ATTN_FWD_RESCALE=always, at scores wide enough
// (queries of amplitude 12: a score's spread is ~17 in log2 units) that rows move theirs on some
// tiles and not on others: both head dims, two and three consumers, dense over pages, own-only and
// page-sparse (the slices among them).
TEST(GpuAttention, LazyRescaleAtWideScores) {
  SKIP_WITHOUT_GPU();
  auto wide = [](Problem pr) {
    pr.q_scale = 12.0f;
    return pr;
  };
  auto sparse = [&](int64_t t, int64_t hq, int64_t hkv, int64_t hd) {
    Problem pr = wide(Make(t, hq, hkv, hd, 64, 9));
    pr.per_tile = 4;
    for (int64_t i = 0; i < (t + 127) / 128; ++i)
      for (int64_t j = 0; j < pr.per_tile; ++j)
        pr.sel.push_back(static_cast<int32_t>(2 * j + i % 2));
    return pr;
  };
  for (const char* mode : {"lazy", "always"}) {
    SCOPED_TRACE(mode);
    if (std::strcmp(mode, "always") == 0) setenv("CTXPLAN_ATTN_FWD_RESCALE", "always", 1);
    CheckProblem(wide(Make(700, 4, 2, 128, 64, 6)), 130, /*backward=*/false);
    CheckProblem(wide(Make(700, 4, 2, 64, 64, 6)), 131, /*backward=*/false);
    CheckProblem(wide(Make(900, 8, 2, 64, 64, 0)), 132, /*backward=*/false);
    setenv("CTXPLAN_ATTN_FWD_CONSUMERS", "3", 1);
    CheckProblem(wide(Make(900, 8, 2, 64, 64, 0)), 133, /*backward=*/false);
    unsetenv("CTXPLAN_ATTN_FWD_CONSUMERS");
    CheckProblem(sparse(600, 8, 2, 128), 134, /*backward=*/false);
    CheckProblem(sparse(600, 8, 2, 64), 135, /*backward=*/false);
    setenv("CTXPLAN_ATTN_FWD_SLICES", "on", 1);
    CheckProblem(sparse(600, 8, 2, 64), 136, /*backward=*/false);
    unsetenv("CTXPLAN_ATTN_FWD_SLICES");
  }
  unsetenv("CTXPLAN_ATTN_FWD_RESCALE");
}

// The two-warpgroup backward at every small count of a block's items (1-5 and 7: the deferred
// whole dQ of an odd and an even last item, operands reloaded into both buffers), dense, over
// earlier pages and gathered, rows past t, at both head dims.
TEST(GpuAttention, TwoWarpgroupBackwardAtEveryItemCount) {
  SKIP_WITHOUT_GPU();
  for (const int64_t t : {64, 128, 192, 256, 320, 448}) {
    SCOPED_TRACE(t);
    CheckProblem(Make(t, 2, 2, 128, 128, 0), 40 + t / 64);  // own blocks: ceil(t / 64) items
    CheckProblem(Make(t - 5, 6, 2, 128, 128, 2), 50 + t / 64);
    CheckProblem(Make(t - 3, 8, 2, 64, 128, 1), 60 + t / 64);  // head_dim 64: a 16 KB dQ
  }
  CheckProblem(Make(300, 14, 2, 128, 128, 3), 25);
  Problem sparse64 = Make(200, 8, 4, 64, 64, 4);  // head_dim 64: gathered blocks
  sparse64.per_tile = 2;
  sparse64.sel = {0, 3, 1, 2};
  CheckProblem(sparse64, 26);
  Problem sparse = Make(256, 8, 2, 128, 96, 9);
  sparse.per_tile = 3;
  sparse.sel = {1, 4, 8, 0, 2, 6};
  CheckProblem(sparse, 27);
}
// The two-warpgroup backward with its producer warpgroup (the default; =dense keeps gathered
// blocks without one) and without (CTXPLAN_ATTN_BWD_PRODUCER=off): every small item count (each
// operands buffer reloaded after both warpgroups' releases, the last staged dQ of an odd and an
// even item), own blocks one a KV head and one a query head, earlier pages over every position,
// rows past t, both head dims, and gathered blocks.
TEST(GpuAttention, TwoWarpgroupBackwardWithAndWithoutProducer) {
  SKIP_WITHOUT_GPU();
  for (const char* producer : {"on", "off", "dense"}) {
    setenv("CTXPLAN_ATTN_BWD_PRODUCER", producer, 1);
    for (const char* split : {"off", "on"}) {
      setenv("CTXPLAN_ATTN_BWD_SPLIT", split, 1);
      for (const int64_t t : {64, 128, 192, 256, 320, 448}) {
        SCOPED_TRACE(std::string(producer) + " " + split + " " + std::to_string(t));
        CheckProblem(Make(t, 2, 2, 128, 128, 0), 70 + t / 64);
        CheckProblem(Make(t - 5, 14, 2, 128, 128, 2), 80 + t / 64);
        CheckProblem(Make(t - 3, 8, 2, 64, 64, 1), 90 + t / 64);
      }
      // Gathered page-sparse blocks (a producer but under =dense and =off): pages of 96 and 128,
      // both head dims.
      Problem sparse = Make(256, 8, 2, 128, 96, 9);
      sparse.per_tile = 3;
      sparse.sel = {1, 4, 8, 0, 2, 6};
      CheckProblem(sparse, 100);
      Problem sparse128 = Make(448, 14, 2, 128, 128, 6);
      sparse128.per_tile = 3;
      sparse128.sel = {0, 2, 5, 1, 3, 4, 0, 4, 5, 1, 2, 3};
      CheckProblem(sparse128, 101);
      Problem sparse64 = Make(200, 8, 4, 64, 64, 4);
      sparse64.per_tile = 2;
      sparse64.sel = {0, 3, 1, 2};
      CheckProblem(sparse64, 102);
    }
  }
  unsetenv("CTXPLAN_ATTN_BWD_SPLIT");
  unsetenv("CTXPLAN_ATTN_BWD_PRODUCER");
}
// dK, dV and the dKV pages of dense key blocks (no atomics) repeat bit for bit, run after run: a
// block reading its K and V before they had landed (a cp.async group never committed) made them
// differ in 16 of 40 runs at d_h 128 (H100).
TEST(GpuAttention, DenseBackwardRepeatsItself) {
  SKIP_WITHOUT_GPU();
  for (const Problem& base : {Make(384, 28, 4, 128, 192, 3), Make(1000, 28, 4, 128, 128, 4),
                              Make(700, 32, 8, 64, 64, 5)}) {
    Problem pr = base;
    pr.Generate(21);
    const DeviceProblem dp(pr);
    const FwdResult f = GpuForward(pr, dp);
    const std::vector<float> init(pr.num_slots * pr.PageShape().page_elements(), 0.5f);
    const BwdResult first = GpuBackward(pr, dp, f.out, f.lse, init, false);
    int differ = 0;
    for (int rep = 0; rep < 30; ++rep) {
      const BwdResult again = GpuBackward(pr, dp, f.out, f.lse, init, false);
      const bool same = std::memcmp(again.dk.data(), first.dk.data(), first.dk.size() * 4) == 0 &&
                        std::memcmp(again.dv.data(), first.dv.data(), first.dv.size() * 4) == 0 &&
                        std::memcmp(again.dkv.data(), first.dkv.data(), first.dkv.size() * 4) == 0;
      if (!same) ++differ;
    }
    EXPECT_EQ(differ, 0) << "t=" << pr.t << " hd=" << pr.hd;
  }
}
TEST(GpuAttention, TinyChunk) {
  SKIP_WITHOUT_GPU();
  CheckProblem(Make(1, 4, 1, 128, 64, 2), 8);
  CheckProblem(Make(17, 4, 4, 64, 16, 1), 9);
}

// Head_dim 64 dense on the 64-key blocks, two a multiprocessor (CTXPLAN_ATTN_BWD_KEYS=64, kept to
// compare with the default 128-key blocks): own positions, and earlier pages over every position.
TEST(GpuAttention, HeadDim64OnSixtyFourKeyBlocks) {
  SKIP_WITHOUT_GPU();
  setenv("CTXPLAN_ATTN_BWD_KEYS", "64", 1);
  CheckProblem(Make(300, 8, 2, 64, 64, 0), 44);
  CheckProblem(Make(257, 32, 8, 64, 128, 3), 45);
  unsetenv("CTXPLAN_ATTN_BWD_KEYS");
}

// --- real top-k selection (sinks + top pages per 128-query tile) ---
// pr.sel: each tile's `sinks` first pages and its `budget` best of uniform random scores
// (rng_seed).
void SelectTopK(Problem& pr, int64_t budget, int64_t sinks, uint32_t rng_seed) {
  const int64_t tiles = (pr.t + pr.query_tile - 1) / pr.query_tile;
  std::vector<float> scores(tiles * pr.pages);
  std::mt19937 rng(rng_seed);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (auto& s : scores) s = u(rng);
  pr.per_tile = std::min(pr.pages, sinks + budget);
  pr.sel.assign(tiles * pr.per_tile, -1);
  cpu::PageTopK(scores.data(), tiles, pr.pages, budget, sinks, pr.sel.data());
}

// The pages some tile selected, ascending (the runtime's AttendedPages).
std::vector<int32_t> UnionOf(const std::vector<int32_t>& sel) {
  std::vector<int32_t> pages(sel.begin(), sel.end());
  std::sort(pages.begin(), pages.end());
  pages.erase(std::unique(pages.begin(), pages.end()), pages.end());
  return pages;
}

TEST(GpuAttention, SparseTopK) {
  SKIP_WITHOUT_GPU();
  for (int variant = 0; variant < 2; ++variant) {
    Problem pr = variant == 0 ? Make(300, 14, 2, 128, 64, 12) : Make(256, 4, 4, 64, 16, 20);
    pr.Generate(11 + variant);
    SelectTopK(pr, variant == 0 ? 3 : 6, 1, 99 + variant);
    // CheckProblem regenerates the same inputs from the seed; keep the selection.
    CheckProblem(pr, 11 + variant);
  }
}

// The sparse backward launched over the union of the tiles' selections only equals the one
// launched over every earlier page: the own positions' dK/dV bit for bit, the pages no tile
// selected untouched in the dKV pool (no block of an unselected page writes anything), dQ up to
// the order of its fp32 adds (dQ is rounded to bf16 after them, so another order flips the last
// bit of a few elements: 1.1e-5 measured on the H200). Pages of 128 and 64 tokens (64- and
// 128-key blocks, which start where the blocks over every position do): the whole dKV pool bit
// for bit. Pages of 96, 192 and 48, whose blocks over the union end at their page's end (a block
// over every position spans two pages): a key's items come in another order (ItemOrder rotates
// by the block's first key), so the selected pages' dKV agree to fp32 (or bf16) rounding.
TEST(GpuAttention, SparseBackwardOverTheUnionEqualsAllBlocks) {
  SKIP_WITHOUT_GPU();
  setenv("CTXPLAN_ATTN_BWD_SPARSE", "union", 1);  // key blocks, never gathered
  struct Shape {
    int64_t t, hq, hkv, hd, p, pages;
  };
  for (const Shape sh :
       {Shape{384, 14, 2, 128, 128, 24}, Shape{256, 8, 2, 128, 64, 40},
        Shape{256, 8, 4, 64, 128, 16}, Shape{256, 8, 2, 128, 96, 30},
        Shape{256, 8, 2, 128, 192, 14}, Shape{256, 8, 2, 128, 48, 40}, Shape{256, 8, 4, 64, 96, 20},
        Shape{256, 8, 4, 64, 64, 30}, Shape{256, 8, 2, 64, 32, 40}}) {
    Problem pr = Make(sh.t, sh.hq, sh.hkv, sh.hd, sh.p, sh.pages);
    pr.Generate(31);
    SelectTopK(pr, 3, 1, 77);
    const std::vector<int32_t> union_pages = UnionOf(pr.sel);
    ASSERT_LT(static_cast<int64_t>(union_pages.size()), pr.pages);  // some pages unselected

    const DeviceProblem dp(pr);
    const FwdResult f = GpuForward(pr, dp);
    std::mt19937 init_rng(5);
    const std::vector<float> dkv_init =
        RandomBf16(pr.num_slots * pr.PageShape().page_elements(), init_rng);
    const DeviceBuffer<int32_t> union_dev = Upload(union_pages);
    // The key blocks of either launch start at the same keys: 64-key blocks for pages of 64 or
    // fewer tokens, else 128 (at both head dims).
    const int64_t block_keys = sh.p <= 64 ? 64 : 128;
    const bool same_blocks = sh.p % block_keys == 0;
    const int64_t pe = pr.PageShape().page_elements();
    for (const bool bf16_pool : {false, true}) {
      const BwdResult all = GpuBackward(pr, dp, f.out, f.lse, dkv_init, bf16_pool);
      const BwdResult over_union =
          GpuBackward(pr, dp, f.out, f.lse, dkv_init, bf16_pool, &union_dev,
                      static_cast<int64_t>(union_pages.size()));
      const std::string where = "t " + std::to_string(sh.t) + " hd " + std::to_string(sh.hd) +
                                " p " + std::to_string(sh.p) + (bf16_pool ? " bf16" : " fp32");
      EXPECT_EQ(RelErr(over_union.dk, all.dk), 0.0) << where;
      EXPECT_EQ(RelErr(over_union.dv, all.dv), 0.0) << where;
      if (same_blocks) {
        EXPECT_EQ(RelErr(over_union.dkv, all.dkv), 0.0) << where;
      } else {
        EXPECT_LE(RelErr(over_union.dkv, all.dkv), bf16_pool ? 1e-4 : 1e-6) << where;
      }
      for (int64_t pg = 0; pg < pr.pages; ++pg) {
        if (std::binary_search(union_pages.begin(), union_pages.end(), static_cast<int32_t>(pg)))
          continue;
        const int64_t at = pr.dkv_slots[pg] * pe;
        for (const BwdResult* r : {&all, &over_union})
          ASSERT_TRUE(
              std::equal(r->dkv.begin() + at, r->dkv.begin() + at + pe, dkv_init.begin() + at))
              << where << ": unselected page " << pg << " written";
      }
      EXPECT_LE(RelErr(over_union.dq, all.dq), 1e-4) << where;
    }
  }
  unsetenv("CTXPLAN_ATTN_BWD_SPARSE");
}

// At GQA groups of 1 and 2 the page-sparse backward takes key blocks over the union where
// AttentionBackwardOverUnion says (the runtime passes the union); what they compute is the gathered
// blocks' (CTXPLAN_ATTN_BWD_SPARSE=gather), which the test below checks against the CPU reference:
// to fp32 rounding on an fp32 dKV pool (the gathered blocks add dK/dV by atomics), to a few bf16
// roundings on a bf16 one.
TEST(GpuAttention, GroupsOfOneAndTwoTakeTheUnionAsGatheredBlocksWould) {
  SKIP_WITHOUT_GPU();
  struct Shape {
    int64_t t, hq, hkv, hd, p, pages;
  };
  // At group 1 also pages that are not whole 128-key blocks: 48 and 64 in one-warpgroup 64-key
  // blocks, 96 in 128-key blocks three quarters full, 192 at head_dim 64 in 64-key halves two a
  // block, of one page or two (an odd count of halves leaves the last block's second warpgroup
  // without keys); at group 2 on a bf16 pool 64 and 192 at head_dim 64, 96 and 192 at 128.
  for (const Shape sh : {Shape{256, 4, 4, 64, 128, 24},   Shape{384, 2, 2, 64, 128, 12},
                         Shape{200, 3, 3, 64, 256, 9},    Shape{4096, 2, 2, 128, 128, 40},
                         Shape{3072, 4, 2, 64, 256, 20},  Shape{3200, 4, 2, 64, 128, 41},
                         Shape{256, 4, 4, 64, 64, 48},    Shape{1000, 2, 2, 64, 192, 13},
                         Shape{4096, 2, 2, 128, 64, 81},  Shape{384, 2, 2, 64, 48, 40},
                         Shape{576, 3, 3, 64, 96, 22},    Shape{2048, 2, 2, 64, 192, 21},
                         Shape{1024, 2, 2, 128, 128, 20}, Shape{1536, 2, 2, 128, 96, 30},
                         Shape{2048, 3, 3, 128, 64, 41},  Shape{3072, 4, 2, 64, 64, 60},
                         Shape{3072, 4, 2, 64, 192, 21},  Shape{1024, 4, 2, 128, 128, 20},
                         Shape{1536, 4, 2, 128, 96, 30},  Shape{1536, 4, 2, 128, 192, 15}}) {
    // (Head dim 128 under 4096 tokens, and group 2 at head dim 128 under 16384 or over pages that
    // are not whole 128-key blocks: the union on a bf16 pool only.)
    ASSERT_TRUE(AttentionBackwardOverUnion(sh.t, sh.hq, sh.hkv, sh.hd, sh.p, /*dkv_f32=*/false));
    Problem pr = Make(sh.t, sh.hq, sh.hkv, sh.hd, sh.p, sh.pages);
    pr.Generate(53);
    SelectTopK(pr, 4, 1, 91);
    const std::vector<int32_t> union_pages = UnionOf(pr.sel);
    const DeviceProblem dp(pr);
    const FwdResult f = GpuForward(pr, dp);
    std::mt19937 init_rng(6);
    const std::vector<float> dkv_init =
        RandomBf16(pr.num_slots * pr.PageShape().page_elements(), init_rng);
    const DeviceBuffer<int32_t> union_dev = Upload(union_pages);
    const auto n_union = static_cast<int64_t>(union_pages.size());
    for (const bool bf16_pool : {false, true}) {
      if (!AttentionBackwardOverUnion(sh.t, sh.hq, sh.hkv, sh.hd, sh.p, !bf16_pool)) continue;
      const std::string where = "t " + std::to_string(sh.t) + " heads " + std::to_string(sh.hq) +
                                "/" + std::to_string(sh.hkv) + " hd " + std::to_string(sh.hd) +
                                " p " + std::to_string(sh.p) + (bf16_pool ? " bf16" : " fp32");
      const BwdResult by_union =
          GpuBackward(pr, dp, f.out, f.lse, dkv_init, bf16_pool, &union_dev, n_union);
      setenv("CTXPLAN_ATTN_BWD_SPARSE", "gather", 1);
      const BwdResult gathered =
          GpuBackward(pr, dp, f.out, f.lse, dkv_init, bf16_pool, &union_dev, n_union);
      unsetenv("CTXPLAN_ATTN_BWD_SPARSE");
      // dK and dV (bf16) of the own positions: in 64-key blocks the items come in another order
      // than in the gathered launch's 128-key own blocks, so a few sums round to the other bf16
      // neighbour (1.2-1.4e-4 measured at 4096 tokens, d_h 128).
      const double own_tolerance = UnionKeyBlocksOf(sh.p, sh.hd).keys == 64 ? 5e-4 : 1e-4;
      EXPECT_LE(RelErr(by_union.dq, gathered.dq), 1e-4) << where;
      EXPECT_LE(RelErr(by_union.dk, gathered.dk), own_tolerance) << where;
      EXPECT_LE(RelErr(by_union.dv, gathered.dv), own_tolerance) << where;
      // A bf16 pool: the union adds a page's dK/dV once, the gathered blocks once a tile that
      // selected it (bf16 atomics, each rounded): apart by a few bf16 roundings (2^-8).
      EXPECT_LE(RelErr(by_union.dkv, gathered.dkv), bf16_pool ? 1e-2 : 1e-5) << where;
      EXPECT_GT(RelErr(by_union.dkv, dkv_init), 1e-3) << where << ": no page's dKV was added";
    }
  }
}

// Gathered key blocks (a selection tile's selected positions, 128 at a time, dK/dV added into the
// dKV pages by atomics) against the CPU reference at every page size the sweep times, power of
// two or not, both head dims, fp32 and bf16 dKV pools, a real top-k selection of 4 pages a tile
// (the last group of a tile part full where 4 p is not a multiple of 128).
TEST(GpuAttention, GatheredSparseBackwardAtEveryPageSize) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 60;
  for (const int64_t hd : {int64_t{128}, int64_t{64}}) {
    for (const int64_t p : {32, 48, 64, 96, 128, 192, 256}) {
      Problem pr =
          hd == 128 ? Make(300, 14, 2, 128, p, 2048 / p + 3) : Make(256, 8, 4, 64, p, 2048 / p + 3);
      SelectTopK(pr, 3, 1, seed);
      CheckProblem(pr, seed++, true, /*bf16_pool=*/p == 96 || p == 32);
    }
  }
}

// DkvAccumulate fused into the backward (own_dkv): dK/dV of the own positions are this
// backward's plus what later chunks left in their pages, rounded to bf16 once instead of twice;
// dQ and the earlier pages' dKV are those of the plain backward (page-sparse, to the order of
// the gathered blocks' atomics). Dense and page-sparse, head_dim
// 128 and 64 (both wgmma), a partly filled last own page, own slots out of order.
// The own positions' dK/dV written with the dKV that later chunks left in their pages added.
void CheckFusedOwnDkvAccumulate() {
  struct Shape {
    int64_t t, hq, hkv, hd, p, pages, per_tile;
  };
  // The last two: no earlier pages (a first chunk), d_h 128 and 64.
  for (const Shape sh : {Shape{300, 14, 2, 128, 64, 6, 0}, Shape{384, 14, 2, 128, 128, 8, 3},
                         Shape{256, 8, 4, 64, 64, 5, 0}, Shape{200, 14, 2, 128, 64, 0, 0},
                         Shape{129, 8, 4, 64, 64, 0, 0}}) {
    Problem pr = Make(sh.t, sh.hq, sh.hkv, sh.hd, sh.p, sh.pages);
    pr.Generate(41);
    if (sh.per_tile > 0) {
      const int64_t tiles = (pr.t + pr.query_tile - 1) / pr.query_tile;
      pr.per_tile = sh.per_tile;
      pr.sel.clear();
      for (int64_t i = 0; i < tiles; ++i)
        for (int64_t j = 0; j < sh.per_tile; ++j)
          pr.sel.push_back(static_cast<int32_t>((i + 2 * j) % pr.pages));
      for (int64_t i = 0; i < tiles; ++i)
        std::sort(pr.sel.begin() + i * sh.per_tile, pr.sel.begin() + (i + 1) * sh.per_tile);
    }
    const int64_t own_pages = (pr.t + pr.p - 1) / pr.p;
    OwnDkv own;
    for (int64_t i = 0; i < own_pages; ++i)
      own.slots.push_back(static_cast<int32_t>(own_pages - i));
    std::mt19937 rng(8);
    const int64_t pe = pr.PageShape().page_elements();
    own.pool = RandomBf16((own_pages + 1) * pe, rng, 0.5f);

    const DeviceProblem dp(pr);
    const FwdResult f = GpuForward(pr, dp);
    const std::vector<float> dkv_init = RandomBf16(pr.num_slots * pe, rng);
    const std::string where = "t " + std::to_string(sh.t) + " hd " + std::to_string(sh.hd) + " p " +
                              std::to_string(sh.p) + (sh.per_tile ? " sparse" : " dense");
    for (const bool bf16_pool : {false, true}) {
      const BwdResult plain = GpuBackward(pr, dp, f.out, f.lse, dkv_init, bf16_pool);
      const BwdResult fused =
          GpuBackward(pr, dp, f.out, f.lse, dkv_init, bf16_pool, nullptr, 0, &own);
      std::vector<float> dk = plain.dk, dv = plain.dv;
      const int64_t row = pr.hkv * pr.hd;
      for (int64_t i = 0; i < pr.t; ++i) {
        const int64_t base = own.slots[i / pr.p] * pe + (i % pr.p) * row;
        for (int64_t e = 0; e < row; ++e) {
          dk[i * row + e] += own.pool[base + e];
          dv[i * row + e] += own.pool[base + pr.p * row + e];
        }
      }
      const std::string pool = where + (bf16_pool ? " bf16" : " fp32");
      EXPECT_LE(RelErr(fused.dk, dk), kTol) << pool;
      EXPECT_LE(RelErr(fused.dv, dv), kTol) << pool;
      EXPECT_GT(RelErr(plain.dk, dk), 10 * kTol) << pool;  // the added values are not negligible
      // Page-sparse, the earlier pages' dKV is added by atomics (gathered blocks), in either
      // run's order: to fp32 rounding, or a bf16 ulp where the pool rounds each add.
      EXPECT_LE(RelErr(fused.dkv, plain.dkv), sh.per_tile == 0 ? 0.0
                                              : bf16_pool      ? 5e-3
                                                               : 1e-6)
          << pool;
      EXPECT_LE(RelErr(fused.dq, plain.dq), 1e-4) << pool;
    }
  }
}
TEST(GpuAttention, FusedOwnDkvAccumulate) {
  SKIP_WITHOUT_GPU();
  CheckFusedOwnDkvAccumulate();
}

// Own key blocks one a query head (the kernel's choice for long chunks, SplitsOwnHeads), forced
// on at shapes that fit the CPU reference: dK/dV summed over the GQA group by fp32 atomics, then
// written (and added to the own pages' dKV) by a second kernel.
TEST(GpuAttention, OwnBlocksSplitByQueryHead) {
  SKIP_WITHOUT_GPU();
  setenv("CTXPLAN_ATTN_BWD_SPLIT", "on", 1);
  CheckProblem(Make(300, 14, 2, 128, 64, 0), 30);  // group 7, a first chunk
  CheckProblem(Make(257, 8, 2, 128, 128, 3), 31);  // earlier pages over every position
  Problem sparse = Make(256, 8, 2, 128, 96, 9);    // gathered earlier blocks
  sparse.per_tile = 3;
  sparse.sel = {1, 4, 8, 0, 2, 6};
  CheckProblem(sparse, 32);
  CheckProblem(Make(200, 8, 4, 64, 64, 0), 33);  // head_dim 64
  CheckFusedOwnDkvAccumulate();
  unsetenv("CTXPLAN_ATTN_BWD_SPLIT");
}

// --- exact equalities on the GPU ---
TEST(GpuAttention, PagedEqualsContiguousAndSparseAllEqualsDense) {
  SKIP_WITHOUT_GPU();
  Problem base = Make(320, 8, 2, 128, 64, 6);
  base.shuffle = false;  // identity page table, slots in order: contiguous K/V
  base.extra_slots = 0;
  base.Generate(21);
  // The same logical pages in shuffled slots.
  Problem shuffled = base;
  std::mt19937 rng(5);
  std::vector<int32_t> perm(base.pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const int64_t pe = base.PageShape().page_elements();
  for (int64_t pg = 0; pg < base.pages; ++pg) {
    shuffled.slots[pg] = perm[pg];
    std::copy_n(base.pool.begin() + pg * pe, pe, shuffled.pool.begin() + perm[pg] * pe);
  }
  // Sparse with every page listed for every tile.
  Problem all = base;
  const int64_t tiles = (base.t + 127) / 128;
  all.per_tile = base.pages;
  for (int64_t tile = 0; tile < tiles; ++tile)
    for (int32_t pg = 0; pg < base.pages; ++pg) all.sel.push_back(pg);

  const DeviceProblem d0(base), d1(shuffled), d2(all);
  const FwdResult f0 = GpuForward(base, d0), f1 = GpuForward(shuffled, d1),
                  f2 = GpuForward(all, d2);
  EXPECT_EQ(RelErr(f1.out, f0.out), 0.0) << "paged (shuffled) != contiguous";
  EXPECT_EQ(RelErr(f1.lse, f0.lse), 0.0);
  EXPECT_EQ(RelErr(f2.out, f0.out), 0.0) << "sparse(all) != dense";
  EXPECT_EQ(RelErr(f2.lse, f0.lse), 0.0);

  std::vector<float> out_b(f0.out);
  const std::vector<float> zeros(base.num_slots * pe, 0.0f);
  const BwdResult b0 = GpuBackward(base, d0, out_b, f0.lse, zeros, false);
  const BwdResult b1 = GpuBackward(shuffled, d1, out_b, f0.lse, zeros, false);
  const BwdResult b2 = GpuBackward(all, d2, out_b, f0.lse, zeros, false);
  // dK/dV are deterministic (no atomics); dQ sums key blocks in fp32 in any order. The sparse
  // backward over pages of 64 gathers each tile's selected positions into blocks of its own,
  // whose items come in another order and whose dK/dV the tiles add into the dKV pages by fp32
  // atomics: dK/dV to bf16 rounding, the dKV pool to fp32 rounding (1.04e-6 on an H200).
  EXPECT_EQ(RelErr(b1.dk, b0.dk), 0.0);
  EXPECT_EQ(RelErr(b1.dv, b0.dv), 0.0);
  EXPECT_LE(RelErr(b1.dq, b0.dq), 1e-2);
  EXPECT_LE(RelErr(b2.dk, b0.dk), 1e-4);
  EXPECT_LE(RelErr(b2.dv, b0.dv), 1e-4);
  EXPECT_LE(RelErr(b2.dq, b0.dq), 1e-2);
  EXPECT_LE(RelErr(b2.dkv, b0.dkv), 1e-5);  // fp32 pool
  // Logical page pg of the shuffled run lives in dkv slot shuffled.dkv_slots[pg].
  std::vector<float> b1_logical(b0.dkv.size()), b0_logical(b0.dkv.size());
  for (int64_t pg = 0; pg < base.pages; ++pg) {
    std::copy_n(b1.dkv.begin() + shuffled.dkv_slots[pg] * pe, pe, b1_logical.begin() + pg * pe);
    std::copy_n(b0.dkv.begin() + base.dkv_slots[pg] * pe, pe, b0_logical.begin() + pg * pe);
  }
  EXPECT_EQ(RelErr(b1_logical, b0_logical), 0.0);
}

// --- page selection ---
TEST(GpuPageSelect, SummaryScoreTopK) {
  SKIP_WITHOUT_GPU();
  struct Cfg {
    int64_t t, hq, hkv, hd, p, pages;
  };
  for (const Cfg c : {Cfg{300, 14, 2, 128, 64, 11}, Cfg{129, 4, 4, 64, 16, 37}}) {
    Problem pr = Make(c.t, c.hq, c.hkv, c.hd, c.p, c.pages);
    pr.Generate(31);
    const DeviceProblem dp(pr);
    // Summaries.
    std::vector<float> sum_ref(pr.pages * pr.hkv * pr.hd);
    cpu::PageSummary(
        PagedKv<const float>{pr.PageShape(), pr.pool.data(), pr.slots.data(), pr.pages},
        sum_ref.data());
    DeviceBuffer<bf16> sum_d(sum_ref.size());
    sum_d.Poison();
    cuda::PageSummary(dp.Earlier(pr), sum_d.get(), nullptr);
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> sum_got = DownloadBf16(sum_d);
    EXPECT_LE(RelErr(sum_got, sum_ref), kTol) << "page summary";

    // Scores, on the GPU's (bf16) summaries for both.
    const int64_t tiles = (pr.t + pr.query_tile - 1) / pr.query_tile;
    std::vector<float> sc_ref(tiles * pr.pages);
    cpu::PageScore(pr.q.data(), pr.t, pr.hq, pr.hkv, pr.hd, pr.query_tile, sum_got.data(), pr.pages,
                   sc_ref.data());
    DeviceBuffer<float> sc_d(sc_ref.size());
    sc_d.Poison();
    const size_t ws_bytes = cuda::PageScoreWorkspaceBytes(pr.t, pr.hkv, pr.hd, pr.query_tile);
    DeviceBuffer<uint8_t> ws(ws_bytes);
    cuda::PageScore(dp.q.get(), pr.t, pr.hq, pr.hkv, pr.hd, pr.query_tile, sum_d.get(), pr.pages,
                    sc_d.get(), ws.get(), ws_bytes, nullptr);
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> sc_got = Download(sc_d);
    EXPECT_LE(RelErr(sc_got, sc_ref), 1e-4) << "page scores";

    // Top-k on the GPU's scores: the very same selection as the CPU reference.
    for (const auto& [budget, sinks] : std::vector<std::pair<int64_t, int64_t>>{
             {3, 1}, {4, 0}, {0, 2}, {pr.pages, 1}, {pr.pages - 3, 2}}) {
      const int64_t per_tile = std::min(pr.pages, sinks + budget);
      std::vector<int32_t> sel_ref(tiles * per_tile, -1);
      EXPECT_EQ(cpu::PageTopK(sc_got.data(), tiles, pr.pages, budget, sinks, sel_ref.data()),
                per_tile);
      DeviceBuffer<int32_t> sel_d(sel_ref.size());
      sel_d.Poison();
      EXPECT_EQ(cuda::PageTopK(sc_d.get(), tiles, pr.pages, budget, sinks, sel_d.get(), nullptr),
                per_tile);
      CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(Download(sel_d), sel_ref) << "top-k budget " << budget << " sinks " << sinks;
    }
  }
}

TEST(GpuPageSelect, TopKTiesNanAndLargePageCounts) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(77);
  const int64_t tiles = 5, pages = 3000;
  std::vector<float> scores(tiles * pages);
  std::uniform_int_distribution<int> coarse(-20, 20);
  for (auto& s : scores) s = static_cast<float>(coarse(rng)) * 0.25f;  // many exact ties
  scores[7] = NAN;
  scores[pages + 3] = -0.0f;
  scores[pages + 4] = 0.0f;
  scores[2 * pages + 100] = INFINITY;
  scores[3 * pages + 5] = -INFINITY;
  const DeviceBuffer<float> sc_d = Upload(scores);
  for (const auto& [budget, sinks] :
       std::vector<std::pair<int64_t, int64_t>>{{64, 1}, {1, 0}, {1000, 4}, {2990, 3}}) {
    const int64_t per_tile = std::min(pages, sinks + budget);
    std::vector<int32_t> sel_ref(tiles * per_tile, -1);
    cpu::PageTopK(scores.data(), tiles, pages, budget, sinks, sel_ref.data());
    DeviceBuffer<int32_t> sel_d(sel_ref.size());
    sel_d.Poison();
    cuda::PageTopK(sc_d.get(), tiles, pages, budget, sinks, sel_d.get(), nullptr);
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(Download(sel_d), sel_ref) << "budget " << budget << " sinks " << sinks;
  }
}

TEST(GpuAttention, RejectsUnsupportedShapes) {
  SKIP_WITHOUT_GPU();
  cuda::AttentionShape s{128, 4, 4, 96, 0.1f};
  PagedKv<const bf16> none{};
  PageSelection dense{};
  EXPECT_THROW(
      cuda::AttentionForward(s, nullptr, nullptr, nullptr, none, dense, nullptr, nullptr, nullptr),
      std::invalid_argument);
  s.head_dim = 128;
  s.num_heads = 6;  // not a multiple of 4
  EXPECT_THROW(
      cuda::AttentionForward(s, nullptr, nullptr, nullptr, none, dense, nullptr, nullptr, nullptr),
      std::invalid_argument);
}

// The backward's workspace as the kernels ask for it and as the planner counts it (host
// arithmetic: no GPU needed), for every catalog model the planner plans and chunks 1024-16384,
// the split own blocks' accumulator included (a first chunk's from 4096 tokens, every chunk's
// past the L2 rule): within the kernel's three 256-byte alignments.
TEST(GpuAttention, PlannerCountsTheBackwardWorkspace) {
  unsetenv("CTXPLAN_ATTN_BWD_SPLIT");  // the rule, not a test's override
  for (const char* name : {"qwen2.5-7b", "qwen2.5-14b", "llama-3.1-8b", "llama-3.2-1b",
                           "qwen2.5-0.5b", "mistral-7b-v0.3"}) {
    const ModelSpec m = LoadModel(name);
    for (const int64_t chunk : {1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384}) {
      SCOPED_TRACE(std::string(name) + " chunk " + std::to_string(chunk));
      RunOptions o;
      o.context_tokens = 4 * chunk;
      o.chunk_tokens = chunk;
      const int64_t planned = PlanGeometry(m, o).attention_workspace_bytes();
      const cuda::AttentionShape shape{chunk, m.num_attention_heads, m.num_key_value_heads,
                                       m.head_dim, 1.0f};
      const auto asked = static_cast<int64_t>(cuda::AttentionBackwardWorkspaceBytes(shape));
      EXPECT_GE(asked, planned);
      EXPECT_LT(asked - planned, 3 * 256);
    }
  }
}

}  // namespace
}  // namespace ctxplan::kernels
