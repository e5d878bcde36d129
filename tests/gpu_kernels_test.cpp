// The CUDA kernels of ops.h against the CPU references (ctxplan/kernels/cpu/reference.h).
//
// Every test skips itself without a GPU. Inputs are fresh random data from a seeded generator
// (never zeros), rounded to bf16 where the kernel stores bf16; the CPU reference runs in fp32 on
// exactly those values. Every output is poisoned (NaN bytes) before the kernel runs, so a value
// the kernel forgot to write fails. Errors are norm-wise relative, ||out - ref|| / ||ref||, +inf
// as soon as anything is NaN or inf. Tolerances: 1e-2 where bf16 storage or bf16 GEMM operands
// round (bf16 outputs, GEMM outputs); 1e-5 for fp32 outputs of plain fp32 arithmetic (rstd,
// fp32 accumulations, AdamW moments and fp32 parameters). Shapes are deliberately awkward:
// token counts that are not multiples of any block, hidden 3584 and small odd widths, head_dim
// 64 and 128, a vocabulary that is not a multiple of the vocab tile, a partly filled last page.
// Each check prints its error ("[err] ..."), so a run's log carries the numbers.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/kernels/cuda/check.h"
#include "ctxplan/kernels/cuda/gemm.h"
#include "ctxplan/kernels/cuda/ops.h"
#include "ctxplan/kernels/paged_kv.h"
#include "support/gpu.h"

namespace ctxplan::kernels {
namespace {

using bf16 = __nv_bfloat16;
using Floats = std::vector<float>;
using Ids = std::vector<int32_t>;

constexpr double kBf16Tolerance = 1e-2;
constexpr double kFp32Tolerance = 1e-5;
constexpr double kInf = std::numeric_limits<double>::infinity();

// --- host data ---------------------------------------------------------------------------------
float RoundBf16(float v) {
  return __bfloat162float(__float2bfloat16(v));
}

Floats Uniform(std::mt19937& rng, size_t n, double lo, double hi, bool bf16_exact = true) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Floats v(n);
  for (float& x : v) {
    x = static_cast<float>(dist(rng));
    if (bf16_exact) x = RoundBf16(x);
  }
  return v;
}

Ids RandomIds(std::mt19937& rng, size_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  Ids ids(n);
  for (int32_t& id : ids) id = dist(rng);
  return ids;
}

std::vector<bf16> ToBf16(const Floats& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __float2bfloat16(v[i]);
  return out;
}

Floats ToFloats(const std::vector<bf16>& v) {
  Floats out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

// ||out - ref|| / ||ref||, +inf on any NaN / inf or a size mismatch.
double RelativeError(const Floats& out, const Floats& ref) {
  if (out.size() != ref.size()) return kInf;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i]) || !std::isfinite(ref[i])) return kInf;
    const double d = static_cast<double>(out[i]) - ref[i];
    diff += d * d;
    norm += static_cast<double>(ref[i]) * ref[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : kInf;
  return std::sqrt(diff / norm);
}

