// Kernel changes a GPU profile may predate. A profile times the kernels as they were when
// `ctxplan calibrate` ran; where a kernel changed since for the options planned (a page size it
// rewrote), the profile times the earlier kernel and the plan says so, naming the change, until
// the GPU is calibrated again. The matrix (tests/matrix_test.cpp) pairs runs with profiles by
// the same rule.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/gpu_spec.h"

namespace ctxplan::sim {

struct KernelChange {
  std::string_view date;           // YYYY-MM-DDTHH:MMZ (UTC): runs and calibrations from then on
                                   // have it; older records' dates are days (YYYY-MM-DD), earlier
                                   // than any time of that day, as they were before it
  std::string_view what;           // what changed and by how much, for one line of `plan`
  std::vector<int64_t> pages;      // the page sizes whose attention it changed; empty: every one
  std::vector<int64_t> head_dims;  // the head dims it changed; empty: every one
};

// Every change, oldest first. A change within the measurements' run-to-run spread (~3%) is not
// one: the same dQ atomics at head dim 128's page-sparse small pages (1.02-1.03x) are left out.
const std::vector<KernelChange>& KernelChanges();

// The changes that `profile` predates and that touch attention over pages of `page_tokens` at
// `head_dim`: those dated after the calibration the profile holds (its own, or its sibling's for
// a scaled estimate). None for a profile with no calibration date (spec values: no page rates to
// be stale).
std::vector<KernelChange> ChangesAfterProfile(const KernelProfile& profile, int64_t page_tokens,
                                              int64_t head_dim);

// The changes between a run recorded on `run_date` (a day, a minute or a second in UTC, as
// ctxtrain's traces carry it) and `profile`'s calibration, either way round, that touch attention
// over pages of `page_tokens` at `head_dim`: where the run's kernels are not the profile's.
std::vector<KernelChange> ChangesBetween(const KernelProfile& profile, std::string_view run_date,
                                         int64_t page_tokens, int64_t head_dim);

// Whether a run recorded on `run_date` with pages of `page_tokens` at `head_dim` ran a kernel that
// `profile` does not describe (ChangesBetween is not empty).
bool RunAndProfileKernelsDiffer(const KernelProfile& profile, std::string_view run_date,
                                int64_t page_tokens, int64_t head_dim);

}  // namespace ctxplan::sim
