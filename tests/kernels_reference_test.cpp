// The CPU reference kernels against naive float64 implementations written independently here:
// plain loops and the textbook formulas (Hugging Face's for RoPE, PyTorch's for AdamW), never a
// call into the code under test. Every input is fresh random data from a seeded generator (never
// zeros: a zero input hides a missing term), every output is poisoned with NaN first (a value the
// kernel forgot to write fails), and errors are norm-wise relative, ||out - ref|| / ||ref||, which
// is +inf as soon as anything is NaN or inf. Shapes are deliberately awkward: single tokens, odd
// widths, counts that are not multiples of the tiles. Backward passes are also checked against
// central finite differences of a naive double forward on tiny shapes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/models/errors.h"

namespace ctxplan::kernels::cpu {
namespace {

using Doubles = std::vector<double>;
using Floats = std::vector<float>;

// fp32 storage with fp64 (or short fp32) sums: a few ulps of fp32 at most.
constexpr double kFp32Tolerance = 1e-5;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ||out - ref|| / ||ref||; +inf when a value is NaN or inf (NaN compares false with everything, so
// it must be caught explicitly) or the sizes differ.
double RelativeError(const Floats& out, const Doubles& ref) {
  if (out.size() != ref.size()) return kInf;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i]) || !std::isfinite(ref[i])) return kInf;
    const double d = static_cast<double>(out[i]) - ref[i];
    diff += d * d;
    norm += ref[i] * ref[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : kInf;
  return std::sqrt(diff / norm);
}

Doubles ToDouble(const Floats& v) {
  return Doubles(v.begin(), v.end());
}

double RelativeError(const Floats& out, const Floats& ref) {
  return RelativeError(out, ToDouble(ref));
}

Floats RandomNormal(std::mt19937& rng, size_t n, double stddev = 1.0) {
  std::normal_distribution<double> dist(0.0, stddev);
  Floats v(n);
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}

Floats RandomUniform(std::mt19937& rng, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  Floats v(n);
  for (float& x : v) x = static_cast<float>(dist(rng));
  return v;
}

std::vector<int32_t> RandomIds(std::mt19937& rng, size_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  std::vector<int32_t> ids(n);
  for (int32_t& id : ids) id = dist(rng);
  return ids;
}

Floats Poisoned(size_t n) {
  return Floats(n, kNaN);
}

// What an accumulating kernel added: after - before, in double.
Doubles Added(const Floats& after, const Floats& before) {
  Doubles d(after.size());
  for (size_t i = 0; i < after.size(); ++i) d[i] = static_cast<double>(after[i]) - before[i];
  return d;
}

double Dot(const Doubles& a, const Floats& b) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// The same over a double output: what an accumulating kernel added (see Added), kept in double
// because casting it back to float would add rounding of its own.
double RelativeError(const Doubles& out, const Doubles& ref) {
  if (out.size() != ref.size()) return kInf;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i]) || !std::isfinite(ref[i])) return kInf;
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  if (norm == 0.0) return diff == 0.0 ? 0.0 : kInf;
  return std::sqrt(diff / norm);
}

// d f / d x_i for every i by central differences, in double. With inputs of order 1, h = 1e-5
// leaves a truncation error ~1e-10 and a rounding error ~1e-11: far below the fp32 tolerance.
Doubles FiniteDifferences(const std::function<double(const Doubles&)>& f, Doubles x,
                          double h = 1e-5) {
  Doubles grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    x[i] = xi + h;
    const double plus = f(x);
    x[i] = xi - h;
    const double minus = f(x);
    x[i] = xi;
    grad[i] = (plus - minus) / (2.0 * h);
  }
  return grad;
}

// ---------------------------------------------------------------------------------------------
// Naive float64 references.

Doubles NaiveEmbedding(const std::vector<int32_t>& tokens, const Floats& table, int64_t hidden) {
  Doubles out;
  for (int32_t id : tokens) {
    for (int64_t i = 0; i < hidden; ++i) out.push_back(table[id * hidden + i]);
  }
  return out;
}

// y[t][i] = x[t][i] / sqrt(mean_j x[t][j]^2 + eps) * w[i]
Doubles NaiveRmsNorm(const Doubles& x, const Doubles& w, int64_t tokens, int64_t hidden, double eps,
                     Doubles* rstd = nullptr) {
  Doubles y(x.size());
  for (int64_t t = 0; t < tokens; ++t) {
    double mean_sq = 0.0;
    for (int64_t j = 0; j < hidden; ++j) mean_sq += x[t * hidden + j] * x[t * hidden + j];
    mean_sq /= static_cast<double>(hidden);
    const double r = 1.0 / std::sqrt(mean_sq + eps);
    if (rstd != nullptr) rstd->push_back(r);
    for (int64_t i = 0; i < hidden; ++i) y[t * hidden + i] = x[t * hidden + i] * r * w[i];
  }
  return y;
}

// y = x W^T + b by the definition: x [m][k], W [n][k], b [n] (empty: none).
Doubles NaiveLinear(const Doubles& x, const Doubles& w, const Doubles& b, int64_t m, int64_t n,
                    int64_t k) {
  Doubles y(static_cast<size_t>(m * n));
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t c = 0; c < n; ++c) {
      double s = b.empty() ? 0.0 : b[c];
      for (int64_t i = 0; i < k; ++i) s += x[r * k + i] * w[c * k + i];
      y[r * n + c] = s;
    }
  }
  return y;
}

