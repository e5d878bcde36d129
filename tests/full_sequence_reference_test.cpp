// The full-sequence backprop reference (the executor's correctness anchor) against what needs no
// trust in our own backward: finite differences of the loss, by the fourth-order stencil below.
//   - directional derivatives: for a random direction u, d/dt L(w + t u) against <grad, u>, over
//     all parameters at once and over each tensor alone. Many entries move together, so the loss
//     change stands far above fp32 rounding: the robust check;
//   - single parameters: 24 entries of every tensor, each perturbed alone. Weaker (the loss moves
//     little), but it pins a wrong entry that a direction could average away.
// The loss for the differences is FullSequenceLoss, the fp32 forward itself (its loss_sum equals
// FullSequenceBackprop's bit for bit, which is tested too). The forward, i.e. the model the
// gradients are of, is checked against a naive float64 forward written here. Plus the loss's own
// properties: about log(V) at initialisation, ignored labels adding nothing, causality,
// grad_scale, n = 0, bad inputs.
//
// Weights for the gradient checks are RandomWeights made larger (matrices std 0.1 instead of 0.02,
// norms 1 + N(0, 0.1)): at the 0.02 initialisation the attention is nearly uniform and the norm
// weights all equal, which would let a wrong softmax or norm backward hide in a tiny gradient.
// Tolerances were set from measured errors, with margins of 10x or more; deliberately broken
// backwards (RoPE backward of K skipped, the tied embedding's lookup gradient dropped, no bias
// gradient, a V gradient column lost) and a wrong RoPE theta each fail them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/cpu/full_sequence_reference.h"
#include "ctxplan/runtime/plan/model_weights.h"

namespace ctxplan {
namespace {

using Tokens = std::vector<int32_t>;

// --- the models: tiny (untied, attention bias), tiny tied, tiny without bias ---

ModelSpec Tiny() {
  return LoadModel("tiny");
}
ModelSpec TinyTied() {
  ModelSpec m = LoadModel("tiny");
  m.tie_word_embeddings = true;
  return m;
}
ModelSpec TinyNoBias() {
  ModelSpec m = LoadModel("tiny");
  m.attention_bias = false;
  return m;
}

ModelSpec Variant(const std::string& name) {
  if (name == "tied") return TinyTied();
  if (name == "nobias") return TinyNoBias();
  return Tiny();
}

// RandomWeights scaled up, so that every path of the backward carries a sizeable gradient.
ModelWeights TestWeights(const ModelSpec& m, uint64_t seed) {
  ModelWeights w = RandomWeights(m, seed);
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  w.ForEach([&](const std::string& name, std::vector<float>& t) {
    const bool norm = name.find("norm") != std::string::npos;
    for (float& x : t) x = norm ? 1.0f + normal(rng) : 5.0f * x;
  });
  return w;
}

Tokens RandomTokens(std::mt19937& rng, int64_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  Tokens t(static_cast<size_t>(n));
  for (int32_t& x : t) x = dist(rng);
  return t;
}

// Random targets with about one position in five ignored (but never all of them).
Tokens RandomLabels(std::mt19937& rng, int64_t n, int64_t vocab) {
  Tokens labels = RandomTokens(rng, n, vocab);
  std::bernoulli_distribution ignore(0.2);
  for (size_t i = 1; i < labels.size(); ++i) {
    if (ignore(rng)) labels[i] = -1;
  }
  return labels;
}

// The tensors of a ModelWeights, in ForEach's fixed order, with their names.
struct Tensor {
  std::string name;
  std::vector<float>* values;
};
std::vector<Tensor> Tensors(ModelWeights& w) {
  std::vector<Tensor> out;
  w.ForEach([&](const std::string& name, std::vector<float>& t) { out.push_back({name, &t}); });
  return out;
}

double Rms(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += static_cast<double>(x) * x;
  return std::sqrt(s / static_cast<double>(std::max<size_t>(v.size(), 1)));
}

// One problem: a model, weights, a sequence, and the gradient under test.
struct Problem {
  ModelSpec model;
  ModelWeights weights;
  Tokens tokens, labels;
  LossAndGrads result;

