#include "ctxplan/runtime/plan/model_weights.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/plan_geometry.h"

namespace ctxplan {

namespace {

// The one order of the tensors; `bias(layer)` and `head` say whether the optional ones are there.
template <typename HasBias, typename Visit>
void VisitTensors(ModelWeights& w, HasBias bias, bool head, Visit&& visit) {
  visit("model.embed_tokens.weight", w.embedding);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& t = w.layers[l];
    visit(p + "input_layernorm.weight", t.attn_norm);
    visit(p + "self_attn.qkv_proj.weight", t.qkv);
    if (bias(t)) visit(p + "self_attn.qkv_proj.bias", t.qkv_bias);
    visit(p + "self_attn.o_proj.weight", t.o);
    visit(p + "post_attention_layernorm.weight", t.mlp_norm);
    visit(p + "mlp.gate_up_proj.weight", t.gate_up);
    visit(p + "mlp.down_proj.weight", t.down);
  }
  visit("model.norm.weight", w.final_norm);
  if (head) visit("lm_head.weight", w.lm_head);
}

}  // namespace

void ModelWeights::ForEach(
    const std::function<void(const std::string&, std::vector<float>&)>& visit) {
  VisitTensors(
      *this, [](const LayerWeights& t) { return !t.qkv_bias.empty(); }, !lm_head.empty(), visit);
}

void ModelWeights::ForEachOfModel(
    const ModelSpec& model,
    const std::function<void(const std::string&, std::vector<float>&)>& visit) {
  CTXPLAN_CHECK(static_cast<int64_t>(layers.size()) == model.num_hidden_layers,
                "weights of another model's depth");
  VisitTensors(
      *this, [&](const LayerWeights&) { return model.attention_bias; }, !model.tie_word_embeddings,
      visit);
}

int64_t ModelWeights::ParameterCount() const {
  int64_t count = 0;
  const_cast<ModelWeights*>(this)->ForEach(
      [&](const std::string&, std::vector<float>& t) { count += static_cast<int64_t>(t.size()); });
  return count;
}

namespace {

// What pipeline stage `stage` of `stages` holds (PipelineStageFirstLayers' split): its layers,
// the embedding on the first stage and, with a tied LM head, on the last (its copy is the head),
// the final norm and the LM head on the last.
struct StageTensors {
  int32_t first_layer = 0, end_layer = 0;
  bool embedding = true, head = true;

  StageTensors(const ModelSpec& model, int32_t stage, int32_t stages) {
    CTXPLAN_CHECK(stage >= 0 && stage < stages, "pipeline stage out of range");
    const std::vector<int32_t> first = PipelineStageFirstLayers(model, stages);
    first_layer = first[static_cast<size_t>(stage)];
    end_layer = first[static_cast<size_t>(stage) + 1];
    head = stage == stages - 1;
    embedding = stage == 0 || (head && model.tie_word_embeddings);
  }
  bool HoldsLayer(int32_t l) const { return l >= first_layer && l < end_layer; }
};

}  // namespace

ModelWeights ZeroWeights(const ModelSpec& m, int32_t stage, int32_t stages) {
  const size_t d = static_cast<size_t>(m.hidden_size);
  const size_t qkv = static_cast<size_t>(m.q_dim() + 2 * m.kv_dim());
  const size_t inter = static_cast<size_t>(m.intermediate_size);
  const size_t vocab = static_cast<size_t>(m.vocab_size);
  const StageTensors holds(m, stage, stages);
  ModelWeights w;
  if (holds.embedding) w.embedding.assign(vocab * d, 0.0f);
  w.layers.resize(static_cast<size_t>(m.num_hidden_layers));
  for (int32_t i = holds.first_layer; i < holds.end_layer; ++i) {
    LayerWeights& l = w.layers[static_cast<size_t>(i)];
    l.attn_norm.assign(d, 0.0f);
    l.qkv.assign(qkv * d, 0.0f);
    if (m.attention_bias) l.qkv_bias.assign(qkv, 0.0f);
    l.o.assign(d * static_cast<size_t>(m.q_dim()), 0.0f);
    l.mlp_norm.assign(d, 0.0f);
    l.gate_up.assign(2 * inter * d, 0.0f);
    l.down.assign(d * inter, 0.0f);
  }
  if (holds.head) {
    w.final_norm.assign(d, 0.0f);
    if (!m.tie_word_embeddings) w.lm_head.assign(vocab * d, 0.0f);
  }
  return w;
}

namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// N(0, std) by Box-Muller from a counter-based stream: every block of a tensor has its own seed,
// so blocks fill in parallel and the result does not depend on the number of threads.
void FillNormal(float* out, size_t n, uint64_t seed, float std) {
  uint64_t state = seed;
  constexpr double kTwoPi = 6.283185307179586;
  for (size_t i = 0; i < n; i += 2) {
    const double u1 = (static_cast<double>(SplitMix64(state) >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(SplitMix64(state) >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)) * std;
    out[i] = static_cast<float>(r * std::cos(kTwoPi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(r * std::sin(kTwoPi * u2));
  }
}

}  // namespace

ModelWeights RandomWeights(const ModelSpec& m, uint64_t seed, int32_t stage, int32_t stages) {
  ModelWeights w = ZeroWeights(m, stage, stages);
  constexpr size_t kBlock = size_t{1} << 20;
  struct Job {
    float* data;
    size_t n;
    uint64_t seed;
  };
  std::vector<Job> jobs;
  // Each tensor seeded by its index over the whole model's tensors: a stage's (the others empty
  // here) get the values the whole model's have.
  uint64_t tensor = 0;
  w.ForEachOfModel(m, [&](const std::string& name, std::vector<float>& t) {
    ++tensor;
    if (name.ends_with("norm.weight")) {  // the RMSNorm weights
      std::fill(t.begin(), t.end(), 1.0f);
      return;
    }
    for (size_t begin = 0; begin < t.size(); begin += kBlock)
      jobs.push_back({t.data() + begin, std::min(kBlock, t.size() - begin),
                      seed * 0x100000001B3ull + tensor * 0x9E3779B97F4A7C15ull + begin});
  });
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (unsigned i = 0; i < threads; ++i)
    pool.emplace_back([&] {
      for (size_t j; (j = next.fetch_add(1)) < jobs.size();)
        FillNormal(jobs[j].data, jobs[j].n, jobs[j].seed, 0.02f);
    });
  for (std::thread& t : pool) t.join();
  return w;
}

void KeepStageTensors(ModelWeights& w, const ModelSpec& model, int32_t stage, int32_t stages) {
  const StageTensors holds(model, stage, stages);
  auto drop = [](std::vector<float>& t) { std::vector<float>().swap(t); };
  if (!holds.embedding) drop(w.embedding);
  if (!holds.head) {
    drop(w.final_norm);
    drop(w.lm_head);
  }
  for (int32_t l = 0; l < static_cast<int32_t>(w.layers.size()); ++l) {
    if (holds.HoldsLayer(l)) continue;
    LayerWeights& t = w.layers[static_cast<size_t>(l)];
    for (std::vector<float>* v :
         {&t.attn_norm, &t.qkv, &t.qkv_bias, &t.o, &t.mlp_norm, &t.gate_up, &t.down})
      drop(*v);
  }
}

}  // namespace ctxplan
