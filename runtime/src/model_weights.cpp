#include "ctxplan/runtime/model_weights.h"

#include <random>

namespace ctxplan {

void ModelWeights::ForEach(
    const std::function<void(const std::string&, std::vector<float>&)>& visit) {
  visit("model.embed_tokens.weight", embedding);
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& w = layers[l];
    visit(p + "input_layernorm.weight", w.attn_norm);
    visit(p + "self_attn.qkv_proj.weight", w.qkv);
    if (!w.qkv_bias.empty()) visit(p + "self_attn.qkv_proj.bias", w.qkv_bias);
    visit(p + "self_attn.o_proj.weight", w.o);
    visit(p + "post_attention_layernorm.weight", w.mlp_norm);
    visit(p + "mlp.gate_up_proj.weight", w.gate_up);
    visit(p + "mlp.down_proj.weight", w.down);
  }
  visit("model.norm.weight", final_norm);
  if (!lm_head.empty()) visit("lm_head.weight", lm_head);
}

int64_t ModelWeights::ParameterCount() const {
  int64_t count = 0;
  const_cast<ModelWeights*>(this)->ForEach(
      [&](const std::string&, std::vector<float>& t) { count += static_cast<int64_t>(t.size()); });
  return count;
}

ModelWeights ZeroWeights(const ModelSpec& m) {
  const size_t d = static_cast<size_t>(m.hidden_size);
  const size_t qkv = static_cast<size_t>(m.q_dim() + 2 * m.kv_dim());
  const size_t inter = static_cast<size_t>(m.intermediate_size);
  const size_t vocab = static_cast<size_t>(m.vocab_size);
  ModelWeights w;
  w.embedding.assign(vocab * d, 0.0f);
  w.layers.resize(static_cast<size_t>(m.num_hidden_layers));
  for (LayerWeights& l : w.layers) {
    l.attn_norm.assign(d, 0.0f);
    l.qkv.assign(qkv * d, 0.0f);
    if (m.attention_bias) l.qkv_bias.assign(qkv, 0.0f);
    l.o.assign(d * static_cast<size_t>(m.q_dim()), 0.0f);
    l.mlp_norm.assign(d, 0.0f);
    l.gate_up.assign(2 * inter * d, 0.0f);
    l.down.assign(d * inter, 0.0f);
  }
  w.final_norm.assign(d, 0.0f);
  if (!m.tie_word_embeddings) w.lm_head.assign(vocab * d, 0.0f);
  return w;
}

ModelWeights RandomWeights(const ModelSpec& m, uint64_t seed) {
  ModelWeights w = ZeroWeights(m);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  w.ForEach([&](const std::string& name, std::vector<float>& t) {
    const bool norm = name.find("norm") != std::string::npos;
    for (float& x : t) x = norm ? 1.0f : normal(rng);
  });
  return w;
}

}  // namespace ctxplan
