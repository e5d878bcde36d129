// Benchmark of the CUDA paged attention (kernels/src/cuda/attention_*.cu) at Qwen2.5-7B's
// attention shape: bf16, head_dim 128, 28 query / 4 KV heads, causal, 64K tokens.
//
//   full      one chunk of 64K own tokens, no earlier pages
//   chunked   16 chunks of 4096 queries, chunk c over c*4096 earlier tokens in pages of p
//             (identity page table = contiguous K/V; shuffled = paging cost), timed as the sum
//   last      the last chunk alone (4096 queries over 61440 earlier tokens): dense vs page-sparse
//             with 64 pages per tile (1 sink + 63 top pages), time ratio vs attended-pair ratio,
//             for pages of 64 tokens and of 128 (the runtime's default); and with one selection
//             shared by every tile
//   select    page summaries, scores and top-k of that last chunk
//   sweep     (only with --only sweep; not part of the default run) the per-FLOP rate against the
//             page size, head_dim and chunk (issue 14): head_dim 128 (28/4 heads, Qwen2.5-7B) and
//             64 (32/8 heads, Llama-3.2-1B); chunks of 1024, 3072, 4096 and 16384; pages of 32,
//             48, 64, 96, 128, 192 and 256 tokens where they divide the chunk (48, 96 and 192
//             divide only the 3072 chunk). Each point is the last chunk of a --tokens context
//             (rounded down to a multiple of the chunk) over a shuffled page table, forward and
//             backward, dense (every earlier page) and page-sparse (each 128-query tile attends
//             6144 earlier tokens: the sink page and 6144/p - 1 random pages, so the attended pairs
//             are the same at every page size). A table per (head_dim, chunk) gives each rate's
//             ratio to page 128's, the two timed alternately repeat by repeat so that a drifting
//             clock cancels (bound: within 10%) and, for head_dim 64, to head_dim 128's at
//             the same chunk and page (bound: within 15%), and marks the ratios outside.
//             --heads sets the head_dim 64 rows' heads (32x8 unless given; 28x4 compares the two
//             head dims at one GQA group), or with --head-dim 128 the head_dim 128 rows';
//             --chunks, --pages and --sparse-tokens narrow or move the grid (a kernel's time
//             against chunk or selection size, for the planner's model); --page-table identity
//             keeps the pool's pages in position order.
//   qtile     (only with --only qtile) the page-sparse last chunk (4096 queries over 61440 earlier
//             tokens, pages of 128, 48 pages a tile) at query tiles of 128, 256 and 512 queries a
//             page selection, head_dim 128 (28/4) and 64 (32/8): a gathered backward block runs a
//             selection tile's queries, so a larger tile gives a block more items for its fixed
//             cost (its keys gathered, its dK/dV added by atomics). Each rate against query tile
//             128's, timed alternately.
// FLOPs as kernels/src/cost.cpp counts them: forward 4 * pairs * H_q * d_h, backward 10 *.
// Timing: CUDA events, warm-up, median of the repeats. Prints a table and RESULT lines
// (shape,fwd_ms,fwd_tflops,bwd_ms,bwd_tflops) that kernels/bench/sdpa_peer.py reads. The mean SM
// clock over each timed window (NVML, where it opens) goes with the sweep's and the full family's
// rows and the CSV (fwd_mhz, bwd_mhz): a long run sits at the board's power limit, its clock
// under the maximum at which the planner's profile holds (head_dim 128 7-8% slower than at it;
// --cool-ms times each window at the maximum). Over a sweep point's few-ms windows the reading
// does not track the kernels' speed (kernels/PERF.md); over the full family's it is steadier.
//
// usage: attention_bench [--reps N] [--tokens N] [--csv FILE]
//                        [--only full|chunked|last|sweep|qtile]
//                        [--heads HQxHKV (the full family's, default 28x4; the sweep's d_h 64
//                        rows', default 32x8)] [--chunks N...] [--pages P...] [--sparse-tokens N]
//                        [--page-table shuffled|identity] [--cool-ms MS]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/kernels/cuda/attention.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/runtime/cuda/gpu_clock_sampler.h"
#include "ctxplan/runtime/cuda/probe_kernel.h"
#include "ctxplan/traces/atomic_file.h"

namespace {

using ctxplan::kernels::KvPageShape;
using ctxplan::kernels::PagedKv;
using ctxplan::kernels::PageSelection;
using ctxplan::kernels::cuda::AttentionShape;
using ctxplan::kernels::cuda::bf16;
namespace kc = ctxplan::kernels::cuda;

// The attention a family benchmarks: the model's heads and the queries of one call.
// GQA: query head h reads KV head h / (hq / hkv).
struct BenchShape {
  int64_t hq = 28;       // H_q, query heads
  int64_t hkv = 4;       // H_kv, KV heads (divides H_q)
  int64_t hd = 128;      // d_h, head_dim: 64 or 128 (what the kernels take)
  int64_t chunk = 4096;  // c, queries (and own positions) of one call: the runtime's chunk

  int64_t QRow() const { return hq * hd; }    // elements of one token's q, out, dout, dq
  int64_t KvRow() const { return hkv * hd; }  // elements of one token's k, v, dk, dv
  float Scale() const { return 1.0f / std::sqrt(static_cast<float>(hd)); }
  AttentionShape Attention() const { return {chunk, hq, hkv, hd, Scale()}; }
};

// The shape of the full, chunked and last families.
constexpr BenchShape kQwen7B{};

template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count = 0) : n(count) {
    if (n) CTXPLAN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), n * sizeof(T)));
  }
  ~Dev() {
    if (p) cudaFree(p);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  // Room for `count` elements instead, contents undefined (the sweep's page tables change length).
  void Reallocate(size_t count) {
    if (count == n) return;
    if (p) cudaFree(p);
    p = nullptr;
    n = 0;
    if (count) CTXPLAN_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), count * sizeof(T)));
    n = count;
  }
};

