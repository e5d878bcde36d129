#include "views/tradeoff_view.h"

// Single-class headers, not the <QtCharts> umbrella: it is most of a chart file's compile time.
#include <QLabel>
#include <QSaveFile>
#include <QToolTip>
#include <QVBoxLayout>
#include <QtCharts/QCategoryAxis>
#include <QtCharts/QChart>
#include <QtCharts/QChartView>
#include <QtCharts/QLegend>
#include <QtCharts/QLegendMarker>
#include <QtCharts/QLineSeries>
#include <QtCharts/QScatterSeries>
#include <QtCharts/QValueAxis>
#include <QtGui/QCursor>
#include <QtGui/QPainter>
#include <QtGui/QPen>
#include <QtGui/QPixmap>
#include <QtSvg/QSvgGenerator>

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "ctxplan/models/units.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan::gui {
namespace {

const QColor kFitColor(0x1f, 0x77, 0xb4);
const QColor kFrontierColor(0x2c, 0xa0, 0x2c);
const QColor kNoFitColor(0xb4, 0xb4, 0xb4);
const QColor kContextColor(0x7f, 0x7f, 0x7f);

double Log2(int64_t tokens) {
  return std::log2(static_cast<double>(std::max<int64_t>(tokens, 1)));
}

// "4K", "1M", "2G": the context axis' labels, at powers of two.
QString PowerOfTwoTokens(int log2) {
  if (log2 >= 30) return QString("%1G").arg(int64_t{1} << (log2 - 30));
  if (log2 >= 20) return QString("%1M").arg(int64_t{1} << (log2 - 20));
  if (log2 >= 10) return QString("%1K").arg(int64_t{1} << (log2 - 10));
  return QString::number(int64_t{1} << std::max(log2, 0));
}

// "1.07M", "384K": a max context in a caption or tooltip.
QString ShortTokens(int64_t tokens) {
  if (tokens >= (int64_t{1} << 20)) return QString("%1M").arg(tokens / double(1 << 20), 0, 'g', 3);
  if (tokens >= 1024) return QString("%1K").arg(tokens / 1024.0, 0, 'g', 3);
  return QString::number(tokens);
}

QString Count(double value) {
  return QString::fromStdString(FormatCount(std::llround(value)));
}

QScatterSeries* NewScatter(const QString& name, const QColor& color, qreal size) {
  auto* series = new QScatterSeries;
  series->setName(name);
  series->setMarkerShape(QScatterSeries::MarkerShapeCircle);
  series->setMarkerSize(size);
  series->setColor(color);
  series->setBorderColor(color.darker(130));
  return series;
}

// Writes through `write` into a QSaveFile (a temporary file renamed over `path` on commit).
template <typename Write>
bool SaveAtomically(const QString& path, QString& error, Write write) {
  QSaveFile file(path);
  if (!file.open(QIODevice::WriteOnly)) {
    error = "cannot write " + path + ": " + file.errorString();
    return false;
  }
  if (!write(file)) {
    file.cancelWriting();
    error = "cannot write " + path + ": rendering failed";
    return false;
  }
  if (!file.commit()) {
    error = "cannot write " + path + ": " + file.errorString();
    return false;
  }
  return true;
}

}  // namespace

