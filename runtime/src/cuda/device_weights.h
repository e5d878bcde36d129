// The model's tensors on the device, in the arena, shaped and ordered as the host's ModelWeights;
// and a LoRA projection's adapter, gradients and moments.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <string>
#include <vector>

#include "ctxplan/runtime/plan/model_weights.h"
#include "device_buffers.h"

namespace ctxplan::gpu {

template <typename T>
struct DeviceLayer {
  DeviceArray<T> attn_norm, qkv, qkv_bias, o, mlp_norm, gate_up, down;
};

template <typename T>
struct DeviceWeights {
  DeviceArray<T> embedding;
  std::vector<DeviceLayer<T>> layers;
  DeviceArray<T> final_norm, lm_head;

  // The same tensors, in the same order, as ModelWeights::ForEach.
  template <typename F>
  void ForEach(F visit) {
    visit(embedding);
    for (DeviceLayer<T>& l : layers) {
      visit(l.attn_norm);
      visit(l.qkv);
      if (l.qkv_bias.size() > 0) visit(l.qkv_bias);
      visit(l.o);
      visit(l.mlp_norm);
      visit(l.gate_up);
      visit(l.down);
    }
    visit(final_norm);
    if (lm_head.size() > 0) visit(lm_head);
  }
};

// Asks for device tensors shaped like `host`'s, all in one category (so that, e.g., all gradients
// are one contiguous region that one memset clears).
template <typename T>
void WantLike(ArenaPlan& arena, DeviceWeights<T>& d, const ModelWeights& host, MemCategory category,
              const char* name) {
  d.layers.resize(host.layers.size());
  arena.Want(d.embedding, host.embedding.size(), category, name);
  for (size_t i = 0; i < host.layers.size(); ++i) {
    const LayerWeights& h = host.layers[i];
    DeviceLayer<T>& l = d.layers[i];
    arena.Want(l.attn_norm, h.attn_norm.size(), category, name);
    arena.Want(l.qkv, h.qkv.size(), category, name);
    arena.Want(l.qkv_bias, h.qkv_bias.size(), category, name);
    arena.Want(l.o, h.o.size(), category, name);
    arena.Want(l.mlp_norm, h.mlp_norm.size(), category, name);
    arena.Want(l.gate_up, h.gate_up.size(), category, name);
    arena.Want(l.down, h.down.size(), category, name);
  }
  arena.Want(d.final_norm, host.final_norm.size(), category, name);
  arena.Want(d.lm_head, host.lm_head.size(), category, name);
}

inline std::vector<std::vector<float>*> HostTensors(ModelWeights& w) {
  std::vector<std::vector<float>*> all;
  w.ForEach([&](const std::string&, std::vector<float>& t) { all.push_back(&t); });
  return all;
}

// One projection's LoRA adapter on the device (lora.h): A [r][in], B [out][r] bf16, trained.
template <typename G>
struct DeviceLoraProjection {
  int64_t out_offset = 0, out = 0, in = 0;
  DeviceArray<__nv_bfloat16> a, b;        // kWeights
  DeviceArray<G> grad_a, grad_b;          // kGrads
  DeviceArray<float> m_a, v_a, m_b, v_b;  // kOptimizer (AdamW on the GPU)
};

}  // namespace ctxplan::gpu
