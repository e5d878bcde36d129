#include "replay_command.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <utility>
#include <vector>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/kernel_changes.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/replay.h"
#include "ctxplan/traces/op_trace.h"
#include "json_out.h"

namespace ctxplan::cli {

namespace {

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

}  // namespace

CLI::App* AddReplayCommand(CLI::App& app, ReplayFlags& flags) {
  CLI::App* cmd = app.add_subcommand(
      "replay", "compare a recorded step (.ctxtrace) with the prediction, op by op");
  cmd->add_option("trace", flags.trace, "the .ctxtrace file")->required();
  cmd->add_option("--machine", flags.run.machine,
                  "machine preset (default: the one the trace was planned for, else "
                  "h200-125g)");
  cmd->add_option("--gpu", flags.run.gpu, "catalogue GPU or path (instead of --machine)");
  cmd->add_option("--model", flags.model,
                  "the trace's model as a .yaml or config.json path, when it is not in the "
                  "catalogue (default: the catalogue model the trace names)");
  cmd->add_option("--host-ram", flags.run.host_ram,
                  "host RAM: with --gpu, or overriding the machine's");
  cmd->add_option("--selection", flags.selection,
                  "the page selection model to predict with (default: the run's), e.g. "
                  "disjoint:S from `ctxplan selection`");
  cmd->add_option("--by-chunk", flags.by_chunk,
                  "one op kind (or kind.part, as 'by kind' names them) chunk by chunk: "
                  "its ops' mean measured and predicted time");
  AddOutputFlags(*cmd, flags.out);
  return cmd;
}

std::string ReplayReport(const ReplayFlags& f) {
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
    return j.Text();
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
  return s;
}

}  // namespace ctxplan::cli