Floats Minus(const Floats& a, const Floats& b) {
  Floats d(a.size());
  for (size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

// Checks and prints one error.
void Expect(const std::string& what, double error, double tolerance) {
  std::printf("[err] %-58s %.3e (tol %.0e)\n", what.c_str(), error, tolerance);
  EXPECT_LE(error, tolerance) << what;  // NaN / inf never pass
}

// --- device buffers ----------------------------------------------------------------------------
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    CTXPLAN_CUDA_CHECK(
        cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<size_t>(n, 1) * sizeof(T)));
    Poison();
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  // NaN bytes: 0xFFFF is a bf16 NaN, 0xFFFFFFFF an fp32 NaN.
  void Poison() { CTXPLAN_CUDA_CHECK(cudaMemset(ptr_, 0xFF, std::max<size_t>(n_, 1) * sizeof(T))); }
  void Upload(const std::vector<T>& host) {
    EXPECT_EQ(host.size(), n_);
    CTXPLAN_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> Download() const {
    CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<T> host(n_);
    CTXPLAN_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

using Bf16Buffer = DeviceBuffer<bf16>;
using FloatBuffer = DeviceBuffer<float>;

std::unique_ptr<Bf16Buffer> UploadBf16(const Floats& v) {
  return std::make_unique<Bf16Buffer>(ToBf16(v));
}
Floats DownloadFloats(const Bf16Buffer& b) {
  return ToFloats(b.Download());
}

template <typename T>
Floats DownloadAsFloats(const DeviceBuffer<T>& b) {
  if constexpr (std::is_same_v<T, bf16>) {
    return ToFloats(b.Download());
  } else {
    return b.Download();
  }
}

template <typename T>
std::vector<T> HostAs(const Floats& v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return ToBf16(v);
  } else {
    return v;
  }
}

void Sync() {
  CTXPLAN_CUDA_CHECK(cudaDeviceSynchronize());
}

template <typename T>
const char* TypeName() {
  return std::is_same_v<T, bf16> ? "bf16" : "fp32";
}

// --- embedding ---------------------------------------------------------------------------------
TEST(GpuKernels, EmbeddingForward) {
  SKIP_WITHOUT_GPU();
  struct Case {
    int64_t tokens, vocab, hidden;
  };
  std::mt19937 rng(101);
  for (const Case& c : {Case{1000, 517, 3584}, Case{37, 11, 77}, Case{1, 3, 8}}) {
    const Ids ids = RandomIds(rng, c.tokens, c.vocab);
    const Floats table = Uniform(rng, c.vocab * c.hidden, -1, 1);
    DeviceBuffer<int32_t> d_ids(ids);
    auto d_table = UploadBf16(table);
    Bf16Buffer d_out(c.tokens * c.hidden);
    cuda::EmbeddingForward(d_ids.get(), d_table->get(), c.tokens, c.vocab, c.hidden, d_out.get(),
                           nullptr);
    Floats ref(c.tokens * c.hidden);
    cpu::EmbeddingForward(ids, table.data(), c.vocab, c.hidden, ref.data());
    Expect("embedding fwd t=" + std::to_string(c.tokens) + " d=" + std::to_string(c.hidden),
           RelativeError(DownloadFloats(d_out), ref), kBf16Tolerance);
  }
}

TEST(GpuKernels, EmbeddingForwardBadIdGivesNaNRow) {
  SKIP_WITHOUT_GPU();
  const Ids ids = {0, 7, 1};  // 7 is outside a vocabulary of 2
  const Floats table = {1, 2, 3, 4};
  DeviceBuffer<int32_t> d_ids(ids);
  auto d_table = UploadBf16(table);
  Bf16Buffer d_out(6);
  cuda::EmbeddingForward(d_ids.get(), d_table->get(), 3, 2, 2, d_out.get(), nullptr);
  const Floats out = DownloadFloats(d_out);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_TRUE(std::isnan(out[2]) && std::isnan(out[3]));
  EXPECT_EQ(out[5], 4.0f);
}

template <typename GradT>
void CheckEmbeddingBackward() {
  struct Case {
    int64_t tokens, vocab, hidden;
  };
  std::mt19937 rng(202);
  // Small vocabularies force many repeated ids; one case repeats a single id everywhere.
  for (const Case& c :
       {Case{1000, 50, 3584}, Case{37, 5, 77}, Case{513, 3000, 512}, Case{300, 1, 64}}) {
    const Ids ids = RandomIds(rng, c.tokens, c.vocab);
    const Floats d_out = Uniform(rng, c.tokens * c.hidden, -1, 1);
    const Floats table0 = Uniform(rng, c.vocab * c.hidden, -1, 1);  // accumulated onto
    DeviceBuffer<int32_t> d_ids(ids);
    auto d_dout = UploadBf16(d_out);
    DeviceBuffer<GradT> d_table(HostAs<GradT>(table0));
    cuda::EmbeddingBackward(d_ids.get(), d_dout->get(), c.tokens, c.vocab, c.hidden, d_table.get(),
                            nullptr);
    Floats ref = table0;
    cpu::EmbeddingBackward(ids, d_out.data(), c.vocab, c.hidden, ref.data());
    const double tol = std::is_same_v<GradT, float> ? kFp32Tolerance : kBf16Tolerance;
    Expect(std::string("embedding bwd ") + TypeName<GradT>() + " t=" + std::to_string(c.tokens) +
               " V=" + std::to_string(c.vocab) + " d=" + std::to_string(c.hidden),
           RelativeError(DownloadAsFloats(d_table), ref), tol);
    // What was added, on its own (the table's initial values do not dominate it).
    Expect(
        std::string("embedding bwd ") + TypeName<GradT>() + " added, V=" + std::to_string(c.vocab),
        RelativeError(Minus(DownloadAsFloats(d_table), table0), Minus(ref, table0)),
        std::is_same_v<GradT, float> ? kFp32Tolerance : 2 * kBf16Tolerance);
  }
}

TEST(GpuKernels, EmbeddingBackwardFp32) {
  SKIP_WITHOUT_GPU();
  CheckEmbeddingBackward<float>();
}

TEST(GpuKernels, EmbeddingBackwardBf16) {
  SKIP_WITHOUT_GPU();
  CheckEmbeddingBackward<bf16>();
}

// --- RMSNorm -----------------------------------------------------------------------------------
struct RowsCase {
  int64_t tokens, hidden;
};
const RowsCase kNormCases[] = {{1000, 3584}, {33, 77}, {5, 1536}, {3, 8192}, {2, 1}};
// hidden 1 is left out of the backward: there x / rms(x) = +-1 whatever x, so dx is exactly 0
// and a relative error means nothing.
// Pipelined (hidden <= 4096, a multiple of 8): 1000 x 3584, 5 x 1536, 1 x 4096; register-cached:
// the rest.
const RowsCase kNormBackwardCases[] = {{1000, 3584}, {33, 77},  {5, 1536},
                                       {1, 4096},    {3, 8192}, {2, 5}};
constexpr float kEps = 1e-6f;

TEST(GpuKernels, RmsNormForward) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(303);
  for (const RowsCase& c : kNormCases) {
    const Floats x = Uniform(rng, c.tokens * c.hidden, -2, 2);
    const Floats w = Uniform(rng, c.hidden, 0.5, 1.5);
    auto d_x = UploadBf16(x);
    auto d_w = UploadBf16(w);
    Bf16Buffer d_y(x.size());
    FloatBuffer d_rstd(c.tokens);
    cuda::RmsNormForward(d_x->get(), d_w->get(), c.tokens, c.hidden, kEps, d_y.get(), d_rstd.get(),
                         nullptr);
    Floats y(x.size()), rstd(c.tokens);
    cpu::RmsNormForward(x.data(), w.data(), c.tokens, c.hidden, kEps, y.data(), rstd.data());
    const std::string shape = " t=" + std::to_string(c.tokens) + " d=" + std::to_string(c.hidden);
    Expect("rmsnorm fwd y" + shape, RelativeError(DownloadFloats(d_y), y), kBf16Tolerance);
    Expect("rmsnorm fwd rstd" + shape, RelativeError(d_rstd.Download(), rstd), kFp32Tolerance);
  }
}

TEST(GpuKernels, RmsNormResidualForward) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(304);
  for (const RowsCase& c : kNormCases) {
    for (bool in_place : {false, true}) {
      const Floats residual = Uniform(rng, c.tokens * c.hidden, -2, 2);
      const Floats x = Uniform(rng, c.tokens * c.hidden, -1, 1);
      const Floats w = Uniform(rng, c.hidden, 0.5, 1.5);
      auto d_res = UploadBf16(residual);
      auto d_x = UploadBf16(x);
      auto d_w = UploadBf16(w);
      Bf16Buffer d_h(x.size()), d_y(x.size());
      FloatBuffer d_rstd(c.tokens);
      bf16* h = in_place ? d_res->get() : d_h.get();
      cuda::RmsNormResidualForward(d_res->get(), d_x->get(), d_w->get(), c.tokens, c.hidden, kEps,
                                   h, d_y.get(), d_rstd.get(), nullptr);
      Floats h_ref(x.size()), y(x.size()), rstd(c.tokens);
      for (size_t i = 0; i < x.size(); ++i) h_ref[i] = residual[i] + x[i];
      cpu::RmsNormForward(h_ref.data(), w.data(), c.tokens, c.hidden, kEps, y.data(), rstd.data());
      const std::string shape = std::string(in_place ? " in place" : "") +
                                " t=" + std::to_string(c.tokens) + " d=" + std::to_string(c.hidden);
      Expect("rmsnorm+residual fwd h" + shape,
             RelativeError(DownloadFloats(in_place ? *d_res : d_h), h_ref), kBf16Tolerance);
      Expect("rmsnorm+residual fwd y" + shape, RelativeError(DownloadFloats(d_y), y),
             kBf16Tolerance);
      // rstd of the bf16-rounded h: within bf16 rounding of the unrounded one.
      Expect("rmsnorm+residual fwd rstd" + shape, RelativeError(d_rstd.Download(), rstd),
             kBf16Tolerance);
    }
  }
}

