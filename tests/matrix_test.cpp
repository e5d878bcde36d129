// The planner against the validation matrix (traces/recorded/matrix.csv): ctxtrain runs on the
// H200 and the H100 over chunk, page, budget, offload, layer inputs, optimizer, LoRA, three
// models and contexts 8K-256K. The runs were split BEFORE any fitting by the rule below; the
// kernel-time model's parameters come from microbenchmarks (models/gpu/*.yaml, `ctxplan
// calibrate`), not from these runs. Both sets' errors are printed, with whether issue 11's
// acceptance is met (validation step time median <= 3%, max <= 8%; device memory median <= 1%,
// max <= 2%; pinned host max <= 1%; every op kind of a replayed trace within 15%).
//
// Step times are at the SM clock the step holds under the board's power limit
// (sim/include/ctxplan/sim/clock_model.h), whose exponent was chosen on the calibration runs.
//
// The assertions are the planner's accuracy today, so that no change makes it worse unnoticed:
// where they are looser than the acceptance, the acceptance is not met yet (the test prints
// "NOT MET" and the issue stays open). Tighten them as the model improves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/kernel_changes.h"
#include "ctxplan/sim/plan_report.h"
#include "ctxplan/sim/replay.h"
#include "ctxplan/traces/op_trace.h"
#include "support/csv.h"
#include "support/process.h"
#include "support/profile_history.h"

