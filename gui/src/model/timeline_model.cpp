#include "model/timeline_model.h"

#include <QMetaObject>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <limits>
#include <tuple>

#include "ctxplan/models/errors.h"
#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/sim/gpu_tier.h"
#include "ctxplan/sim/tick.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan::gui {
namespace {

// The generation the queue's destructor publishes: no job's generation equals it.
constexpr uint64_t kShuttingDown = std::numeric_limits<uint64_t>::max();

constexpr int64_t kMaxTimeNs = int64_t{1} << 53;

int64_t Nanoseconds(sim::Tick ticks) {
  // Rounded as the trace recorder rounds, so a simulated timeline and a .ctxtrace of the same
  // prediction agree to the nanosecond.
  return (ticks + sim::kTicksPerNanosecond / 2) / sim::kTicksPerNanosecond;
}

std::string LaneName(int rank, Stream stream) {
  return "GPU " + std::to_string(rank) + " " + std::string(StreamName(stream));
}

std::string CounterName(MemSpace space, int where) {
  if (space == MemSpace::kGpu) return "GPU " + std::to_string(where) + " memory";
  // Host memory by machine: with pipeline stages on several machines, each has its own.
  return where == 0 ? std::string("host memory") : "host " + std::to_string(where) + " memory";
}

// Keeps every kernel and copy, and each memory space's total after every change.
class Recorder final : public sim::SimObserver {
 public:
  explicit Recorder(const std::function<bool()>& cancelled) : cancelled_(cancelled) {}

  void OnOpComplete(const Op& op, sim::Tick start, sim::Tick end) override {
    if ((spans.size() & 4095) == 4095 && cancelled_ && cancelled_()) throw TimelineCancelled{};
    if (spans.size() >= kMaxTimelineSpans)
      throw InputError("the step has more than " + std::to_string(kMaxTimelineSpans) +
                       " kernels and copies, too many to show as a timeline; accepted: a "
                       "shorter context or larger chunks");
    OpSpan s;
    s.start_ns = Nanoseconds(start);
    s.end_ns = Nanoseconds(end);
    s.op_id = op.id;
    s.chunk = op.chunk;
    s.layer = op.layer;
    s.rank = op.rank;
    s.stream = op.stream;
    s.kind = op.kind;
    s.part = op.part;
    s.phase = op.phase;
    spans.push_back(s);
  }

  void OnMemory(MemSpace space, int where, sim::Tick when,
                const sim::MemoryTracker& memory) override {
    CounterSeries* series = nullptr;
    for (CounterSeries& c : counters)
      if (c.space == space && c.where == where) series = &c;
    if (series == nullptr) {
      counters.push_back({CounterName(space, where), space, where, 0, {}});
      series = &counters.back();
    }
    series->points.push_back({Nanoseconds(when), memory.total()});
  }

  std::vector<OpSpan> spans;
  std::vector<CounterSeries> counters;

 private:
  const std::function<bool()>& cancelled_;
};

}  // namespace

// --- Timeline ----------------------------------------------------------------------------------

Timeline::Timeline(std::vector<OpSpan> spans, std::vector<CounterSeries> counters)
    : spans_(std::move(spans)), counters_(std::move(counters)) {
  // Only what takes time on a stream; a tracer may have recorded bookkeeping ops, and a trace's
  // bytes are not to be trusted with out-of-range kinds or streams.
  // Times beyond +-2^53 ns (104 days) are a corrupt record, not a step: dropping them keeps every
  // difference the views take exact in a double and far from overflow.
  std::erase_if(spans_, [](const OpSpan& s) {
    return static_cast<int>(s.kind) >= kOpKindCount || IsMemory(s.kind) ||
           static_cast<int>(s.stream) >= kStreamCount || s.rank < 0 ||
           std::abs(s.start_ns) > kMaxTimeNs || std::abs(s.end_ns) > kMaxTimeNs;
  });
  for (OpSpan& s : spans_) {
    s.end_ns = std::max(s.end_ns, s.start_ns);
    // The names of these are looked up by index when drawn or exported.
    if (static_cast<int>(s.part) >= static_cast<int>(OpPart::kCount_)) s.part = OpPart::kNone;
    if (static_cast<int>(s.phase) >= static_cast<int>(Phase::kCount_)) s.phase = Phase::kSetup;
  }
  std::sort(spans_.begin(), spans_.end(), [](const OpSpan& a, const OpSpan& b) {
    return std::tie(a.rank, a.stream, a.start_ns, a.op_id) <
           std::tie(b.rank, b.stream, b.start_ns, b.op_id);
  });
  max_end_.resize(spans_.size());
  if (!spans_.empty()) {
    begin_ns_ = std::numeric_limits<int64_t>::max();
    end_ns_ = std::numeric_limits<int64_t>::min();
  }
  for (size_t i = 0; i < spans_.size(); ++i) {
    const OpSpan& s = spans_[i];
    const bool new_lane =
        lanes_.empty() || lanes_.back().rank != s.rank || lanes_.back().stream != s.stream;
    if (new_lane) {
      if (!lanes_.empty()) lanes_.back().end = i;
      lanes_.push_back({s.rank, s.stream, LaneName(s.rank, s.stream), i, i});
    }
    max_end_[i] = new_lane ? s.end_ns : std::max(max_end_[i - 1], s.end_ns);
    begin_ns_ = std::min(begin_ns_, s.start_ns);
    end_ns_ = std::max(end_ns_, s.end_ns);
  }
  if (!lanes_.empty()) lanes_.back().end = spans_.size();

  for (CounterSeries& c : counters_) {
    std::erase_if(c.points, [](const CounterPoint& p) { return std::abs(p.time_ns) > kMaxTimeNs; });
    std::stable_sort(
        c.points.begin(), c.points.end(),
        [](const CounterPoint& a, const CounterPoint& b) { return a.time_ns < b.time_ns; });
    c.peak_bytes = 0;
    // Several changes at one instant draw as the level after the last; the peak still counts
    // every one of them, as the simulator's peak does.
    std::vector<CounterPoint> kept;
    kept.reserve(c.points.size());
    for (const CounterPoint& p : c.points) {
      c.peak_bytes = std::max(c.peak_bytes, p.bytes);
      if (!kept.empty() && kept.back().time_ns == p.time_ns)
        kept.back().bytes = p.bytes;
      else
        kept.push_back(p);
    }
    c.points = std::move(kept);
  }
  std::sort(counters_.begin(), counters_.end(), [](const CounterSeries& a, const CounterSeries& b) {
    return std::tie(a.space, a.where) < std::tie(b.space, b.where);
  });
}