TradeoffView::TradeoffView(ChooseCallback on_choose, QWidget* parent)
    : QWidget(parent), on_choose_(std::move(on_choose)) {
  busy_label_ = new QLabel("computing the trade-offs…");
  busy_label_->setStyleSheet("color: #7f7f7f; font-style: italic");
  busy_label_->setContentsMargins(6, 4, 6, 0);
  busy_label_->setVisible(false);
  caption_ = new QLabel("No trade-offs computed yet.");
  caption_->setWordWrap(true);
  caption_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  caption_->setContentsMargins(6, 0, 6, 4);

  chart_ = new QChart;
  chart_->setTitle("Settings: speed against the longest context they reach");
  context_line_ = new QLineSeries;
  context_line_->setName("selected context");
  QPen context_pen(kContextColor);
  context_pen.setStyle(Qt::DashLine);
  context_pen.setWidthF(1.0);
  context_line_->setPen(context_pen);
  no_fit_ = NewScatter("does not fit at the selected context", kNoFitColor, 8.0);
  fitting_ = NewScatter("fits", kFitColor, 9.0);
  frontier_line_ = new QLineSeries;
  frontier_line_->setName("frontier line");
  QPen frontier_pen(kFrontierColor);
  frontier_pen.setWidthF(2.0);
  frontier_line_->setPen(frontier_pen);
  frontier_ = NewScatter("Pareto frontier", kFrontierColor, 13.0);
  frontier_->setMarkerShape(QScatterSeries::MarkerShapeRectangle);
  selected_ = new QScatterSeries;
  selected_->setName("selected settings");
  selected_->setMarkerShape(QScatterSeries::MarkerShapeCircle);
  selected_->setMarkerSize(22.0);
  selected_->setBrush(Qt::NoBrush);  // a ring around whatever point is underneath
  selected_->setPen(QPen(Qt::black, 2.5));

  context_axis_ = new QCategoryAxis;
  context_axis_->setTitleText("max context (tokens, log scale)");
  context_axis_->setLabelsPosition(QCategoryAxis::AxisLabelsPositionOnValue);
  speed_axis_ = new QValueAxis;
  speed_axis_->setTitleText("tokens/s at the selected context");
  speed_axis_->setLabelFormat("%.0f");
  chart_->addAxis(context_axis_, Qt::AlignBottom);
  chart_->addAxis(speed_axis_, Qt::AlignLeft);
  // Drawn in this order: the context line under everything, the ring on top.
  for (QAbstractSeries* series : std::initializer_list<QAbstractSeries*>{
           context_line_, no_fit_, fitting_, frontier_line_, frontier_, selected_}) {
    chart_->addSeries(series);
    series->attachAxis(context_axis_);
    series->attachAxis(speed_axis_);
  }
  // The frontier's markers stand for it in the legend; the joining line needs no entry.
  for (QLegendMarker* marker : chart_->legend()->markers(frontier_line_)) marker->setVisible(false);
  chart_->legend()->setAlignment(Qt::AlignBottom);
  UpdateContextAxis(12, 22);
  speed_axis_->setRange(0, 1);

  chart_view_ = new QChartView(chart_);
  chart_view_->setRenderHint(QPainter::Antialiasing);
  chart_view_->setMinimumSize(360, 240);

  // Clicking any drawn setting selects it; hovering names it.
  for (QScatterSeries* series : {no_fit_, fitting_, frontier_}) {
    QObject::connect(series, &QScatterSeries::clicked, this,
                     [this](const QPointF& value) { ChoosePoint(PointIndexAt(value)); });
    QObject::connect(series, &QScatterSeries::hovered, this,
                     [this](const QPointF& value, bool entered) { ShowTooltip(value, entered); });
  }

  auto* layout = new QVBoxLayout(this);
  layout->setContentsMargins(0, 0, 0, 0);
  layout->addWidget(busy_label_);
  layout->addWidget(chart_view_, 1);
  layout->addWidget(caption_);
}

QPointF TradeoffView::ChartValue(const TradeoffPoint& point) {
  return QPointF(Log2(point.max_context_tokens), point.tokens_per_second);
}

void TradeoffView::UpdateContextAxis(double low, double high) {
  for (const QString& label : context_axis_->categoriesLabels()) context_axis_->remove(label);
  context_axis_->setStartValue(low);
  for (int log2 = static_cast<int>(std::ceil(low)); log2 <= static_cast<int>(std::floor(high));
       ++log2)
    context_axis_->append(PowerOfTwoTokens(log2), log2);
  context_axis_->setRange(low, high);
}

void TradeoffView::SetBusy(bool busy) {
  busy_ = busy;
  busy_label_->setVisible(busy);
}

