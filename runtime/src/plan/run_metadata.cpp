#include "ctxplan/runtime/plan/run_metadata.h"

#include <charconv>
#include <filesystem>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/step_plan.h"

namespace ctxplan {

namespace {
const std::string& MetadataValue(const RunMetadata& m, const std::string& key,
                                 const std::string& source) {
  auto it = m.find(key);
  if (it == m.end())
    throw InputError(source + ": metadata key '" + key +
                     "' is missing; accepted: a trace "
                     "written by ctxtrain or ctxplan, which records every run option");
  return it->second;
}

int64_t MetadataInteger(const RunMetadata& m, const std::string& key, const std::string& source) {
  const std::string& text = MetadataValue(m, key, source);
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size())
    throw InputError(source + ": metadata key '" + key + "': '" + text +
                     "' is not an integer; accepted: an integer");
  return value;
}
}  // namespace

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
  if (o.gpu_tier_pages > 0) m["gpu_tier_pages"] = std::to_string(o.gpu_tier_pages);
  if (o.pipeline_stages > 1) m["pipeline_stages"] = std::to_string(o.pipeline_stages);
}

RunOptions RunOptionsFromMetadata(const RunMetadata& m, const std::string& source) {
  auto get = [&](const std::string& key) -> const std::string& {
    return MetadataValue(m, key, source);
  };
  auto integer = [&](const std::string& key) { return MetadataInteger(m, key, source); };
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
  // Absent before the GPU tier (2026-11-25) and when it is off.
  if (m.contains("gpu_tier_pages")) o.gpu_tier_pages = integer("gpu_tier_pages");
  // Absent before pipeline stages (2026-11-26) and with one GPU.
  if (m.contains("pipeline_stages")) {
    const int64_t stages = integer("pipeline_stages");
    if (stages < 1 || stages > 4096)
      throw InputError(where + "'pipeline_stages': " + std::to_string(stages) +
                       "; accepted: 1 to 4096");
    o.pipeline_stages = static_cast<int32_t>(stages);
  }
  return o;
}

namespace {

// What the catalogue takes as a file (NamesAFile), made absolute when relative: the trace is
// often replayed from another directory than the run's.
std::string Portable(const std::string& value) {
  if (!NamesAFile(value)) return value;
  std::error_code ec;
  const std::filesystem::path absolute = std::filesystem::absolute(value, ec);
  return ec ? value : absolute.lexically_normal().string();
}

}  // namespace

void AddPlanMachine(const PlanMachine& p, RunMetadata& m) {
  if (!p.gpu.empty())
    m["plan_gpu"] = Portable(p.gpu);
  else
    m["plan_machine"] = Portable(p.machine);
  m["plan_host_ram_bytes"] = std::to_string(p.host_ram_bytes);
  m["plan_machine_name"] = p.name;
}

std::optional<PlanMachine> PlanMachineFromMetadata(const RunMetadata& m,
                                                   const std::string& source) {
  const auto machine = m.find("plan_machine");
  const auto gpu = m.find("plan_gpu");
  if (machine == m.end() && gpu == m.end()) return std::nullopt;
  if (machine != m.end() && gpu != m.end())
    throw InputError(source +
                     ": metadata keys 'plan_machine' and 'plan_gpu' both present; accepted: "
                     "one of them, as ctxtrain writes");
  PlanMachine p;
  if (machine != m.end()) p.machine = machine->second;
  if (gpu != m.end()) p.gpu = gpu->second;
  if (p.machine.empty() && p.gpu.empty())
    throw InputError(source + ": metadata key '" +
                     (machine != m.end() ? "plan_machine" : "plan_gpu") +
                     "' is empty; accepted: a machine preset, a GPU, or a YAML path");
  const auto ram = m.find("plan_host_ram_bytes");
  if (ram != m.end()) {
    const std::string& text = ram->second;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), p.host_ram_bytes);
    if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() ||
        p.host_ram_bytes <= 0)
      throw InputError(source + ": metadata key 'plan_host_ram_bytes': '" + text +
                       "' is not a byte count; accepted: an integer > 0");
  }
  if (const auto name = m.find("plan_machine_name"); name != m.end()) p.name = name->second;
  return p;
}

std::optional<int32_t> RankFromMetadata(const RunMetadata& m, int32_t stages,
                                        const std::string& source) {
  if (!m.contains("rank")) return std::nullopt;
  const int64_t rank = MetadataInteger(m, "rank", source);
  if (rank < 0 || rank >= stages)
    throw InputError(source + ": metadata key 'rank': " + std::to_string(rank) +
                     " is not a stage of the " + std::to_string(stages) +
                     "-GPU plan it describes; accepted: 0 to stages - 1");
  return static_cast<int32_t>(rank);
}

}  // namespace ctxplan
