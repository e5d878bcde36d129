// `ctxplan calibrate`: measure this GPU's kernels (ctxplan-measure, the CUDA build's program
// beside ctxplan) or read samples measured before, fit the kernel-time model, and write a GPU
// profile in the models/gpu/ format.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace ctxplan::cli {

struct CalibrateFlags {
  std::string samples;       // fit these samples instead of measuring
  std::string keep_samples;  // where to keep the samples measured
  std::string gpu;           // the catalogue entry of this GPU (datasheet values); default: by name
  std::string output;        // the GPU profile YAML
  std::string history;       // where the profile `output` replaces goes (models/gpu/history/)
  std::string report;        // every sample against the fitted model, as CSV
  bool quick = false;
};

CLI::App* AddCalibrateCommand(CLI::App& app, CalibrateFlags& flags);
int RunCalibrate(const CalibrateFlags& flags, const char* argv0);

}  // namespace ctxplan::cli
