// The CUPTI activity tracer of the CUDA runtime: what each plan op really did on the GPU, on one
// clock with the CPU side and the runtime's memory events.
//
// How it works (the design of pytorch/kineto's libkineto, reduced to what ctxtrain needs):
// - Activity kinds enabled: CONCURRENT_KERNEL (kernels, without serialising them), MEMCPY, MEMSET,
//   RUNTIME (CPU-side runtime API calls), EXTERNAL_CORRELATION, MEMORY2 (driver-level
//   allocations), DRIVER with every entry point but the launch, memcpy and memset ones switched
//   off, and INTERNAL_LAUNCH_API: kernels that libraries launch through the driver API (cuBLASLt's
//   GEMMs: cuLaunchKernelEx, no runtime call) are correlated too, at one record per launch.
//   Noisy runtime calls (cudaGetLastError, cudaPeekAtLastError, cudaGetDevice) are not recorded.
// - Buffers: CUPTI asks for activity buffers through a request callback and hands them back full
//   through a completion callback (cuptiActivityRegisterCallbacks). They come from a process-wide
//   pool of 8-byte-aligned 4 MiB buffers, reused; at most max_buffers_in_flight are outstanding at
//   once (beyond that CUPTI drops records, which are counted and reported). Each completed buffer
//   is parsed at once into compact records and returned to the pool.
// - External correlation: PushOp(id) / PopOp() around an op's launches push the plan op id with
//   cuptiActivityPushExternalCorrelationId(CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0); CUPTI then
//   emits, for every API call it records in between (runtime or driver alike), a record mapping the
//   call's correlation id to the op id, and the kernel / memcpy / memset the call started carries
//   that correlation id. So every GPU activity maps to the plan op that launched it, provided the
//   API call that launched it is recorded: a launch whose call is not is "unattributed".
//   Records are matched at EndStep, once all of the step's buffers are in, whatever buffer each
//   record arrived in.
// - One clock: CUPTI's timestamps (cuptiGetTimestamp for the CPU side: the clock of the activity
//   records). Times are written in ns from the trace origin, the first BeginStep(): in a one-step
//   trace that is the step's start; later steps follow on the same timeline.
// - EndStep() synchronises the device, flushes CUPTI (cuptiActivityFlushAll, forced), and resolves:
//   per plan op, start = min start and end = max end of its GPU activities; an op that launched
//   nothing (an alloc, a host-side op) gets the CPU span of its PushOp..PopOp. The op records go,
//   sorted by op id, to the OpTraceWriter (compact trace), and with the memory events to the
//   ChromeTraceWriter: one track per plan stream (pid 1, as WallClockTracer writes it), one per
//   CUDA stream (pid 2: kernels, copies, memsets), one per CPU thread (pid 3: runtime and driver
//   API calls), counters of arena and pinned bytes (pid 1) and driver allocations (pid 2).
//
// Tracing off costs nothing: a disabled tracer makes no CUPTI (or CUDA) call at all, and PushOp,
// PopOp and OnMemoryEvent are inline tests of one bool.
//
// Only one tracer may be enabled at a time in a process (CUPTI's callbacks are process-wide).
// PushOp/PopOp/BeginStep/EndStep are for the runtime's one host thread.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ctxplan/runtime/cuda/memory_events.h"
#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/runtime/plan/step_backend.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan::gpu {

struct CuptiTracerOptions {
  bool enabled = false;
  // Activity buffers CUPTI may hold at once (4 MiB each). Records are parsed as each buffer
  // completes, so a handful suffices; more only absorb bursts.
  int max_buffers_in_flight = 64;
  // Driver API records for launch/memcpy/memset entry points: needed to correlate work that
  // libraries launch through the driver API (every cuBLASLt GEMM), at one extra record per launch.
  // Off: those kernels are counted as unattributed and their ops timed on the CPU.
  bool correlate_driver_api = true;
};

// The step's copies between pinned host and device memory in one direction: what the copy
// engine did, apart from the ops' spans, to tell a per-copy cost from a bandwidth (a copy op's
// span also holds the gaps between its copies).
struct TracedCopies {
  static constexpr std::array<uint64_t, 5> kBucketMaxBytes = {
      uint64_t{64} << 10, uint64_t{256} << 10, uint64_t{1} << 20, uint64_t{4} << 20, UINT64_MAX};
  struct Bucket {
    uint64_t calls = 0, bytes = 0;
    int64_t busy_ns = 0;  // sum of the copies' durations
  };
  Bucket all;
  std::array<Bucket, kBucketMaxBytes.size()>
      by_size;            // by_size[i]: kBucketMaxBytes[i-1] < bytes <= kBucketMaxBytes[i]
  int64_t active_ns = 0;  // time at least one copy of this direction runs
};