  Problem(const std::string& variant, int64_t n, uint64_t seed) : model(Variant(variant)) {
    weights = TestWeights(model, seed);
    std::mt19937 rng(static_cast<uint32_t>(seed));
    tokens = RandomTokens(rng, n, model.vocab_size);
    labels = RandomLabels(rng, n, model.vocab_size);
    result = FullSequenceBackprop(model, weights, tokens, labels, 1.0f);
  }
  double Loss(const ModelWeights& w) const { return FullSequenceLoss(model, w, tokens, labels); }
};

// d/dt f(t) at t = 0 by the fourth-order central stencil
//   (f(-2h) - 8 f(-h) + 8 f(h) - f(2h)) / 12 h,
// whose truncation error is O(h^4): measured on these problems, plain central differences
// (O(h^2)) need h so small for 1e-3 accuracy that the fp32 forward's rounding (~1e-7 of the loss)
// swamps the difference; this stencil is accurate to ~1e-3 at h = 1e-2, where rounding is small.
double Derivative(const std::function<double(double)>& f, double h) {
  return (f(-2 * h) - 8 * f(-h) + 8 * f(h) - f(2 * h)) / (12 * h);
}

// The absolute error floor of Derivative from the loss's fp32 rounding: ~1e-7 of the loss per
// evaluation (fp32 activations; the loss itself sums in double), times the stencil's
// sqrt(1 + 64 + 64 + 1) / 12 ~ 1, over h; doubled for margin.
double RoundingFloor(double loss, double h) {
  return 2e-7 * std::max(1.0, std::abs(loss)) / h;
}

// The loss's derivative along u, by differences and from the gradient: d/dt L(w + t u) and
// <grad, u>. u is given per tensor in ForEach order; an empty entry does not move that tensor.
struct Directional {
  double finite_difference, analytic;
};
Directional DirectionalDerivative(const Problem& p,
                                  const std::vector<std::vector<float>>& direction, double h) {
  ModelWeights grads = p.result.grads;
  const std::vector<Tensor> tg = Tensors(grads);
  double analytic = 0.0;
  for (size_t t = 0; t < direction.size(); ++t) {
    for (size_t i = 0; i < direction[t].size(); ++i) {
      analytic += static_cast<double>((*tg[t].values)[i]) * direction[t][i];
    }
  }
  const auto loss_at = [&](double step) {
    ModelWeights moved = p.weights;
    const std::vector<Tensor> tm = Tensors(moved);
    for (size_t t = 0; t < direction.size(); ++t) {
      for (size_t i = 0; i < direction[t].size(); ++i) {
        (*tm[t].values)[i] += static_cast<float>(step * direction[t][i]);
      }
    }
    return p.Loss(moved);
  };
  return {Derivative(loss_at, h), analytic};
}

// A random direction for the tensors selected by `which` (all when negative): N(0, 1) per entry
// scaled by the tensor's RMS, so that a step is a relative perturbation in every tensor alike.
std::vector<std::vector<float>> RandomDirection(const Problem& p, std::mt19937& rng,
                                                int which = -1) {
  ModelWeights w = p.weights;
  const std::vector<Tensor> tensors = Tensors(w);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> u(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (which >= 0 && static_cast<int>(t) != which) continue;
    const float scale = static_cast<float>(Rms(*tensors[t].values));
    u[t].resize(tensors[t].values->size());
    for (float& x : u[t]) x = scale * normal(rng);
  }
  return u;
}

// Steps of 1% of every entry (directions are scaled by each tensor's RMS); measured errors are
// 1e-3 relative at worst, mostly ~1e-4.
constexpr double kDirectionStep = 1e-2;
constexpr double kDirectionTolerance = 5e-3;  // relative, on the directional derivative

// ---------------------------------------------------------------------------------------------

class GradientCheck
    : public ::testing::TestWithParam<std::tuple<std::string /*variant*/, int64_t /*n*/>> {};

TEST_P(GradientCheck, DirectionalDerivativeOverAllParameters) {
  const auto& [variant, n] = GetParam();
  const Problem p(variant, n, 11 + n);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 3; ++trial) {
    const Directional d = DirectionalDerivative(p, RandomDirection(p, rng), kDirectionStep);
    EXPECT_NEAR(d.finite_difference, d.analytic,
                kDirectionTolerance * std::abs(d.analytic) +
                    RoundingFloor(p.result.loss_sum, kDirectionStep))
        << "trial " << trial;
  }
}

TEST_P(GradientCheck, DirectionalDerivativePerTensor) {
  const auto& [variant, n] = GetParam();
  const Problem p(variant, n, 23 + n);
  ModelWeights w = p.weights;
  const std::vector<Tensor> tensors = Tensors(w);
  std::mt19937 rng(8);
  for (size_t t = 0; t < tensors.size(); ++t) {
    const Directional d =
        DirectionalDerivative(p, RandomDirection(p, rng, static_cast<int>(t)), kDirectionStep);
    EXPECT_NEAR(d.finite_difference, d.analytic,
                kDirectionTolerance * std::abs(d.analytic) +
                    RoundingFloor(p.result.loss_sum, kDirectionStep))
        << tensors[t].name;
  }
}

// One entry alone moves the loss little, so the step is larger than along a direction: 10% of the
// tensor's RMS (the stencil is O(h^4)); measured errors are below 2e-3 relative.
constexpr double kSingleStep = 1e-1;
constexpr double kSingleTolerance = 1e-2;

// At small n only: 24 entries x 17 tensors x 4 forwards each.
class SingleParameterCheck : public GradientCheck {};

TEST_P(SingleParameterCheck, FiniteDifferences) {
  const auto& [variant, n] = GetParam();
  Problem p(variant, n, 37 + n);
  ModelWeights w = p.weights;
  ModelWeights grads = p.result.grads;
  const std::vector<Tensor> tw = Tensors(w), tg = Tensors(grads);
  const int64_t hidden = p.model.hidden_size;
  std::vector<int32_t> targets;
  for (int32_t l : p.labels) {
    if (l >= 0) targets.push_back(l);
  }
  std::mt19937 rng(9);
  for (size_t t = 0; t < tw.size(); ++t) {
    std::vector<float>& values = *tw[t].values;
    const std::vector<float>& grad = *tg[t].values;
    // 24 entries, three quarters of them, in the embedding and LM head, in rows that matter: the
    // embedding's lookups read the tokens' rows, the LM head's largest gradients are in the
    // targets' rows (a tied embedding is both); elsewhere their gradients are zero or tiny.
    const bool embedding = tw[t].name == "model.embed_tokens.weight";
    const bool lm_head =
        tw[t].name == "lm_head.weight" || (embedding && p.model.tie_word_embeddings);
    std::vector<int32_t> rows;
    if (embedding) rows.insert(rows.end(), p.tokens.begin(), p.tokens.end());
    if (lm_head) rows.insert(rows.end(), targets.begin(), targets.end());
    std::uniform_int_distribution<size_t> any(0, values.size() - 1);
    std::uniform_int_distribution<int64_t> column(0, hidden - 1);
    std::uniform_int_distribution<size_t> row(0, std::max<size_t>(rows.size(), 1) - 1);
    std::vector<size_t> picks;
    for (int k = 0; k < 24; ++k) {
      picks.push_back(rows.empty() || k % 4 == 0
                          ? any(rng)
                          : static_cast<size_t>(rows[row(rng)] * hidden + column(rng)));
    }
    const double h = kSingleStep * std::max(Rms(values), 1e-2);
    for (size_t i : picks) {
      const float original = values[i];
      const double fd = Derivative(
          [&](double step) {
            values[i] = static_cast<float>(original + step);
            const double loss = p.Loss(w);
            values[i] = original;
            return loss;
          },
          h);
      EXPECT_NEAR(fd, grad[i],
                  kSingleTolerance * std::abs(grad[i]) + RoundingFloor(p.result.loss_sum, h))
          << tw[t].name << "[" << i << "]";
    }
  }
}

std::string ParamName(const ::testing::TestParamInfo<GradientCheck::ParamType>& info) {
  return std::get<0>(info.param) + "_n" + std::to_string(std::get<1>(info.param));
}
INSTANTIATE_TEST_SUITE_P(Tiny, GradientCheck,
                         ::testing::Combine(::testing::Values("untied", "tied", "nobias"),
                                            ::testing::Values<int64_t>(1, 7, 100)),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Tiny, SingleParameterCheck,
                         ::testing::Combine(::testing::Values("untied", "tied", "nobias"),
                                            ::testing::Values<int64_t>(1, 7)),
                         ParamName);

// ---------------------------------------------------------------------------------------------
// The forward, i.e. the model definition the gradients are of, against a naive float64 forward
// written here from the Hugging Face Qwen2 / Llama modeling code: plain loops, no kernel calls.

using Doubles = std::vector<double>;

// y[t] = x[t] W^T + b over n rows; W is [out][in].
Doubles NaiveLinear(const Doubles& x, const std::vector<float>& w, const std::vector<float>& b,
                    int64_t n, int64_t out, int64_t in) {
  Doubles y(static_cast<size_t>(n * out));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t o = 0; o < out; ++o) {
      double acc = b.empty() ? 0.0 : b[o];
      for (int64_t i = 0; i < in; ++i) acc += x[t * in + i] * w[o * in + i];
      y[t * out + o] = acc;
    }
  }
  return y;
}

