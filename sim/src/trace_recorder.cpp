#include "ctxplan/sim/trace_recorder.h"

#include "ctxplan/runtime/plan/op_record.h"

namespace ctxplan::sim {

namespace {
int64_t Nanoseconds(Tick ticks) {
  return (ticks + kTicksPerNanosecond / 2) / kTicksPerNanosecond;
}
}  // namespace

void TraceRecorder::OnOpComplete(const Op& op, Tick start, Tick end) {
  writer_.Op(TraceRecordOf(op, Nanoseconds(start), Nanoseconds(end)));
}

void TraceRecorder::OnMemory(MemSpace space, int /*where*/, Tick when,
                             const MemoryTracker& memory) {
  MemoryRecord r;
  r.time_ns = Nanoseconds(when);
  r.space = static_cast<uint8_t>(space);
  r.space_total_bytes = memory.total();
  writer_.Memory(r);
}

}  // namespace ctxplan::sim