namespace ctxplan {
namespace {

const std::string kDir = std::string(CTXPLAN_SOURCE_DIR) + "/traces/recorded/";

// The selection model a run of `model` is planned with: the union rule at the draw scale fitted
// on the model's selection traces (traces/recorded/selection/<model>-*.ctxtrace: runs recorded
// for that, in no set of the matrix), else at the rule's default scale, which the calibration
// runs' traces were fitted for.
SelectionModel MeasuredSelection(const std::string& model) {
  static std::map<std::string, SelectionModel> fitted;
  if (const auto it = fitted.find(model); it != fitted.end()) return it->second;
  const ModelSpec spec = LoadModel(model);
  std::vector<UnionSample> samples;
  for (const auto& entry : std::filesystem::directory_iterator(kDir + "selection")) {
    const std::string name = entry.path().filename().string();
    if (entry.path().extension() != ".ctxtrace" || name.rfind(model + "-", 0) != 0) continue;
    const std::vector<UnionSample> s =
        sim::MeasuredUnionSamples(ReadOpTrace(entry.path()), spec, name);
    samples.insert(samples.end(), s.begin(), s.end());
  }
  SelectionModel selection;
  if (!samples.empty()) selection.draw_scale = FitUnionDrawScale(samples);
  return fitted[model] = selection;
}

struct MatrixRun {
  std::string machine, model, trace, line;
  std::string date;  // recorded, YYYY-MM-DD
  RunOptions options;
  double tokens_per_second = 0, arena_gib = 0, device_gib = 0, host_gib = 0, startup_s = 0;
  double sm_clock_mhz = 0;  // measured (NVML), 0 where not recorded
  // The run's host AdamW rate, measured by ctxplan-measure in the same session (0: not
  // measured). Recorded, not used: on the H200 host of 2026-11-25 it predicted the AdamW-on-host
  // rows within 2.4% (2.17 Gparam/s against the profile's 1.86: +12% otherwise), but on that
  // day's H100 host it read 1.46 Gparam/s where the step ran as the profile's 2.10 predicts
  // (-6.5%; with 1.46, +22.7%): 256M parameters timed once are not the run's 7.6B.
  double host_adamw_gparams = 0;
  bool validation = false;
};

// The split, written down before the runs were fitted or judged (traces/recorded/README.md):
// every run on the H100, every run of Llama-3.1-8B or (from 2026-11-29, before its first run)
// Llama-2-7B, and every run with page 96 or 192 or chunk 3072 or 6144 is validation; the rest is
// calibration.
bool IsValidation(const MatrixRun& r) {
  const RunOptions& o = r.options;
  return r.machine.rfind("h100", 0) == 0 || r.model == "llama-3.1-8b" || r.model == "llama-2-7b" ||
         o.page_tokens == 96 || o.page_tokens == 192 || o.chunk_tokens == 3072 ||
         o.chunk_tokens == 6144;
}

std::vector<MatrixRun> ReadMatrix(const std::string& file = "matrix.csv") {
  std::vector<MatrixRun> runs;
  for (const std::vector<std::string>& f : test::ReadCsvRows(kDir + file)) {
    const std::string line = test::CsvLine(f);
    EXPECT_EQ(f.size(), 26u) << line;
    if (f.size() != 26) continue;
    MatrixRun r;
    r.line = line;
    r.machine = f[0];
    r.model = f[1];
    RunOptions& o = r.options;
    o.context_tokens = std::stoll(f[2]);
    o.chunk_tokens = std::stoll(f[3]);
    o.page_tokens = std::stoll(f[4]);
    o.query_tile = 128;
    o.sink_pages = 1;
    o.page_budget = ParsePageBudget(f[5], "budget");
    o.keep_layer_inputs = f[6] == "on";
    o.offload = f[7] == "on";
    o.grad_dtype = ParseGradDtype(f[8], "grad_dtype");
    o.optimizer = ParseOptimizer(f[9], "optimizer");
    o.lora_rank = std::stoll(f[10]);
    r.tokens_per_second = std::stod(f[12]);
    r.arena_gib = std::stod(f[13]);
    r.device_gib = std::stod(f[14]);
    r.host_gib = std::stod(f[15]);
    r.startup_s = std::stod(f[16]);
    r.date = f[20];
    r.trace = f[21];
    r.sm_clock_mhz = f[22].empty() ? 0 : std::stod(f[22]);
    r.host_adamw_gparams = f[24].empty() ? 0 : std::stod(f[24]);
    o.gpu_tier_pages = std::stoll(f[25]);
    o.selection = MeasuredSelection(r.model);
    r.validation = IsValidation(r);
    runs.push_back(r);
  }
  return runs;
}

struct Errors {
  std::vector<double> time, device, host;
  std::vector<double> clock;              // runs whose SM clock was recorded
  std::vector<double> nvml_clock;         // those on a GPU whose NVML clock tracks speed
  std::vector<double> at_measured_clock;  // their step time at that clock (a diagnostic)
  std::vector<double> default_rule_time;  // step time with every union at the rule's default
  void Print(const char* set) const {
    auto stats = [](std::vector<double> v, double& median, double& max) {
      if (v.empty()) return;
      std::sort(v.begin(), v.end());
      median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
      max = v.back();
    };
    double tm = 0, tx = 0, dm = 0, dx = 0, hm = 0, hx = 0;
    stats(time, tm, tx);
    stats(device, dm, dx);
    stats(host, hm, hx);
    std::printf(
        "  %-11s %2zu runs: step time median %5.1f%% max %5.1f%%; device memory median "
        "%4.1f%% max %4.1f%%; pinned host max %4.1f%%\n",
        set, time.size(), 100 * tm, 100 * tx, 100 * dm, 100 * dx, 100 * hx);
    if (default_rule_time != time) {
      double rm = 0, rx = 0;
      stats(default_rule_time, rm, rx);
      std::printf(
          "  %-11s %2zu runs, no model's selection measured: step time median %5.1f%% "
          "max %5.1f%%\n",
          set, time.size(), 100 * rm, 100 * rx);
    }
    if (clock.empty()) return;
    double cm = 0, cx = 0, am = 0, ax = 0;
    stats(clock, cm, cx);
    stats(at_measured_clock, am, ax);
    std::printf(
        "  %-11s %2zu runs with a recorded SM clock: predicted clock median %4.1f%% max "
        "%4.1f%%; step time at the measured clock median %4.1f%% max %4.1f%%\n",
        set, clock.size(), 100 * cm, 100 * cx, 100 * am, 100 * ax);
    if (nvml_clock.empty()) return;
    stats(nvml_clock, cm, cx);
    std::printf(
        "  %-11s %2zu of them where NVML's clock is the kernels' speed (the H200): predicted "
        "clock median %4.1f%% max %4.1f%%\n",
        set, nvml_clock.size(), 100 * cm, 100 * cx);
  }
};

// The machine a run is planned on: its preset, or the preset with another GPU profile.
MachineSpec MachineOf(const MatrixRun& r, const char* gpu = nullptr) {
  MachineSpec machine = LoadMachine(r.machine);
  if (gpu != nullptr) machine.gpu = LoadGpu(gpu);
  return machine;
}

// MachineOf with the GPU profile that describes the kernels the run ran: the committed one, or an
// earlier calibration of it (tests/support/profile_history.h); nullopt, the run named, when none
// does (sim/kernel_changes.h): a run of a kernel its profile does not describe judges nothing.
std::optional<MachineSpec> JudgingMachine(const MatrixRun& r, const ModelSpec& model,
                                          const char* gpu = nullptr) {
  MachineSpec machine = MachineOf(r, gpu);
  const std::optional<GpuSpec> profile =
      test::ProfileOfRun(machine.gpu, r.date, r.options.page_tokens, model.head_dim);
  if (!profile) {
    std::printf("  left out (no profile times its kernels): %s\n", r.line.c_str());
    return std::nullopt;
  }
  if (profile->kernels.date != machine.gpu.kernels.date)
    std::printf("  judged by the calibration of %s: %s\n", profile->kernels.date.c_str(),
                r.line.c_str());
  machine.gpu = *profile;
  return machine;
}

// Whether NVML's clock reading on this GPU is the kernels' speed, by its committed calibration
// (a property of the GPU and its driver, not of the kernels a run ran).
bool NvmlClockTracksSpeed(const GpuSpec& committed) {
  constexpr double kTracks = 0.05;
  return committed.kernels.nvml_clock_speed_error >= 0 &&
         committed.kernels.nvml_clock_speed_error <= kTracks;
}

double MedianOf(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty()      ? 0
         : v.size() % 2 ? v[v.size() / 2]
                        : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

TEST(Matrix, PlannerPredictsTheValidationRuns) {
  const std::vector<MatrixRun> runs = ReadMatrix();
  ASSERT_GE(runs.size(), 40u);
  Errors calibration, validation;
  // The calibration runs' step time errors by the profile that judges them: the committed one (a
  // run of today's kernels) or an earlier one (models/gpu/history/). A model change is judged on
  // all of them; the split tells whether it moves today's runs and the older ones alike.
  std::vector<double> calibration_today, calibration_earlier;
  std::map<std::string, int> machines;
  for (const MatrixRun& r : runs) {
    const ModelSpec model = LoadModel(r.model);
    const std::optional<MachineSpec> judging = JudgingMachine(r, model);
    if (!judging) continue;
    const MachineSpec& machine = *judging;
    const bool todays_kernels = machine.gpu.kernels.date == MachineOf(r).gpu.kernels.date;
    ++machines[r.machine];
    r.options.Validate(model);
    const PlanGeometry geometry(model, r.options);
    const sim::KernelTimeModel time_model(machine);
    const sim::StepPrediction prediction = sim::AnalyticModel(time_model).Predict(geometry);
    const sim::PlanReport report = sim::MakeReport(geometry, machine, prediction);
    // Step time is the inverse of tokens/s; errors relative to the measurement.
    const double time = r.tokens_per_second / report.tokens_per_second - 1.0;
    // A model with a measured selection, planned at the rule's default instead: what a user who
    // did not measure it would be told.
    double default_rule_time = time;
    if (r.options.selection.draw_scale > 0) {
      RunOptions o = r.options;
      o.selection = SelectionModel{};
      const PlanGeometry g(model, o);
      default_rule_time = r.tokens_per_second /
                              sim::MakeReport(g, machine, sim::AnalyticModel(time_model).Predict(g))
                                  .tokens_per_second -
                          1.0;
    }
    const double device =
        static_cast<double>(report.gpu_memory.device) / (r.device_gib * 1073741824.0) - 1.0;
    const double host_gib = static_cast<double>(report.host_peak) / 1073741824.0;
    // Relative to at least 1 GiB: with every page in the GPU tier the runtime still pins one page
    // of each layer's stores (7 MiB for Qwen2.5-7B at page 64), which the plan does not count.
    const double host = (host_gib - r.host_gib) / std::max(r.host_gib, 1.0);
    // NVML's mean over the step, as the runs record it: the GPU idles at the maximum clock through
    // a tail of host work (AdamW on the host).
    const double tail = prediction.step_ticks > 0
                            ? static_cast<double>(prediction.gpu_idle_tail_ticks) /
                                  static_cast<double>(prediction.step_ticks)
                            : 0.0;
    const double clock_mhz = (prediction.sm_clock_fraction * (1.0 - tail) + tail) *
                             time_model.profile().max_sm_clock_mhz;
    Errors& set = r.validation ? validation : calibration;
    set.time.push_back(std::abs(time));
    if (!r.validation)
      (todays_kernels ? calibration_today : calibration_earlier).push_back(std::abs(time));
    set.default_rule_time.push_back(std::abs(default_rule_time));
    set.device.push_back(std::abs(device));
    set.host.push_back(std::abs(host));
    std::printf(
        "  %s %-10s %-13s %7lld c %5lld p %3lld %-4s %s%s%s  time %+6.1f%%  device %+5.1f%%"
        "  host %+5.1f%%  clock %4.0f MHz%s\n",
        r.validation ? "V" : "C", r.machine.c_str(), r.model.c_str(),
        static_cast<long long>(r.options.context_tokens),
        static_cast<long long>(r.options.chunk_tokens),
        static_cast<long long>(r.options.page_tokens),
        r.options.dense() ? "all" : std::to_string(r.options.page_budget).c_str(),
        r.options.offload ? "offload " : "", r.options.keep_layer_inputs ? "keep " : "",
        r.options.lora_rank ? "lora" : "", 100 * time, 100 * device, 100 * host, clock_mhz,
        r.sm_clock_mhz > 0
            ? (" (measured " + std::to_string(std::lround(r.sm_clock_mhz)) + ")").c_str()
            : "");
    if (std::abs(default_rule_time - time) > 5e-4)
      std::printf(
          "      %s's selection measured (draw scale %.3f); at the default rule's: time "
          "%+6.1f%%\n",
          r.model.c_str(), r.options.selection.draw_scale, 100 * default_rule_time);
    if (r.sm_clock_mhz > 0) {
      Errors& errors = r.validation ? validation : calibration;
      const double clock_error = std::abs(clock_mhz / r.sm_clock_mhz - 1.0);
      errors.clock.push_back(clock_error);
      // The planner's clock is the kernels' speed (clock_model.h); NVML's reading matches it
      // where the GPU's calibration found it explaining the sustained kernels' speed (the H200:
      // ~3%; the H100 reports 6-11% less for the same speed).
      if (NvmlClockTracksSpeed(MachineOf(r).gpu)) errors.nvml_clock.push_back(clock_error);
      // A diagnostic, never fitted: the same step at the clock NVML measured, which tells the
      // power model's error from the kernel times'.
      // The kernels' clock: NVML's step mean with the idle tail at the maximum taken out.
      const double measured_fraction = std::clamp(
          (r.sm_clock_mhz / time_model.profile().max_sm_clock_mhz - tail) / (1.0 - tail), 0.5, 1.0);
      const sim::StepPrediction at_measured =
          sim::AnalyticModel(time_model).PredictAtClock(geometry, measured_fraction);
      const double at_measured_time =
          r.tokens_per_second / sim::MakeReport(geometry, machine, at_measured).tokens_per_second -
          1.0;
      std::printf("      at the measured clock: time %+6.1f%%\n", 100 * at_measured_time);
      (r.validation ? validation : calibration)
          .at_measured_clock.push_back(std::abs(at_measured_time));
    }
  }
  calibration.Print("calibration");
  for (const auto& [what, errors] :
       {std::pair<const char*, const std::vector<double>*>{"the committed profiles (today's "
                                                           "kernels)",
                                                           &calibration_today},
        {"earlier calibrations", &calibration_earlier}}) {
    if (errors->empty()) continue;
    double sum = 0;
    for (const double e : *errors) sum += e;
    std::printf(
        "  calibration %2zu runs judged by %s: step time median %4.2f%% mean %4.2f%% max %4.1f%%\n",
        errors->size(), what, 100 * MedianOf(*errors),
        100 * sum / static_cast<double>(errors->size()),
        100 * *std::max_element(errors->begin(), errors->end()));
  }
  validation.Print("validation");
  for (const auto& [name, count] : machines) std::printf("  %s: %d runs\n", name.c_str(), count);
  ASSERT_GE(validation.time.size(), 10u);
  const double time_median = MedianOf(validation.time);
  const double time_max = *std::max_element(validation.time.begin(), validation.time.end());
  const double device_median = MedianOf(validation.device);
  const double device_max = *std::max_element(validation.device.begin(), validation.device.end());
  const double host_max = *std::max_element(validation.host.begin(), validation.host.end());
  const bool met = time_median <= 0.03 && time_max <= 0.08 && device_median <= 0.01 &&
                   device_max <= 0.02 && host_max <= 0.01;
  std::printf("  issue 11 acceptance on the validation set: %s\n", met ? "met" : "NOT MET");
  // Today's accuracy (2026-11-25, the offload rows re-recorded after the backward's union table
  // stopped queueing behind page copies, the loss timed by shape): time median 3.4%, max 9.2%
  // (the worst: the H100 at chunk 1024, pessimistic; was 3.9% / 13.4%, Llama-3.1-8B 128K k64
  // offload, optimistic). Device
  // memory median 0.2%, max 1.2% since the plan counts the CUDA backend's activation buffers one by
  // one (was 0.7% / 2.3%). The predicted SM clock against NVML's: validation median 2.6%, max 9.9%.
  // 2026-11-26: the H100 re-calibrated and its four runs over pages of 32 and 96 re-recorded
  // with the new attention forward: median 3.5%, max 11.6% (the H100 at chunk 1024 page 32,
  // +2.2% at NVML's clock: the clock model holds it at 1767 MHz where it ran 1952). The H100's
  // clock is predicted 4-10% low on every run; its kernel times at the measured clock are within
  // -7.7% / +4.1%.
  // 2026-11-26 (evening): Llama-3.1-8B's selection measured on its own run
  // (traces/recorded/selection/): median 2.7%, max 6.1% (at the default union rule 3.1% / 10.8%,
  // the L8B 128K k64 offload run). Issue 11's acceptance.
  // 2026-11-27: the kernels of the morning (flushed exponentials, gathered sparse backward, own
  // blocks first) re-recorded 9 H200 and 13 H100 runs, the H100's profile re-measured on the GPU
  // of its last 9: validation (30) median 2.9%, max 12.6%, NOT MET. The worst are H100 runs the
  // planner holds slower than they ran, by its clock: the faster attention kernels draw the
  // H100's 700 W at 1500-1650 MHz run back to back (attention_bwd_w 647 -> 916 W), and the clock
  // model, averaging the step's power, holds Llama-3.2-1B c3072 at 1674 MHz where it ran 1786
  // (+12.6%; at NVML's clock the validation max is 8.5%).
  // 2026-11-27 (noon): the clock read as the kernels' speed, not NVML's reading (FitPower; the
  // H100 reports 6-11% less clock for the same speed), the exponent re-chosen on the
  // calibration runs (4.5): validation median 2.8%, max 4.7% (the H100's own profile 3.0% / 4.7%),
  // calibration 2.6% / 10.8%. Then 10 new configurations recorded with the model fixed (6 H100,
  // 4 H200): validation (40) median 2.5%, max 4.7%; pinned host max 0.2% once the host page
  // stores count as pinned up front (the 512K k16 H100 row was -3.2%); with page-sparse attention
  // drawing its watts for its whole time: 2.1% / 4.4% (calibration 2.3% / 10.8%). Issue 11's
  // acceptance. 2026-11-29: (92) 2.4% / 7.2% with Llama-2-7B's; attention's watts by head dim
  // 2.1% / 6.1% (calibration, 61 with 32 runs of that day's kernels: 2.8% / 10.8% -> 2.5% / 10.7%).
  EXPECT_LE(time_median, 0.03);
  EXPECT_LE(time_max, 0.08);
  EXPECT_LE(device_median, 0.01);
  EXPECT_LE(device_max, 0.02);
  // The clock against NVML's on the H200 alone, where NVML's reading is the kernels' speed:
  // validation median 2.0%, max 5.5% on 2026-11-27 (noon); 2.7% / 7.3% with the rows to 11-28.
  // 2026-11-29: 4.1% / 9.9% with Llama-2-7B's (group 1, 32K), the bound 8% -> 10% to record it,
  // not to hide it: the power model holds its dense and union steps at 1670-1690 MHz where they
  // ran 1533-1584 (its page-32 steps, attention on gathered blocks, right: 1696 against
  // 1695 / 1715), as it holds every compute-bound 7-8B step without offload since 2026-11-27
  // 5-9% high (Qwen2.5-7B and Llama-3.1-8B too, calibration runs among them); the power group
  // re-measured that day read within 1.5% of the profile's rows, so the inputs are current and
  // the model's form is what misses. Their step times stay within -7.2% .. +1.8%.
  // 2026-11-29, later: attention's watts by head dim (sim/MODEL-LOG.md): 4.1% / 8.6%, Llama-2-7B's
  // steps -6.1% .. +3.1%; Qwen2.5-7B's calibration runs still 5-8% high.
  ASSERT_GE(validation.nvml_clock.size(), 10u);
  EXPECT_LE(MedianOf(validation.nvml_clock), 0.055);
  EXPECT_LE(*std::max_element(validation.nvml_clock.begin(), validation.nvml_clock.end()), 0.10);
  EXPECT_LE(host_max, 0.01);
}

// Runs outside the grid (chunk 1024-16384), recorded the same way
// (traces/recorded/beyond-matrix.csv) and judged by no set: printed with the planner's error, and
// bounded at today's accuracy so that a change that worsens them is seen. Chunk 256, 2026-11-26
// night: 9-12% optimistic (an H100 trace of Llama-3.2-1B 32K: the fused loss over 256 tokens at
// twice its predicted time, the many small page copies x1.25-1.30, the unions x0.84 of the plan);
// with the loss timed a vocabulary tile at a time and the union rule anchored at one tile,
// -4.7 / +1.9 / +2.5%.
TEST(Matrix, BeyondTheMatrix) {
  const std::vector<MatrixRun> runs = ReadMatrix("beyond-matrix.csv");
  ASSERT_GE(runs.size(), 3u);
  for (const MatrixRun& r : runs) {
    const ModelSpec model = LoadModel(r.model);
    const std::optional<MachineSpec> judging = JudgingMachine(r, model);
    if (!judging) continue;
    const MachineSpec& machine = *judging;
    r.options.Validate(model);
    const PlanGeometry geometry(model, r.options);
    const sim::KernelTimeModel time_model(machine);
    const sim::PlanReport report =
        sim::MakeReport(geometry, machine, sim::AnalyticModel(time_model).Predict(geometry));
    const double time = r.tokens_per_second / report.tokens_per_second - 1.0;
    const double device =
        static_cast<double>(report.gpu_memory.device) / (r.device_gib * 1073741824.0) - 1.0;
    std::printf("  %-10s %-13s %7lld c %5lld p %3lld %-4s  time %+6.1f%%  device %+5.1f%%\n",
                r.machine.c_str(), r.model.c_str(),
                static_cast<long long>(r.options.context_tokens),
                static_cast<long long>(r.options.chunk_tokens),
                static_cast<long long>(r.options.page_tokens),
                r.options.dense() ? "all" : std::to_string(r.options.page_budget).c_str(),
                100 * time, 100 * device);
    EXPECT_LE(std::abs(time), 0.08) << r.line;
    EXPECT_LE(std::abs(device), 0.02) << r.line;
  }
}

// Start-up before the first step (random weights, arena, pinning), predicted against ctxtrain's
// start-up line in every run.
TEST(Matrix, StartUpBeforeTheFirstStep) {
  std::vector<double> errors;
  for (const MatrixRun& r : ReadMatrix()) {
    const ModelSpec model = LoadModel(r.model);
    const std::optional<MachineSpec> judging = JudgingMachine(r, model);
    if (!judging) continue;
    const MachineSpec& machine = *judging;
    r.options.Validate(model);
    const PlanGeometry geometry(model, r.options);
    const sim::KernelTimeModel time_model(machine);
    const sim::PlanReport report =
        sim::MakeReport(geometry, machine, sim::AnalyticModel(time_model).Predict(geometry));
    errors.push_back(std::abs(report.startup.total() / r.startup_s - 1.0));
    std::printf(
        "  %-10s %-13s %7lld host %6.2f GiB  start-up measured %5.1f s predicted %5.1f s "
        "(%+.0f%%)\n",
        r.machine.c_str(), r.model.c_str(), static_cast<long long>(r.options.context_tokens),
        r.host_gib, r.startup_s, report.startup.total(),
        100 * (report.startup.total() / r.startup_s - 1.0));
  }
  const double median = MedianOf(errors), max = *std::max_element(errors.begin(), errors.end());
  std::printf("  start-up: median error %.1f%%, max %.1f%% over %zu runs\n", 100 * median,
              100 * max, errors.size());
  // Today's accuracy as a guard (2026-11-24: median 20.7%, max 41.7%; 2026-11-25, six traced
  // rows re-recorded: 23.9%, 41.2%). Start-up is host work (random weights, pinning), and the
  // lent hosts differ by 30% and more in it: the profiles' host rates were measured on other
  // hosts than most runs. And a bias: on one host (2026-11-25) ctxtrain's weights phase ran at
  // 0.235 Gparam/s where weights_init measured 0.292, the first touch of 30 GB of fresh host
  // tensors and their upload being in the one and not the other.
  // 2026-11-25: an H100 host pinned 85 GiB in 81.9 s (start-up 143.8 s, predicted 66): max 54%.
  // Later that day the upload was measured as the backend does it (weights_upload: rounding on
  // the host's threads, pageable copies, 1.2 Gparam/s where the pinned link says 27): median
  // 23.8% -> 12.7%, max 54.1% -> 49.9%.
  // 2026-11-26, the H100 re-calibrated (its pinning and upload rates): median 13.1%, max 52.0%.
  EXPECT_LE(median, 0.15);
  EXPECT_LE(max, 0.53);
}

// An H100 prediction made without the H100's calibration: the H200's profile scaled by datasheet
// differences (models/gpu/h100-sxm-estimate.yaml), against the matrix's H100 runs.
//
// A run recorded with a kernel the H200's profile does not describe (a change between the two
// dates for its page size, sim/kernel_changes.h) cannot judge it: such runs are left out here,
// and named, until one of the two is redone.
TEST(Matrix, H100FromTheH200ProfileScaled) {
  Errors calibrated, estimated;
  for (const MatrixRun& r : ReadMatrix()) {
    if (r.machine != "h100-125g") continue;
    // Both profiles must time the run's kernels: the H100's, and the H200's it is scaled from.
    const ModelSpec model = LoadModel(r.model);
    const std::optional<MachineSpec> own = JudgingMachine(r, model);
    const std::optional<MachineSpec> scaled = JudgingMachine(r, model, "h100-sxm-estimate");
    if (!own || !scaled) continue;
    r.options.Validate(model);
    const PlanGeometry geometry(model, r.options);
    double error[2] = {0, 0};  // calibrated, scaled
    for (const bool estimate : {false, true}) {
      const MachineSpec& machine = estimate ? *scaled : *own;
      const sim::KernelTimeModel time_model(machine);
      const sim::PlanReport report =
          sim::MakeReport(geometry, machine, sim::AnalyticModel(time_model).Predict(geometry));
      error[estimate] = r.tokens_per_second / report.tokens_per_second - 1.0;
      (estimate ? estimated : calibrated).time.push_back(std::abs(error[estimate]));
    }
    std::printf("  %-13s %7lld c %5lld p %3lld %-4s %-8s calibrated %+6.1f%%  scaled %+6.1f%%\n",
                r.model.c_str(), static_cast<long long>(r.options.context_tokens),
                static_cast<long long>(r.options.chunk_tokens),
                static_cast<long long>(r.options.page_tokens),
                r.options.dense() ? "all" : std::to_string(r.options.page_budget).c_str(),
                r.options.offload ? "offload" : "", 100 * error[0], 100 * error[1]);
  }
  // Runs of kernels that the H200's profile (or the H100's) does not describe are left out.
  ASSERT_GE(estimated.time.size(), 10u);
  std::printf(
      "  H100 runs, step time error: calibrated profile median %.1f%% max %.1f%%; "
      "H200 profile scaled median %.1f%% max %.1f%%\n",
      100 * MedianOf(calibrated.time),
      100 * *std::max_element(calibrated.time.begin(), calibrated.time.end()),
      100 * MedianOf(estimated.time),
      100 * *std::max_element(estimated.time.begin(), estimated.time.end()));
  // Acceptance: within 8% on every H100 run. Met since the offload rows were re-recorded with
  // the union table copied by SMs (2026-11-25): median 2.5%, max 5.4% (was 2.7%, 14.2%). With
  // the page union modelled from the calibration traces (plan_geometry.h) the Llama-3.1-8B 128K
  // offload run, whose tiles select more independently than the calibration models', is 8.0%
  // optimistic: the guard sits just above it.
  // 2026-11-26, the backward's copies timed at the expected union: median 2.8%, max 10.0% (the
  // Llama-3.1-8B 128K offload run again, now 10% optimistic: its tiles' unions are 20% larger
  // than the plan's, x0.834 in the union check below, and the attention backward is slower).
  // 2026-11-26 evening: six runs the H200's profile describes (the d_h 64 runs and the pages of
  // 32 and 96 wait for its calibration), two of them re-recorded on another H100 that ran 2-3%
  // slower (Qwen2.5-7B c1024 p64 5,124 -> 4,955 tok/s): median 3.7%, max 10.3%.
  // 2026-11-26 night: 13 runs (the H200 profile re-measured), Llama-3.1-8B's selection measured,
  // an accumulating GEMM's wave scaled by HBM: median 3.0%, max 9.4%. The three worst are
  // Llama-3.2-1B's (-8.2..-9.4%): the scaled profile holds its steps at 1881 MHz where the H100
  // ran 1635 (the H100 draws 1.2-1.4x the H200's watts per GEMM and attention FLOP at one clock,
  // which no datasheet value tells; its own profile says 1759). The power is the whole gap:
  // the scaled profile with the H100's measured watts (idle, GEMM, attention, memory) predicts
  // every H100 run within 6.3% (median 3.0%); with its GEMM and attention rates instead, 8.8%.
  // 2026-11-27, the H200's profile of the morning's kernels (09:34Z) scaled, against the 18 H100
  // runs of those kernels: median 2.7%, max 5.8%, within the 8% (the H100's own profile:
  // 4.7% / 12.6%, its measured attention watts holding the clock 5-7% low). Issue 11's bound.
  // 2026-11-27 noon, the clock read as the kernels' speed (clock_model.h), watts refitted on both
  // GPUs: scaled median 2.1%, max 4.9%; the H100's own profile 3.0% / 4.7%. With page-sparse
  // attention drawing its watts for its whole time: 1.5% / 4.5%, own profile 2.4% / 3.9%.
  // 2026-11-28, seven runs of the three-consumer forward (six Llama-3.2-1B, one Llama-3.1-8B)
  // added: with the backward's own launches in fixed waves the 16K first chunk was 10.2%
  // pessimistic scaled (6.3% own), its own-only backward fitted 27% slow; timed heaviest first
  // with their own item cost (fitted on the samples): scaled median 1.5%, max 7.2% (the
  // Llama-3.2-1B 128K offload run), own profile 2.8% / 5.5%.
  EXPECT_LE(MedianOf(estimated.time), 0.04);
  EXPECT_LE(*std::max_element(estimated.time.begin(), estimated.time.end()), 0.08);
}

// A run recorded with kernels the committed profile no longer describes is judged by the earlier
// calibration kept in the history folder that does; a scaled estimate by its sibling's.
TEST(Matrix, AnEarlierCalibrationJudgesTheRunsOfItsKernels) {
  test::ScratchDir dir;
  const std::string yaml = test::ProfileRedated("h200", "2026-11-25T10:00Z");
  ASSERT_FALSE(yaml.empty());
  dir.Write("h200-2026-11-25.yaml", yaml);
  dir.Write("other.yaml", test::ReadAll(std::string(CTXPLAN_SOURCE_DIR) + "/models/gpu/l40s.yaml"));
  ASSERT_EQ(test::GpuHistory(dir.path(), "h200").size(), 1u);
  ASSERT_TRUE(test::GpuHistory(dir.path() / "none", "h200").empty());

  const GpuSpec h200 = LoadGpu("h200"), estimate = LoadGpu("h100-sxm-estimate");
  for (const GpuSpec& gpu : {h200, estimate}) {
    // Before the page cursor, at pages of 96: the earlier calibration (scaled, for the estimate).
    const auto early = test::ProfileOfRun(gpu, "2026-11-24", 96, 128, dir.path());
    ASSERT_TRUE(early.has_value()) << gpu.name;
    EXPECT_EQ(early->kernels.date, "2026-11-25T10:00Z") << gpu.name;
    EXPECT_EQ(early->name, gpu.name);
    EXPECT_EQ(early->kernels.provenance, gpu.kernels.provenance) << gpu.name;
    // After the last change at head dim 128 (the forward's slices and lazy rescale,
    // 2026-11-28T07:30Z) and at 64 (K and V in registers, 2026-11-29T08:45Z): the committed
    // profile; before them, not here (this folder holds no calibration of those kernels).
    const auto late = test::ProfileOfRun(gpu, "2026-11-28T07:50Z", 96, 128, dir.path());
    ASSERT_TRUE(late.has_value()) << gpu.name;
    EXPECT_EQ(late->kernels.date, gpu.kernels.date) << gpu.name;
    EXPECT_TRUE(test::ProfileOfRun(gpu, "2026-11-29T08:50Z", 128, 64, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-28T07:50Z", 128, 64, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-28T05:00Z", 96, 128, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-28T02:40Z", 96, 128, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T19:40Z", 96, 128, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T23:58Z", 128, 64, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T21:20Z", 128, 64, dir.path()).has_value());
    // Between the whole dQ and the barrier-free backward at head dim 128: not here.
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T16:40Z", 96, 128, dir.path()).has_value());
    // Between the TMA loads and the whole dQ, with no calibration of those kernels here.
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T14:30Z", 96, 128, dir.path()).has_value());
    // Between the morning's changes and the TMA loads, with no calibration of those kernels here.
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T12:00Z", 96, 128, dir.path()).has_value());
    // After the page changes of 2026-11-26, before the morning's, or between the morning's
    // changes: neither (left out).
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-26T19:00Z", 96, 128, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T07:00Z", 128, 64, dir.path()).has_value());
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-27T08:45Z", 96, 128, dir.path()).has_value());
    // No history: only the committed profile can judge.
    EXPECT_FALSE(test::ProfileOfRun(gpu, "2026-11-24", 96, 128, dir.path() / "none").has_value());
  }
  // The estimate scaled from the earlier H200 calibration is not the earlier H200 calibration.
  const auto scaled = test::ProfileOfRun(estimate, "2026-11-24", 96, 128, dir.path());
  const auto own = test::ProfileOfRun(h200, "2026-11-24", 96, 128, dir.path());
  ASSERT_TRUE(scaled && own);
  EXPECT_NE(scaled->kernels.gemm_accumulate_wave_us_per_byte,
            own->kernels.gemm_accumulate_wave_us_per_byte);
}

TEST(Matrix, EveryOpKindOfTheRecordedTracesWithin15Percent) {
  int replayed = 0, gaps = 0;
  for (const MatrixRun& r : ReadMatrix()) {
    if (r.trace.empty()) continue;
    const ModelSpec model = LoadModel(r.model);
    // A trace of a kernel no profile describes judges nothing, as in the matrix.
    const std::optional<MachineSpec> judging = JudgingMachine(r, model);
    if (!judging) continue;
    const MachineSpec& machine = *judging;
    const OpTrace trace = ReadOpTrace(kDir + "matrix/" + r.trace);
    RunOptions options = RunOptionsFromMetadata(trace.metadata, r.trace);
    options.selection = r.options.selection;  // the model's measured selection, as the matrix
    const StepPlan plan(model, options);
    const sim::KernelTimeModel time_model(machine);
    const sim::ReplayResult result = sim::Replay(trace, plan, time_model, r.trace);
    std::map<OpKind, std::pair<double, double>> by_kind;  // measured, predicted
    for (const sim::KindComparison& k : result.by_kind) {
      by_kind[k.kind].first += k.measured_seconds;
      by_kind[k.kind].second += k.predicted_seconds;
    }
    std::printf("  %s (%s): step measured %.3f s, predicted %.3f s\n", r.trace.c_str(),
                r.machine.c_str(), result.measured_step_seconds, result.predicted_step_seconds);
    if (result.unions.layers > 0)
      std::printf(
          "    page unions: predicted x%.2f of measured; tiles drew as %.2f independent (the "
          "plan: %.2f)\n",
          result.unions.predicted_pages / result.unions.measured_pages,
          result.unions.independent_tiles, result.unions.planned_independent_tiles);
    for (const auto& [kind, times] : by_kind) {
      const auto [measured, predicted] = times;
      if (measured <= 0 && predicted <= 0) continue;
      std::printf("    %-22s measured %8.3f s predicted %8.3f s (x%.2f)\n",
                  std::string(OpKindName(kind)).c_str(), measured, predicted,
                  predicted / std::max(measured, 1e-12));
      // Kinds under 0.2% of the step are launch-bound noise; the rest within 15% (issue 11's
      // acceptance; met since 2026-11-26 night, when the memory-bound kernels came to be timed as
      // they run in a step - behind a longer kernel, their input in the L2 where the kernel
      // before wrote it - and the D2H kept its rate beside an H2D). The bounds below stay for a
      // regression to name its kind.
      if (measured < 0.002 * result.measured_step_seconds) continue;
      const double ratio = predicted / measured;
      if (std::abs(ratio - 1.0) <= 0.15) continue;
      ++gaps;
      std::printf("    ^ NOT MET: %s off by more than 15%%\n",
                  std::string(OpKindName(kind)).c_str());
      const bool known = kind == OpKind::kPageTopK || kind == OpKind::kAttentionBackward ||
                         kind == OpKind::kCopyD2H || kind == OpKind::kCopyH2D ||
                         kind == OpKind::kAttentionForward ||
                         kind == OpKind::kLinearBackwardWeight || kind == OpKind::kRmsNormForward ||
                         kind == OpKind::kRopeForward || kind == OpKind::kRopeBackward;
      EXPECT_TRUE(known) << r.trace << " " << OpKindName(kind) << " x" << ratio;
      EXPECT_GT(ratio, kind == OpKind::kPageTopK ? 0.45 : 0.65)
          << r.trace << " " << OpKindName(kind);
      EXPECT_LT(ratio, 1.40) << r.trace << " " << OpKindName(kind);
    }
    ++replayed;
  }
  std::printf("  %d traces replayed; op kinds beyond 15%%: %d (acceptance: 0)\n", replayed, gaps);
  EXPECT_GE(replayed, 6);
  // 2026-11-27: the Llama-3.1-8B 128K k64 H200 trace's attention backward read x0.80 on the
  // first profile of the gathered blocks (a GQA group of 4 gives a block 8 items where the
  // calibration's sparse rows, all of group 7, gave 14), x0.91 since the grid has group 4 too.
  EXPECT_EQ(gaps, 0);
}

}  // namespace
}  // namespace ctxplan