// Hugging Face's apply_rotary_pos_emb, literally: inv_freq = 1 / theta^(arange(0, d, 2) / d),
// emb = cat(freqs, freqs), out = x * cos(emb) + rotate_half(x) * sin(emb),
// rotate_half(x) = cat(-x[d/2:], x[:d/2]).
Doubles NaiveRope(const Doubles& x, int64_t tokens, int64_t heads, int64_t head_dim,
                  int64_t first_position, double theta) {
  const int64_t half = head_dim / 2;
  Doubles out(x.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const double* xh = x.data() + (t * heads + h) * head_dim;
      double* oh = out.data() + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) {
        const double inv_freq = 1.0 / std::pow(theta, static_cast<double>(2 * (i % half)) /
                                                          static_cast<double>(head_dim));
        const double emb = static_cast<double>(first_position + t) * inv_freq;
        const double rotated = i < half ? -xh[i + half] : xh[i - half];
        oh[i] = xh[i] * std::cos(emb) + rotated * std::sin(emb);
      }
    }
  }
  return out;
}

double NaiveSilu(double g) {
  return g / (1.0 + std::exp(-g));
}

// out[t][i] = silu(gate[t][i]) * up[t][i], gate_up[t] = [gate | up].
Doubles NaiveSwiglu(const Doubles& gate_up, int64_t tokens, int64_t inter) {
  Doubles out(static_cast<size_t>(tokens * inter));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < inter; ++i) {
      out[t * inter + i] =
          NaiveSilu(gate_up[t * 2 * inter + i]) * gate_up[t * 2 * inter + inter + i];
    }
  }
  return out;
}

struct NaiveLoss {
  double loss = 0.0;
  Doubles dx;  // [t][d], scaled
  Doubles dw;  // [V][d], scaled
};

// Full logits, log-softmax with the max subtracted, and the textbook gradient
// d loss / d logits = softmax - onehot, pushed through logits = x W^T.
NaiveLoss NaiveCrossEntropy(const Doubles& x, const Doubles& w, const std::vector<int32_t>& labels,
                            int64_t hidden, int64_t vocab, double grad_scale) {
  const int64_t tokens = static_cast<int64_t>(labels.size());
  NaiveLoss r;
  r.dx.assign(static_cast<size_t>(tokens * hidden), 0.0);
  r.dw.assign(static_cast<size_t>(vocab * hidden), 0.0);
  const Doubles logits = NaiveLinear(x, w, {}, tokens, vocab, hidden);  // [t][V]
  for (int64_t t = 0; t < tokens; ++t) {
    if (labels[t] < 0) continue;
    const double* l = logits.data() + t * vocab;
    const double max = *std::max_element(l, l + vocab);
    double sum = 0.0;
    for (int64_t v = 0; v < vocab; ++v) sum += std::exp(l[v] - max);
    const double log_z = max + std::log(sum);
    r.loss -= l[labels[t]] - log_z;  // -log_softmax[label]
    for (int64_t v = 0; v < vocab; ++v) {
      const double g = (std::exp(l[v] - log_z) - (v == labels[t] ? 1.0 : 0.0)) * grad_scale;
      for (int64_t i = 0; i < hidden; ++i) {
        r.dx[t * hidden + i] += g * w[v * hidden + i];
        r.dw[v * hidden + i] += g * x[t * hidden + i];
      }
    }
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Embedding

TEST(EmbeddingReference, ForwardGathersRows) {
  std::mt19937 rng(101);
  const int64_t vocab = 11;
  for (int64_t tokens : {1, 7, 33}) {
    for (int64_t hidden : {5, 64}) {
      SCOPED_TRACE("tokens=" + std::to_string(tokens) + " hidden=" + std::to_string(hidden));
      const Floats table = RandomNormal(rng, vocab * hidden);
      const std::vector<int32_t> ids = RandomIds(rng, tokens, vocab);
      Floats out = Poisoned(tokens * hidden);
      EmbeddingForward(ids, table.data(), vocab, hidden, out.data());
      EXPECT_EQ(RelativeError(out, NaiveEmbedding(ids, table, hidden)), 0.0);
    }
  }
}

TEST(EmbeddingReference, BackwardAccumulatesRepeatedIds) {
  std::mt19937 rng(102);
  const int64_t vocab = 6;  // 33 tokens over 6 ids: every id repeats
  for (int64_t tokens : {1, 7, 33}) {
    for (int64_t hidden : {5, 64}) {
      SCOPED_TRACE("tokens=" + std::to_string(tokens) + " hidden=" + std::to_string(hidden));
      std::vector<int32_t> ids = RandomIds(rng, tokens, vocab);
      if (tokens > 1) ids[1] = ids[0];  // at least one repeat whatever the draw
      const Floats d_out = RandomNormal(rng, tokens * hidden);
      const Floats before = RandomNormal(rng, vocab * hidden);  // accumulate: non-zero start
      Floats d_table = before;
      EmbeddingBackward(ids, d_out.data(), vocab, hidden, d_table.data());
      Doubles ref = ToDouble(before);
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t i = 0; i < hidden; ++i) ref[ids[t] * hidden + i] += d_out[t * hidden + i];
      }
      EXPECT_LE(RelativeError(d_table, ref), kFp32Tolerance);
    }
  }
}