TEST(GpuKernels, RmsNormResidualForwardChained) {
  SKIP_WITHOUT_GPU();
  // Three dependent launches back to back on one stream, each reading the residual stream the
  // previous one wrote in place: the kernels' programmatic dependent launch must keep the order.
  std::mt19937 rng(305);
  const int64_t t = 777, d = 3584, n = t * d;
  const Floats residual = Uniform(rng, n, -2, 2), x = Uniform(rng, n, -1, 1);
  const Floats w = Uniform(rng, d, 0.5, 1.5);
  auto d_res = UploadBf16(residual);
  auto d_x = UploadBf16(x);
  auto d_w = UploadBf16(w);
  Bf16Buffer d_y(n);
  FloatBuffer d_rstd(t);
  Floats h = residual;
  for (int step = 0; step < 3; ++step) {
    cuda::RmsNormResidualForward(d_res->get(), d_x->get(), d_w->get(), t, d, kEps, d_res->get(),
                                 d_y.get(), d_rstd.get(), nullptr);
    for (int64_t i = 0; i < n; ++i) h[i] = RoundBf16(h[i] + x[i]);
  }
  Floats y(n), rstd(t);
  cpu::RmsNormForward(h.data(), w.data(), t, d, kEps, y.data(), rstd.data());
  Expect("rmsnorm+residual fwd x3 chained, h", RelativeError(DownloadFloats(*d_res), h),
         kBf16Tolerance);
  Expect("rmsnorm+residual fwd x3 chained, y", RelativeError(DownloadFloats(d_y), y),
         kBf16Tolerance);
}

template <typename GradT>
void CheckRmsNormBackward(bool with_add) {
  std::mt19937 rng(with_add ? 405 : 404);
  for (const RowsCase& c : kNormBackwardCases) {
    const int64_t n = c.tokens * c.hidden;
    const Floats x = Uniform(rng, n, -2, 2);
    const Floats w = Uniform(rng, c.hidden, 0.5, 1.5);
    const Floats dy = Uniform(rng, n, -1, 1);
    const Floats add = Uniform(rng, n, -1, 1);
    const Floats dw0 = Uniform(rng, c.hidden, -1, 1);
    Floats y(n), rstd(c.tokens);
    cpu::RmsNormForward(x.data(), w.data(), c.tokens, c.hidden, kEps, y.data(), rstd.data());

    auto d_x = UploadBf16(x);
    auto d_w = UploadBf16(w);
    auto d_dy = UploadBf16(dy);
    auto d_add = UploadBf16(add);
    FloatBuffer d_rstd(rstd);
    Bf16Buffer d_dx(n);
    DeviceBuffer<GradT> d_dw(HostAs<GradT>(dw0));
    DeviceBuffer<char> scratch(cuda::RmsNormBackwardScratchBytes(c.tokens, c.hidden));
    // Twice on the same scratch: the same sums in the same order (d_weight bit for bit).
    DeviceBuffer<GradT> d_dw_again(HostAs<GradT>(dw0));
    for (GradT* target : {d_dw.get(), d_dw_again.get()}) {
      cuda::RmsNormBackward(d_x->get(), d_w->get(), d_rstd.get(), d_dy->get(),
                            with_add ? d_add->get() : nullptr, c.tokens, c.hidden, d_dx.get(),
                            target, scratch.get(), nullptr);
    }

    Floats dx(n), dw = dw0;
    cpu::RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), c.tokens, c.hidden, dx.data(),
                         dw.data());
    if (with_add) {
      for (int64_t i = 0; i < n; ++i) dx[i] += add[i];
    }
    const std::string shape = std::string(with_add ? " +d_add" : "") + " dW " + TypeName<GradT>() +
                              " t=" + std::to_string(c.tokens) + " d=" + std::to_string(c.hidden);
    Expect("rmsnorm bwd dx" + shape, RelativeError(DownloadFloats(d_dx), dx), kBf16Tolerance);
    const double tol = std::is_same_v<GradT, float> ? kFp32Tolerance : kBf16Tolerance;
    Expect("rmsnorm bwd d_weight" + shape, RelativeError(DownloadAsFloats(d_dw), dw), tol);
    EXPECT_EQ(DownloadAsFloats(d_dw_again), DownloadAsFloats(d_dw)) << "deterministic" << shape;
  }
}