// Random bf16 in [-1, 1) (xorshift; timing does not need normal data, but never zeros).
void FillRandom(bf16* dst, size_t n, uint64_t seed, float scale = 1.0f) {
  std::vector<uint16_t> h(std::min<size_t>(n, size_t{1} << 24));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (size_t done = 0; done < n;) {
    const size_t m = std::min(h.size(), n - done);
    for (size_t i = 0; i < m; ++i) {
      s ^= s << 13;
      s ^= s >> 7;
      s ^= s << 17;
      const float f = (static_cast<float>(s >> 40) / 16777216.0f * 2.0f - 1.0f) * scale;
      uint32_t b;
      std::memcpy(&b, &f, 4);
      h[i] = static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
    CTXPLAN_CUDA_CHECK(cudaMemcpy(dst + done, h.data(), m * 2, cudaMemcpyHostToDevice));
    done += m;
  }
}

// Median time (ms) of each of fns over reps after warm-up, timed in turn, a repeat of each
// before the next repeat; each fn enqueues work on the default stream. Several are timed in turn
// so that a GPU whose clock drifts over a run (the H100's, by its temperature and power) gives
// them the same clocks: their ratio holds where two timings apart differ by up to 10%. Each
// repeat starts behind an idle kernel (kHoldSeconds), so that its launches are all enqueued before
// the first runs, as a training step's are: a short call timed from an idle GPU also counted the
// host's launch latency (1024-token page-sparse forwards of 50-90 us read 4% slower, median, up
// to 15%; kernels/PERF.md).
constexpr double kHoldSeconds = 200e-6;
// --cool-ms: the host idles this long before each timed window, so that the board's power limiter
// has let go and the window runs at the maximum SM clock, as ctxplan-measure's calibration rows
// do (2 ms batches between host work: ~130 W, 1980 MHz). A sweep run back to back sits at the
// 700 W limit instead, its head_dim 128 windows at 1650-1930 MHz (kernels/PERF.md).
double g_cool_seconds = 0;
// The SM clock sampler (null until main opens it) and its reading over the last timed window.
ctxplan::gpu::GpuClockSampler* g_clocks = nullptr;
double g_last_mhz = 0;  // 0: not known

std::vector<double> TimeInTurnMs(const std::vector<std::function<void()>>& fns, int reps,
                                 int warmup = 1) {
  for (int i = 0; i < warmup; ++i)
    for (const auto& fn : fns) fn();
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
  if (g_cool_seconds > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(g_cool_seconds));
  if (g_clocks != nullptr) g_clocks->Begin();
  std::vector<cudaEvent_t> marks(fns.size() + 1);
  for (cudaEvent_t& e : marks) CTXPLAN_CUDA_CHECK(cudaEventCreate(&e));
  std::vector<std::vector<double>> ms(fns.size());
  for (int i = 0; i < reps; ++i) {
    ctxplan::gpu::LaunchIdleKernel(kHoldSeconds, nullptr);
    CTXPLAN_CUDA_CHECK(cudaEventRecord(marks[0]));
    for (size_t f = 0; f < fns.size(); ++f) {
      fns[f]();
      CTXPLAN_CUDA_CHECK(cudaEventRecord(marks[f + 1]));
    }
    CTXPLAN_CUDA_CHECK(cudaEventSynchronize(marks.back()));
    for (size_t f = 0; f < fns.size(); ++f) {
      float x = 0.0f;
      CTXPLAN_CUDA_CHECK(cudaEventElapsedTime(&x, marks[f], marks[f + 1]));
      ms[f].push_back(x);
    }
  }
  g_last_mhz = g_clocks != nullptr ? g_clocks->End().sm_clock_mhz : 0.0;
  for (cudaEvent_t e : marks) CTXPLAN_CUDA_CHECK(cudaEventDestroy(e));
  std::vector<double> medians;
  for (std::vector<double>& m : ms) {
    std::sort(m.begin(), m.end());
    medians.push_back(m[m.size() / 2]);
  }
  return medians;
}

double TimeMs(const std::function<void()>& fn, int reps, int warmup = 1) {
  return TimeInTurnMs({fn}, reps, warmup)[0];
}

struct Row {
  std::string shape;
  int64_t hq = 0, hd = 0;  // H_q and d_h of the shape: an attended pair is 4 * hq * hd FLOPs fwd
  double pairs = 0, fwd_ms = 0, bwd_ms = 0;
  double fwd_mhz = 0, bwd_mhz = 0;  // the SM clock while timed (0: not known)
  double FwdTflops() const { return 4.0 * pairs * hq * hd / (fwd_ms * 1e-3) / 1e12; }
  double BwdTflops() const { return 10.0 * pairs * hq * hd / (bwd_ms * 1e-3) / 1e12; }
};

std::vector<Row> g_rows;
std::ostream* g_csv = nullptr;  // --csv: published when the run completes

void Report(const Row& r) {
  g_rows.push_back(r);
  std::printf("RESULT,%s,%.3f,%.1f,%.3f,%.1f\n", r.shape.c_str(), r.fwd_ms, r.FwdTflops(), r.bwd_ms,
              r.BwdTflops());
  if (g_csv) {
    char line[320];
    std::snprintf(line, sizeof(line), "%s,%.4f,%.2f,%.4f,%.2f,%.0f,%.0f\n", r.shape.c_str(),
                  r.fwd_ms, r.FwdTflops(), r.bwd_ms, r.BwdTflops(), r.fwd_mhz, r.bwd_mhz);
    *g_csv << line;
  }
  std::fflush(stdout);
}

// One chunk of n own tokens, no earlier pages (s.chunk is not used: the chunk is all n).
void BenchFull(const BenchShape& s, int64_t n, int reps) {
  const size_t qn = n * s.QRow(), kn = n * s.KvRow();
  Dev<bf16> q(qn), k(kn), v(kn), out(qn), dout(qn), dq(qn), dk(kn), dv(kn);
  Dev<float> lse(n * s.hq);
  FillRandom(q.p, qn, 1);
  FillRandom(k.p, kn, 2);
  FillRandom(v.p, kn, 3);
  FillRandom(dout.p, qn, 4);
  const AttentionShape shape{n, s.hq, s.hkv, s.hd, s.Scale()};
  const PagedKv<const bf16> none{};
  const PagedKv<float> no_dkv{};
  const PageSelection dense{};
  const size_t ws_bytes = kc::AttentionBackwardWorkspaceBytes(shape);
  Dev<uint8_t> ws(ws_bytes);
  Row r;
  r.shape = "full_" + std::to_string(n / 1024) + "k";
  if (s.hq != kQwen7B.hq || s.hkv != kQwen7B.hkv)
    r.shape += "_h" + std::to_string(s.hq) + "x" + std::to_string(s.hkv);
  if (s.hd != kQwen7B.hd) r.shape += "_d" + std::to_string(s.hd);
  r.hq = s.hq;
  r.hd = s.hd;
  r.pairs = static_cast<double>(n) * (n + 1) / 2.0;
  auto fwd = [&] {
    kc::AttentionForward(shape, q.p, k.p, v.p, none, dense, out.p, lse.p, nullptr);
  };
  r.fwd_ms = TimeMs(fwd, reps);
  r.fwd_mhz = g_last_mhz;
  fwd();
  r.bwd_ms = TimeMs(
      [&] {
        kc::AttentionBackward(shape, q.p, k.p, v.p, none, dense, out.p, lse.p, dout.p, dq.p, dk.p,
                              dv.p, no_dkv, ws.p, ws_bytes, nullptr);
      },
      reps);
  r.bwd_mhz = g_last_mhz;
  Report(r);
}

// The whole n-token sequence as chunks of c = s.chunk queries over earlier pages of p tokens.
// The dKV pool's type (--dkv): fp32 as the sweeps before 2026-11-28 ran, or bf16 as the runtime's
// at its default grad dtype (a bf16 pool costs the union's read-add-write and the gathered
// blocks' atomics half the bytes).
bool g_dkv_bf16 = false;

// K/V of every position live in a pool of pages (identity or shuffled table); each chunk's own
// K/V are also given contiguously (as the runtime's projections produce them).
struct Chunked {
  BenchShape s;
  int64_t n, c, p;  // tokens, chunk (s.chunk), page tokens
  bool shuffled;
  int64_t pages;                  // n / p
  Dev<bf16> q, k, v, out, dout;   // [n][H_q or H_kv][d_h]: every chunk's
  Dev<bf16> dq, dk, dv;           // [c][H_q or H_kv][d_h]: the timed chunk's
  Dev<bf16> pool;                 // [pages][2][p][H_kv][d_h]: K/V of all n positions
  Dev<float> lse;                 // [n][H_q]
  Dev<float> dkv;                 // [pages][2][p][H_kv][d_h]: dK/dV accumulated (fp32 pool)
  Dev<bf16> dkv16;                // the same, a bf16 pool (g_dkv_bf16; the other is empty)
  Dev<int32_t> slots, dkv_slots;  // [pages]: logical page -> slot (the same table)
  Dev<uint8_t> ws;                // the backward's workspace for c queries
  size_t ws_bytes;

  Chunked(const BenchShape& s_, int64_t n_, int64_t p_, bool shuffled_)
      : s(s_),
        n(n_),
        c(s_.chunk),
        p(0),
        shuffled(shuffled_),
        pages(0),
        q(n_ * s_.QRow()),
        k(n_ * s_.KvRow()),
        v(n_ * s_.KvRow()),
        out(n_ * s_.QRow()),
        dout(n_ * s_.QRow()),
        dq(s_.chunk * s_.QRow()),
        dk(s_.chunk * s_.KvRow()),
        dv(s_.chunk * s_.KvRow()),
        pool(static_cast<size_t>(n_) * 2 * s_.KvRow()),
        lse(n_ * s_.hq),
        dkv(g_dkv_bf16 ? 0 : static_cast<size_t>(n_) * 2 * s_.KvRow()),
        dkv16(g_dkv_bf16 ? static_cast<size_t>(n_) * 2 * s_.KvRow() : 0),
        ws(kc::AttentionBackwardWorkspaceBytes(s_.Attention())),
        ws_bytes(kc::AttentionBackwardWorkspaceBytes(s_.Attention())) {
    FillRandom(q.p, q.n, 11);
    FillRandom(k.p, k.n, 12);
    FillRandom(v.p, v.n, 13);
    FillRandom(dout.p, dout.n, 14);
    SetPages(p_);
  }
  // Lays K/V out in pages of p_ tokens (p_ divides n) under a new page table, and zeroes the
  // dKV pages. The pools hold 2 * n * H_kv * d_h elements whatever the page size, so the sweep
  // re-pages one Chunked per page size instead of refilling q, k, v and dout (seconds a time).
  void SetPages(int64_t p_) {
    if (p_ < 16 || n % p_ != 0)
      throw std::invalid_argument("Chunked: pages of " + std::to_string(p_) +
                                  " tokens do not tile " + std::to_string(n));
    p = p_;
    pages = n / p;
    slots.Reallocate(pages);
    dkv_slots.Reallocate(pages);
    if (dkv.n) CTXPLAN_CUDA_CHECK(cudaMemset(dkv.p, 0, dkv.n * sizeof(float)));
    if (dkv16.n) CTXPLAN_CUDA_CHECK(cudaMemset(dkv16.p, 0, dkv16.n * sizeof(bf16)));
    std::vector<int32_t> perm(pages);
    std::iota(perm.begin(), perm.end(), 0);
    if (shuffled) {
      std::mt19937 rng(7);
      std::shuffle(perm.begin(), perm.end(), rng);
    }
    CTXPLAN_CUDA_CHECK(cudaMemcpy(slots.p, perm.data(), pages * 4, cudaMemcpyHostToDevice));
    CTXPLAN_CUDA_CHECK(cudaMemcpy(dkv_slots.p, perm.data(), pages * 4, cudaMemcpyHostToDevice));
    // Page pg (tokens pg*p..) into slot perm[pg]: K rows then V rows, [p][H_kv][d_h] each.
    const size_t rows = static_cast<size_t>(p) * s.KvRow();
    for (int64_t pg = 0; pg < pages; ++pg) {
      bf16* dst = pool.p + static_cast<size_t>(perm[pg]) * 2 * rows;
      CTXPLAN_CUDA_CHECK(cudaMemcpy(dst, k.p + pg * rows, rows * 2, cudaMemcpyDeviceToDevice));
      CTXPLAN_CUDA_CHECK(
          cudaMemcpy(dst + rows, v.p + pg * rows, rows * 2, cudaMemcpyDeviceToDevice));
    }
  }
  AttentionShape Shape() const { return s.Attention(); }
  KvPageShape PageShape() const { return {p, s.hkv, s.hd}; }
  PagedKv<const bf16> Earlier(int64_t chunk) const {
    return {PageShape(), pool.p, slots.p, chunk * c / p};
  }
  PagedKv<float> Dkv(int64_t chunk) const {
    return {PageShape(), dkv.p, dkv_slots.p, chunk * c / p};
  }
  void Forward(int64_t chunk, const PageSelection& sel) {
    const int64_t o = chunk * c;
    kc::AttentionForward(Shape(), q.p + o * s.QRow(), k.p + o * s.KvRow(), v.p + o * s.KvRow(),
                         Earlier(chunk), sel, out.p + o * s.QRow(), lse.p + o * s.hq, nullptr);
  }
  // own_dkv: fuse the DkvAccumulate of the chunk's own pages (as later chunks left them).
  void Backward(int64_t chunk, const PageSelection& sel, bool own_dkv = false) {
    const int64_t o = chunk * c;
    if (g_dkv_bf16) {
      const PagedKv<const bf16> own{PageShape(), dkv16.p, dkv_slots.p + o / p, c / p};
      const PagedKv<bf16> pool16{PageShape(), dkv16.p, dkv_slots.p, chunk * c / p};
      kc::AttentionBackward(Shape(), q.p + o * s.QRow(), k.p + o * s.KvRow(), v.p + o * s.KvRow(),
                            Earlier(chunk), sel, out.p + o * s.QRow(), lse.p + o * s.hq,
                            dout.p + o * s.QRow(), dq.p, dk.p, dv.p, pool16, ws.p, ws_bytes,
                            nullptr, own_dkv ? &own : nullptr);
      return;
    }
    const PagedKv<const float> own{PageShape(), dkv.p, dkv_slots.p + o / p, c / p};
    kc::AttentionBackward(Shape(), q.p + o * s.QRow(), k.p + o * s.KvRow(), v.p + o * s.KvRow(),
                          Earlier(chunk), sel, out.p + o * s.QRow(), lse.p + o * s.hq,
                          dout.p + o * s.QRow(), dq.p, dk.p, dv.p, Dkv(chunk), ws.p, ws_bytes,
                          nullptr, own_dkv ? &own : nullptr);
  }
};

void BenchChunked(Chunked& ch, int reps) {
  const int64_t chunks = ch.n / ch.c;
  const PageSelection dense{};
  Row r;
  r.hq = ch.s.hq;
  r.hd = ch.s.hd;
  r.shape = "chunked_" + std::to_string(ch.n / 1024) + "k_c" + std::to_string(ch.c) + "_p" +
            std::to_string(ch.p) + (ch.shuffled ? "_shuffled" : "_identity");
  r.pairs = static_cast<double>(ch.n) * (ch.n + 1) / 2.0;
  r.fwd_ms = TimeMs(
      [&] {
        for (int64_t i = 0; i < chunks; ++i) ch.Forward(i, dense);
      },
      reps);
  r.bwd_ms = TimeMs(
      [&] {
        for (int64_t i = 0; i < chunks; ++i) ch.Backward(i, dense);
      },
      reps);
  Report(r);
}

// Page selections of `tiles` query tiles: the sink (page 0) and per_tile - 1 other pages drawn at
// random from 1 .. earlier_pages - 1, ascending per tile, one generator for all tiles.
std::vector<int32_t> RandomSelection(int64_t tiles, int64_t earlier_pages, int64_t per_tile,
                                     uint32_t seed) {
  std::vector<int32_t> sel;
  std::mt19937 rng(seed);
  for (int64_t t = 0; t < tiles; ++t) {
    std::vector<int32_t> cand(earlier_pages - 1);
    std::iota(cand.begin(), cand.end(), 1);
    std::shuffle(cand.begin(), cand.end(), rng);
    std::vector<int32_t> pick(cand.begin(), cand.begin() + (per_tile - 1));
    pick.push_back(0);  // sink
    std::sort(pick.begin(), pick.end());
    sel.insert(sel.end(), pick.begin(), pick.end());
  }
  return sel;
}

// A host selection on the device with the union of its pages, over which the backward's key
// blocks are launched as the runtime launches them (PageSelection::union_pages).
struct DeviceSelection {
  DeviceSelection(const std::vector<int32_t>& sel, int64_t query_tile, int64_t per_tile)
      : pages(sel.size()), union_pages(UnionOf(sel)), union_d(union_pages.size()) {
    CTXPLAN_CUDA_CHECK(cudaMemcpy(pages.p, sel.data(), sel.size() * 4, cudaMemcpyHostToDevice));
    CTXPLAN_CUDA_CHECK(
        cudaMemcpy(union_d.p, union_pages.data(), union_pages.size() * 4, cudaMemcpyHostToDevice));
    view.query_tile = query_tile;
    view.pages_per_tile = per_tile;
    view.pages = pages.p;
    view.union_pages = union_d.p;
    view.num_union_pages = static_cast<int64_t>(union_pages.size());
  }
  static std::vector<int32_t> UnionOf(std::vector<int32_t> p) {
    std::sort(p.begin(), p.end());
    p.erase(std::unique(p.begin(), p.end()), p.end());
    return p;
  }
  Dev<int32_t> pages;
  std::vector<int32_t> union_pages;
  Dev<int32_t> union_d;
  PageSelection view;
};

// The last chunk alone: dense vs 64 pages per tile.
void BenchSparse(Chunked& ch, int reps) {
  const int64_t last = ch.n / ch.c - 1;
  const int64_t earlier_pages = last * ch.c / ch.p;
  const int64_t tile = 128, tiles = ch.c / tile;
  const double own_pairs = static_cast<double>(ch.c) * (ch.c + 1) / 2.0;
  const PageSelection dense{};
  Row d;
  d.hq = ch.s.hq;
  d.hd = ch.s.hd;
  d.shape = "last_chunk_dense_p" + std::to_string(ch.p);
  d.pairs = own_pairs + static_cast<double>(ch.c) * earlier_pages * ch.p;
  d.fwd_ms = TimeMs([&] { ch.Forward(last, dense); }, reps, 2);
  d.bwd_ms = TimeMs([&] { ch.Backward(last, dense); }, reps, 2);
  Report(d);
  // DkvAccumulate fused into the backward: what it adds to the kernel, against the bytes the
  // standalone kernel moves (fp32 pages read, dK/dV read and written).
  const double fused_ms = TimeMs([&] { ch.Backward(last, dense, true); }, reps, 2);
  const double acc_bytes = 2.0 * ch.c * ch.s.KvRow() * 4 + 4.0 * ch.c * ch.s.KvRow() * 2;
  std::printf(
      "FUSED p=%lld: backward with the own dKV accumulate %.3f ms, without %.3f ms: %+.1f us "
      "for the %.1f MB the standalone DkvAccumulate moves\n",
      static_cast<long long>(ch.p), fused_ms, d.bwd_ms, (fused_ms - d.bwd_ms) * 1e3,
      acc_bytes / 1e6);

  const int64_t per_tile = std::min<int64_t>(64, earlier_pages);
  const std::vector<int32_t> sel = RandomSelection(tiles, earlier_pages, per_tile, 3);
  const DeviceSelection random(sel, tile, per_tile);
  const PageSelection& sparse = random.view;
  Row s;
  s.hq = ch.s.hq;
  s.hd = ch.s.hd;
  s.shape = "last_chunk_sparse64_p" + std::to_string(ch.p);
  s.pairs = own_pairs + static_cast<double>(ch.c) * per_tile * ch.p;
  s.fwd_ms = TimeMs([&] { ch.Forward(last, sparse); }, reps, 2);
  s.bwd_ms = TimeMs([&] { ch.Backward(last, sparse); }, reps, 2);
  Report(s);
  std::printf(
      "SPARSE p=%lld: attended pairs ratio %.3f; time ratio fwd %.3f, bwd %.3f "
      "(sparse/dense; the selections' union %zu of %lld pages)\n",
      static_cast<long long>(ch.p), s.pairs / d.pairs, s.fwd_ms / d.fwd_ms, s.bwd_ms / d.bwd_ms,
      random.union_pages.size(), static_cast<long long>(earlier_pages));

  // The same number of attended pairs when every tile selects the same pages (neighbouring
  // tiles of real text select alike): few key blocks with many tiles each instead of many with
  // few, which separates the backward's per-key-block cost from its per-tile cost.
  std::vector<int32_t> shared_sel;
  for (int64_t t = 0; t < tiles; ++t)
    shared_sel.insert(shared_sel.end(), sel.begin(), sel.begin() + per_tile);
  const DeviceSelection shared(shared_sel, tile, per_tile);
  Row sh = s;
  sh.shape = "last_chunk_sparse64_shared_p" + std::to_string(ch.p);
  sh.fwd_ms = TimeMs([&] { ch.Forward(last, shared.view); }, reps, 2);
  sh.bwd_ms = TimeMs([&] { ch.Backward(last, shared.view); }, reps, 2);
  Report(sh);
  std::printf(
      "SPARSE p=%lld, one selection for every tile: time ratio fwd %.3f, bwd %.3f "
      "(sparse/dense)\n",
      static_cast<long long>(ch.p), sh.fwd_ms / d.fwd_ms, sh.bwd_ms / d.bwd_ms);

  // Proportionality: time against the pages each tile selects (random, the sink included; k = 1
  // is the sink alone, so its time is the own positions' causal part plus one page).
  std::printf("SPARSE-K p=%lld, time (ms) against pages a tile:", static_cast<long long>(ch.p));
  double t1_fwd = 0, t1_bwd = 0;
  for (const int64_t k : {int64_t{1}, int64_t{16}, int64_t{32}, int64_t{64}, int64_t{128}}) {
    if (k > earlier_pages) break;
    const DeviceSelection kd(
        RandomSelection(tiles, earlier_pages, k, 11 + static_cast<uint32_t>(k)), tile, k);
    const PageSelection& ks = kd.view;
    const double f = TimeMs([&] { ch.Forward(last, ks); }, reps, 2);
    const double b = TimeMs([&] { ch.Backward(last, ks); }, reps, 2);
    if (k == 1) {
      t1_fwd = f;
      t1_bwd = b;
    }
    std::printf(" k %lld fwd %.3f bwd %.3f", static_cast<long long>(k), f, b);
    if (k > 1)
      std::printf(" (per page above k 1: fwd %.1f us, bwd %.1f us)", (f - t1_fwd) / (k - 1) * 1e3,
                  (b - t1_bwd) / (k - 1) * 1e3);
    std::printf(";");
  }
  std::printf(" dense (all %lld pages): per page above k 1: fwd %.1f us, bwd %.1f us\n",
              static_cast<long long>(earlier_pages),
              (d.fwd_ms - t1_fwd) / static_cast<double>(earlier_pages - 1) * 1e3,
              (d.bwd_ms - t1_bwd) / static_cast<double>(earlier_pages - 1) * 1e3);

  // Page selection for this chunk: summaries of the earlier pages, scores, top-k.
  Dev<bf16> sums(earlier_pages * ch.s.KvRow());
  Dev<float> scores(tiles * earlier_pages);
  Dev<int32_t> picked(tiles * per_tile);
  const size_t sws = kc::PageScoreWorkspaceBytes(ch.c, ch.s.hkv, ch.s.hd, tile);
  Dev<uint8_t> sw(sws);
  const bf16* qlast = ch.q.p + last * ch.c * ch.s.QRow();
  const double t_sum = TimeMs([&] { kc::PageSummary(ch.Earlier(last), sums.p, nullptr); }, reps, 2);
  const double t_score = TimeMs(
      [&] {
        kc::PageScore(qlast, ch.c, ch.s.hq, ch.s.hkv, ch.s.hd, tile, sums.p, earlier_pages,
                      scores.p, sw.p, sws, nullptr);
      },
      reps, 2);
  const double t_topk = TimeMs(
      [&] { kc::PageTopK(scores.p, tiles, earlier_pages, per_tile - 1, 1, picked.p, nullptr); },
      reps, 2);
  const double sum_bytes = static_cast<double>(earlier_pages) * ch.p * ch.s.KvRow() * 2;
  std::printf(
      "SELECT p=%lld pages=%lld: summary %.3f ms (%.0f GB/s of K read), score %.3f ms, "
      "top-k %.3f ms\n",
      static_cast<long long>(ch.p), static_cast<long long>(earlier_pages), t_sum,
      sum_bytes / (t_sum * 1e-3) / 1e9, t_score, t_topk);
}

// The full, chunked and last families (only: one of them, or "" for all), then their table.
// full_heads: the full family's query and KV heads (the others keep Qwen2.5-7B's).
void RunFamilies(const std::string& only, int64_t n, int reps, const BenchShape& full_heads) {
  if (only.empty() || only == "full") BenchFull(full_heads, n, reps);
  for (const int64_t p : {int64_t{64}, int64_t{128}}) {
    if (only == "full") break;
    for (const bool shuffled : {false, true}) {
      if (only == "last" && !shuffled) continue;
      Chunked ch(kQwen7B, n, p, shuffled);
      if (only != "last") BenchChunked(ch, reps);
      if (shuffled) BenchSparse(ch, reps);
    }
  }
  std::printf("\n%-34s %10s %10s %10s %10s\n", "shape", "fwd ms", "fwd TF/s", "bwd ms", "bwd TF/s");
  for (const Row& r : g_rows)
    std::printf("%-34s %10.2f %10.1f %10.2f %10.1f\n", r.shape.c_str(), r.fwd_ms, r.FwdTflops(),
                r.bwd_ms, r.BwdTflops());
  // Paging cost: shuffled vs identity page table.
  for (size_t i = 0; i + 1 < g_rows.size(); ++i) {
    const Row& a = g_rows[i];
    const Row& b = g_rows[i + 1];
    if (a.shape.find("_identity") != std::string::npos &&
        b.shape.find("_shuffled") != std::string::npos)
      std::printf("PAGING %s: shuffled/identity time fwd %.3f bwd %.3f\n", a.shape.c_str(),
                  b.fwd_ms / a.fwd_ms, b.bwd_ms / a.bwd_ms);
  }
}

// Forward and backward times (ms) of chunk `last` of ch over sel, each timed in turn with the same
// on ref over ref_sel when ref is given (TimeInTurnMs: the ratio of the two holds where the clock
// drifts), alone otherwise (ref times 0).
struct TurnTimes {
  double fwd_ms = 0, bwd_ms = 0, ref_fwd_ms = 0, ref_bwd_ms = 0;
  double fwd_mhz = 0, bwd_mhz = 0;  // the SM clock over each direction's timed window
};
TurnTimes TimeFwdBwd(Chunked& ch, int64_t last, const PageSelection& sel, int reps,
                     Chunked* ref = nullptr, const PageSelection& ref_sel = {}) {
  TurnTimes t;
  if (ref == nullptr) {
    t.fwd_ms = TimeMs([&] { ch.Forward(last, sel); }, reps, 2);
    t.fwd_mhz = g_last_mhz;
    t.bwd_ms = TimeMs([&] { ch.Backward(last, sel); }, reps, 2);
    t.bwd_mhz = g_last_mhz;
    return t;
  }
  const std::vector<double> fwd =
      TimeInTurnMs({[&] { ch.Forward(last, sel); }, [&] { ref->Forward(last, ref_sel); }}, reps, 2);
  t.fwd_mhz = g_last_mhz;
  const std::vector<double> bwd = TimeInTurnMs(
      {[&] { ch.Backward(last, sel); }, [&] { ref->Backward(last, ref_sel); }}, reps, 2);
  t.bwd_mhz = g_last_mhz;
  t.fwd_ms = fwd[0];
  t.ref_fwd_ms = fwd[1];
  t.bwd_ms = bwd[0];
  t.ref_bwd_ms = bwd[1];
  return t;
}

// --- sweep: the per-FLOP rate against page size, head_dim and chunk (issue 14) -------------

// The heads swept (the chunk is set per point): Qwen2.5-7B's head_dim 128 first, as the
// head_dim 64 rows are compared with it, then a Llama-3.2-1B-like head_dim 64.
constexpr BenchShape kSweepHeads[] = {{28, 4, 128}, {32, 8, 64}};
// 3072 is not in issue 14's list: it is the one chunk here that pages of 48, 96 and 192 divide
// (it takes every swept page size); chunks start on page boundaries, so the others skip them.
constexpr int64_t kSweepChunks[] = {1024, 3072, 4096, 16384};
constexpr int64_t kSweepPages[] = {32, 48, 64, 96, 128, 192, 256};
constexpr int64_t kRefPage = 128;  // the runtime's default page: the page-size ratios' reference
constexpr int64_t kRefHeadDim = 128;
constexpr double kPageBound = 0.10;     // issue 14: every page size within 10% of page 128's rate
constexpr double kHeadDimBound = 0.15;  // and head_dim 64 within 15% of head_dim 128's
// Page-sparse: the earlier tokens each 128-query tile attends. A multiple of every swept page
// size (48 pages of 128, 192 of 32, 24 of 256), so the sparse points of one (head_dim, chunk)
// attend the same pairs at every page size and their rates compare the same work.
constexpr int64_t kSparseTokens = 6144;

// The sweep's grid: kSweepChunks, kSweepPages and kSparseTokens unless --chunks, --pages or
// --sparse-tokens narrow or move it (to read one kernel's rate against chunk or selection size,
// as the planner's union model was read: each attended page's cost apart from the own blocks').
struct SweepGrid {
  std::vector<int64_t> chunks{std::begin(kSweepChunks), std::end(kSweepChunks)};
  std::vector<int64_t> pages{std::begin(kSweepPages), std::end(kSweepPages)};
  int64_t sparse_tokens = kSparseTokens;
  // The pool's page table: shuffled (the paging cost, as the sweeps before 2026-11-28 ran), or
  // identity (pages in position order, nearer how the runtime fills its pool).
  bool shuffled = true;
};

struct SweepPoint {
  int64_t hd, chunk, page;
  bool sparse;
  int64_t pages_per_tile;  // sparse: the pages a tile selects; dense: every earlier page
  Row row;
  // Page 128's point (same head_dim, chunk and mode) timed alternately with this one
  // (TimeInTurnMs): its attended pairs and times, from which the /p128 ratios come. Zero at page
  // 128 itself.
  double ref_pairs = 0, ref_fwd_ms = 0, ref_bwd_ms = 0;
  // Sparse: the backward on the other blocks: gathered (CTXPLAN_ATTN_BWD_SPARSE=gather) where the
  // kernel takes key blocks over the union's pages (AttentionBackwardOverUnion: GQA groups 1-2),
  // else those key blocks (=union).
  double bwd_alt_ms = 0;
};

const SweepPoint* FindPoint(const std::vector<SweepPoint>& points, int64_t hd, int64_t chunk,
                            int64_t page, bool sparse) {
  for (const SweepPoint& x : points)
    if (x.hd == hd && x.chunk == chunk && x.page == page && x.sparse == sparse) return &x;
  return nullptr;
}

// A point's per-FLOP rates over its reference's: page 128 of the same head_dim, chunk and mode;
// head_dim 128 at the same chunk, page and mode (head_dim 64 only). Absent: no reference.
struct SweepRatios {
  std::optional<double> fwd_page, bwd_page, fwd_hd, bwd_hd;
};

SweepRatios RatiosOf(const SweepPoint& x, const std::vector<SweepPoint>& points) {
  SweepRatios r;
  if (x.ref_fwd_ms > 0) {
    r.fwd_page = (x.row.pairs / x.row.fwd_ms) / (x.ref_pairs / x.ref_fwd_ms);
    r.bwd_page = (x.row.pairs / x.row.bwd_ms) / (x.ref_pairs / x.ref_bwd_ms);
  } else if (const SweepPoint* ref = FindPoint(points, x.hd, x.chunk, kRefPage, x.sparse)) {
    r.fwd_page = x.row.FwdTflops() / ref->row.FwdTflops();
    r.bwd_page = x.row.BwdTflops() / ref->row.BwdTflops();
  }
  if (x.hd != kRefHeadDim) {
    if (const SweepPoint* ref = FindPoint(points, kRefHeadDim, x.chunk, x.page, x.sparse)) {
      r.fwd_hd = x.row.FwdTflops() / ref->row.FwdTflops();
      r.bwd_hd = x.row.BwdTflops() / ref->row.BwdTflops();
    }
  }
  return r;
}

bool Outside(const std::optional<double>& ratio, double bound) {
  return ratio && std::abs(*ratio - 1.0) > bound;
}

// "0.87 ", "0.73*" (more than `bound` from 1), or "-" without a reference.
std::string RatioText(const std::optional<double>& ratio, double bound) {
  if (!ratio) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f%c", *ratio, Outside(ratio, bound) ? '*' : ' ');
  return text;
}

// The table of one (head_dim, chunk): points[first..] are its points.
void PrintSweepTable(const BenchShape& s, int64_t context, const SweepGrid& grid,
                     const std::vector<SweepPoint>& points, size_t first) {
  std::printf(
      "\nSWEEP d_h %lld, %lld/%lld heads, chunk %lld: the last chunk of %lld tokens, %lld earlier "
      "in %s pages\n  dense: every earlier page; sparse: %lld earlier tokens a 128-query "
      "tile (the sink page and %lld/p - 1 random ones); dKV pool %s\n",
      static_cast<long long>(s.hd), static_cast<long long>(s.hq), static_cast<long long>(s.hkv),
      static_cast<long long>(s.chunk), static_cast<long long>(context),
      static_cast<long long>(context - s.chunk), grid.shuffled ? "shuffled" : "identity",
      static_cast<long long>(grid.sparse_tokens), static_cast<long long>(grid.sparse_tokens),
      g_dkv_bf16 ? "bf16" : "fp32");
  std::printf("%-6s %5s %10s | %8s %8s %6s | %8s %8s %6s | %8s %8s | %8s | %9s\n", "mode", "page",
              "pages/tile", "fwd ms", "fwd TF/s", "/p128", "bwd ms", "bwd TF/s", "/p128",
              "fwd/d128", "bwd/d128", "bwd alt/", "MHz f/b");
  // Dense rows, then sparse ones, each by page size (the order they were measured in is by page).
  for (const bool sparse : {false, true}) {
    for (size_t i = first; i < points.size(); ++i) {
      const SweepPoint& x = points[i];
      if (x.sparse != sparse) continue;
      const SweepRatios r = RatiosOf(x, points);
      char alt[16] = "-";
      if (x.bwd_alt_ms > 0)
        std::snprintf(
            alt, sizeof(alt), "%.2f%s", x.bwd_alt_ms / x.row.bwd_ms,
            ctxplan::AttentionBackwardOverUnion(x.chunk, s.hq, s.hkv, x.hd, x.page, !g_dkv_bf16)
                ? "g"
                : "u");
      std::printf(
          "%-6s %5lld %10lld | %8.3f %8.1f %6s | %8.3f %8.1f %6s | %8s %8s | %8s | %4.0f/%4.0f\n",
          sparse ? "sparse" : "dense", static_cast<long long>(x.page),
          static_cast<long long>(x.pages_per_tile), x.row.fwd_ms, x.row.FwdTflops(),
          RatioText(r.fwd_page, kPageBound).c_str(), x.row.bwd_ms, x.row.BwdTflops(),
          RatioText(r.bwd_page, kPageBound).c_str(), RatioText(r.fwd_hd, kHeadDimBound).c_str(),
          RatioText(r.bwd_hd, kHeadDimBound).c_str(), alt, x.row.fwd_mhz, x.row.bwd_mhz);
    }
  }
  std::printf(
      "(TF/s per FLOP as counted for the attended pairs; * outside issue 14's bounds: /p128 more "
      "than %.0f%% from 1, /d128 more than %.0f%%; bwd alt/: the sparse backward's time on the "
      "other blocks, over this one's: u key blocks over the union's pages where this one gathers "
      "each tile's selected positions, g those where this one takes the union; MHz f/b: the mean "
      "SM clock while the forward / backward were timed, 0 where NVML did not open)\n",
      kPageBound * 100, kHeadDimBound * 100);
  std::fflush(stdout);
}

// Every point with a ratio outside issue 14's bounds (SWEEP-OUT lines), then their count.
void PrintSweepSummary(const std::vector<SweepPoint>& points) {
  std::printf("\n");
  int outside = 0;
  for (const SweepPoint& x : points) {
    const SweepRatios r = RatiosOf(x, points);
    const bool out = Outside(r.fwd_page, kPageBound) || Outside(r.bwd_page, kPageBound) ||
                     Outside(r.fwd_hd, kHeadDimBound) || Outside(r.bwd_hd, kHeadDimBound);
    if (!out) continue;
    ++outside;
    std::printf(
        "SWEEP-OUT %s: fwd /p128 %s /d128 %s, bwd /p128 %s /d128 %s\n", x.row.shape.c_str(),
        RatioText(r.fwd_page, kPageBound).c_str(), RatioText(r.fwd_hd, kHeadDimBound).c_str(),
        RatioText(r.bwd_page, kPageBound).c_str(), RatioText(r.bwd_hd, kHeadDimBound).c_str());
  }
  std::printf("SWEEP: %d of %zu points outside issue 14's bounds\n", outside, points.size());
}

// The last chunk of a `context`-token sequence (context a multiple of s.chunk, at least two
// chunks) at every swept page size that divides the chunk: dense, then page-sparse, forward and
// backward. Reports each point (RESULT line, CSV row), appends it to points, prints the table.
void SweepChunk(const BenchShape& s, int64_t context, int reps, const SweepGrid& grid,
                std::vector<SweepPoint>& points) {
  const int64_t c = s.chunk, last = context / c - 1, earlier = last * c;
  const int64_t tile = 128, tiles = c / tile;  // query tiles of the page selection
  const double own_pairs = static_cast<double>(c) * (c + 1) / 2.0;
  // sweep_d<d_h>_h<H_q>x<H_kv>_c<chunk>_p<page>_dense_e<earlier tokens each query attends> and
  // ..._sparse_e<earlier tokens a tile attends>of<earlier tokens>: sdpa_peer.py reads these.
  const std::string name = "sweep_d" + std::to_string(s.hd) + "_h" + std::to_string(s.hq) + "x" +
                           std::to_string(s.hkv) + "_c" + std::to_string(c);
  const size_t first = points.size();
  std::optional<Chunked> ch;  // one per (head_dim, chunk), re-paged per page size
  // Page 128's, timed beside each other page size's point (TimeInTurnMs): dense, and sparse with
  // its own selection of the grid's sparse tokens a tile.
  Chunked ref(s, context, kRefPage, grid.shuffled);
  const int64_t ref_pages = earlier / kRefPage;
  const int64_t ref_per_tile = std::min(grid.sparse_tokens / kRefPage, ref_pages);
  const DeviceSelection ref_sel(RandomSelection(tiles, ref_pages, ref_per_tile, 3), tile,
                                ref_per_tile);
  const PageSelection dense{};
  // x's forward and backward, alternately with page 128's where p is not 128.
  auto time_point = [&](SweepPoint& x, const PageSelection& sel, const PageSelection& r_sel,
                        double r_pairs) {
    const bool alone = x.page == kRefPage;
    const TurnTimes t = TimeFwdBwd(*ch, last, sel, reps, alone ? nullptr : &ref, r_sel);
    x.row.fwd_ms = t.fwd_ms;
    x.row.bwd_ms = t.bwd_ms;
    x.ref_fwd_ms = t.ref_fwd_ms;
    x.ref_bwd_ms = t.ref_bwd_ms;
    x.row.fwd_mhz = t.fwd_mhz;
    x.row.bwd_mhz = t.bwd_mhz;
    if (!alone) x.ref_pairs = r_pairs;
  };
  for (const int64_t p : grid.pages) {
    if (c % p != 0) continue;
    if (ch) {
      ch->SetPages(p);
    } else {
      ch.emplace(s, context, p, grid.shuffled);
    }
    const int64_t earlier_pages = earlier / p;

    SweepPoint d{s.hd, c, p, false, earlier_pages, {}};
    d.row.shape = name + "_p" + std::to_string(p) + "_dense_e" + std::to_string(earlier);
    d.row.hq = s.hq;
    d.row.hd = s.hd;
    d.row.pairs = own_pairs + static_cast<double>(c) * earlier;
    time_point(d, dense, dense, d.row.pairs);
    Report(d.row);
    points.push_back(d);

    // BenchSparse's selection (sink + random pages, one generator, seed 3), the grid's sparse
    // tokens a tile.
    const int64_t per_tile = std::min(grid.sparse_tokens / p, earlier_pages);
    const DeviceSelection sel(RandomSelection(tiles, earlier_pages, per_tile, 3), tile, per_tile);
    SweepPoint sp{s.hd, c, p, true, per_tile, {}};
    sp.row.shape = name + "_p" + std::to_string(p) + "_sparse_e" + std::to_string(per_tile * p) +
                   "of" + std::to_string(earlier);
    sp.row.hq = s.hq;
    sp.row.hd = s.hd;
    sp.row.pairs = own_pairs + static_cast<double>(c) * per_tile * p;
    time_point(sp, sel.view, ref_sel.view,
               own_pairs + static_cast<double>(c) * ref_per_tile * kRefPage);
    {
      const char* was = std::getenv("CTXPLAN_ATTN_BWD_SPARSE");
      const std::string before = was != nullptr ? was : "";
      const bool union_default =
          ctxplan::AttentionBackwardOverUnion(c, s.hq, s.hkv, s.hd, p, !g_dkv_bf16);
      setenv("CTXPLAN_ATTN_BWD_SPARSE", union_default ? "gather" : "union", 1);
      sp.bwd_alt_ms = TimeMs([&] { ch->Backward(last, sel.view); }, reps, 2);
      if (was != nullptr) {
        setenv("CTXPLAN_ATTN_BWD_SPARSE", before.c_str(), 1);
      } else {
        unsetenv("CTXPLAN_ATTN_BWD_SPARSE");
      }
    }
    Report(sp.row);
    points.push_back(sp);
  }
  PrintSweepTable(s, context, grid, points, first);
}

// Every (head_dim, chunk) of the sweep over the last chunk of `tokens` (rounded down to a multiple
// of the chunk), then the ratios outside the bounds. head_dim: only that head_dim's rows (0: both);
// heads: the head_dim 64 rows' (H_q, H_kv), or with head_dim 128 the head_dim 128 rows', else
// kSweepHeads'.
void RunSweep(int64_t tokens, int reps, int64_t head_dim,
              std::optional<std::pair<int64_t, int64_t>> heads, const SweepGrid& grid) {
  std::vector<SweepPoint> points;
  for (BenchShape s : kSweepHeads) {
    if (head_dim != 0 && s.hd != head_dim) continue;
    if (heads && (s.hd == 64 || head_dim == 128)) std::tie(s.hq, s.hkv) = *heads;
    for (const int64_t c : grid.chunks) {
      s.chunk = c;
      const int64_t context = tokens / c * c;
      if (context < 2 * c) {
        std::printf("SWEEP d_h %lld, chunk %lld: skipped, --tokens %lld leaves no earlier chunk\n",
                    static_cast<long long>(s.hd), static_cast<long long>(c),
                    static_cast<long long>(tokens));
        continue;
      }
      SweepChunk(s, context, reps, grid, points);
    }
  }
  PrintSweepSummary(points);
}

// --- qtile: the page-sparse rate against the query tile (a page selection's queries) ---------

// The last 4096-query chunk of `tokens` (at least two chunks) over pages of 128, each query tile
// attending the sink and 47 random pages (6144 tokens, as the sweep), at query tiles of 128, 256
// and 512: forward and backward rates, each against query tile 128's timed alternately with it.
void RunQueryTiles(int64_t tokens, int reps) {
  constexpr int64_t kChunk = 4096, kPage = 128, kPerTile = kSparseTokens / kPage;
  constexpr int64_t kTiles[] = {128, 256, 512};
  const int64_t context = tokens / kChunk * kChunk, last = context / kChunk - 1;
  const int64_t earlier = last * kChunk, earlier_pages = earlier / kPage;
  if (last < 1 || earlier_pages < kPerTile) {
    std::printf("QTILE: skipped, --tokens %lld leaves under %lld earlier pages\n",
                static_cast<long long>(tokens), static_cast<long long>(kPerTile));
    return;
  }
  const double pairs = static_cast<double>(kChunk) * (kChunk + 1) / 2.0 +
                       static_cast<double>(kChunk) * kSparseTokens;
  for (BenchShape s : kSweepHeads) {
    s.chunk = kChunk;
    Chunked ch(s, context, kPage, /*shuffled=*/true);
    auto selection = [&](int64_t query_tile) {
      return DeviceSelection(RandomSelection(kChunk / query_tile, earlier_pages, kPerTile, 3),
                             query_tile, kPerTile);
    };
    const DeviceSelection ref = selection(kTiles[0]);  // query tile 128's, timed beside the others
    std::printf(
        "\nQTILE d_h %lld, %lld/%lld heads: the last chunk of %lld tokens, %lld earlier "
        "tokens a tile in pages of %lld\n%-10s | %8s %8s %6s | %8s %8s %6s\n",
        static_cast<long long>(s.hd), static_cast<long long>(s.hq), static_cast<long long>(s.hkv),
        static_cast<long long>(context), static_cast<long long>(kSparseTokens),
        static_cast<long long>(kPage), "query tile", "fwd ms", "fwd TF/s", "/q128", "bwd ms",
        "bwd TF/s", "/q128");
    for (const int64_t query_tile : kTiles) {
      const bool alone = query_tile == kTiles[0];
      TurnTimes t;
      if (alone) {
        t = TimeFwdBwd(ch, last, ref.view, reps);
      } else {
        const DeviceSelection sel = selection(query_tile);
        t = TimeFwdBwd(ch, last, sel.view, reps, &ch, ref.view);
      }
      Row row;
      row.shape = "qtile_d" + std::to_string(s.hd) + "_h" + std::to_string(s.hq) + "x" +
                  std::to_string(s.hkv) + "_c" + std::to_string(kChunk) + "_p" +
                  std::to_string(kPage) + "_q" + std::to_string(query_tile) + "_e" +
                  std::to_string(kSparseTokens) + "of" + std::to_string(earlier);
      row.hq = s.hq;
      row.hd = s.hd;
      row.pairs = pairs;
      row.fwd_ms = t.fwd_ms;
      row.bwd_ms = t.bwd_ms;
      // The same pairs: the rate ratio is the time's inverse.
      const double fwd_ratio = alone ? 1.0 : t.ref_fwd_ms / t.fwd_ms;
      const double bwd_ratio = alone ? 1.0 : t.ref_bwd_ms / t.bwd_ms;
      Report(row);
      std::printf("%10lld | %8.3f %8.1f %6.2f | %8.3f %8.1f %6.2f\n",
                  static_cast<long long>(query_tile), row.fwd_ms, row.FwdTflops(), fwd_ratio,
                  row.bwd_ms, row.BwdTflops(), bwd_ratio);
    }
    std::fflush(stdout);
  }
}

// --heads "H_qxH_kv": H_kv dividing H_q, H_q at most 128; nullopt for anything else.
std::optional<std::pair<int64_t, int64_t>> ParseHeads(const std::string& v) {
  long long hq = 0, hkv = 0;
  char x = 0, extra = 0;
  if (std::sscanf(v.c_str(), "%lld%c%lld%c", &hq, &x, &hkv, &extra) != 3 || x != 'x' || hq < 1 ||
      hkv < 1 || hq > 128 || hq % hkv != 0)
    return std::nullopt;
  return std::pair<int64_t, int64_t>{hq, hkv};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "attention_bench: ctxplan's paged attention on Qwen2.5-7B shapes (28/4 heads, d_h 128); "
      "--only sweep (not in the default run) sweeps the last chunk's per-FLOP rate over page sizes "
      "32-256, d_h 64 and 128, chunks 1024-16384 against page 128's (issue 14); "
      "kernels/bench/sdpa_peer.py --ours FILE runs the PyTorch SDPA peers on the same shapes"};
  int reps = 5;
  int64_t n = 65536;
  constexpr int64_t c = kQwen7B.chunk;  // the runtime's chunk
  std::string only, csv, heads = "28x4";
  int64_t head_dim = 0;
  app.add_option("--reps", reps, "timed repetitions per shape")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  app.add_option("--tokens", n,
                 "context tokens, a multiple of the 4096-token chunk (sweep: rounded down to a "
                 "multiple of each chunk; its last chunk is timed)")
      ->capture_default_str()
      ->check(CLI::Range(c, int64_t{1} << 22))
      ->check(CLI::Validator(
          [](const std::string& v) {
            return std::stoll(v) % c == 0 ? std::string{} : "must be a multiple of 4096";
          },
          "MULTIPLE OF 4096"));
  app.add_option("--only", only,
                 "one family of shapes; sweep: page size x head_dim x chunk, run only when asked "
                 "(about a minute on an H100); qtile: the page-sparse rate against the query "
                 "tile, also only when asked")
      ->check(CLI::IsMember({"full", "chunked", "last", "sweep", "qtile"}));
  app.add_option("--heads", heads,
                 "the full family's H_q x H_kv (GQA group H_q / H_kv); its rows are named "
                 "full_<n>k_h<H_q>x<H_kv> unless 28x4 (Qwen2.5-7B); sweep: the head_dim 64 "
                 "rows' (32x8 unless given), or with --head-dim 128 the head_dim 128 rows'")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](const std::string& v) {
            return ParseHeads(v)
                       ? std::string{}
                       : std::string{"must be H_qxH_kv, H_kv dividing H_q, H_q at most 128"};
          },
          "HQxHKV"));
  app.add_option(
         "--head-dim", head_dim,
         "sweep: only this head_dim's rows (the /d128 ratios need both); full: the head_dim "
         "(128 unless given; rows named full_<n>k..._d64 at 64)")
      ->check(CLI::IsMember({64, 128}));
  std::string dkv_type = "fp32";
  app.add_option("--dkv", dkv_type,
                 "the backward's dKV pool: fp32, or bf16 as the runtime's at its default grad "
                 "dtype")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  SweepGrid grid;
  app.add_option("--chunks", grid.chunks,
                 "sweep: the chunks timed (default 1024 3072 4096 16384), multiples of 128")
      ->check(CLI::Range(int64_t{1024}, int64_t{65536}))
      ->check(CLI::Validator(
          [](const std::string& v) {
            return std::stoll(v) % 128 == 0 ? std::string{} : "must be a multiple of 128";
          },
          "MULTIPLE OF 128"));
  app.add_option("--pages", grid.pages,
                 "sweep: the page sizes timed where they divide the chunk (default 32 48 64 96 "
                 "128 192 256)")
      ->check(CLI::Range(int64_t{16}, int64_t{256}));
  app.add_option("--sparse-tokens", grid.sparse_tokens,
                 "sweep: the earlier tokens a page-sparse 128-query tile attends, a multiple of "
                 "every --pages size and of 128")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{128}, int64_t{1} << 20));
  std::string page_table = "shuffled";
  app.add_option("--page-table", page_table,
                 "sweep: the pool's page table, shuffled (the paging cost) or identity (pages in "
                 "position order)")
      ->capture_default_str()
      ->check(CLI::IsMember({"shuffled", "identity"}));
  double cool_ms = 0;
  app.add_option("--cool-ms", cool_ms,
                 "idle the GPU this long before each timed window (its clock then at the "
                 "maximum, as the calibration's rows are timed; 0: back to back)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 10000.0));
  app.add_option("--csv", csv, "also write the results as CSV (published when the run completes)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "attention_bench: %s; see attention_bench --help\n", e.what());
    return 2;
  }
  g_dkv_bf16 = dkv_type == "bf16";
  g_cool_seconds = cool_ms * 1e-3;
  grid.shuffled = page_table == "shuffled";
  const bool grid_flags = app.count("--chunks") + app.count("--pages") +
                              app.count("--sparse-tokens") + app.count("--page-table") >
                          0;
  if (grid_flags && only != "sweep") {
    std::fprintf(stderr,
                 "attention_bench: --chunks, --pages, --sparse-tokens and --page-table: accepted "
                 "with --only sweep\n");
    return 2;
  }
  for (const int64_t p : grid.pages) {
    if (grid.sparse_tokens % p != 0 || grid.sparse_tokens % kRefPage != 0) {
      std::fprintf(stderr,
                   "attention_bench: --sparse-tokens %lld: must be a multiple of every page size "
                   "(%lld) and of %lld, so that every page size attends the same pairs\n",
                   static_cast<long long>(grid.sparse_tokens), static_cast<long long>(p),
                   static_cast<long long>(kRefPage));
      return 2;
    }
  }
  if (head_dim != 0 && only != "sweep" && only != "full") {
    std::fprintf(stderr,
                 "attention_bench: --head-dim %lld: accepted with --only sweep or --only full (the "
                 "chunked and last families run Qwen2.5-7B's head_dim 128)\n",
                 static_cast<long long>(head_dim));
    return 2;
  }
  std::optional<ctxplan::AtomicFileWriter> csv_file;
  try {
    if (!csv.empty()) csv_file.emplace(csv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: --csv: %s\n", e.what());
    return 2;
  }
  if (csv_file) g_csv = &csv_file->stream();
  try {
    int dev = 0;
    cudaDeviceProp prop{};
    CTXPLAN_CUDA_CHECK(cudaGetDevice(&dev));
    CTXPLAN_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    if (only == "sweep" || only == "qtile") {
      std::printf("device: %s, %d SMs, L2 %d MB; %s of the last chunk, n=%lld\n", prop.name,
                  prop.multiProcessorCount, prop.l2CacheSize >> 20, only.c_str(),
                  static_cast<long long>(n));
    } else {
      std::printf(
          "device: %s, %d SMs, L2 %d MB; shape H_q=%lld H_kv=%lld d_h=%lld (full: %s), n=%lld\n",
          prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20,
          static_cast<long long>(kQwen7B.hq), static_cast<long long>(kQwen7B.hkv),
          static_cast<long long>(kQwen7B.hd), heads.c_str(), static_cast<long long>(n));
    }
    ctxplan::gpu::GpuClockSampler clocks(dev);
    g_clocks = &clocks;
    if (clocks.available())
      std::printf("SM clock: sampled over each timed window (maximum %.0f MHz)\n",
                  clocks.max_sm_clock_mhz());
    if (g_csv) *g_csv << "shape,fwd_ms,fwd_tflops,bwd_ms,bwd_tflops,fwd_mhz,bwd_mhz\n";
    if (only == "qtile") {
      RunQueryTiles(n, reps);
    } else if (only == "sweep") {
      RunSweep(n, reps, head_dim, app.count("--heads") > 0 ? ParseHeads(heads) : std::nullopt,
               grid);
    } else {
      BenchShape full_heads = kQwen7B;
      std::tie(full_heads.hq, full_heads.hkv) = *ParseHeads(heads);  // validated by the parser
      if (head_dim != 0) full_heads.hd = head_dim;
      RunFamilies(only, n, reps, full_heads);
    }
    g_clocks = nullptr;  // the sampler goes with this scope
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: %s\n", e.what());
    return 1;
  }
  try {
    if (csv_file) csv_file->Commit();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "attention_bench: --csv: %s\n", e.what());
    return 2;
  }
  return 0;
}
