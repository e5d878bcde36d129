#include "recommend_command.h"

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "command_run.h"
#include "ctxplan/models/catalog.h"
#include "ctxplan/models/units.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/recommend.h"
#include "json_out.h"
#include "report_format.h"

namespace ctxplan::cli {

namespace {

std::string MachineFlagsOf(const RunFlags& f) {
  std::string s = f.gpu.empty() ? "--machine " + (f.machine.empty() ? "h200-125g" : f.machine)
                                : "--gpu " + f.gpu;
  if (!f.host_ram.empty()) s += " --host-ram " + f.host_ram;
  return s;
}

}  // namespace

CLI::App* AddRecommendCommand(CLI::App& app, RecommendFlags& flags) {
  flags.run.context = "32K";
  CLI::App* cmd = app.add_subcommand(
      "recommend", "the fastest configuration that fits at a context, and its trade-offs");
  AddRunFlags(*cmd, flags.run, true);
  AddOutputFlags(*cmd, flags.out);
  return cmd;
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

}  // namespace ctxplan::cli
