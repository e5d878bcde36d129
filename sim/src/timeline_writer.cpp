#include "ctxplan/sim/timeline_writer.h"

namespace ctxplan::sim {

TimelineWriter::TimelineWriter(ChromeTraceWriter& writer) : writer_(writer) {
  Pid(0);
}

int64_t TimelineWriter::Pid(int rank) {
  const int64_t pid = kPid + rank;
  if (static_cast<size_t>(rank) >= named_.size()) named_.resize(static_cast<size_t>(rank) + 1);
  if (named_[static_cast<size_t>(rank)]) return pid;
  named_[static_cast<size_t>(rank)] = true;
  writer_.SetProcessName(pid, rank == 0 ? std::string("ctxplan simulated step")
                                        : "ctxplan simulated step, GPU " + std::to_string(rank));
  for (int s = 0; s < kStreamCount; ++s)
    writer_.SetThreadName(pid, s, StreamName(static_cast<Stream>(s)), s);
  return pid;
}

void TimelineWriter::OnOpComplete(const Op& op, Tick start, Tick end) {
  name_.assign(OpKindName(op.kind));
  if (op.part != OpPart::kNone) {
    name_ += '.';
    name_ += OpPartName(op.part);
  }
  writer_.Complete(Pid(op.rank), static_cast<int64_t>(op.stream), name_, PhaseName(op.phase),
                   TicksToMicroseconds(start), TicksToMicroseconds(end - start),
                   {{"op_id", static_cast<int64_t>(op.id)},
                    {"chunk", op.chunk},
                    {"layer", op.layer},
                    {"gflop", op.cost.flops / 1e9},
                    {"mbytes", op.cost.bytes / 1e6}});
}

void TimelineWriter::OnMemory(MemSpace space, int where, Tick when, const MemoryTracker& memory) {
  const double gib = static_cast<double>(memory.total()) / 1073741824.0;
  // GPU memory under its GPU; every machine's host memory under the first GPU, by machine.
  if (space == MemSpace::kGpu) {
    writer_.Counter(Pid(where), "GPU memory (GiB)", TicksToMicroseconds(when),
                    {{"allocated", gib}});
    return;
  }
  writer_.Counter(kPid,
                  where == 0 ? std::string("pinned host memory (GiB)")
                             : "pinned host memory (GiB), machine " + std::to_string(where),
                  TicksToMicroseconds(when), {{"allocated", gib}});
}

}  // namespace ctxplan::sim