void TradeoffView::Show(const TradeoffResult& result) {
  if (!result.ok()) {
    if (!result.error.empty())
      caption_->setText("Trade-offs: " + QString::fromStdString(result.error));
    return;
  }
  result_ = result;

  QList<QPointF> fitting, frontier, no_fit;
  std::vector<QPointF> frontier_sorted;
  double low = std::numeric_limits<double>::max(), high = 0, fastest = 0;
  bool drawn = false;
  for (const TradeoffPoint& p : result_.points) {
    if (p.max_context_tokens <= 0) continue;  // no place on a log axis
    const QPointF value = ChartValue(p);
    drawn = true;
    low = std::min(low, value.x());
    high = std::max(high, value.x());
    fastest = std::max(fastest, value.y());
    if (!p.fits) {
      no_fit.append(value);
    } else if (p.frontier) {
      frontier.append(value);
      frontier_sorted.push_back(value);
    } else {
      fitting.append(value);
    }
  }
  // The frontier runs from the fastest (shortest reach) to the longest reach.
  std::sort(frontier_sorted.begin(), frontier_sorted.end(),
            [](const QPointF& a, const QPointF& b) { return a.x() < b.x(); });
  no_fit_->replace(no_fit);
  fitting_->replace(fitting);
  frontier_->replace(frontier);
  frontier_line_->replace(QList<QPointF>(frontier_sorted.begin(), frontier_sorted.end()));
  if (result_.selected.max_context_tokens > 0)
    selected_->replace(QList<QPointF>{ChartValue(result_.selected)});
  else
    selected_->clear();

  const double context = Log2(result_.selection.options.context_tokens);
  if (!drawn) low = high = context;  // nothing drawn: centre on the selected context
  low = std::min(low, context);
  high = std::max(high, context);
  // Half an octave either side, so edge points and their rings are not cut by the frame.
  UpdateContextAxis(low - 0.5, high + 0.5);
  speed_axis_->setRange(0.0, std::max(fastest, 1.0) * 1.08);
  speed_axis_->applyNiceNumbers();
  context_line_->replace(
      QList<QPointF>{QPointF(context, 0.0), QPointF(context, speed_axis_->max())});

  const int fits = result_.fitting();
  QString text = QString("%1 settings at %2 tokens: %3 fit, %4 on the frontier.")
                     .arg(result_.points.size())
                     .arg(ShortTokens(result_.selection.options.context_tokens))
                     .arg(fits)
                     .arg(result_.frontier_size());
  if (const int best = result_.fastest_fitting(); best >= 0) {
    const TradeoffPoint& p = result_.points[best];
    text += QString(" Fastest: %1 (%2 tokens/s, up to %3).")
                .arg(QString::fromStdString(p.label), Count(p.tokens_per_second),
                     ShortTokens(p.max_context_tokens));
  }
  const auto longest = std::max_element(
      result_.points.begin(), result_.points.end(), [](const auto& a, const auto& b) {
        return (a.fits ? a.max_context_tokens : -1) < (b.fits ? b.max_context_tokens : -1);
      });
  if (fits > 0)
    text += QString(" Longest: %1 (up to %2, %3 tokens/s).")
                .arg(QString::fromStdString(longest->label),
                     ShortTokens(longest->max_context_tokens), Count(longest->tokens_per_second));
  text += QString(" Selected: %1.").arg(QString::fromStdString(result_.selected.label));
  text += " Click a point to select its settings.";
  caption_->setText(text);
}

const TradeoffPoint* TradeoffView::PointFor(const RunOptions& o) const {
  for (const TradeoffPoint& p : result_.points) {
    const RunOptions& q = p.options;
    if (q.chunk_tokens == o.chunk_tokens && q.page_tokens == o.page_tokens &&
        q.page_budget == o.page_budget && q.offload == o.offload &&
        q.gpu_tier_pages == o.gpu_tier_pages && q.query_tile == o.query_tile &&
        q.context_tokens == o.context_tokens)
      return &p;
  }
  return nullptr;
}

