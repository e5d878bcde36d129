// The step as a timeline, without widgets: every kernel and copy as a compact span on its
// (rank, stream) lane, and memory as counter series, for TimelineView to draw. Made two ways: by
// simulating an ExplorerSelection's plan op by op (the event path, as `ctxplan timeline`), or
// from spans already made (ReplayModel builds the measured step from a trace's op records).
//
// A Timeline is immutable once built and shared as std::shared_ptr<const Timeline>: views, the
// model and a worker can hold the same one without copying half a million spans or locking.
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
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/runtime/plan/op.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/kernel_time_model.h"
#include "explorer_model.h"
#include "model/mailbox.h"

namespace ctxplan::gui {

// One kernel or copy. 40 bytes: a 1M-token step has ~380K of them, a 4M one over a million.
struct OpSpan {
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  OpId op_id = kNoOp;
  int32_t chunk = -1;
  int32_t layer = -1;
  int16_t rank = 0;
  Stream stream = Stream::kCompute;
  OpKind kind = OpKind::kAlloc;
  OpPart part = OpPart::kNone;
  Phase phase = Phase::kSetup;

  int64_t duration_ns() const { return end_ns - start_ns; }
};

// Bytes allocated in one memory space after each change, oldest first: a step function.
struct CounterPoint {
  int64_t time_ns = 0;
  int64_t bytes = 0;
};

struct CounterSeries {
  std::string name;  // "GPU 0 memory", "host memory" (machine 0), "host 1 memory"
  MemSpace space = MemSpace::kGpu;
  int where = 0;  // the GPU's rank; for host memory the machine
  int64_t peak_bytes = 0;
  std::vector<CounterPoint> points;
};

// The ops of one (rank, stream): spans()[begin, end), sorted by start.
struct TimelineLane {
  int rank = 0;
  Stream stream = Stream::kCompute;
  std::string name;  // "GPU 0 compute"
  size_t begin = 0;
  size_t end = 0;
};

class Timeline {
 public:
  Timeline() = default;
  // Takes spans in any order (memory bookkeeping ops, which take no time, are dropped) and
  // counters in any order of their points; sorts both and finds the lanes.
  Timeline(std::vector<OpSpan> spans, std::vector<CounterSeries> counters);

  const std::vector<OpSpan>& spans() const { return spans_; }
  const std::vector<TimelineLane>& lanes() const { return lanes_; }
  const std::vector<CounterSeries>& counters() const { return counters_; }
  bool empty() const { return spans_.empty(); }
  // First start and last end over all spans (0, 0 when empty).
  int64_t begin_ns() const { return begin_ns_; }
  int64_t end_ns() const { return end_ns_; }

  // The spans of `lane` that overlap [t0, t1], as indices into spans(): [first, last). Two binary
  // searches, so a paint of a zoomed-in view touches only what it shows.
  std::pair<size_t, size_t> VisibleOps(size_t lane, int64_t t0, int64_t t1) const;
  // The lane index of (rank, stream), or -1.
  int LaneOf(int rank, Stream stream) const;

  // CSV of the spans overlapping [t0, t1], lane by lane: op_id, rank, stream, kind, part, phase,
  // chunk, layer, start_ns, end_ns, duration_ns.
  void WriteCsv(std::ostream& out, int64_t t0, int64_t t1) const;
  // Writes it atomically; throws InputError naming the file when it cannot.
  void SaveCsv(const std::string& path, int64_t t0, int64_t t1) const;
  void SaveCsv(const std::string& path) const { SaveCsv(path, begin_ns_, end_ns_); }

  // "attention_bwd.paged": the name `ctxplan replay` and the Chrome trace give an op.
  static std::string KindPartName(OpKind kind, OpPart part);

