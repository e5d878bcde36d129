// The step plan: the ordered stream of operations of one chunk-recurrent training step
// (DESIGN.md, "The training method"). The runtime executes it, the simulator models it, and a
// trace carries its op ids; there is only one plan, so prediction and execution cannot drift.
//
// Streams and their waits (each stream is in order, like a CUDA stream):
//   compute — every kernel; its paged-attention ops wait for the H2D copy of their pages.
//   h2d     — pages into GPU slots: the union of the layer's selected KV pages (and in the
//             backward the dKV pages that already exist, plus the chunk's own dKV); waits for
//             the selection (sparse fill/recompute) and for its slot buffer to be released.
//             Dense attention and the backward (whose selections were kept by the recompute)
//             prefetch one layer ahead.
//   d2h     — the chunk's fresh KV pages (fill) and the accumulated dKV pages (backward) home.
//   host    — the optimizer step when it runs on the CPU.
// Slot buffers alternate between two layers, so a copy can run while the previous layer computes.
//
// The plan is a coroutine: Ops() yields op after op, and nothing is materialised.
#pragma once

#include <cstdint>
#include <vector>

#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/generator.h"
#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/runtime/plan/pipeline_schedule.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/runtime/plan/run_options.h"

namespace ctxplan {

class StepPlan {
 public:
  // Bumped whenever the op stream of a given (model, options) changes: traces record it, and
  // replay refuses to compare op ids across versions.
  static constexpr int kVersion = 3;
  // No op depends on one more than this many ops before it, so a consumer can keep a bounded
  // window of completion times.
  static constexpr OpId kMaxDependencyDistance = 16384;

  // Throws InputError if the options are invalid for the model.
  StepPlan(const ModelSpec& model, const RunOptions& options);

  const PlanGeometry& geometry() const { return geometry_; }
  const ModelSpec& model() const { return geometry_.model(); }
  const RunOptions& options() const { return geometry_.options(); }

  // The ops of one step in emission order (a topological order: dependencies come first).
  Generator<Op> Ops() const;

 private:
  PlanGeometry geometry_;
};

}  // namespace ctxplan
