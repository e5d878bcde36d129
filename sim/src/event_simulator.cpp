#include "ctxplan/sim/event_simulator.h"

#include <deque>
#include <string>
#include <vector>

#include "ctxplan/models/errors.h"
#include "ctxplan/sim/analytic_model.h"
#include "ctxplan/sim/event_queue.h"

namespace ctxplan::sim {

namespace {

// Completion times are kept in a ring indexed by op id. A dependency is never more than
// kMaxDependencyDistance ops back, and no queued op is more than kLookaheadOps ahead of the
// oldest unfinished one, so a ring of this size never overwrites a time still needed.
constexpr size_t kCompletionRing = size_t{1} << 16;
static_assert(kCompletionRing > EventSimulator::kLookaheadOps + StepPlan::kMaxDependencyDistance);

class Engine;

// One in-order stream: a queue of ops, at most one running, and the event of its completion.
class StreamState final : public Event {
 public:
  StreamState() : Event(EventPriority::kOpComplete) {}
  void Process() override;
  std::string Name() const override { return "stream " + std::string(StreamName(stream)); }

  Engine* engine = nullptr;
  Stream stream = Stream::kCompute;
  std::deque<Op> waiting;
  bool busy = false;
  Op running;
  Tick running_since = 0;
  Tick busy_ticks = 0;
};

class Engine {
 public:
  Engine(const StepPlan& plan, const KernelTimeModel& time_model, SimObserver* observer)
      : ops_(plan.Ops()),
        time_model_(time_model),
        observer_(observer),
        done_id_(kCompletionRing, kNoOp),
        done_at_(kCompletionRing, 0) {
    for (int s = 0; s < kStreamCount; ++s) {
      streams_[s].engine = this;
      streams_[s].stream = static_cast<Stream>(s);
    }
  }

  StepPrediction Run() {
    Refill();
    StartAll();
    while (!queue_.Empty()) queue_.ServiceOne();
    for (const StreamState& s : streams_)
      CTXPLAN_CHECK(s.waiting.empty() && !s.busy, "simulation stalled with ops waiting on stream " +
                                                      std::string(StreamName(s.stream)));
    CTXPLAN_CHECK(exhausted_, "simulation ended before the plan did");
    for (int s = 0; s < kStreamCount; ++s) result_.busy_ticks[s] = streams_[s].busy_ticks;
    result_.gpu.peak_bytes = memory_[0].peak();
    result_.gpu.at_peak = memory_[0].at_peak();
    result_.gpu.end_bytes = memory_[0].total();
    result_.host.peak_bytes = memory_[1].peak();
    result_.host.at_peak = memory_[1].at_peak();
    result_.host.end_bytes = memory_[1].total();
    return result_;
  }

  void Complete(StreamState& s) {
    const Tick now = queue_.now();
    MarkDone(s.running.id, now);
    s.busy = false;
    s.busy_ticks += now - s.running_since;
    result_.step_ticks = std::max(result_.step_ticks, now);
    if (observer_) observer_->OnOpComplete(s.running, s.running_since, now);
    Refill();
    StartAll();
  }

 private:
  void Refill() {
    while (queued_ < EventSimulator::kLookaheadOps && !exhausted_) {
      if (!ops_.Next()) {
        exhausted_ = true;
        break;
      }
      const Op& op = ops_.Current();
      streams_[static_cast<size_t>(op.stream)].waiting.push_back(op);
      ++queued_;
    }
  }

  bool Done(OpId id) const { return done_id_[id % kCompletionRing] == id; }
  void MarkDone(OpId id, Tick when) {
    done_id_[id % kCompletionRing] = id;
    done_at_[id % kCompletionRing] = when;
  }

  void StartAll() {
    for (StreamState& s : streams_) Start(s);
  }

  // Starts the stream's next ops while they are ready: memory bookkeeping runs at once, a
  // kernel or copy occupies the stream until its completion event.
  void Start(StreamState& s) {
    const Tick now = queue_.now();
    while (!s.busy && !s.waiting.empty()) {
      const Op& op = s.waiting.front();
      for (int d = 0; d < op.num_deps; ++d)
        if (!Done(op.deps[d])) return;
      ++result_.op_count;
      --queued_;
      if (IsMemory(op.kind)) {
        MemoryTracker& memory = memory_[op.space == MemSpace::kGpu ? 0 : 1];
        memory.Apply(op.category, op.kind == OpKind::kAlloc ? op.bytes : -op.bytes);
        if (observer_) observer_->OnMemory(op.space, now, memory);
        MarkDone(op.id, now);
        s.waiting.pop_front();
        continue;
      }
      if (op.kind == OpKind::kCopyH2D) result_.h2d_bytes += op.cost.bytes;
      if (op.kind == OpKind::kCopyD2H) result_.d2h_bytes += op.cost.bytes;
      result_.flops += op.cost.flops;
      s.running = op;
      s.waiting.pop_front();
      s.busy = true;
      s.running_since = now;
      queue_.Schedule(&s, now + time_model_.Duration(s.running));
    }
  }

  Generator<Op> ops_;
  const KernelTimeModel& time_model_;
  SimObserver* observer_;
  EventQueue queue_;
  std::array<StreamState, kStreamCount> streams_;
  std::array<MemoryTracker, 2> memory_;  // GPU, host
  std::vector<OpId> done_id_;
  std::vector<Tick> done_at_;
  size_t queued_ = 0;
  bool exhausted_ = false;
  StepPrediction result_;
};

void StreamState::Process() {
  engine->Complete(*this);
}

}  // namespace

StepPrediction EventSimulator::Run(const StepPlan& plan, SimObserver* observer) const {
  // The ops timed at the SM clock the step holds under the power limit, which the analytic
  // path finds (clock_model.h).
  const double clock = AnalyticModel(time_model_).SustainedClock(plan.geometry());
  const KernelTimeModel at_clock = time_model_.AtClock(clock);
  Engine engine(plan, at_clock, observer);
  StepPrediction result = engine.Run();
  result.sm_clock_fraction = clock;
  return result;
}

}  // namespace ctxplan::sim
