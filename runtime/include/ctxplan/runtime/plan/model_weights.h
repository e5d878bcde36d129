// The parameters of a Qwen2 / Llama model in fp32 on the host, in Hugging Face layouts, and
// their gradients (the same structure). The CPU backend trains these directly; the CUDA backend
// converts them to bf16 on the device.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ctxplan/models/model_spec.h"

namespace ctxplan {

struct LayerWeights {
  std::vector<float> attn_norm;  // [d]
  std::vector<float> qkv;        // [q_dim + 2 kv_dim][d]: Q rows, then K rows, then V rows
  std::vector<float> qkv_bias;   // [q_dim + 2 kv_dim], empty without attention bias
  std::vector<float> o;          // [d][q_dim]
  std::vector<float> mlp_norm;   // [d]
  std::vector<float> gate_up;    // [2 I][d]: gate rows, then up rows
  std::vector<float> down;       // [d][I]
};

struct ModelWeights {
  std::vector<float> embedding;  // [V][d]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [d]
  std::vector<float> lm_head;     // [V][d]; empty when tied to the embedding

  // Calls `visit(name, tensor)` for every parameter tensor, in a fixed order, with Hugging Face
  // names ("model.layers.3.self_attn.q_proj.weight" for the Q rows of qkv, etc. — fused tensors
  // are visited whole under their own name: "model.layers.3.self_attn.qkv_proj.weight").
  void ForEach(const std::function<void(const std::string&, std::vector<float>&)>& visit);
  // ForEach's order over every tensor `model` has, those held empty here too (another pipeline
  // stage's): a tensor's index in it is the same for the whole model and for any stage. ForEach
  // skips an empty bias or LM head, which shifts the indices of a stage-shaped object.
  void ForEachOfModel(const ModelSpec& model,
                      const std::function<void(const std::string&, std::vector<float>&)>& visit);
  int64_t ParameterCount() const;
};

// Every tensor sized for `model` and filled with zeros (gradients start so). With `stages` > 1,
// only the tensors pipeline stage `stage` holds, the others empty (KeepStageTensors' shape).
ModelWeights ZeroWeights(const ModelSpec& model, int32_t stage = 0, int32_t stages = 1);
// Random initialisation from a seed: matrices N(0, 0.02), norms 1, biases N(0, 0.02). With
// `stages` > 1 only stage `stage`'s tensors, with the values they have in the whole model's: a
// rank of several GPUs initialises (and holds on the host) its own quarter of a 7B model, not all
// of it.
ModelWeights RandomWeights(const ModelSpec& model, uint64_t seed, int32_t stage = 0,
                           int32_t stages = 1);

// Empties every tensor pipeline stage `stage` of `stages` does not hold (its shape stays the
// model's): the layers of the other stages (PipelineStageFirstLayers' split), the embedding but
// on the first stage and, with a tied LM head, on the last (its copy is the head), the final norm
// and the LM head but on the last. A stage's GPU, and its checkpoint, keep only their own tensors.
void KeepStageTensors(ModelWeights& weights, const ModelSpec& model, int32_t stage, int32_t stages);

}  // namespace ctxplan
