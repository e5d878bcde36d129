// Replay: a recorded step (measured by ctxtrain, or predicted by ctxplan) against the planner's
// prediction of the same plan, op by op. Both carry the plan's op ids, so every measured op has
// exactly one predicted twin.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan::sim {

struct KindComparison {
  OpKind kind = OpKind::kAlloc;
  OpPart part = OpPart::kNone;
  int64_t count = 0;
  double measured_seconds = 0.0;  // summed durations
  double predicted_seconds = 0.0;
};

// One op kind (and part) in one chunk: how its ops compare there (chunk -1: ops of no chunk).
struct ChunkComparison {
  OpKind kind = OpKind::kAlloc;
  OpPart part = OpPart::kNone;
  int32_t chunk = -1;
  int64_t count = 0;
  double measured_seconds = 0.0;  // summed durations
  double predicted_seconds = 0.0;
};

// One copy kind in one phase (fill, recompute, backward): where PCIe time goes, with the bytes
// the plan moves there (the trace records no bytes; its copies' busy time is ctxtrain's to print).
struct PhaseComparison {
  OpKind kind = OpKind::kCopyH2D;
  Phase phase = Phase::kSetup;
  int64_t count = 0;
  double measured_seconds = 0.0;  // summed durations
  double predicted_seconds = 0.0;
  double predicted_bytes = 0.0;
};

struct OpComparison {
  OpRecord measured;
  double measured_seconds = 0.0;
  double predicted_seconds = 0.0;
};

// The page-sparse layers' unions of their query tiles' selections, as the trace recorded them
// (traces from 2026-11-25 on) against the plan's expected union, which times the copies.
struct UnionComparison {
  int64_t layers = 0;                    // sparse (phase, chunk, layer) records
  double measured_pages = 0;             // their unions, summed
  double predicted_pages = 0;            // the plan's expected unions of the same chunks, summed
  double independent_tiles = 0;          // the median record's union as a fraction of tiles drawing
                                         // independently would make it (1: independent draws)
  double planned_independent_tiles = 0;  // the same for the plan's expected unions
};

// Where the compute stream stood idle between its ops (gaps in the union of their spans), each
// gap charged to the op that ended it (its phase and kind) and the op whose end began it: what the
// stream waited on, in the trace and in the plan's simulated step alike.
struct IdleComparison {
  Phase phase = Phase::kSetup;     // of the op the stream waited to run
  OpKind before = OpKind::kAlloc;  // the op that ran last before the gap
  OpKind after = OpKind::kAlloc;   // the op that ended it
  int64_t measured_count = 0, predicted_count = 0;
  double measured_seconds = 0.0, predicted_seconds = 0.0;
};

struct ReplayResult {
  double measured_step_seconds = 0.0;  // first start to last end in the trace
  double predicted_step_seconds = 0.0;
  int64_t measured_gpu_peak = 0;  // from the trace's memory records (0 if none)
  int64_t measured_host_peak = 0;
  int64_t predicted_gpu_peak = 0;
  int64_t predicted_host_peak = 0;
  uint64_t plan_ops = 0;                  // kernels and copies in the plan
  uint64_t traced_ops = 0;                // of which the trace holds this many
  int32_t rank = -1;                      // the GPU of a pipelined run the trace is of; -1: all
  std::vector<KindComparison> by_kind;    // sorted by measured time, largest first
  std::vector<ChunkComparison> by_chunk;  // every kind, part and chunk, in that order
  std::vector<PhaseComparison> copies_by_phase;  // host copies by kind, then phase
  std::vector<OpComparison> worst;               // largest |measured - predicted|, at most 10
  UnionComparison unions;                        // empty (layers 0) when the trace has none
  // The compute stream's idle time, of one GPU (a rank's trace, or a run of one GPU; else 0), and
  // its largest gaps by measured time, at most 8.
  double measured_compute_idle_seconds = 0.0;
  double predicted_compute_idle_seconds = 0.0;
  std::vector<IdleComparison> compute_idle;
};

// The machine a replay predicts for, and where it came from: the report says both, since a step
// predicted for another GPU than the one it was planned for compares nothing.
struct ReplayMachine {
  MachineSpec machine;
  std::string origin;  // "from the trace", or "default h200-125g: <why>"
};

// The machine the trace's run was planned for, rebuilt from its metadata: plan_machine (a catalogue
// preset, or a machine YAML that still reads) or plan_gpu (a catalogue GPU or GPU YAML) with
// plan_host_ram_bytes, as ctxtrain writes them; else a ctxplan prediction's `machine` when it names
// a preset. A trace naming no machine (recorded before these keys), or one whose machine cannot be
// rebuilt here (its YAML gone or unreadable), gets h200-125g, the origin saying why. Malformed
// keys throw InputError naming `trace_name`.
ReplayMachine MachineOfTrace(const TraceMetadata& metadata, const std::string& trace_name);

// Throws InputError when the trace does not follow this plan (an op id the plan lacks, or whose
// kind or stream differ: a trace from another plan version or other options).
ReplayResult Replay(const OpTrace& trace, const StepPlan& plan, const KernelTimeModel& time_model,
                    const std::string& trace_name);

// The trace's page unions chunk by chunk, each the mean over the layers of the fill pass's union
// records (the recompute reselects the same pages), for FitUnionDrawScale: only the chunks `g`
// plans page-sparse, sinks taken off.
std::vector<UnionSample> MeasuredUnionSamples(const OpTrace& trace, const PlanGeometry& g);
// The same, planned from the trace's own options (its metadata) for `model`; a trace whose
// options do not read or do not suit the model throws InputError naming `trace_name`.
std::vector<UnionSample> MeasuredUnionSamples(const OpTrace& trace, const ModelSpec& model,
                                              const std::string& trace_name);

}  // namespace ctxplan::sim