// The final norm's variant: three calls of different lengths (so different grids) add to the
// same partial rows, summed into d_weight once at the end; d_weight must equal the sum of the
// three calls' gradients, and the whole sequence run twice must give the same bits.
template <typename GradT>
void CheckRmsNormBackwardIntoPartials() {
  std::mt19937 rng(406);
  const int64_t call_tokens[] = {1000, 7, 333};
  for (const int64_t hidden : {int64_t{3584}, int64_t{77}, int64_t{8192}}) {
    const Floats w = Uniform(rng, hidden, 0.5, 1.5);
    const Floats dw0 = Uniform(rng, hidden, -1, 1);
    auto d_w = UploadBf16(w);
    DeviceBuffer<char> partials(cuda::RmsNormBackwardScratchBytes(1000, hidden));
    Floats dw_ref = dw0;
    std::vector<GradT> results[2];
    for (int run = 0; run < 2; ++run) {
      DeviceBuffer<GradT> d_dw(HostAs<GradT>(dw0));
      CTXPLAN_CUDA_CHECK(cudaMemset(partials.get(), 0, partials.size()));
      std::mt19937 call_rng(407);  // the same calls in both runs
      int rows = 0;
      for (const int64_t t : call_tokens) {
        const Floats x = Uniform(call_rng, t * hidden, -2, 2);
        const Floats dy = Uniform(call_rng, t * hidden, -1, 1);
        Floats y(t * hidden), rstd(t);
        cpu::RmsNormForward(x.data(), w.data(), t, hidden, kEps, y.data(), rstd.data());
        auto d_x = UploadBf16(x);
        auto d_dy = UploadBf16(dy);
        FloatBuffer d_rstd(rstd);
        Bf16Buffer d_dx(t * hidden);
        rows = std::max(rows, cuda::RmsNormBackwardIntoPartials(
                                  d_x->get(), d_w->get(), d_rstd.get(), d_dy->get(), t, hidden,
                                  d_dx.get(), reinterpret_cast<float*>(partials.get()), nullptr));
        if (run == 1) continue;
        Floats dx(t * hidden);
        cpu::RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), t, hidden, dx.data(),
                             dw_ref.data());
        Expect(
            "rmsnorm bwd into partials dx t=" + std::to_string(t) + " d=" + std::to_string(hidden),
            RelativeError(DownloadFloats(d_dx), dx), kBf16Tolerance);
      }
      EXPECT_GT(rows, 0);
      EXPECT_LE(static_cast<size_t>(rows) * hidden * sizeof(float), partials.size());
      cuda::RmsNormAddPartials(reinterpret_cast<const float*>(partials.get()), rows, hidden,
                               d_dw.get(), nullptr);
      results[run] = d_dw.Download();
      if (run == 0) {
        const double tol = std::is_same_v<GradT, float> ? kFp32Tolerance : kBf16Tolerance;
        Expect("rmsnorm bwd into partials, 3 calls, d_weight " + std::string(TypeName<GradT>()) +
                   " d=" + std::to_string(hidden),
               RelativeError(DownloadAsFloats(d_dw), dw_ref), tol);
      }
    }
    EXPECT_EQ(0,
              std::memcmp(results[0].data(), results[1].data(), results[0].size() * sizeof(GradT)))
        << "deterministic d=" << hidden;
  }
}

TEST(GpuKernels, RmsNormBackwardIntoPartials) {
  SKIP_WITHOUT_GPU();
  CheckRmsNormBackwardIntoPartials<float>();
  CheckRmsNormBackwardIntoPartials<bf16>();
}

TEST(GpuKernels, RmsNormBackwardFp32Weight) {
  SKIP_WITHOUT_GPU();
  CheckRmsNormBackward<float>(false);
  CheckRmsNormBackward<float>(true);
}

TEST(GpuKernels, RmsNormBackwardBf16Weight) {
  SKIP_WITHOUT_GPU();
  CheckRmsNormBackward<bf16>(false);
  CheckRmsNormBackward<bf16>(true);
}

TEST(GpuKernels, RmsNormBackwardInPlaceAdd) {
  SKIP_WITHOUT_GPU();
  // d_add aliasing dx: the residual stream's gradient updated in place.
  std::mt19937 rng(406);
  const int64_t t = 129, d = 3584, n = t * d;
  const Floats x = Uniform(rng, n, -2, 2), w = Uniform(rng, d, 0.5, 1.5);
  const Floats dy = Uniform(rng, n, -1, 1), add = Uniform(rng, n, -1, 1);
  Floats y(n), rstd(t);
  cpu::RmsNormForward(x.data(), w.data(), t, d, kEps, y.data(), rstd.data());
  auto d_x = UploadBf16(x);
  auto d_w = UploadBf16(w);
  auto d_dy = UploadBf16(dy);
  auto d_acc = UploadBf16(add);
  FloatBuffer d_rstd(rstd), d_dw(Floats(d, 0.5f));
  DeviceBuffer<char> scratch(cuda::RmsNormBackwardScratchBytes(t, d));
  cuda::RmsNormBackward(d_x->get(), d_w->get(), d_rstd.get(), d_dy->get(), d_acc->get(), t, d,
                        d_acc->get(), d_dw.get(), scratch.get(), nullptr);
  Floats dx(n), dw(d, 0.5f);
  cpu::RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), t, d, dx.data(), dw.data());
  for (int64_t i = 0; i < n; ++i) dx[i] += add[i];
  Expect("rmsnorm bwd dx, d_add aliasing dx", RelativeError(DownloadFloats(*d_acc), dx),
         kBf16Tolerance);
}

// --- RoPE --------------------------------------------------------------------------------------
struct RopeCase {
  int64_t tokens, heads, head_dim, row_stride, first_position;
  double theta;
};

void CheckRope(bool backward) {
  const RopeCase cases[] = {
      {1000, 28, 128, 28 * 128, 0, 1e6},       // Qwen2.5-7B Q, a first chunk
      {513, 7, 64, 7 * 64, 123457, 1e4},       // head_dim 64, a later chunk
      {300, 32, 128, 36 * 128, 3000000, 1e6},  // Q and K heads inside a fused QKV row
      {37, 3, 24, 3 * 24, 77, 1e4},            // scalar path (half = 12)
      {17, 5, 6, 41, 4000001, 5e5},            // odd row stride, positions in the millions
  };
  std::mt19937 rng(backward ? 502 : 501);
  for (const RopeCase& c : cases) {
    const int64_t width = c.heads * c.head_dim;
    const Floats full = Uniform(rng, c.tokens * c.row_stride, -1, 1);
    auto d_x = UploadBf16(full);
    if (backward) {
      cuda::RopeBackward(d_x->get(), c.tokens, c.heads, c.head_dim, c.row_stride, c.first_position,
                         c.theta, nullptr);
    } else {
      cuda::RopeForward(d_x->get(), c.tokens, c.heads, c.head_dim, c.row_stride, c.first_position,
                        c.theta, nullptr);
    }
    const Floats out_full = DownloadFloats(*d_x);
    Floats rotated(c.tokens * width), out(c.tokens * width);
    bool rest_untouched = true;
    for (int64_t t = 0; t < c.tokens; ++t) {
      std::copy_n(full.begin() + t * c.row_stride, width, rotated.begin() + t * width);
      std::copy_n(out_full.begin() + t * c.row_stride, width, out.begin() + t * width);
      for (int64_t i = width; i < c.row_stride; ++i) {
        rest_untouched =
            rest_untouched && out_full[t * c.row_stride + i] == full[t * c.row_stride + i];
      }
    }
    if (backward) {
      cpu::RopeBackward(rotated.data(), c.tokens, c.heads, c.head_dim, c.first_position, c.theta);
    } else {
      cpu::RopeForward(rotated.data(), c.tokens, c.heads, c.head_dim, c.first_position, c.theta);
    }
    Expect(std::string("rope ") + (backward ? "bwd" : "fwd") + " t=" + std::to_string(c.tokens) +
               " H=" + std::to_string(c.heads) + " d_h=" + std::to_string(c.head_dim) + " stride=" +
               std::to_string(c.row_stride) + " pos0=" + std::to_string(c.first_position),
           RelativeError(out, rotated), kBf16Tolerance);
    EXPECT_TRUE(rest_untouched) << "RoPE wrote outside the rotated heads";
  }
}

