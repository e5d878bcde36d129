// Speed of the planner against its acceptance targets:
//   - the event simulation of one Qwen2.5-7B step at 1M tokens (chunk 4096, dense) under 1 s on
//     one core;
//   - the analytic path at least 10,000 configurations/s per core;
//   - `ctxplan max-context` under 100 ms end to end.
// Every benchmark is single-threaded, so its wall time is one core's time. After the Google
// Benchmark runs, the program times the real ctxplan binary and prints targets vs measured.
//
// CI builds this program but never runs it for timing: shared runners make timings meaningless.
// Run a Release build by hand:  build/sim/ctxplan_bench [--benchmark_filter=...]
#include <benchmark/benchmark.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/runtime/plan/run_options.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/capacity.h"
#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/sim/kernel_time_model.h"

#ifndef CTXPLAN_EXE
#error "sim/CMakeLists.txt must define CTXPLAN_EXE, the path of the ctxplan binary"
#endif

namespace ctxplan::sim {
namespace {

using Clock = std::chrono::steady_clock;

const ModelSpec& Qwen7B() {
  static const ModelSpec model = LoadModel("qwen2.5-7b");
  return model;
}

const MachineSpec& H200() {
  static const MachineSpec machine = LoadMachine("h200-125g");
  return machine;
}

// Seconds per call of each benchmark's final run (Google Benchmark reruns a function with more
// iterations until the timing is stable; the last run overwrites earlier ones).
std::map<std::string, double>& Measured() {
  static std::map<std::string, double> measured;
  return measured;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// --- the event path: one whole step, op by op --------------------------------------------------

// Arg: page budget (RunOptions::kAllPages = dense).
void BM_EventSimulation(benchmark::State& state) {
  RunOptions options;
  options.context_tokens = int64_t{1} << 20;
  options.chunk_tokens = 4096;
  options.page_budget = state.range(0);
  options.offload = true;
  const KernelTimeModel time_model(H200());
  uint64_t ops = 0;
  double predicted_step_s = 0.0;
  const auto start = Clock::now();
  for (auto _ : state) {
    // The plan is part of the work: its ops are generated as the simulator pulls them.
    const StepPlan plan(Qwen7B(), options);
    const StepPrediction prediction = EventSimulator(time_model).Run(plan);
    benchmark::DoNotOptimize(prediction.step_ticks);
    ops = prediction.op_count;
    predicted_step_s = prediction.step_seconds();
  }
  const double per_call = SecondsSince(start) / static_cast<double>(state.iterations());
  state.SetItemsProcessed(static_cast<int64_t>(ops) * state.iterations());  // items/s = ops/s
  state.counters["ops"] = static_cast<double>(ops);
  state.counters["wall_s"] = per_call;
  state.counters["predicted_step_s"] = predicted_step_s;
  Measured()[options.dense() ? "event_dense" : "event_sparse"] = per_call;
}
BENCHMARK(BM_EventSimulation)
    ->ArgName("budget")
    ->Arg(RunOptions::kAllPages)
    ->Arg(64)
    ->Unit(benchmark::kMillisecond);

// --- the analytic path: a sweep-sized grid ------------------------------------------------------

std::vector<RunOptions> AnalyticGrid() {
  std::vector<RunOptions> grid;
  for (int64_t context = 8 << 10; context <= (int64_t{1} << 20); context *= 2) {
    for (const int64_t chunk : {2048, 4096, 8192}) {
      for (const int64_t budget : {int64_t{64}, RunOptions::kAllPages}) {
        for (const bool offload : {true, false}) {
          for (const int64_t page : {64, 128, 256}) {
            RunOptions o;
            o.context_tokens = context;
            o.chunk_tokens = chunk;
            o.page_tokens = page;
            o.page_budget = budget;
            o.offload = offload;
            grid.push_back(o);
          }
        }
      }
    }
  }
  return grid;  // 8 contexts x 3 chunks x 2 budgets x 2 offloads x 3 pages = 288
}

void BM_AnalyticGrid(benchmark::State& state) {
  const std::vector<RunOptions> grid = AnalyticGrid();
  for (const RunOptions& o : grid) o.Validate(Qwen7B());  // a bad grid is the bench's bug
  const KernelTimeModel time_model(H200());
  const auto start = Clock::now();
  for (auto _ : state) {
    for (const RunOptions& o : grid) {
      // Geometry included: a sweep builds one per configuration.
      const StepPrediction prediction =
          AnalyticModel(time_model).Predict(PlanGeometry(Qwen7B(), o));
      benchmark::DoNotOptimize(prediction.step_ticks);
    }
  }
  const double configs = static_cast<double>(grid.size());
  Measured()["analytic_config"] =
      SecondsSince(start) / (static_cast<double>(state.iterations()) * configs);
  state.counters["configs"] = configs;
  state.counters["configs/s"] =
      benchmark::Counter(configs, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_AnalyticGrid)->Unit(benchmark::kMillisecond);

// --- the max-context search, in process -----------------------------------------------------

void BM_MaxContext(benchmark::State& state) {
  int64_t tokens = 0;
  const auto start = Clock::now();
  for (auto _ : state) {
    const CapacityResult result = FindMaxContext(Qwen7B(), H200(), RunOptions{});
    tokens = result.max_context_tokens;
    benchmark::DoNotOptimize(tokens);
  }
  const double per_call = SecondsSince(start) / static_cast<double>(state.iterations());
  state.counters["ms/call"] = per_call * 1e3;
  state.counters["max_context_tokens"] = static_cast<double>(tokens);
  Measured()["max_context_lib"] = per_call;
}
BENCHMARK(BM_MaxContext)->Unit(benchmark::kMicrosecond);

// --- end to end: the program as a user runs it --------------------------------------------------

// Mean wall seconds of `ctxplan max-context` (process start, catalogue load, search, output),
// after one warm-up run that pages the binary in; negative if the program failed.
double TimeMaxContextProgram(int runs) {
  const std::string command = std::string("'") + CTXPLAN_EXE + "' max-context > /dev/null";
  if (std::system(command.c_str()) != 0) return -1.0;
  const auto start = Clock::now();
  for (int i = 0; i < runs; ++i) {
    if (std::system(command.c_str()) != 0) return -1.0;
  }
  return SecondsSince(start) / runs;
}

// One row: "what: measured (target) PASS|MISS, measured/target". `at_least` targets are rates.
void PrintRow(const char* what, const char* key, double target, bool at_least,
              double (*to_display)(double), const char* unit) {
  const auto it = Measured().find(key);
  if (it == Measured().end()) {
    std::printf("  %-34s not run\n", what);
    return;
  }
  if (it->second < 0) {
    std::printf("  %-34s FAILED (the program exited with an error)\n", what);
    return;
  }
  const double value = to_display(it->second);
  const bool pass = at_least ? value >= target : value < target;
  std::printf("  %-34s %10.3f %-9s (target %s %g %s)  %s  measured/target %.3f\n", what, value,
              unit, at_least ? ">=" : "<", target, unit, pass ? "PASS" : "MISS", value / target);
}

void PrintTargets() {
  std::printf("\nAcceptance targets (single-threaded, one core):\n");
  const auto seconds = [](double s) { return s; };
  const auto millis = [](double s) { return s * 1e3; };
  const auto per_second = [](double s) { return 1.0 / s; };
  PrintRow("event sim 1M dense, chunk 4096", "event_dense", 1.0, false, seconds, "s");
  PrintRow("event sim 1M sparse k=64", "event_sparse", 1.0, false, seconds, "s");
  PrintRow("analytic path", "analytic_config", 10'000, true, per_second, "configs/s");
  PrintRow("max-context search (in process)", "max_context_lib", 100, false, millis, "ms");
  PrintRow("ctxplan max-context (end to end)", "max_context_program", 100, false, millis, "ms");
}

}  // namespace
}  // namespace ctxplan::sim

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  try {
    benchmark::RunSpecifiedBenchmarks();
    constexpr int kRuns = 20;
    const double program_s = ctxplan::sim::TimeMaxContextProgram(kRuns);
    ctxplan::sim::Measured()["max_context_program"] = program_s;
    std::printf("\nctxplan max-context end to end: mean of %d runs %.2f ms (%s)\n", kRuns,
                program_s * 1e3, CTXPLAN_EXE);
    ctxplan::sim::PrintTargets();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ctxplan_bench: %s\n", e.what());
    return 1;
  }
  benchmark::Shutdown();
  return 0;
}
