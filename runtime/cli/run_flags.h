// The flags every ctxplan command shares: model, machine and run options, kept as text until
// Resolve() validates them, so a bad value gets one clear line naming the flag.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"

namespace ctxplan::cli {

struct RunFlags {
  std::string model = "qwen2.5-7b";
  std::string machine;  // preset; default h200-125g when no --gpu either
  std::string gpu;
  std::string host_ram;  // with --gpu (default 125GiB) or overriding a preset's
  std::string context = "1M";
  std::string chunk = "4096";
  std::string page = "128";
  std::string budget = "64";
  std::string sinks = "1";
  std::string query_tile = "128";
  std::string offload = "on";
  std::string grad_dtype = "bf16";
  std::string optimizer = "adamw-gpu";
  std::string lora_rank = "0";
  std::string selection = "disjoint";
  std::string keep_layer_inputs = "off";
  // The GPU tier of the page store (with offload): off | auto | a size; resolved against the
  // machine by the planner (sim/gpu_tier.h), not by ResolveOptions.
  std::string gpu_tier = "off";
  std::string gpu_tier_margin = "2GiB";
  // GPUs the layers are pipelined over (RunOptions::pipeline_stages); more than the machine has
  // spans several machines like it.
  std::string gpus = "1";
};

// `with_context`: max-context searches the context itself. `lists`: sweep takes comma lists.
void AddRunFlags(CLI::App& app, RunFlags& flags, bool with_context, bool lists = false);

// The model and machine the flags name. Catalogue names and file paths; a path that cannot be read
// gets one line naming the flag.
ModelSpec ResolveModel(const RunFlags& flags);
MachineSpec ResolveMachine(const RunFlags& flags);
// Run options from single-valued flags (the `context` flag ignored when !with_context).
RunOptions ResolveOptions(const RunFlags& flags, const ModelSpec& model, bool with_context);

// Parses one value of each option; shared with sweep, which splits lists first.
int64_t ParseNonNegative(const std::string& text, const std::string& flag);
bool ParseOnOff(const std::string& text, const std::string& flag);
std::vector<std::string> SplitList(const std::string& text);

std::string DescribeOptions(const RunOptions& options);

}  // namespace ctxplan::cli
