#include "calibrate_command.h"

#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/sim/calibration.h"
#include "ctxplan/sim/clock_model.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan::cli {

namespace {

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// The catalogue entry of the GPU the samples were measured on, by the name CUDA reports.
std::string CatalogueNameFor(const std::string& gpu_name) {
  const std::string n = Lower(gpu_name);
  if (n.find("gh200") != std::string::npos) return "gh200";
  if (n.find("h200") != std::string::npos) return "h200";
  if (n.find("h100") != std::string::npos)
    return n.find("pcie") != std::string::npos ? "h100-pcie" : "h100-sxm";
  throw InputError("calibrate: the samples were measured on " + gpu_name +
                   ", which no catalogue GPU matches; name its entry with --gpu (a catalogue "
                   "GPU or a GPU .yaml holding its datasheet values)");
}

// ctxplan-measure sits beside ctxplan in a CUDA build.
std::filesystem::path MeasureProgram(const char* argv0) {
  std::error_code error;
  std::filesystem::path self = std::filesystem::canonical("/proc/self/exe", error);
  if (error) self = argv0;
  const std::filesystem::path beside = self.parent_path() / "ctxplan-measure";
  if (std::filesystem::exists(beside)) return beside;
  throw InputError(
      "calibrate: measuring needs ctxplan-measure beside ctxplan (" + beside.string() +
      "), built only with CUDA (-DCTXPLAN_CUDA=ON) and run on the GPU to calibrate; or fit "
      "samples measured before with --samples FILE");
}

std::string Percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f%%", 100.0 * fraction);
  return text;
}

// The calibrated profile at `output`, about to be replaced, copied into `folder` as
// NAME-DATE.yaml (the date without its colon), unless the same file is already there. Nothing to
// keep when `output` does not exist yet; an InputError when it holds no calibration of its own or
// another file has its name there. `check_only`: those checks alone, before measuring.
void KeepReplacedProfile(const std::string& output, const std::string& folder,
                         bool check_only = false) {
  std::error_code ec;
  if (!std::filesystem::exists(output, ec)) return;
  const std::string text = ReadTextFile(output);
  const GpuSpec old = ParseGpuYaml(text, output);
  if (old.kernels.provenance != Provenance::kMeasured || old.kernels.date.empty())
    throw InputError("calibrate --history: " + output +
                     " holds no calibration of its own (datasheet values or an estimate); "
                     "accepted: a profile ctxplan calibrate wrote");
  std::string date = old.kernels.date;
  date.erase(std::remove(date.begin(), date.end(), ':'), date.end());
  const std::filesystem::path kept =
      std::filesystem::path(folder) / (old.name + "-" + date + ".yaml");
  if (std::filesystem::exists(kept, ec)) {
    if (ReadTextFile(kept.string()) == text) return;
    throw InputError("calibrate --history: " + kept.string() + " exists and differs from " +
                     output + "; accepted: a folder without another profile of that name and date");
  }
  if (check_only) return;
  std::filesystem::create_directories(folder, ec);
  AtomicFileWriter copy{kept};
  copy.stream() << text;
  copy.Commit();
  std::cout << "kept the replaced profile (calibrated " << old.kernels.date << ") as "
            << kept.string() << "\n";
}

}  // namespace

CLI::App* AddCalibrateCommand(CLI::App& app, CalibrateFlags& f) {
  CLI::App* cmd = app.add_subcommand(
      "calibrate", "measure this GPU's kernels and write its profile (models/gpu/ format)");
  cmd->add_option("--output,-o", f.output, "the GPU profile .yaml to write")->required();
  cmd->add_option("--samples", f.samples,
                  "fit these ctxplan-measure samples (CSV) instead of measuring now");
  cmd->add_option("--keep-samples", f.keep_samples,
                  "keep the samples measured here in this CSV (default: beside --output)");
  cmd->add_option("--gpu", f.gpu,
                  "the catalogue entry (or .yaml) with this GPU's datasheet values "
                  "(default: matched by the name CUDA reports)");
  cmd->add_option("--history", f.history,
                  "keep the calibrated profile --output replaces in this folder, as "
                  "NAME-DATE.yaml (models/gpu/history/: the recorded runs of its kernels stay "
                  "judged by it)");
  cmd->add_option("--report", f.report,
                  "also write every sample against the fitted model's time for it as CSV (group, "
                  "shape, measured and predicted seconds): which shapes the profile explains "
                  "badly");
  cmd->add_flag("--quick", f.quick, "a smaller grid (under a minute; a rougher profile)");
  return cmd;
}

