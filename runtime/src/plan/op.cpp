#include "ctxplan/runtime/plan/op.h"

#include <array>

namespace ctxplan {

std::string_view StreamName(Stream stream) {
  static constexpr std::array<std::string_view, kStreamCount> kNames = {
      "compute", "h2d", "d2h", "host", "send_next", "recv_prev", "send_prev", "recv_next"};
  return kNames.at(static_cast<size_t>(stream));
}

std::string_view PhaseName(Phase phase) {
  static constexpr std::array<std::string_view, static_cast<size_t>(Phase::kCount_)> kNames = {
      "setup", "fill", "recompute", "loss", "backward", "optimizer"};
  return kNames.at(static_cast<size_t>(phase));
}

std::string_view OpPartName(OpPart part) {
  static constexpr std::array<std::string_view, static_cast<size_t>(OpPart::kCount_)> kNames = {
      "",    "qkv",   "o",         "gate_up",  "down",      "lm_head",
      "own", "paged", "attn_norm", "mlp_norm", "final_norm"};
  return kNames.at(static_cast<size_t>(part));
}

std::string_view MemCategoryName(MemCategory category) {
  static constexpr std::array<std::string_view, kMemCategoryCount> kNames = {
      "weights",  "grads",     "optimizer",      "layer_inputs", "activations", "page_slots",
      "kv_pages", "dkv_pages", "page_summaries", "workspace",    "grad_staging"};
  return kNames.at(static_cast<size_t>(category));
}

}  // namespace ctxplan