TEST(EmbeddingReference, OutOfRangeIdsThrowAndWriteNothing) {
  std::mt19937 rng(103);
  const int64_t vocab = 9, hidden = 5;
  const Floats table = RandomNormal(rng, vocab * hidden);
  for (int32_t bad : {-1, static_cast<int32_t>(vocab), std::numeric_limits<int32_t>::max()}) {
    SCOPED_TRACE("bad id " + std::to_string(bad));
    const std::vector<int32_t> ids = {0, 3, bad, 1};
    Floats out = Poisoned(ids.size() * hidden);
    EXPECT_THROW(EmbeddingForward(ids, table.data(), vocab, hidden, out.data()), InputError);
    const Floats d_out = RandomNormal(rng, ids.size() * hidden);
    const Floats before = RandomNormal(rng, vocab * hidden);
    Floats d_table = before;
    EXPECT_THROW(EmbeddingBackward(ids, d_out.data(), vocab, hidden, d_table.data()), InputError);
    EXPECT_EQ(d_table, before) << "a rejected batch must leave the accumulated gradient alone";
  }
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

TEST(RmsNormReference, ForwardMatchesNaive) {
  std::mt19937 rng(201);
  const float eps = 1e-6f;
  for (int64_t tokens : {1, 7, 33}) {
    for (int64_t hidden : {5, 64}) {
      SCOPED_TRACE("tokens=" + std::to_string(tokens) + " hidden=" + std::to_string(hidden));
      const Floats x = RandomNormal(rng, tokens * hidden, 3.0);
      const Floats w = RandomUniform(rng, hidden, 0.5, 1.5);
      Floats y = Poisoned(tokens * hidden), rstd = Poisoned(tokens);
      RmsNormForward(x.data(), w.data(), tokens, hidden, eps, y.data(), rstd.data());
      Doubles ref_rstd;
      const Doubles ref = NaiveRmsNorm(ToDouble(x), ToDouble(w), tokens, hidden, eps, &ref_rstd);
      EXPECT_LE(RelativeError(y, ref), kFp32Tolerance);
      EXPECT_LE(RelativeError(rstd, ref_rstd), kFp32Tolerance);
    }
  }
}

// Backward against the explicit Jacobian dy_i/dx_j = w_i (r delta_ij - x_i x_j r^3 / d), a
// different route from the kernel's fused formula.
TEST(RmsNormReference, BackwardMatchesJacobian) {
  std::mt19937 rng(202);
  const float eps = 1e-6f;
  for (int64_t tokens : {1, 7, 33}) {
    for (int64_t hidden : {5, 64}) {
      SCOPED_TRACE("tokens=" + std::to_string(tokens) + " hidden=" + std::to_string(hidden));
      const Floats x = RandomNormal(rng, tokens * hidden);
      const Floats w = RandomUniform(rng, hidden, 0.5, 1.5);
      const Floats dy = RandomNormal(rng, tokens * hidden);
      Floats y(tokens * hidden), rstd(tokens);
      RmsNormForward(x.data(), w.data(), tokens, hidden, eps, y.data(), rstd.data());
      Floats dx = Poisoned(tokens * hidden);
      const Floats dw_before = RandomNormal(rng, hidden);
      Floats dw = dw_before;
      RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), tokens, hidden, dx.data(),
                      dw.data());

      Doubles ref_dx(tokens * hidden, 0.0), ref_dw(hidden, 0.0);
      for (int64_t t = 0; t < tokens; ++t) {
        const Doubles xt(x.begin() + t * hidden, x.begin() + (t + 1) * hidden);
        const double* xr = xt.data();
        double ms = 0.0;
        for (int64_t j = 0; j < hidden; ++j) ms += xr[j] * xr[j];
        const double r = 1.0 / std::sqrt(ms / hidden + eps);
        for (int64_t i = 0; i < hidden; ++i) {
          const double g = dy[t * hidden + i];
          ref_dw[i] += g * xr[i] * r;
          for (int64_t j = 0; j < hidden; ++j) {
            const double jac = w[i] * ((i == j ? r : 0.0) - xr[i] * xr[j] * r * r * r / hidden);
            ref_dx[t * hidden + j] += g * jac;
          }
        }
      }
      EXPECT_LE(RelativeError(dx, ref_dx), kFp32Tolerance);
      EXPECT_LE(RelativeError(Added(dw, dw_before), ref_dw), kFp32Tolerance);
    }
  }
}

