#include "selection_command.h"

#include <cstdio>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/replay.h"
#include "ctxplan/traces/op_trace.h"
#include "json_out.h"

namespace ctxplan::cli {

CLI::App* AddSelectionCommand(CLI::App& app, SelectionFlags& flags) {
  CLI::App* cmd = app.add_subcommand(
      "selection",
      "fit how a model's query tiles overlap in their page selections from traced runs, for "
      "--selection disjoint:S");
  cmd->add_option("traces", flags.traces, ".ctxtrace files of page-sparse runs of one model")
      ->required();
  cmd->add_option("--model", flags.model,
                  "the traces' model as a .yaml or config.json path, when it is not in the "
                  "catalogue (default: the catalogue model the traces name)");
  cmd->add_flag("--json", flags.json, "print JSON instead of text");
  cmd->add_option("--output,-o", flags.output, "write to this file (atomically) instead of stdout");
  cmd->add_flag("--csv", flags.csv,
                "print each sparse chunk's measured union as CSV (trace, chunk, k, tiles, "
                "candidates, layers, union pages with the sinks) instead of the fit");
  return cmd;
}

std::string SelectionReport(const SelectionFlags& flags) {
  struct Traced {
    std::string path;
    std::vector<UnionSample> samples;
  };
  std::vector<Traced> traced;
  std::vector<UnionSample> all;
  std::string model_name;
  for (const std::string& path : flags.traces) {
    const OpTrace trace = ReadOpTrace(path);
    const auto name = trace.metadata.find("model");
    if (name == trace.metadata.end())
      throw InputError(path +
                       ": metadata key 'model' is missing; accepted: a trace written by "
                       "ctxtrain");
    if (!model_name.empty() && name->second != model_name)
      throw InputError(path + ": a trace of '" + name->second + "' where the others are of '" +
                       model_name + "'; accepted: traces of one model");
    model_name = name->second;
    const ModelSpec model = LoadModel(flags.model.empty() ? name->second : flags.model);
    if (model.name != name->second)
      throw InputError("--model " + flags.model + " is model '" + model.name + "', but " + path +
                       " is a trace of '" + name->second + "'; accepted: the traces' model");
    Traced t{path, sim::MeasuredUnionSamples(trace, model, path)};
    all.insert(all.end(), t.samples.begin(), t.samples.end());
    traced.push_back(std::move(t));
  }
  if (flags.csv) {
    std::string csv = "trace,chunk,k,tiles,candidates,layers,mean_union_pages\n";
    char row[512];
    for (const Traced& t : traced) {
      for (const UnionSample& u : t.samples) {
        std::snprintf(row, sizeof row, "%s,%lld,%lld,%lld,%lld,%lld,%.2f\n", t.path.c_str(),
                      static_cast<long long>(u.chunk), static_cast<long long>(u.k),
                      static_cast<long long>(u.tiles), static_cast<long long>(u.candidates),
                      static_cast<long long>(u.layers), u.pages + static_cast<double>(u.sinks));
        csv += row;
      }
    }
    return csv;
  }
  const double scale = FitUnionDrawScale(all);
  // Each trace's union in total under the fitted and the default scale, against the measured.
  auto ratio = [](const std::vector<UnionSample>& samples, double s) {
    double predicted = 0, measured = 0;
    for (const UnionSample& u : samples) {
      predicted += ExpectedUnionPages(u.candidates, u.k, u.tiles, s);
      measured += u.pages;
    }
    return measured > 0 ? predicted / measured : 0.0;
  };
  char flag[64];
  std::snprintf(flag, sizeof flag, "--selection disjoint:%.3g", scale);
  if (flags.json) {
    JsonOut j;
    j.BeginObject().Field("model", model_name).Field("draw_scale", scale);
    j.Field("default_draw_scale", kUnionDrawScale).Field("flag", flag);
    j.BeginArray("traces");
    for (const Traced& t : traced) {
      j.BeginObject().Field("trace", t.path);
      j.Field("sparse_chunks", static_cast<int64_t>(t.samples.size()));
      j.Field("union_ratio_fitted", ratio(t.samples, scale));
      j.Field("union_ratio_default", ratio(t.samples, kUnionDrawScale));
      j.EndObject();
    }
    j.EndArray().EndObject();
    return j.Text();
  }
  std::string text;
  char line[512];
  std::snprintf(line, sizeof line,
                "%s: union rule draw scale %.3f (the default, fitted on Qwen2.5-7B and "
                "Llama-3.2-1B runs: %.2f)\n",
                model_name.c_str(), scale, kUnionDrawScale);
  text += line;
  for (const Traced& t : traced) {
    std::snprintf(line, sizeof line,
                  "  %s: %zu sparse chunks; unions predicted x%.3f of measured at %.3f, x%.3f at "
                  "the default\n",
                  t.path.c_str(), t.samples.size(), ratio(t.samples, scale), scale,
                  ratio(t.samples, kUnionDrawScale));
    text += line;
  }
  text += std::string("plan with: ") + flag + "\n";
  return text;
}

}  // namespace ctxplan::cli