Doubles NaiveRmsNorm(const Doubles& x, const std::vector<float>& w, int64_t n, int64_t d,
                     double eps) {
  Doubles y(x.size());
  for (int64_t t = 0; t < n; ++t) {
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += x[t * d + i] * x[t * d + i];
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(d) + eps);
    for (int64_t i = 0; i < d; ++i) y[t * d + i] = x[t * d + i] * r * w[i];
  }
  return y;
}

// rotate_half RoPE of head `h` of row t (position t), columns [offset + h d_h, ...) of a row of
// width `width`.
void NaiveRope(Doubles& x, int64_t n, int64_t width, int64_t offset, int64_t heads, int64_t dh,
               double theta) {
  const int64_t half = dh / 2;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      double* v = x.data() + t * width + offset + h * dh;
      for (int64_t j = 0; j < half; ++j) {
        const double angle = static_cast<double>(t) * std::pow(theta, -2.0 * j / dh);
        const double x1 = v[j], x2 = v[j + half];
        v[j] = x1 * std::cos(angle) - x2 * std::sin(angle);
        v[j + half] = x2 * std::cos(angle) + x1 * std::sin(angle);
      }
    }
  }
}

double NaiveLoss(const ModelSpec& m, const ModelWeights& w, const Tokens& tokens,
                 const Tokens& labels) {
  const int64_t n = static_cast<int64_t>(tokens.size()), d = m.hidden_size, dh = m.head_dim;
  const int64_t hq = m.num_attention_heads, hkv = m.num_key_value_heads,
                inter = m.intermediate_size;
  const int64_t q_dim = m.q_dim(), kv_dim = m.kv_dim(), rows = q_dim + 2 * kv_dim;
  Doubles h(static_cast<size_t>(n * d));
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < d; ++i) h[t * d + i] = w.embedding[tokens[t] * d + i];
  }
  for (const LayerWeights& l : w.layers) {
    const Doubles x = NaiveRmsNorm(h, l.attn_norm, n, d, m.rms_norm_eps);
    Doubles qkv = NaiveLinear(x, l.qkv, l.qkv_bias, n, rows, d);
    NaiveRope(qkv, n, rows, 0, hq, dh, m.rope_theta);       // Q
    NaiveRope(qkv, n, rows, q_dim, hkv, dh, m.rope_theta);  // K
    Doubles attn(static_cast<size_t>(n * q_dim), 0.0);
    for (int64_t head = 0; head < hq; ++head) {
      const int64_t kvh = head / (hq / hkv);
      for (int64_t i = 0; i < n; ++i) {
        Doubles s(static_cast<size_t>(i + 1));
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0.0;
          for (int64_t e = 0; e < dh; ++e) {
            dot += qkv[i * rows + head * dh + e] * qkv[j * rows + q_dim + kvh * dh + e];
          }
          s[j] = dot / std::sqrt(static_cast<double>(dh));
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double sum = 0.0;
        for (double& v : s) sum += (v = std::exp(v - mx));
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t e = 0; e < dh; ++e) {
            attn[i * q_dim + head * dh + e] +=
                s[j] / sum * qkv[j * rows + q_dim + kv_dim + kvh * dh + e];
          }
        }
      }
    }
    const Doubles o = NaiveLinear(attn, l.o, {}, n, d, q_dim);
    for (size_t i = 0; i < h.size(); ++i) h[i] += o[i];
    const Doubles y = NaiveRmsNorm(h, l.mlp_norm, n, d, m.rms_norm_eps);
    const Doubles gu = NaiveLinear(y, l.gate_up, {}, n, 2 * inter, d);
    Doubles act(static_cast<size_t>(n * inter));
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t i = 0; i < inter; ++i) {
        const double g = gu[t * 2 * inter + i], u = gu[t * 2 * inter + inter + i];
        act[t * inter + i] = g / (1.0 + std::exp(-g)) * u;
      }
    }
    const Doubles down = NaiveLinear(act, l.down, {}, n, d, inter);
    for (size_t i = 0; i < h.size(); ++i) h[i] += down[i];
  }
  const Doubles xf = NaiveRmsNorm(h, w.final_norm, n, d, m.rms_norm_eps);
  const std::vector<float>& head = m.tie_word_embeddings ? w.embedding : w.lm_head;
  const Doubles logits = NaiveLinear(xf, head, {}, n, m.vocab_size, d);
  double loss = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    if (labels[t] < 0) continue;
    const double* row = logits.data() + t * m.vocab_size;
    const double mx = *std::max_element(row, row + m.vocab_size);
    double sum = 0.0;
    for (int64_t v = 0; v < m.vocab_size; ++v) sum += std::exp(row[v] - mx);
    loss += mx + std::log(sum) - row[labels[t]];
  }
  return loss;
}

