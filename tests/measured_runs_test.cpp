// The planner against real runs: every ctxtrain run of traces/recorded/h200-7b-runs.csv (Qwen2.5-7B
// on the lent H200, commands in scripts/gpu-runs.sh) is predicted for the h200-125g machine and
// compared. The bounds are the planner's current accuracy, not aspirations: a change to the
// kernel-time model, the memory accounting or the machine preset that moves a prediction outside
// them has to explain why (or re-measure).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/plan_report.h"
#include "support/csv.h"
#include "support/profile_history.h"

namespace ctxplan {
namespace {

struct MeasuredRun {
  RunOptions options;
  double tokens_per_second = 0, arena_gib = 0, device_gib = 0, host_gib = 0;
  std::string line;
  std::string label;  // the configuration: the first 8 fields
};

std::vector<MeasuredRun> ReadRuns() {
  const std::string path = std::string(CTXPLAN_SOURCE_DIR) + "/traces/recorded/h200-7b-runs.csv";
  std::vector<MeasuredRun> runs;
  for (const std::vector<std::string>& f : test::ReadCsvRows(path)) {
    const std::string line = test::CsvLine(f);
    EXPECT_EQ(f.size(), 12u) << line;
    if (f.size() != 12) continue;
    MeasuredRun r;
    r.line = line;
    for (size_t i = 0; i < 8; ++i) r.label += (i ? "," : "") + f[i];
    RunOptions& o = r.options;
    o.context_tokens = std::stoll(f[0]);
    o.chunk_tokens = std::stoll(f[1]);
    o.page_tokens = 128;
    o.query_tile = 128;
    o.sink_pages = 1;
    o.page_budget = ParsePageBudget(f[2], "budget");
    o.keep_layer_inputs = f[3] == "on";
    o.offload = f[4] == "on";
    o.grad_dtype = ParseGradDtype(f[5], "grad_dtype");
    o.optimizer = ParseOptimizer(f[6], "optimizer");
    o.lora_rank = std::stoll(f[7]);
    r.tokens_per_second = std::stod(f[8]);
    r.arena_gib = std::stod(f[9]);
    r.device_gib = std::stod(f[10]);
    r.host_gib = std::stod(f[11]);
    runs.push_back(r);
  }
  return runs;
}

// The GPU profile that times a recorded run's kernels (tests/support/profile_history.h): the
// committed one, or an earlier calibration kept beside it. Every run must have one: a GPU
// calibrated again after a kernel change keeps its earlier calibration in models/gpu/history/.
MachineSpec JudgingMachine(const std::string& preset, std::string_view date, int64_t page_tokens,
                           int64_t head_dim) {
  MachineSpec machine = LoadMachine(preset);
  const std::optional<GpuSpec> gpu = test::ProfileOfRun(machine.gpu, date, page_tokens, head_dim);
  EXPECT_TRUE(gpu.has_value()) << preset << " " << date << ": no profile times its kernels";
  if (gpu) machine.gpu = *gpu;
  return machine;
}

// traces/recorded/h200-7b-runs.csv holds no date: its rows were recorded 2026-11-23 and -25.
constexpr std::string_view kH200RunsRecorded = "2026-11-25";

TEST(MeasuredRuns, PlannerPredictsTheH200Runs) {
  const ModelSpec model = LoadModel("qwen2.5-7b");
  const MachineSpec machine = JudgingMachine("h200-125g", kH200RunsRecorded, 128, model.head_dim);
  const sim::KernelTimeModel time_model(machine);
  const sim::AnalyticModel analytic(time_model);
  const std::vector<MeasuredRun> runs = ReadRuns();
  ASSERT_EQ(runs.size(), 20u);
  double worst_speed = 0, worst_device = 0, worst_host = 0;
  for (const MeasuredRun& r : runs) {
    r.options.Validate(model);
    const PlanGeometry geometry(model, r.options);
    const sim::PlanReport report = sim::MakeReport(geometry, machine, analytic.Predict(geometry));
    const double speed = report.tokens_per_second / r.tokens_per_second;
    const double device =
        static_cast<double>(report.gpu_memory.device) / (r.device_gib * 1073741824.0);
    const double host_gib = static_cast<double>(report.host_peak) / 1073741824.0;
    // Step time: within 40% either way. These runs were recorded on 2026-11-22 by an older
    // ctxtrain (a slower sparse backward, other kernels since tuned) than the kernels the
    // calibrated profile measures, so they no longer judge the time model: the validation matrix
    // (matrix_test.cpp) does. Kept for memory, and as a wide guard on time: at 512K and 1M with
    // offload the planner is now pessimistic by up to 26% (the per-copy cost of the union's
    // page runs, measured in isolation, weighs more than in the overlapped runtime).
    EXPECT_GT(speed, 1.0 / 1.4) << r.line;
    EXPECT_LT(speed, 1.4) << r.line;
    // GPU memory: the plan never under-predicts by more than 10% (the CUDA backend allocates
    // more activation buffers than the plan counts, and device KV/dKV pages for the last chunk
    // that it never writes: most at large chunks), nor over-predicts by 5%.
    EXPECT_GT(device, 0.90) << r.line;
    EXPECT_LT(device, 1.05) << r.line;
    // Host memory: the plan's pinned pages and optimizer state, within 1% + 0.5 GiB (the page
    // stores pin their whole capacity up front; the plan's dKV peak is a little lower).
    EXPECT_NEAR(host_gib, r.host_gib, 0.01 * r.host_gib + 0.5) << r.line;
    worst_speed = std::max(worst_speed, std::abs(std::log(speed)));
    worst_device = std::max(worst_device, std::abs(std::log(device)));
    worst_host = std::max(worst_host, std::abs(host_gib - r.host_gib));
    std::printf("  %-48s tok/s %6.0f predicted %6.0f (x%.2f), device %6.2f predicted %6.2f GiB\n",
                r.label.c_str(), r.tokens_per_second, report.tokens_per_second, speed, r.device_gib,
                static_cast<double>(report.gpu_memory.device) / 1073741824.0);
  }
  std::printf("  worst: tokens/s x%.3f, device memory x%.3f, host %.2f GiB\n",
              std::exp(worst_speed), std::exp(worst_device), worst_host);
}

// Issues 13 and 17: the planner against the pipelined runs (traces/recorded/pipeline-runs.csv):
// on the two-GPU H200 host one GPU and two, on the four-GPU H100 host 2M and 4M tokens over
// four, on the four-GPU H200 host 4M over four; each predicted for its host by the analytic path
// (the event path agrees with it, sim_test). Step time within 5% below 1M, within 9% from 1M on;
// each GPU's arena within 1%, host memory of all ranks within 2%.
std::vector<double> Numbers(const std::string& field) {
  std::vector<double> v;
  std::stringstream in(field);
  std::string item;
  while (std::getline(in, item, ';')) v.push_back(std::stod(item));
  return v;
}

TEST(MeasuredRuns, PlannerPredictsThePipelinedRuns) {
  const std::string path = std::string(CTXPLAN_SOURCE_DIR) + "/traces/recorded/pipeline-runs.csv";
  int rows = 0;
  double worst_time = 0;
  for (const std::vector<std::string>& f : test::ReadCsvRows(path)) {
    ASSERT_EQ(f.size(), 19u) << test::CsvLine(f);
    ++rows;
    const ModelSpec model = LoadModel(f[1]);
    const MachineSpec machine = JudgingMachine(f[0], f[18], std::stoll(f[4]), model.head_dim);
    const sim::KernelTimeModel time_model(machine);
    const sim::AnalyticModel analytic(time_model);
    RunOptions o;
    o.context_tokens = std::stoll(f[2]);
    o.chunk_tokens = std::stoll(f[3]);
    o.page_tokens = std::stoll(f[4]);
    o.page_budget = ParsePageBudget(f[5], "budget");
    o.offload = f[6] == "on";
    o.gpu_tier_pages = std::stoll(f[7]);
    o.optimizer = ParseOptimizer(f[8], "optimizer");
    o.pipeline_stages = static_cast<int32_t>(std::stoll(f[9]));
    const PlanGeometry geometry(model, o);
    const sim::StepPrediction p = analytic.Predict(geometry);
    const double step = std::stod(f[12]);
    const double time = p.step_seconds() / step - 1.0;
    // From 1M on, 8%: since the backward's copies are timed at the expected union (2026-11-26,
    // as the runtime moves them) the 1M steps are predicted 5.6% / 7.2% short (1 / 2 GPUs; they
    // were +4-5% long with the dKV half of the copy at its worst case, which hid it).
    // 2026-11-27, the clock read as the kernels' speed and page-sparse attention drawing its
    // watts for its whole time (clock_model.h, sim/MODEL-LOG.md): the H200's 1M steps -5.7 /
    // -7.4% -> -3.4 / -5.0%, the H100s' 4M step with its GPU tier -4.6 -> -7.7%.
    // 2026-11-29, attention's watts by head dim (sim/MODEL-LOG.md): the H100s' 4M step -7.3 ->
    // -8.2%, judged by the H100 profile of 2026-11-26, whose power group drew 717 W at head dim
    // 128's backward and 1332 W at 64's (then an mma.sync kernel); so 9% from 1M on. The twelve
    // rows' mean |error| 4.63 -> 4.59%.
    EXPECT_LE(std::abs(time), o.context_tokens >= (int64_t{1} << 20) ? 0.09 : 0.05) << f[2];
    worst_time = std::max(worst_time, std::abs(time));
    const std::vector<double> arenas = Numbers(f[13]);
    ASSERT_EQ(arenas.size(), static_cast<size_t>(o.pipeline_stages)) << f[2];
    std::string per_gpu;
    for (int32_t r = 0; r < o.pipeline_stages; ++r) {
      double planned =
          static_cast<double>(o.pipeline_stages == 1 ? p.gpu.peak_bytes
                                                     : p.gpu_peak_by_rank[static_cast<size_t>(r)]) /
          1073741824.0;
      // Built before the later stages saved one chunk's layer inputs only: they held two.
      if (r > 0 && f[17] == "b3406b7+stage-weights")
        planned += static_cast<double>(
                       geometry.layer_inputs_bytes(geometry.Chunk(geometry.num_chunks() - 1), r)) /
                   1073741824.0;
      EXPECT_NEAR(planned / arenas[static_cast<size_t>(r)], 1.0, 0.01) << f[2] << " rank " << r;
      char one[64];
      std::snprintf(one, sizeof one, "%s%.2f/%.2f", r ? "; " : "", arenas[static_cast<size_t>(r)],
                    planned);
      per_gpu += one;
    }
    const double host = static_cast<double>(p.host.peak_bytes) / 1073741824.0;
    EXPECT_NEAR(host / std::stod(f[15]), 1.0, 0.02) << f[2];
    std::printf(
        "  %8s tokens on %s GPU(s) of %s: step %7.2f s, predicted %7.2f (%+.1f%%); arena GiB "
        "measured/planned %s; host %.2f/%.2f GiB\n",
        f[2].c_str(), f[9].c_str(), f[0].c_str(), step, p.step_seconds(), 100 * time,
        per_gpu.c_str(), std::stod(f[15]), host);
  }
  EXPECT_EQ(rows, 12);
  std::printf("  worst step-time error %.1f%%\n", 100 * worst_time);
}

}  // namespace
}  // namespace ctxplan