int RunCalibrate(const CalibrateFlags& f, const char* argv0) {
  if (!f.history.empty()) KeepReplacedProfile(f.output, f.history, /*check_only=*/true);
  std::optional<AtomicFileWriter> report;  // opened first: a bad path measures and writes nothing
  if (!f.report.empty()) report.emplace(std::filesystem::path(f.report));
  std::filesystem::path samples_path = f.samples;
  if (samples_path.empty()) {
    samples_path = f.keep_samples.empty()
                       ? std::filesystem::path(f.output).replace_extension(".samples.csv")
                       : std::filesystem::path(f.keep_samples);
    const std::filesystem::path program = MeasureProgram(argv0);
    std::string command = "'" + program.string() + "' --output '" + samples_path.string() + "'";
    if (f.quick) command += " --quick";
    std::cerr << "calibrate: measuring (" << command << ")\n";
    const int status = std::system(command.c_str());
    if (status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::cerr << "ctxplan: calibrate: ctxplan-measure failed (status " << status
                << "); no profile written\n";
      return WIFEXITED(status) && WEXITSTATUS(status) == 2 ? 2 : 1;
    }
  }
  const sim::CalibrationSamples samples = sim::ReadCalibrationSamples(samples_path);
  const auto name = samples.header.find("gpu_name");
  const std::string gpu_name = name == samples.header.end() ? "an unnamed GPU" : name->second;
  // A host of several GPUs: what its PCIe gave them together, for its machine .yaml.
  const sim::HostLinkSums links = sim::FitHostLinkSums(samples);
  if (links.gpus > 1)
    std::printf(
        "host links: %d GPUs copying at once moved %.1f GB/s up and %.1f down together; a machine "
        ".yaml of this host takes them as host_links_h2d_gbs: %.1f and host_links_d2h_gbs: %.1f\n",
        links.gpus, links.h2d_gbs, links.d2h_gbs, links.h2d_gbs, links.d2h_gbs);
  // The host's selection read-back after each page top-k, for its machine .yaml.
  const sim::SelectionReadBackFit read_back = sim::FitSelectionReadBack(samples);
  if (read_back.samples > 0)
    std::printf(
        "selection read-back: %d samples, %.1f us + %.2f ns an entry + %.3f ns an earlier page "
        "(within %.0f%%); a machine .yaml of this host takes them as selection_read_back_us: "
        "%.1f, selection_read_back_ns_per_entry: %.2f and selection_read_back_ns_per_page: "
        "%.3f\n",
        read_back.samples, read_back.fixed_us, read_back.ns_per_entry, read_back.ns_per_page,
        read_back.max_error * 100.0, read_back.fixed_us, read_back.ns_per_entry,
        read_back.ns_per_page);
  if (std::all_of(samples.rows.begin(), samples.rows.end(), [](const sim::CalibrationSample& s) {
        return s.op.starts_with("links_") || s.op == "selection_read_back";
      }))
    throw InputError("calibrate: " + samples_path.string() +
                     " holds the links and readback groups alone (a machine's keys, above); a GPU "
                     "profile needs ctxplan-measure's other groups: run it without --only");
  const GpuSpec base = LoadGpu(f.gpu.empty() ? CatalogueNameFor(gpu_name) : f.gpu);
  const sim::CalibrationFit fit =
      sim::FitCalibration(samples, base, samples_path.filename().string());

  if (!f.history.empty()) KeepReplacedProfile(f.output, f.history);
  AtomicFileWriter out{std::filesystem::path(f.output)};
  out.stream() << sim::GpuProfileYaml(fit.gpu);
  out.Commit();
  // The written profile must load as any catalogue entry does.
  (void)LoadGpu(f.output);

  if (report) {
    sim::WriteFitReport(report->stream(), fit.residuals);
    report->Commit();
  }
  std::cout << "calibrated " << fit.gpu.name << " from " << samples.rows.size()
            << " samples measured on " << gpu_name << " -> " << f.output << "\n";
  std::cout << "model against its samples (|predicted / measured - 1|):\n";
  for (const sim::FitResidual& r : fit.residuals) {
    std::printf("  %-14s %4d samples  median %6s  max %6s  (%s)\n", r.group.c_str(), r.samples,
                Percent(r.median_error).c_str(), Percent(r.max_error).c_str(), r.worst.c_str());
  }
  if (fit.duty_cycle_power_exponent > 0)
    std::printf(
        "power: the duty-cycled GEMM's draw goes as clock^%.2f (the clock model uses %.1f, chosen "
        "on the matrix's calibration runs: clock_model.h)\n",
        fit.duty_cycle_power_exponent, sim::kPowerExponent);
  return 0;
}

}  // namespace ctxplan::cli
