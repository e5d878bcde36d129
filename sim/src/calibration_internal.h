// What the fit's groups share (calibration.cpp, calibration_attention.cpp): picking samples,
// implying a parameter from them, scoring a trial profile, grid searches, and the context each
// group's fit works in. Private to sim/src.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/sim/calibration.h"

namespace ctxplan::sim::detail {

// Rows of the samples that `keep` accepts.
std::vector<const CalibrationSample*> Select(
    const CalibrationSamples& samples, const std::function<bool(const CalibrationSample&)>& keep);

void Require(const std::vector<const CalibrationSample*>& rows, std::string_view what);

using Setter = std::function<void(KernelProfile&, double)>;

// The value of one profile parameter at which the model reproduces each sample, by bisection on
// a log scale between lo and hi (the model's time falls as the parameter, a rate or a fraction,
// rises); the median over the samples, robust to the odd slow repetition or off-model shape.
double ImpliedMedian(const GpuSpec& gpu, const KernelProfile& base, const Setter& set,
                     const std::vector<const CalibrationSample*>& rows, double lo, double hi);

// How badly a profile explains samples: the median and a quarter of the worst |log error|.
double Score(const GpuSpec& gpu, const KernelProfile& k,
             const std::vector<const CalibrationSample*>& rows);

// 0, step, 2 step, ... up to max: the values a grid search tries (exact multiples, no drift).
std::vector<double> Grid(double max, double step);

// The best of a grid search's trials.
struct Candidate {
  KernelProfile profile;
  double score = -1;
  void Consider(const KernelProfile& trial, double trial_score) {
    if (score < 0 || trial_score < score) {
      profile = trial;
      score = trial_score;
    }
  }
};

// What each group of the fit works on: the samples (compute-bound seconds at the maximum clock),
// the spec being fitted and its kernel profile (gpu.kernels), fitted group by group in place.
struct FitContext {
  const CalibrationSamples& samples;
  GpuSpec& gpu;
  KernelProfile& k;
  std::string where;  // " on <gpu>, driver ..., <date>, ctxplan-measure at <commit>"

  // A spec value the samples measured, its note saying what and where.
  void Measured(SpecValue& v, double value, const std::string& what) const;
};

// Attention's item costs, rates per head dim and page tables (calibration_attention.cpp).
void FitAttention(const FitContext& c);

}  // namespace ctxplan::sim::detail