TEST(RmsNormReference, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(203);
  const int64_t tokens = 3, hidden = 5;
  const float eps = 1e-6f;
  const Floats x = RandomNormal(rng, tokens * hidden);
  const Floats w = RandomUniform(rng, hidden, 0.5, 1.5);
  const Floats dy = RandomNormal(rng, tokens * hidden);  // L = sum dy * y
  Floats y(tokens * hidden), rstd(tokens), dx = Poisoned(tokens * hidden);
  const Floats dw_before = RandomNormal(rng, hidden);
  Floats dw = dw_before;
  RmsNormForward(x.data(), w.data(), tokens, hidden, eps, y.data(), rstd.data());
  RmsNormBackward(x.data(), w.data(), rstd.data(), dy.data(), tokens, hidden, dx.data(), dw.data());
  const Doubles fd_x = FiniteDifferences(
      [&](const Doubles& xs) {
        return Dot(NaiveRmsNorm(xs, ToDouble(w), tokens, hidden, eps), dy);
      },
      ToDouble(x));
  const Doubles fd_w = FiniteDifferences(
      [&](const Doubles& ws) {
        return Dot(NaiveRmsNorm(ToDouble(x), ws, tokens, hidden, eps), dy);
      },
      ToDouble(w));
  EXPECT_LE(RelativeError(dx, fd_x), kFp32Tolerance);
  EXPECT_LE(RelativeError(Added(dw, dw_before), fd_w), kFp32Tolerance);
}

// ---------------------------------------------------------------------------------------------
// Linear

TEST(LinearReference, ForwardMatchesNaive) {
  std::mt19937 rng(301);
  for (int64_t m : {1, 7, 33}) {
    for (int64_t n : {5, 64}) {
      for (int64_t k : {5, 64}) {
        for (bool with_bias : {false, true}) {
          SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) +
                       " k=" + std::to_string(k) + " bias=" + std::to_string(with_bias));
          const Floats x = RandomNormal(rng, m * k);
          const Floats w = RandomNormal(rng, n * k);
          const Floats b = with_bias ? RandomNormal(rng, n) : Floats{};
          Floats y = Poisoned(m * n);
          LinearForward(x.data(), w.data(), with_bias ? b.data() : nullptr, m, n, k, y.data());
          EXPECT_LE(RelativeError(y, NaiveLinear(ToDouble(x), ToDouble(w), ToDouble(b), m, n, k)),
                    kFp32Tolerance);
        }
      }
    }
  }
}

TEST(LinearReference, BackwardMatchesNaive) {
  std::mt19937 rng(302);
  for (int64_t m : {1, 7, 33}) {
    for (int64_t n : {5, 64}) {
      for (int64_t k : {5, 64}) {
        SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) +
                     " k=" + std::to_string(k));
        const Floats x = RandomNormal(rng, m * k);
        const Floats w = RandomNormal(rng, n * k);
        const Floats dy = RandomNormal(rng, m * n);
        const Floats dw_before = RandomNormal(rng, n * k);
        const Floats db_before = RandomNormal(rng, n);
        Floats dx = Poisoned(m * k), dw = dw_before, db = db_before;
        LinearBackward(x.data(), w.data(), dy.data(), m, n, k, dx.data(), dw.data(), db.data());
        Doubles ref_dx(m * k, 0.0), ref_dw(n * k, 0.0), ref_db(n, 0.0);
        for (int64_t r = 0; r < m; ++r) {
          for (int64_t c = 0; c < n; ++c) {
            const double g = dy[r * n + c];
            ref_db[c] += g;
            for (int64_t i = 0; i < k; ++i) {
              ref_dx[r * k + i] += g * w[c * k + i];
              ref_dw[c * k + i] += g * x[r * k + i];
            }
          }
        }
        EXPECT_LE(RelativeError(dx, ref_dx), kFp32Tolerance);
        EXPECT_LE(RelativeError(Added(dw, dw_before), ref_dw), kFp32Tolerance);
        EXPECT_LE(RelativeError(Added(db, db_before), ref_db), kFp32Tolerance);

        // Null dx / d_bias are skipped; d_w is still accumulated.
        Floats dw2 = dw_before;
        LinearBackward(x.data(), w.data(), dy.data(), m, n, k, nullptr, dw2.data(), nullptr);
        EXPECT_EQ(dw2, dw);
      }
    }
  }
}

TEST(LinearReference, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(303);
  const int64_t m = 3, n = 4, k = 5;
  const Floats x = RandomNormal(rng, m * k), w = RandomNormal(rng, n * k), b = RandomNormal(rng, n);
  const Floats dy = RandomNormal(rng, m * n);
  const Floats dw_before = RandomNormal(rng, n * k), db_before = RandomNormal(rng, n);
  Floats dx = Poisoned(m * k), dw = dw_before, db = db_before;
  LinearBackward(x.data(), w.data(), dy.data(), m, n, k, dx.data(), dw.data(), db.data());
  const Doubles xd = ToDouble(x), wd = ToDouble(w), bd = ToDouble(b);
  const Doubles fd_x = FiniteDifferences(
      [&](const Doubles& v) { return Dot(NaiveLinear(v, wd, bd, m, n, k), dy); }, xd);
  const Doubles fd_w = FiniteDifferences(
      [&](const Doubles& v) { return Dot(NaiveLinear(xd, v, bd, m, n, k), dy); }, wd);
  const Doubles fd_b = FiniteDifferences(
      [&](const Doubles& v) { return Dot(NaiveLinear(xd, wd, v, m, n, k), dy); }, bd);
  EXPECT_LE(RelativeError(dx, fd_x), kFp32Tolerance);
  EXPECT_LE(RelativeError(Added(dw, dw_before), fd_w), kFp32Tolerance);
  EXPECT_LE(RelativeError(Added(db, db_before), fd_b), kFp32Tolerance);
}

