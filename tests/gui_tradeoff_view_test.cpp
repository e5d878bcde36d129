// The trade-off chart and the cost panel, rendered offscreen: they draw something, the chart's
// series hold the points the model computed, a click hands the window the point's options, and
// the exports write files.
#include <QApplication>
#include <QDir>
#include <QFile>
#include <QHash>
#include <QImage>
#include <QLabel>
#include <QPainter>
#include <QTemporaryDir>
#include <QtCharts/QChart>
#include <QtCharts/QLineSeries>
#include <QtCharts/QScatterSeries>
#include <QtSvg/QSvgRenderer>

#include <optional>
#include <vector>

#include <gtest/gtest.h>

#include "ctxplan/models/catalog.h"
#include "explorer_model.h"
#include "model/tradeoff_model.h"
#include "views/cost_view.h"
#include "views/tradeoff_view.h"

namespace ctxplan::gui {
namespace {

// One application for the whole binary, on the offscreen platform (no display on CI).
QApplication& App() {
  static int argc = 1;
  static char name[] = "gui_tradeoff_view_test";
  static char* argv[] = {name, nullptr};
  static QApplication* app = [] {
    qputenv("QT_QPA_PLATFORM", "offscreen");
    return new QApplication(argc, argv);
  }();
  return *app;
}

ExplorerSelection Selection(int64_t context) {
  ExplorerSelection s;
  s.model_name = "qwen2.5-7b";
  s.machine_name = "h200-125g";
  s.model = LoadModel(s.model_name);
  s.machine = LoadMachine(s.machine_name);
  s.options.context_tokens = context;
  return s;
}

// At 1M (the explorer's default context) some settings fit and some do not: every kind of
// point is drawn. Computed once; the model is the slow part.
const TradeoffResult& Grid1M() {
  static const TradeoffResult result = [] {
    App();
    TradeoffModel model;
    return model.ComputeNow(Selection(int64_t{1} << 20));
  }();
  return result;
}

// The pixels of `image` that differ from its most common colour (the background): a blank
// image has next to none.
int InkedPixels(const QImage& rendered) {
  const QImage image = rendered.convertToFormat(QImage::Format_RGB32);
  QHash<QRgb, int> counts;
  for (int y = 0; y < image.height(); ++y)
    for (int x = 0; x < image.width(); ++x) ++counts[image.pixel(x, y)];
  int background = 0;
  for (auto it = counts.begin(); it != counts.end(); ++it) background = std::max(background, *it);
  return image.width() * image.height() - background;
}

// Renders `widget` at 900x600 and counts its inked pixels.
int InkedPixels(QWidget& widget) {
  widget.resize(900, 600);
  widget.show();
  QApplication::processEvents();
  const QImage image = widget.grab().toImage();
  EXPECT_EQ(image.size(), QSize(900, 600));
  return InkedPixels(image);
}

QByteArray ReadAll(const QString& path) {
  QFile file(path);
  if (!file.open(QIODevice::ReadOnly)) return {};
  return file.readAll();
}

class TradeoffViewTest : public ::testing::Test {
 protected:
  void SetUp() override { App(); }
};

TEST_F(TradeoffViewTest, DrawsEveryPointInItsSeries) {
  const TradeoffResult& r = Grid1M();
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_EQ(r.points.size(), 72u);
  TradeoffView view;
  const int before = InkedPixels(view);  // axes and legend only
  view.Show(r);
  const int after = InkedPixels(view);
  EXPECT_GT(after, 5000);
  EXPECT_GT(after, before + 300);  // the points themselves

  const int fitting = r.fitting(), frontier = r.frontier_size();
  ASSERT_GT(frontier, 0);
  ASSERT_LT(fitting, 72);
  EXPECT_EQ(view.frontier_series()->count(), frontier);
  EXPECT_EQ(view.frontier_line()->count(), frontier);
  EXPECT_EQ(view.fitting_series()->count(), fitting - frontier);
  EXPECT_EQ(view.no_fit_series()->count(), 72 - fitting);  // all reach some context here
  EXPECT_EQ(view.selected_series()->count(), 1);
  EXPECT_EQ(view.selected_series()->at(0), TradeoffView::ChartValue(r.selected));
  EXPECT_TRUE(view.chart()->series().contains(view.frontier_series()));
  EXPECT_TRUE(view.chart()->series().contains(view.fitting_series()));
  // The frontier's line runs left to right (longer reach, lower speed).
  for (int i = 1; i < view.frontier_line()->count(); ++i) {
    EXPECT_LE(view.frontier_line()->at(i - 1).x(), view.frontier_line()->at(i).x());
    EXPECT_GE(view.frontier_line()->at(i - 1).y(), view.frontier_line()->at(i).y());
  }
  EXPECT_TRUE(view.caption()->text().contains("72 settings"))
      << view.caption()->text().toStdString();
}

TEST_F(TradeoffViewTest, ClickingAPointChoosesItsOptions) {
  const TradeoffResult& r = Grid1M();
  ASSERT_TRUE(r.ok()) << r.error;
  std::vector<RunOptions> chosen;
  TradeoffView view([&chosen](const RunOptions& o) { chosen.push_back(o); });
  view.Show(r);
  InkedPixels(view);

  // The path a click takes: the series' value, the nearest point, the callback.
  for (int i : {0, 17, 40, 71}) {
    const int index = view.PointIndexAt(TradeoffView::ChartValue(r.points[i]));
    ASSERT_GE(index, 0);
    EXPECT_EQ(TradeoffView::ChartValue(r.points[index]), TradeoffView::ChartValue(r.points[i]));
    ASSERT_TRUE(view.ChoosePoint(index));
    const RunOptions& o = chosen.back();
    const RunOptions& want = r.points[index].options;
    EXPECT_EQ(o.chunk_tokens, want.chunk_tokens);
    EXPECT_EQ(o.page_tokens, want.page_tokens);
    EXPECT_EQ(o.page_budget, want.page_budget);
    EXPECT_EQ(o.offload, want.offload);
    EXPECT_EQ(o.gpu_tier_pages, want.gpu_tier_pages);
    EXPECT_EQ(o.context_tokens, int64_t{1} << 20);
    ASSERT_NE(view.PointFor(o), nullptr);
    EXPECT_EQ(view.PointFor(o)->label, r.points[index].label);
  }
  EXPECT_EQ(chosen.size(), 4u);

  // A click as the chart reports it: the frontier series' clicked signal.
  int on_frontier = -1;
  for (int i = 0; i < static_cast<int>(r.points.size()); ++i)
    if (r.points[i].frontier) on_frontier = i;
  ASSERT_GE(on_frontier, 0);
  emit view.frontier_series()->clicked(TradeoffView::ChartValue(r.points[on_frontier]));
  ASSERT_EQ(chosen.size(), 5u);
  EXPECT_EQ(view.PointFor(chosen.back())->label, r.points[on_frontier].label);

  EXPECT_FALSE(view.ChoosePoint(-1));
  EXPECT_FALSE(view.ChoosePoint(72));
  EXPECT_EQ(chosen.size(), 5u);
}

TEST_F(TradeoffViewTest, BusyLabelFollowsTheModel) {
  TradeoffView view;
  view.resize(900, 600);
  view.show();
  EXPECT_FALSE(view.busy());
  view.SetBusy(true);
  EXPECT_TRUE(view.busy());
  EXPECT_EQ(view.findChildren<QLabel*>().size(), 2);
  bool shown = false;
  for (QLabel* label : view.findChildren<QLabel*>()) {
    if (label->text().contains("computing")) shown = label->isVisible();
  }
  EXPECT_TRUE(shown);
  view.SetBusy(false);
  bool hidden = false;
  for (QLabel* label : view.findChildren<QLabel*>()) {
    if (label->text().contains("computing")) hidden = !label->isVisible();
  }
  EXPECT_TRUE(hidden);
  // An error result keeps the chart and says why.
  TradeoffResult failed;
  failed.generation = 3;
  failed.error = "boom";
  view.Show(failed);
  EXPECT_TRUE(view.caption()->text().contains("boom"));
}

TEST_F(TradeoffViewTest, ExportsPngSvgAndCsv) {
  const TradeoffResult& r = Grid1M();
  ASSERT_TRUE(r.ok()) << r.error;
  TradeoffView view;
  QTemporaryDir dir;
  ASSERT_TRUE(dir.isValid());
  EXPECT_FALSE(view.SaveCsv(dir.filePath("early.csv")));  // nothing computed yet
  view.Show(r);
  InkedPixels(view);

  const QString png = dir.filePath("tradeoffs.png"), svg = dir.filePath("tradeoffs.svg"),
                csv = dir.filePath("tradeoffs.csv");
  ASSERT_TRUE(view.SavePng(png)) << view.last_error().toStdString();
  ASSERT_TRUE(view.SaveSvg(svg)) << view.last_error().toStdString();
  ASSERT_TRUE(view.SaveCsv(csv)) << view.last_error().toStdString();
  const QImage image(png);
  EXPECT_FALSE(image.isNull());
  EXPECT_GT(image.width(), 300);
  const QByteArray svg_text = ReadAll(svg);
  EXPECT_GT(svg_text.size(), 1000);
  EXPECT_TRUE(svg_text.contains("<svg"));
  // And it draws the chart: Qt's own SVG renderer reads it back and paints the points.
  QSvgRenderer renderer(svg);
  ASSERT_TRUE(renderer.isValid());
  QImage from_svg(renderer.defaultSize(), QImage::Format_RGB32);
  from_svg.fill(Qt::white);
  QPainter painter(&from_svg);
  renderer.render(&painter);
  painter.end();
  EXPECT_GT(InkedPixels(from_svg), 5000);
  const QByteArray csv_text = ReadAll(csv);
  EXPECT_EQ(csv_text.count('\n'), 73);  // header + a row a point
  EXPECT_TRUE(csv_text.startsWith("label,"));
  // No temporary file is left beside them.
  EXPECT_EQ(QDir(dir.path()).entryList(QDir::Files).size(), 3);

  // A directory that does not exist: false and a reason, no crash.
  EXPECT_FALSE(view.SaveCsv(dir.filePath("no/such/dir/t.csv")));
  EXPECT_FALSE(view.last_error().isEmpty());
  EXPECT_FALSE(view.SavePng(dir.filePath("no/such/dir/t.png")));
  EXPECT_FALSE(view.SaveSvg(dir.filePath("no/such/dir/t.svg")));
}

TEST_F(TradeoffViewTest, CostViewShowsTheRunsGpuHours) {
  ExplorerSelection selection = Selection(128 * 1024);
  const ExplorerResult result = ExplorerModel::Compute(selection, 1);
  ASSERT_TRUE(result.ok()) << result.error;

  CostView view;
  EXPECT_FALSE(view.cost().has_value());
  view.Show(result.report);
  ASSERT_TRUE(view.cost().has_value());
  EXPECT_EQ(view.token_budget(), int64_t{10} << 30);  // "10G"
  EXPECT_FALSE(view.cost()->cost.has_value());        // no price yet
  view.SetPricePerGpuHour(2.5);
  ASSERT_TRUE(view.SetTokenBudget("1G"));

  sim::PlanReport expected = result.report;
  sim::AddRunCost(expected, int64_t{1} << 30, 2.5);
  ASSERT_TRUE(view.cost().has_value());
  EXPECT_DOUBLE_EQ(view.cost()->steps, 8192.0);  // 1G tokens of 128K-token steps
  EXPECT_DOUBLE_EQ(view.cost()->gpu_hours, expected.run_cost->gpu_hours);
  ASSERT_TRUE(view.cost()->cost.has_value());
  EXPECT_DOUBLE_EQ(*view.cost()->cost, *expected.run_cost->cost);
  const QString text = view.FiguresText();
  EXPECT_TRUE(text.contains("GPU-hours: " + QString::number(expected.run_cost->gpu_hours, 'f', 1)))
      << text.toStdString();
  EXPECT_TRUE(text.contains("steps: 8,192")) << text.toStdString();
  EXPECT_GT(InkedPixels(view), 2000);

  // GPU-hours count every GPU: the same step on two GPUs costs twice the GPU-hours.
  sim::PlanReport two = result.report;
  two.gpus = 2;
  view.Show(two);
  EXPECT_NEAR(view.cost()->gpu_hours, 2 * expected.run_cost->gpu_hours, 1e-9);
  EXPECT_TRUE(view.FiguresText().contains("(all 2 GPUs)")) << view.FiguresText().toStdString();

  // A budget that does not parse is refused; the figures stay.
  EXPECT_FALSE(view.SetTokenBudget("lots"));
  EXPECT_EQ(view.token_budget(), int64_t{1} << 30);

  QTemporaryDir dir;
  const QString csv = dir.filePath("cost.csv");
  ASSERT_TRUE(view.SaveCsv(csv)) << view.last_error().toStdString();
  const QByteArray csv_text = ReadAll(csv);
  EXPECT_EQ(csv_text.count('\n'), 2);
  EXPECT_TRUE(csv_text.startsWith("train_tokens,")) << csv_text.toStdString();
  EXPECT_TRUE(csv_text.contains(",2.5000,")) << csv_text.toStdString();
}

}  // namespace
}  // namespace ctxplan::gui
