// The shape of a decoder-only transformer of the Qwen2 / Llama family, with Hugging Face
// config.json field names, and the sizes the planner derives from it.
#pragma once

#include <cstdint>
#include <string>

namespace ctxplan {

struct ModelSpec {
  std::string name;         // catalogue name ("qwen2.5-7b") or the file it came from
  std::string source_path;  // file the spec was loaded from ("<embedded>/llm/qwen2.5-7b.yaml")
  std::string model_type;   // Hugging Face model_type: "qwen2", "llama" or "mistral"
  std::string hf_repo;      // Hugging Face repository the shape came from; empty when unknown

  int64_t hidden_size = 0;          // d
  int64_t intermediate_size = 0;    // I (SwiGLU width)
  int64_t num_hidden_layers = 0;    // L
  int64_t num_attention_heads = 0;  // H_q
  int64_t num_key_value_heads = 0;  // H_kv (GQA)
  int64_t head_dim = 0;             // d_h; hidden_size / num_attention_heads when absent
  int64_t vocab_size = 0;           // V
  int64_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // Q/K/V projections carry a bias (Qwen2)
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;

  // --- derived sizes (elements, not bytes) ---
  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  int64_t gqa_group() const { return num_attention_heads / num_key_value_heads; }

  // Parameters of one decoder layer: Q/K/V/O, gate/up/down, two RMSNorm weights, Q/K/V biases.
  int64_t layer_params() const;
  // Weights that are matrix-multiplied in the layers (no norms, biases or embeddings).
  int64_t layer_matmul_params() const;
  int64_t embedding_params() const { return vocab_size * hidden_size; }
  int64_t lm_head_params() const { return tie_word_embeddings ? 0 : vocab_size * hidden_size; }
  // All parameters: embeddings, layers, final norm, LM head (when not tied).
  int64_t total_params() const;
  // Matmul parameters per token of forward work: layers plus the LM head (tied or not).
  int64_t matmul_params() const;

  // Bytes of post-RoPE K and V of one token over all layers, stored in bf16.
  int64_t kv_bytes_per_token() const { return 2 * num_hidden_layers * kv_dim() * 2; }
};

}  // namespace ctxplan
