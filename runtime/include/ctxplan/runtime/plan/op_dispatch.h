// The plan's compute ops, kind by kind, to the backend method that runs each. Both backends that
// interpret the plan (the CPU reference and CUDA) implement this one method set, so an op kind is
// mapped here once and a backend that lacks a method does not compile. Also the indexing of the
// per-layer state both backends keep between the passes of a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/runtime/plan/plan_geometry.h"

namespace ctxplan {

// Runs compute op `op` (not a kAlloc / kFree) on `backend`. Backend::kName names it in errors.
template <typename Backend>
void DispatchComputeOp(Backend& backend, const Op& op) {
  switch (op.kind) {
    case OpKind::kEmbeddingForward:
      return backend.EmbeddingForward(op);
    case OpKind::kEmbeddingBackward:
      return backend.EmbeddingBackward(op);
    case OpKind::kRmsNormForward:
      return backend.NormForward(op);
    case OpKind::kRmsNormBackward:
      return backend.NormBackward(op);
    case OpKind::kLinearForward:
      return backend.LinearForward(op);
    case OpKind::kLinearBackwardInput:
      return backend.LinearBackward(op, /*input=*/true);
    case OpKind::kLinearBackwardWeight:
      return backend.LinearBackward(op, /*input=*/false);
    case OpKind::kRopeForward:
      return backend.RopeForward(op);
    case OpKind::kRopeBackward:
      return backend.RopeBackward(op);
    case OpKind::kKvWrite:
      return backend.KvWrite(op);
    case OpKind::kPageSummary:
      return backend.PageSummary(op);
    case OpKind::kPageScore:
      return backend.PageScore(op);
    case OpKind::kPageTopK:
      return backend.PageTopK(op);
    case OpKind::kAttentionForward:
      return backend.AttentionForward(op);
    case OpKind::kAttentionBackward:
      return backend.AttentionBackward(op);
    case OpKind::kDkvAccumulate:
      return backend.DkvAccumulate(op);
    case OpKind::kSwigluForward:
      return backend.SwigluForward(op);
    case OpKind::kSwigluBackward:
      return backend.SwigluBackward(op);
    case OpKind::kLossForwardBackward:
      return backend.Loss(op);
    case OpKind::kZeroFill:
      return backend.ZeroFill(op);
    case OpKind::kAdamW:
      return backend.OptimizerStep(op);
    case OpKind::kCopyH2D:
      return backend.CopyIn(op);
    case OpKind::kCopyD2H:
      return backend.CopyOut(op);
    case OpKind::kBoundaryPack:
      return backend.BoundaryPack(op);
    case OpKind::kBoundaryUnpack:
      return backend.BoundaryUnpack(op);
    case OpKind::kPeerSend:
      return backend.PeerSend(op);
    case OpKind::kPeerRecv:
      return backend.PeerRecv(op);
    default:
      break;
  }
  throw InternalError(std::string(Backend::kName) + ": unexpected op " +
                      std::string(OpKindName(op.kind)));
}

// Where the layer state that the backward pass reads back (layer input, attention output, LSE,
// page selection) lives: one slot per layer, or per chunk and layer when the fill keeps every
// chunk's inputs (--keep-layer-inputs).
// With pipeline stages a stage recomputes chunks ahead of its backward
// (PlanGeometry::chunks_in_flight): one slot per layer and chunk in flight, by chunk modulo.
inline size_t SavedLayerSlot(const Op& op, const PlanGeometry& g) {
  const int64_t layers = g.num_layers();
  if (g.options().keep_layer_inputs) return static_cast<size_t>(op.chunk * layers + op.layer);
  return static_cast<size_t>((op.chunk % g.chunks_in_flight(op.rank)) * layers + op.layer);
}
// The slots SavedLayerSlot indexes for `stage`'s ops (the first stage's cover every stage's).
inline size_t SavedLayerSlots(const PlanGeometry& g, int32_t stage = 0) {
  return static_cast<size_t>(g.num_layers() * (g.options().keep_layer_inputs
                                                   ? g.num_chunks()
                                                   : g.chunks_in_flight(stage)));
}

// Whether `op`'s pass writes that state: the recompute always, the fill when it keeps inputs.
inline bool SavesLayerState(const Op& op, bool keep_layer_inputs) {
  return op.phase == Phase::kRecompute || (op.phase == Phase::kFill && keep_layer_inputs);
}

// The backends compute a layer's attention over its own positions and its earlier pages in one
// call, at the layer's last attention op: the paged one, or the own one of a chunk without
// earlier pages.
inline bool IsLastAttentionOp(const Op& op, const ChunkGeometry& chunk) {
  return op.part == OpPart::kPaged || chunk.earlier_pages == 0;
}

}  // namespace ctxplan