TEST(FullSequenceReference, ForwardMatchesNaiveFloat64) {
  for (const std::string variant : {"untied", "tied", "nobias"}) {
    for (int64_t n : {1, 7, 40}) {
      const Problem p(variant, n, 50 + n);
      const double naive = NaiveLoss(p.model, p.weights, p.tokens, p.labels);
      EXPECT_NEAR(p.result.loss_sum, naive, 1e-5 * std::abs(naive)) << variant << " n=" << n;
    }
  }
}

// ---------------------------------------------------------------------------------------------

TEST(FullSequenceReference, LossAtInitialisationIsAboutLogVocab) {
  for (const ModelSpec& m : {Tiny(), TinyTied(), TinyNoBias()}) {
    const ModelWeights w = RandomWeights(m, 3);
    std::mt19937 rng(4);
    const Tokens tokens = RandomTokens(rng, 100, m.vocab_size);
    const Tokens labels = RandomTokens(rng, 100, m.vocab_size);
    const LossAndGrads r = FullSequenceBackprop(m, w, tokens, labels, 1.0f);
    ASSERT_EQ(r.labelled, 100);
    const double mean = r.loss_sum / static_cast<double>(r.labelled);
    const double log_vocab = std::log(static_cast<double>(m.vocab_size));
    EXPECT_NEAR(mean, log_vocab, 0.1 * log_vocab) << m.name;
  }
}

