#include "ctxplan/sim/trace_recorder.h"

namespace ctxplan::sim {

namespace {
int64_t Nanoseconds(Tick ticks) {
  return (ticks + kTicksPerNanosecond / 2) / kTicksPerNanosecond;
}
}  // namespace

void TraceRecorder::OnOpComplete(const Op& op, Tick start, Tick end) {
  OpRecord r;
  r.op_id = op.id;
  r.start_ns = Nanoseconds(start);
  r.end_ns = Nanoseconds(end);
  r.kind = static_cast<uint8_t>(op.kind);
  r.stream = static_cast<uint8_t>(op.stream);
  r.phase = static_cast<uint8_t>(op.phase);
  r.part = static_cast<uint8_t>(op.part);
  r.chunk = op.chunk;
  r.layer = op.layer;
  writer_.Op(r);
}

void TraceRecorder::OnMemory(MemSpace space, Tick when, const MemoryTracker& memory) {
  MemoryRecord r;
  r.time_ns = Nanoseconds(when);
  r.space = static_cast<uint8_t>(space);
  r.space_total_bytes = memory.total();
  writer_.Memory(r);
}

}  // namespace ctxplan::sim