TEST(GpuKernels, RopeForward) {
  SKIP_WITHOUT_GPU();
  CheckRope(false);
}

TEST(GpuKernels, RopeBackward) {
  SKIP_WITHOUT_GPU();
  CheckRope(true);
}

// --- SwiGLU ------------------------------------------------------------------------------------
const RowsCase kSwigluCases[] = {{257, 18944}, {33, 77}, {1000, 1536}, {1, 8}};

TEST(GpuKernels, SwigluForward) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(601);
  for (const RowsCase& c : kSwigluCases) {
    const Floats gate_up = Uniform(rng, c.tokens * 2 * c.hidden, -6, 6);
    auto d_gu = UploadBf16(gate_up);
    Bf16Buffer d_out(c.tokens * c.hidden);
    cuda::SwigluForward(d_gu->get(), c.tokens, c.hidden, d_out.get(), nullptr);
    Floats out(c.tokens * c.hidden);
    cpu::SwigluForward(gate_up.data(), c.tokens, c.hidden, out.data());
    Expect("swiglu fwd t=" + std::to_string(c.tokens) + " I=" + std::to_string(c.hidden),
           RelativeError(DownloadFloats(d_out), out), kBf16Tolerance);
  }
}

TEST(GpuKernels, SwigluBackward) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(602);
  for (const RowsCase& c : kSwigluCases) {
    for (bool in_place : {false, true}) {
      const Floats gate_up = Uniform(rng, c.tokens * 2 * c.hidden, -6, 6);
      const Floats d_out = Uniform(rng, c.tokens * c.hidden, -1, 1);
      auto d_gu = UploadBf16(gate_up);
      auto d_dout = UploadBf16(d_out);
      Bf16Buffer d_dgu(gate_up.size());
      bf16* target = in_place ? d_gu->get() : d_dgu.get();
      cuda::SwigluBackward(d_gu->get(), d_dout->get(), c.tokens, c.hidden, target, nullptr);
      Floats ref(gate_up.size());
      cpu::SwigluBackward(gate_up.data(), d_out.data(), c.tokens, c.hidden, ref.data());
      Expect(std::string("swiglu bwd") + (in_place ? " in place" : "") +
                 " t=" + std::to_string(c.tokens) + " I=" + std::to_string(c.hidden),
             RelativeError(DownloadFloats(in_place ? *d_gu : d_dgu), ref), kBf16Tolerance);
    }
  }
}

// --- page helpers ------------------------------------------------------------------------------
struct PageCase {
  int64_t tokens, page_tokens, kv_heads, head_dim, row_stride, k_offset, v_offset;
};
// 1000 = 15 * 64 + 40 and 50 = 3 * 16 + 2: partly filled last pages; 64 = one full page; a
// fused QKV row (28 + 4 + 4 heads of 128) with K at head 28 and V at head 32; a scalar path.
const PageCase kPageCases[] = {
    {1000, 64, 4, 128, 4 * 128, 0, 0}, {50, 16, 7, 64, 7 * 64, 0, 0},
    {64, 64, 4, 128, 4 * 128, 0, 0},   {300, 128, 4, 128, 36 * 128, 28 * 128, 32 * 128},
    {37, 16, 3, 6, 19, 0, 0},
};

struct PageSetup {
  KvPageShape shape;
  int64_t pages = 0, slots = 0;
  std::vector<int32_t> page_slot;  // logical page -> slot: a shuffled subset of the pool
};

PageSetup MakePages(const PageCase& c, std::mt19937& rng) {
  PageSetup s;
  s.shape = {c.page_tokens, c.kv_heads, c.head_dim};
  s.pages = (c.tokens + c.page_tokens - 1) / c.page_tokens;
  s.slots = s.pages + 3;
  std::vector<int32_t> all(s.slots);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  s.page_slot.assign(all.begin(), all.begin() + s.pages);
  return s;
}

// The K and V rows of tokens 0..t-1 gathered from a pool (host copy).
Floats GatherRows(const Floats& pool, const PageSetup& s, int64_t tokens, int which) {
  const int64_t kv = s.shape.kv_dim();
  Floats rows(tokens * kv);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = s.page_slot[t / s.shape.page_tokens];
    const int64_t at = s.shape.Offset(slot, which, t % s.shape.page_tokens, 0);
    std::copy_n(pool.begin() + at, kv, rows.begin() + t * kv);
  }
  return rows;
}

TEST(GpuKernels, KvWrite) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(701);
  for (const PageCase& c : kPageCases) {
    const PageSetup s = MakePages(c, rng);
    const int64_t kv = s.shape.kv_dim();
    const Floats qkv = Uniform(rng, c.tokens * c.row_stride, -1, 1);
    auto d_qkv = UploadBf16(qkv);
    Bf16Buffer d_pool(s.slots * s.shape.page_elements());  // poisoned
    DeviceBuffer<int32_t> d_slots(s.page_slot);
    cuda::KvWrite(d_qkv->get() + c.k_offset, d_qkv->get() + c.v_offset, c.row_stride, c.tokens,
                  PagedKv<bf16>{s.shape, d_pool.get(), d_slots.get(), s.pages}, nullptr);

    // Reference: contiguous K and V extracted from the rows, written by the CPU KvWrite.
    Floats k(c.tokens * kv), v(c.tokens * kv);
    for (int64_t t = 0; t < c.tokens; ++t) {
      std::copy_n(qkv.begin() + t * c.row_stride + c.k_offset, kv, k.begin() + t * kv);
      std::copy_n(qkv.begin() + t * c.row_stride + c.v_offset, kv, v.begin() + t * kv);
    }
    Floats pool_ref(s.slots * s.shape.page_elements(), 0.0f);
    cpu::KvWrite(k.data(), v.data(), c.tokens,
                 PagedKv<float>{s.shape, pool_ref.data(), s.page_slot.data(), s.pages});
    const std::vector<bf16> pool_raw = d_pool.Download();
    const Floats pool = ToFloats(pool_raw);
    const std::string shape =
        " t=" + std::to_string(c.tokens) + " p=" + std::to_string(c.page_tokens) +
        " kv_dim=" + std::to_string(kv) + " stride=" + std::to_string(c.row_stride);
    Expect("kv write K" + shape,
           RelativeError(GatherRows(pool, s, c.tokens, 0), GatherRows(pool_ref, s, c.tokens, 0)),
           kBf16Tolerance);
    Expect("kv write V" + shape,
           RelativeError(GatherRows(pool, s, c.tokens, 1), GatherRows(pool_ref, s, c.tokens, 1)),
           kBf16Tolerance);
    // Nothing else was written: the unused slots and the last page's tail keep their poison.
    int64_t written = 0;
    for (const bf16& e : pool_raw) {
      uint16_t bits;
      std::memcpy(&bits, &e, sizeof(bits));
      written += bits != 0xFFFF;
    }
    EXPECT_LE(written, 2 * c.tokens * kv) << "KvWrite wrote outside its rows" << shape;
  }
}

