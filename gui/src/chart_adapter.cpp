#include "chart_adapter.h"

// Single-class headers, not the <QtCharts> umbrella: this file is most of the GUI's compile time.
#include <QtCharts/QBarCategoryAxis>
#include <QtCharts/QBarSet>
#include <QtCharts/QCategoryAxis>
#include <QtCharts/QChart>
#include <QtCharts/QChartView>
#include <QtCharts/QHorizontalStackedBarSeries>
#include <QtCharts/QLegend>
#include <QtCharts/QLegendMarker>
#include <QtCharts/QLineSeries>
#include <QtCharts/QScatterSeries>
#include <QtCharts/QValueAxis>
#include <QtGui/QPainter>
#include <QtGui/QPen>

#include <algorithm>
#include <cmath>

namespace ctxplan::gui {
namespace {

// The context axis is log2(tokens), labelled by hand: QLogValueAxis prints "1.04858e+06".
// Its range is the window's context slider, 4K to 8M.
constexpr int kMinLog2 = 12;
constexpr int kMaxLog2 = 23;

const QColor kGpuColor(0x1f, 0x77, 0xb4);
const QColor kHostColor(0xff, 0x7f, 0x0e);
const QColor kNoFitColor(0xd6, 0x27, 0x28);
const QColor kMaxColor(0x2c, 0xa0, 0x2c);
const QColor kSpeedColor(0x94, 0x67, 0xbd);

// One colour per memory category, so the stacked bars stay readable with eleven of them.
const std::array<QColor, kMemCategoryCount> kCategoryColors = {
    QColor(0x1f, 0x77, 0xb4),  // weights
    QColor(0xae, 0xc7, 0xe8),  // grads
    QColor(0xff, 0x7f, 0x0e),  // optimizer
    QColor(0x2c, 0xa0, 0x2c),  // layer inputs
    QColor(0x98, 0xdf, 0x8a),  // activations
    QColor(0x94, 0x67, 0xbd),  // page slots
    QColor(0xd6, 0x27, 0x28),  // KV pages
    QColor(0xff, 0x98, 0x96),  // dKV pages
    QColor(0x8c, 0x56, 0x4b),  // page summaries
    QColor(0x7f, 0x7f, 0x7f),  // workspace
    QColor(0xbc, 0xbd, 0x22),  // grad staging
};

double GiB(int64_t bytes) {
  return static_cast<double>(bytes) / static_cast<double>(1 << 30);
}
double Log2(int64_t tokens) {
  return std::log2(static_cast<double>(std::max<int64_t>(tokens, 1)));
}

QString PowerOfTwoTokens(int log2) {
  return log2 >= 20 ? QString("%1M").arg(1 << (log2 - 20)) : QString("%1K").arg(1 << (log2 - 10));
}

QLineSeries* NewLine(const QString& name, const QColor& color, Qt::PenStyle style, qreal width) {
  auto* series = new QLineSeries;
  series->setName(name);
  QPen pen(color);
  pen.setStyle(style);
  pen.setWidthF(width);
  series->setPen(pen);
  return series;
}

QList<QPointF> Vertical(double x, double top) {
  return {QPointF(x, 0.0), QPointF(x, top)};
}
QList<QPointF> Horizontal(double y) {
  return {QPointF(kMinLog2, y), QPointF(kMaxLog2, y)};
}

QChartView* NewView(QChart* chart) {
  auto* view = new QChartView(chart);
  view->setRenderHint(QPainter::Antialiasing);
  view->setMinimumSize(360, 220);
  return view;
}

}  // namespace

ChartAdapter::ChartAdapter() {
  // --- memory against context ---
  curve_chart_ = new QChart;
  curve_chart_->setTitle("Peak memory and speed against context");
  gpu_ = NewLine("GPU (device level)", kGpuColor, Qt::SolidLine, 2.0);
  gpu_->setPointsVisible(true);
  host_ = NewLine("host pinned", kHostColor, Qt::SolidLine, 2.0);
  host_->setPointsVisible(true);
  gpu_capacity_ = NewLine("GPU capacity", kGpuColor, Qt::DashLine, 1.5);
  host_capacity_ = NewLine("host usable", kHostColor, Qt::DashLine, 1.5);
  no_fit_ = new QScatterSeries;
  no_fit_->setName("does not fit");
  no_fit_->setColor(kNoFitColor);
  no_fit_->setBorderColor(kNoFitColor);
  no_fit_->setMarkerSize(8.0);
  selected_ = NewLine("selected context", Qt::black, Qt::SolidLine, 1.0);
  max_context_ = NewLine("max context", kMaxColor, Qt::DotLine, 2.0);

  auto* context_axis = new QCategoryAxis;
  context_axis->setTitleText("context (tokens, log scale)");
  context_axis->setLabelsPosition(QCategoryAxis::AxisLabelsPositionOnValue);
  context_axis->setStartValue(kMinLog2 - 0.001);
  for (int log2 = kMinLog2; log2 <= kMaxLog2; ++log2)
    context_axis->append(PowerOfTwoTokens(log2), log2);
  context_axis->setRange(kMinLog2, kMaxLog2);
  memory_axis_ = new QValueAxis;
  memory_axis_->setTitleText("GiB");
  memory_axis_->setLabelFormat("%.0f");
  curve_chart_->addAxis(context_axis, Qt::AlignBottom);
  curve_chart_->addAxis(memory_axis_, Qt::AlignLeft);
  for (QAbstractSeries* series : std::initializer_list<QAbstractSeries*>{
           gpu_capacity_, host_capacity_, gpu_, host_, no_fit_, selected_, max_context_}) {
    curve_chart_->addSeries(series);
    series->attachAxis(context_axis);
    series->attachAxis(memory_axis_);
  }
  speed_ = NewLine("tokens/s (right)", kSpeedColor, Qt::SolidLine, 2.0);
  speed_->setPointsVisible(true);
  speed_axis_ = new QValueAxis;
  speed_axis_->setTitleText("tokens/s");
  speed_axis_->setLabelFormat("%.0f");
  curve_chart_->addAxis(speed_axis_, Qt::AlignRight);
  curve_chart_->addSeries(speed_);
  speed_->attachAxis(context_axis);
  speed_->attachAxis(speed_axis_);
  curve_chart_->legend()->setAlignment(Qt::AlignBottom);
  curve_view_ = NewView(curve_chart_);

  // --- categories at the peak ---
  category_chart_ = new QChart;
  category_chart_->setTitle("Memory at the peak, by category");
  auto* bars = new QHorizontalStackedBarSeries;
  for (int c = 0; c < kMemCategoryCount; ++c) {
    auto* set = new QBarSet(QString::fromUtf8(MemCategoryName(static_cast<MemCategory>(c))));
    *set << 0.0 << 0.0;
    set->setColor(kCategoryColors[c]);
    set->setBorderColor(kCategoryColors[c]);
    bars->append(set);
    sets_[c] = set;
  }
  bars->setBarWidth(0.6);
  category_chart_->addSeries(bars);
  // Horizontal bars list categories bottom up: host first so the GPU is on top.
  space_axis_ = new QBarCategoryAxis;
  space_axis_->append({"host", "GPU"});
  bytes_axis_ = new QValueAxis;
  bytes_axis_->setTitleText("GiB");
  bytes_axis_->setLabelFormat("%.0f");
  category_chart_->addAxis(space_axis_, Qt::AlignLeft);
  category_chart_->addAxis(bytes_axis_, Qt::AlignBottom);
  bars->attachAxis(space_axis_);
  bars->attachAxis(bytes_axis_);
  category_chart_->legend()->setAlignment(Qt::AlignRight);
  category_view_ = NewView(category_chart_);
}

QWidget* ChartAdapter::curve_view() const {
  return curve_view_;
}
QWidget* ChartAdapter::category_view() const {
  return category_view_;
}

void ChartAdapter::Show(const ExplorerResult& result) {
  if (!result.ok()) return;
  const sim::PlanReport& report = result.report;

  // --- memory against context ---
  QList<QPointF> gpu, host, no_fit, speed;
  double top = std::max(GiB(report.gpu_capacity), GiB(report.host_capacity));
  double fastest = 0;
  for (const CurvePoint& point : result.curve) {
    const double x = Log2(point.context_tokens);
    if (point.tokens_per_second > 0) {
      speed.append(QPointF(x, point.tokens_per_second));
      fastest = std::max(fastest, point.tokens_per_second);
    }
    gpu.append(QPointF(x, GiB(point.gpu_device)));
    host.append(QPointF(x, GiB(point.host_peak)));
    if (!point.fits_gpu) no_fit.append(gpu.back());
    if (!point.fits_host) no_fit.append(host.back());
  }
  for (const QPointF& p : gpu) top = std::max(top, p.y());
  // Past 1.4x the larger capacity nothing fits any more; clipping there keeps the crossing of
  // the curves and the capacity lines, which is what the chart is for, readable.
  top = std::min(top, 1.4 * std::max(GiB(report.gpu_capacity), GiB(report.host_capacity)));
  gpu_->replace(gpu);
  host_->replace(host);
  no_fit_->replace(no_fit);
  gpu_capacity_->replace(Horizontal(GiB(report.gpu_capacity)));
  host_capacity_->replace(Horizontal(GiB(report.host_capacity)));
  selected_->replace(Vertical(Log2(report.context_tokens), top));
  if (result.max_context_tokens > 0)
    max_context_->replace(Vertical(Log2(result.max_context_tokens), top));
  else
    max_context_->clear();
  memory_axis_->setRange(0.0, top * 1.05);
  memory_axis_->applyNiceNumbers();  // ticks at 0, 20, 40, ... rather than 0, 73, 147
  speed_->replace(speed);
  speed_axis_->setRange(0.0, std::max(fastest, 1.0) * 1.05);
  speed_axis_->applyNiceNumbers();

  // --- categories at the peak ---
  const sim::CategoryBytes& gpu_at_peak = report.prediction.gpu.at_peak;
  const sim::CategoryBytes& host_at_peak = report.prediction.host.at_peak;
  const QList<QLegendMarker*> markers = category_chart_->legend()->markers();
  for (int c = 0; c < kMemCategoryCount; ++c) {
    sets_[c]->replace(0, GiB(host_at_peak[c]));
    sets_[c]->replace(1, GiB(gpu_at_peak[c]));
    // Eleven legend entries crowd the chart; list only what is there.
    const bool present = gpu_at_peak[c] > 0 || host_at_peak[c] > 0;
    for (QLegendMarker* marker : markers)
      if (marker->label() == sets_[c]->label()) marker->setVisible(present);
  }
  space_axis_->replace(space_axis_->at(0),
                       QString("host: %1 GiB usable").arg(GiB(report.host_capacity), 0, 'f', 0));
  space_axis_->replace(space_axis_->at(1),
                       QString("GPU: %1 GiB").arg(GiB(report.gpu_capacity), 0, 'f', 0));
  const double widest = std::max({GiB(report.gpu_memory.allocated), GiB(report.host_peak),
                                  GiB(report.gpu_capacity), GiB(report.host_capacity)});
  bytes_axis_->setRange(0.0, widest * 1.05);
  bytes_axis_->applyNiceNumbers();
}

}  // namespace ctxplan::gui
