#include "explorer_model.h"

#include <QCoreApplication>
#include <QMetaObject>

#include <cmath>
#include <exception>
#include <limits>
#include <utility>

#include "ctxplan/models/catalog.h"
#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/recommend.h"
#include "ctxplan/sim/timeline_writer.h"
#include "ctxplan/traces/atomic_file.h"
#include "ctxplan/traces/chrome_trace_writer.h"

namespace ctxplan::gui {
namespace {

// The generation the destructor publishes: no job's generation equals it, so all give up.
constexpr uint64_t kShuttingDown = std::numeric_limits<uint64_t>::max();

bool SameOptions(const RunOptions& a, const RunOptions& b) {
  return a.context_tokens == b.context_tokens && a.chunk_tokens == b.chunk_tokens &&
         a.page_tokens == b.page_tokens && a.page_budget == b.page_budget &&
         a.sink_pages == b.sink_pages && a.query_tile == b.query_tile && a.offload == b.offload &&
         a.grad_dtype == b.grad_dtype && a.optimizer == b.optimizer && a.lora_rank == b.lora_rank &&
         a.selection.kind == b.selection.kind &&
         a.selection.overlap_fraction == b.selection.overlap_fraction &&
         a.selection.draw_scale == b.selection.draw_scale &&
         a.keep_layer_inputs == b.keep_layer_inputs && a.pipeline_stages == b.pipeline_stages;
}

bool SameSelection(const ExplorerSelection& a, const ExplorerSelection& b) {
  return a.model_name == b.model_name && a.machine_name == b.machine_name &&
         SameOptions(a.options, b.options) && a.gpu_tier_text == b.gpu_tier_text;
}

MachineSpec LoadUsableMachine(const std::string& name) {
  MachineSpec machine = LoadMachine(name);
  // As the CLI's ResolveMachine: a machine whose OS reserve eats all RAM cannot plan anything.
  if (machine.host_usable_bytes() <= 0)
    throw InputError("machine " + name + ": no host RAM is left after what the OS keeps");
  return machine;
}

// Thrown out of the event simulator by the observer below to abandon a stale export.
struct TimelineCancelled {};

// Forwards to the timeline writer and checks, every few thousand ops, whether the export is
// still wanted: the event path cannot be interrupted otherwise, and an 8M-token step has
// millions of ops.
class CancellableObserver final : public sim::SimObserver {
 public:
  CancellableObserver(sim::SimObserver& inner, std::function<bool()> cancelled)
      : inner_(inner), cancelled_(std::move(cancelled)) {}

  void OnOpComplete(const Op& op, sim::Tick start, sim::Tick end) override {
    if ((++ops_ & 4095) == 0 && cancelled_()) throw TimelineCancelled{};
    inner_.OnOpComplete(op, start, end);
  }
  void OnMemory(MemSpace space, int where, sim::Tick when,
                const sim::MemoryTracker& memory) override {
    inner_.OnMemory(space, where, when, memory);
  }