TEST(FullSequenceReference, LossOnlyForwardMatchesBitForBit) {
  for (const std::string variant : {"untied", "tied", "nobias"}) {
    const Problem p(variant, 33, 5);
    EXPECT_EQ(p.Loss(p.weights), p.result.loss_sum) << variant;
  }
}

TEST(FullSequenceReference, Deterministic) {
  const Problem p("untied", 20, 6);
  const LossAndGrads again = FullSequenceBackprop(p.model, p.weights, p.tokens, p.labels, 1.0f);
  EXPECT_EQ(again.loss_sum, p.result.loss_sum);
  ModelWeights a = p.result.grads, b = again.grads;
  const std::vector<Tensor> ta = Tensors(a), tb = Tensors(b);
  for (size_t t = 0; t < ta.size(); ++t) EXPECT_EQ(*ta[t].values, *tb[t].values) << ta[t].name;
}

TEST(FullSequenceReference, AllLabelsIgnoredGivesZeroLossAndGradients) {
  for (const std::string variant : {"untied", "tied"}) {
    Problem p(variant, 9, 12);
    const Tokens ignored(p.tokens.size(), -1);
    LossAndGrads r = FullSequenceBackprop(p.model, p.weights, p.tokens, ignored, 1.0f);
    EXPECT_EQ(r.loss_sum, 0.0);
    EXPECT_EQ(r.labelled, 0);
    for (const Tensor& t : Tensors(r.grads)) {
      EXPECT_TRUE(std::all_of(t.values->begin(), t.values->end(), [](float g) { return g == 0; }))
          << variant << " " << t.name;
    }
  }
}

