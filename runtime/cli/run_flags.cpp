#include "run_flags.h"

#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"

namespace ctxplan::cli {

void AddRunFlags(CLI::App& app, RunFlags& f, bool with_context, bool lists) {
  const std::string list = lists ? " (comma list)" : "";
  app.add_option("--model", f.model,
                 "catalogue model (ctxplan list) or path to a YAML / HF config.json")
      ->capture_default_str();
  app.add_option("--machine", f.machine, "machine preset: GPU + host RAM (default h200-125g)");
  app.add_option("--gpu", f.gpu, "catalogue GPU or path to a GPU YAML (instead of --machine)");
  app.add_option("--host-ram", f.host_ram, "host RAM, e.g. 512GiB (default 125GiB with --gpu)");
  if (with_context)
    app.add_option("--context", f.context, "context length in tokens, e.g. 1M, 32K" + list)
        ->capture_default_str();
  app.add_option("--chunk", f.chunk, "chunk size c in tokens" + list)->capture_default_str();
  app.add_option("--page", f.page, "page size p in tokens" + list)->capture_default_str();
  app.add_option("--budget", f.budget, "pages k per query tile, or 'all' (dense)" + list)
      ->capture_default_str();
  app.add_option("--sinks", f.sinks, "sink pages always attended")->capture_default_str();
  app.add_option("--query-tile", f.query_tile, "queries sharing one page selection")
      ->capture_default_str();
  app.add_option("--offload", f.offload, "KV/dKV pages in pinned host memory: on|off" + list)
      ->capture_default_str();
  app.add_option("--grad-dtype", f.grad_dtype, "gradients and dKV: bf16|fp32")
      ->capture_default_str();
  app.add_option("--optimizer", f.optimizer, "adamw-gpu|adamw-host|none")->capture_default_str();
  app.add_option("--lora-rank", f.lora_rank, "LoRA rank, 0 = full fine-tune")
      ->capture_default_str();
  app.add_option("--selection", f.selection,
                 "union of the tiles' page selections: shared (best case), disjoint (worst "
                 "case), overlap:F (measured fraction)")
      ->capture_default_str();
  app.add_option("--keep-layer-inputs", f.keep_layer_inputs,
                 "keep every chunk's layer inputs from the fill instead of recomputing them: "
                 "on|off (one forward less, O(n) GPU memory)")
      ->capture_default_str();
  app.add_option("--gpu-tier", f.gpu_tier,
                 "with offload, keep the earliest pages' KV and dKV in GPU memory: off | auto "
                 "(what the plan leaves free) | a size, e.g. 40GiB | all (= --offload off)")
      ->capture_default_str();
  app.add_option("--gpu-tier-margin", f.gpu_tier_margin,
                 "device memory --gpu-tier auto leaves free beside the tier")
      ->capture_default_str();
  app.add_option("--gpus", f.gpus,
                 "GPUs the layers are pipelined over, chunks as micro-batches (more than the "
                 "machine has: several such machines)" +
                     list)
      ->capture_default_str();
}

int64_t ParseNonNegative(const std::string& text, const std::string& flag) {
  int64_t value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || value < 0)
    throw InputError(flag + ": '" + text + "' is not a count; accepted: an integer >= 0");
  return value;
}

bool ParseOnOff(const std::string& text, const std::string& flag) {
  if (text == "on" || text == "true" || text == "1") return true;
  if (text == "off" || text == "false" || text == "0") return false;
  throw InputError(flag + ": '" + text + "' is not on or off; accepted: on, off");
}