std::pair<size_t, size_t> Timeline::VisibleOps(size_t lane, int64_t t0, int64_t t1) const {
  if (lane >= lanes_.size()) return {0, 0};
  const TimelineLane& l = lanes_[lane];
  // First span that may still run at t0: every span before it ended before t0.
  const auto first = std::lower_bound(max_end_.begin() + static_cast<std::ptrdiff_t>(l.begin),
                                      max_end_.begin() + static_cast<std::ptrdiff_t>(l.end), t0);
  // First span that starts after t1.
  const auto last = std::upper_bound(spans_.begin() + static_cast<std::ptrdiff_t>(l.begin),
                                     spans_.begin() + static_cast<std::ptrdiff_t>(l.end), t1,
                                     [](int64_t t, const OpSpan& s) { return t < s.start_ns; });
  const size_t a = static_cast<size_t>(first - max_end_.begin());
  const size_t b = static_cast<size_t>(last - spans_.begin());
  return {a, std::max(a, b)};
}

int Timeline::LaneOf(int rank, Stream stream) const {
  for (size_t i = 0; i < lanes_.size(); ++i)
    if (lanes_[i].rank == rank && lanes_[i].stream == stream) return static_cast<int>(i);
  return -1;
}

std::string Timeline::KindPartName(OpKind kind, OpPart part) {
  std::string name(OpKindName(kind));
  if (part != OpPart::kNone) name += "." + std::string(OpPartName(part));
  return name;
}

void Timeline::WriteCsv(std::ostream& out, int64_t t0, int64_t t1) const {
  // No quoting needed: the names are the library's own identifiers, without commas or quotes.
  out << "op_id,rank,stream,kind,part,phase,chunk,layer,start_ns,end_ns,duration_ns\n";
  for (size_t lane = 0; lane < lanes_.size(); ++lane) {
    const auto [first, last] = VisibleOps(lane, t0, t1);
    for (size_t i = first; i < last; ++i) {
      const OpSpan& s = spans_[i];
      if (s.end_ns < t0 || s.start_ns > t1) continue;  // hidden behind a longer op's end
      out << s.op_id << ',' << s.rank << ',' << StreamName(s.stream) << ',' << OpKindName(s.kind)
          << ',' << (s.part == OpPart::kNone ? std::string_view() : OpPartName(s.part)) << ','
          << PhaseName(s.phase) << ',' << s.chunk << ',' << s.layer << ',' << s.start_ns << ','
          << s.end_ns << ',' << s.duration_ns() << '\n';
    }
  }
}

void Timeline::SaveCsv(const std::string& path, int64_t t0, int64_t t1) const {
  AtomicFileWriter file(path);
  WriteCsv(file.stream(), t0, t1);
  file.Commit();
}

Timeline SimulateTimeline(const StepPlan& plan, const sim::KernelTimeModel& time_model,
                          const std::function<bool()>& cancelled) {
  Recorder recorder(cancelled);
  sim::EventSimulator(time_model).Run(plan, &recorder);
  return Timeline(std::move(recorder.spans), std::move(recorder.counters));
}

