#include "ctxplan/sim/event_queue.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "ctxplan/models/errors.h"
#include "ctxplan/sim/tick.h"

namespace ctxplan::sim {
namespace {

struct Firing {
  int id;
  Tick tick;
  bool operator==(const Firing&) const = default;
};

// Appends (its id, the queue's now()) to a shared log when processed.
class RecordingEvent : public Event {
 public:
  RecordingEvent(int id, const EventQueue* queue, std::vector<Firing>* log,
                 EventPriority priority = EventPriority::kDefault)
      : Event(priority), id_(id), queue_(queue), log_(log) {}

  void Process() override { log_->push_back({id_, queue_->now()}); }
  std::string Name() const override { return "recording " + std::to_string(id_); }
  int id() const { return id_; }

 private:
  int id_;
  const EventQueue* queue_;
  std::vector<Firing>* log_;
};

std::vector<int> Ids(const std::vector<Firing>& log) {
  std::vector<int> ids;
  for (const Firing& firing : log) ids.push_back(firing.id);
  return ids;
}

TEST(TickTest, ConvertsSecondsAndTicks) {
  EXPECT_EQ(SecondsToTicks(1.0), kTicksPerSecond);
  EXPECT_EQ(SecondsToTicks(0.0), 0);
  EXPECT_EQ(SecondsToTicks(1e-6), kTicksPerMicrosecond);
  EXPECT_EQ(SecondsToTicks(1e-9), kTicksPerNanosecond);
  EXPECT_EQ(SecondsToTicks(-2e-3), -2 * kTicksPerMillisecond);
  EXPECT_EQ(SecondsToTicks(2.4e-12), 2);  // Rounds to nearest, not down.
  EXPECT_EQ(SecondsToTicks(2.6e-12), 3);
  EXPECT_DOUBLE_EQ(TicksToSeconds(kTicksPerSecond / 4), 0.25);
  EXPECT_DOUBLE_EQ(TicksToMicroseconds(1'500'000), 1.5);
  // Seconds as a double keep picoseconds for about 15 minutes, then ~1 ps per 1e15 ps.
  const Tick long_run = 1000 * kTicksPerSecond + 1;
  EXPECT_EQ(SecondsToTicks(TicksToSeconds(long_run)), long_run);
  const Tick ten_hours = 36'000 * kTicksPerSecond + 1;
  EXPECT_NEAR(static_cast<double>(SecondsToTicks(TicksToSeconds(ten_hours)) - ten_hours), 0, 8);
  EXPECT_GT(kMaxTick, SecondsToTicks(100.0 * 86400.0));  // ~106 days fit.
}

TEST(TickTest, RejectsUnrepresentableSeconds) {
  EXPECT_THROW(SecondsToTicks(std::nan("")), InternalError);
  EXPECT_THROW(SecondsToTicks(std::numeric_limits<double>::infinity()), InternalError);
  EXPECT_THROW(SecondsToTicks(1e7), InternalError);  // 1e19 ps overflows int64.
  EXPECT_THROW(SecondsToTicks(-1e7), InternalError);
}

TEST(EventQueueTest, StartsEmptyAtTickZero) {
  EventQueue queue;
  EXPECT_TRUE(queue.Empty());
  EXPECT_EQ(queue.size(), 0u);
  EXPECT_EQ(queue.now(), 0);
  EXPECT_EQ(queue.NextTick(), kMaxTick);
  EXPECT_EQ(queue.RunUntilEmpty(), 0u);
}

TEST(EventQueueTest, OrdersByTick) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(1, &queue, &log), b(2, &queue, &log), c(3, &queue, &log);
  queue.Schedule(&a, 30);
  queue.Schedule(&b, 10);
  queue.Schedule(&c, 20);
  EXPECT_EQ(queue.size(), 3u);
  EXPECT_EQ(queue.NextTick(), 10);
  EXPECT_TRUE(b.scheduled());
  EXPECT_EQ(b.when(), 10);

