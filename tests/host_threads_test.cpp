// The host code's own thread pools, which scripts/tsan.sh runs under ThreadSanitizer (issue 16):
// HostAdamWStep (--optimizer adamw-host, and what ctxplan-measure times) splits every tensor
// among its threads, and RandomWeights fills 1M-element blocks from a shared counter. Both must
// give the same bits whatever the number of threads, touch nothing outside their tensors, and
// hand their results to the caller only through the joins.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/bf16.h"
#include "ctxplan/runtime/cpu/host_adamw.h"
#include "ctxplan/runtime/plan/model_weights.h"

namespace ctxplan {
namespace {

// Tensors of awkward lengths (shorter than the thread count, not a multiple of it), laid out
// with gaps and in a different order in each of the three arrays, so that a slice that strays
// out of its tensor lands on a sentinel or on another tensor's elements.
struct Layout {
  std::vector<HostAdamWTensor> tensors;
  size_t weights = 0, grads = 0, moments = 0;
};

Layout MakeLayout() {
  const size_t lengths[] = {1, 7, 1000, 4097, 3};
  Layout l;
  for (const size_t n : lengths) l.tensors.push_back({0, 0, 0, n});
  for (HostAdamWTensor& t : l.tensors) {
    t.weight = l.weights + 5;  // a gap of five sentinels before each tensor
    l.weights = t.weight + t.n;
  }
  for (size_t i = l.tensors.size(); i-- > 0;) {  // gradients in reverse order
    l.tensors[i].grad = l.grads + 3;
    l.grads = l.tensors[i].grad + l.tensors[i].n;
  }
  for (HostAdamWTensor& t : l.tensors) {
    t.moment = l.moments + 2;
    l.moments = t.moment + t.n;
  }
  l.weights += 5;
  l.moments += 2;
  return l;
}

constexpr uint16_t kSentinelBits = 0x7e11;  // a bf16 NaN no update could produce
constexpr float kSentinelMoment = -12345.0f;

struct State {
  std::vector<uint16_t> weights;
  std::vector<float> m, v;
};

template <typename Grad>
struct Problem {
  Layout layout = MakeLayout();
  std::vector<Grad> grads;
  State start;

  Problem() {
    std::mt19937 rng(42);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    start.weights.assign(layout.weights, kSentinelBits);
    start.m.assign(layout.moments, kSentinelMoment);
    start.v.assign(layout.moments, kSentinelMoment);
    grads.assign(layout.grads, Grad{});
    for (const HostAdamWTensor& t : layout.tensors) {
      for (size_t j = 0; j < t.n; ++j) {
        start.weights[t.weight + j] = Fp32ToBf16(normal(rng) * 0.02f);
        start.m[t.moment + j] = normal(rng) * 1e-3f;
        start.v[t.moment + j] = std::abs(normal(rng)) * 1e-6f;
        const float g = normal(rng) * 1e-2f;
        if constexpr (std::is_same_v<Grad, float>)
          grads[t.grad + j] = g;
        else
          grads[t.grad + j] = Fp32ToBf16(g);
      }
    }
  }

