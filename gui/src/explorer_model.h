// The explorer's state and computation, without widgets (the KDAB hotspot split): the user's
// selection, validated by the library on every change, and the answers the window shows,
// computed off the GUI thread. Tests drive it headless with a QCoreApplication.
//
// Every accepted change requests a computation tagged with a new generation. Requests run one at
// a time on a private worker thread; a job whose generation is no longer the latest gives up
// between stages, and a result that arrives for an old generation is dropped. So dragging the
// context slider costs at most one computation in flight, and the window only ever shows the
// answer to the newest selection.
//
// What crosses between threads (a job's selection, a job's answer) goes through a Mailbox under a
// std::mutex, never in the closure of a Qt pool job or queued call: Qt's own locks are futexes
// inside libQt6Core, which ThreadSanitizer does not see, so it would take every such hand-off for
// a data race and could not check the rest (scripts/tsan.sh). Qt only starts the worker and wakes
// this object's thread.
#pragma once

#include <QObject>
#include <QString>
#include <QThreadPool>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "ctxplan/models/gpu_spec.h"
#include "ctxplan/models/model_spec.h"
#include "ctxplan/runtime/plan/run_options.h"
#include "ctxplan/sim/capacity.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/plan_report.h"
#include "model/mailbox.h"

namespace ctxplan::gui {

// What the user has chosen. Model and machine are loaded when chosen (which validates them), so
// a request hands the worker plain data and the worker never touches the catalogue.
struct ExplorerSelection {
  std::string model_name;
  std::string machine_name;
  ModelSpec model;
  MachineSpec machine;
  RunOptions options;  // options.context_tokens is the context being looked at
  // The page store's GPU tier (with offload), sized for each context planned; its text as
  // chosen ("off", "auto", "32GiB").
  sim::GpuTierSetting gpu_tier;
  std::string gpu_tier_text = "off";
};

// One point of the curves against context: memory, and the speed where the step fits (the
// analytic path, as `ctxplan sweep` predicts it).
struct CurvePoint {
  int64_t context_tokens = 0;
  int64_t gpu_allocated = 0;  // our arena's peak
  int64_t gpu_device = 0;     // what nvidia-smi would show; compared with the GPU's capacity
  int64_t host_peak = 0;      // pinned host memory; compared with the usable host RAM
  bool fits_gpu = false;
  bool fits_host = false;
  double tokens_per_second = 0;  // 0 where it does not fit
  double step_seconds = 0;

  bool fits() const { return fits_gpu && fits_host; }
};

// The answers for one selection. `report` carries, at the selected context: memory by category
// at the peak (prediction.gpu.at_peak, prediction.host.at_peak), GPU memory three ways against
// gpu_capacity, host_peak against host_capacity (usable), step seconds, tokens/s and bottleneck.
struct ExplorerResult {
  uint64_t generation = 0;  // 0: nothing computed yet
  ExplorerSelection selection;
  std::string error;  // non-empty: the computation failed and nothing below is valid
  sim::PlanReport report;
  int64_t max_context_tokens = 0;
  sim::CapacityLimit limit = sim::CapacityLimit::kNothingFits;
  sim::PlanReport at_max;  // the plan at max_context_tokens
  std::vector<CurvePoint> curve;

  bool ok() const { return generation != 0 && error.empty(); }
};

class ExplorerModel : public QObject {
  Q_OBJECT

 public:
  // The curve's contexts: kCurvePoints log-spaced from 4K to 4M tokens, the range where the
  // method's interesting limits (GPU, then host RAM) fall on the machines we plan for.
  static constexpr int kCurvePoints = 24;
  static constexpr int64_t kCurveMinTokens = int64_t{4} << 10;
  static constexpr int64_t kCurveMaxTokens = int64_t{4} << 20;
  static std::vector<int64_t> CurveContexts();

  // Starts with the CLI's defaults (qwen2.5-7b on h200-125g, RunOptions' defaults). Computes
  // nothing until a setter, Refresh() or ComputeNow() asks.
  explicit ExplorerModel(QObject* parent = nullptr);
  // Stops stale work and waits for the worker threads, so no job outlives the model.
  ~ExplorerModel() override;

  const ExplorerSelection& selection() const { return selection_; }
  // The newest result applied (generation 0 before the first).
  const ExplorerResult& result() const { return result_; }
  // Generation of the newest request; its result is the only one that will be applied.
  uint64_t generation() const { return latest_->load(); }
  bool busy() const { return busy_; }

