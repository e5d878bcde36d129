// What ctxtrain watches a step with (runtime/plan/step_backend.h's StepObserver): a progress
// line on stderr, the CUPTI tracer's op brackets, and two observers at once.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/runtime/plan/step_backend.h"
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
#include "ctxplan/runtime/cuda/cupti_tracer.h"
#endif

namespace ctxplan::train {

// A progress line on stderr while a step runs: step, pass, chunk, tokens/s (when a terminal).
class Progress final : public StepObserver {
 public:
  // `shown`: false on the ranks of several GPUs that do not report.
  Progress(int64_t steps, int32_t chunks, int64_t tokens, bool shown = true)
      : steps_(steps),
        chunks_(chunks),
        tokens_(tokens),
        enabled_(shown && isatty(STDERR_FILENO) == 1) {}
  void StartStep(int64_t step) {
    step_ = step;
    start_ = std::chrono::steady_clock::now();
  }
  void BeforeOp(const Op& op) override {
    if (!enabled_ || op.chunk < 0 || (op.chunk == chunk_ && op.phase == phase_)) return;
    chunk_ = op.chunk;
    phase_ = op.phase;
    std::fprintf(stderr, "\r  step %lld/%lld  %-9s chunk %d/%d   ",
                 static_cast<long long>(step_ + 1), static_cast<long long>(steps_),
                 std::string(PhaseName(op.phase)).c_str(), chunk_ + 1, chunks_);
    std::fflush(stderr);
  }
  void EndStep(double loss, double seconds) {
    if (!enabled_) return;
    std::fprintf(stderr, "\r  step %lld/%lld  loss %.4f  %.0f tokens/s              \n",
                 static_cast<long long>(step_ + 1), static_cast<long long>(steps_), loss,
                 static_cast<double>(tokens_) / seconds);
  }

 private:
  int64_t steps_;
  int32_t chunks_;
  int64_t tokens_;
  bool enabled_;
  int64_t step_ = 0;
  int32_t chunk_ = -1;
  Phase phase_ = Phase::kSetup;
  std::chrono::steady_clock::time_point start_;
};

// Both of two observers (either may be null), in order.
class BothObservers final : public StepObserver {
 public:
  BothObservers(StepObserver* a, StepObserver* b) : a_(a), b_(b) {}
  void BeforeOp(const Op& op) override {
    if (a_) a_->BeforeOp(op);
    if (b_) b_->BeforeOp(op);
  }
  void AfterOp(const Op& op) override {
    if (a_) a_->AfterOp(op);
    if (b_) b_->AfterOp(op);
  }

 private:
  StepObserver* a_;
  StepObserver* b_;
};

#ifdef CTXPLAN_HAVE_CUDA_BACKEND
// Brackets each op of this process's rank for CUPTI (so its GPU work maps to its plan id) and
// hands the rank's memory events to the tracer, which writes them on its clock. The other ranks'
// ops run in their own processes, and their traces.
class CuptiStepObserver final : public StepObserver {
 public:
  CuptiStepObserver(gpu::CuptiTracer& tracer, int32_t rank) : tracer_(tracer), rank_(rank) {}
  void BeforeOp(const Op& op) override {
    if (op.rank == rank_) tracer_.PushOp(op);
  }
  void AfterOp(const Op& op) override {
    if (op.rank != rank_) return;
    tracer_.PopOp();
    if (!IsMemory(op.kind)) return;
    tracer_.OnMemoryEvent(op.space, op.category, memory_.Apply(op));
  }

 private:
  gpu::CuptiTracer& tracer_;
  int32_t rank_;
  PlanMemoryTally memory_;
};
#endif

}  // namespace ctxplan::train