  EXPECT_EQ(queue.RunUntilEmpty(), 3u);
  EXPECT_EQ(log, (std::vector<Firing>{{2, 10}, {3, 20}, {1, 30}}));
  EXPECT_EQ(queue.now(), 30);
  EXPECT_EQ(queue.events_serviced(), 3u);
  EXPECT_FALSE(a.scheduled());
  EXPECT_TRUE(queue.Empty());
}

TEST(EventQueueTest, OrdersByPriorityWithinATick) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent stats(1, &queue, &log, EventPriority::kStatistics);
  RecordingEvent start(2, &queue, &log, EventPriority::kStreamStart);
  RecordingEvent plain(3, &queue, &log);
  RecordingEvent complete(4, &queue, &log, EventPriority::kOpComplete);
  RecordingEvent first(5, &queue, &log, static_cast<EventPriority>(-128));
  RecordingEvent last(6, &queue, &log, static_cast<EventPriority>(127));
  RecordingEvent earlier_tick(7, &queue, &log, static_cast<EventPriority>(127));
  for (Event* event : std::vector<Event*>{&last, &stats, &start, &plain, &complete, &first}) {
    queue.Schedule(event, 50);
  }
  queue.Schedule(&earlier_tick, 49);  // Tick beats priority.
  queue.RunUntilEmpty();
  EXPECT_EQ(Ids(log), (std::vector<int>{7, 5, 4, 3, 2, 1, 6}));
}

TEST(EventQueueTest, IsFifoAmongEqualTickAndPriority) {
  EventQueue queue;
  std::vector<Firing> log;
  std::vector<std::unique_ptr<RecordingEvent>> events;
  for (int id = 0; id < 100; ++id) {
    events.push_back(std::make_unique<RecordingEvent>(id, &queue, &log));
  }
  for (uint32_t seed : {1u, 2u, 3u}) {
    std::vector<int> order(100);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(seed));
    log.clear();
    const Tick tick = queue.now() + 7;
    for (int id : order) queue.Schedule(events[static_cast<size_t>(id)].get(), tick);
    queue.RunUntilEmpty();
    EXPECT_EQ(Ids(log), order) << "seed " << seed;
  }
}

TEST(EventQueueTest, DescheduledEventsDoNotRun) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(1, &queue, &log), b(2, &queue, &log), c(3, &queue, &log);
  queue.Schedule(&a, 10);
  queue.Schedule(&b, 20);
  queue.Schedule(&c, 30);
  queue.Deschedule(&b);
  EXPECT_FALSE(b.scheduled());
  EXPECT_EQ(queue.size(), 2u);
  queue.Deschedule(&a);  // The top: NextTick must not report the dead entry.
  EXPECT_EQ(queue.NextTick(), 30);
  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{3, 30}}));

  // A descheduled event can be scheduled again, and runs once.
  queue.Schedule(&b, 40);
  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{3, 30}, {2, 40}}));
}

TEST(EventQueueTest, DescheduleLastEventEmptiesQueue) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(1, &queue, &log);
  queue.Schedule(&a, 10);
  queue.Deschedule(&a);
  EXPECT_TRUE(queue.Empty());
  EXPECT_EQ(queue.NextTick(), kMaxTick);
  EXPECT_EQ(queue.RunUntilEmpty(), 0u);
  EXPECT_TRUE(log.empty());
}

TEST(EventQueueTest, RescheduleMovesEarlierAndLater) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(1, &queue, &log), b(2, &queue, &log), c(3, &queue, &log);
  queue.Schedule(&a, 10);
  queue.Schedule(&b, 20);
  queue.Schedule(&c, 30);
  queue.Reschedule(&a, 40);
  queue.Reschedule(&c, 5);
  EXPECT_EQ(a.when(), 40);
  EXPECT_EQ(queue.size(), 3u);
  EXPECT_EQ(queue.NextTick(), 5);
  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{3, 5}, {2, 20}, {1, 40}}));
}