 private:
  sim::SimObserver& inner_;
  std::function<bool()> cancelled_;
  uint64_t ops_ = 0;
};

}  // namespace

std::vector<int64_t> ExplorerModel::CurveContexts() {
  std::vector<int64_t> contexts;
  contexts.reserve(kCurvePoints);
  const double ratio = static_cast<double>(kCurveMaxTokens) / static_cast<double>(kCurveMinTokens);
  for (int i = 0; i < kCurvePoints; ++i) {
    const double t = static_cast<double>(i) / (kCurvePoints - 1);
    contexts.push_back(std::llround(static_cast<double>(kCurveMinTokens) * std::pow(ratio, t)));
  }
  return contexts;
}

ExplorerModel::ExplorerModel(QObject* parent)
    : QObject(parent),
      latest_(std::make_shared<std::atomic<uint64_t>>(0)),
      latest_timeline_(std::make_shared<std::atomic<uint64_t>>(0)) {
  selection_.model_name = "qwen2.5-7b";
  selection_.machine_name = "h200-125g";
  selection_.model = LoadModel(selection_.model_name);
  selection_.machine = LoadUsableMachine(selection_.machine_name);
  compute_pool_.setMaxThreadCount(1);
  timeline_pool_.setMaxThreadCount(1);
}

ExplorerModel::~ExplorerModel() {
  latest_->store(kShuttingDown);
  latest_timeline_->store(kShuttingDown);
  compute_pool_.clear();  // jobs not started yet never start
  timeline_pool_.clear();
  compute_pool_.waitForDone();
  timeline_pool_.waitForDone();
  // Results the jobs queued for this object are discarded with it (~QObject drops its events,
  // ~Mailbox the tasks).
}

void ExplorerModel::StartJob(QThreadPool& pool, Mailbox& jobs, std::function<void()> job) {
  jobs.Push(std::move(job));
  // The pool's job carries no data of ours, only where to find it; each runs the oldest job
  // waiting (one per start; the destructor's clear() drops the rest with the mailbox).
  pool.start([&jobs] {
    if (std::function<void()> next = jobs.Pop()) next();
  });
}

void ExplorerModel::Post(std::function<void()> task) {
  posted_.Push(std::move(task));
  // Queued by name, so that Qt allocates and frees the call: dropped if this object is gone.
  QMetaObject::invokeMethod(this, "RunPosted", Qt::QueuedConnection);
}

void ExplorerModel::RunPosted() {
  // One call may find several tasks (and later calls none): one at a time, outside the lock, as
  // a task may post or start more.
  while (std::function<void()> task = posted_.Pop()) task();
}

bool ExplorerModel::Accept(const std::function<void(ExplorerSelection&)>& change) {
  ExplorerSelection candidate = selection_;
  try {
    change(candidate);
    candidate.options.Validate(candidate.model);
    // The plan's geometry has checks of its own beyond Validate().
    [[maybe_unused]] const PlanGeometry geometry(candidate.model, candidate.options);
  } catch (const InputError& e) {
    emit errorOccurred(QString::fromStdString(e.what()));
    return false;
  }
  if (SameSelection(candidate, selection_)) return true;
  selection_ = std::move(candidate);
  emit selectionChanged();
  Refresh();
  return true;
}

bool ExplorerModel::SetModelName(const QString& name) {
  const std::string text = name.toStdString();
  if (text == selection_.model_name) return true;
  return Accept([&](ExplorerSelection& s) {
    s.model = LoadModel(text);
    s.model_name = text;
  });
}

bool ExplorerModel::SetMachineName(const QString& name) {
  const std::string text = name.toStdString();
  if (text == selection_.machine_name) return true;
  return Accept([&](ExplorerSelection& s) {
    s.machine = LoadUsableMachine(text);
    s.machine_name = text;
  });
}

bool ExplorerModel::SetContextTokens(qint64 tokens) {
  return Accept([&](ExplorerSelection& s) { s.options.context_tokens = tokens; });
}

bool ExplorerModel::SetChunkTokens(qint64 tokens) {
  return Accept([&](ExplorerSelection& s) { s.options.chunk_tokens = tokens; });
}

bool ExplorerModel::SetPageTokens(qint64 tokens) {
  return Accept([&](ExplorerSelection& s) { s.options.page_tokens = tokens; });
}

bool ExplorerModel::SetPageBudget(qint64 pages) {
  return Accept([&](ExplorerSelection& s) { s.options.page_budget = pages; });
}

bool ExplorerModel::SetOffload(bool on) {
  return Accept([&](ExplorerSelection& s) { s.options.offload = on; });
}

bool ExplorerModel::SetGpus(int gpus) {
  return Accept([&](ExplorerSelection& s) { s.options.pipeline_stages = gpus; });
}

bool ExplorerModel::SetGpuTier(const QString& text) {
  return Accept([&](ExplorerSelection& s) {
    s.gpu_tier = sim::ParseGpuTierSetting(text.toStdString(), "2GiB", "GPU tier");
    s.gpu_tier_text = text.toStdString();
  });
}

bool ExplorerModel::SetLoraRank(int rank) {
  return Accept([&](ExplorerSelection& s) { s.options.lora_rank = rank; });
}

bool ExplorerModel::SetQueryTile(qint64 queries) {
  return Accept([&](ExplorerSelection& s) { s.options.query_tile = queries; });
}

bool ExplorerModel::SetSinkPages(qint64 pages) {
  return Accept([&](ExplorerSelection& s) { s.options.sink_pages = pages; });
}

bool ExplorerModel::SetKeepLayerInputs(bool keep) {
  return Accept([&](ExplorerSelection& s) { s.options.keep_layer_inputs = keep; });
}

bool ExplorerModel::SetGradDtype(const QString& name) {
  return Accept([&](ExplorerSelection& s) {
    s.options.grad_dtype = ParseGradDtype(name.toStdString(), "grad dtype");
  });
}

bool ExplorerModel::SetOptimizer(const QString& name) {
  return Accept([&](ExplorerSelection& s) {
    s.options.optimizer = ParseOptimizer(name.toStdString(), "optimizer");
  });
}

bool ExplorerModel::SetSelectionModel(const QString& text) {
  return Accept([&](ExplorerSelection& s) {
    s.options.selection = ParseSelectionModel(text.toStdString(), "selection");
  });
}

void ExplorerModel::Refresh() {
  const uint64_t generation = latest_->fetch_add(1) + 1;
  SetBusy(true);
  std::shared_ptr<std::atomic<uint64_t>> latest = latest_;
  // Runs on the worker: the selection is copied in, the result goes back to the GUI thread.
  StartJob(compute_pool_, compute_jobs_, [this, latest, generation, selection = selection_]() {
    auto stale = [&] { return latest->load() != generation; };
    if (stale()) return;  // a newer request is queued behind this one
    ExplorerResult result = Compute(selection, generation, stale);
    if (stale()) return;
    Post([this, result = std::move(result)]() mutable { Apply(std::move(result)); });
  });
}

std::optional<RunOptions> ExplorerModel::RecommendedOptions(const ExplorerSelection& selection) {
  const sim::Recommendation r =
      sim::Recommend(selection.model, selection.machine, selection.options, selection.gpu_tier);
  if (!r.fastest) return std::nullopt;
  return r.fastest->options;
}

void ExplorerModel::Recommend() {
  SetBusy(true);
  StartJob(compute_pool_, compute_jobs_, [this, selection = selection_]() {
    std::optional<RunOptions> options;
    std::string error;
    try {
      options = RecommendedOptions(selection);
    } catch (const std::exception& e) {
      error = e.what();
    }
    Post([this, selection, options, error]() {
      SetBusy(false);
      if (!SameSelection(selection, selection_)) {
        emit recommendationDone(false, "the selection changed while searching");
      } else if (!error.empty()) {
        emit recommendationDone(false, QString::fromStdString(error));
      } else if (!options) {
        emit recommendationDone(false, "nothing fits at this context");
      } else {
        const RunOptions o = *options;
        Accept([&](ExplorerSelection& s) {
          s.options.chunk_tokens = o.chunk_tokens;
          s.options.page_tokens = o.page_tokens;
          s.options.offload = o.offload;
          s.options.keep_layer_inputs = o.keep_layer_inputs;
          s.options.optimizer = o.optimizer;
          s.options.query_tile = o.query_tile;
        });
        emit recommendationDone(true, "the fastest settings that fit are selected");
      }
    });
  });
}

ExplorerResult ExplorerModel::ComputeNow() {
  const uint64_t generation = latest_->fetch_add(1) + 1;
  ExplorerResult result = Compute(selection_, generation);
  Apply(result);
  return result;
}

void ExplorerModel::WaitForWorkers(bool deliver) {
  compute_pool_.waitForDone();
  timeline_pool_.waitForDone();
  if (deliver) QCoreApplication::sendPostedEvents(this);
}

void ExplorerModel::Apply(ExplorerResult result) {
  // The only place results land, always on this object's thread: an old generation's answer
  // must never overwrite a newer selection's, whatever order the worker finished in.
  if (result.generation != latest_->load()) {
    ++dropped_results_;
    return;
  }
  result_ = std::move(result);
  SetBusy(false);
  if (!result_.error.empty()) emit errorOccurred(QString::fromStdString(result_.error));
  emit resultReady(result_);
}

void ExplorerModel::SetBusy(bool busy) {
  if (busy == busy_) return;
  busy_ = busy;
  emit busyChanged(busy_);
}

ExplorerResult ExplorerModel::Compute(const ExplorerSelection& selection, uint64_t generation,
                                      const std::function<bool()>& cancelled) {
  ExplorerResult result;
  result.generation = generation;
  result.selection = selection;
  auto abandoned = [&] {
    if (!cancelled || !cancelled()) return false;
    result.error = "cancelled";
    return true;
  };
  try {
    const ModelSpec& model = selection.model;
    const MachineSpec& machine = selection.machine;
    const sim::KernelTimeModel time_model(machine);
    const sim::GpuTierSetting& tier = selection.gpu_tier;
    const PlanGeometry geometry(model, sim::WithGpuTier(model, machine, selection.options, tier));
    result.report =
        sim::MakeReport(geometry, machine, sim::AnalyticModel(time_model).Predict(geometry));
    if (abandoned()) return result;

    const sim::CapacityResult capacity =
        sim::FindMaxContext(model, machine, selection.options, tier);
    result.max_context_tokens = capacity.max_context_tokens;
    result.limit = capacity.limit;
    result.at_max = capacity.at_max;
    if (abandoned()) return result;

    // Memory as the max-context search probes it (closed-form, O(chunks) a point); where the
    // step fits, its time on the analytic path too.
    const sim::AnalyticModel analytic(time_model);
    for (const int64_t context : CurveContexts()) {
      RunOptions options = selection.options;
      options.context_tokens = context;
      const PlanGeometry point_geometry(model, sim::WithGpuTier(model, machine, options, tier));
      const sim::MemoryPrediction memory = sim::AnalyticModel::PredictMemory(point_geometry);
      sim::StepPrediction prediction;
      prediction.gpu = memory.gpu;
      prediction.host = memory.host;
      sim::PlanReport report = sim::MakeReport(point_geometry, machine, prediction);
      if (report.fits())
        report = sim::MakeReport(point_geometry, machine, analytic.Predict(point_geometry));
      result.curve.push_back({context, report.gpu_memory.allocated, report.gpu_memory.device,
                              report.host_peak, report.fits_gpu, report.fits_host,
                              report.fits() ? report.tokens_per_second : 0.0,
                              report.fits() ? report.prediction.step_seconds() : 0.0});
      if (abandoned()) return result;
    }
  } catch (const InputError& e) {
    result.error = e.what();
  } catch (const std::exception& e) {
    // A bug in the planner, not the user's doing: say so rather than blame the input.
    result.error = std::string("internal error: ") + e.what();
  }
  return result;
}

void ExplorerModel::ExportTimeline(const QString& path) {
  const uint64_t number = latest_timeline_->fetch_add(1) + 1;
  std::shared_ptr<std::atomic<uint64_t>> latest = latest_timeline_;
  auto job = [this, latest, number, selection = selection_, file_path = path.toStdString()]() {
    auto stale = [&] { return latest->load() != number; };
    if (stale()) return;
    bool ok = false;
    QString message;
    try {
      const StepPlan plan(selection.model, sim::WithGpuTier(selection.model, selection.machine,
                                                            selection.options, selection.gpu_tier));
      const sim::KernelTimeModel time_model(selection.machine);
      AtomicFileWriter file(file_path);
      sim::StepPrediction prediction;
      {
        ChromeTraceWriter trace(file.stream());
        trace.Metadata("tool", "ctxplan-gui timeline");
        trace.Metadata("model", selection.model.name);
        trace.Metadata("machine", selection.machine.name);
        trace.Metadata("context_tokens", selection.options.context_tokens);
        trace.Metadata("plan_version", StepPlan::kVersion);
        sim::TimelineWriter timeline(trace);
        CancellableObserver observer(timeline, stale);
        prediction = sim::EventSimulator(time_model).Run(plan, &observer);
        trace.Finish();
      }
      file.Commit();
      ok = true;
      message = QString("timeline: %1 ops, step %2 s, written to %3")
                    .arg(prediction.op_count)
                    .arg(prediction.step_seconds(), 0, 'f', 3)
                    .arg(QString::fromStdString(file_path));
    } catch (const TimelineCancelled&) {
      return;  // a newer export replaced this one; AtomicFileWriter removed its temporary file
    } catch (const InputError& e) {
      message = QString("timeline: ") + e.what();
    } catch (const std::exception& e) {
      message = QString("timeline: internal error: ") + e.what();
    }
    if (stale()) return;
    Post([this, ok, message] { emit timelineFinished(ok, message); });
  };
  StartJob(timeline_pool_, timeline_jobs_, std::move(job));
}

}  // namespace ctxplan::gui