// Loss and gradients are sums over labelled positions: the whole equals the sum of the runs with
// one label each, and an ignored position's label value (-1, -100) changes nothing.
TEST(FullSequenceReference, IgnoredLabelsContributeNothing) {
  const Problem p("untied", 8, 13);
  double loss_sum = 0.0;
  ModelWeights grad_sum = ZeroWeights(p.model);
  for (size_t j = 0; j < p.labels.size(); ++j) {
    Tokens one(p.labels.size(), -1);
    one[j] = p.labels[j];
    const LossAndGrads r = FullSequenceBackprop(p.model, p.weights, p.tokens, one, 1.0f);
    EXPECT_EQ(r.labelled, p.labels[j] >= 0 ? 1 : 0);
    loss_sum += r.loss_sum;
    ModelWeights g = r.grads;
    const std::vector<Tensor> ts = Tensors(grad_sum), tg = Tensors(g);
    for (size_t t = 0; t < ts.size(); ++t) {
      for (size_t i = 0; i < ts[t].values->size(); ++i) (*ts[t].values)[i] += (*tg[t].values)[i];
    }
  }
  EXPECT_NEAR(loss_sum, p.result.loss_sum, 1e-9 * std::abs(p.result.loss_sum));
  ModelWeights whole = p.result.grads;
  const std::vector<Tensor> ts = Tensors(grad_sum), tw = Tensors(whole);
  for (size_t t = 0; t < ts.size(); ++t) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < ts[t].values->size(); ++i) {
      const double a = (*ts[t].values)[i], b = (*tw[t].values)[i];
      diff += (a - b) * (a - b);
      norm += b * b;
    }
    EXPECT_LE(std::sqrt(diff), 1e-5 * std::sqrt(norm)) << ts[t].name;
  }

  Tokens minus100 = p.labels;
  for (int32_t& l : minus100) l = l < 0 ? -100 : l;
  const LossAndGrads r = FullSequenceBackprop(p.model, p.weights, p.tokens, minus100, 1.0f);
  EXPECT_EQ(r.loss_sum, p.result.loss_sum);
  EXPECT_EQ(r.grads.embedding, p.result.grads.embedding);
}

