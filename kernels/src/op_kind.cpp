#include "ctxplan/kernels/op_kind.h"

#include <array>

namespace ctxplan {

namespace {
constexpr std::array<std::string_view, kOpKindCount> kOpKindNames = {
    "embedding_fwd", "embedding_bwd",    "rmsnorm_fwd",       "rmsnorm_bwd",
    "linear_fwd",    "linear_bwd_input", "linear_bwd_weight", "rope_fwd",
    "rope_bwd",      "kv_write",         "page_summary",      "page_score",
    "page_topk",     "attention_fwd",    "attention_bwd",     "dkv_accumulate",
    "swiglu_fwd",    "swiglu_bwd",       "loss_fwd_bwd",      "zero_fill",
    "adamw",         "copy_h2d",         "copy_d2h",          "alloc",
    "free",          "boundary_pack",    "boundary_unpack",   "peer_send",
    "peer_recv"};
}  // namespace

std::string_view OpKindName(OpKind kind) {
  return kOpKindNames.at(static_cast<size_t>(kind));
}

bool IsCopy(OpKind kind) {
  return kind == OpKind::kCopyH2D || kind == OpKind::kCopyD2H;
}
bool IsMemory(OpKind kind) {
  return kind == OpKind::kAlloc || kind == OpKind::kFree;
}
bool IsPeer(OpKind kind) {
  return kind == OpKind::kPeerSend || kind == OpKind::kPeerRecv;
}
bool IsCompute(OpKind kind) {
  return !IsCopy(kind) && !IsMemory(kind) && !IsPeer(kind) && kind != OpKind::kCount_;
}

}  // namespace ctxplan