TEST(EventQueueTest, RescheduleToSameTickQueuesBehindTies) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(1, &queue, &log), b(2, &queue, &log), c(3, &queue, &log);
  queue.Schedule(&a, 10);
  queue.Schedule(&b, 10);
  queue.Schedule(&c, 10);
  queue.Reschedule(&a, 10);
  queue.RunUntilEmpty();
  EXPECT_EQ(Ids(log), (std::vector<int>{2, 3, 1}));
}

TEST(EventQueueTest, ProcessMayScheduleFurtherEvents) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent same_tick_completion(100, &queue, &log, EventPriority::kOpComplete);
  RecordingEvent later(101, &queue, &log);
  int remaining = 3;
  // A periodic event that reschedules itself, and at its first firing also schedules a
  // higher-priority event in the same tick (which must still run in that tick, next).
  LambdaEvent* self = nullptr;
  LambdaEvent periodic(
      [&] {
        log.push_back({0, queue.now()});
        if (queue.now() == 10) {
          queue.Schedule(&same_tick_completion, queue.now());
          queue.Schedule(&later, queue.now() + 1);
        }
        if (--remaining > 0) queue.Schedule(self, queue.now() + 10);
      },
      "periodic", EventPriority::kStreamStart);
  self = &periodic;
  queue.Schedule(&periodic, 10);
  EXPECT_EQ(queue.RunUntilEmpty(), 5u);
  EXPECT_EQ(log, (std::vector<Firing>{{0, 10}, {100, 10}, {101, 11}, {0, 20}, {0, 30}}));
}

TEST(EventQueueTest, ProcessMayDescheduleAndRescheduleOthers) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent victim(1, &queue, &log), moved(2, &queue, &log);
  LambdaEvent actor(
      [&] {
        queue.Deschedule(&victim);
        queue.Reschedule(&moved, queue.now());
      },
      "actor");
  queue.Schedule(&actor, 5);
  queue.Schedule(&victim, 5);
  queue.Schedule(&moved, 100);
  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{2, 5}}));
}

TEST(EventQueueTest, ViolatedPreconditionsThrowInternalError) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(1, &queue, &log), b(2, &queue, &log);

  EXPECT_THROW(queue.ServiceOne(), InternalError);
  EXPECT_THROW(queue.Deschedule(&a), InternalError);
  EXPECT_THROW(queue.Reschedule(&a, 5), InternalError);
  EXPECT_THROW(queue.Schedule(nullptr, 5), InternalError);
  EXPECT_THROW(queue.Schedule(&a, -1), InternalError);  // Before tick 0.

  queue.Schedule(&a, 10);
  EXPECT_THROW(queue.Schedule(&a, 20), InternalError);  // Already scheduled.
  EXPECT_THROW(a.set_priority(EventPriority::kStatistics), InternalError);
  queue.ServiceOne();
  ASSERT_EQ(queue.now(), 10);

  EXPECT_THROW(queue.Schedule(&b, 9), InternalError);  // In the past.
  queue.Schedule(&b, 10);                              // Now is fine.
  EXPECT_THROW(queue.Reschedule(&b, 9), InternalError);
  EXPECT_TRUE(b.scheduled()) << "a failed Reschedule must leave the event in place";
  EXPECT_EQ(b.when(), 10);

  EventQueue other;
  EXPECT_THROW(other.Deschedule(&b), InternalError);  // Scheduled, but elsewhere.
  EXPECT_THROW(other.Reschedule(&b, 20), InternalError);

  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{1, 10}, {2, 10}}));
}

TEST(EventQueueTest, ErrorMessagesNameTheEvent) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(42, &queue, &log);
  queue.Schedule(&a, 10);
  try {
    queue.Schedule(&a, 20);
    FAIL() << "expected InternalError";
  } catch (const InternalError& error) {
    EXPECT_NE(std::string(error.what()).find("recording 42"), std::string::npos) << error.what();
  }
}

