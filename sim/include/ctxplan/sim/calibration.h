// `ctxplan calibrate`, the CPU half: raw microbenchmark samples (written by ctxplan-measure on
// the GPU, sim/calibrate/) -> the kernel-time model's parameters (KernelProfile) and the GPU
// profile YAML that `--gpu` / `--machine` take. Each parameter is fitted on the samples of the
// kernels it governs, by medians (robust to the odd slow repetition), never on end-to-end runs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "ctxplan/models/gpu_spec.h"

namespace ctxplan::sim {

// One row of the samples CSV (sim/calibrate/measure_main.cpp documents the fields per op).
struct CalibrationSample {
  std::string op;
  int64_t m = 0, n = 0, k = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t page_tokens = 0, pages = 0, pages_per_tile = 0;
  int64_t grad_bytes = 0;
  double bytes = 0, flops = 0;
  int64_t copies = 0;
  double seconds = 0;
  double sm_clock_mhz = 0;  // NVML's SM clock while it was timed (0: not recorded)
  double watts = 0;         // board power while it was timed (0: not recorded)
};

struct CalibrationSamples {
  std::map<std::string, std::string> header;  // "# key: value" lines: gpu_name, driver, date, ...
  std::vector<CalibrationSample> rows;
};

class KernelTimeModel;

// The time `model` gives one sample's kernel (or launch), as calibrate judges its fit: the ops the
// sample's kernel runs, as the runtime's plan costs them (an attention chunk's own positions and
// earlier pages, one launch; a random page selection's expected union), summed.
double PredictedSeconds(const KernelTimeModel& model, const CalibrationSample& s);

// Reads a samples CSV; a malformed file throws InputError naming the file, line and field.
CalibrationSamples ReadCalibrationSamples(const std::filesystem::path& path);

// One sample against the fitted model's time for it.
struct SampleFit {
  CalibrationSample sample;  // its `seconds` measured (the sustained group: scaled to max clock)
  double predicted_seconds = 0;
};

// How well the fitted model reproduces the samples of one group of ops.
struct FitResidual {
  std::string group;  // "gemm", "attention_fwd", "memory", "copy", ...
  int samples = 0;
  double median_error = 0;  // |predicted / measured - 1|
  double max_error = 0;
  std::string worst;            // the worst sample, described
  std::vector<SampleFit> each;  // every sample of the group, in the file's order
};

// The residuals as CSV (`ctxplan calibrate --report`): a row a sample, its group, shape,
// measured and predicted seconds and their ratio.
void WriteFitReport(std::ostream& out, const std::vector<FitResidual>& residuals);

struct CalibrationFit {
  GpuSpec gpu;  // `base` with the measured spec values and the measured kernel profile
  std::vector<FitResidual> residuals;
  // The exponent of a GEMM's power against clock its duty-cycled power rows imply (0: none);
  // reported beside the model's kPowerExponent (clock_model.h), not used by it.
  double duty_cycle_power_exponent = 0;
};

// Fits `base` (the catalogue entry of the same GPU, for its datasheet values) to the samples.
// Throws InputError when a group the profile needs has no usable samples.
CalibrationFit FitCalibration(const CalibrationSamples& samples, const GpuSpec& base,
                              const std::string& samples_name);

// The GPU profile as YAML in the models/gpu/ format.
std::string GpuProfileYaml(const GpuSpec& gpu);

// What the host's PCIe gave all its GPUs copying one way at once (ctxplan-measure's links rows
// with the most GPUs), summed over them: a machine .yaml's host_links_h2d_gbs and
// host_links_d2h_gbs. gpus 0: the samples hold no such rows (one GPU, or the group not run).
struct HostLinkSums {
  int gpus = 0;
  double h2d_gbs = 0, d2h_gbs = 0;
};
HostLinkSums FitHostLinkSums(const CalibrationSamples& samples);

// A page-sparse layer's selection read-back on this host (ctxplan-measure's readback rows):
// seconds = fixed + per entry x (tiles x pages a tile) + per page x earlier pages, least squares
// with no negative term (a term that would be negative is dropped and the rest refitted): a
// machine .yaml's selection_read_back_us, _ns_per_entry and _ns_per_page. samples 0: no rows.
struct SelectionReadBackFit {
  int samples = 0;
  double fixed_us = 0, ns_per_entry = 0, ns_per_page = 0;
  double max_error = 0;  // the largest |predicted / measured - 1| over the rows
};
SelectionReadBackFit FitSelectionReadBack(const CalibrationSamples& samples);

}  // namespace ctxplan::sim
