#include "ctxplan/runtime/cpu/wall_clock_tracer.h"

#include "ctxplan/runtime/plan/op_record.h"

namespace ctxplan {

WallClockTracer::WallClockTracer(OpTraceWriter* compact, ChromeTraceWriter* chrome)
    : compact_(compact), chrome_(chrome), origin_(std::chrono::steady_clock::now()) {
  if (chrome_) {
    chrome_->SetProcessName(1, "ctxtrain step");
    for (int s = 0; s < kStreamCount; ++s)
      chrome_->SetThreadName(1, s, StreamName(static_cast<Stream>(s)), s);
  }
}

int64_t WallClockTracer::Now() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() -
                                                              origin_)
      .count();
}

void WallClockTracer::BeforeOp(const Op& /*op*/) {
  started_ns_ = Now();
}

void WallClockTracer::AfterOp(const Op& op) {
  const int64_t end = Now();
  if (IsMemory(op.kind)) {
    const int64_t total = memory_.Apply(op);
    if (compact_)
      compact_->Memory(
          {end, static_cast<uint8_t>(op.space), static_cast<uint8_t>(op.category), total});
    if (chrome_)
      chrome_->Counter(1, op.space == MemSpace::kGpu ? "arena (GiB)" : "pinned host (GiB)",
                       static_cast<double>(end) / 1e3,
                       {{"allocated", static_cast<double>(total) / 1073741824.0}});
    return;
  }
  if (compact_) compact_->Op(TraceRecordOf(op, started_ns_, end));
  if (chrome_) {
    name_.assign(OpKindName(op.kind));
    if (op.part != OpPart::kNone) {
      name_ += '.';
      name_ += OpPartName(op.part);
    }
    chrome_->Complete(
        1, static_cast<int64_t>(op.stream), name_, PhaseName(op.phase),
        static_cast<double>(started_ns_) / 1e3, static_cast<double>(end - started_ns_) / 1e3,
        {{"op_id", static_cast<int64_t>(op.id)}, {"chunk", op.chunk}, {"layer", op.layer}});
  }
}

}  // namespace ctxplan
