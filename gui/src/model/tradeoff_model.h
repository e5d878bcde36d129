// The explorer's trade-off view, without widgets: for the user's selection (model, machine,
// context and the options they train with), a grid of the settings that trade speed against
// memory (chunk, page, page budget, offload and its GPU tier), each planned on the analytic path
// as `ctxplan recommend` plans its candidates, and the Pareto frontier of max context against
// tokens/s among those that fit at the selected context. Tests drive it headless.
//
// Requests run on one private worker thread, newest first: each request takes a new generation,
// a job whose generation is no longer the latest gives up between points, and a result that
// arrives for an old generation is dropped. Data crosses threads only through a Mailbox (see
// explorer_model.h for why not through Qt's queued calls).
#pragma once

#include <QObject>
#include <QThreadPool>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

#include "ctxplan/runtime/plan/run_options.h"
#include "explorer_model.h"
#include "model/mailbox.h"

namespace ctxplan::gui {

// How a point keeps its KV/dKV pages: all on the GPU, in pinned host memory, or in host memory
// with a GPU tier (auto: the earliest pages in what the plan leaves free on the GPU).
enum class OffloadMode : uint8_t { kOff, kHost, kHostWithTier };

// One choice of the grid, planned at the selection's context.
struct TradeoffPoint {
  RunOptions options;  // the selection's options with this point's choices; gpu_tier_pages resolved
  OffloadMode offload = OffloadMode::kOff;
  std::string gpu_tier_text = "off";  // what ExplorerModel::SetGpuTier takes to select it
  std::string label;                  // "c4096 p128 k64 offload+tier"
  // At the selected context. tokens_per_second is the analytic path's even where the step does
  // not fit (what it would run at with the memory), so non-fitting points can be drawn greyed.
  bool fits = false;
  bool fits_gpu = false;
  bool fits_host = false;
  double tokens_per_second = 0;
  double step_seconds = 0;
  int64_t gpu_device = 0;  // what nvidia-smi would show, per GPU
  int64_t host_peak = 0;   // pinned host memory, per machine
  // The largest context that fits with these settings (0: not even one token).
  int64_t max_context_tokens = 0;
  // No fitting point has at least its max context and tokens/s and more of one (only fitting
  // points are on it).
  bool frontier = false;
};

struct TradeoffResult {
  uint64_t generation = 0;  // 0: nothing computed yet
  ExplorerSelection selection;
  std::string error;  // non-empty: the computation failed and nothing below is valid
  // The grid in a fixed order (chunk, then page, page budget, offload), as recommend searches.
  std::vector<TradeoffPoint> points;
  // The selection's own settings, planned like a point: the highlight. Its index in `points`
  // when the grid holds the same settings, else -1 (a chunk or GPU tier off the grid).
  TradeoffPoint selected;
  int selected_index = -1;

  bool ok() const { return generation != 0 && error.empty(); }
  int fitting() const;
  int frontier_size() const;
  // The fitting point with the most tokens/s (the first of equals, as recommend keeps it); -1
  // when none fits.
  int fastest_fitting() const;
};

class TradeoffModel : public QObject {
  Q_OBJECT

 public:
  // The grid (4 x 2 x 3 x 3 = 72 points where the context is at least 8192 tokens; chunks
  // longer than the context are skipped but the first, as in recommend: the same plan).
  static const std::vector<int64_t>& GridChunks();   // 1024, 2048, 4096, 8192
  static const std::vector<int64_t>& GridPages();    // 64, 128
  static const std::vector<int64_t>& GridBudgets();  // 16, 64, all (RunOptions::kAllPages)
  static const std::vector<OffloadMode>& GridOffloads();

  explicit TradeoffModel(QObject* parent = nullptr);
  // Stops stale work and waits for the worker, so no job outlives the model.
  ~TradeoffModel() override;

  // Requests the grid for `selection` on the worker; returns its generation. The window calls
  // it with ExplorerModel::selection() on every selectionChanged (or only while the view is
  // visible): a request in flight becomes stale and gives up at its next point.
  uint64_t Request(const ExplorerSelection& selection);
  // Computes on the calling thread and applies it as the newest generation (a request in flight
  // becomes stale). For tests and scripted use.
  TradeoffResult ComputeNow(const ExplorerSelection& selection);
  // Blocks until the worker is idle, then (with `deliver`) hands this object what it queued.
  void WaitForWorkers(bool deliver = true);

  const TradeoffResult& result() const { return result_; }  // the newest applied
  uint64_t generation() const { return latest_->load(); }   // the newest requested
  bool busy() const { return busy_; }
  uint64_t dropped_results() const { return dropped_results_; }        // arrived stale, dropped
  uint64_t cancelled_jobs() const { return cancelled_jobs_->load(); }  // gave up mid-grid

  // The computation itself: pure, thread-safe. `cancelled` is polled between points; when it
  // returns true the result is abandoned (error "cancelled").
  static TradeoffResult Compute(const ExplorerSelection& selection, uint64_t generation,
                                const std::function<bool()>& cancelled = {});
  // Marks `frontier` on every point (see TradeoffPoint::frontier).
  static void MarkFrontier(std::vector<TradeoffPoint>& points);
  // "c4096 p128 k64 offload+tier" ("dense" for every page, "no-offload", "offload").
  static std::string Label(const RunOptions& options, OffloadMode offload);

  // CSV: a header, then one row a point (label, the settings, the figures, the frontier flag).
  static void WriteCsv(std::ostream& out, const TradeoffResult& result);

 signals:
  // On this object's thread, for the newest generation only (result.generation == generation).
  void resultReady(const ctxplan::gui::TradeoffResult& result, quint64 generation);
  void busyChanged(bool busy);

 private:
  // Tasks handed from one thread to another, oldest first (as ExplorerModel's).

  void Post(std::function<void()> task);
  Q_INVOKABLE void RunPosted();
  void Apply(TradeoffResult result);
  void SetBusy(bool busy);

  TradeoffResult result_;
  bool busy_ = false;
  uint64_t dropped_results_ = 0;
  std::shared_ptr<std::atomic<uint64_t>> latest_;
  std::shared_ptr<std::atomic<uint64_t>> cancelled_jobs_;
  // Declared before the pool so that they outlive its thread.
  Mailbox jobs_;
  Mailbox posted_;
  QThreadPool pool_;
};

}  // namespace ctxplan::gui
