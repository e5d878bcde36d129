// One interface for every backend that executes the step plan: the runtime pulls the plan's ops
// in order and hands each to the backend, which does what the op says on real buffers. The CPU
// backend (tests, CI) runs them one after another; the CUDA backend enqueues them on streams.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/runtime/plan/page_reads.h"
#include "ctxplan/runtime/plan/step_plan.h"

namespace ctxplan {

// The run itself went wrong (a NaN loss, a diverging step): not the user's input, not our bug.
// The message names the step or chunk; the caller stops and leaves any checkpoint as it was.
class TrainingError : public std::runtime_error {
 public:
  explicit TrainingError(const std::string& message) : std::runtime_error(message) {}
};

struct StepInputs {
  std::span<const int32_t> tokens;  // [n]
  std::span<const int32_t> labels;  // [n]: target of each position, -1 = no loss there
};

struct StepOutputs {
  double loss_sum = 0.0;         // summed cross-entropy over labelled positions
  int64_t labelled = 0;          // positions with a label
  uint64_t ops_executed = 0;     // kernels and copies
  int64_t peak_arena_bytes = 0;  // GPU arena allocated at the peak (as the plan's ops say)
  int64_t peak_host_bytes = 0;   // pinned host memory at the peak
  // Page-sparse layers: the union of the chunk's query tiles' selections, as drawn (CUDA backend;
  // the fill's and the recompute's, which the backward reuses). Traces record them.
  struct PageUnion {
    Phase phase;
    int32_t chunk, layer;
    int64_t pages;
  };
  std::vector<PageUnion> page_unions;
  // How often each page of each layer was attended (page_reads.h): the GPU tier's evidence.
  PageReads page_reads;
  double mean_loss() const { return labelled > 0 ? loss_sum / static_cast<double>(labelled) : 0; }
};

// The plan's own memory accounting: what its alloc and free ops say each space holds, and the
// peak. Backends report it; tracers write it next to what they measure.
class PlanMemoryTally {
 public:
  // Applies a kAlloc / kFree op (others are ignored) and returns its space's new total.
  int64_t Apply(const Op& op) {
    if (!IsMemory(op.kind)) return total(op.space);
    const size_t s = op.space == MemSpace::kGpu ? 0 : 1;
    total_[s] += op.kind == OpKind::kAlloc ? op.bytes : -op.bytes;
    peak_[s] = std::max(peak_[s], total_[s]);
    return total_[s];
  }
  int64_t total(MemSpace space) const { return total_[space == MemSpace::kGpu ? 0 : 1]; }
  int64_t peak(MemSpace space) const { return peak_[space == MemSpace::kGpu ? 0 : 1]; }

 private:
  int64_t total_[2] = {0, 0};
  int64_t peak_[2] = {0, 0};
};

class StepBackend {
 public:
  virtual ~StepBackend() = default;
  virtual void BeginStep(const StepPlan& plan, const StepInputs& inputs) = 0;
  virtual void Execute(const Op& op) = 0;
  virtual StepOutputs EndStep() = 0;
};

// Observes execution (tracing, progress). Called before and after each op the backend executes.
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  virtual void BeforeOp(const Op& /*op*/) {}
  virtual void AfterOp(const Op& /*op*/) {}
};

// Runs one step: every op of the plan, in plan order, on the backend. The inputs are checked
// here, once for every backend: one token and one label per position, ids in the vocabulary.
StepOutputs RunStep(const StepPlan& plan, const StepInputs& inputs, StepBackend& backend,
                    StepObserver* observer = nullptr);

}  // namespace ctxplan
