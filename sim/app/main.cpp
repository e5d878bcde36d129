// ctxplan: how long a context can model M train on GPU G with host RAM R, and how fast?
//
//   ctxplan max-context            the largest context that fits, and what binds
//   ctxplan plan                   memory by category, step time, tokens/s, bottleneck, cost
//   ctxplan sweep                  a grid of configurations to CSV or JSON
//   ctxplan timeline               the simulated step as a Chrome trace (Perfetto) or .ctxtrace
//   ctxplan replay TRACE           a recorded step against the prediction, op by op
//   ctxplan list                   the catalogue
//
// Exit codes: 0 success, 2 bad input (one line on stderr naming what and what is accepted),
// 1 an internal error (a bug).
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string_view>

#include <CLI/CLI.hpp>

#include "calibrate_command.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/capacity.h"
#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/kernel_changes.h"
#include "ctxplan/sim/recommend.h"
#include "ctxplan/sim/replay.h"
#include "ctxplan/sim/timeline_writer.h"
#include "ctxplan/sim/trace_recorder.h"
#include "ctxplan/traces/atomic_file.h"
#include "ctxplan/traces/chrome_trace_writer.h"
#include "ctxplan/traces/op_trace.h"
#include "json_out.h"
#include "progress_bar.h"
#include "report_format.h"
#include "run_flags.h"
#include "selection_command.h"

