// What ctxtrain reports at the end of a run (the lead rank's), as text for people or as one JSON
// object for scripts: the steps' speed, start-up by phase, memory three ways, the page store, how
// the tiles' selections overlapped, and the GPU's clock under its power limit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ctxplan/runtime/plan/page_reads.h"
#include "ctxplan/sim/measured_pass_clocks.h"
#ifdef CTXPLAN_HAVE_CUDA_BACKEND
#include "ctxplan/runtime/cuda/cupti_tracer.h"
#endif

namespace ctxplan::train {

// Start-up: from the process's start to the first step's, by phase, in seconds. A long run pays
// it once; a short measurement run can be dominated by it, so it is reported apart from the steps.
struct Startup {
  double context = 0;  // creating the CUDA context
  double weights = 0;  // random init or safetensors (or checkpoint) load; on CUDA also the upload
  double arena = 0;    // reserving the device arena
  double pinning = 0;  // pinning the host page stores; setting up the host optimizer's buffers
  double total = 0;    // process start to the first step's start
  double other() const;
};

// A duration as trace metadata and the JSON output write it: microseconds, so that the short
// phases of a small CPU run do not all read 0.
std::string SecondsText(double seconds);

// The fractions of each layer's pages a GPU tier is asked about (RunReport::read_shares).
inline constexpr double kTierFractions[] = {0.1, 0.25, 0.5};

struct RunReport {
  std::string backend, model;
  bool cuda = false;
  int64_t context_tokens = 0, steps = 0;
  double loss = 0, tokens_per_second = 0;
  Startup startup;
  // The steps' own time, start-up excluded: all of them, the first (one-time costs: cuBLASLt
  // plans, first touches) and the mean of those after it (0 with one step).
  double steps_seconds = 0, first_step_seconds = 0, later_step_seconds = 0;
  // Memory three ways. CUDA: what the arena really carved out (allocated, at the peak), its one
  // cudaMalloc (reserved), and the device-level figure nvidia-smi shows (CUDA context, cuBLASLt
  // workspace and all; -1 where not known); pinned host memory as the page stores pinned it.
  // CPU: the plan's own accounting. The plan's figures beside them either way.
  int64_t arena_allocated = 0, arena_reserved = 0, device_used = -1, pinned_host = 0;
  int64_t plan_arena_peak = 0, plan_host_peak = 0;
  // The GPU tier the run kept (the earliest pages of every layer; 0 when off) of the pages a layer.
  int64_t gpu_tier_pages = 0, pages_per_layer = 0;
  // What a GPU tier of each kTierFractions of each layer's pages would keep off PCIe, holding the
  // earliest pages or the most-read ones (page_reads.h); empty where the step read no pages.
  std::vector<PageReadShares> read_shares;
  // The tiles' unions as the planner's union rule's draw scale; 0 where the run says nothing.
  double selection_draw_scale = 0;
  // NVML over the steps tokens/s counts (0: not known), and pass by pass over the traced step.
  double sm_clock_mhz = 0, board_watts = 0;
  sim::MeasuredPassClocks traced_pass_clocks{};
  std::string machine;  // the very GPU and host CPU (CUDA, the text): lent machines differ
};

void PrintRunReportJson(const RunReport& r);
void PrintRunReportText(const RunReport& r);

#ifdef CTXPLAN_HAVE_CUDA_BACKEND
// The traced step's pinned copies, by direction and size: calls, bytes and the copy engine's
// busy time, so a copy op slower than planned shows whether a per-copy cost or a bandwidth lost.
void PrintTracedCopies(const gpu::TraceStepSummary& summary);
#endif

}  // namespace ctxplan::train