template <typename PageT>
void CheckDkvAccumulate() {
  std::mt19937 rng(std::is_same_v<PageT, float> ? 801 : 802);
  for (const PageCase& c : kPageCases) {
    const PageSetup s = MakePages(c, rng);
    const int64_t kv = s.shape.kv_dim();
    const Floats pool = Uniform(rng, s.slots * s.shape.page_elements(), -1, 1);
    // dK and dV rows: inside one fused dQKV row when the offsets differ, else two buffers.
    const bool fused = c.k_offset != c.v_offset;
    const Floats dqkv = Uniform(rng, c.tokens * c.row_stride, -1, 1);
    const Floats dv_rows = fused ? dqkv : Uniform(rng, c.tokens * c.row_stride, -1, 1);
    DeviceBuffer<PageT> d_pool(HostAs<PageT>(pool));
    DeviceBuffer<int32_t> d_slots(s.page_slot);
    auto d_dqkv = UploadBf16(dqkv);
    auto d_dv_rows = UploadBf16(dv_rows);
    bf16* dv_base = fused ? d_dqkv->get() : d_dv_rows->get();
    cuda::DkvAccumulate(PagedKv<const PageT>{s.shape, d_pool.get(), d_slots.get(), s.pages},
                        c.tokens, d_dqkv->get() + c.k_offset, dv_base + c.v_offset, c.row_stride,
                        nullptr);
    Floats dk(c.tokens * kv), dv(c.tokens * kv);
    for (int64_t t = 0; t < c.tokens; ++t) {
      std::copy_n(dqkv.begin() + t * c.row_stride + c.k_offset, kv, dk.begin() + t * kv);
      std::copy_n(dv_rows.begin() + t * c.row_stride + c.v_offset, kv, dv.begin() + t * kv);
    }
    cpu::DkvAccumulate(PagedKv<const float>{s.shape, pool.data(), s.page_slot.data(), s.pages},
                       c.tokens, dk.data(), dv.data());
    const Floats out = DownloadFloats(*d_dqkv);
    const Floats out_dv = fused ? out : DownloadFloats(*d_dv_rows);
    Floats out_k(c.tokens * kv), out_v(c.tokens * kv);
    for (int64_t t = 0; t < c.tokens; ++t) {
      std::copy_n(out.begin() + t * c.row_stride + c.k_offset, kv, out_k.begin() + t * kv);
      std::copy_n(out_dv.begin() + t * c.row_stride + c.v_offset, kv, out_v.begin() + t * kv);
    }
    const std::string shape =
        std::string(" pages ") + TypeName<PageT>() + " t=" + std::to_string(c.tokens) +
        " p=" + std::to_string(c.page_tokens) + " kv_dim=" + std::to_string(kv);
    Expect("dkv accumulate dK" + shape, RelativeError(out_k, dk), kBf16Tolerance);
    Expect("dkv accumulate dV" + shape, RelativeError(out_v, dv), kBf16Tolerance);
  }
}

TEST(GpuKernels, DkvAccumulateFp32Pages) {
  SKIP_WITHOUT_GPU();
  CheckDkvAccumulate<float>();
}

TEST(GpuKernels, DkvAccumulateBf16Pages) {
  SKIP_WITHOUT_GPU();
  CheckDkvAccumulate<bf16>();
}

// --- linear layers -----------------------------------------------------------------------------
struct LinearCase {
  int64_t m, n, k;
  bool bias;
};
const LinearCase kLinearCases[] = {
    {1000, 1152, 3584, true}, {37, 29, 51, true}, {257, 896, 640, false}, {1, 3584, 8, true}};

std::string LinearShape(const LinearCase& c) {
  return " m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k);
}

TEST(GpuKernels, LinearForwardAndInputGradient) {
  SKIP_WITHOUT_GPU();
  cuda::CublasLtGemm gemm;
  std::mt19937 rng(901);
  for (const LinearCase& c : kLinearCases) {
    const Floats x = Uniform(rng, c.m * c.k, -1, 1);
    const Floats w = Uniform(rng, c.n * c.k, -0.1, 0.1);
    const Floats b = Uniform(rng, c.n, -1, 1);
    const Floats dy = Uniform(rng, c.m * c.n, -1, 1);
    auto d_x = UploadBf16(x);
    auto d_w = UploadBf16(w);
    auto d_b = UploadBf16(b);
    auto d_dy = UploadBf16(dy);
    Bf16Buffer d_y(c.m * c.n), d_dx(c.m * c.k);
    cuda::LinearForward(gemm, d_x->get(), d_w->get(), c.bias ? d_b->get() : nullptr, c.m, c.n, c.k,
                        d_y.get(), nullptr);
    cuda::LinearBackwardInput(gemm, d_dy->get(), d_w->get(), c.m, c.n, c.k, d_dx.get(), nullptr);
    Floats y(c.m * c.n), dx(c.m * c.k);
    cpu::LinearForward(x.data(), w.data(), c.bias ? b.data() : nullptr, c.m, c.n, c.k, y.data());
    cpu::LinearBackward(x.data(), w.data(), dy.data(), c.m, c.n, c.k, dx.data(), nullptr, nullptr);
    Expect(std::string("linear fwd") + (c.bias ? "+bias" : "") + LinearShape(c),
           RelativeError(DownloadFloats(d_y), y), kBf16Tolerance);
    Expect("linear bwd dx" + LinearShape(c), RelativeError(DownloadFloats(d_dx), dx),
           kBf16Tolerance);
  }
}

