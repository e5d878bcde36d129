// Ordinary full-sequence backprop from the CPU reference kernels. See the header for the model.
//
// Notation in the shape comments: n tokens, d hidden, H_q / H_kv heads, d_h head dim,
// q_dim = H_q d_h, kv_dim = H_kv d_h, R = q_dim + 2 kv_dim (fused QKV rows), I MLP width,
// V vocabulary.
#include "ctxplan/runtime/cpu/full_sequence_reference.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "ctxplan/kernels/cpu/reference.h"
#include "ctxplan/kernels/paged_kv.h"
#include "ctxplan/models/errors.h"

namespace ctxplan {
namespace {

namespace cpu = kernels::cpu;

// Tiles of the fused linear + cross-entropy. They only bound the size of the logits tile
// (token_tile x vocab_tile floats, 32 MiB at most); for the tiny test models one tile covers
// everything, and the math is the same for any tiling up to the order of fp32 sums.
constexpr int64_t kLossTokenTile = 1024;
constexpr int64_t kLossVocabTile = 8192;

// Sizes of the model, as int64 once, so that the code below reads like the shape comments.
struct Dims {
  int64_t n, d, hq, hkv, dh, q_dim, kv_dim, rows, inter, vocab;
  float eps;
  double theta;

  Dims(const ModelSpec& m, int64_t tokens)
      : n(tokens),
        d(m.hidden_size),
        hq(m.num_attention_heads),
        hkv(m.num_key_value_heads),
        dh(m.head_dim),
        q_dim(m.q_dim()),
        kv_dim(m.kv_dim()),
        rows(m.q_dim() + 2 * m.kv_dim()),
        inter(m.intermediate_size),
        vocab(m.vocab_size),
        eps(static_cast<float>(m.rms_norm_eps)),
        theta(m.rope_theta) {}
};

// Everything one layer's backward needs, saved by the forward (nothing is recomputed: this is the
// plain method the chunk-recurrent executor is checked against).
struct LayerActivations {
  std::vector<float> x;          // [n][d]       rmsnorm(h_in, attn_norm)
  std::vector<float> rstd_attn;  // [n]
  std::vector<float> q;          // [n][H_q][d_h]  post-RoPE
  std::vector<float> k;          // [n][H_kv][d_h] post-RoPE
  std::vector<float> v;          // [n][H_kv][d_h]
  std::vector<float> attn;       // [n][H_q][d_h]  attention output
  std::vector<float> lse;        // [n][H_q]       its log-sum-exp, for the backward
  std::vector<float> h_mid;      // [n][d]       residual stream after the attention block
  std::vector<float> y;          // [n][d]       rmsnorm(h_mid, mlp_norm)
  std::vector<float> rstd_mlp;   // [n]
  std::vector<float> gate_up;    // [n][2I]
  std::vector<float> act;        // [n][I]       swiglu(gate_up)

  explicit LayerActivations(const Dims& s)
      : x(s.n * s.d),
        rstd_attn(s.n),
        q(s.n * s.q_dim),
        k(s.n * s.kv_dim),
        v(s.n * s.kv_dim),
        attn(s.n * s.q_dim),
        lse(s.n * s.hq),
        h_mid(s.n * s.d),
        y(s.n * s.d),
        rstd_mlp(s.n),
        gate_up(s.n * 2 * s.inter),
        act(s.n * s.inter) {}
};

struct Activations {
  // residual[l] is the input of layer l, residual[L] the input of the final norm: L + 1 buffers
  // of [n][d] when kept for the backward, a single one rewritten in place otherwise.
  std::vector<std::vector<float>> residual;
  std::vector<LayerActivations> layers;  // L when kept, 1 otherwise
  std::vector<float> final_x;            // [n][d] rmsnorm(residual[L], final_norm)
  std::vector<float> final_rstd;         // [n]
};

// The attention of the whole sequence: "own" positions only, no earlier pages, dense.
cpu::AttentionShape AttentionShapeOf(const Dims& s) {
  return {.tokens = s.n,
          .num_heads = s.hq,
          .num_kv_heads = s.hkv,
          .head_dim = s.dh,
          .scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.dh)))};
}

void CheckShape(const std::vector<float>& tensor, int64_t expected, const std::string& what) {
  CTXPLAN_CHECK(static_cast<int64_t>(tensor.size()) == expected,
                what + " has " + std::to_string(tensor.size()) + " elements, the model needs " +
                    std::to_string(expected));
}

