#include "ctxplan/runtime/plan/pipeline_schedule.h"

#include <algorithm>

#include "ctxplan/models/errors.h"

namespace ctxplan {

int32_t PipelineSchedule::WarmUp(const PlanGeometry& g, int32_t stage) {
  return g.chunks_in_flight(stage) - 1;
}

PipelineSchedule::PipelineSchedule(const PlanGeometry& g)
    : g_(g),
      items_(static_cast<size_t>(g.stages())),
      cursor_(static_cast<size_t>(g.stages()), 0),
      filled_(static_cast<size_t>(g.stages()), 0),
      recomputed_(static_cast<size_t>(g.stages()), g.num_chunks()),
      backward_(static_cast<size_t>(g.stages()), g.num_chunks()),
      forward_items_(static_cast<size_t>(g.stages()), 0),
      backward_items_(static_cast<size_t>(g.stages()), 0) {
  const int32_t chunks = g.num_chunks();
  const bool recompute = !g.options().keep_layer_inputs;
  for (int32_t r = 0; r < g.stages(); ++r) {
    std::vector<PipelineItem>& items = items_[static_cast<size_t>(r)];
    for (int32_t i = 0; i < g.fill_chunks(); ++i) items.push_back({r, PipelineItemKind::kFill, i});
    int32_t next_forward = chunks - 1;
    if (recompute)
      for (int32_t k = 0; k <= WarmUp(g, r); ++k)
        items.push_back({r, PipelineItemKind::kRecompute, next_forward--});
    for (int32_t i = chunks - 1; i >= 0; --i) {
      items.push_back({r, PipelineItemKind::kBackward, i});
      if (recompute && next_forward >= 0)
        items.push_back({r, PipelineItemKind::kRecompute, next_forward--});
    }
    remaining_ += items.size();
  }
}

bool PipelineSchedule::Ready(const PipelineItem& item) const {
  const int32_t r = item.stage;
  const auto s = static_cast<size_t>(r);
  const bool last = r == g_.last_stage();
  if (item.kind != PipelineItemKind::kBackward) {
    if (r > 0) {
      const bool received = item.kind == PipelineItemKind::kFill ? filled_[s - 1] > item.chunk
                                                                 : recomputed_[s - 1] <= item.chunk;
      if (!received) return false;
    }
    return last || forward_items_[s] - forward_items_[s + 1] < 2;
  }
  if (!last && backward_[s + 1] > item.chunk) return false;
  return r == 0 || backward_items_[s] - backward_items_[s - 1] < 2;
}

bool PipelineSchedule::Next(PipelineItem& item) {
  const int32_t stages = g_.stages();
  while (remaining_ > 0) {
    for (; turn_ < stages; ++turn_) {
      const auto s = static_cast<size_t>(turn_);
      if (cursor_[s] == items_[s].size() || !Ready(items_[s][cursor_[s]])) continue;
      item = items_[s][cursor_[s]++];
      --remaining_;
      progressed_ = true;
      switch (item.kind) {
        case PipelineItemKind::kFill:
          filled_[s] = item.chunk + 1;
          ++forward_items_[s];
          break;
        case PipelineItemKind::kRecompute:
          recomputed_[s] = item.chunk;
          ++forward_items_[s];
          break;
        case PipelineItemKind::kBackward:
          backward_[s] = item.chunk;
          ++backward_items_[s];
          break;
      }
      ++turn_;
      return true;
    }
    CTXPLAN_CHECK(progressed_, "the pipeline schedule deadlocked");
    turn_ = 0;
    progressed_ = false;
  }
  return false;
}

}  // namespace ctxplan