template <typename GradT>
void CheckLinearWeightGradient() {
  cuda::CublasLtGemm gemm;
  std::mt19937 rng(std::is_same_v<GradT, float> ? 902 : 903);
  for (const LinearCase& c : kLinearCases) {
    const Floats x = Uniform(rng, c.m * c.k, -1, 1);
    const Floats dy = Uniform(rng, c.m * c.n, -1, 1);
    Floats dw0 = Uniform(rng, c.n * c.k, -1, 1, false);
    Floats db0 = Uniform(rng, c.n, -1, 1, false);
    // Initial values of the size of one chunk's gradient, rounded to what the type stores.
    const float scale = std::sqrt(static_cast<float>(c.m)) / 3.0f;
    for (float& v : dw0) v = std::is_same_v<GradT, float> ? v * scale : RoundBf16(v * scale);
    for (float& v : db0) v = std::is_same_v<GradT, float> ? v * scale : RoundBf16(v * scale);
    auto d_x = UploadBf16(x);
    auto d_dy = UploadBf16(dy);
    DeviceBuffer<GradT> d_dw(HostAs<GradT>(dw0)), d_db(HostAs<GradT>(db0));
    cuda::LinearBackwardWeight(gemm, d_x->get(), d_dy->get(), c.m, c.n, c.k, d_dw.get(),
                               c.bias ? d_db.get() : static_cast<GradT*>(nullptr), nullptr);
    Floats dw = dw0, db = db0;
    cpu::LinearBackward(x.data(), nullptr, dy.data(), c.m, c.n, c.k, nullptr, dw.data(),
                        c.bias ? db.data() : nullptr);
    const std::string type = std::string(" ") + TypeName<GradT>();
    Expect("linear bwd dW (+=)" + type + LinearShape(c), RelativeError(DownloadAsFloats(d_dw), dw),
           kBf16Tolerance);
    Expect("linear bwd dW added" + type + LinearShape(c),
           RelativeError(Minus(DownloadAsFloats(d_dw), dw0), Minus(dw, dw0)),
           std::is_same_v<GradT, float> ? kBf16Tolerance : 2 * kBf16Tolerance);
    if (c.bias) {
      Expect("linear bwd d_bias (+=)" + type + LinearShape(c),
             RelativeError(DownloadAsFloats(d_db), db), kBf16Tolerance);
    } else {
      EXPECT_EQ(DownloadAsFloats(d_db), db0);  // untouched
    }
  }
}

TEST(GpuKernels, LinearWeightGradientFp32) {
  SKIP_WITHOUT_GPU();
  CheckLinearWeightGradient<float>();
}

TEST(GpuKernels, LinearWeightGradientBf16) {
  SKIP_WITHOUT_GPU();
  CheckLinearWeightGradient<bf16>();
}

// --- fused linear + cross-entropy --------------------------------------------------------------
struct LossCase {
  int64_t tokens, hidden, vocab, token_tile, vocab_tile;
};

template <typename GradT>
void CheckLinearCrossEntropy() {
  const LossCase cases[] = {
      {300, 3584, 1000, 128, 256},   // 3 token tiles (the second unlabelled), 4 vocab tiles
      {37, 77, 517, 16, 100},        // odd widths: scalar paths, last vocab tile of 17
      {256, 896, 4099, 4096, 1024},  // one token tile, last vocab tile of 3
  };
  cuda::CublasLtGemm gemm;
  std::mt19937 rng(std::is_same_v<GradT, float> ? 1001 : 1002);
  for (const LossCase& c : cases) {
    const Floats x = Uniform(rng, c.tokens * c.hidden, -1, 1);
    // Logits of a few units: a peaked but not one-hot softmax.
    const double w_range = 6.0 / std::sqrt(static_cast<double>(c.hidden));
    const Floats w = Uniform(rng, c.vocab * c.hidden, -w_range, w_range);
    Ids labels = RandomIds(rng, c.tokens, c.vocab);
    std::bernoulli_distribution drop(0.1);
    for (int32_t& l : labels) {
      if (drop(rng)) l = drop(rng) ? -100 : -1;
    }
    if (c.tokens > 2 * c.token_tile) {
      for (int64_t t = c.token_tile; t < 2 * c.token_tile; ++t) labels[t] = -1;
    }
    const int64_t labelled =
        std::count_if(labels.begin(), labels.end(), [](int32_t l) { return l >= 0; });
    const float grad_scale = 1.0f / static_cast<float>(labelled);

    // The reference, once with d_w starting at zero to size the initial values.
    Floats dx_ref(c.tokens * c.hidden), dw_grad(c.vocab * c.hidden, 0.0f);
    cpu::LinearCrossEntropy(x.data(), w.data(), labels, c.hidden, c.vocab, c.token_tile,
                            c.vocab_tile, grad_scale, dx_ref.data(), dw_grad.data());
    double rms = 0.0;
    for (float v : dw_grad) rms += static_cast<double>(v) * v;
    rms = std::sqrt(rms / dw_grad.size());
    Floats dw0 = Uniform(rng, dw_grad.size(), -rms, rms, false);
    if (!std::is_same_v<GradT, float>) {
      for (float& v : dw0) v = RoundBf16(v);
    }
    Floats dw_ref = dw0;
    const double loss_ref =
        cpu::LinearCrossEntropy(x.data(), w.data(), labels, c.hidden, c.vocab, c.token_tile,
                                c.vocab_tile, grad_scale, dx_ref.data(), dw_ref.data());

    auto d_x = UploadBf16(x);
    auto d_w = UploadBf16(w);
    DeviceBuffer<int32_t> d_labels(labels);
    DeviceBuffer<GradT> d_dw(HostAs<GradT>(dw0));
    Bf16Buffer d_dx(c.tokens * c.hidden);
    FloatBuffer d_loss(1);
    const cuda::LinearCrossEntropyShape shape{c.tokens, c.hidden, c.vocab, c.token_tile,
                                              c.vocab_tile};
    DeviceBuffer<char> workspace(cuda::LinearCrossEntropyWorkspaceBytes(shape));
    cuda::LinearCrossEntropy(gemm, shape, d_x->get(), d_w->get(), d_labels.get(), grad_scale,
                             d_dx.get(), d_dw.get(), d_loss.get(), workspace.get(), nullptr);
    const float loss = d_loss.Download()[0];
    const std::string name = std::string(" dW ") + TypeName<GradT>() +
                             " t=" + std::to_string(c.tokens) + " d=" + std::to_string(c.hidden) +
                             " V=" + std::to_string(c.vocab) + " tiles " +
                             std::to_string(c.token_tile) + "x" + std::to_string(c.vocab_tile);
    Expect("linear+CE loss" + name,
           std::isfinite(loss) ? std::abs(loss - loss_ref) / std::abs(loss_ref) : kInf,
           kBf16Tolerance);
    Expect("linear+CE dx" + name, RelativeError(DownloadFloats(d_dx), dx_ref), kBf16Tolerance);
    Expect("linear+CE dW (+=)" + name, RelativeError(DownloadAsFloats(d_dw), dw_ref),
           kBf16Tolerance);
    Expect("linear+CE dW added" + name,
           RelativeError(Minus(DownloadAsFloats(d_dw), dw0), Minus(dw_ref, dw0)),
           std::is_same_v<GradT, float> ? kBf16Tolerance : 2 * kBf16Tolerance);
  }
}

