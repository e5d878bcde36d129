// The pipeline schedule of a step over several GPUs (DESIGN.md, "Ranks").
#pragma once

#include <cstdint>
#include <vector>

#include "ctxplan/runtime/plan/plan_geometry.h"

namespace ctxplan {

// The order in which the pipeline stages run their share of a step, as one sequence of
// (stage, item) that respects every dependency between stages: the plan emits its ops in it, and
// the analytic path times it. Each stage's own order is the fill's chunks ascending, then pass
// 2's chunks descending as "one forward, one backward" (1F1B): stage r first recomputes
// stages - 1 - r chunks ahead (its warm-up), so that while later stages run chunk i's recompute,
// loss and backward it recomputes chunk i-1 instead of waiting; the last stage alternates. The
// bubble is (stages - 1) chunks of one stage's work at either end of a pass. With one stage it
// is the one-GPU order: fill, then per chunk its recompute and backward.
enum class PipelineItemKind : uint8_t { kFill, kRecompute, kBackward };
struct PipelineItem {
  int32_t stage = 0;
  PipelineItemKind kind = PipelineItemKind::kFill;
  int32_t chunk = 0;
};

class PipelineSchedule {
 public:
  explicit PipelineSchedule(const PlanGeometry& geometry);
  // The next item, or false once every stage has run all of its items. Stages take turns, one
  // item a turn when it is ready: its input has crossed the boundary (the neighbour ran the
  // chunk's item) and its send buffers are free (at most two sends ahead of the neighbour).
  bool Next(PipelineItem& item);
  // Stage r's chunks in flight in pass 2 beyond the one in its backward (its warm-up).
  static int32_t WarmUp(const PlanGeometry& geometry, int32_t stage);

 private:
  bool Ready(const PipelineItem& item) const;

  const PlanGeometry& g_;
  std::vector<std::vector<PipelineItem>> items_;  // [stage] in its order
  std::vector<size_t> cursor_;                    // [stage]
  std::vector<int32_t> filled_;                   // [stage] fill chunks run (they run ascending)
  std::vector<int32_t> recomputed_;               // [stage] lowest chunk recomputed (descending)
  std::vector<int32_t> backward_;                 // [stage] lowest chunk through its backward
  std::vector<int64_t> forward_items_, backward_items_;  // [stage] run so far: sends, receives
  size_t remaining_ = 0;
  int32_t turn_ = 0;         // the stage whose turn it is
  bool progressed_ = false;  // in this round of turns
};

}  // namespace ctxplan
