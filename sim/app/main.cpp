// ctxplan: how long a context can model M train on GPU G with host RAM R, and how fast?
//
//   ctxplan max-context            the largest context that fits, and what binds
//   ctxplan plan                   memory by category, step time, tokens/s, bottleneck, cost
//   ctxplan sweep                  a grid of configurations to CSV or JSON
//   ctxplan timeline               the simulated step as a Chrome trace (Perfetto) or .ctxtrace
//   ctxplan replay TRACE           a recorded step against the prediction, op by op
//   ctxplan list                   the catalogue
//
// sweep, replay, recommend, calibrate and selection each live in their own <name>_command.cpp.
//
// Exit codes: 0 success, 2 bad input (one line on stderr naming what and what is accepted),
// 1 an internal error (a bug).
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>

#include <CLI/CLI.hpp>

#include "calibrate_command.h"
#include "command_output.h"
#include "command_run.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/capacity.h"
#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/timeline_writer.h"
#include "ctxplan/sim/trace_recorder.h"
#include "ctxplan/traces/atomic_file.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/op_trace.h"
#include "json_out.h"
#include "recommend_command.h"
#include "replay_command.h"
#include "report_format.h"
#include "run_flags.h"
#include "selection_command.h"
#include "sweep_command.h"

namespace ctxplan::cli {
namespace {

// --- plan ----------------------------------------------------------------------------------
struct PlanFlags {
  RunFlags run;
  OutputFlags out;
  std::string path = "event";
  std::string train_tokens;
  std::optional<double> price;
};

int RunPlan(const PlanFlags& f) {
  const ModelSpec model = ResolveModel(f.run);
  const MachineSpec machine = ResolveMachine(f.run);
  const RunOptions options = ResolveWithTier(f.run, model, machine, true);
  if (f.path != "event" && f.path != "analytic")
    throw InputError("--path: '" + f.path + "' is not a path; accepted: event, analytic");
  if (f.price && !(*f.price >= 0.0 && *f.price < 1e9)) {
    char price[32];
    std::snprintf(price, sizeof price, "%g", *f.price);
    throw InputError(std::string("--price-per-gpu-hour: ") + price +
                     " is out of range; accepted: a price from 0 to 1e9 per GPU-hour");
  }
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(machine);
  sim::PlanReport report = MakeReport(plan.geometry(), machine, Predict(f.path, plan, time_model));
  if (!f.train_tokens.empty())
    sim::AddRunCost(report, ParseTokens(f.train_tokens, "--train-tokens"), f.price);
  else if (f.price)
    throw InputError("--price-per-gpu-hour: needs --train-tokens, the tokens to train on");
  const PlanContext context{model, machine, options, f.path};
  if (f.out.json) {
    JsonOut json;
    json.BeginObject();
    PlanJson(json, context, report);
    json.EndObject();
    Emit(json.Text(), f.out.output);
  } else {
    Emit(PlanText(context, report), f.out.output);
  }
  return 0;
}

// --- max-context ---------------------------------------------------------------------------
struct CapacityFlags {
  RunFlags run;
  OutputFlags out;
};

int RunMaxContext(const CapacityFlags& f) {
  const ModelSpec model = ResolveModel(f.run);
  const MachineSpec machine = ResolveMachine(f.run);
  const RunOptions options = ResolveOptions(f.run, model, false);
  const sim::GpuTierSetting tier = GpuTierOf(f.run);
  const sim::CapacityResult result = sim::FindMaxContext(model, machine, options, tier);

  RunOptions at_max = options;
  at_max.context_tokens = std::max<int64_t>(result.max_context_tokens, 1);
  at_max = sim::WithGpuTier(model, machine, at_max, tier);

  // The GPU-memory slope over the upper half of the reachable range: what one more token costs
  // on the GPU once the fixed buffers are paid. With a GPU tier, the tier of the maximum held
  // fixed and only beyond the context where the tiered store is full: the tier full, and the
  // host tier holding at least a chunk's largest union, so that the staging slots (which
  // stage the union's host pages only) have their full size. Up to there the slots grow, by at
  // most two parities of the largest union.
  double slope = 0.0;
  int64_t from = 0, to = 0;
  if (result.max_context_tokens >= 2 * options.chunk_tokens) {
    to = result.max_context_tokens;
    const int64_t full_store =
        at_max.offload && at_max.gpu_tier_pages > 0
            ? (at_max.gpu_tier_pages + PlanGeometry(model, at_max).max_union_pages()) *
                  at_max.page_tokens
            : 0;
    from = std::max(to / 2, full_store);
    if (from < to - options.chunk_tokens) {
      RunOptions lower = at_max;
      lower.context_tokens = from;
      const auto low = sim::AnalyticModel::PredictMemory(PlanGeometry(model, lower));
      slope = static_cast<double>(result.at_max.gpu_memory.allocated - low.gpu.peak_bytes) /
              static_cast<double>(to - from) * 10000.0 / 1e6;
    } else {
      from = to = 0;  // the tier fills near the maximum: no range to measure over
    }
  }
  const PlanContext context{model, machine, at_max, "analytic"};
  if (f.out.json) {
    JsonOut json;
    json.BeginObject()
        .Field("max_context_tokens", result.max_context_tokens)
        .Field("limit", sim::CapacityLimitName(result.limit))
        .Field("gpu_memory_slope_mb_per_10k_tokens", slope)
        .Field("slope_from_tokens", from)
        .Field("slope_to_tokens", to)
        .BeginObject("at_max");
    PlanJson(json, context, result.at_max);
    json.EndObject().EndObject();
    Emit(json.Text(), f.out.output);
  } else {
    Emit(CapacityText(context, result, slope, from, to), f.out.output);
  }
  return 0;
}

// --- timeline ------------------------------------------------------------------------------
struct TimelineFlags {
  RunFlags run;
  std::string output = "ctxplan-timeline.json";
  std::string format = "chrome";
};

// The metadata a trace carries so that replay can rebuild the plan it followed.
RunMetadata TraceMetadataFor(const ModelSpec& model, const MachineSpec& machine,
                             const RunOptions& options, const std::string& source) {
  RunMetadata m;
  m["source"] = source;
  m["model"] = model.name;
  m["machine"] = machine.name;
  m["gpu_name"] = machine.gpu.display_name;
  AddRunOptions(options, m);
  return m;
}

int RunCompactTimeline(const TimelineFlags& f, const ModelSpec& model, const MachineSpec& machine,
                       const RunOptions& options) {
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(machine);
  std::unique_ptr<OpTraceWriter> writer;
  try {
    writer = std::make_unique<OpTraceWriter>(
        f.output, TraceMetadataFor(model, machine, options, "ctxplan prediction"));
  } catch (const InputError& e) {
    ThrowOutputError(e);
  }
  sim::TraceRecorder recorder(*writer);
  const sim::StepPrediction prediction = sim::EventSimulator(time_model).Run(plan, &recorder);
  try {
    writer->Finish();
  } catch (const InputError& e) {
    ThrowOutputError(e);
  }
  std::fprintf(stderr, "ctxplan timeline: %llu ops, step %.3f s, written to %s\n",
               static_cast<unsigned long long>(prediction.op_count), prediction.step_seconds(),
               f.output.c_str());
  return 0;
}

int RunTimeline(const TimelineFlags& f) {
  const ModelSpec model = ResolveModel(f.run);
  const MachineSpec machine = ResolveMachine(f.run);
  const RunOptions options = ResolveWithTier(f.run, model, machine, true);
  if (f.format == "ctxtrace") return RunCompactTimeline(f, model, machine, options);
  if (f.format != "chrome")
    throw InputError("--format: '" + f.format +
                     "' is not a trace format; accepted: chrome, "
                     "ctxtrace");
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(machine);
  const auto file = OpenOutput(f.output);
  sim::StepPrediction prediction;
  {
    ChromeTraceWriter trace(file->stream());
    trace.Metadata("tool", "ctxplan timeline");
    trace.Metadata("model", model.name);
    trace.Metadata("machine", machine.name);
    trace.Metadata("options", DescribeOptions(options));
    trace.Metadata("context_tokens", options.context_tokens);
    trace.Metadata("plan_version", StepPlan::kVersion);
    sim::TimelineWriter timeline(trace);
    prediction = sim::EventSimulator(time_model).Run(plan, &timeline);
    trace.Finish();
  }
  CommitOutput(*file);
  std::fprintf(stderr, "ctxplan timeline: %llu ops, step %.3f s, written to %s\n",
               static_cast<unsigned long long>(prediction.op_count), prediction.step_seconds(),
               f.output.c_str());
  return 0;
}

// --- list ----------------------------------------------------------------------------------
int RunList() {
  std::string s = "models:";
  for (const std::string& name : CatalogModelNames()) s += " " + name;
  s += "\ngpus:";
  for (const std::string& name : CatalogGpuNames()) s += " " + name;
  s += "\nmachines:";
  for (const std::string& name : CatalogMachineNames()) s += " " + name;
  std::cout << s << "\n";
  return 0;
}

int Main(int argc, char** argv) {
  CLI::App app{"ctxplan: plan the longest context an LLM can train on a GPU, and how fast"};
  app.require_subcommand(1);
  app.set_version_flag("--version",
                       "ctxplan 0.1.0 (step plan v" + std::to_string(StepPlan::kVersion) + ")");

  PlanFlags plan;
  CLI::App* plan_cmd = app.add_subcommand("plan", "memory, step time and bottleneck of one run");
  AddRunFlags(*plan_cmd, plan.run, true);
  AddOutputFlags(*plan_cmd, plan.out);
  plan_cmd->add_option("--path", plan.path, "event (op by op) or analytic")->capture_default_str();
  plan_cmd->add_option("--train-tokens", plan.train_tokens, "tokens to train on, for GPU-hours");
  plan_cmd->add_option("--price-per-gpu-hour", plan.price, "price of one GPU-hour, for cost");

  CapacityFlags capacity;
  CLI::App* capacity_cmd =
      app.add_subcommand("max-context", "the largest context that fits, and which limit binds");
  AddRunFlags(*capacity_cmd, capacity.run, false);
  AddOutputFlags(*capacity_cmd, capacity.out);

  SweepFlags sweep;
  CLI::App* sweep_cmd = AddSweepCommand(app, sweep);

  TimelineFlags timeline;
  timeline.run.context = "64K";
  CLI::App* timeline_cmd =
      app.add_subcommand("timeline", "the simulated step as Chrome trace JSON (Perfetto)");
  AddRunFlags(*timeline_cmd, timeline.run, true);
  timeline_cmd->add_option("--output,-o", timeline.output, "trace file")->capture_default_str();
  timeline_cmd
      ->add_option("--format", timeline.format,
                   "chrome (JSON for Perfetto) or ctxtrace (compact, replayable)")
      ->capture_default_str();

  ReplayFlags replay;
  CLI::App* replay_cmd = AddReplayCommand(app, replay);

  RecommendFlags recommend;
  CLI::App* recommend_cmd = AddRecommendCommand(app, recommend);

  CLI::App* list_cmd = app.add_subcommand("list", "the model, GPU and machine catalogue");

  CalibrateFlags calibrate;
  CLI::App* calibrate_cmd = AddCalibrateCommand(app, calibrate);

  SelectionFlags selection;
  CLI::App* selection_cmd = AddSelectionCommand(app, selection);

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "ctxplan: " << OneLine(e.what()) << "; see ctxplan --help\n";
    return 2;
  }
  if (plan_cmd->parsed()) return RunPlan(plan);
  if (capacity_cmd->parsed()) return RunMaxContext(capacity);
  if (sweep_cmd->parsed()) {
    Emit(SweepReport(sweep), sweep.output);
    return 0;
  }
  if (timeline_cmd->parsed()) return RunTimeline(timeline);
  if (replay_cmd->parsed()) {
    Emit(ReplayReport(replay), replay.out.output);
    return 0;
  }
  if (recommend_cmd->parsed()) {
    recommend.gpu_tier_given = recommend_cmd->count("--gpu-tier") > 0;
    return RunRecommend(recommend);
  }
  if (list_cmd->parsed()) return RunList();
  if (calibrate_cmd->parsed()) return RunCalibrate(calibrate, argv[0]);
  if (selection_cmd->parsed()) {
    Emit(SelectionReport(selection), selection.output);
    return 0;
  }
  return 2;
}

}  // namespace
}  // namespace ctxplan::cli

int main(int argc, char** argv) {
  using ctxplan::cli::OneLine;
  try {
    return ctxplan::cli::Main(argc, argv);
  } catch (const ctxplan::InputError& e) {
    std::cerr << "ctxplan: " << OneLine(e.what()) << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "ctxplan: internal error: " << OneLine(e.what()) << "\n";
    return 1;
  }
}
