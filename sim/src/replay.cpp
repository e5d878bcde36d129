#include "ctxplan/sim/replay.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <tuple>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/sim/event_simulator.h"

namespace ctxplan::sim {

namespace {

struct Predicted {
  Tick start = -1;  // -1: not a timed op
  Tick end = -1;
  OpKind kind = OpKind::kAlloc;
  Stream stream = Stream::kCompute;
  OpPart part = OpPart::kNone;
  Phase phase = Phase::kSetup;
  int32_t rank = 0;    // the GPU (pipeline stage) that runs it
  double bytes = 0.0;  // the op's cost in bytes (for copies, what it moves)
};

class Recorder final : public SimObserver {
 public:
  void OnOpComplete(const Op& op, Tick start, Tick end) override {
    if (ops.size() <= op.id) ops.resize(op.id + 1);
    ops[op.id] = {start, end, op.kind, op.stream, op.part, op.phase, op.rank, op.cost.bytes};
    ++timed;
  }
  std::vector<Predicted> ops;
  uint64_t timed = 0;
};

double Seconds(int64_t ns) {
  return static_cast<double>(ns) * 1e-9;
}

// An op on the compute stream: its span in seconds, its phase and kind.
struct StreamSpan {
  double start, end;
  Phase phase;
  OpKind kind;
};

// The gaps between a stream's ops in the union of their spans (ops may overlap: kernels launched
// with programmatic dependent launch, records of one launch), each given to charge(phase, before,
// after, seconds); returns their sum.
template <typename Charge>
double StreamIdle(std::vector<StreamSpan> spans, Charge charge) {
  if (spans.empty()) return 0.0;
  std::sort(spans.begin(), spans.end(),
            [](const StreamSpan& a, const StreamSpan& b) { return a.start < b.start; });
  double covered = spans[0].end, idle = 0.0;
  OpKind last = spans[0].kind;
  for (size_t i = 1; i < spans.size(); ++i) {
    const StreamSpan& s = spans[i];
    if (s.start > covered) {
      idle += s.start - covered;
      charge(s.phase, last, s.kind, s.start - covered);
    }
    if (s.end > covered) {
      covered = s.end;
      last = s.kind;
    }
  }
  return idle;
}

// What replay predicts for when the trace cannot say: the default machine of every command.
constexpr const char* kDefaultMachine = "h200-125g";

ReplayMachine DefaultMachine(const std::string& why) {
  return {LoadMachine(kDefaultMachine), std::string("default ") + kDefaultMachine + ": " + why};
}

// The catalogue's rule for "this names a file": a '/' or a .yaml/.yml/.json ending.
bool NamesAFile(const std::string& value) {
  if (value.find('/') != std::string::npos) return true;
  for (std::string_view suffix : {".yaml", ".yml", ".json"}) {
    if (value.size() < suffix.size()) continue;
    bool match = true;
    for (size_t i = 0; i < suffix.size(); ++i)
      match = match &&
              std::tolower(static_cast<unsigned char>(value[value.size() - suffix.size() + i])) ==
                  suffix[i];
    if (match) return true;
  }
  return false;
}

}  // namespace

ReplayMachine MachineOfTrace(const TraceMetadata& metadata, const std::string& trace_name) {
  const std::optional<PlanMachine> planned = PlanMachineFromMetadata(metadata, trace_name);
  if (!planned) {
    // ctxplan's own predictions (timeline --format ctxtrace) name their machine by name only:
    // a preset rebuilds, a custom "<gpu>+<ram>" does not say where its GPU came from.
    const auto named = metadata.find("machine");
    if (named == metadata.end()) return DefaultMachine("the trace names no machine");
    const std::vector<std::string> presets = CatalogMachineNames();
    if (std::find(presets.begin(), presets.end(), named->second) != presets.end())
      return {LoadMachine(named->second), "from the trace"};
    return DefaultMachine("the trace's machine '" + named->second +
                          "' is not a preset, and the trace does not say how it was built");
  }
  const bool by_gpu = !planned->gpu.empty();
  const std::string& value = by_gpu ? planned->gpu : planned->machine;
  const std::string what = std::string(by_gpu ? "GPU" : "machine") + " '" + value + "'";
  std::error_code ec;
  if (NamesAFile(value) && !std::filesystem::is_regular_file(value, ec))
    return DefaultMachine("the trace's " + what + " is no longer a readable file here");
  try {
    if (by_gpu)  // as --gpu --host-ram built it; ctxtrain always writes the host RAM
      return {MakeMachine(LoadGpu(value),
                          planned->host_ram_bytes > 0 ? planned->host_ram_bytes : 125 * kGiB),
              "from the trace"};
    MachineSpec machine = LoadMachine(value);
    if (planned->host_ram_bytes > 0 && planned->host_ram_bytes != machine.host_ram_bytes) {
      // --host-ram overrode the preset's, as ResolveMachine does it: the preset otherwise kept.
      machine.host_ram_bytes = planned->host_ram_bytes;
      machine.name = !planned->name.empty()
                         ? planned->name
                         : machine.name + "+" + std::to_string(planned->host_ram_bytes) + "B";
    }
    return {std::move(machine), "from the trace"};
  } catch (const InputError& e) {  // a YAML edited since into something that no longer loads
    return DefaultMachine("the trace's " + what + " cannot be rebuilt here (" + e.what() + ")");
  }
}

namespace {

UnionComparison CompareUnions(const OpTrace& trace, const PlanGeometry& g) {
  UnionComparison u;
  const RunOptions& o = g.options();
  std::vector<double> fractions, planned;
  for (const UnionRecord& m : trace.unions) {
    if (m.chunk < 0 || m.chunk >= g.num_chunks()) continue;
    const ChunkGeometry c = g.Chunk(m.chunk);
    if (!c.sparse) continue;
    ++u.layers;
    u.measured_pages += m.pages;
    u.predicted_pages += static_cast<double>(c.expected_union_pages);
    // untouched = (1 - k / F)^(f T): the f that gives a union of `pages`.
    const double free_pages = static_cast<double>(c.earlier_pages - o.sink_pages);
    const double per_tile = std::log(1.0 - static_cast<double>(o.page_budget) / free_pages);
    auto fraction_into = [&](int64_t pages, std::vector<double>& out) {
      const double untouched = 1.0 - static_cast<double>(pages - o.sink_pages) / free_pages;
      if (untouched > 0 && untouched < 1 && per_tile < 0)
        out.push_back(std::log(untouched) / per_tile / static_cast<double>(c.tiles));
    };
    fraction_into(m.pages, fractions);
    fraction_into(c.expected_union_pages, planned);
  }
  auto median = [](std::vector<double>& v) {
    if (v.empty()) return 0.0;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  u.independent_tiles = median(fractions);
  u.planned_independent_tiles = median(planned);
  return u;
}

}  // namespace

std::vector<UnionSample> MeasuredUnionSamples(const OpTrace& trace, const PlanGeometry& g) {
  std::vector<DrawnUnion> drawn;
  for (const UnionRecord& m : trace.unions)
    if (m.phase == static_cast<uint8_t>(Phase::kFill)) drawn.push_back({m.chunk, m.pages});
  return UnionSamplesOf(g, drawn);
}

std::vector<UnionSample> MeasuredUnionSamples(const OpTrace& trace, const ModelSpec& model,
                                              const std::string& trace_name) {
  const RunOptions options = RunOptionsFromMetadata(trace.metadata, trace_name);
  options.Validate(model);
  return MeasuredUnionSamples(trace, PlanGeometry(model, options));
}

ReplayResult Replay(const OpTrace& trace, const StepPlan& plan, const KernelTimeModel& time_model,
                    const std::string& trace_name) {
  // A trace of one rank of a pipelined run (ctxtrain writes one a GPU, with its rank) holds that
  // rank's ops and memory: it is compared with the plan's ops of that rank and that GPU's
  // predicted peak. A trace naming no rank (one GPU, or a prediction of every GPU) is compared
  // with all of the plan's ops.
  const int32_t rank =
      RankFromMetadata(trace.metadata, plan.geometry().stages(), trace_name).value_or(-1);
  Recorder recorder;
  const StepPrediction prediction = EventSimulator(time_model).Run(plan, &recorder);
  ReplayResult r;
  r.rank = rank;
  r.predicted_step_seconds = prediction.step_seconds();
  // The rank's own peak where the trace is of one rank, else the prediction's.
  auto of_rank = [rank](const std::vector<int64_t>& by_rank, int64_t whole) {
    return rank >= 0 && static_cast<size_t>(rank) < by_rank.size()
               ? by_rank[static_cast<size_t>(rank)]
               : whole;
  };
  r.predicted_gpu_peak = of_rank(prediction.gpu_peak_by_rank, prediction.gpu.peak_bytes);
  // A rank's trace holds its own host allocations: set against its own share's peak, not the
  // machine's (the sum over its GPUs: 82.7 GiB against one rank's 23.5 on 4x H200).
  r.predicted_host_peak = of_rank(prediction.host_peak_by_rank, prediction.host.peak_bytes);
  for (const Predicted& p : recorder.ops)
    r.plan_ops += p.start >= 0 && (rank < 0 || p.rank == rank) ? 1 : 0;

  std::map<std::pair<OpKind, OpPart>, KindComparison> by_kind;
  std::map<std::tuple<OpKind, OpPart, int32_t>, ChunkComparison> by_chunk;
  std::map<std::pair<OpKind, Phase>, PhaseComparison> by_phase;
  int64_t first_start = INT64_MAX, last_end = INT64_MIN;
  std::vector<OpComparison> all;
  all.reserve(trace.ops.size());
  std::vector<bool> seen(recorder.ops.size(), false);
  // The compute stream's ops, of one GPU only (interleaved GPUs' streams have no gaps to speak of).
  const bool one_gpu = rank >= 0 || plan.geometry().stages() == 1;
  std::vector<StreamSpan> measured_compute, predicted_compute;
  for (const OpRecord& m : trace.ops) {
    // Bookkeeping ops take no time on any stream; a tracer may still record their CPU span.
    if (m.kind < kOpKindCount && IsMemory(static_cast<OpKind>(m.kind))) continue;
    const bool known = m.op_id < recorder.ops.size() && recorder.ops[m.op_id].start >= 0;
    if (!known)
      throw InputError(trace_name + ": op " + std::to_string(m.op_id) +
                       " is not a kernel or copy of the plan its metadata describes; accepted: "
                       "a trace of this plan version and these options");
    const Predicted& p = recorder.ops[m.op_id];
    if (static_cast<uint8_t>(p.kind) != m.kind || static_cast<uint8_t>(p.stream) != m.stream)
      throw InputError(trace_name + ": op " + std::to_string(m.op_id) + " is a " +
                       (m.kind < kOpKindCount ? std::string(OpKindName(static_cast<OpKind>(m.kind)))
                                              : "kind " + std::to_string(m.kind)) +
                       " in the trace but a " + std::string(OpKindName(p.kind)) +
                       " in the plan; accepted: a trace of this plan version and these options");
    if (seen[m.op_id])
      throw InputError(trace_name + ": op " + std::to_string(m.op_id) + " appears twice");
    if (rank >= 0 && p.rank != rank) continue;  // another GPU's (an older ctxtrain's bracket)
    seen[m.op_id] = true;
    ++r.traced_ops;
    first_start = std::min(first_start, m.start_ns);
    last_end = std::max(last_end, m.end_ns);
    OpComparison c{m, Seconds(m.end_ns - m.start_ns), TicksToSeconds(p.end - p.start)};
    // One more op in a row of a table: its count and both times.
    auto add = [&c](auto& row) {
      ++row.count;
      row.measured_seconds += c.measured_seconds;
      row.predicted_seconds += c.predicted_seconds;
    };
    KindComparison& k = by_kind[{p.kind, p.part}];
    k.kind = p.kind;
    k.part = p.part;
    add(k);
    ChunkComparison& in_chunk = by_chunk[{p.kind, p.part, m.chunk}];
    in_chunk.kind = p.kind;
    in_chunk.part = p.part;
    in_chunk.chunk = m.chunk;
    add(in_chunk);
    if (p.kind == OpKind::kCopyH2D || p.kind == OpKind::kCopyD2H) {
      PhaseComparison& in_phase = by_phase[{p.kind, p.phase}];
      in_phase.kind = p.kind;
      in_phase.phase = p.phase;
      add(in_phase);
      in_phase.predicted_bytes += p.bytes;
    }
    all.push_back(c);
    if (one_gpu && p.stream == Stream::kCompute)
      measured_compute.push_back({Seconds(m.start_ns), Seconds(m.end_ns), p.phase, p.kind});
  }
  if (r.traced_ops > 0) r.measured_step_seconds = Seconds(last_end - first_start);
  for (const MemoryRecord& m : trace.memory) {
    int64_t& peak = m.space == static_cast<uint8_t>(MemSpace::kGpu) ? r.measured_gpu_peak
                                                                    : r.measured_host_peak;
    peak = std::max(peak, m.space_total_bytes);
  }
  for (const auto& [key, k] : by_kind) r.by_kind.push_back(k);
  for (const auto& [key, c] : by_chunk) r.by_chunk.push_back(c);
  for (const auto& [key, c] : by_phase) r.copies_by_phase.push_back(c);
  std::sort(r.by_kind.begin(), r.by_kind.end(),
            [](const auto& a, const auto& b) { return a.measured_seconds > b.measured_seconds; });
  auto error = [](const OpComparison& c) {
    return std::abs(c.measured_seconds - c.predicted_seconds);
  };
  const size_t keep = std::min<size_t>(10, all.size());
  std::partial_sort(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(keep), all.end(),
                    [&](const auto& a, const auto& b) { return error(a) > error(b); });
  all.resize(keep);
  r.worst = std::move(all);
  r.unions = CompareUnions(trace, plan.geometry());

  if (one_gpu) {
    for (const Predicted& p : recorder.ops)
      if (p.start >= 0 && p.stream == Stream::kCompute && (rank < 0 || p.rank == rank))
        predicted_compute.push_back(
            {TicksToSeconds(p.start), TicksToSeconds(p.end), p.phase, p.kind});
    std::map<std::tuple<Phase, OpKind, OpKind>, IdleComparison> idle;
    auto gap = [&](Phase phase, OpKind before, OpKind after) -> IdleComparison& {
      IdleComparison& g = idle[{phase, before, after}];
      g.phase = phase;
      g.before = before;
      g.after = after;
      return g;
    };
    r.measured_compute_idle_seconds = StreamIdle(
        std::move(measured_compute), [&](Phase phase, OpKind before, OpKind after, double s) {
          IdleComparison& g = gap(phase, before, after);
          ++g.measured_count;
          g.measured_seconds += s;
        });
    r.predicted_compute_idle_seconds = StreamIdle(
        std::move(predicted_compute), [&](Phase phase, OpKind before, OpKind after, double s) {
          IdleComparison& g = gap(phase, before, after);
          ++g.predicted_count;
          g.predicted_seconds += s;
        });
    for (const auto& [key, g] : idle) r.compute_idle.push_back(g);
    std::sort(r.compute_idle.begin(), r.compute_idle.end(), [](const auto& a, const auto& b) {
      return std::tie(a.measured_seconds, a.predicted_seconds) >
             std::tie(b.measured_seconds, b.predicted_seconds);
    });
    if (r.compute_idle.size() > 8) r.compute_idle.resize(8);
  }
  return r;
}

}  // namespace ctxplan::sim