// ---------------------------------------------------------------------------------------------
// RoPE

TEST(RopeReference, ForwardMatchesHuggingFaceFormula) {
  std::mt19937 rng(401);
  for (int64_t tokens : {1, 7, 33}) {
    for (int64_t heads : {1, 3}) {
      for (int64_t head_dim : {64, 128}) {
        // Qwen2.5 uses theta = 1e6, Llama 2 1e4; positions far into a long context too.
        for (auto [first, theta] : {std::pair<int64_t, double>{0, 1e4}, {5, 1e6}, {1 << 22, 1e6}}) {
          SCOPED_TRACE("tokens=" + std::to_string(tokens) + " heads=" + std::to_string(heads) +
                       " head_dim=" + std::to_string(head_dim) + " first=" + std::to_string(first) +
                       " theta=" + std::to_string(theta));
          const Floats x = RandomNormal(rng, tokens * heads * head_dim);
          Floats out = x;
          RopeForward(out.data(), tokens, heads, head_dim, first, theta);
          EXPECT_LE(
              RelativeError(out, NaiveRope(ToDouble(x), tokens, heads, head_dim, first, theta)),
              kFp32Tolerance);
        }
      }
    }
  }
}

TEST(RopeReference, PositionZeroIsIdentity) {
  std::mt19937 rng(402);
  const int64_t heads = 3, head_dim = 128;
  const Floats x = RandomNormal(rng, heads * head_dim);
  Floats out = x;
  RopeForward(out.data(), 1, heads, head_dim, 0, 1e6);
  EXPECT_EQ(out, x);  // cos 0 = 1, sin 0 = 0: exact
}

TEST(RopeReference, KnownValue) {
  // head_dim 4, theta 1e4: inv_freq = {1, 1e4^-0.5 = 0.01}; pairs (0, 2) and (1, 3); position 2.
  Floats x = {1.0f, 2.0f, 3.0f, 4.0f};
  RopeForward(x.data(), 1, 1, 4, 2, 1e4);
  const double a0 = 2.0, a1 = 0.02;
  EXPECT_NEAR(x[0], 1.0 * std::cos(a0) - 3.0 * std::sin(a0), 1e-6);
  EXPECT_NEAR(x[1], 2.0 * std::cos(a1) - 4.0 * std::sin(a1), 1e-6);
  EXPECT_NEAR(x[2], 3.0 * std::cos(a0) + 1.0 * std::sin(a0), 1e-6);
  EXPECT_NEAR(x[3], 4.0 * std::cos(a1) + 2.0 * std::sin(a1), 1e-6);
}

TEST(RopeReference, BackwardInvertsForward) {
  std::mt19937 rng(403);
  for (int64_t head_dim : {64, 128}) {
    const int64_t tokens = 33, heads = 3, first = 1000;
    const Floats x = RandomNormal(rng, tokens * heads * head_dim);
    Floats y = x;
    RopeForward(y.data(), tokens, heads, head_dim, first, 1e6);
    RopeBackward(y.data(), tokens, heads, head_dim, first, 1e6);
    EXPECT_LE(RelativeError(y, ToDouble(x)), kFp32Tolerance) << "head_dim " << head_dim;
  }
}

TEST(RopeReference, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(404);
  const int64_t tokens = 3, heads = 2, head_dim = 8, first = 7;
  const double theta = 1e4;
  const Floats x = RandomNormal(rng, tokens * heads * head_dim);
  const Floats dy = RandomNormal(rng, x.size());  // L = sum dy * rope(x)
  Floats dx = dy;
  RopeBackward(dx.data(), tokens, heads, head_dim, first, theta);
  const Doubles fd = FiniteDifferences(
      [&](const Doubles& v) {
        return Dot(NaiveRope(v, tokens, heads, head_dim, first, theta), dy);
      },
      ToDouble(x));
  EXPECT_LE(RelativeError(dx, fd), kFp32Tolerance);
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

TEST(SwigluReference, ForwardMatchesNaive) {
  std::mt19937 rng(501);
  for (int64_t tokens : {1, 7, 33}) {
    for (int64_t inter : {5, 64}) {
      SCOPED_TRACE("tokens=" + std::to_string(tokens) + " I=" + std::to_string(inter));
      // Wide gates reach both saturated ends of the sigmoid.
      const Floats gate_up = RandomNormal(rng, tokens * 2 * inter, 4.0);
      Floats out = Poisoned(tokens * inter);
      SwigluForward(gate_up.data(), tokens, inter, out.data());
      EXPECT_LE(RelativeError(out, NaiveSwiglu(ToDouble(gate_up), tokens, inter)), kFp32Tolerance);
    }
  }
}

TEST(SwigluReference, BackwardMatchesNaive) {
  std::mt19937 rng(502);
  for (int64_t tokens : {1, 7, 33}) {
    for (int64_t inter : {5, 64}) {
      SCOPED_TRACE("tokens=" + std::to_string(tokens) + " I=" + std::to_string(inter));
      const Floats gate_up = RandomNormal(rng, tokens * 2 * inter, 4.0);
      const Floats d_out = RandomNormal(rng, tokens * inter);
      Floats d_gate_up = Poisoned(gate_up.size());
      SwigluBackward(gate_up.data(), d_out.data(), tokens, inter, d_gate_up.data());
      // silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))); d up = d_out silu(g).
      Doubles ref(gate_up.size());
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t i = 0; i < inter; ++i) {
          const double g = gate_up[t * 2 * inter + i], u = gate_up[t * 2 * inter + inter + i];
          const double s = 1.0 / (1.0 + std::exp(-g)), d = d_out[t * inter + i];
          ref[t * 2 * inter + i] = d * u * s * (1.0 + g * (1.0 - s));
          ref[t * 2 * inter + inter + i] = d * NaiveSilu(g);
        }
      }
      EXPECT_LE(RelativeError(d_gate_up, ref), kFp32Tolerance);
    }
  }
}