// The copy ops of one direction and phase: their spans against the busy time of the copies and
// memsets in them (the rest of a span is the copy engine waiting: for the host to issue the next
// copy, or behind a memset that waits for SMs).
struct TracedCopyOps {
  uint64_t ops = 0, memsets = 0;
  int64_t span_ns = 0, memcpy_ns = 0, memset_ns = 0;
};

struct TraceStepSummary {
  std::vector<OpRecord> ops;                       // one per op pushed in the step, sorted by op id
  uint64_t kernels = 0, memcpys = 0, memsets = 0;  // GPU activities received
  uint64_t api_calls = 0;                          // runtime + driver API records
  uint64_t driver_api_calls = 0;                   // of which driver API (and internal launch)
  uint64_t external_correlations = 0;
  uint64_t driver_memory_events = 0;  // MEMORY2 records
  uint64_t memory_events = 0;         // the runtime's own (OnMemoryEvent)
  // GPU activities mapped to no pushed op: launched outside any PushOp..PopOp, or by an API call
  // CUPTI did not record (an op none of whose work is attributed is timed on the CPU: ~0). The
  // kernels among them by name (distinct, the first 16), to tell which launch path was missed.
  uint64_t unattributed = 0;
  std::vector<std::string> unattributed_kernels;
  uint64_t untimed = 0;  // GPU activities CUPTI could not time (start = end = 0)
  uint64_t dropped_records = 0;
  bool driver_memory_traced = false;  // MEMORY2 could be enabled (not on every virtualised GPU)
  int64_t step_start_ns = 0, step_end_ns = 0;  // from the trace origin
  TracedCopies h2d, d2h;                       // memcpy HtoD / DtoH of the step
  int64_t duplex_ns = 0;                       // time copies of both directions run at once
  // [0]: copy_h2d ops, [1]: copy_d2h ops; by Phase.
  std::array<std::array<TracedCopyOps, static_cast<size_t>(Phase::kCount_)>, 2> copy_ops{};
};

class CuptiTracer final : public MemoryEventListener {
 public:
  // Enabled: registers the buffer callbacks and enables the activity kinds (CuptiError if CUPTI
  // refuses, InternalError if another tracer is enabled). Disabled: does nothing at all.
  explicit CuptiTracer(const CuptiTracerOptions& options);
  ~CuptiTracer() override;
  CuptiTracer(const CuptiTracer&) = delete;
  CuptiTracer& operator=(const CuptiTracer&) = delete;

  bool enabled() const { return enabled_; }

  // Where EndStep writes (not owned; either may be null; they must outlive the tracer's use).
  // The caller writes the metadata and calls Finish().
  void SetOutputs(OpTraceWriter* compact, ChromeTraceWriter* chrome);

  void BeginStep() {
    if (enabled_) BeginStepImpl();
  }
  // Around the launches of one plan op. Nesting is allowed (the innermost op wins).
  void PushOp(OpId id) {
    if (enabled_) PushOpImpl(id, nullptr);
  }
  void PushOp(const Op& op) {
    if (enabled_) PushOpImpl(op.id, &op);
  }
  void PopOp() {
    if (enabled_) PopOpImpl();
  }
  // The runtime's own allocators report here (DeviceArena / PinnedPageStore SetListener).
  void OnMemoryEvent(MemSpace space, MemCategory category, int64_t space_total_bytes) override {
    if (enabled_) MemoryEventImpl(space, category, space_total_bytes);
  }
  // Synchronises the device, flushes CUPTI, writes the step's records to the outputs and
  // returns them. Disabled: returns an empty summary without any CUDA or CUPTI call.
  TraceStepSummary EndStep();

  // CUPTI's clock now, in ns from the trace origin (0 before the first BeginStep; enabled only).
  int64_t NowNs() const;

  // Trace metadata of this machine: GPU name, driver, CUDA runtime and CUPTI versions (a few CUDA
  // and CUPTI queries: call it only when tracing).
  static TraceMetadata DeviceMetadata();

  class Impl;  // opaque: keeps cupti.h out of this header

 private:
  void BeginStepImpl();
  void PushOpImpl(OpId id, const Op* op);
  void PopOpImpl();
  void MemoryEventImpl(MemSpace space, MemCategory category, int64_t total);

  bool enabled_ = false;
  std::unique_ptr<Impl> impl_;
};

// Brackets each op the backend executes with PushOp/PopOp (for RunStep's observer argument).
class CuptiOpObserver final : public StepObserver {
 public:
  explicit CuptiOpObserver(CuptiTracer& tracer) : tracer_(tracer) {}
  void BeforeOp(const Op& op) override { tracer_.PushOp(op); }
  void AfterOp(const Op& /*op*/) override { tracer_.PopOp(); }

 private:
  CuptiTracer& tracer_;
};

}  // namespace ctxplan::gpu