TEST(EventQueueTest, ThrowingProcessLeavesQueueConsistent) {
  EventQueue queue;
  std::vector<Firing> log;
  LambdaEvent thrower([] { throw std::runtime_error("boom"); }, "thrower");
  RecordingEvent after(1, &queue, &log);
  queue.Schedule(&thrower, 5);
  queue.Schedule(&after, 6);
  EXPECT_THROW(queue.ServiceOne(), std::runtime_error);
  EXPECT_FALSE(thrower.scheduled());
  EXPECT_EQ(queue.now(), 5);
  EXPECT_EQ(queue.size(), 1u);
  queue.Schedule(&thrower, 7);  // Reusable.
  queue.Deschedule(&thrower);
  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{1, 6}}));
}

TEST(EventQueueTest, RunUntilStopsAfterLimitInclusive) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent a(1, &queue, &log), b(2, &queue, &log), c(3, &queue, &log);
  LambdaEvent spawner([&] { queue.Schedule(&c, 20); }, "spawner");
  queue.Schedule(&a, 10);
  queue.Schedule(&spawner, 15);
  queue.Schedule(&b, 25);
  EXPECT_EQ(queue.RunUntil(20), 3u);  // a, spawner, and c which it scheduled inside the limit.
  EXPECT_EQ(queue.now(), 20);
  EXPECT_EQ(queue.NextTick(), 25);
  EXPECT_EQ(queue.RunUntil(24), 0u);
  EXPECT_EQ(queue.now(), 20) << "now() must not jump to the limit";
  EXPECT_EQ(queue.RunUntil(kMaxTick), 1u);
  EXPECT_EQ(log, (std::vector<Firing>{{1, 10}, {3, 20}, {2, 25}}));
}

TEST(EventQueueTest, LambdaEventRunsItsCallableAndKeepsItsName) {
  EventQueue queue;
  int calls = 0;
  LambdaEvent event([&] { ++calls; }, "tick-tock", EventPriority::kStatistics);
  EXPECT_EQ(event.Name(), "tick-tock");
  EXPECT_EQ(event.priority(), EventPriority::kStatistics);
  queue.Schedule(&event, 1);
  queue.RunUntilEmpty();
  queue.Schedule(&event, 2);
  queue.RunUntilEmpty();
  EXPECT_EQ(calls, 2);
  event.set_priority(EventPriority::kDefault);  // Allowed while unscheduled.
  EXPECT_EQ(event.priority(), EventPriority::kDefault);
}

TEST(EventQueueTest, DestroyingAScheduledEventDeschedulesIt) {
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent keep(1, &queue, &log);
  queue.Schedule(&keep, 20);
  {
    RecordingEvent doomed(2, &queue, &log);
    queue.Schedule(&doomed, 10);
  }
  EXPECT_EQ(queue.size(), 1u);
  EXPECT_EQ(queue.NextTick(), 20);
  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{1, 20}}));
}

TEST(EventQueueTest, DestroyingADescheduledEventLeavesNoDanglingEntry) {
  // Lazy deletion leaves stale heap entries; they must not outlive their event (ASan checks the
  // absence of use-after-free here).
  EventQueue queue;
  std::vector<Firing> log;
  RecordingEvent keep(1, &queue, &log);
  queue.Schedule(&keep, 5);
  {
    RecordingEvent doomed(2, &queue, &log);
    queue.Schedule(&doomed, 10);
    queue.Reschedule(&doomed, 30);
    queue.Reschedule(&doomed, 20);
    queue.Deschedule(&doomed);
  }
  EXPECT_EQ(queue.size(), 1u);
  queue.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{1, 5}}));
}

TEST(EventQueueTest, EventsMayOutliveTheQueue) {
  std::vector<Firing> log;
  auto first = std::make_unique<EventQueue>();
  RecordingEvent event(1, first.get(), &log);
  first->Schedule(&event, 10);
  first.reset();
  EXPECT_FALSE(event.scheduled());

  EventQueue second;
  RecordingEvent moved(2, &second, &log);
  {
    EventQueue third;
    third.Schedule(&moved, 3);
    third.Deschedule(&moved);    // Leaves a stale entry in `third`...
    second.Schedule(&moved, 4);  // ...which moving to `second` must clear.
  }
  second.RunUntilEmpty();
  EXPECT_EQ(log, (std::vector<Firing>{{2, 4}}));
}