TEST(SwigluReference, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(503);
  const int64_t tokens = 3, inter = 5;
  const Floats gate_up = RandomNormal(rng, tokens * 2 * inter, 2.0);
  const Floats d_out = RandomNormal(rng, tokens * inter);
  Floats d_gate_up = Poisoned(gate_up.size());
  SwigluBackward(gate_up.data(), d_out.data(), tokens, inter, d_gate_up.data());
  const Doubles fd =
      FiniteDifferences([&](const Doubles& v) { return Dot(NaiveSwiglu(v, tokens, inter), d_out); },
                        ToDouble(gate_up));
  EXPECT_LE(RelativeError(d_gate_up, fd), kFp32Tolerance);
}

// ---------------------------------------------------------------------------------------------
// Fused linear + cross-entropy

// Labels in range with a few ignored positions (-1 and Hugging Face's -100) sprinkled in.
std::vector<int32_t> RandomLabels(std::mt19937& rng, int64_t tokens, int64_t vocab) {
  std::vector<int32_t> labels = RandomIds(rng, tokens, vocab);
  for (int64_t t = 2; t < tokens; t += 5) labels[t] = (t % 2 == 0) ? -1 : -100;
  return labels;
}

struct LossCase {
  int64_t tokens, hidden, vocab, token_tile, vocab_tile;
};

std::string Describe(const LossCase& c) {
  return "tokens=" + std::to_string(c.tokens) + " hidden=" + std::to_string(c.hidden) +
         " vocab=" + std::to_string(c.vocab) + " token_tile=" + std::to_string(c.token_tile) +
         " vocab_tile=" + std::to_string(c.vocab_tile);
}

TEST(LinearCrossEntropyReference, MatchesNaiveLogSoftmax) {
  std::mt19937 rng(601);
  // Token counts and vocabularies that are not multiples of their tiles, tiles larger than the
  // whole, and tiles of one.
  const std::vector<LossCase> cases = {
      {1, 5, 37, 8, 16}, {7, 5, 37, 8, 16},  {33, 64, 100, 8, 16}, {33, 64, 100, 64, 256},
      {7, 64, 37, 1, 1}, {33, 5, 101, 4, 7}, {1, 64, 100, 1, 100},
  };
  for (const LossCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    const Floats x = RandomNormal(rng, c.tokens * c.hidden);
    const Floats w = RandomNormal(rng, c.vocab * c.hidden, 1.0 / std::sqrt(c.hidden));
    const std::vector<int32_t> labels = RandomLabels(rng, c.tokens, c.vocab);
    const float grad_scale = 0.37f;
    Floats dx = Poisoned(x.size());
    const Floats dw_before = RandomNormal(rng, w.size());
    Floats dw = dw_before;
    const double loss =
        LinearCrossEntropy(x.data(), w.data(), labels, c.hidden, c.vocab, c.token_tile,
                           c.vocab_tile, grad_scale, dx.data(), dw.data());
    const NaiveLoss ref =
        NaiveCrossEntropy(ToDouble(x), ToDouble(w), labels, c.hidden, c.vocab, grad_scale);
    ASSERT_TRUE(std::isfinite(loss));
    EXPECT_LE(std::abs(loss - ref.loss) / std::abs(ref.loss), kFp32Tolerance)
        << loss << " vs " << ref.loss;
    EXPECT_LE(RelativeError(dx, ref.dx), kFp32Tolerance);
    EXPECT_LE(RelativeError(Added(dw, dw_before), ref.dw), kFp32Tolerance);
  }
}

