// The discrete-event core: a time-ordered queue of caller-owned events (after gem5's EventQueue).
//
// Ordering is total and deterministic: by tick, then priority (lower first), then scheduling order
// (FIFO among equal tick and priority; gem5 is LIFO there). FIFO keeps a run reproducible and
// makes "first come, first served" resource models fall out of the queue for free.
//
// The queue is a binary heap of 24-byte POD entries. Deschedule is lazy: it only marks the event,
// and the orphaned entry is skipped when it surfaces, so Reschedule costs two O(log n) heap
// operations and no search. To make lazy deletion safe with caller-owned events, an event counts
// the entries that still point at it: destroying an event purges them (rare, O(n)), and
// destroying the queue detaches every event still pointing into it. Either may outlive the other.
//
// Not thread-safe: one queue belongs to one simulation on one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ctxplan/models/errors.h"
#include "ctxplan/sim/tick.h"

namespace ctxplan::sim {

// Lower runs first among events of the same tick. Any int8_t value is allowed; these name the
// conventional slots.
enum class EventPriority : int8_t {
  kOpComplete = -10,  // Completions free their resources before same-tick starts allocate.
  kDefault = 0,
  kStreamStart = 10,  // Streams issue their next op once the tick's completions are in.
  kStatistics = 100,  // Samples see the settled state of the tick.
};

class EventQueue;

class Event {
 public:
  explicit Event(EventPriority priority = EventPriority::kDefault) : priority_(priority) {}
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  // Destroying a scheduled event deschedules it (a destructor cannot report the likely bug).
  virtual ~Event();

  // Called by the queue at when(); the event is already unscheduled, so it may reschedule itself.
  virtual void Process() = 0;
  // For diagnostics only (error messages, debug traces); never on a hot path.
  virtual std::string Name() const { return "event"; }

  EventPriority priority() const { return priority_; }
  // Only while unscheduled: a scheduled event's priority is baked into its heap entry.
  void set_priority(EventPriority priority) {
    CTXPLAN_CHECK(!scheduled_, "set_priority on scheduled event '" + Name() + "'");
    priority_ = priority;
  }
  bool scheduled() const { return scheduled_; }
  // The tick it is (or was last) scheduled for.
  Tick when() const { return when_; }

 private:
  friend class EventQueue;

  Tick when_ = 0;
  uint64_t order_ = 0;           // The (priority, sequence) key of its live heap entry.
  EventQueue* queue_ = nullptr;  // Set while any heap entry (live or stale) points here.
  uint32_t entries_ = 0;         // Heap entries pointing here: one live, the rest stale.
  EventPriority priority_;
  bool scheduled_ = false;
};

// An event that runs a callable; for one-off or glue events where a subclass is overkill.
class LambdaEvent final : public Event {
 public:
  LambdaEvent(std::function<void()> callback, std::string name,
              EventPriority priority = EventPriority::kDefault)
      : Event(priority), callback_(std::move(callback)), name_(std::move(name)) {}

  void Process() override { callback_(); }
  std::string Name() const override { return name_; }

 private:
  std::function<void()> callback_;
  std::string name_;
};

class EventQueue {
 public:
  EventQueue() = default;
  EventQueue(const EventQueue&) = delete;
  EventQueue& operator=(const EventQueue&) = delete;
  ~EventQueue();

  // Preconditions (InternalError otherwise): `event` is not scheduled and when >= now().
  void Schedule(Event* event, Tick when);
  // Precondition: `event` is scheduled on this queue.
  void Deschedule(Event* event);
  // Moves a scheduled event; it queues behind events already at (when, priority), exactly as
  // Deschedule + Schedule would. Precondition: `event` is scheduled on this queue.
  void Reschedule(Event* event, Tick when);

  bool Empty() const { return live_ == 0; }
  // Scheduled events (descheduled ones excluded).
  size_t size() const { return live_; }
  // The tick of the next event, or kMaxTick when empty.
  Tick NextTick() const { return heap_.empty() ? kMaxTick : heap_.front().tick; }
  // The tick of the event being (or last) processed; starts at 0 and never decreases.
  Tick now() const { return now_; }
  uint64_t events_serviced() const { return serviced_; }

  // Pops the next event, advances now() to its tick and runs its Process(). If Process() throws,
  // the queue is still consistent (the event is already off it). Precondition: !Empty().
  void ServiceOne();
  // Services events until none is left; returns how many ran.
  uint64_t RunUntilEmpty();
  // Services every event with when() <= limit (including ones scheduled meanwhile); returns how
  // many ran. now() stays at the last serviced tick: it does not jump to `limit`.
  uint64_t RunUntil(Tick limit);

 private:
  friend class Event;

  struct Entry {
    Tick tick;
    uint64_t order;  // Priority in the top byte, biased to sort as unsigned; sequence below.
    Event* event;
  };
  static constexpr int kSequenceBits = 56;
  static constexpr uint64_t kMaxSequence = (uint64_t{1} << kSequenceBits) - 1;
  // Compaction threshold: stale entries are tolerated until they outnumber live ones and this.
  static constexpr size_t kMinStaleToCompact = 1024;