// --- WorkerQueue -------------------------------------------------------------------------------

WorkerQueue::WorkerQueue(QObject* owner)
    : owner_(owner), latest_(std::make_shared<std::atomic<uint64_t>>(0)) {
  pool_.setMaxThreadCount(1);
}

WorkerQueue::~WorkerQueue() {
  latest_->store(kShuttingDown);
  pool_.clear();  // jobs not started yet never start
  pool_.waitForDone();
  // What the job posted is dropped with posted_, and the owner's ~QObject drops the wake-ups.
}

std::function<bool()> WorkerQueue::StaleCheck(uint64_t generation) const {
  return [latest = latest_, generation] { return latest->load() != generation; };
}

void WorkerQueue::Start(std::function<void()> job) {
  jobs_.Push(std::move(job));
  // The pool's job carries no data, only where to find it: the oldest job waiting.
  pool_.start([this] {
    if (std::function<void()> next = jobs_.Pop()) next();
  });
}

void WorkerQueue::Post(std::function<void()> task) {
  posted_.Push(std::move(task));
  // The wake-up carries no data either, and is queued by name (see the constructor); Qt drops it
  // if the owner is gone by then.
  QMetaObject::invokeMethod(owner_, "RunPosted", Qt::QueuedConnection);
}

void WorkerQueue::Wait(bool deliver) {
  pool_.waitForDone();
  if (deliver) RunPosted();
}

void WorkerQueue::RunPosted() {
  // One wake-up may find several tasks (and later ones none): one at a time, outside the lock,
  // as a task may start or post more.
  while (std::function<void()> task = posted_.Pop()) task();
}

// --- TimelineModel -----------------------------------------------------------------------------

TimelineModel::TimelineModel(QObject* parent)
    : QObject(parent), timeline_(std::make_shared<const Timeline>()), worker_(this) {}

TimelineModel::TimelineModel(Timeline timeline, QObject* parent)
    : QObject(parent),
      timeline_(std::make_shared<const Timeline>(std::move(timeline))),
      worker_(this) {}

TimelineModel::~TimelineModel() = default;

Timeline TimelineModel::Compute(const ExplorerSelection& selection,
                                const std::function<bool()>& cancelled) {
  const StepPlan plan(selection.model, sim::WithGpuTier(selection.model, selection.machine,
                                                        selection.options, selection.gpu_tier));
  const sim::KernelTimeModel time_model(selection.machine);
  return SimulateTimeline(plan, time_model, cancelled);
}

void TimelineModel::Request(const ExplorerSelection& selection) {
  const uint64_t generation = worker_.Renew();
  SetBusy(true);
  worker_.Start([this, generation, stale = worker_.StaleCheck(generation), selection] {
    if (stale()) return;  // a newer request is queued behind this one
    std::shared_ptr<const Timeline> timeline;
    std::string error;
    try {
      timeline = std::make_shared<const Timeline>(Compute(selection, stale));
    } catch (const TimelineCancelled&) {
      return;
    } catch (const InputError& e) {
      error = e.what();
    } catch (const std::exception& e) {
      error = std::string("internal error: ") + e.what();
    }
    if (stale()) return;
    worker_.Post([this, generation, timeline, error] {
      Apply(generation, timeline, QString::fromStdString(error));
    });
  });
}

QString TimelineModel::ComputeNow(const ExplorerSelection& selection) {
  const uint64_t generation = worker_.Renew();
  std::shared_ptr<const Timeline> timeline;
  QString error;
  try {
    timeline = std::make_shared<const Timeline>(Compute(selection));
  } catch (const InputError& e) {
    error = QString::fromStdString(e.what());
  } catch (const std::exception& e) {
    error = QString("internal error: ") + e.what();
  }
  Apply(generation, timeline, error);
  return error;
}

void TimelineModel::SetTimeline(Timeline timeline) {
  SetTimeline(std::make_shared<const Timeline>(std::move(timeline)));
}

void TimelineModel::SetTimeline(std::shared_ptr<const Timeline> timeline) {
  Apply(worker_.Renew(), std::move(timeline), {});
}

void TimelineModel::Apply(uint64_t generation, std::shared_ptr<const Timeline> timeline,
                          QString error) {
  // An old request's answer never replaces a newer one's, whatever order they finished in.
  if (generation != worker_.latest()) return;
  // A failed request shows nothing rather than the previous selection's step as if it were this.
  timeline_ = timeline ? std::move(timeline) : std::make_shared<const Timeline>();
  error_ = std::move(error);
  SetBusy(false);
  if (!error_.isEmpty()) emit errorOccurred(error_);
  emit timelineChanged();
}

void TimelineModel::SetBusy(bool busy) {
  if (busy == busy_) return;
  busy_ = busy;
  emit busyChanged(busy_);
}

}  // namespace ctxplan::gui