void CheckWeights(const ModelSpec& m, const ModelWeights& w) {
  const Dims s(m, 0);
  CheckShape(w.embedding, s.vocab * s.d, "embedding");
  CTXPLAN_CHECK(static_cast<int64_t>(w.layers.size()) == m.num_hidden_layers, "layer count");
  for (const LayerWeights& l : w.layers) {
    CheckShape(l.attn_norm, s.d, "attn_norm");
    CheckShape(l.qkv, s.rows * s.d, "qkv");
    CheckShape(l.qkv_bias, m.attention_bias ? s.rows : 0, "qkv_bias");
    CheckShape(l.o, s.d * s.q_dim, "o");
    CheckShape(l.mlp_norm, s.d, "mlp_norm");
    CheckShape(l.gate_up, 2 * s.inter * s.d, "gate_up");
    CheckShape(l.down, s.d * s.inter, "down");
  }
  CheckShape(w.final_norm, s.d, "final_norm");
  CheckShape(w.lm_head, m.tie_word_embeddings ? 0 : s.vocab * s.d, "lm_head");
}

const float* LmHead(const ModelSpec& m, const ModelWeights& w) {
  return m.tie_word_embeddings ? w.embedding.data() : w.lm_head.data();
}

// One decoder layer forward: h_out = h_in + attention block, + MLP block. Saves in `a` what the
// backward needs. h_in and h_out may be the same buffer (the loss-only forward runs in place).
void LayerForward(const Dims& s, const LayerWeights& w, const std::vector<float>& h_in,
                  LayerActivations& a, std::vector<float>& h_out) {
  // --- attention block ---
  cpu::RmsNormForward(h_in.data(), w.attn_norm.data(), s.n, s.d, s.eps, a.x.data(),
                      a.rstd_attn.data());
  std::vector<float> qkv(s.n * s.rows);  // [n][R]: per token Q, then K, then V
  cpu::LinearForward(a.x.data(), w.qkv.data(), w.qkv_bias.empty() ? nullptr : w.qkv_bias.data(),
                     s.n, s.rows, s.d, qkv.data());
  // RoPE and attention want Q, K, V each contiguous per token: split the fused rows.
  for (int64_t t = 0; t < s.n; ++t) {
    const float* row = qkv.data() + t * s.rows;
    std::copy_n(row, s.q_dim, a.q.data() + t * s.q_dim);
    std::copy_n(row + s.q_dim, s.kv_dim, a.k.data() + t * s.kv_dim);
    std::copy_n(row + s.q_dim + s.kv_dim, s.kv_dim, a.v.data() + t * s.kv_dim);
  }
  cpu::RopeForward(a.q.data(), s.n, s.hq, s.dh, /*first_position=*/0, s.theta);
  cpu::RopeForward(a.k.data(), s.n, s.hkv, s.dh, /*first_position=*/0, s.theta);
  cpu::AttentionForward(AttentionShapeOf(s), a.q.data(), a.k.data(), a.v.data(),
                        kernels::PagedKv<const float>{}, kernels::PageSelection{}, a.attn.data(),
                        a.lse.data());
  std::vector<float> proj(s.n * s.d);  // [n][d]: a block's output before the residual add
  cpu::LinearForward(a.attn.data(), w.o.data(), nullptr, s.n, s.d, s.q_dim, proj.data());
  for (int64_t i = 0; i < s.n * s.d; ++i) a.h_mid[i] = h_in[i] + proj[i];

  // --- MLP block ---
  cpu::RmsNormForward(a.h_mid.data(), w.mlp_norm.data(), s.n, s.d, s.eps, a.y.data(),
                      a.rstd_mlp.data());
  cpu::LinearForward(a.y.data(), w.gate_up.data(), nullptr, s.n, 2 * s.inter, s.d,
                     a.gate_up.data());
  cpu::SwigluForward(a.gate_up.data(), s.n, s.inter, a.act.data());
  cpu::LinearForward(a.act.data(), w.down.data(), nullptr, s.n, s.d, s.inter, proj.data());
  for (int64_t i = 0; i < s.n * s.d; ++i) h_out[i] = a.h_mid[i] + proj[i];
}