namespace ctxplan {
namespace {

// The plan's page-union rule (plan_geometry.h) is a least-squares fit over the calibration
// traces' unions alone: refit here on a grid, the committed constants must be the optimum (within
// a grid step), and each calibration trace's union within 5%. The validation traces are printed.
TEST(Matrix, PageUnionRuleIsTheCalibrationFit) {
  struct Chunk {
    std::string trace;
    bool calibration;
    int64_t k, tiles, candidates;
    double union_pages;  // sink included
  };
  std::vector<Chunk> chunks;
  for (const std::vector<std::string>& f : test::ReadCsvRows(kDir + "matrix/unions.csv")) {
    ASSERT_EQ(f.size(), 9u) << test::CsvLine(f);
    chunks.push_back({f[0], f[1] == "calibration", std::stoll(f[4]), std::stoll(f[5]),
                      std::stoll(f[6]), std::stod(f[8])});
  }
  ASSERT_GE(chunks.size(), 100u);
  auto predict = [](const Chunk& c, double scale, double tile_exp, double draw_exp) {
    const double f = static_cast<double>(c.candidates), t = static_cast<double>(c.tiles);
    const double k = static_cast<double>(c.k);
    const double draws =
        std::clamp(1.0 + scale * std::pow(t - 1.0, tile_exp) * std::pow(f / k, draw_exp), 1.0, t);
    return 1.0 + f * (1.0 - std::pow(1.0 - k / f, draws));  // one sink page
  };
  // Mean squared relative error per trace, then over the calibration traces.
  auto loss = [&](double scale, double tile_exp, double draw_exp) {
    std::map<std::string, std::pair<double, int>> by_trace;
    for (const Chunk& c : chunks) {
      if (!c.calibration) continue;
      const double e = predict(c, scale, tile_exp, draw_exp) / c.union_pages - 1.0;
      by_trace[c.trace].first += e * e;
      ++by_trace[c.trace].second;
    }
    double sum = 0;
    for (const auto& [trace, v] : by_trace) sum += v.first / v.second;
    return sum / static_cast<double>(by_trace.size());
  };
  double best = 1e30, best_scale = 0, best_tile = 0, best_draw = 0;
  for (int g = 0; g <= 10; ++g)
    for (int a = 10; a <= 300; a += 2)
      for (int b = 0; b <= 40; ++b) {
        const double l = loss(a / 100.0, g / 10.0, b / 100.0);
        if (l < best) {
          best = l;
          best_scale = a / 100.0;
          best_tile = g / 10.0;
          best_draw = b / 100.0;
        }
      }
  std::printf(
      "  union rule refit: scale %.2f (tiles-1)^%.1f (candidates/k)^%.2f (committed %.2f %.1f "
      "%.2f)\n",
      best_scale, best_tile, best_draw, kUnionDrawScale, kUnionTileExponent, kUnionDrawExponent);
  EXPECT_NEAR(kUnionDrawScale, best_scale, 0.021);
  EXPECT_NEAR(kUnionTileExponent, best_tile, 0.051);
  EXPECT_NEAR(kUnionDrawExponent, best_draw, 0.011);
  // Each trace's pages in total, with the committed rule (ExpectedUnionPages is the plan's).
  std::map<std::string, std::pair<double, double>> totals;  // predicted, measured
  std::map<std::string, bool> is_calibration;
  for (const Chunk& c : chunks) {
    totals[c.trace].first += 1.0 + ExpectedUnionPages(c.candidates, c.k, c.tiles);
    totals[c.trace].second += c.union_pages;
    is_calibration[c.trace] = c.calibration;
  }
  for (const auto& [trace, t] : totals) {
    std::printf("    %-28s %-11s union predicted x%.3f of measured\n", trace.c_str(),
                is_calibration[trace] ? "calibration" : "validation", t.first / t.second);
    if (is_calibration[trace]) {
      EXPECT_NEAR(t.first / t.second, 1.0, 0.05) << trace;
    }
  }
}

}  // namespace
}  // namespace ctxplan
