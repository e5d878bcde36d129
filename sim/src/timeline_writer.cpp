#include "ctxplan/sim/timeline_writer.h"

namespace ctxplan::sim {

TimelineWriter::TimelineWriter(ChromeTraceWriter& writer) : writer_(writer) {
  writer_.SetProcessName(kPid, "ctxplan simulated step");
  for (int s = 0; s < kStreamCount; ++s)
    writer_.SetThreadName(kPid, s, StreamName(static_cast<Stream>(s)), s);
}

void TimelineWriter::OnOpComplete(const Op& op, Tick start, Tick end) {
  name_.assign(OpKindName(op.kind));
  if (op.part != OpPart::kNone) {
    name_ += '.';
    name_ += OpPartName(op.part);
  }
  writer_.Complete(kPid, static_cast<int64_t>(op.stream), name_, PhaseName(op.phase),
                   TicksToMicroseconds(start), TicksToMicroseconds(end - start),
                   {{"op_id", static_cast<int64_t>(op.id)},
                    {"chunk", op.chunk},
                    {"layer", op.layer},
                    {"gflop", op.cost.flops / 1e9},
                    {"mbytes", op.cost.bytes / 1e6}});
}

void TimelineWriter::OnMemory(MemSpace space, Tick when, const MemoryTracker& memory) {
  const double gib = static_cast<double>(memory.total()) / 1073741824.0;
  writer_.Counter(kPid, space == MemSpace::kGpu ? "GPU memory (GiB)" : "pinned host memory (GiB)",
                  TicksToMicroseconds(when), {{"allocated", gib}});
}

}  // namespace ctxplan::sim