std::vector<std::string> SplitList(const std::string& text) {
  std::vector<std::string> items;
  size_t start = 0;
  while (true) {
    const size_t comma = text.find(',', start);
    items.push_back(text.substr(start, comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return items;
}

namespace {

// The loaders say that a file cannot be read, but not which flag named it nor what else the flag
// takes. The catalogue's rule says what is a path (NamesAFile).
void CheckReadableIfPath(const std::string& value, const std::string& flag,
                         const std::string& accepted) {
  if (!NamesAFile(value)) return;
  std::error_code ec;
  std::string reason;
  if (std::filesystem::is_directory(value, ec)) {
    reason = "it is a directory";
  } else if (std::ifstream in(value, std::ios::binary); !in) {
    reason = std::strerror(errno);
  } else {
    return;
  }
  throw InputError(flag + ": cannot read '" + value + "' (" + reason + "); accepted: " + accepted);
}

// MakeMachine bounds the host RAM (more than the OS keeps, not absurd) without naming the flag.
MachineSpec MakeMachineForFlag(const GpuSpec& gpu, int64_t host_ram_bytes) {
  try {
    return MakeMachine(gpu, host_ram_bytes);
  } catch (const InputError& e) {
    throw InputError(std::string("--host-ram: ") + e.what());
  }
}

}  // namespace

ModelSpec ResolveModel(const RunFlags& f) {
  CheckReadableIfPath(f.model, "--model",
                      "a catalogue model (ctxplan list) or the path of a readable model .yaml or "
                      "Hugging Face config.json");
  return LoadModel(f.model);
}

MachineSpec ResolveMachine(const RunFlags& f) {
  if (!f.machine.empty() && !f.gpu.empty())
    throw InputError(
        "--machine and --gpu: give one; accepted: --machine PRESET, or --gpu GPU "
        "[--host-ram SIZE]");
  if (!f.gpu.empty()) {
    CheckReadableIfPath(f.gpu, "--gpu",
                        "a catalogue GPU (ctxplan list) or the path of a readable GPU .yaml");
    const int64_t ram = ParseBytes(f.host_ram.empty() ? "125GiB" : f.host_ram, "--host-ram");
    return MakeMachineForFlag(LoadGpu(f.gpu), ram);
  }
  CheckReadableIfPath(f.machine, "--machine",
                      "a machine preset (ctxplan list) or the path of a readable machine .yaml");
  MachineSpec machine = LoadMachine(f.machine.empty() ? "h200-125g" : f.machine);
  if (!f.host_ram.empty()) {
    const int64_t ram = ParseBytes(f.host_ram, "--host-ram");
    MakeMachineForFlag(machine.gpu, ram);  // the same bounds as with --gpu
    machine.host_ram_bytes = ram;
    machine.name += "+" + f.host_ram;
  }
  if (machine.host_usable_bytes() <= 0)
    throw InputError("--host-ram: " + FormatGiB(machine.host_ram_bytes) +
                     " leaves nothing after the " + FormatGiB(machine.host_reserved_bytes) +
                     " the OS keeps; accepted: more host RAM than that");
  return machine;
}

RunOptions ResolveOptions(const RunFlags& f, const ModelSpec& model, bool with_context) {
  RunOptions o;
  if (with_context) o.context_tokens = ParseTokens(f.context, "--context");
  o.chunk_tokens = ParseTokens(f.chunk, "--chunk");
  o.page_tokens = ParseTokens(f.page, "--page");
  o.page_budget = ParsePageBudget(f.budget, "--budget");
  o.sink_pages = ParseNonNegative(f.sinks, "--sinks");
  o.query_tile = ParseTokens(f.query_tile, "--query-tile");
  o.offload = ParseOnOff(f.offload, "--offload");
  o.grad_dtype = ParseGradDtype(f.grad_dtype, "--grad-dtype");
  o.optimizer = ParseOptimizer(f.optimizer, "--optimizer");
  o.lora_rank = ParseNonNegative(f.lora_rank, "--lora-rank");
  o.selection = ParseSelectionModel(f.selection, "--selection");
  o.keep_layer_inputs = ParseOnOff(f.keep_layer_inputs, "--keep-layer-inputs");
  const int64_t gpus = ParseNonNegative(f.gpus, "--gpus");
  if (gpus < 1 || gpus > 4096)
    throw InputError("--gpus: '" + f.gpus + "' is out of range; accepted: 1 to 4096 GPUs");
  o.pipeline_stages = static_cast<int32_t>(gpus);
  o.Validate(model);
  return o;
}

std::string DescribeOptions(const RunOptions& o) {
  std::string s = "chunk " + FormatCount(o.chunk_tokens) + ", page " + FormatCount(o.page_tokens);
  s += o.dense() ? ", dense attention"
                 : ", budget " + FormatCount(o.page_budget) + " pages + " +
                       FormatCount(o.sink_pages) + " sink, query tile " +
                       FormatCount(o.query_tile) + ", selection " + SelectionModelName(o.selection);
  s += std::string(", offload ") + (o.offload ? "on" : "off");
  if (o.offload && o.gpu_tier_pages > 0)
    s += " (GPU tier " + FormatCount(o.gpu_tier_pages) + " pages a layer)";
  s += ", grads " + std::string(GradDtypeName(o.grad_dtype));
  s += ", optimizer " + std::string(OptimizerName(o.optimizer));
  s += o.lora_rank > 0 ? ", LoRA rank " + std::to_string(o.lora_rank) : ", full fine-tune";
  if (o.keep_layer_inputs) s += ", layer inputs kept";
  if (o.pipeline_stages > 1) s += ", pipelined over " + std::to_string(o.pipeline_stages) + " GPUs";
  return s;
}

}  // namespace ctxplan::cli
