// Run options as the string key/values that traces carry, and back: a trace names the plan it
// followed, so replay can rebuild exactly that plan; and the machine it was planned for, so replay
// predicts for that machine.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "ctxplan/runtime/plan/run_options.h"

namespace ctxplan {

using RunMetadata = std::map<std::string, std::string>;

// Adds the options' keys (context_tokens, chunk_tokens, ..., selection) and plan_version.
void AddRunOptions(const RunOptions& options, RunMetadata& metadata);
// Reads them back; a missing or malformed key throws InputError naming `source` and the key.
RunOptions RunOptionsFromMetadata(const RunMetadata& metadata, const std::string& source);
// The GPU (pipeline stage) a per-rank trace of a `stages`-GPU run was recorded on; nullopt when
// the trace names no rank (one GPU, or a trace of every GPU). Not an integer in 0..stages - 1:
// InputError naming `source` and the key.
std::optional<int32_t> RankFromMetadata(const RunMetadata& metadata, int32_t stages,
                                        const std::string& source);

// The machine a run was planned for, in the terms of the flags that chose it (--machine, or --gpu
// with --host-ram): what replay needs to rebuild the same MachineSpec.
struct PlanMachine {
  std::string machine;         // a preset name or a machine YAML path; empty with `gpu`
  std::string gpu;             // a catalogue GPU or a GPU YAML path; empty with `machine`
  int64_t host_ram_bytes = 0;  // the host RAM planned for, --host-ram applied
  std::string name;            // MachineSpec::name: "h200-125g", "h100-sxm+250GiB"
};

// Adds plan_machine or plan_gpu, plan_host_ram_bytes and plan_machine_name. A value that is a path
// (a '/' or a .yaml/.yml/.json ending, the catalogue's rule) is written absolute, so that a replay
// run from another directory still finds the file.
void AddPlanMachine(const PlanMachine& machine, RunMetadata& metadata);
// Reads them back; nullopt when the trace names no planning machine (recorded before these keys
// existed). Both plan_machine and plan_gpu, or a malformed plan_host_ram_bytes, throw InputError
// naming `source` and the key.
std::optional<PlanMachine> PlanMachineFromMetadata(const RunMetadata& metadata,
                                                   const std::string& source);

}  // namespace ctxplan