namespace ctxplan::cli {
namespace {

// The run options of the flags with the GPU tier sized for the machine (sim/gpu_tier.h).
sim::GpuTierSetting GpuTierOf(const RunFlags& f) {
  return sim::ParseGpuTierSetting(f.gpu_tier, f.gpu_tier_margin, "--gpu-tier");
}
RunOptions ResolveWithTier(const RunFlags& f, const ModelSpec& model, const MachineSpec& machine,
                           bool with_context) {
  return sim::WithGpuTier(model, machine, ResolveOptions(f, model, with_context), GpuTierOf(f));
}

struct OutputFlags {
  bool json = false;
  std::string output;  // empty: stdout
};

void AddOutputFlags(CLI::App& app, OutputFlags& f) {
  app.add_flag("--json", f.json, "print JSON instead of text");
  app.add_option("--output,-o", f.output, "write to this file (atomically) instead of stdout");
}

// AtomicFileWriter's errors name the path only; the flag and what it accepts make them actionable.
[[noreturn]] void ThrowOutputError(const InputError& e) {
  throw InputError(std::string("--output: ") + e.what() +
                   "; accepted: a file in an existing, writable directory");
}

std::unique_ptr<AtomicFileWriter> OpenOutput(const std::string& path) {
  try {
    return std::make_unique<AtomicFileWriter>(path);
  } catch (const InputError& e) {
    ThrowOutputError(e);
  }
}

void CommitOutput(AtomicFileWriter& file) {
  try {
    file.Commit();
  } catch (const InputError& e) {
    ThrowOutputError(e);
  }
}

// Writes the whole result at once: to stdout, or to a temp file renamed onto the target, so a
// failure never leaves half an output behind.
void Emit(const std::string& text, const std::string& path) {
  if (path.empty()) {
    // A full disk or a closed pipe must not pass for success: a script would read a cut result.
    errno = 0;
    std::cout << text << std::flush;
    if (!std::cout)
      throw InputError(std::string("standard output: write failed (") +
                       (errno != 0 ? std::strerror(errno) : "stream error") +
                       "); accepted: a writable stdout, or --output FILE");
    return;
  }
  const auto file = OpenOutput(path);
  file->stream() << text;
  CommitOutput(*file);
}

// Every error is one line on stderr, whatever the user typed: control characters echoed back
// from a flag value or a file name are escaped.
std::string OneLine(std::string_view message) {
  std::string line;
  for (const char c : message) {
    if (c == '\n') {
      line += "\\n";
    } else if (c == '\r') {
      line += "\\r";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned char>(c));
      line += hex;
    } else {
      line += c;
    }
  }
  return line;
}

sim::StepPrediction Predict(const std::string& path, const StepPlan& plan,
                            const sim::KernelTimeModel& time_model) {
  if (path == "event") return sim::EventSimulator(time_model).Run(plan);
  return sim::AnalyticModel(time_model).Predict(plan.geometry());
}

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

// --- sweep ---------------------------------------------------------------------------------
struct SweepFlags {
  RunFlags run;
  std::string format = "csv";
  std::string output;
  std::string path = "analytic";
};

int RunSweep(SweepFlags f) {
  if (f.format != "csv" && f.format != "json")
    throw InputError("--format: '" + f.format + "' is not a format; accepted: csv, json");
  if (f.path != "event" && f.path != "analytic")
    throw InputError("--path: '" + f.path + "' is not a path; accepted: event, analytic");
  const ModelSpec model = ResolveModel(f.run);
  const MachineSpec machine = ResolveMachine(f.run);
  const sim::KernelTimeModel time_model(machine);

  // Validate every combination before the first simulation: bad input costs nothing. A value
  // no combination accepts is an error (its first message); a combination of values that each
  // run elsewhere (chunk 1024 with page 96) is skipped, and the skips are said on stderr.
  struct Axis {
    std::string RunFlags::*field;
    std::vector<std::string> values;
    std::vector<bool> runs;             // by value: some combination with it resolved
    std::vector<std::string> refusals;  // by value: the first combination's error
  };
  std::vector<Axis> axes;
  for (auto [field, text] :
       {std::pair{&RunFlags::context, f.run.context}, std::pair{&RunFlags::chunk, f.run.chunk},
        std::pair{&RunFlags::page, f.run.page}, std::pair{&RunFlags::budget, f.run.budget},
        std::pair{&RunFlags::offload, f.run.offload}, std::pair{&RunFlags::gpus, f.run.gpus}}) {
    std::vector<std::string> values = SplitList(text);
    const size_t n = values.size();
    axes.push_back(
        {field, std::move(values), std::vector<bool>(n, false), std::vector<std::string>(n)});
  }
  std::vector<RunOptions> grid;
  std::vector<size_t> index(axes.size(), 0);
  int64_t combinations = 0;
  std::string first_skip;
  while (true) {
    RunFlags one = f.run;
    for (size_t a = 0; a < axes.size(); ++a) one.*(axes[a].field) = axes[a].values[index[a]];
    ++combinations;
    try {
      grid.push_back(ResolveWithTier(one, model, machine, true));
      for (size_t a = 0; a < axes.size(); ++a) axes[a].runs[index[a]] = true;
    } catch (const InputError& e) {
      for (size_t a = 0; a < axes.size(); ++a)
        if (axes[a].refusals[index[a]].empty()) axes[a].refusals[index[a]] = e.what();
      if (first_skip.empty()) first_skip = e.what();
    }
    size_t a = 0;
    while (a < axes.size() && ++index[a] == axes[a].values.size()) index[a++] = 0;
    if (a == axes.size()) break;
  }
  for (const Axis& axis : axes)
    for (size_t v = 0; v < axis.values.size(); ++v)
      if (!axis.runs[v]) throw InputError(axis.refusals[v]);
  if (const int64_t skipped = combinations - static_cast<int64_t>(grid.size()); skipped > 0)
    std::cerr << "ctxplan: sweep: skipped " << skipped << " of " << combinations
              << " combinations that cannot run, e.g. " << first_skip << "\n";

  std::string text;
  JsonOut json;
  if (f.format == "csv") {
    text =
        "model,machine,context_tokens,chunk_tokens,page_tokens,page_budget,offload,"
        "gpu_allocated_bytes,gpu_device_bytes,host_peak_bytes,fits,step_seconds,"
        "tokens_per_second,bottleneck,gpu_tier_pages,gpus\n";
  } else {
    json.BeginObject().Field("model", model.name).Field("machine", machine.name);
    json.BeginArray("results");
  }
  ProgressBar progress("sweep", static_cast<int64_t>(grid.size()));
  for (size_t i = 0; i < grid.size(); ++i) {
    const RunOptions& o = grid[i];
    const StepPlan plan(model, o);
    const sim::PlanReport r =
        MakeReport(plan.geometry(), machine, Predict(f.path, plan, time_model));
    if (f.format == "csv") {
      char row[512];
      std::snprintf(
          row, sizeof row, "%s,%s,%lld,%lld,%lld,%s,%s,%lld,%lld,%lld,%s,%.6f,%.1f,%s,%lld,%d\n",
          model.name.c_str(), machine.name.c_str(), static_cast<long long>(o.context_tokens),
          static_cast<long long>(o.chunk_tokens), static_cast<long long>(o.page_tokens),
          o.dense() ? "all" : std::to_string(o.page_budget).c_str(), o.offload ? "on" : "off",
          static_cast<long long>(r.gpu_memory.allocated),
          static_cast<long long>(r.gpu_memory.device), static_cast<long long>(r.host_peak),
          r.fits() ? "yes" : "no", r.prediction.step_seconds(), r.tokens_per_second,
          std::string(sim::BottleneckName(r.bottleneck)).c_str(),
          static_cast<long long>(o.offload ? o.gpu_tier_pages : 0), o.pipeline_stages);
      text += row;
    } else {
      json.BeginObject();
      PlanJson(json, PlanContext{model, machine, o, f.path}, r);
      json.EndObject();
    }
    progress.Update(static_cast<int64_t>(i + 1));
  }
  progress.Done();
  if (f.format == "json") {
    json.EndArray().EndObject();
    text = json.Text();
  }
  Emit(text, f.output);
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

// --- replay --------------------------------------------------------------------------------
struct ReplayFlags {
  std::string trace;
  std::string by_chunk;   // an op kind, optionally ".part": its ops chunk by chunk
  std::string model;      // the trace's model as a file, when outside the catalogue
  std::string selection;  // the union rule to predict with, instead of the run's
  RunFlags run;
  OutputFlags out;
};

std::string KindPartName(OpKind kind, OpPart part) {
  std::string name(OpKindName(kind));
  if (part != OpPart::kNone) name += "." + std::string(OpPartName(part));
  return name;
}

// The ops of `name` (an op kind, or kind.part) chunk by chunk; an InputError naming the kinds the
// trace holds when none match.
std::vector<sim::ChunkComparison> ChunksOf(const sim::ReplayResult& r, const std::string& name) {
  std::vector<sim::ChunkComparison> rows;
  for (const sim::ChunkComparison& c : r.by_chunk)
    if (KindPartName(c.kind, c.part) == name || std::string(OpKindName(c.kind)) == name)
      rows.push_back(c);
  if (rows.empty()) {
    std::string accepted;
    for (const sim::KindComparison& k : r.by_kind)
      accepted += (accepted.empty() ? "" : ", ") + KindPartName(k.kind, k.part);
    throw InputError("--by-chunk: '" + name +
                     "' is not an op kind of this trace; accepted: " + accepted);
  }
  return rows;
}

int RunReplay(ReplayFlags f) {
  const OpTrace trace = ReadOpTrace(f.trace);
  const auto model_name = trace.metadata.find("model");
  if (model_name == trace.metadata.end())
    throw InputError(f.trace +
                     ": metadata key 'model' is missing; accepted: a trace written by "
                     "ctxtrain or ctxplan");
  // The trace names its model; one outside the catalogue (a .yaml or config.json ctxtrain was
  // given) comes from --model, which must be that model.
  RunFlags model_flags;
  model_flags.model = f.model;
  const ModelSpec model =
      f.model.empty() ? LoadModel(model_name->second) : ResolveModel(model_flags);
  if (model.name != model_name->second)
    throw InputError("--model " + f.model + " is model '" + model.name + "', but " + f.trace +
                     " is a trace of '" + model_name->second + "'; accepted: the trace's model");
  // The machine the run was planned for, unless the command line names another: a prediction for
  // another GPU than the one measured compares nothing, so the report says where it came from.
  MachineSpec machine;
  std::string machine_from;
  if (f.run.machine.empty() && f.run.gpu.empty()) {
    sim::ReplayMachine planned = sim::MachineOfTrace(trace.metadata, f.trace);
    machine = std::move(planned.machine);
    machine_from = std::move(planned.origin);
    if (!f.run.host_ram.empty()) {  // the trace's machine with other host RAM, as on a preset
      const int64_t ram = ParseBytes(f.run.host_ram, "--host-ram");
      try {
        MakeMachine(machine.gpu, ram);  // the bounds --host-ram has everywhere
      } catch (const InputError& e) {
        throw InputError(std::string("--host-ram: ") + e.what());
      }
      if (ram <= machine.host_reserved_bytes)
        throw InputError("--host-ram: " + FormatGiB(ram) + " leaves nothing after the " +
                         FormatGiB(machine.host_reserved_bytes) +
                         " the OS keeps; accepted: more host RAM than that");
      machine.host_ram_bytes = ram;
      machine.name += "+" + f.run.host_ram;
      machine_from += ", host RAM from --host-ram";
    }
  } else {
    machine = ResolveMachine(f.run);
    machine_from = f.run.gpu.empty() ? "from --machine" : "from --gpu";
  }
  RunOptions options = RunOptionsFromMetadata(trace.metadata, f.trace);
  // A selection measured since (ctxplan selection) times the copies; the ops stay the run's.
  if (!f.selection.empty()) options.selection = ParseSelectionModel(f.selection, "--selection");
  options.Validate(model);
  const StepPlan plan(model, options);
  const sim::KernelTimeModel time_model(machine);
  const sim::ReplayResult r = sim::Replay(trace, plan, time_model, f.trace);
  const std::vector<sim::ChunkComparison> chunks =
      f.by_chunk.empty() ? std::vector<sim::ChunkComparison>{} : ChunksOf(r, f.by_chunk);
  auto source = trace.metadata.find("source");
  const std::string from = source == trace.metadata.end() ? "unknown" : source->second;
  // Kernels changed between the run and the profile's calibration (sim/kernel_changes.h): the
  // replay then sets one kernel's times against another's.
  const auto recorded = trace.metadata.find("date");
  const std::string run_date = recorded == trace.metadata.end() ? "" : recorded->second;
  const KernelProfile profile = sim::EffectiveKernelProfile(machine.gpu);
  const std::vector<sim::KernelChange> changes =
      sim::ChangesBetween(profile, run_date, options.page_tokens, model.head_dim);
  if (f.out.json) {
    JsonOut j;
    j.BeginObject().Field("trace", f.trace).Field("source", from).Field("model", model.name);
    j.Field("machine", machine.name).Field("machine_from", machine_from);
    j.BeginArray("kernel_changes_between_run_and_profile");
    for (const sim::KernelChange& c : changes) j.Field("", std::string(c.date));  // elements
    j.EndArray();
    j.Field("measured_step_seconds", r.measured_step_seconds);
    j.Field("predicted_step_seconds", r.predicted_step_seconds);
    j.Field("plan_ops", static_cast<int64_t>(r.plan_ops));
    j.Field("rank", static_cast<int64_t>(r.rank));
    j.Field("traced_ops", static_cast<int64_t>(r.traced_ops));
    j.Field("measured_gpu_peak_bytes", r.measured_gpu_peak);
    j.Field("predicted_gpu_peak_bytes", r.predicted_gpu_peak);
    j.Field("measured_host_peak_bytes", r.measured_host_peak);
    j.Field("predicted_host_peak_bytes", r.predicted_host_peak);
    if (r.unions.layers > 0) {
      j.Field("union_layers", r.unions.layers);
      j.Field("measured_union_pages", r.unions.measured_pages);
      j.Field("predicted_union_pages", r.unions.predicted_pages);
      j.Field("union_independent_tiles", r.unions.independent_tiles);
      j.Field("planned_union_independent_tiles", r.unions.planned_independent_tiles);
    }
    j.BeginArray("by_kind");
    for (const sim::KindComparison& k : r.by_kind)
      j.BeginObject()
          .Field("kind", OpKindName(k.kind))
          .Field("part", OpPartName(k.part))
          .Field("count", k.count)
          .Field("measured_seconds", k.measured_seconds)
          .Field("predicted_seconds", k.predicted_seconds)
          .EndObject();
    j.EndArray();
    j.BeginArray("copies_by_phase");
    for (const sim::PhaseComparison& c : r.copies_by_phase)
      j.BeginObject()
          .Field("kind", OpKindName(c.kind))
          .Field("phase", PhaseName(c.phase))
          .Field("count", c.count)
          .Field("measured_seconds", c.measured_seconds)
          .Field("predicted_seconds", c.predicted_seconds)
          .Field("predicted_bytes", c.predicted_bytes)
          .EndObject();
    j.EndArray();
    if (!f.by_chunk.empty()) {
      j.BeginArray("by_chunk");
      for (const sim::ChunkComparison& c : chunks)
        j.BeginObject()
            .Field("kind", OpKindName(c.kind))
            .Field("part", OpPartName(c.part))
            .Field("chunk", static_cast<int64_t>(c.chunk))
            .Field("count", c.count)
            .Field("measured_seconds", c.measured_seconds)
            .Field("predicted_seconds", c.predicted_seconds)
            .EndObject();
      j.EndArray();
    }
    j.BeginObject("compute_idle")
        .Field("measured_seconds", r.measured_compute_idle_seconds)
        .Field("predicted_seconds", r.predicted_compute_idle_seconds);
    j.BeginArray("waits");
    for (const sim::IdleComparison& g : r.compute_idle)
      j.BeginObject()
          .Field("phase", PhaseName(g.phase))
          .Field("waited_for", OpKindName(g.after))
          .Field("after", OpKindName(g.before))
          .Field("measured_count", g.measured_count)
          .Field("measured_seconds", g.measured_seconds)
          .Field("predicted_count", g.predicted_count)
          .Field("predicted_seconds", g.predicted_seconds)
          .EndObject();
    j.EndArray().EndObject();
    j.BeginArray("worst_ops");
    for (const sim::OpComparison& c : r.worst)
      j.BeginObject()
          .Field("op_id", static_cast<int64_t>(c.measured.op_id))
          .Field("kind", OpKindName(static_cast<OpKind>(c.measured.kind)))
          .Field("chunk", c.measured.chunk)
          .Field("layer", c.measured.layer)
          .Field("measured_seconds", c.measured_seconds)
          .Field("predicted_seconds", c.predicted_seconds)
          .EndObject();
    j.EndArray().EndObject();
    Emit(j.Text(), f.out.output);
    return 0;
  }
  char line[256];
  std::string s = "ctxplan replay: " + f.trace + " (" + from + ", " + model.name + ") against " +
                  machine.name + " (" + machine_from + ")\n";
  for (const sim::KernelChange& c : changes)
    s += "note: this run was recorded on " + run_date +
         " and the GPU's kernel times calibrated on " + profile.date + "; between the two, on " +
         std::string(c.date) + ", " + std::string(c.what) + ": at pages of " +
         std::to_string(options.page_tokens) + ", head dim " + std::to_string(model.head_dim) +
         " the replay sets one kernel's times against another's\n";
  if (plan.geometry().stages() > 1 && r.rank >= 0)
    s += "GPU " + std::to_string(r.rank) + " of " + std::to_string(plan.geometry().stages()) +
         " (pipeline stage of layers " + std::to_string(plan.geometry().stage_first_layer(r.rank)) +
         "-" + std::to_string(plan.geometry().stage_first_layer(r.rank + 1) - 1) +
         "): its ops and memory; the step is the pipeline's\n";
  std::snprintf(
      line, sizeof line, "step: measured %.6f s, predicted %.6f s (measured/predicted %.3f)\n",
      r.measured_step_seconds, r.predicted_step_seconds,
      r.predicted_step_seconds > 0 ? r.measured_step_seconds / r.predicted_step_seconds : 0.0);
  s += line;
  s += "ops: " + FormatCount(static_cast<int64_t>(r.traced_ops)) + " of " +
       FormatCount(static_cast<int64_t>(r.plan_ops)) + " kernels and copies of the plan traced\n";
  if (r.measured_gpu_peak > 0 || r.measured_host_peak > 0)
    s += "memory peaks of the plan's alloc/free ops on the measured clock: GPU " +
         FormatGiB(r.measured_gpu_peak) + " (predicted " + FormatGiB(r.predicted_gpu_peak) +
         "), host " + FormatGiB(r.measured_host_peak) + " (predicted " +
         FormatGiB(r.predicted_host_peak) + ")\n";
  // What the runtime's allocators held, when the trace carries it (ctxtrain on CUDA).
  auto bytes_of = [&](const char* key) -> int64_t {
    const auto it = trace.metadata.find(key);
    if (it == trace.metadata.end()) return -1;
    try {
      return std::stoll(it->second);
    } catch (const std::exception&) {
      return -1;
    }
  };
  const int64_t arena = bytes_of("gpu_arena_allocated_bytes");
  const int64_t device = bytes_of("gpu_device_used_bytes");
  const int64_t host = bytes_of("host_runtime_bytes");
  if (arena >= 0 && device >= 0 && host >= 0)
    s += "memory held by the runtime: GPU arena " + FormatGiB(arena) + ", device-level " +
         FormatGiB(device) + "; host " + FormatGiB(host) + "\n";
  if (r.unions.layers > 0) {
    std::snprintf(
        line, sizeof line,
        "page unions of %lld sparse layers: measured %.0f pages, predicted %.0f "
        "(x%.2f); as if %.2f of the tiles drew independently (the plan: %.2f)\n",
        static_cast<long long>(r.unions.layers), r.unions.measured_pages, r.unions.predicted_pages,
        r.unions.measured_pages > 0 ? r.unions.predicted_pages / r.unions.measured_pages : 0.0,
        r.unions.independent_tiles, r.unions.planned_independent_tiles);
    s += line;
  }
  s += "by kind                      count    measured s   predicted s   ratio\n";
  for (const sim::KindComparison& k : r.by_kind) {
    const std::string name = KindPartName(k.kind, k.part);
    std::snprintf(line, sizeof line, "  %-24s %9lld %13.6f %13.6f %7.3f\n", name.c_str(),
                  static_cast<long long>(k.count), k.measured_seconds, k.predicted_seconds,
                  k.predicted_seconds > 0 ? k.measured_seconds / k.predicted_seconds : 0.0);
    s += line;
  }
  if (std::any_of(r.by_kind.begin(), r.by_kind.end(), [](const sim::KindComparison& k) {
        return k.kind == OpKind::kPeerSend || k.kind == OpKind::kPeerRecv;
      }))
    s += "  (peer_send, peer_recv: an NCCL kernel spans its wait for the other GPU too; the plan "
         "times the transfer alone and puts the wait in the step)\n";
  if (!r.copies_by_phase.empty()) {
    s += "host copies by phase           count    measured s   predicted s   ratio   plan GB  "
         "(GB/s if measured)\n";
    for (const sim::PhaseComparison& c : r.copies_by_phase) {
      const std::string name =
          std::string(OpKindName(c.kind)) + " " + std::string(PhaseName(c.phase));
      std::snprintf(line, sizeof line, "  %-24s %9lld %13.6f %13.6f %7.3f %9.1f  (%.1f)\n",
                    name.c_str(), static_cast<long long>(c.count), c.measured_seconds,
                    c.predicted_seconds,
                    c.predicted_seconds > 0 ? c.measured_seconds / c.predicted_seconds : 0.0,
                    c.predicted_bytes / 1e9,
                    c.measured_seconds > 0 ? c.predicted_bytes / 1e9 / c.measured_seconds : 0.0);
      s += line;
    }
  }
  if (!f.by_chunk.empty()) {
    s += "by chunk, " + f.by_chunk +
         " (per op)\n  chunk      ops   measured ms  predicted ms   ratio\n";
    for (const sim::ChunkComparison& c : chunks) {
      const double n = static_cast<double>(c.count);
      std::snprintf(line, sizeof line, "  %5d %8lld %13.4f %13.4f %7.3f\n", c.chunk,
                    static_cast<long long>(c.count), c.measured_seconds * 1e3 / n,
                    c.predicted_seconds * 1e3 / n,
                    c.predicted_seconds > 0 ? c.measured_seconds / c.predicted_seconds : 0.0);
      s += line;
    }
  }
  if (r.measured_compute_idle_seconds > 0 || r.predicted_compute_idle_seconds > 0) {
    std::snprintf(line, sizeof line,
                  "compute stream idle between its ops: measured %.3f s, predicted %.3f s; the "
                  "largest waits (phase: the op waited for, after which op)\n",
                  r.measured_compute_idle_seconds, r.predicted_compute_idle_seconds);
    s += line;
    s += "  phase      waited for          after                  count    measured s   "
         "count   predicted s\n";
    for (const sim::IdleComparison& g : r.compute_idle) {
      std::snprintf(
          line, sizeof line, "  %-10s %-19s %-19s %8lld %13.6f %7lld %13.6f\n",
          std::string(PhaseName(g.phase)).c_str(), std::string(OpKindName(g.after)).c_str(),
          std::string(OpKindName(g.before)).c_str(), static_cast<long long>(g.measured_count),
          g.measured_seconds, static_cast<long long>(g.predicted_count), g.predicted_seconds);
      s += line;
    }
  }
  s += "largest differences (op id, kind, chunk, layer, measured s, predicted s)\n";
  for (const sim::OpComparison& c : r.worst) {
    std::snprintf(line, sizeof line, "  %10llu %-18s %5d %4d %12.6f %12.6f\n",
                  static_cast<unsigned long long>(c.measured.op_id),
                  std::string(OpKindName(static_cast<OpKind>(c.measured.kind))).c_str(),
                  c.measured.chunk, c.measured.layer, c.measured_seconds, c.predicted_seconds);
    s += line;
  }
  Emit(s, f.out.output);
  return 0;
}

// --- recommend -----------------------------------------------------------------------------
struct RecommendFlags {
  RunFlags run;
  OutputFlags out;
  bool gpu_tier_given = false;  // else recommend searches the tier too
};

std::string MachineFlagsOf(const RunFlags& f) {
  std::string s = f.gpu.empty() ? "--machine " + (f.machine.empty() ? "h200-125g" : f.machine)
                                : "--gpu " + f.gpu;
  if (!f.host_ram.empty()) s += " --host-ram " + f.host_ram;
  return s;
}

int RunRecommend(const RecommendFlags& f) {
  const ModelSpec model = ResolveModel(f.run);
  const MachineSpec machine = ResolveMachine(f.run);
  const RunOptions base = ResolveOptions(f.run, model, true);
  const sim::GpuTierSetting tier = GpuTierOf(f.run);
  // No --gpu-tier given: the tier is one of the choices searched.
  sim::RecommendSpace space;
  space.gpu_tiers = f.gpu_tier_given ? std::vector<sim::GpuTierSetting>{tier}
                                     : sim::SearchedGpuTiers(f.run.gpu_tier_margin);
  const sim::Recommendation r = sim::Recommend(model, machine, base, tier, space);
  const std::string machine_flags = MachineFlagsOf(f.run);
  auto fmt = [](const char* format, double value) {
    char text[64];
    std::snprintf(text, sizeof text, format, value);
    return std::string(text);
  };
  struct Pick {
    const char* key;
    const char* title;
    const std::optional<sim::RecommendCandidate>& candidate;
  };
  const Pick picks[] = {{"fastest", "fastest", r.fastest},
                        {"longest_context", "longest context", r.longest},
                        {"least_gpu_memory", "least GPU memory", r.least_memory}};
  if (f.out.json) {
    JsonOut json;
    json.BeginObject()
        .Field("model", model.name)
        .Field("machine", machine.name)
        .Field("context_tokens", base.context_tokens)
        .Field("evaluated", r.evaluated)
        .Field("fitting", r.fitting);
    for (const Pick& p : picks) {
      if (!p.candidate) continue;
      const sim::RecommendCandidate& c = *p.candidate;
      json.BeginObject(p.key);
      PlanJson(json, PlanContext{model, machine, c.options, "analytic"}, c.report);
      json.Field("max_context_tokens", c.max_context_tokens)
          .Field("ctxtrain", sim::CtxtrainCommand(model, machine_flags, c.options, c.gpu_tier))
          .EndObject();
    }
    json.EndObject();
    Emit(json.Text(), f.out.output);
    return r.fastest ? 0 : 3;
  }
  std::string s = "ctxplan recommend: " + model.name + " on " + machine.name + " at " +
                  FormatTokens(base.context_tokens) + " tokens\n";
  s += "  searched chunk, page, offload" +
       (!f.gpu_tier_given ? std::string(" (GPU tier off and auto)")
        : tier.off()      ? std::string()
                          : " (GPU tier " + sim::DescribeGpuTierSetting(tier) + ")") +
       ", keeping layer inputs and the optimizer's placement: " + FormatCount(r.evaluated) +
       " configurations, " + FormatCount(r.fitting) + " fit\n";
  s += "  kept as given: " + DescribeOptions(base) + "\n";
  if (!base.dense())
    s += "  (page-sparse: chunk and page size also shape which earlier positions are attended)\n";
  if (!r.fastest) {
    s += "\nNothing fits at this context: see ctxplan max-context.\n";
    Emit(s, f.out.output);
    return 3;
  }
  for (const Pick& p : picks) {
    const sim::RecommendCandidate& c = *p.candidate;
    const RunOptions& o = c.options;
    s += "\n" + std::string(p.title) + ": chunk " + FormatCount(o.chunk_tokens) + ", page " +
         FormatCount(o.page_tokens) + ", offload " + (o.offload ? "on" : "off") +
         (o.offload && o.gpu_tier_pages > 0
              ? " (GPU tier " + FormatCount(o.gpu_tier_pages) + " pages a layer)"
              : std::string()) +
         ", layer inputs " + (o.keep_layer_inputs ? "kept" : "recomputed") + ", optimizer " +
         std::string(OptimizerName(o.optimizer)) + "\n";
    s += "  " + fmt("%.0f tokens/s", c.report.tokens_per_second) + ", step " +
         fmt("%.2f s", c.report.prediction.step_seconds()) + ", GPU " +
         FormatGiB(c.report.gpu_memory.device) + ", pinned host " + FormatGiB(c.report.host_peak) +
         "; max context " + FormatTokens(c.max_context_tokens) + " tokens\n";
    s += "  " + sim::CtxtrainCommand(model, machine_flags, o, c.gpu_tier) + "\n";
  }
  Emit(s, f.out.output);
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
  sweep.run.context = "32K,128K,512K,1M";
  CLI::App* sweep_cmd = app.add_subcommand("sweep", "a grid of configurations, to CSV or JSON");
  AddRunFlags(*sweep_cmd, sweep.run, true, true);
  sweep_cmd->add_option("--format", sweep.format, "csv or json")->capture_default_str();
  sweep_cmd->add_option("--output,-o", sweep.output, "write to this file instead of stdout");
  sweep_cmd->add_option("--path", sweep.path, "analytic (fast) or event")->capture_default_str();

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
  CLI::App* replay_cmd = app.add_subcommand(
      "replay", "compare a recorded step (.ctxtrace) with the prediction, op by op");
  replay_cmd->add_option("trace", replay.trace, "the .ctxtrace file")->required();
  replay_cmd->add_option("--machine", replay.run.machine,
                         "machine preset (default: the one the trace was planned for, else "
                         "h200-125g)");
  replay_cmd->add_option("--gpu", replay.run.gpu, "catalogue GPU or path (instead of --machine)");
  replay_cmd->add_option("--model", replay.model,
                         "the trace's model as a .yaml or config.json path, when it is not in the "
                         "catalogue (default: the catalogue model the trace names)");
  replay_cmd->add_option("--host-ram", replay.run.host_ram,
                         "host RAM: with --gpu, or overriding the machine's");
  replay_cmd->add_option("--selection", replay.selection,
                         "the page selection model to predict with (default: the run's), e.g. "
                         "disjoint:S from `ctxplan selection`");
  replay_cmd->add_option("--by-chunk", replay.by_chunk,
                         "one op kind (or kind.part, as 'by kind' names them) chunk by chunk: "
                         "its ops' mean measured and predicted time");
  AddOutputFlags(*replay_cmd, replay.out);

  RecommendFlags recommend;
  recommend.run.context = "32K";
  CLI::App* recommend_cmd = app.add_subcommand(
      "recommend", "the fastest configuration that fits at a context, and its trade-offs");
  AddRunFlags(*recommend_cmd, recommend.run, true);
  AddOutputFlags(*recommend_cmd, recommend.out);

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
  if (sweep_cmd->parsed()) return RunSweep(sweep);
  if (timeline_cmd->parsed()) return RunTimeline(timeline);
  if (replay_cmd->parsed()) return RunReplay(replay);
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