TEST(EventQueueTest, ManyReschedulesStayCorrect) {
  // Enough stale entries to trigger compaction several times.
  EventQueue queue;
  std::vector<Firing> log;
  std::vector<std::unique_ptr<RecordingEvent>> events;
  for (int id = 0; id < 10; ++id) {
    events.push_back(std::make_unique<RecordingEvent>(id, &queue, &log));
    queue.Schedule(events.back().get(), 1'000'000);
  }
  std::mt19937 random(7);
  for (int i = 0; i < 20'000; ++i) {
    queue.Reschedule(events[random() % events.size()].get(), 1000 + random() % 100'000);
  }
  EXPECT_EQ(queue.size(), 10u);
  std::vector<Tick> expected;
  for (const auto& event : events) expected.push_back(event->when());
  std::sort(expected.begin(), expected.end());
  queue.RunUntilEmpty();
  ASSERT_EQ(log.size(), 10u);
  for (size_t i = 0; i < log.size(); ++i) EXPECT_EQ(log[i].tick, expected[i]);
}

// Schedules a few thousand events with random ticks and priorities (many ties), runs them, and
// compares with a stable sort by (tick, priority) of the scheduling order.
TEST(EventQueuePropertyTest, MatchesReferenceSort) {
  for (uint32_t seed : {11u, 12u, 13u}) {
    std::mt19937 random(seed);
    EventQueue queue;
    std::vector<Firing> log;
    std::vector<std::unique_ptr<RecordingEvent>> events;
    const int kEvents = 5000;
    for (int id = 0; id < kEvents; ++id) {
      const auto priority = static_cast<EventPriority>(static_cast<int>(random() % 7) * 40 - 120);
      events.push_back(std::make_unique<RecordingEvent>(id, &queue, &log, priority));
      queue.Schedule(events.back().get(), static_cast<Tick>(random() % 500));
    }
    std::vector<int> expected(kEvents);
    std::iota(expected.begin(), expected.end(), 0);
    std::stable_sort(expected.begin(), expected.end(), [&](int x, int y) {
      const auto& a = *events[static_cast<size_t>(x)];
      const auto& b = *events[static_cast<size_t>(y)];
      return std::tuple(a.when(), a.priority()) < std::tuple(b.when(), b.priority());
    });
    queue.RunUntilEmpty();
    EXPECT_EQ(Ids(log), expected) << "seed " << seed;
    for (size_t i = 1; i < log.size(); ++i) ASSERT_LE(log[i - 1].tick, log[i].tick);
  }
}

// Interleaves random schedules, deschedules, reschedules and services against a brute-force
// model of the ordering rule, checking every observable after every step.
TEST(EventQueuePropertyTest, MatchesReferenceModelUnderRandomOperations) {
  struct Model {
    bool scheduled = false;
    Tick tick = 0;
    int priority = 0;
    uint64_t sequence = 0;
  };
  for (uint32_t seed : {21u, 22u, 23u, 24u}) {
    std::mt19937 random(seed);
    EventQueue queue;
    std::vector<Firing> log;
    std::vector<std::unique_ptr<RecordingEvent>> events;
    std::vector<Model> model(200);
    for (int id = 0; id < 200; ++id) {
      events.push_back(std::make_unique<RecordingEvent>(id, &queue, &log));
    }
    uint64_t sequence = 0;
    Tick now = 0;
    size_t checked_firings = 0;

    auto model_next = [&]() -> int {
      int best = -1;
      for (int id = 0; id < 200; ++id) {
        const Model& m = model[static_cast<size_t>(id)];
        if (!m.scheduled) continue;
        const Model* b = best < 0 ? nullptr : &model[static_cast<size_t>(best)];
        if (b == nullptr || std::tuple(m.tick, m.priority, m.sequence) <
                                std::tuple(b->tick, b->priority, b->sequence)) {
          best = id;
        }
      }
      return best;
    };

    for (int step = 0; step < 20'000; ++step) {
      const size_t id = random() % 200;
      RecordingEvent& event = *events[id];
      Model& m = model[id];
      const auto op = random() % 10;
      const Tick when = now + static_cast<Tick>(random() % 50);
      if (op < 4) {
        if (m.scheduled) {
          EXPECT_THROW(queue.Schedule(&event, when), InternalError);
        } else {
          const int priority = static_cast<int>(random() % 256) - 128;
          event.set_priority(static_cast<EventPriority>(priority));
          queue.Schedule(&event, when);
          m = {true, when, priority, sequence++};
        }
      } else if (op < 5) {
        if (m.scheduled) {
          queue.Deschedule(&event);
          m.scheduled = false;
        } else {
          EXPECT_THROW(queue.Deschedule(&event), InternalError);
        }
      } else if (op < 6) {
        if (m.scheduled) {
          queue.Reschedule(&event, when);
          m.tick = when;
          m.sequence = sequence++;
        } else {
          EXPECT_THROW(queue.Reschedule(&event, when), InternalError);
        }
      } else {
        const int expected = model_next();
        if (expected < 0) {
          EXPECT_THROW(queue.ServiceOne(), InternalError);
        } else {
          queue.ServiceOne();
          Model& fired = model[static_cast<size_t>(expected)];
          fired.scheduled = false;
          ASSERT_EQ(log.size(), checked_firings + 1);
          ASSERT_EQ(log.back(), (Firing{expected, fired.tick}))
              << "seed " << seed << " step " << step;
          ASSERT_GE(fired.tick, now) << "now() went backwards";
          now = fired.tick;
          ++checked_firings;
        }
      }
      const int next = model_next();
      const size_t live = static_cast<size_t>(
          std::count_if(model.begin(), model.end(), [](const Model& x) { return x.scheduled; }));
      ASSERT_EQ(queue.size(), live);
      ASSERT_EQ(queue.Empty(), live == 0);
      ASSERT_EQ(queue.NextTick(), next < 0 ? kMaxTick : model[static_cast<size_t>(next)].tick);
      ASSERT_EQ(queue.now(), now);
      ASSERT_EQ(event.scheduled(), m.scheduled);
    }
  }
}

// Not a timing assertion (sanitizer and debug builds are slow); it shows the cost in the log and
// exercises a long run with a steady population of pending events, as the simulator has.
TEST(EventQueuePerfTest, ServicesAMillionEvents) {
  EventQueue queue;
  constexpr size_t kPending = 1000;
  constexpr uint64_t kTotal = 1'000'000;
  uint64_t fired = 0;
  std::vector<std::unique_ptr<LambdaEvent>> events;
  std::mt19937 random(5);
  for (size_t i = 0; i < kPending; ++i) {
    // Each worker reschedules itself until the total is reached.
    events.push_back(std::make_unique<LambdaEvent>(
        [&queue, &fired, &random, &events, i] {
          if (++fired + kPending <= kTotal) {
            queue.Schedule(events[i].get(), queue.now() + 1 + static_cast<Tick>(random() % 1000));
          }
        },
        "worker " + std::to_string(i)));
  }
  for (auto& event : events) queue.Schedule(event.get(), static_cast<Tick>(random() % 1000));
  const auto start = std::chrono::steady_clock::now();
  const uint64_t serviced = queue.RunUntilEmpty();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(serviced, kTotal);
  RecordProperty("seconds_per_million_events", std::to_string(seconds));
  std::printf("[ perf     ] %llu events in %.3f s (%.0f ns/event)\n",
              static_cast<unsigned long long>(serviced), seconds, seconds * 1e9 / kTotal);
}

}  // namespace
}  // namespace ctxplan::sim
