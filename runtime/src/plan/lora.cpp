#include "ctxplan/runtime/plan/lora.h"

#include <cmath>
#include <random>

#include "ctxplan/models/errors.h"

namespace ctxplan {

void LoraWeights::ForEach(
    const std::function<void(const std::string&, std::vector<float>&)>& visit) {
  ForEachShaped([&](const std::string& name, const std::array<int64_t, 2>&,
                    std::vector<float>& tensor) { visit(name, tensor); });
}

void LoraWeights::ForEachShaped(
    const std::function<void(const std::string&, const std::array<int64_t, 2>&,
                             std::vector<float>&)>& visit) {
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string prefix = "model.layers." + std::to_string(l) + ".";
    for (OpPart part : kLoraParts)
      for (LoraProjection& p : layers[l].Part(part)) {
        visit(prefix + p.name + ".lora_A.weight", {rank, p.in}, p.a);
        visit(prefix + p.name + ".lora_B.weight", {p.out, rank}, p.b);
      }
  }
}

int64_t LoraWeights::ParameterCount() const {
  int64_t count = 0;
  const_cast<LoraWeights*>(this)->ForEach(
      [&](const std::string&, std::vector<float>& t) { count += static_cast<int64_t>(t.size()); });
  return count;
}

LoraWeights ZeroLora(const ModelSpec& m, int64_t rank) {
  CTXPLAN_CHECK(rank > 0, "LoRA rank must be positive");
  const int64_t d = m.hidden_size, q = m.q_dim(), kv = m.kv_dim(), i = m.intermediate_size;
  auto projection = [&](std::string name, int64_t offset, int64_t out, int64_t in) {
    LoraProjection p;
    p.name = std::move(name);
    p.out_offset = offset;
    p.out = out;
    p.in = in;
    p.a.assign(static_cast<size_t>(rank * in), 0.0f);
    p.b.assign(static_cast<size_t>(out * rank), 0.0f);
    return p;
  };
  LoraWeights w;
  w.rank = rank;
  w.scale = 1.0f;
  w.layers.resize(static_cast<size_t>(m.num_hidden_layers));
  for (LayerLora& l : w.layers) {
    l.qkv = {projection("self_attn.q_proj", 0, q, d), projection("self_attn.k_proj", q, kv, d),
             projection("self_attn.v_proj", q + kv, kv, d)};
    l.o = {projection("self_attn.o_proj", 0, d, q)};
    l.gate_up = {projection("mlp.gate_proj", 0, i, d), projection("mlp.up_proj", i, i, d)};
    l.down = {projection("mlp.down_proj", 0, d, i)};
  }
  return w;
}

LoraWeights RandomLora(const ModelSpec& m, int64_t rank, uint64_t seed, bool random_b) {
  LoraWeights w = ZeroLora(m, rank);
  std::mt19937_64 rng(seed);
  for (LayerLora& l : w.layers)
    for (OpPart part : kLoraParts)
      for (LoraProjection& p : l.Part(part)) {
        std::normal_distribution<float> a(0.0f, 1.0f / std::sqrt(static_cast<float>(p.in)));
        for (float& x : p.a) x = a(rng);
        if (random_b) {
          std::normal_distribution<float> b(0.0f, 0.02f);
          for (float& x : p.b) x = b(rng);
        }
      }
  return w;
}

void MergeLora(const LoraWeights& lora,
               const std::function<std::vector<float>&(OpPart, size_t)>& weight_of) {
  const int64_t r = lora.rank;
  for (size_t l = 0; l < lora.layers.size(); ++l)
    for (OpPart part : kLoraParts) {
      std::vector<float>& w = weight_of(part, l);
      for (const LoraProjection& p : lora.layers[l].Part(part))
        for (int64_t o = 0; o < p.out; ++o)
          for (int64_t k = 0; k < p.in; ++k) {
            double sum = 0.0;
            for (int64_t j = 0; j < r; ++j)
              sum += static_cast<double>(p.b[static_cast<size_t>(o * r + j)]) *
                     p.a[static_cast<size_t>(j * p.in + k)];
            w[static_cast<size_t>((p.out_offset + o) * p.in + k)] +=
                static_cast<float>(lora.scale * sum);
          }
    }
}