TEST(LinearCrossEntropyReference, IgnoredPositionsGetNoLossAndNoGradient) {
  std::mt19937 rng(602);
  const int64_t tokens = 9, hidden = 5, vocab = 13;
  const Floats x = RandomNormal(rng, tokens * hidden);
  const Floats w = RandomNormal(rng, vocab * hidden);
  std::vector<int32_t> labels = RandomIds(rng, tokens, vocab);
  labels[0] = -1;
  labels[4] = -100;
  labels[8] = -1;
  Floats dx = Poisoned(x.size());
  Floats dw(w.size(), 0.0f);
  const double loss = LinearCrossEntropy(x.data(), w.data(), labels, hidden, vocab, 4, 5, 1.0f,
                                         dx.data(), dw.data());
  // Same loss as the labelled tokens alone.
  std::vector<int32_t> kept_labels;
  Floats kept_x;
  for (int64_t t = 0; t < tokens; ++t) {
    if (labels[t] < 0) continue;
    kept_labels.push_back(labels[t]);
    kept_x.insert(kept_x.end(), x.begin() + t * hidden, x.begin() + (t + 1) * hidden);
  }
  const NaiveLoss ref =
      NaiveCrossEntropy(ToDouble(kept_x), ToDouble(w), kept_labels, hidden, vocab, 1.0);
  EXPECT_LE(std::abs(loss - ref.loss) / ref.loss, kFp32Tolerance);
  for (int64_t t : {0, 4, 8}) {
    for (int64_t i = 0; i < hidden; ++i) EXPECT_EQ(dx[t * hidden + i], 0.0f) << "t=" << t;
  }

  // A chunk with no label at all (and an empty one): zero loss, zero dx, d_w untouched.
  const std::vector<int32_t> none(tokens, -1);
  const Floats dw_before = RandomNormal(rng, w.size());
  Floats dw2 = dw_before;
  Floats dx2 = Poisoned(x.size());
  EXPECT_EQ(LinearCrossEntropy(x.data(), w.data(), none, hidden, vocab, 4, 5, 1.0f, dx2.data(),
                               dw2.data()),
            0.0);
  EXPECT_EQ(dx2, Floats(x.size(), 0.0f));
  EXPECT_EQ(dw2, dw_before);
  EXPECT_EQ(LinearCrossEntropy(x.data(), w.data(), {}, hidden, vocab, 4, 5, 1.0f, nullptr, nullptr),
            0.0);
}

TEST(LinearCrossEntropyReference, TileSizesAgree) {
  std::mt19937 rng(603);
  const int64_t tokens = 33, hidden = 64, vocab = 101;
  const Floats x = RandomNormal(rng, tokens * hidden);
  const Floats w = RandomNormal(rng, vocab * hidden, 1.0 / std::sqrt(hidden));
  const std::vector<int32_t> labels = RandomLabels(rng, tokens, vocab);
  auto run = [&](int64_t token_tile, int64_t vocab_tile, Floats* dx, Floats* dw) {
    *dx = Poisoned(x.size());
    dw->assign(w.size(), 0.0f);
    return LinearCrossEntropy(x.data(), w.data(), labels, hidden, vocab, token_tile, vocab_tile,
                              1.0f, dx->data(), dw->data());
  };
  Floats base_dx, base_dw;
  const double base_loss = run(tokens, vocab, &base_dx, &base_dw);  // one tile: no tiling at all
  for (auto [tt, vt] : {std::pair<int64_t, int64_t>{1, 1}, {4, 7}, {8, 16}, {32, 100}, {64, 512}}) {
    SCOPED_TRACE("token_tile=" + std::to_string(tt) + " vocab_tile=" + std::to_string(vt));
    Floats dx, dw;
    const double loss = run(tt, vt, &dx, &dw);
    EXPECT_LE(std::abs(loss - base_loss) / std::abs(base_loss), 1e-6);
    EXPECT_LE(RelativeError(dx, base_dx), 1e-6);
    EXPECT_LE(RelativeError(dw, base_dw), 1e-6);
  }
}

TEST(LinearCrossEntropyReference, LargeLogitsStayFinite) {
  // Logits of several hundred: exp() overflows double without the running max.
  std::mt19937 rng(604);
  const int64_t tokens = 7, hidden = 16, vocab = 37;
  const Floats x = RandomNormal(rng, tokens * hidden);
  const Floats w = RandomNormal(rng, vocab * hidden, 300.0 / std::sqrt(hidden));
  const std::vector<int32_t> labels = RandomIds(rng, tokens, vocab);
  Floats dx = Poisoned(x.size()), dw(w.size(), 0.0f);
  const double loss = LinearCrossEntropy(x.data(), w.data(), labels, hidden, vocab, 3, 8, 1.0f,
                                         dx.data(), dw.data());
  const NaiveLoss ref = NaiveCrossEntropy(ToDouble(x), ToDouble(w), labels, hidden, vocab, 1.0);
  ASSERT_TRUE(std::isfinite(loss));
  EXPECT_LE(std::abs(loss - ref.loss) / std::abs(ref.loss), kFp32Tolerance);
  EXPECT_LE(RelativeError(dx, ref.dx), kFp32Tolerance);
  EXPECT_LE(RelativeError(dw, ref.dw), kFp32Tolerance);
}

TEST(LinearCrossEntropyReference, BackwardMatchesFiniteDifferences) {
  std::mt19937 rng(605);
  const int64_t tokens = 5, hidden = 4, vocab = 7;
  const Floats x = RandomNormal(rng, tokens * hidden);
  const Floats w = RandomNormal(rng, vocab * hidden);
  std::vector<int32_t> labels = RandomIds(rng, tokens, vocab);
  labels[3] = -1;
  const float grad_scale = 0.5f;
  Floats dx = Poisoned(x.size());
  const Floats dw_before = RandomNormal(rng, w.size());
  Floats dw = dw_before;
  LinearCrossEntropy(x.data(), w.data(), labels, hidden, vocab, 2, 3, grad_scale, dx.data(),
                     dw.data());
  const Doubles xd = ToDouble(x), wd = ToDouble(w);
  const Doubles fd_x = FiniteDifferences(
      [&](const Doubles& v) {
        return grad_scale * NaiveCrossEntropy(v, wd, labels, hidden, vocab, 1.0).loss;
      },
      xd);
  const Doubles fd_w = FiniteDifferences(
      [&](const Doubles& v) {
        return grad_scale * NaiveCrossEntropy(xd, v, labels, hidden, vocab, 1.0).loss;
      },
      wd);
  EXPECT_LE(RelativeError(dx, fd_x), kFp32Tolerance);
  EXPECT_LE(RelativeError(Added(dw, dw_before), fd_w), kFp32Tolerance);
}

