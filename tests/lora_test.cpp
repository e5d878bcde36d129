// LoRA on the CPU backend. The adapters' gradients must be those of the merged weight through the
// chain rule: for W' = W + s B A and the merged model's weight gradient G (full fine-tune of W'),
// dB = s G A^T and dA = s B^T G. The base stays frozen, and training the adapters lowers the loss.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/cpu/cpu_backend.h"
#include "ctxplan/runtime/io/token_data.h"
#include "ctxplan/runtime/plan/lora.h"
#include "ctxplan/runtime/plan/step_backend.h"

namespace ctxplan {
namespace {

const ModelSpec& Tiny() {
  static const ModelSpec model = LoadModel("tiny");
  return model;
}

RunOptions Options(int64_t rank, int64_t budget, bool offload) {
  RunOptions o;
  o.context_tokens = 50;  // 4 chunks, the last one short
  o.chunk_tokens = 16;
  o.page_tokens = 8;
  o.page_budget = budget;
  o.sink_pages = 1;
  o.query_tile = 4;
  o.offload = offload;
  o.optimizer = OptimizerKind::kNone;
  o.lora_rank = rank;
  return o;
}

double RelativeError(const std::vector<double>& out, const std::vector<double>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

std::vector<float>& FusedWeight(ModelWeights& w, OpPart part, size_t layer) {
  LayerWeights& l = w.layers[layer];
  switch (part) {
    case OpPart::kQkv:
      return l.qkv;
    case OpPart::kO:
      return l.o;
    case OpPart::kGateUp:
      return l.gate_up;
    default:
      return l.down;
  }
}

TEST(Lora, GradientsAreTheMergedWeightsThroughTheChainRule) {
  const ModelSpec& m = Tiny();
  const ModelWeights base = RandomWeights(m, 3);
  const int64_t rank = 3;
  const LoraWeights adapters = RandomLora(m, rank, 4, /*random_b=*/true);
  std::vector<int32_t> tokens = RandomTokens(m.vocab_size, 50, 5);
  std::vector<int32_t> labels(tokens.begin() + 1, tokens.end());
  labels.push_back(-1);

  struct Variant {
    int64_t budget;
    bool offload;
  };
  for (const Variant v : {Variant{RunOptions::kAllPages, true},
                          Variant{RunOptions::kAllPages, false}, Variant{2, true}}) {
    const std::string where =
        "budget " + std::to_string(v.budget) + " offload " + std::to_string(v.offload);
    // The merged model, full fine-tune: G.
    ModelWeights merged = base;
    MergeLora(adapters, [&](OpPart part, size_t l) -> std::vector<float>& {
      return FusedWeight(merged, part, l);
    });
    ModelWeights full_grads = ZeroWeights(m);
    CpuBackend full(m, merged, full_grads, nullptr);
    const StepOutputs want =
        RunStep(StepPlan(m, Options(0, v.budget, v.offload)), {tokens, labels}, full);
    // Base + adapters.
    ModelWeights w = base, base_grads = ZeroWeights(m);
    LoraState lora{adapters, ZeroLora(m, rank), ZeroLora(m, rank), ZeroLora(m, rank)};
    CpuBackend backend(m, w, base_grads, nullptr, &lora);
    const StepOutputs got =
        RunStep(StepPlan(m, Options(rank, v.budget, v.offload)), {tokens, labels}, backend);
    EXPECT_NEAR(got.loss_sum / want.loss_sum, 1.0, 1e-5) << where;

    double worst = 0.0;
    const float s = adapters.scale;
    for (size_t l = 0; l < adapters.layers.size(); ++l)
      for (OpPart part : kLoraParts) {
        const std::vector<float>& g = FusedWeight(full_grads, part, l);
        const std::vector<LoraProjection>& ps = adapters.layers[l].Part(part);
        const std::vector<LoraProjection>& gs = lora.grads.layers[l].Part(part);
        for (size_t n = 0; n < ps.size(); ++n) {
          const LoraProjection& p = ps[n];
          std::vector<double> want_a(p.a.size(), 0.0), want_b(p.b.size(), 0.0);
          for (int64_t o = 0; o < p.out; ++o)
            for (int64_t k = 0; k < p.in; ++k) {
              const double grad = g[static_cast<size_t>((p.out_offset + o) * p.in + k)];
              for (int64_t j = 0; j < rank; ++j) {
                want_a[static_cast<size_t>(j * p.in + k)] +=
                    s * p.b[static_cast<size_t>(o * rank + j)] * grad;
                want_b[static_cast<size_t>(o * rank + j)] +=
                    s * grad * p.a[static_cast<size_t>(j * p.in + k)];
              }
            }
          const std::vector<double> got_a(gs[n].a.begin(), gs[n].a.end());
          const std::vector<double> got_b(gs[n].b.begin(), gs[n].b.end());
          const double ea = RelativeError(got_a, want_a), eb = RelativeError(got_b, want_b);
          EXPECT_LE(ea, 1e-4) << where << " layer " << l << " " << p.name << " lora_A";
          EXPECT_LE(eb, 1e-4) << where << " layer " << l << " " << p.name << " lora_B";
          worst = std::max({worst, ea, eb});
        }
      }
    // Frozen: no gradient reaches the base.
    base_grads.ForEach([&](const std::string& name, std::vector<float>& t) {
      for (float x : t) ASSERT_EQ(x, 0.0f) << where << " " << name;
    });
    std::printf("  %s: loss %.6f vs merged %.6f, worst adapter gradient error %.2e\n",
                where.c_str(), got.mean_loss(), want.mean_loss(), worst);
  }
}

TEST(Lora, TrainingTheAdaptersLowersTheLossAndLeavesTheBase) {
  const ModelSpec& m = Tiny();
  const ModelWeights base = RandomWeights(m, 7);
  ModelWeights w = base, grads = ZeroWeights(m);
  const int64_t rank = 8;
  LoraState lora{RandomLora(m, rank, 8), ZeroLora(m, rank), ZeroLora(m, rank), ZeroLora(m, rank)};
  OptimizerState optimizer;
  optimizer.params.lr = 1e-2f;
  RunOptions o = Options(rank, RunOptions::kAllPages, true);
  o.optimizer = OptimizerKind::kAdamWGpu;
  const StepPlan plan(m, o);
  CpuBackend backend(m, w, grads, &optimizer, &lora);
  // One fixed sequence, learned by heart through the adapters alone.
  std::vector<int32_t> tokens = RandomTokens(m.vocab_size, 50, 9);
  std::vector<int32_t> labels(tokens.begin() + 1, tokens.end());
  labels.push_back(-1);
  double first = 0, last = 0;
  for (int s = 0; s < 150; ++s) {
    lora.grads = ZeroLora(m, rank);
    const StepOutputs out = RunStep(plan, {tokens, labels}, backend);
    if (s == 0) first = out.mean_loss();
    last = out.mean_loss();
  }
  EXPECT_LT(last, 0.8 * first) << "first " << first << " last " << last;
  ModelWeights start = base;
  std::vector<std::vector<float>*> before, after;
  start.ForEach([&](const std::string&, std::vector<float>& t) { before.push_back(&t); });
  w.ForEach([&](const std::string&, std::vector<float>& t) { after.push_back(&t); });
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(*before[i], *after[i]) << i;
  std::printf("  LoRA rank %lld: loss %.4f -> %.4f in 150 steps, base unchanged\n",
              static_cast<long long>(rank), first, last);
}

}  // namespace
}  // namespace ctxplan