 private:
  std::vector<OpSpan> spans_;
  // max(end) over spans_[lane.begin .. i]: monotone, so the first span that may reach into a
  // window is found by binary search even where a long op hides shorter ones after it.
  std::vector<int64_t> max_end_;
  std::vector<TimelineLane> lanes_;
  std::vector<CounterSeries> counters_;
  int64_t begin_ns_ = 0;
  int64_t end_ns_ = 0;
};

// Thrown out of a simulation that `cancelled` asked to abandon.
struct TimelineCancelled {};

// The plan simulated op by op (sim::EventSimulator) and recorded. `cancelled` is polled every few
// thousand ops (the event path cannot be interrupted otherwise). Throws InputError for a plan the
// simulator refuses or a step of more than kMaxTimelineSpans ops (a context of many millions of
// tokens: too many to hold and draw), TimelineCancelled when `cancelled` says so.
inline constexpr size_t kMaxTimelineSpans = 6'000'000;
Timeline SimulateTimeline(const StepPlan& plan, const sim::KernelTimeModel& time_model,
                          const std::function<bool()>& cancelled = {});

// Runs jobs one at a time on a private thread and hands what they send back to the owner's
// thread, as ExplorerModel does (explorer_model.h): data crosses threads only through mailboxes
// under a std::mutex, which ThreadSanitizer sees; Qt only starts the worker and wakes the owner.
// Each request takes a new generation; a job whose generation is no longer the latest is stale
// and gives up. Shared by TimelineModel and ReplayModel.
class WorkerQueue {
 public:
  // `owner` receives the posted tasks on its thread; it must outlive this queue (make the queue
  // a member of the owner) and have a `Q_INVOKABLE void RunPosted()` that calls this queue's
  // RunPosted(): the wake-up is queued by name, so that Qt allocates and frees the call and no
  // closure of ours crosses threads through Qt's locks, which ThreadSanitizer cannot see.
  explicit WorkerQueue(QObject* owner);
  // Makes every job stale, drops those not started and waits for the running one.
  ~WorkerQueue();
  WorkerQueue(const WorkerQueue&) = delete;
  WorkerQueue& operator=(const WorkerQueue&) = delete;

  // A new generation: every job started before is stale from now on.
  uint64_t Renew() { return latest_->fetch_add(1) + 1; }
  uint64_t latest() const { return latest_->load(); }
  // For a job to poll: true once its generation is no longer the latest.
  std::function<bool()> StaleCheck(uint64_t generation) const;
  // Runs `job` on the worker thread, after the jobs started before it.
  void Start(std::function<void()> job);
  // From the worker: runs `task` on the owner's thread.
  void Post(std::function<void()> task);
  // Blocks until the worker is idle, then (with `deliver`) runs what it posted, here. For tests.
  void Wait(bool deliver = true);
  // Runs what the worker posted, oldest first; the owner's RunPosted() calls it.
  void RunPosted();

 private:
  QObject* owner_;
  std::shared_ptr<std::atomic<uint64_t>> latest_;
  // Before the pool: the pool's thread may still use them while the pool shuts down.
  Mailbox jobs_;
  Mailbox posted_;
  QThreadPool pool_;
};

// The timeline of the explorer's selection, simulated off the GUI thread (the newest request
// wins, older ones are abandoned mid-simulation), or one handed in ready-made.
class TimelineModel : public QObject {
  Q_OBJECT

 public:
  explicit TimelineModel(QObject* parent = nullptr);
  // Shows `timeline` at once; nothing is computed.
  explicit TimelineModel(Timeline timeline, QObject* parent = nullptr);
  ~TimelineModel() override;

  // The newest timeline applied (empty, never null, before the first).
  std::shared_ptr<const Timeline> timeline() const { return timeline_; }
  // The newest request's error; empty when it succeeded.
  const QString& error() const { return error_; }
  bool busy() const { return busy_; }

  // Simulates `selection`'s step on the worker thread; timelineChanged() when it lands.
  void Request(const ExplorerSelection& selection);
  // The same on the calling thread, applied as the newest (a request in flight becomes stale).
  // Returns the error, empty on success. For tests and scripted use.
  QString ComputeNow(const ExplorerSelection& selection);
  // Shows a timeline made elsewhere (a trace's spans); a request in flight becomes stale.
  void SetTimeline(Timeline timeline);
  void SetTimeline(std::shared_ptr<const Timeline> timeline);
  // Blocks until the worker is idle and applies what it finished. For tests.
  void WaitForWorkers() { worker_.Wait(true); }

  // The computation itself: pure, thread-safe. Throws InputError, TimelineCancelled.
  static Timeline Compute(const ExplorerSelection& selection,
                          const std::function<bool()>& cancelled = {});

 signals:
  void timelineChanged();
  void errorOccurred(const QString& message);
  void busyChanged(bool busy);

 private:
  Q_INVOKABLE void RunPosted() { worker_.RunPosted(); }  // see WorkerQueue
  void Apply(uint64_t generation, std::shared_ptr<const Timeline> timeline, QString error);
  void SetBusy(bool busy);

  std::shared_ptr<const Timeline> timeline_;
  QString error_;
  bool busy_ = false;
  WorkerQueue worker_;  // last: its destructor stops the worker before the rest goes
};

}  // namespace ctxplan::gui