// One decoder layer backward. On entry dh [n][d] is dLoss/dh_out; on exit dLoss/dh_in (the
// residual path plus both blocks). Weight gradients accumulate into g.
void LayerBackward(const Dims& s, const LayerWeights& w, const std::vector<float>& h_in,
                   const LayerActivations& a, std::vector<float>& dh, LayerWeights& g) {
  std::vector<float> d_norm_in(s.n * s.d);  // [n][d]: a norm's input gradient, then added to dh

  // --- MLP block: h_out = h_mid + down(swiglu(gate_up(rmsnorm(h_mid)))) ---
  std::vector<float> d_act(s.n * s.inter);          // [n][I]
  std::vector<float> d_gate_up(s.n * 2 * s.inter);  // [n][2I]
  std::vector<float> d_y(s.n * s.d);                // [n][d]
  cpu::LinearBackward(a.act.data(), w.down.data(), dh.data(), s.n, s.d, s.inter, d_act.data(),
                      g.down.data(), nullptr);
  cpu::SwigluBackward(a.gate_up.data(), d_act.data(), s.n, s.inter, d_gate_up.data());
  cpu::LinearBackward(a.y.data(), w.gate_up.data(), d_gate_up.data(), s.n, 2 * s.inter, s.d,
                      d_y.data(), g.gate_up.data(), nullptr);
  cpu::RmsNormBackward(a.h_mid.data(), w.mlp_norm.data(), a.rstd_mlp.data(), d_y.data(), s.n, s.d,
                       d_norm_in.data(), g.mlp_norm.data());
  for (int64_t i = 0; i < s.n * s.d; ++i) dh[i] += d_norm_in[i];  // now dLoss/dh_mid

  // --- attention block: h_mid = h_in + o(attention(rope(qkv(rmsnorm(h_in))))) ---
  std::vector<float> d_attn(s.n * s.q_dim);  // [n][H_q][d_h]
  cpu::LinearBackward(a.attn.data(), w.o.data(), dh.data(), s.n, s.d, s.q_dim, d_attn.data(),
                      g.o.data(), nullptr);
  std::vector<float> dq(s.n * s.q_dim);   // [n][H_q][d_h]
  std::vector<float> dk(s.n * s.kv_dim);  // [n][H_kv][d_h]
  std::vector<float> dv(s.n * s.kv_dim);  // [n][H_kv][d_h]
  cpu::AttentionBackward(AttentionShapeOf(s), a.q.data(), a.k.data(), a.v.data(),
                         kernels::PagedKv<const float>{}, kernels::PageSelection{}, a.attn.data(),
                         a.lse.data(), d_attn.data(), dq.data(), dk.data(), dv.data(),
                         kernels::PagedKv<float>{});
  // dq and dk are gradients w.r.t. the post-RoPE values: rotate them back to the projections'.
  cpu::RopeBackward(dq.data(), s.n, s.hq, s.dh, /*first_position=*/0, s.theta);
  cpu::RopeBackward(dk.data(), s.n, s.hkv, s.dh, /*first_position=*/0, s.theta);
  std::vector<float> d_qkv(s.n * s.rows);  // [n][R]: fused again, as the projection wrote them
  for (int64_t t = 0; t < s.n; ++t) {
    float* row = d_qkv.data() + t * s.rows;
    std::copy_n(dq.data() + t * s.q_dim, s.q_dim, row);
    std::copy_n(dk.data() + t * s.kv_dim, s.kv_dim, row + s.q_dim);
    std::copy_n(dv.data() + t * s.kv_dim, s.kv_dim, row + s.q_dim + s.kv_dim);
  }
  std::vector<float> d_x(s.n * s.d);  // [n][d]
  cpu::LinearBackward(a.x.data(), w.qkv.data(), d_qkv.data(), s.n, s.rows, s.d, d_x.data(),
                      g.qkv.data(), g.qkv_bias.empty() ? nullptr : g.qkv_bias.data());
  cpu::RmsNormBackward(h_in.data(), w.attn_norm.data(), a.rstd_attn.data(), d_x.data(), s.n, s.d,
                       d_norm_in.data(), g.attn_norm.data());
  for (int64_t i = 0; i < s.n * s.d; ++i) dh[i] += d_norm_in[i];  // now dLoss/dh_in
}

