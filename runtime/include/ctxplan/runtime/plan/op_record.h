// A plan op as the compact trace records it (traces/op_trace.h), for the tracers that write one:
// the CPU backend's wall clock, the simulator's recorder. Header-only: the plan library itself does
// not link the trace library.
#pragma once

#include <cstdint>

#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan {

inline OpRecord TraceRecordOf(const Op& op, int64_t start_ns, int64_t end_ns) {
  OpRecord r;
  r.op_id = op.id;
  r.start_ns = start_ns;
  r.end_ns = end_ns;
  r.kind = static_cast<uint8_t>(op.kind);
  r.stream = static_cast<uint8_t>(op.stream);
  r.phase = static_cast<uint8_t>(op.phase);
  r.part = static_cast<uint8_t>(op.part);
  r.chunk = op.chunk;
  r.layer = op.layer;
  return r;
}

}  // namespace ctxplan
