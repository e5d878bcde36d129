#include "ctxplan/runtime/run_metadata.h"

#include <charconv>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/step_plan.h"

namespace ctxplan {

void AddRunOptions(const RunOptions& o, RunMetadata& m) {
  m["plan_version"] = std::to_string(StepPlan::kVersion);
  m["context_tokens"] = std::to_string(o.context_tokens);
  m["chunk_tokens"] = std::to_string(o.chunk_tokens);
  m["page_tokens"] = std::to_string(o.page_tokens);
  m["page_budget"] = o.dense() ? "all" : std::to_string(o.page_budget);
  m["sink_pages"] = std::to_string(o.sink_pages);
  m["query_tile"] = std::to_string(o.query_tile);
  m["offload"] = o.offload ? "on" : "off";
  m["grad_dtype"] = std::string(GradDtypeName(o.grad_dtype));
  m["optimizer"] = std::string(OptimizerName(o.optimizer));
  m["lora_rank"] = std::to_string(o.lora_rank);
  m["selection"] = SelectionModelName(o.selection);
  m["keep_layer_inputs"] = o.keep_layer_inputs ? "on" : "off";
}

RunOptions RunOptionsFromMetadata(const RunMetadata& m, const std::string& source) {
  auto get = [&](const std::string& key) -> const std::string& {
    auto it = m.find(key);
    if (it == m.end())
      throw InputError(source + ": metadata key '" + key +
                       "' is missing; accepted: a trace "
                       "written by ctxtrain or ctxplan, which records every run option");
    return it->second;
  };
  auto integer = [&](const std::string& key) {
    const std::string& text = get(key);
    int64_t value = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || ec != std::errc() || ptr != text.data() + text.size())
      throw InputError(source + ": metadata key '" + key + "': '" + text +
                       "' is not an integer; accepted: an integer");
    return value;
  };
  const int64_t version = integer("plan_version");
  if (version != StepPlan::kVersion)
    throw InputError(source + ": metadata key 'plan_version': the trace follows step plan v" +
                     std::to_string(version) + "; accepted: v" +
                     std::to_string(StepPlan::kVersion) + ", the plan this ctxplan builds");
  RunOptions o;
  const std::string where = source + ": metadata key ";
  o.context_tokens = integer("context_tokens");
  o.chunk_tokens = integer("chunk_tokens");
  o.page_tokens = integer("page_tokens");
  o.page_budget = ParsePageBudget(get("page_budget"), where + "'page_budget'");
  o.sink_pages = integer("sink_pages");
  o.query_tile = integer("query_tile");
  const std::string& offload = get("offload");
  if (offload != "on" && offload != "off")
    throw InputError(where + "'offload': '" + offload + "'; accepted: on, off");
  o.offload = offload == "on";
  o.grad_dtype = ParseGradDtype(get("grad_dtype"), where + "'grad_dtype'");
  o.optimizer = ParseOptimizer(get("optimizer"), where + "'optimizer'");
  o.lora_rank = integer("lora_rank");
  o.selection = ParseSelectionModel(get("selection"), where + "'selection'");
  const std::string& keep = get("keep_layer_inputs");
  if (keep != "on" && keep != "off")
    throw InputError(where + "'keep_layer_inputs': '" + keep + "'; accepted: on, off");
  o.keep_layer_inputs = keep == "on";
  return o;
}

}  // namespace ctxplan