TEST(LinearCrossEntropyReference, LabelOutsideVocabularyThrowsAndWritesNothing) {
  std::mt19937 rng(606);
  const int64_t tokens = 6, hidden = 5, vocab = 11;
  const Floats x = RandomNormal(rng, tokens * hidden), w = RandomNormal(rng, vocab * hidden);
  for (int32_t bad : {static_cast<int32_t>(vocab), 1 << 30}) {
    std::vector<int32_t> labels = RandomIds(rng, tokens, vocab);
    labels[tokens - 1] = bad;  // the last one: everything before it is valid
    const Floats dx_before = RandomNormal(rng, x.size()), dw_before = RandomNormal(rng, w.size());
    Floats dx = dx_before, dw = dw_before;
    EXPECT_THROW(LinearCrossEntropy(x.data(), w.data(), labels, hidden, vocab, 4, 4, 1.0f,
                                    dx.data(), dw.data()),
                 InputError);
    EXPECT_EQ(dx, dx_before);
    EXPECT_EQ(dw, dw_before);
  }
}

// ---------------------------------------------------------------------------------------------
// AdamW

struct NaiveAdamState {
  Doubles p, m, v;
};

// torch.optim.AdamW, single tensor, amsgrad off, written out.
void NaiveAdamWStep(NaiveAdamState& s, const Floats& grad, const AdamWParams& hp) {
  const double lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
  const double bias1 = 1.0 - std::pow(b1, static_cast<double>(hp.step));
  const double bias2 = 1.0 - std::pow(b2, static_cast<double>(hp.step));
  for (size_t i = 0; i < s.p.size(); ++i) {
    s.p[i] *= 1.0 - lr * wd;
    s.m[i] = b1 * s.m[i] + (1.0 - b1) * grad[i];
    s.v[i] = b2 * s.v[i] + (1.0 - b2) * grad[i] * grad[i];
    s.p[i] -= (lr / bias1) * s.m[i] / (std::sqrt(s.v[i]) / std::sqrt(bias2) + eps);
  }
}

TEST(AdamWReference, SeveralStepsMatchNaive) {
  std::mt19937 rng(701);
  const int64_t n = 1031;
  AdamWParams hp;
  hp.lr = 0.05f;
  hp.weight_decay = 0.1f;
  const Floats p0 = RandomNormal(rng, n, 0.1);
  Floats p = p0, m = Poisoned(n), v = Poisoned(n);
  std::fill(m.begin(), m.end(), 0.0f);  // optimizer state starts at zero, as in PyTorch
  std::fill(v.begin(), v.end(), 0.0f);
  NaiveAdamState ref{ToDouble(p0), Doubles(n, 0.0), Doubles(n, 0.0)};
  for (int64_t step = 1; step <= 6; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    hp.step = step;
    const Floats grad = RandomNormal(rng, n, 0.01 * step);  // changing scale: v lags behind
    AdamW(p.data(), grad.data(), m.data(), v.data(), n, hp);
    NaiveAdamWStep(ref, grad, hp);
    EXPECT_LE(RelativeError(p, ref.p), kFp32Tolerance);
    EXPECT_LE(RelativeError(m, ref.m), kFp32Tolerance);
    EXPECT_LE(RelativeError(v, ref.v), kFp32Tolerance);
    // The displacement, not just the parameters: an update of lr-size is small against p.
    Doubles ref_moved(n);
    for (int64_t i = 0; i < n; ++i) ref_moved[i] = ref.p[i] - p0[i];
    EXPECT_LE(RelativeError(Added(p, p0), ref_moved), kFp32Tolerance);
  }
}

TEST(AdamWReference, FirstStepIsSignedLearningRate) {
  // Step 1 from zero moments: m_hat = g and v_hat = g^2, so p1 = p0 (1 - lr wd) - lr g / (|g| +
  // eps): the decay is decoupled (not folded into g) and eps sits outside the square root.
  std::mt19937 rng(702);
  const int64_t n = 17;
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.5f;
  hp.eps = 1e-3f;  // large enough to be visible
  const Floats p0 = RandomNormal(rng, n), g = RandomNormal(rng, n);
  Floats p = p0, m(n, 0.0f), v(n, 0.0f);
  AdamW(p.data(), g.data(), m.data(), v.data(), n, hp);
  for (int64_t i = 0; i < n; ++i) {
    const double lr = hp.lr, expected = p0[i] * (1.0 - lr * static_cast<double>(hp.weight_decay)) -
                                        lr * g[i] / (std::abs(g[i]) + static_cast<double>(hp.eps));
    EXPECT_NEAR(p[i], expected, 1e-6) << i;
  }
}

}  // namespace
}  // namespace ctxplan::kernels::cpu
