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
  std::string Name() const override {
    return "rank " + std::to_string(rank) + " stream " + std::string(StreamName(stream));
  }

  Engine* engine = nullptr;
  int rank = 0;
  Stream stream = Stream::kCompute;
  std::deque<Op> waiting;
  bool busy = false;
  Op running;
  Tick running_since = 0;
  Tick busy_ticks = 0;
};

class Engine {
 public:
  // Every rank (pipeline stage) has its own GPU: its own streams and GPU memory. The ranks of
  // one machine share its host memory; ranks fill machines in order.
  Engine(const StepPlan& plan, const KernelTimeModel& time_model, SimObserver* observer)
      : ops_(plan.Ops()),
        time_model_(time_model),
        observer_(observer),
        ranks_(plan.geometry().stages()),
        gpus_per_machine_(time_model.gpus_per_machine()),
        streams_(static_cast<size_t>(ranks_ * kStreamCount)),
        gpu_memory_(static_cast<size_t>(ranks_)),
        host_memory_(static_cast<size_t>((ranks_ + gpus_per_machine_ - 1) / gpus_per_machine_)),
        host_by_rank_(static_cast<size_t>(ranks_)),
        done_id_(kCompletionRing, kNoOp),
        done_at_(kCompletionRing, 0) {
    // The host page stores each rank pins up front (PlanGeometry::host_store_pages).
    const PlanGeometry& g = plan.geometry();
    for (int32_t r = 0; r < ranks_; ++r) {
      for (MemoryTracker* host : {&host_memory_[static_cast<size_t>(r / gpus_per_machine_)],
                                  &host_by_rank_[static_cast<size_t>(r)]}) {
        host->Reserve(MemCategory::kKvPages, g.kv_host_store_bytes(r));
        host->Reserve(MemCategory::kDkvPages, g.dkv_host_store_bytes(r));
      }
    }
    for (size_t i = 0; i < streams_.size(); ++i) {
      streams_[i].engine = this;
      streams_[i].rank = static_cast<int>(i / kStreamCount);
      streams_[i].stream = static_cast<Stream>(i % kStreamCount);
    }
  }

  StepPrediction Run() {
    Refill();
    StartAll();
    while (!queue_.Empty()) queue_.ServiceOne();
    for (const StreamState& s : streams_)
      CTXPLAN_CHECK(s.waiting.empty() && !s.busy,
                    "simulation stalled with ops waiting on " + s.Name());
    CTXPLAN_CHECK(exhausted_, "simulation ended before the plan did");
    // Of the busiest rank, per stream: its utilisation is the pipeline's.
    for (const StreamState& s : streams_) {
      Tick& busy = result_.busy_ticks[static_cast<size_t>(s.stream)];
      busy = std::max(busy, s.busy_ticks);
    }
    // The GPU with the highest peak, the machine with the most host memory at its peak.
    auto largest = [](const std::vector<MemoryTracker>& trackers, MemoryPeak& out) {
      for (const MemoryTracker& m : trackers)
        if (m.peak() >= out.peak_bytes) out = {m.peak(), m.at_peak(), m.total()};
    };
    largest(gpu_memory_, result_.gpu);
    largest(host_memory_, result_.host);
    for (const MemoryTracker& m : gpu_memory_) result_.gpu_peak_by_rank.push_back(m.peak());
    for (const MemoryTracker& m : host_by_rank_) result_.host_peak_by_rank.push_back(m.peak());
    return result_;
  }

  void Complete(StreamState& s) {
    const Tick now = queue_.now();
    MarkDone(s.running.id, now);
    s.busy = false;
    s.busy_ticks += now - s.running_since;
    result_.step_ticks = std::max(result_.step_ticks, now);
    // Observers get the kernel's span: a top-k's host read-back after it holds the stream, idle.
    if (observer_)
      observer_->OnOpComplete(s.running, s.running_since,
                              std::max(s.running_since, now - time_model_.HostTicks(s.running)));
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
      CTXPLAN_CHECK(op.rank >= 0 && op.rank < ranks_, "an op of a rank the plan does not have");
      streams_[static_cast<size_t>(op.rank * kStreamCount + static_cast<int>(op.stream))]
          .waiting.push_back(op);
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
        MemoryTracker& memory =
            op.space == MemSpace::kGpu
                ? gpu_memory_[static_cast<size_t>(op.rank)]
                : host_memory_[static_cast<size_t>(op.rank / gpus_per_machine_)];
        const int64_t delta = op.kind == OpKind::kAlloc ? op.bytes : -op.bytes;
        memory.Apply(op.category, delta);
        if (op.space != MemSpace::kGpu)
          host_by_rank_[static_cast<size_t>(op.rank)].Apply(op.category, delta);
        if (observer_)
          observer_->OnMemory(op.space,
                              op.space == MemSpace::kGpu ? op.rank : op.rank / gpus_per_machine_,
                              now, memory);
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
  int ranks_;
  int gpus_per_machine_;
  std::vector<StreamState> streams_;         // [rank][stream]
  std::vector<MemoryTracker> gpu_memory_;    // [rank]
  std::vector<MemoryTracker> host_memory_;   // [machine]
  std::vector<MemoryTracker> host_by_rank_;  // [rank]: each GPU's own share of host_memory_
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
  const AnalyticModel analytic(time_model_);
  // Each pass at its own clock; the step's clock reported as the analytic path weighs them.
  const StepPrediction analytic_step = analytic.Predict(plan.geometry());
  const KernelTimeModel at_clock = analytic.ForRun(plan.geometry(), analytic_step.pass_clocks);
  Engine engine(plan, at_clock, observer);
  StepPrediction result = engine.Run();
  result.sm_clock_fraction = analytic_step.sm_clock_fraction;
  result.pass_clocks = analytic_step.pass_clocks;
  result.energy_by_pass = analytic_step.energy_by_pass;
  result.seconds_by_pass = analytic_step.seconds_by_pass;
  return result;
}

}  // namespace ctxplan::sim
