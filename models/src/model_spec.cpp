#include "ctxplan/models/model_spec.h"

namespace ctxplan {

int64_t ModelSpec::layer_matmul_params() const {
  const int64_t attention = hidden_size * q_dim()           // Q
                            + 2 * hidden_size * kv_dim()    // K, V
                            + q_dim() * hidden_size;        // O
  const int64_t mlp = 3 * hidden_size * intermediate_size;  // gate, up, down
  return attention + mlp;
}

int64_t ModelSpec::layer_params() const {
  const int64_t norms = 2 * hidden_size;  // input and post-attention RMSNorm weights
  const int64_t biases = attention_bias ? q_dim() + 2 * kv_dim() : 0;
  return layer_matmul_params() + norms + biases;
}

int64_t ModelSpec::total_params() const {
  const int64_t final_norm = hidden_size;
  return embedding_params() + num_hidden_layers * layer_params() + final_norm + lm_head_params();
}

int64_t ModelSpec::matmul_params() const {
  // A tied LM head still costs a vocab x hidden matmul per token: count it either way.
  return num_hidden_layers * layer_matmul_params() + vocab_size * hidden_size;
}

}  // namespace ctxplan
