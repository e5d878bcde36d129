// Reading a GPU file's kernel_model (the calibrated kernel-time model), and the limits it shares
// with the rest of the GPU file. Private to ctxplan_models.
#pragma once

#include "ctxplan/models/gpu_spec.h"
#include "yaml_fields.h"

namespace ctxplan::detail {

inline constexpr NumberLimit kDeviceGbsLimit{1e6};
inline constexpr NumberLimit kTflopsLimit{1e6};
inline constexpr NumberLimit kHostGbsLimit{1e5};
inline constexpr NumberLimit kProfileLimit{1e7};
inline constexpr NumberLimit kFixedCostLimit{1e7, true};  // microseconds or nanoseconds, 0 allowed

// The kernel_model mapping of a GPU file. An estimate only names the calibrated sibling it is
// derived from (derived_from); the caller scales that sibling's profile.
KernelProfile ReadKernelProfile(const Fields& f);

}  // namespace ctxplan::detail
