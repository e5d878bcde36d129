// Earlier calibrations of the committed GPU profiles (models/gpu/history/), so that a recorded run
// is judged by the profile of the kernels it ran. A kernel change makes a GPU's next calibration
// describe new kernels (sim/kernel_changes.h); the runs recorded before it stay evidence for the
// planner with the calibration of their day, kept in the history folder when the profile is
// replaced, instead of being left out of the matrix until every one is recorded again.
#pragma once

#include <algorithm>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/sim/kernel_changes.h"
#include "ctxplan/sim/kernel_time_model.h"

namespace ctxplan::test {

// The committed history folder.
inline std::filesystem::path GpuHistoryFolder() {
  return std::filesystem::path(CTXPLAN_SOURCE_DIR) / "models" / "gpu" / "history";
}

// The profiles in `folder` (each a models/gpu/ file) whose `name` is `gpu_name`, newest
// calibration first. None when the folder does not exist.
inline std::vector<GpuSpec> GpuHistory(const std::filesystem::path& folder,
                                       std::string_view gpu_name) {
  std::vector<GpuSpec> out;
  std::error_code ec;
  if (!std::filesystem::is_directory(folder, ec)) return out;
  for (const auto& entry : std::filesystem::directory_iterator(folder)) {
    if (entry.path().extension() != ".yaml") continue;
    GpuSpec gpu = LoadGpu(entry.path().string());
    if (gpu.name == gpu_name) out.push_back(std::move(gpu));
  }
  std::sort(out.begin(), out.end(),
            [](const GpuSpec& a, const GpuSpec& b) { return a.kernels.date > b.kernels.date; });
  return out;
}

// `gpu` if its profile describes the kernels of a run recorded on `run_date` with pages of
// `page_tokens` at `head_dim`; else the newest calibration in `folder` that does, whole (its
// measured host rates too); for a profile scaled from a calibrated sibling, `gpu` with the
// sibling's earlier calibration scaled the same way. nullopt if none does.
inline std::optional<GpuSpec> ProfileOfRun(
    const GpuSpec& gpu, std::string_view run_date, int64_t page_tokens, int64_t head_dim,
    const std::filesystem::path& folder = GpuHistoryFolder()) {
  if (!sim::RunAndProfileKernelsDiffer(sim::EffectiveKernelProfile(gpu), run_date, page_tokens,
                                       head_dim))
    return gpu;
  const bool scaled = gpu.kernels.provenance == Provenance::kEstimate &&
                      !gpu.kernels.derived_from.empty() && !gpu.kernels.empty();
  for (const GpuSpec& earlier : GpuHistory(folder, scaled ? gpu.kernels.derived_from : gpu.name)) {
    GpuSpec candidate = scaled ? gpu : earlier;
    if (scaled) candidate.kernels = ScaleKernelProfile(earlier, gpu);
    if (!sim::RunAndProfileKernelsDiffer(candidate.kernels, run_date, page_tokens, head_dim))
      return candidate;
  }
  return std::nullopt;
}

}  // namespace ctxplan::test
