// The step timeline: its model headless (spans and lanes as the simulator makes them, requests
// off the GUI thread with the newest winning), and its view rendered offscreen (not blank, the
// kinds' colours, zoom and pan, the visible-range API, exports).
#include <QApplication>
#include <QElapsedTimer>
#include <QEventLoop>
#include <QFile>
#include <QImage>
#include <QMouseEvent>
#include <QTemporaryDir>
#include <QThread>
#include <QWheelEvent>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/models/catalog.h"
#include "ctxplan/runtime/plan/step_plan.h"
#include "ctxplan/sim/event_simulator.h"
#include "ctxplan/sim/gpu_tier.h"
#include "model/timeline_model.h"
#include "views/timeline_view.h"

namespace ctxplan::gui {
namespace {

// One application for the whole binary, offscreen: the views paint into images.
QApplication& App() {
  static int argc = 1;
  static char name[] = "gui_timeline_test";
  static char* argv[] = {name, nullptr};
  static QApplication* app = [] {
    qputenv("QT_QPA_PLATFORM", "offscreen");
    return new QApplication(argc, argv);
  }();
  return *app;
}

ExplorerSelection Selection(int64_t context_tokens, int pipeline_stages = 1) {
  ExplorerSelection s;
  s.model_name = "qwen2.5-7b";
  s.machine_name = "h200-125g";
  s.model = LoadModel(s.model_name);
  s.machine = LoadMachine(s.machine_name);
  s.options.context_tokens = context_tokens;
  s.options.pipeline_stages = pipeline_stages;
  return s;
}

// What the simulator itself reports for the same plan: every kernel and copy it completes, and
// its memory peaks.
struct Reference : sim::SimObserver {
  void OnOpComplete(const Op& /*op*/, sim::Tick /*start*/, sim::Tick /*end*/) override { ++ops; }
  uint64_t ops = 0;
  sim::StepPrediction prediction;
};

Reference Simulate(const ExplorerSelection& s) {
  const StepPlan plan(s.model, sim::WithGpuTier(s.model, s.machine, s.options, s.gpu_tier));
  const sim::KernelTimeModel time_model(s.machine);
  Reference r;
  r.prediction = sim::EventSimulator(time_model).Run(plan, &r);
  return r;
}

std::set<std::pair<int, Stream>> LanesOf(const Timeline& t) {
  std::set<std::pair<int, Stream>> lanes;
  for (const TimelineLane& l : t.lanes()) lanes.insert({l.rank, l.stream});
  return lanes;
}

class GuiTimelineTest : public ::testing::Test {
 protected:
  void SetUp() override { App(); }
};

TEST_F(GuiTimelineTest, ModelHoldsEveryKernelAndCopyOfTheSimulatedStep) {
  const ExplorerSelection s = Selection(int64_t{32} << 10);
  TimelineModel model;
  ASSERT_EQ(model.ComputeNow(s), QString());
  const Timeline& t = *model.timeline();
  const Reference ref = Simulate(s);
  EXPECT_EQ(t.spans().size(), ref.ops);
  EXPECT_GT(t.spans().size(), 1000u);

  const std::set<std::pair<int, Stream>> expected = {
      {0, Stream::kCompute}, {0, Stream::kH2D}, {0, Stream::kD2H}};
  EXPECT_EQ(LanesOf(t), expected);
  for (const TimelineLane& l : t.lanes()) {
    EXPECT_LT(l.begin, l.end);
    for (size_t i = l.begin; i < l.end; ++i) {
      const OpSpan& op = t.spans()[i];
      EXPECT_EQ(op.rank, l.rank);
      EXPECT_EQ(op.stream, l.stream);
      EXPECT_FALSE(IsMemory(op.kind));
      EXPECT_LE(op.start_ns, op.end_ns);
      if (i > l.begin) {
        EXPECT_LE(t.spans()[i - 1].start_ns, op.start_ns);
      }
    }
  }
  // The step spans the simulator's step time (nanoseconds, rounded).
  EXPECT_GE(t.begin_ns(), 0);
  EXPECT_NEAR(static_cast<double>(t.end_ns()), ref.prediction.step_seconds() * 1e9, 1e3);

  // Memory: GPU 0 and the host, peaking where the simulator says.
  ASSERT_EQ(t.counters().size(), 2u);
  EXPECT_EQ(t.counters()[0].space, MemSpace::kGpu);
  EXPECT_EQ(t.counters()[0].peak_bytes, ref.prediction.gpu.peak_bytes);
  EXPECT_EQ(t.counters()[1].space, MemSpace::kHost);
  EXPECT_EQ(t.counters()[1].peak_bytes, ref.prediction.host.peak_bytes);
  for (const CounterSeries& c : t.counters()) {
    ASSERT_FALSE(c.points.empty()) << c.name;
    for (size_t i = 1; i < c.points.size(); ++i)
      EXPECT_LT(c.points[i - 1].time_ns, c.points[i].time_ns);
  }
}

TEST_F(GuiTimelineTest, TwoPipelineStagesGiveLanesOfTwoRanks) {
  const ExplorerSelection s = Selection(int64_t{32} << 10, 2);
  TimelineModel model;
  ASSERT_EQ(model.ComputeNow(s), QString());
  const Timeline& t = *model.timeline();
  EXPECT_EQ(t.spans().size(), Simulate(s).ops);
  std::set<int> ranks;
  for (const TimelineLane& l : t.lanes()) ranks.insert(l.rank);
  EXPECT_EQ(ranks, (std::set<int>{0, 1}));
  EXPECT_GE(t.LaneOf(0, Stream::kCompute), 0);
  EXPECT_GE(t.LaneOf(1, Stream::kCompute), 0);
  EXPECT_GE(t.LaneOf(0, Stream::kSendNext), 0);  // activations to stage 1
  EXPECT_GE(t.LaneOf(1, Stream::kRecvPrev), 0);
  // Lanes ordered by rank, then stream.
  for (size_t i = 1; i < t.lanes().size(); ++i)
    EXPECT_LT(std::make_pair(t.lanes()[i - 1].rank, t.lanes()[i - 1].stream),
              std::make_pair(t.lanes()[i].rank, t.lanes()[i].stream));
  int gpu_series = 0;
  for (const CounterSeries& c : t.counters()) gpu_series += c.space == MemSpace::kGpu;
  EXPECT_EQ(gpu_series, 2);
}

TEST_F(GuiTimelineTest, NewestRequestWins) {
  TimelineModel model;
  std::vector<bool> busy;
  int changes = 0;
  QObject::connect(&model, &TimelineModel::busyChanged, [&](bool b) { busy.push_back(b); });
  QObject::connect(&model, &TimelineModel::timelineChanged, [&] { ++changes; });
  model.Request(Selection(int64_t{64} << 10));
  model.Request(Selection(int64_t{16} << 10));
  model.WaitForWorkers();
  EXPECT_EQ(changes, 1);  // the first was abandoned or dropped
  EXPECT_EQ(model.timeline()->spans().size(), Simulate(Selection(int64_t{16} << 10)).ops);
  EXPECT_FALSE(model.busy());
  EXPECT_EQ(busy, (std::vector<bool>{true, false}));

  // Delivered by the event loop, as in the window.
  model.Request(Selection(int64_t{8} << 10));
  QElapsedTimer timer;
  timer.start();
  while (model.busy() && timer.elapsed() < 20000)
    QCoreApplication::processEvents(QEventLoop::AllEvents | QEventLoop::WaitForMoreEvents, 50);
  EXPECT_FALSE(model.busy());
  EXPECT_EQ(changes, 2);
  EXPECT_EQ(model.timeline()->spans().size(), Simulate(Selection(int64_t{8} << 10)).ops);

  // A refused plan: the error, and no stale step left on show.
  ExplorerSelection bad = Selection(int64_t{16} << 10);
  bad.options.chunk_tokens = 1000;  // not a multiple of the page
  EXPECT_NE(model.ComputeNow(bad), QString());
  EXPECT_TRUE(model.timeline()->empty());
}

// The queue's shutdown against a job in every state: abandoned mid-simulation, queued behind
// another, or finished with its answer posted but not delivered (the short step, given time).
// Under ThreadSanitizer (scripts/tsan.sh) this checks the model's teardown against its worker.
TEST_F(GuiTimelineTest, DestroyingTheModelWithWorkInFlightIsSafe) {
  for (int i = 0; i < 4; ++i) {
    TimelineModel model;
    model.Request(Selection(int64_t{8} << 10));
    if (i % 2 == 1) QThread::msleep(50);  // time to finish and post
    model.Request(Selection(int64_t{64} << (10 + i)));
  }
  QCoreApplication::processEvents();  // the destroyed models' wake-ups are dropped
}

TEST_F(GuiTimelineTest, VisibleOpsMatchesAScanAndCsvExportsThem) {
  // Spans handed in ready-made, in no order, with one long op hiding shorter ones after it.
  std::vector<OpSpan> spans;
  std::mt19937 random(7);
  int64_t t = 0;
  for (uint64_t id = 0; id < 2000; ++id) {
    OpSpan s;
    s.op_id = id;
    s.kind = id % 3 == 0 ? OpKind::kLinearForward : OpKind::kCopyH2D;
    s.stream = id % 3 == 0 ? Stream::kCompute : Stream::kH2D;
    s.start_ns = t;
    s.end_ns = t + (id == 10 ? 500000 : static_cast<int64_t>(random() % 1000));
    t += 300;
    spans.push_back(s);
  }
  OpSpan alloc;  // bookkeeping: dropped
  alloc.kind = OpKind::kAlloc;
  spans.push_back(alloc);
  std::shuffle(spans.begin(), spans.end(), random);
  TimelineModel model(Timeline(std::move(spans), {}));
  const Timeline& timeline = *model.timeline();
  ASSERT_EQ(timeline.spans().size(), 2000u);
  ASSERT_EQ(timeline.lanes().size(), 2u);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t a = static_cast<int64_t>(random() % 700000);
    const int64_t b = a + static_cast<int64_t>(random() % 50000);
    for (size_t lane = 0; lane < 2; ++lane) {
      const auto [first, last] = timeline.VisibleOps(lane, a, b);
      const TimelineLane& l = timeline.lanes()[lane];
      for (size_t i = l.begin; i < l.end; ++i) {
        const OpSpan& s = timeline.spans()[i];
        if (s.end_ns >= a && s.start_ns <= b) {
          ASSERT_TRUE(i >= first && i < last)
              << "op " << s.op_id << " in [" << a << ", " << b << "] missed";
        }
      }
    }
  }
}

// --- the view, offscreen -------------------------------------------------------------------------

int DistinctKindColors(const QImage& image) {
  std::set<QRgb> palette;
  for (int k = 0; k < kOpKindCount; ++k)
    if (!IsMemory(static_cast<OpKind>(k)))
      palette.insert(TimelineView::KindColor(static_cast<OpKind>(k)).rgb());
  std::map<QRgb, int> seen;
  for (int y = 0; y < image.height(); ++y)
    for (int x = 0; x < image.width(); ++x) {
      const QRgb c = image.pixel(x, y) | 0xff000000u;
      if (palette.count(c)) ++seen[c];
    }
  int colors = 0;
  for (const auto& [color, pixels] : seen) colors += pixels >= 20;  // more than a legend swatch
  return colors;
}

int NonBackgroundPixels(const QImage& image) {
  const QRgb background = image.pixel(0, 0);
  int n = 0;
  for (int y = 0; y < image.height(); ++y)
    for (int x = 0; x < image.width(); ++x) n += image.pixel(x, y) != background;
  return n;
}

TEST_F(GuiTimelineTest, ViewRendersZoomsPansAndExports) {
  TimelineModel model;
  ASSERT_EQ(model.ComputeNow(Selection(int64_t{32} << 10)), QString());
  TimelineView view;
  view.Follow(model);
  view.resize(1200, 500);
  view.show();
  const Timeline& t = *model.timeline();
  EXPECT_EQ(view.visible_begin_ns(), 0);
  EXPECT_EQ(view.visible_end_ns(), t.end_ns());

  const QImage full = view.grab().toImage();
  ASSERT_EQ(full.size(), QSize(1200, 500));
  EXPECT_GT(NonBackgroundPixels(full), 20000);
  EXPECT_GE(DistinctKindColors(full), 3);

  // The visible-range API: set, clamp, zoom around a point, and the callback.
  std::vector<std::pair<int64_t, int64_t>> ranges;
  view.SetRangeChangedCallback([&](int64_t a, int64_t b) { ranges.push_back({a, b}); });
  const int64_t a = t.end_ns() / 4, b = t.end_ns() / 2;
  view.SetVisibleRange(a, b);
  EXPECT_EQ(view.visible_begin_ns(), a);
  EXPECT_EQ(view.visible_end_ns(), b);
  ASSERT_EQ(ranges.size(), 1u);
  EXPECT_EQ(ranges[0], std::make_pair(a, b));
  view.SetVisibleRange(a, b);  // no change: no call
  EXPECT_EQ(ranges.size(), 1u);
  view.ZoomAround(0.5, a);
  EXPECT_EQ(view.visible_begin_ns(), a);
  EXPECT_NEAR(static_cast<double>(view.visible_end_ns()), static_cast<double>(a + (b - a) / 2),
              1.0);                             // rounded
  view.SetVisibleRange(-1000, t.end_ns() * 3);  // clamped to the step
  EXPECT_EQ(view.visible_begin_ns(), 0);
  EXPECT_EQ(view.visible_end_ns(), t.end_ns());
  view.SetVisibleRange(a, a + 1);  // at least kMinRangeNs
  EXPECT_EQ(view.visible_end_ns() - view.visible_begin_ns(), TimelineView::kMinRangeNs);

  // The mouse: the wheel zooms in around the cursor, a drag pans by as much time as it covers.
  view.Fit();
  const QPointF middle(700, 200);
  QWheelEvent wheel(middle, view.mapToGlobal(middle), QPoint(), QPoint(0, 120), Qt::NoButton,
                    Qt::NoModifier, Qt::NoScrollPhase, false);
  QApplication::sendEvent(&view, &wheel);
  const int64_t zoomed = view.visible_end_ns() - view.visible_begin_ns();
  EXPECT_NEAR(static_cast<double>(zoomed), 0.8 * static_cast<double>(t.end_ns()),
              0.001 * static_cast<double>(t.end_ns()));
  const int64_t before = view.visible_begin_ns();
  QMouseEvent press(QEvent::MouseButtonPress, middle, view.mapToGlobal(middle), Qt::LeftButton,
                    Qt::LeftButton, Qt::NoModifier);
  QApplication::sendEvent(&view, &press);
  const QPointF left(middle.x() - 100, middle.y());
  QMouseEvent move(QEvent::MouseMove, left, view.mapToGlobal(left), Qt::NoButton, Qt::LeftButton,
                   Qt::NoModifier);
  QApplication::sendEvent(&view, &move);
  QMouseEvent release(QEvent::MouseButtonRelease, left, view.mapToGlobal(left), Qt::LeftButton,
                      Qt::NoButton, Qt::NoModifier);
  QApplication::sendEvent(&view, &release);
  EXPECT_GT(view.visible_begin_ns(), before);  // dragged left: later times come into view
  EXPECT_EQ(view.visible_end_ns() - view.visible_begin_ns(), zoomed);

  // Zoomed into a few ops: the op under the cursor, described.
  const TimelineLane& compute = t.lanes()[static_cast<size_t>(t.LaneOf(0, Stream::kCompute))];
  const OpSpan& op = t.spans()[(compute.begin + compute.end) / 2];
  view.SetVisibleRange(op.start_ns - op.duration_ns(), op.end_ns + op.duration_ns());
  // It fills the middle third of the plot; its lane is somewhere down the view.
  const OpSpan* found = nullptr;
  for (int x = view.width() * 2 / 5; x < view.width() * 3 / 5 && found == nullptr; x += 10)
    for (int y = 0; y < view.height() && found == nullptr; y += 2) {
      const OpSpan* at = view.OpAt(QPoint(x, y));
      if (at != nullptr && at->op_id == op.op_id) found = at;
    }
  ASSERT_NE(found, nullptr);
  const QString text = TimelineView::Describe(*found);
  EXPECT_TRUE(text.contains(QString::fromStdString(Timeline::KindPartName(op.kind, op.part))))
      << text.toStdString();
  EXPECT_TRUE(text.contains("layer")) << text.toStdString();

  // A zoomed-in view is drawn too, and differs from the full one.
  const QImage zoomed_image = view.grab().toImage();
  EXPECT_GT(NonBackgroundPixels(zoomed_image), 5000);
  EXPECT_NE(zoomed_image, full);

  // Exports: the visible ops, the picture.
  QTemporaryDir dir;
  ASSERT_TRUE(dir.isValid());
  QString error;
  view.SetVisibleRange(a, b);
  ASSERT_TRUE(view.SaveCsv(dir.filePath("ops.csv"), &error)) << error.toStdString();
  ASSERT_TRUE(view.SavePng(dir.filePath("view.png"), &error)) << error.toStdString();
  ASSERT_TRUE(view.SaveSvg(dir.filePath("view.svg"), &error)) << error.toStdString();
  QFile csv(dir.filePath("ops.csv"));
  ASSERT_TRUE(csv.open(QIODevice::ReadOnly));
  const QList<QByteArray> lines = csv.readAll().split('\n');
  EXPECT_TRUE(lines[0].startsWith("op_id,rank,stream,kind,part,phase,chunk,layer,start_ns"));
  size_t visible = 0;
  for (const OpSpan& s : t.spans()) visible += s.end_ns >= a && s.start_ns <= b;
  EXPECT_EQ(static_cast<size_t>(lines.size()), visible + 2);  // header, trailing newline
  EXPECT_LT(visible, t.spans().size());
  QImage png;
  ASSERT_TRUE(png.load(dir.filePath("view.png")));
  EXPECT_EQ(png.size(), view.size());
  QFile svg(dir.filePath("view.svg"));
  ASSERT_TRUE(svg.open(QIODevice::ReadOnly));
  EXPECT_TRUE(svg.readAll().contains("<svg"));
  EXPECT_FALSE(view.SaveCsv(dir.filePath("missing/ops.csv"), &error));
  EXPECT_FALSE(error.isEmpty());
}

TEST_F(GuiTimelineTest, TwoViewsKeptInStep) {
  TimelineModel model;
  ASSERT_EQ(model.ComputeNow(Selection(int64_t{16} << 10)), QString());
  TimelineView top, bottom;
  top.SetTimeline(model.timeline());
  bottom.SetTimeline(model.timeline());
  top.SetRangeChangedCallback([&](int64_t a, int64_t b) { bottom.SetVisibleRange(a, b); });
  bottom.SetRangeChangedCallback([&](int64_t a, int64_t b) { top.SetVisibleRange(a, b); });
  const int64_t end = model.timeline()->end_ns();
  top.SetVisibleRange(end / 3, end / 2);
  EXPECT_EQ(bottom.visible_begin_ns(), end / 3);
  EXPECT_EQ(bottom.visible_end_ns(), end / 2);
  bottom.Fit();
  EXPECT_EQ(top.visible_begin_ns(), 0);
  EXPECT_EQ(top.visible_end_ns(), end);
}

TEST_F(GuiTimelineTest, EmptyViewPaintsWithoutATimeline) {
  TimelineView view;
  view.resize(600, 200);
  const QImage image = view.grab().toImage();
  EXPECT_EQ(image.size(), QSize(600, 200));
  EXPECT_EQ(view.OpAt(QPoint(300, 100)), nullptr);
  view.SetTimeline(nullptr);
  EXPECT_EQ(view.timeline(), nullptr);
  view.grab();
}

}  // namespace
}  // namespace ctxplan::gui