int TradeoffView::PointIndexAt(const QPointF& value) const {
  // Nearest in the chart's proportions: an octave and a tokens/s are not the same distance.
  const double x_span = std::max(context_axis_->max() - context_axis_->min(), 1e-9);
  const double y_span = std::max(speed_axis_->max() - speed_axis_->min(), 1e-9);
  int best = -1;
  double best_distance = std::numeric_limits<double>::max();
  for (int i = 0; i < static_cast<int>(result_.points.size()); ++i) {
    const TradeoffPoint& p = result_.points[i];
    if (p.max_context_tokens <= 0) continue;
    const QPointF at = ChartValue(p);
    const double dx = (at.x() - value.x()) / x_span, dy = (at.y() - value.y()) / y_span;
    const double distance = dx * dx + dy * dy;
    if (distance < best_distance) {
      best_distance = distance;
      best = i;
    }
  }
  return best;
}

bool TradeoffView::ChoosePoint(int index) {
  if (index < 0 || index >= static_cast<int>(result_.points.size()) || !on_choose_) return false;
  on_choose_(result_.points[index].options);
  return true;
}

void TradeoffView::ShowTooltip(const QPointF& value, bool entered) {
  if (!entered) {
    QToolTip::hideText();
    return;
  }
  const int index = PointIndexAt(value);
  if (index < 0) return;
  // Several settings can land on one spot (same reach, same speed): name them all.
  const QPointF at = ChartValue(result_.points[index]);
  QStringList lines;
  for (const TradeoffPoint& p : result_.points) {
    if (p.max_context_tokens <= 0 || ChartValue(p) != at) continue;
    lines.append(QString("%1: %2 tokens/s%3, up to %4, GPU %5, host %6")
                     .arg(QString::fromStdString(p.label), Count(p.tokens_per_second),
                          p.fits ? QString() : QString(" (does not fit)"),
                          ShortTokens(p.max_context_tokens),
                          QString::fromStdString(FormatGiB(p.gpu_device)),
                          QString::fromStdString(FormatGiB(p.host_peak))));
  }
  QToolTip::showText(QCursor::pos(), lines.join('\n'), chart_view_);
}

bool TradeoffView::SavePng(const QString& path) {
  const QPixmap pixmap = chart_view_->grab();
  if (pixmap.isNull()) {
    last_error_ = "cannot write " + path + ": the chart has no size yet";
    return false;
  }
  return SaveAtomically(path, last_error_,
                        [&](QSaveFile& file) { return pixmap.save(&file, "PNG"); });
}

bool TradeoffView::SaveSvg(const QString& path) {
  const QSize size = chart_view_->size();
  if (size.isEmpty()) {
    last_error_ = "cannot write " + path + ": the chart has no size yet";
    return false;
  }
  return SaveAtomically(path, last_error_, [&](QSaveFile& file) {
    QSvgGenerator svg;
    svg.setOutputDevice(&file);
    svg.setSize(size);
    svg.setViewBox(QRect(QPoint(0, 0), size));
    svg.setTitle("ctxplan trade-offs");
    QPainter painter;
    if (!painter.begin(&svg)) return false;
    // QGraphicsView::render draws the scene's items through the painter: vector output.
    chart_view_->render(&painter);
    return painter.end();
  });
}

bool TradeoffView::SaveCsv(const QString& path) {
  if (!result_.ok()) {
    last_error_ = "cannot write " + path + ": no trade-offs computed yet";
    return false;
  }
  try {
    AtomicFileWriter file(std::filesystem::path(path.toStdString()));
    TradeoffModel::WriteCsv(file.stream(), result_);
    file.Commit();
  } catch (const std::exception& e) {
    last_error_ = QString::fromStdString(e.what());
    return false;
  }
  return true;
}

}  // namespace ctxplan::gui