namespace lora_cpu {

namespace {
// x A^T: [t][r] from x [t][in], A [r][in].
std::vector<float> Down(const LoraProjection& p, const float* x, int64_t t, int64_t r) {
  std::vector<float> u(static_cast<size_t>(t * r), 0.0f);
  for (int64_t i = 0; i < t; ++i)
    for (int64_t j = 0; j < r; ++j) {
      double sum = 0.0;
      for (int64_t k = 0; k < p.in; ++k)
        sum += static_cast<double>(x[i * p.in + k]) * p.a[static_cast<size_t>(j * p.in + k)];
      u[static_cast<size_t>(i * r + j)] = static_cast<float>(sum);
    }
  return u;
}
}  // namespace

void Forward(const std::vector<LoraProjection>& part, float scale, const float* x, int64_t t,
             float* y, int64_t y_stride) {
  for (const LoraProjection& p : part) {
    const int64_t r = static_cast<int64_t>(p.a.size()) / p.in;
    const std::vector<float> u = Down(p, x, t, r);
    for (int64_t i = 0; i < t; ++i)
      for (int64_t o = 0; o < p.out; ++o) {
        double sum = 0.0;
        for (int64_t j = 0; j < r; ++j)
          sum += static_cast<double>(u[static_cast<size_t>(i * r + j)]) *
                 p.b[static_cast<size_t>(o * r + j)];
        y[i * y_stride + p.out_offset + o] += static_cast<float>(scale * sum);
      }
  }
}

void Backward(const std::vector<LoraProjection>& part, float scale, const float* x, const float* dy,
              int64_t dy_stride, int64_t t, float* dx, std::vector<LoraProjection>* grads) {
  for (size_t n = 0; n < part.size(); ++n) {
    const LoraProjection& p = part[n];
    const int64_t r = static_cast<int64_t>(p.a.size()) / p.in;
    // du = scale * dy_seg B: [t][r]
    std::vector<float> du(static_cast<size_t>(t * r), 0.0f);
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < r; ++j) {
        double sum = 0.0;
        for (int64_t o = 0; o < p.out; ++o)
          sum += static_cast<double>(dy[i * dy_stride + p.out_offset + o]) *
                 p.b[static_cast<size_t>(o * r + j)];
        du[static_cast<size_t>(i * r + j)] = static_cast<float>(scale * sum);
      }
    if (dx != nullptr)
      for (int64_t i = 0; i < t; ++i)
        for (int64_t k = 0; k < p.in; ++k) {
          double sum = 0.0;
          for (int64_t j = 0; j < r; ++j)
            sum += static_cast<double>(du[static_cast<size_t>(i * r + j)]) *
                   p.a[static_cast<size_t>(j * p.in + k)];
          dx[i * p.in + k] += static_cast<float>(sum);
        }
    if (grads == nullptr) continue;
    LoraProjection& g = (*grads)[n];
    for (int64_t j = 0; j < r; ++j)  // dA += du^T x
      for (int64_t k = 0; k < p.in; ++k) {
        double sum = 0.0;
        for (int64_t i = 0; i < t; ++i)
          sum += static_cast<double>(du[static_cast<size_t>(i * r + j)]) * x[i * p.in + k];
        g.a[static_cast<size_t>(j * p.in + k)] += static_cast<float>(sum);
      }
    const std::vector<float> u = Down(p, x, t, r);  // dB += scale * dy_seg^T u
    for (int64_t o = 0; o < p.out; ++o)
      for (int64_t j = 0; j < r; ++j) {
        double sum = 0.0;
        for (int64_t i = 0; i < t; ++i)
          sum += static_cast<double>(dy[i * dy_stride + p.out_offset + o]) *
                 u[static_cast<size_t>(i * r + j)];
        g.b[static_cast<size_t>(o * r + j)] += static_cast<float>(scale * sum);
      }
  }
}

}  // namespace lora_cpu
}  // namespace ctxplan
