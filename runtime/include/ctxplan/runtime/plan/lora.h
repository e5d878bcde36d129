// LoRA (Hu et al., 2021): low-rank adapters on every projection of every layer, the base weights
// frozen. For a projection W [out][in] whose outputs are columns [out_offset, out_offset + out) of
// its fused linear (q, k, v of qkv; gate, up of gate_up; o; down):
//   y[:, out_offset : out_offset + out] += scale * (x A^T) B^T,   A [r][in], B [out][r]
// so its parameters are r * (in + out), exactly what PlanGeometry::trainable_params counts. A
// starts random and B at zero (the PEFT convention): training starts from the base model.
//
// The CPU math below is the reference both backends follow; the gradients are those of the
// merged weight W + scale * B A through the chain rule (dB = scale * G A^T, dA = scale * B^T G for
// the merged weight's gradient G), which the tests check.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/kernels/cost.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/op.h"

namespace ctxplan {

struct LoraProjection {
  std::string name;  // "self_attn.q_proj", "mlp.down_proj", ...
  int64_t out_offset = 0, out = 0, in = 0;
  std::vector<float> a;  // [r][in]
  std::vector<float> b;  // [out][r]
};

// The fused linears that carry adapters, in the order every visit goes through them.
inline constexpr std::array<OpPart, 4> kLoraParts = {OpPart::kQkv, OpPart::kO, OpPart::kGateUp,
                                                     OpPart::kDown};

// The adapters of rank `rank` (0: none) on fused linear `part`, as the cost model counts them:
// Q, K, V on qkv, gate and up on gate_up, one projection on o and down.
inline LoraAdapters LoraOn(OpPart part, int64_t rank) {
  return {rank, part == OpPart::kQkv ? 3 : part == OpPart::kGateUp ? 2 : 1};
}

// One layer's adapters, by fused linear: the host's (LoraProjection) or a backend's own.
template <typename Projection>
struct LoraParts {
  std::vector<Projection> qkv, o, gate_up, down;  // the projections of each fused linear

  std::vector<Projection>& Part(OpPart part) {
    return const_cast<std::vector<Projection>&>(std::as_const(*this).Part(part));
  }
  const std::vector<Projection>& Part(OpPart part) const {
    switch (part) {
      case OpPart::kQkv:
        return qkv;
      case OpPart::kO:
        return o;
      case OpPart::kGateUp:
        return gate_up;
      case OpPart::kDown:
        return down;
      default:
        throw InternalError("LoRA: no adapters on part " + std::string(OpPartName(part)));
    }
  }
};
using LayerLora = LoraParts<LoraProjection>;

struct LoraWeights {
  int64_t rank = 0;
  float scale = 1.0f;  // alpha / rank, with alpha = rank
  std::vector<LayerLora> layers;

  // Every adapter tensor in a fixed order, named as PEFT names them
  // ("model.layers.3.self_attn.q_proj.lora_A.weight").
  void ForEach(const std::function<void(const std::string&, std::vector<float>&)>& visit);
  // The same with each tensor's shape: A [r][in], B [out][r].
  void ForEachShaped(const std::function<void(const std::string&, const std::array<int64_t, 2>&,
                                              std::vector<float>&)>& visit);
  int64_t ParameterCount() const;
};

// Adapters of rank `rank` for `model`, all zero (gradients and moments start so).
LoraWeights ZeroLora(const ModelSpec& model, int64_t rank);
// A ~ N(0, 1 / in) from `seed`; B zero, or also N(0, 0.02) with `random_b` (tests: a non-trivial
// adapter from the first step).
LoraWeights RandomLora(const ModelSpec& model, int64_t rank, uint64_t seed, bool random_b = false);

// W + scale * B A for every projection, in place on a copy of the base weights' tensors: the
// merged model computes what base + adapters compute. `weight_of(part, layer)` gives the fused
// weight [fused out][in] of a part.
void MergeLora(const LoraWeights& lora,
               const std::function<std::vector<float>&(OpPart, size_t)>& weight_of);

namespace lora_cpu {
// y [t][y_stride] += scale * (x A^T) B^T on each projection's columns; x [t][in].
void Forward(const std::vector<LoraProjection>& part, float scale, const float* x, int64_t t,
             float* y, int64_t y_stride);
// With du = scale * dy[:, seg] B [t][r]: dx [t][in] += du A (when dx is non-null); and, when
// `grads` is non-null (same projections), dA += du^T x and dB += scale * dy[:, seg]^T (x A^T).
void Backward(const std::vector<LoraProjection>& part, float scale, const float* x, const float* dy,
              int64_t dy_stride, int64_t t, float* dx, std::vector<LoraProjection>* grads);
}  // namespace lora_cpu

}  // namespace ctxplan
