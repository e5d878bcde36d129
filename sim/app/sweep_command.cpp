#include "sweep_command.h"

#include <cstdio>
#include <iostream>
#include <utility>
#include <vector>

#include "command_run.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/plan_report.h"
#include "json_out.h"
#include "progress_bar.h"
#include "report_format.h"

namespace ctxplan::cli {

CLI::App* AddSweepCommand(CLI::App& app, SweepFlags& flags) {
  flags.run.context = "32K,128K,512K,1M";
  CLI::App* cmd = app.add_subcommand("sweep", "a grid of configurations, to CSV or JSON");
  AddRunFlags(*cmd, flags.run, true, true);
  cmd->add_option("--format", flags.format, "csv or json")->capture_default_str();
  cmd->add_option("--output,-o", flags.output, "write to this file instead of stdout");
  cmd->add_option("--path", flags.path, "analytic (fast) or event")->capture_default_str();
  return cmd;
}

std::string SweepReport(const SweepFlags& f) {
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
  return text;
}

}  // namespace ctxplan::cli
