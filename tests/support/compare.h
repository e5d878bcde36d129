// What the backend tests compare with: a relative error over a whole tensor, a small model of the
// CUDA kernels' shapes, and weights sharp enough that attention is far from uniform (so a wrong
// page or mask shows).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/model_weights.h"

namespace ctxplan::test {

// A small model of the shapes the CUDA kernels take (head dim 64), untied, of `layers` layers.
inline ModelSpec SmallGpuModel(int64_t layers) {
  ModelSpec m = LoadModel("tiny");
  m.name = "small-d64-" + std::to_string(layers) + "l";
  m.hidden_size = 256;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 64;
  m.intermediate_size = 512;
  m.vocab_size = 512;
  m.num_hidden_layers = layers;
  return m;
}

// ||out - ref|| / ||ref|| (||out - ref|| where ref is all zeros); infinite if out is not finite.
inline double RelativeError(const std::vector<float>& out, const std::vector<float>& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    diff += (double(out[i]) - ref[i]) * (double(out[i]) - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// Larger weights than the 0.02 init (norms excepted), so that attention is far from uniform.
inline ModelWeights SharpWeights(const ModelSpec& model, uint64_t seed) {
  ModelWeights weights = RandomWeights(model, seed);
  weights.ForEach([](const std::string& name, std::vector<float>& t) {
    if (name.find("norm") == std::string::npos)
      for (float& x : t) x *= 4.0f;
  });
  return weights;
}

}  // namespace ctxplan::test