// Embedding, every layer, final norm. With keep, every layer's activations and every residual
// stream buffer are saved for the backward; without, one set of buffers is reused (same
// arithmetic, so the same bits).
Activations Forward(const ModelSpec& m, const ModelWeights& w, std::span<const int32_t> tokens,
                    bool keep) {
  const Dims s(m, static_cast<int64_t>(tokens.size()));
  const int64_t layers = m.num_hidden_layers;
  Activations act;
  act.residual.assign(keep ? layers + 1 : 1, std::vector<float>(s.n * s.d));
  act.layers.assign(keep ? layers : 1, LayerActivations(s));
  cpu::EmbeddingForward(tokens, w.embedding.data(), s.vocab, s.d, act.residual[0].data());
  for (int64_t l = 0; l < layers; ++l) {
    const size_t in = keep ? l : 0, out = keep ? l + 1 : 0;
    LayerForward(s, w.layers[l], act.residual[in], act.layers[keep ? l : 0], act.residual[out]);
  }
  act.final_x.resize(s.n * s.d);
  act.final_rstd.resize(s.n);
  cpu::RmsNormForward(act.residual.back().data(), w.final_norm.data(), s.n, s.d, s.eps,
                      act.final_x.data(), act.final_rstd.data());
  return act;
}

void CheckInputs(const ModelSpec& m, const ModelWeights& w, std::span<const int32_t> tokens,
                 std::span<const int32_t> labels) {
  CTXPLAN_CHECK(tokens.size() == labels.size(), std::to_string(tokens.size()) + " tokens but " +
                                                    std::to_string(labels.size()) + " labels");
  CheckWeights(m, w);
}

}  // namespace

LossAndGrads FullSequenceBackprop(const ModelSpec& model, const ModelWeights& weights,
                                  std::span<const int32_t> tokens, std::span<const int32_t> labels,
                                  float grad_scale) {
  CheckInputs(model, weights, tokens, labels);
  const Dims s(model, static_cast<int64_t>(tokens.size()));
  LossAndGrads result;
  result.grads = ZeroWeights(model);
  result.labelled = std::count_if(labels.begin(), labels.end(), [](int32_t l) { return l >= 0; });
  if (s.n == 0) return result;  // nothing to do, and the kernels' tiles must be positive

  const Activations act = Forward(model, weights, tokens, /*keep=*/true);
  ModelWeights& g = result.grads;

  // Loss and its gradient w.r.t. the final norm's output; the LM-head gradient lands in the
  // embedding's when the two are tied, to which the lookup's gradient is added at the end.
  std::vector<float> d_final_x(s.n * s.d);  // [n][d]
  float* d_lm_head = model.tie_word_embeddings ? g.embedding.data() : g.lm_head.data();
  result.loss_sum = cpu::LinearCrossEntropy(act.final_x.data(), LmHead(model, weights), labels, s.d,
                                            s.vocab, kLossTokenTile, kLossVocabTile, grad_scale,
                                            d_final_x.data(), d_lm_head);

  std::vector<float> dh(s.n * s.d);  // [n][d]: dLoss/d(residual stream) at the current depth
  cpu::RmsNormBackward(act.residual.back().data(), weights.final_norm.data(), act.final_rstd.data(),
                       d_final_x.data(), s.n, s.d, dh.data(), g.final_norm.data());
  for (int64_t l = model.num_hidden_layers - 1; l >= 0; --l) {
    LayerBackward(s, weights.layers[l], act.residual[l], act.layers[l], dh, g.layers[l]);
  }
  cpu::EmbeddingBackward(tokens, dh.data(), s.vocab, s.d, g.embedding.data());
  return result;
}

double FullSequenceLoss(const ModelSpec& model, const ModelWeights& weights,
                        std::span<const int32_t> tokens, std::span<const int32_t> labels) {
  CheckInputs(model, weights, tokens, labels);
  const Dims s(model, static_cast<int64_t>(tokens.size()));
  if (s.n == 0) return 0.0;
  const Activations act = Forward(model, weights, tokens, /*keep=*/false);
  return cpu::LinearCrossEntropy(act.final_x.data(), LmHead(model, weights), labels, s.d, s.vocab,
                                 kLossTokenTile, kLossVocabTile, /*grad_scale=*/1.0f,
                                 /*dx=*/nullptr, /*d_w=*/nullptr);
}

}  // namespace ctxplan
