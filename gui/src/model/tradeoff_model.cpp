#include "model/tradeoff_model.h"

#include <QCoreApplication>
#include <QMetaObject>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <limits>
#include <utility>

#include "ctxplan/models/errors.h"
#include "ctxplan/runtime/plan/plan_geometry.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/capacity.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "ctxplan/sim/plan_report.h"

namespace ctxplan::gui {
namespace {

// The generation the destructor publishes: no job's generation equals it, so all give up.
constexpr uint64_t kShuttingDown = std::numeric_limits<uint64_t>::max();

// The tier a point's offload mode plans with. Auto keeps the selection's margin when the
// selection itself uses auto (so the highlighted point and its grid twin agree), else the
// explorer's default of 2 GiB.
sim::GpuTierSetting TierFor(OffloadMode mode, const sim::GpuTierSetting& selected) {
  sim::GpuTierSetting tier;  // off
  if (mode == OffloadMode::kHostWithTier) {
    tier.kind = sim::GpuTierSetting::Kind::kAuto;
    if (selected.kind == sim::GpuTierSetting::Kind::kAuto)
      tier.margin_bytes = selected.margin_bytes;
  }
  return tier;
}

// The grid's offload mode of the selection's own settings; false when the grid has none like
// it (a GPU tier of a given size).
bool ModeOf(const ExplorerSelection& s, OffloadMode& mode) {
  using Kind = sim::GpuTierSetting::Kind;
  if (!s.options.offload || s.gpu_tier.kind == Kind::kAll) {
    mode = OffloadMode::kOff;  // a tier of every page is offload off (WithGpuTier)
  } else if (s.gpu_tier.kind == Kind::kOff) {
    mode = OffloadMode::kHost;
  } else if (s.gpu_tier.kind == Kind::kAuto) {
    mode = OffloadMode::kHostWithTier;
  } else {
    return false;
  }
  return true;
}

// Plans `options` (offload and tier already chosen) at its context, as recommend plans a
// candidate: the step on the analytic path, then the max-context search with the same tier.
TradeoffPoint Evaluate(const ModelSpec& model, const MachineSpec& machine,
                       const sim::AnalyticModel& analytic, const RunOptions& options,
                       const sim::GpuTierSetting& tier) {
  TradeoffPoint p;
  p.options = sim::WithGpuTier(model, machine, options, tier);
  p.options.Validate(model);
  const PlanGeometry geometry(model, p.options);
  const sim::PlanReport report = sim::MakeReport(geometry, machine, analytic.Predict(geometry));
  p.fits = report.fits();
  p.fits_gpu = report.fits_gpu;
  p.fits_host = report.fits_host;
  p.tokens_per_second = report.tokens_per_second;
  p.step_seconds = report.prediction.step_seconds();
  p.gpu_device = report.gpu_memory.device;
  p.host_peak = report.host_peak;
  p.max_context_tokens = sim::FindMaxContext(model, machine, p.options, tier).max_context_tokens;
  return p;
}

std::string OffloadName(OffloadMode mode) {
  switch (mode) {
    case OffloadMode::kOff:
      return "off";
    case OffloadMode::kHost:
      return "on";
    case OffloadMode::kHostWithTier:
      return "on+tier";
  }
  return "?";
}

}  // namespace

int TradeoffResult::fitting() const {
  return static_cast<int>(
      std::count_if(points.begin(), points.end(), [](const TradeoffPoint& p) { return p.fits; }));
}

int TradeoffResult::frontier_size() const {
  return static_cast<int>(std::count_if(points.begin(), points.end(),
                                        [](const TradeoffPoint& p) { return p.frontier; }));
}

int TradeoffResult::fastest_fitting() const {
  int best = -1;
  for (int i = 0; i < static_cast<int>(points.size()); ++i)
    if (points[i].fits &&
        (best < 0 || points[i].tokens_per_second > points[best].tokens_per_second))
      best = i;
  return best;
}

const std::vector<int64_t>& TradeoffModel::GridChunks() {
  static const std::vector<int64_t> chunks = {1024, 2048, 4096, 8192};
  return chunks;
}

const std::vector<int64_t>& TradeoffModel::GridPages() {
  static const std::vector<int64_t> pages = {64, 128};
  return pages;
}

const std::vector<int64_t>& TradeoffModel::GridBudgets() {
  static const std::vector<int64_t> budgets = {16, 64, RunOptions::kAllPages};
  return budgets;
}

const std::vector<OffloadMode>& TradeoffModel::GridOffloads() {
  static const std::vector<OffloadMode> modes = {OffloadMode::kOff, OffloadMode::kHost,
                                                 OffloadMode::kHostWithTier};
  return modes;
}

std::string TradeoffModel::Label(const RunOptions& o, OffloadMode offload) {
  std::string label = "c" + std::to_string(o.chunk_tokens) + " p" + std::to_string(o.page_tokens);
  label += o.dense() ? " dense" : " k" + std::to_string(o.page_budget);
  switch (offload) {
    case OffloadMode::kOff:
      return label + " no-offload";
    case OffloadMode::kHost:
      return label + " offload";
    case OffloadMode::kHostWithTier:
      return label + " offload+tier";
  }
  return label;
}

TradeoffModel::TradeoffModel(QObject* parent)
    : QObject(parent),
      latest_(std::make_shared<std::atomic<uint64_t>>(0)),
      cancelled_jobs_(std::make_shared<std::atomic<uint64_t>>(0)) {
  pool_.setMaxThreadCount(1);
}

TradeoffModel::~TradeoffModel() {
  latest_->store(kShuttingDown);
  pool_.clear();  // jobs not started yet never start
  pool_.waitForDone();
}

uint64_t TradeoffModel::Request(const ExplorerSelection& selection) {
  const uint64_t generation = latest_->fetch_add(1) + 1;
  SetBusy(true);
  std::shared_ptr<std::atomic<uint64_t>> latest = latest_;
  std::shared_ptr<std::atomic<uint64_t>> cancelled_jobs = cancelled_jobs_;
  jobs_.Push([this, latest, cancelled_jobs, generation, selection]() {
    auto stale = [&] { return latest->load() != generation; };
    if (stale()) return;  // a newer request is queued behind this one
    TradeoffResult result = Compute(selection, generation, stale);
    if (stale()) {
      ++*cancelled_jobs;
      return;
    }
    Post([this, result = std::move(result)]() mutable { Apply(std::move(result)); });
  });
  // The pool's job carries no data of ours, only where to find it (see ExplorerModel).
  pool_.start([this] {
    if (std::function<void()> next = jobs_.Pop()) next();
  });
  return generation;
}

TradeoffResult TradeoffModel::ComputeNow(const ExplorerSelection& selection) {
  const uint64_t generation = latest_->fetch_add(1) + 1;
  TradeoffResult result = Compute(selection, generation);
  Apply(result);
  return result;
}

void TradeoffModel::WaitForWorkers(bool deliver) {
  pool_.waitForDone();
  if (deliver) QCoreApplication::sendPostedEvents(this);
}

void TradeoffModel::Post(std::function<void()> task) {
  posted_.Push(std::move(task));
  // Queued by name, so that Qt allocates and frees the call: dropped if this object is gone.
  QMetaObject::invokeMethod(this, "RunPosted", Qt::QueuedConnection);
}

void TradeoffModel::RunPosted() {
  while (std::function<void()> task = posted_.Pop()) task();
}

void TradeoffModel::Apply(TradeoffResult result) {
  // Always on this object's thread: an old generation's grid must never replace a newer one.
  if (result.generation != latest_->load()) {
    ++dropped_results_;
    return;
  }
  result_ = std::move(result);
  SetBusy(false);
  emit resultReady(result_, result_.generation);
}

void TradeoffModel::SetBusy(bool busy) {
  if (busy == busy_) return;
  busy_ = busy;
  emit busyChanged(busy_);
}

void TradeoffModel::MarkFrontier(std::vector<TradeoffPoint>& points) {
  // Quadratic, but the grid has 72 points; the plain definition is the easiest to trust.
  for (TradeoffPoint& p : points) {
    p.frontier = p.fits;
    if (!p.fits) continue;
    for (const TradeoffPoint& q : points) {
      if (!q.fits) continue;
      const bool at_least = q.max_context_tokens >= p.max_context_tokens &&
                            q.tokens_per_second >= p.tokens_per_second;
      const bool more =
          q.max_context_tokens > p.max_context_tokens || q.tokens_per_second > p.tokens_per_second;
      if (at_least && more) {
        p.frontier = false;
        break;
      }
    }
  }
}

TradeoffResult TradeoffModel::Compute(const ExplorerSelection& selection, uint64_t generation,
                                      const std::function<bool()>& cancelled) {
  TradeoffResult result;
  result.generation = generation;
  result.selection = selection;
  auto abandoned = [&] {
    if (!cancelled || !cancelled()) return false;
    result.error = "cancelled";
    result.points.clear();
    return true;
  };
  try {
    const ModelSpec& model = selection.model;
    const MachineSpec& machine = selection.machine;
    const RunOptions& base = selection.options;
    base.Validate(model);
    const sim::KernelTimeModel time_model(machine);
    const sim::AnalyticModel analytic(time_model);

    // The selection first: it is the highlight, and it tells the user at once whether the
    // inputs plan at all (an invalid selection fails here, not 72 times).
    result.selected = Evaluate(model, machine, analytic, base, selection.gpu_tier);
    OffloadMode selected_mode = OffloadMode::kOff;
    const bool on_grid = ModeOf(selection, selected_mode);
    result.selected.offload = selected_mode;
    result.selected.gpu_tier_text = selection.gpu_tier_text;
    result.selected.label = Label(base, selected_mode);
    if (!on_grid) result.selected.label += " tier " + selection.gpu_tier_text;
    if (abandoned()) return result;

    for (const int64_t chunk : GridChunks())
      for (const int64_t page : GridPages())
        for (const int64_t budget : GridBudgets())
          for (const OffloadMode mode : GridOffloads()) {
            // As recommend: a chunk beyond the context is the same plan as one of the context's
            // length, so only the first is kept. The selection's other options (sinks, grad
            // dtype, optimizer, pipeline stages, kept inputs, selection model) stay.
            if (chunk > base.context_tokens && chunk != GridChunks().front()) continue;
            RunOptions o = base;
            o.chunk_tokens = chunk;
            o.page_tokens = page;
            o.page_budget = budget;
            o.offload = mode != OffloadMode::kOff;
            o.query_tile = std::min(base.query_tile, chunk);
            o.gpu_tier_pages = 0;
            const sim::GpuTierSetting tier = TierFor(mode, selection.gpu_tier);
            TradeoffPoint p = Evaluate(model, machine, analytic, o, tier);
            p.offload = mode;
            p.gpu_tier_text = mode == OffloadMode::kHostWithTier ? "auto" : "off";
            p.label = Label(p.options, mode);
            if (on_grid && result.selected_index < 0 && mode == selected_mode &&
                chunk == base.chunk_tokens && page == base.page_tokens &&
                budget == base.page_budget && o.query_tile == base.query_tile)
              result.selected_index = static_cast<int>(result.points.size());
            result.points.push_back(std::move(p));
            if (abandoned()) return result;
          }
    MarkFrontier(result.points);
    if (result.selected_index >= 0)
      result.selected.frontier = result.points[result.selected_index].frontier;
  } catch (const InputError& e) {
    result.error = e.what();
    result.points.clear();
  } catch (const std::exception& e) {
    // A bug in the planner, not the user's doing: say so rather than blame the input.
    result.error = std::string("internal error: ") + e.what();
    result.points.clear();
  }
  return result;
}

void TradeoffModel::WriteCsv(std::ostream& out, const TradeoffResult& result) {
  out << "label,chunk_tokens,page_tokens,page_budget,offload,gpu_tier,gpu_tier_pages,"
         "context_tokens,fits,fits_gpu,fits_host,tokens_per_second,step_seconds,"
         "max_context_tokens,gpu_device_bytes,host_pinned_bytes,frontier,selected\n";
  for (size_t i = 0; i < result.points.size(); ++i) {
    const TradeoffPoint& p = result.points[i];
    const RunOptions& o = p.options;
    char figures[96];
    std::snprintf(figures, sizeof figures, "%.3f,%.6f", p.tokens_per_second, p.step_seconds);
    out << p.label << ',' << o.chunk_tokens << ',' << o.page_tokens << ','
        << (o.dense() ? std::string("all") : std::to_string(o.page_budget)) << ','
        << OffloadName(p.offload) << ',' << p.gpu_tier_text << ',' << o.gpu_tier_pages << ','
        << o.context_tokens << ',' << int{p.fits} << ',' << int{p.fits_gpu} << ','
        << int{p.fits_host} << ',' << figures << ',' << p.max_context_tokens << ',' << p.gpu_device
        << ',' << p.host_peak << ',' << int{p.frontier} << ','
        << int{static_cast<int>(i) == result.selected_index} << '\n';
  }
}

}  // namespace ctxplan::gui