  // Min-heap on (tick, order) expressed as std::*_heap's max-heap "less".
  static bool Later(const Entry& a, const Entry& b) {
    return a.tick != b.tick ? a.tick > b.tick : a.order > b.order;
  }
  static bool IsLive(const Entry& entry) {
    return entry.event->scheduled_ && entry.event->order_ == entry.order;
  }
  // Drops one heap entry's claim on its event.
  static void Release(Event* event) {
    if (--event->entries_ == 0) event->queue_ = nullptr;
  }
  void PopTop() {
    std::pop_heap(heap_.begin(), heap_.end(), Later);
    heap_.pop_back();
  }
  // Invariant after every public operation: the heap is empty or its top is live, which keeps
  // NextTick() const and exact.
  void DropStaleTop() {
    while (!heap_.empty() && !IsLive(heap_.front())) {
      Release(heap_.front().event);
      PopTop();
      --stale_;
    }
  }
  void Compact();
  // Removes every entry pointing at `event` (the event is being destroyed or moved to another
  // queue). Must not throw: it runs in ~Event.
  void Purge(Event* event) noexcept;

  std::vector<Entry> heap_;
  size_t live_ = 0;
  size_t stale_ = 0;
  uint64_t next_sequence_ = 0;
  uint64_t serviced_ = 0;
  Tick now_ = 0;
};

// ---- implementation ---------------------------------------------------------------------------

inline Event::~Event() {
  if (queue_ != nullptr) queue_->Purge(this);
}

inline EventQueue::~EventQueue() {
  // Events may outlive the queue; leave none pointing at it. Every entry's event is alive: an
  // event purges its entries when it dies.
  for (const Entry& entry : heap_) {
    entry.event->queue_ = nullptr;
    entry.event->entries_ = 0;
    entry.event->scheduled_ = false;
  }
}

inline void EventQueue::Schedule(Event* event, Tick when) {
  CTXPLAN_CHECK(event != nullptr, "Schedule(nullptr)");
  CTXPLAN_CHECK(!event->scheduled_, "event '" + event->Name() + "' scheduled at tick " +
                                        std::to_string(when) + " is already scheduled at tick " +
                                        std::to_string(event->when_));
  CTXPLAN_CHECK(when >= now_, "event '" + event->Name() + "' scheduled in the past: tick " +
                                  std::to_string(when) + " < now " + std::to_string(now_));
  CTXPLAN_CHECK(next_sequence_ <= kMaxSequence, "event sequence numbers exhausted");
  // Stale entries on another queue would outlive this event's bookkeeping there; drop them.
  if (event->queue_ != nullptr && event->queue_ != this) event->queue_->Purge(event);

  const auto biased_priority = static_cast<uint64_t>(static_cast<int>(event->priority_) + 128);
  const uint64_t order = (biased_priority << kSequenceBits) | next_sequence_++;
  heap_.push_back(Entry{when, order, event});
  std::push_heap(heap_.begin(), heap_.end(), Later);
  event->when_ = when;
  event->order_ = order;
  event->queue_ = this;
  ++event->entries_;
  event->scheduled_ = true;
  ++live_;
}

inline void EventQueue::Deschedule(Event* event) {
  CTXPLAN_CHECK(event != nullptr, "Deschedule(nullptr)");
  CTXPLAN_CHECK(event->scheduled_ && event->queue_ == this,
                "Deschedule of event '" + event->Name() + "', which is not scheduled" +
                    (event->scheduled_ ? " on this queue" : ""));
  event->scheduled_ = false;
  --live_;
  ++stale_;
  DropStaleTop();
  if (stale_ >= kMinStaleToCompact && stale_ > live_) Compact();
}

inline void EventQueue::Reschedule(Event* event, Tick when) {
  CTXPLAN_CHECK(event != nullptr, "Reschedule(nullptr)");
  CTXPLAN_CHECK(event->scheduled_ && event->queue_ == this,
                "Reschedule of event '" + event->Name() + "', which is not scheduled" +
                    (event->scheduled_ ? " on this queue" : ""));
  // Checked before descheduling, so a failed call leaves the event where it was.
  CTXPLAN_CHECK(when >= now_, "event '" + event->Name() + "' rescheduled into the past: tick " +
                                  std::to_string(when) + " < now " + std::to_string(now_));
  Deschedule(event);
  Schedule(event, when);
}

inline void EventQueue::ServiceOne() {
  CTXPLAN_CHECK(!heap_.empty(), "ServiceOne on an empty event queue");
  const Entry entry = heap_.front();  // Live, by the DropStaleTop invariant.
  PopTop();
  Event* event = entry.event;
  Release(event);
  event->scheduled_ = false;
  --live_;
  DropStaleTop();
  now_ = entry.tick;
  ++serviced_;
  event->Process();
}

inline uint64_t EventQueue::RunUntilEmpty() {
  const uint64_t before = serviced_;
  while (!heap_.empty()) ServiceOne();
  return serviced_ - before;
}

inline uint64_t EventQueue::RunUntil(Tick limit) {
  const uint64_t before = serviced_;
  while (!heap_.empty() && heap_.front().tick <= limit) ServiceOne();
  return serviced_ - before;
}

inline void EventQueue::Compact() {
  auto stale = std::partition(heap_.begin(), heap_.end(), IsLive);
  for (auto it = stale; it != heap_.end(); ++it) Release(it->event);
  heap_.erase(stale, heap_.end());
  std::make_heap(heap_.begin(), heap_.end(), Later);
  stale_ = 0;
}

inline void EventQueue::Purge(Event* event) noexcept {
  auto gone = std::remove_if(heap_.begin(), heap_.end(),
                             [event](const Entry& entry) { return entry.event == event; });
  const auto removed = static_cast<size_t>(heap_.end() - gone);
  heap_.erase(gone, heap_.end());
  std::make_heap(heap_.begin(), heap_.end(), Later);
  if (event->scheduled_) {
    --live_;
    stale_ -= removed - 1;
  } else {
    stale_ -= removed;
  }
  event->queue_ = nullptr;
  event->entries_ = 0;
  event->scheduled_ = false;
  DropStaleTop();
}

}  // namespace ctxplan::sim
