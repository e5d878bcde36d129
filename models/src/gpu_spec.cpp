#include "ctxplan/models/gpu_spec.h"

#include <cmath>

#include "ctxplan/models/units.h"

namespace ctxplan {

const char* ProvenanceName(Provenance provenance) {
  switch (provenance) {
    case Provenance::kDatasheet:
      return "datasheet";
    case Provenance::kMeasured:
      return "measured";
    case Provenance::kEstimate:
      return "estimate";
  }
  return "unknown";
}

int64_t GpuSpec::memory_bytes() const {
  return static_cast<int64_t>(std::llround(memory_gib.value * static_cast<double>(kGiB)));
}

}  // namespace ctxplan