  // Each setter validates the changed selection with the library. Accepted: the state changes,
  // selectionChanged() fires and a computation is requested (unless nothing changed). Refused:
  // errorOccurred() carries the library's one-line InputError and the state is unchanged.
  bool SetModelName(const QString& name);
  bool SetMachineName(const QString& name);
  bool SetContextTokens(qint64 tokens);
  bool SetChunkTokens(qint64 tokens);
  bool SetPageTokens(qint64 tokens);
  bool SetPageBudget(qint64 pages);  // RunOptions::kAllPages (0) is dense attention
  bool SetOffload(bool on);
  // GPUs the layers are pipelined over (RunOptions::pipeline_stages): memory is per GPU.
  bool SetGpus(int gpus);
  bool SetGradDtype(const QString& name);       // bf16 | fp32
  bool SetOptimizer(const QString& name);       // adamw-gpu | adamw-host | none
  bool SetSelectionModel(const QString& text);  // shared | disjoint | overlap:F
  bool SetGpuTier(const QString& text);         // off | auto | a size, e.g. 32GiB
  bool SetLoraRank(int rank);                   // 0: full fine-tune
  bool SetQueryTile(qint64 queries);            // queries sharing one page selection
  bool SetSinkPages(qint64 pages);              // pages every query tile attends
  bool SetKeepLayerInputs(bool keep);           // keep them from the fill, or recompute them

  // Requests a computation of the current selection on the worker thread.
  void Refresh();
  // Searches, on the worker thread, the fastest settings that fit at the selected context
  // (`ctxplan recommend`: chunk, page, offload, kept inputs, the optimizer's placement) and,
  // unless the selection changed meanwhile, selects them; recommendationDone() says what came of
  // it. The search itself, pure: nullopt when nothing fits.
  void Recommend();
  static std::optional<RunOptions> RecommendedOptions(const ExplorerSelection& selection);
  // Computes the current selection on the calling thread and applies it as the newest
  // generation (any request in flight becomes stale). For tests and scripted use.
  ExplorerResult ComputeNow();
  // Blocks until the worker threads are idle, then (with `deliver`) hands this object what they
  // queued for it. For tests.
  void WaitForWorkers(bool deliver = true);
  // Results that arrived for a generation that was no longer the newest, and were dropped.
  uint64_t dropped_results() const { return dropped_results_; }

  // Simulates the selected step op by op (event path) on a worker thread and writes it as
  // Chrome trace JSON to `path`, atomically. A newer export cancels an older one; the file is
  // then left as it was. Ends with timelineFinished().
  void ExportTimeline(const QString& path);

  // The computation itself: pure, thread-safe. `cancelled` is polled between stages; when it
  // returns true the result is abandoned (error "cancelled").
  static ExplorerResult Compute(const ExplorerSelection& selection, uint64_t generation,
                                const std::function<bool()>& cancelled = {});

 signals:
  void selectionChanged();
  void resultReady(const ctxplan::gui::ExplorerResult& result);
  void errorOccurred(const QString& message);
  void busyChanged(bool busy);
  void timelineFinished(bool ok, const QString& message);
  void recommendationDone(bool applied, const QString& message);

 private:
  // Runs `job` on `pool`'s thread, after the jobs started on it before.
  static void StartJob(QThreadPool& pool, Mailbox& jobs, std::function<void()> job);
  // From a worker: runs `task` on this object's thread (never, if the object is gone by then).
  void Post(std::function<void()> task);
  Q_INVOKABLE void RunPosted();

  // Applies `change` to a copy of the selection, validates the copy and, if it passes and differs,
  // makes it the selection; see the setters.
  bool Accept(const std::function<void(ExplorerSelection&)>& change);
  void Apply(ExplorerResult result);
  void SetBusy(bool busy);

  ExplorerSelection selection_;
  ExplorerResult result_;
  bool busy_ = false;
  uint64_t dropped_results_ = 0;
  // Shared with the jobs, which may still hold them while the model goes away: the newest
  // generation (jobs compare theirs against it) and the newest timeline export's number.
  std::shared_ptr<std::atomic<uint64_t>> latest_;
  std::shared_ptr<std::atomic<uint64_t>> latest_timeline_;
  // Jobs waiting for the pools' threads, and what the jobs hand back to this object's thread.
  // Declared before the pools, so that they outlive the pools' threads.
  Mailbox compute_jobs_;
  Mailbox timeline_jobs_;
  Mailbox posted_;
  // One thread each: computations queue behind each other (stale ones then return at once),
  // and a long timeline export never delays the charts.
  QThreadPool compute_pool_;
  QThreadPool timeline_pool_;
};

}  // namespace ctxplan::gui
