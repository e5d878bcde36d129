#include "model/replay_model.h"

#include <cstdio>
#include <exception>
#include <utility>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/runtime/plan/run_metadata.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/traces/atomic_file.h"
#include "ctxplan/traces/op_trace.h"

namespace ctxplan::gui {
namespace {

// The measured step as a timeline: each op record with its plan twin's rank (records carry
// none), part and phase (as sim::Replay takes the part from the plan too; and a corrupt record's
// bytes then never reach a name lookup). The replay checked that every kernel or copy it holds is
// one of the plan's, of the same kind and stream; records that are not are left out.
Timeline MeasuredTimeline(const OpTrace& trace, const Timeline& predicted) {
  std::vector<uint32_t> twin;  // op id -> index + 1 into predicted.spans(); 0: none
  for (size_t i = 0; i < predicted.spans().size(); ++i) {
    const OpId id = predicted.spans()[i].op_id;
    if (id >= twin.size()) twin.resize(id + 1, 0);
    twin[id] = static_cast<uint32_t>(i + 1);
  }
  std::vector<OpSpan> spans;
  spans.reserve(trace.ops.size());
  for (const OpRecord& r : trace.ops) {
    if (r.op_id >= twin.size() || twin[r.op_id] == 0) continue;  // bookkeeping ops
    const OpSpan& p = predicted.spans()[twin[r.op_id] - 1];
    OpSpan s = p;
    s.start_ns = r.start_ns;
    s.end_ns = r.end_ns;
    s.chunk = r.chunk;  // as recorded: sim::Replay's by-chunk rows use the record's chunk
    s.layer = r.layer;
    spans.push_back(s);
  }
  // Memory records name their space but not which GPU or machine: one series a space (with
  // several pipeline stages the recorder's totals of different GPUs interleave in one series).
  std::vector<CounterSeries> counters;
  for (const MemoryRecord& m : trace.memory) {
    const MemSpace space =
        m.space == static_cast<uint8_t>(MemSpace::kGpu) ? MemSpace::kGpu : MemSpace::kHost;
    CounterSeries* series = nullptr;
    for (CounterSeries& c : counters)
      if (c.space == space) series = &c;
    if (series == nullptr) {
      counters.push_back({space == MemSpace::kGpu ? "GPU memory" : "host memory", space, 0, 0, {}});
      series = &counters.back();
    }
    series->points.push_back({m.time_ns, m.space_total_bytes});
  }
  return Timeline(std::move(spans), std::move(counters));
}

struct LoadCancelled {};

}  // namespace

// --- ReplayData --------------------------------------------------------------------------------

std::string ReplayData::Summary() const {
  if (!error.empty()) return error;
  if (generation == 0) return "no trace loaded";
  const sim::ReplayResult& r = result;
  char line[160];
  std::snprintf(
      line, sizeof line, "step: measured %.3f s, predicted %.3f s (measured/predicted %.3f)",
      r.measured_step_seconds, r.predicted_step_seconds,
      r.predicted_step_seconds > 0 ? r.measured_step_seconds / r.predicted_step_seconds : 0.0);
  std::string s = std::string(line) + "; " + FormatCount(static_cast<int64_t>(r.traced_ops)) +
                  " of " + FormatCount(static_cast<int64_t>(r.plan_ops)) +
                  " kernels and copies traced; " + model_name + " (" + source + ") against " +
                  machine_name + " (" + machine_origin + ")";
  for (const sim::KernelChange& c : kernel_changes)
    s += "; note: the run's kernels are not the profile's: on " + std::string(c.date) + ", " +
         std::string(c.what);
  return s;
}

std::vector<ChunkRow> ReplayData::ByChunk(const std::string& kind) const {
  // The replay command's rule (--by-chunk): a kind.part, or a kind with all its parts.
  std::vector<ChunkRow> rows;
  for (const sim::ChunkComparison& c : result.by_chunk) {
    const std::string name = Timeline::KindPartName(c.kind, c.part);
    if (name == kind || std::string(OpKindName(c.kind)) == kind)
      rows.push_back({name, c.chunk, c.count, c.measured_seconds, c.predicted_seconds});
  }
  return rows;
}

void ReplayData::SaveKindCsv(const std::string& file_path) const {
  AtomicFileWriter file(file_path);
  std::ostream& out = file.stream();
  out << "name,kind,part,count,measured_s,predicted_s,ratio\n";
  char numbers[96];
  for (const KindRow& k : by_kind) {
    std::snprintf(numbers, sizeof numbers, "%.9f,%.9f,%.6f", k.measured_seconds,
                  k.predicted_seconds, k.ratio());
    out << k.name << ',' << OpKindName(k.kind) << ','
        << (k.part == OpPart::kNone ? std::string_view() : OpPartName(k.part)) << ',' << k.count
        << ',' << numbers << '\n';
  }
  file.Commit();
}

// --- ReplayModel -------------------------------------------------------------------------------

ReplayModel::ReplayModel(QObject* parent) : QObject(parent), worker_(this) {}

ReplayModel::~ReplayModel() = default;

ReplayData ReplayModel::Load(const std::string& path, uint64_t generation,
                             const std::function<bool()>& cancelled) {
  ReplayData data;
  data.generation = generation;
  data.path = path;
  auto check = [&] {
    if (cancelled && cancelled()) throw LoadCancelled{};
  };
  try {
    // As `ctxplan replay TRACE` with no machine flags (sim/app/main.cpp, RunReplay).
    const OpTrace trace = ReadOpTrace(path);
    check();
    const auto model_name = trace.metadata.find("model");
    if (model_name == trace.metadata.end())
      throw InputError(path +
                       ": metadata key 'model' is missing; accepted: a trace written by "
                       "ctxtrain or ctxplan");
    const ModelSpec model = LoadModel(model_name->second);
    sim::ReplayMachine planned = sim::MachineOfTrace(trace.metadata, path);
    const RunOptions options = RunOptionsFromMetadata(trace.metadata, path);
    options.Validate(model);
    const StepPlan plan(model, options);
    const sim::KernelTimeModel time_model(planned.machine);
    data.result = sim::Replay(trace, plan, time_model, path);
    const auto recorded = trace.metadata.find("date");
    if (recorded != trace.metadata.end())
      data.kernel_changes =
          sim::ChangesBetween(sim::EffectiveKernelProfile(planned.machine.gpu), recorded->second,
                              options.page_tokens, model.head_dim);
    check();
    // sim::Replay keeps only its comparisons: the predicted spans take a second simulation of the
    // same plan (a tenth of a second for a 1M-token step), the measured ones the trace's records.
    Timeline predicted = SimulateTimeline(plan, time_model, cancelled);
    Timeline measured = MeasuredTimeline(trace, predicted);
    data.predicted = std::make_shared<const Timeline>(std::move(predicted));
    data.measured = std::make_shared<const Timeline>(std::move(measured));

    const auto source = trace.metadata.find("source");
    data.source = source == trace.metadata.end() ? "unknown" : source->second;
    data.model_name = model.name;
    data.machine_name = planned.machine.name;
    data.machine_origin = std::move(planned.origin);
    for (const sim::KindComparison& k : data.result.by_kind)
      data.by_kind.push_back({k.kind, k.part, Timeline::KindPartName(k.kind, k.part), k.count,
                              k.measured_seconds, k.predicted_seconds});
  } catch (const InputError& e) {
    data.error = e.what();
  } catch (const LoadCancelled&) {
    data.error = "cancelled";
  } catch (const TimelineCancelled&) {
    data.error = "cancelled";
  } catch (const std::exception& e) {
    // A bug, or a file so broken the reader did not see it coming: either way, not a crash.
    data.error = path + ": internal error: " + e.what();
  }
  if (!data.error.empty()) {  // nothing below the error is valid: show nothing of it
    data.result = {};
    data.by_kind.clear();
    data.measured = std::make_shared<const Timeline>();
    data.predicted = std::make_shared<const Timeline>();
  }
  return data;
}

void ReplayModel::Open(const QString& path) {
  const uint64_t generation = worker_.Renew();
  SetBusy(true);
  worker_.Start(
      [this, generation, stale = worker_.StaleCheck(generation), file = path.toStdString()] {
        if (stale()) return;  // a newer file is queued behind this one
        ReplayData data = Load(file, generation, stale);
        if (stale()) return;
        worker_.Post([this, data = std::move(data)]() mutable { Apply(std::move(data)); });
      });
}

const ReplayData& ReplayModel::LoadNow(const QString& path) {
  Apply(Load(path.toStdString(), worker_.Renew()));
  return data_;
}

void ReplayModel::Apply(ReplayData data) {
  if (data.generation != worker_.latest()) return;  // an older file than the one asked for last
  data_ = std::move(data);
  SetBusy(false);
  if (!data_.error.empty()) emit errorOccurred(QString::fromStdString(data_.error));
  emit loaded();
}

void ReplayModel::SetBusy(bool busy) {
  if (busy == busy_) return;
  busy_ = busy;
  emit busyChanged(busy_);
}

}  // namespace ctxplan::gui