TEST(GpuKernels, LinearCrossEntropyFp32Weight) {
  SKIP_WITHOUT_GPU();
  CheckLinearCrossEntropy<float>();
}

TEST(GpuKernels, LinearCrossEntropyBf16Weight) {
  SKIP_WITHOUT_GPU();
  CheckLinearCrossEntropy<bf16>();
}

TEST(GpuKernels, LinearCrossEntropyLossOnly) {
  SKIP_WITHOUT_GPU();
  // dx and d_w null: the loss alone (a frozen head in an evaluation pass).
  std::mt19937 rng(1003);
  const int64_t t = 200, d = 512, v = 3001;
  const Floats x = Uniform(rng, t * d, -1, 1), w = Uniform(rng, v * d, -0.2, 0.2);
  const Ids labels = RandomIds(rng, t, v);
  const double loss_ref =
      cpu::LinearCrossEntropy(x.data(), w.data(), labels, d, v, 64, 512, 1.0f, nullptr, nullptr);
  cuda::CublasLtGemm gemm;
  auto d_x = UploadBf16(x);
  auto d_w = UploadBf16(w);
  DeviceBuffer<int32_t> d_labels(labels);
  FloatBuffer d_loss(1);
  const cuda::LinearCrossEntropyShape shape{t, d, v, 64, 512};
  DeviceBuffer<char> workspace(cuda::LinearCrossEntropyWorkspaceBytes(shape));
  cuda::LinearCrossEntropy(gemm, shape, d_x->get(), d_w->get(), d_labels.get(), 1.0f, nullptr,
                           static_cast<float*>(nullptr), d_loss.get(), workspace.get(), nullptr);
  const float loss = d_loss.Download()[0];
  Expect("linear+CE loss only", std::isfinite(loss) ? std::abs(loss - loss_ref) / loss_ref : kInf,
         kBf16Tolerance);
}

// --- AdamW -------------------------------------------------------------------------------------
template <typename P, typename G>
void CheckAdamW(int64_t n, int64_t offset) {
  std::mt19937 rng(1100 + static_cast<int>(sizeof(P) * 10 + sizeof(G)) + static_cast<int>(offset));
  constexpr bool kParamBf16 = std::is_same_v<P, bf16>;
  constexpr bool kGradBf16 = std::is_same_v<G, bf16>;
  const Floats p0 = Uniform(rng, n, -0.05, 0.05, kParamBf16);
  const Floats g = Uniform(rng, n, -1e-2, 1e-2, kGradBf16);
  const Floats m0 = Uniform(rng, n, -5e-3, 5e-3, false);
  const Floats v0 = Uniform(rng, n, 1e-6, 1e-4, false);
  cpu::AdamWParams cp;
  cp.lr = 1e-2f;
  cp.weight_decay = 0.1f;
  cp.step = 7;
  cuda::AdamWParams gp;
  gp.lr = cp.lr;
  gp.beta1 = cp.beta1;
  gp.beta2 = cp.beta2;
  gp.eps = cp.eps;
  gp.weight_decay = cp.weight_decay;
  gp.step = cp.step;

  // `offset` elements in: misaligned pointers take the scalar path.
  auto padded = [offset](const Floats& v) {
    Floats out(v.size() + offset, 1.0f);
    std::copy(v.begin(), v.end(), out.begin() + offset);
    return out;
  };
  DeviceBuffer<P> d_p(HostAs<P>(padded(p0)));
  DeviceBuffer<G> d_g(HostAs<G>(padded(g)));
  FloatBuffer d_m(padded(m0)), d_v(padded(v0));
  cuda::AdamW(d_p.get() + offset, d_g.get() + offset, d_m.get() + offset, d_v.get() + offset, n, gp,
              nullptr);
  Floats p = p0, m = m0, v = v0;
  cpu::AdamW(p.data(), g.data(), m.data(), v.data(), n, cp);
  auto unpad = [offset](const Floats& v) { return Floats(v.begin() + offset, v.end()); };
  const std::string name = std::string(" param ") + TypeName<P>() + " grad " + TypeName<G>() +
                           " n=" + std::to_string(n) + (offset ? " misaligned" : "");
  Expect("adamw param" + name, RelativeError(unpad(DownloadAsFloats(d_p)), p),
         kParamBf16 ? kBf16Tolerance : kFp32Tolerance);
  Expect("adamw m" + name, RelativeError(unpad(d_m.Download()), m), kFp32Tolerance);
  Expect("adamw v" + name, RelativeError(unpad(d_v.Download()), v), kFp32Tolerance);
  // The update itself, not only the parameter it moved.
  Expect("adamw update" + name,
         RelativeError(Minus(unpad(DownloadAsFloats(d_p)), p0), Minus(p, p0)),
         kParamBf16 ? 5 * kBf16Tolerance : 1e-4);
}

TEST(GpuKernels, AdamW) {
  SKIP_WITHOUT_GPU();
  for (int64_t offset : {0, 1}) {
    CheckAdamW<bf16, bf16>(1000003, offset);
    CheckAdamW<bf16, float>(1000003, offset);
    CheckAdamW<float, float>(1000003, offset);
    CheckAdamW<float, float>(7, offset);
  }
}

}  // namespace
}  // namespace ctxplan::kernels