// Position i sees tokens 0..i only: with labels up to position j, the tokens after j change
// neither the loss nor any gradient, and (untied) embedding rows used only after j get none.
TEST(FullSequenceReference, Causal) {
  const ModelSpec m = Tiny();
  const ModelWeights w = TestWeights(m, 14);
  std::mt19937 rng(15);
  Tokens tokens = RandomTokens(rng, 12, m.vocab_size);
  Tokens labels = RandomTokens(rng, 12, m.vocab_size);
  const size_t j = 6;
  for (size_t i = j + 1; i < labels.size(); ++i) labels[i] = -1;
  // Token ids the prefix never uses for the suffix, so that their rows are identifiable.
  for (size_t i = j + 1; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(200 + i);
  for (size_t i = 0; i <= j; ++i) tokens[i] = tokens[i] % 200;
  const LossAndGrads a = FullSequenceBackprop(m, w, tokens, labels, 1.0f);
  Tokens other = tokens;
  for (size_t i = j + 1; i < other.size(); ++i) other[i] = static_cast<int32_t>(220 + i);
  const LossAndGrads b = FullSequenceBackprop(m, w, other, labels, 1.0f);
  EXPECT_NEAR(a.loss_sum, b.loss_sum, 1e-12 * std::abs(a.loss_sum));
  EXPECT_EQ(a.grads.layers[0].qkv, b.grads.layers[0].qkv);
  EXPECT_EQ(a.grads.lm_head, b.grads.lm_head);
  const int64_t d = m.hidden_size;
  for (size_t i = j + 1; i < tokens.size(); ++i) {
    const auto row = a.grads.embedding.begin() + tokens[i] * d;
    EXPECT_TRUE(std::all_of(row, row + d, [](float g) { return g == 0; })) << "token " << i;
  }
}

TEST(FullSequenceReference, GradScaleScalesGradientsNotLoss) {
  const Problem p("tied", 10, 16);
  const LossAndGrads r = FullSequenceBackprop(p.model, p.weights, p.tokens, p.labels, 0.25f);
  EXPECT_EQ(r.loss_sum, p.result.loss_sum);
  ModelWeights a = p.result.grads, b = r.grads;
  const std::vector<Tensor> ta = Tensors(a), tb = Tensors(b);
  // A power of two: every product and sum of the backward scales exactly, barring underflow.
  for (size_t t = 0; t < ta.size(); ++t) {
    int64_t mismatches = 0;
    for (size_t i = 0; i < ta[t].values->size(); ++i) {
      mismatches += (*tb[t].values)[i] != 0.25f * (*ta[t].values)[i];
    }
    EXPECT_EQ(mismatches, 0) << ta[t].name;
  }
}

TEST(FullSequenceReference, EmptySequence) {
  const ModelSpec m = Tiny();
  const ModelWeights w = RandomWeights(m, 17);
  LossAndGrads r = FullSequenceBackprop(m, w, {}, {}, 1.0f);
  EXPECT_EQ(r.loss_sum, 0.0);
  EXPECT_EQ(r.labelled, 0);
  EXPECT_EQ(r.grads.ParameterCount(), w.ParameterCount());
  for (const Tensor& t : Tensors(r.grads)) {
    EXPECT_TRUE(std::all_of(t.values->begin(), t.values->end(), [](float g) { return g == 0; }));
  }
  EXPECT_EQ(FullSequenceLoss(m, w, {}, {}), 0.0);
}

TEST(FullSequenceReference, RejectsBadInputs) {
  const ModelSpec m = Tiny();
  const ModelWeights w = RandomWeights(m, 18);
  const Tokens ok = {1, 2, 3};
  EXPECT_THROW(FullSequenceBackprop(m, w, Tokens{1, 256, 3}, ok, 1.0f), InputError);
  EXPECT_THROW(FullSequenceBackprop(m, w, ok, Tokens{1, 256, 3}, 1.0f), InputError);
  EXPECT_THROW(FullSequenceBackprop(m, w, ok, Tokens{1, 2}, 1.0f), InternalError);
  EXPECT_THROW(FullSequenceBackprop(TinyTied(), w, ok, ok, 1.0f), InternalError);    // has lm_head
  EXPECT_THROW(FullSequenceBackprop(TinyNoBias(), w, ok, ok, 1.0f), InternalError);  // has bias
}

}  // namespace
}  // namespace ctxplan