  State Run(unsigned threads, int64_t steps) const {
    State s = start;
    for (int64_t step = 1; step <= steps; ++step) {
      const HostAdamWParams p{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step};
      HostAdamWStep<Grad>(p, layout.tensors, s.weights.data(), grads.data(), s.m.data(), s.v.data(),
                          threads);
    }
    return s;
  }
};

// One fp32 update of one element as torch.optim.AdamW writes it, in double.
float ReferenceWeight(float w, double g, double m, double v, int64_t step) {
  const double lr = 1e-3, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, wd = 0.1;
  m = beta1 * m + (1 - beta1) * g;
  v = beta2 * v + (1 - beta2) * g * g;
  const double m_hat = m / (1 - std::pow(beta1, static_cast<double>(step)));
  const double v_hat = v / (1 - std::pow(beta2, static_cast<double>(step)));
  return static_cast<float>(w * (1 - lr * wd) - lr * m_hat / (std::sqrt(v_hat) + eps));
}

template <typename Grad>
void ExpectThreadCountsAgree() {
  const Problem<Grad> problem;
  const State one = problem.Run(1, 3);
  // Two to sixteen threads as the CUDA backend asks for, and more threads than elements.
  for (const unsigned threads : {2u, 3u, 8u, 16u, 64u}) {
    const State many = problem.Run(threads, 3);
    EXPECT_EQ(many.weights, one.weights) << threads << " threads";
    EXPECT_EQ(many.m, one.m) << threads << " threads";
    EXPECT_EQ(many.v, one.v) << threads << " threads";
  }
  // The gaps between tensors are never written.
  size_t updated = 0;
  for (const uint16_t bits : one.weights) updated += bits != kSentinelBits;
  size_t total = 0;
  for (const HostAdamWTensor& t : problem.layout.tensors) total += t.n;
  EXPECT_EQ(updated, total);
  for (size_t i = 0; i < one.m.size(); ++i) {
    bool inside = false;
    for (const HostAdamWTensor& t : problem.layout.tensors)
      inside = inside || (i >= t.moment && i < t.moment + t.n);
    if (inside) continue;
    EXPECT_EQ(one.m[i], kSentinelMoment) << i;
    EXPECT_EQ(one.v[i], kSentinelMoment) << i;
  }
}

TEST(HostAdamW, EveryThreadCountGivesTheSameBitsBf16Grads) {
  ExpectThreadCountsAgree<uint16_t>();
}

TEST(HostAdamW, EveryThreadCountGivesTheSameBitsFp32Grads) {
  ExpectThreadCountsAgree<float>();
}

TEST(HostAdamW, OneStepIsTorchsAdamW) {
  const Problem<float> problem;
  const State after = problem.Run(8, 1);
  for (const HostAdamWTensor& t : problem.layout.tensors) {
    for (size_t j = 0; j < t.n; ++j) {
      const float w = Bf16ToFp32(problem.start.weights[t.weight + j]);
      const float expected =
          ReferenceWeight(w, problem.grads[t.grad + j], problem.start.m[t.moment + j],
                          problem.start.v[t.moment + j], 1);
      // bf16 keeps 8 bits of mantissa: one rounding of the result.
      EXPECT_NEAR(Bf16ToFp32(after.weights[t.weight + j]), expected,
                  std::abs(expected) * 0x1.0p-8 + 1e-9);
    }
  }
}

// The embedding and the LM head of 2,560,000 elements each (two full 1M-element blocks and a short
// one), so that RandomWeights' threads all take jobs.
ModelSpec Wide() {
  ModelSpec m = LoadModel("tiny");
  m.vocab_size = 40000;
  return m;
}

TEST(RandomWeights, EveryBlockIsFilledAndTheSameOnEveryCall) {
  const ModelSpec model = Wide();
  ModelWeights a = RandomWeights(model, 5);
  ModelWeights b = RandomWeights(model, 5);
  std::vector<std::vector<float>> first;
  a.ForEach([&](const std::string&, std::vector<float>& t) { first.push_back(t); });
  size_t i = 0;
  b.ForEach([&](const std::string& name, std::vector<float>& t) {
    EXPECT_EQ(t, first[i++]) << name;
    if (name.find("norm") != std::string::npos) return;
    // Every block of the tensor was drawn: none is left at ZeroWeights' zeros.
    constexpr size_t kBlock = size_t{1} << 20;
    for (size_t begin = 0; begin < t.size(); begin += kBlock) {
      double sum_sq = 0;
      const size_t end = std::min(t.size(), begin + kBlock);
      for (size_t j = begin; j < end; ++j) sum_sq += double(t[j]) * t[j];
      EXPECT_NEAR(std::sqrt(sum_sq / static_cast<double>(end - begin)), 0.02, 0.004)
          << name << " block at " << begin;
    }
  });
  ModelWeights c = RandomWeights(model, 6);
  EXPECT_NE(c.embedding, a.embedding);
}

}  // namespace
}  // namespace ctxplan
