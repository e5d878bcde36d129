#include "views/timeline_view.h"

#include <QBuffer>
#include <QFontMetrics>
#include <QImage>
#include <QMouseEvent>
#include <QPainter>
#include <QPolygonF>
#include <QSvgGenerator>
#include <QToolButton>
#include <QToolTip>
#include <QWheelEvent>

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <limits>
#include <sstream>

#include "ctxplan/models/errors.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan::gui {
namespace {

constexpr int kMargin = 4;
constexpr int kHeaderHeight = 20;
constexpr int kLegendRowHeight = 16;
constexpr int kAxisHeight = 18;
constexpr int kLaneHeight = 16;
constexpr int kLanePitch = 19;     // lane and gap
constexpr int kMinMemoryRow = 32;  // a memory series' row: its name, its peak
constexpr int kDefaultMemoryRow = 60;

const QColor kBackground(255, 255, 255);
const QColor kLaneShade(244, 244, 246);  // every other lane; not a kind's colour
const QColor kGrid(226, 226, 230);
const QColor kText(40, 40, 48);
const QColor kFaintText(110, 110, 120);

// One colour a kind, in OpKind order: related kinds share a hue family (GEMMs blue, attention
// red, copies purple and orange) so the eye finds the phases before reading the legend.
constexpr std::array<QRgb, kOpKindCount> kKindColors = {
    0xff8c564b,  // embedding_fwd
    0xffc49c94,  // embedding_bwd
    0xff7f7f7f,  // rmsnorm_fwd
    0xffb0b0b0,  // rmsnorm_bwd
    0xff1f77b4,  // linear_fwd
    0xff6baed6,  // linear_bwd_input
    0xff08306b,  // linear_bwd_weight
    0xff17becf,  // rope_fwd
    0xff9edae5,  // rope_bwd
    0xffbcbd22,  // kv_write
    0xffdbdb8d,  // page_summary
    0xffffd92f,  // page_score
    0xffe5c494,  // page_topk
    0xffd62728,  // attention_fwd
    0xff8b0000,  // attention_bwd
    0xffff9896,  // dkv_accumulate
    0xff2ca02c,  // swiglu_fwd
    0xff98df8a,  // swiglu_bwd
    0xffe377c2,  // loss_fwd_bwd
    0xfff7b6d2,  // zero_fill
    0xff393b79,  // adamw
    0xff9467bd,  // copy_h2d
    0xffff7f0e,  // copy_d2h
    0xff000000,  // alloc (never drawn: no duration)
    0xff000000,  // free
    0xff843c39,  // boundary_pack
    0xffad494a,  // boundary_unpack
    0xff637939,  // peer_send
    0xff8ca252,  // peer_recv
};

QColor CounterColor(const CounterSeries& c) {
  if (c.space == MemSpace::kHost) return QColor(0xe6, 0x51, 0x00);
  static constexpr std::array<QRgb, 4> kGpu = {0xff1f4e79, 0xff2e7d32, 0xff6a1b9a, 0xff00838f};
  return QColor(kGpu[static_cast<size_t>(c.where) % kGpu.size()]);
}

// "1.234 s", "12.5 ms", "830 us": three significant digits in the unit that suits the value.
QString FormatDuration(double ns) {
  const double a = std::abs(ns);
  if (a == 0) return "0 s";
  if (a >= 1e9) return QString::number(ns / 1e9, 'f', 3) + " s";
  if (a >= 1e6) return QString::number(ns / 1e6, 'f', a >= 1e8 ? 1 : (a >= 1e7 ? 2 : 3)) + " ms";
  if (a >= 1e3) return QString::number(ns / 1e3, 'f', a >= 1e5 ? 1 : (a >= 1e4 ? 2 : 3)) + " us";
  return QString::number(ns, 'f', 0) + " ns";
}

QString FromView(std::string_view text) {
  return QString::fromUtf8(text.data(), static_cast<qsizetype>(text.size()));
}

QString FormatGiB(int64_t bytes) {
  return QString::number(static_cast<double>(bytes) / 1073741824.0, 'f', 1) + " GiB";
}

// A tick spacing of 1, 2 or 5 times a power of ten nanoseconds, at least `raw`.
int64_t NiceStep(double raw) {
  if (raw <= 1) return 1;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  for (const double m : {1.0, 2.0, 5.0, 10.0})
    if (m * power >= raw) return static_cast<int64_t>(std::llround(m * power));
  return static_cast<int64_t>(std::llround(10 * power));
}

// A tick's label in the unit of the step, with the decimals the step needs.
QString TickLabel(int64_t t, int64_t step) {
  double unit = 1;
  const char* name = "ns";
  if (step >= 1'000'000'000) {
    unit = 1e9;
    name = "s";
  } else if (step >= 1'000'000) {
    unit = 1e6;
    name = "ms";
  } else if (step >= 1'000) {
    unit = 1e3;
    name = "us";
  }
  const double in_unit = static_cast<double>(step) / unit;
  const int decimals = in_unit >= 1 ? 0 : static_cast<int>(std::ceil(-std::log10(in_unit)));
  return QString::number(static_cast<double>(t) / unit, 'f', decimals) + " " + name;
}

}  // namespace

bool SaveBytes(const QString& path, const QByteArray& bytes, QString* error) {
  try {
    AtomicFileWriter file(path.toStdString());
    file.stream().write(bytes.constData(), bytes.size());
    file.Commit();
    return true;
  } catch (const std::exception& e) {
    if (error != nullptr) *error = QString::fromStdString(e.what());
    return false;
  }
}

TimelineView::TimelineView(QWidget* parent) : QWidget(parent) {
  setMouseTracking(true);  // hover descriptions without a button held
  setFocusPolicy(Qt::WheelFocus);
  setAttribute(Qt::WA_OpaquePaintEvent);  // Render fills every pixel
  fit_button_ = new QToolButton(this);
  fit_button_->setText("Fit");
  fit_button_->setToolTip("Show the whole step (or double-click the timeline)");
  fit_button_->setAutoRaise(true);
  connect(fit_button_, &QToolButton::clicked, this, [this] { Fit(); });
}

TimelineView::~TimelineView() = default;

void TimelineView::SetTimeline(std::shared_ptr<const Timeline> timeline) {
  timeline_ = std::move(timeline);
  hovered_ = nullptr;
  kinds_present_.clear();
  std::array<bool, kOpKindCount> present{};
  if (timeline_)
    for (const OpSpan& s : timeline_->spans()) present[static_cast<size_t>(s.kind)] = true;
  for (int k = 0; k < kOpKindCount; ++k)
    if (present[static_cast<size_t>(k)]) kinds_present_.push_back(static_cast<OpKind>(k));
  if (timeline_ && !timeline_->empty())
    SetTimeBounds(std::min<int64_t>(0, timeline_->begin_ns()), timeline_->end_ns());
  else
    SetTimeBounds(0, 1);
  Fit();
  updateGeometry();  // the lane count sets the height it asks for
  update();
}

void TimelineView::Follow(TimelineModel& model) {
  SetTimeline(model.timeline());
  connect(&model, &TimelineModel::timelineChanged, this,
          [this, &model] { SetTimeline(model.timeline()); });
}

void TimelineView::SetTitle(const QString& title) {
  title_ = title;
  update();
}

void TimelineView::SetTimeBounds(int64_t begin_ns, int64_t end_ns) {
  bounds_begin_ = begin_ns;
  bounds_end_ = std::max(end_ns, begin_ns + kMinRangeNs);
  SetVisibleRange(visible_begin_, visible_end_);  // re-clamped
}

void TimelineView::SetRangeChangedCallback(std::function<void(int64_t, int64_t)> callback) {
  range_changed_ = std::move(callback);
}

void TimelineView::SetVisibleRange(int64_t begin_ns, int64_t end_ns) {
  const int64_t bounds = bounds_end_ - bounds_begin_;
  const int64_t width = std::clamp(end_ns - begin_ns, std::min(kMinRangeNs, bounds), bounds);
  const int64_t begin = std::clamp(begin_ns, bounds_begin_, bounds_end_ - width);
  if (begin == visible_begin_ && begin + width == visible_end_) return;
  visible_begin_ = begin;
  visible_end_ = begin + width;
  update();
  if (range_changed_) range_changed_(visible_begin_, visible_end_);
}

void TimelineView::Fit() {
  SetVisibleRange(bounds_begin_, bounds_end_);
}

void TimelineView::ZoomAround(double factor, int64_t center_ns) {
  const double begin =
      static_cast<double>(center_ns) - static_cast<double>(center_ns - visible_begin_) * factor;
  const double end =
      static_cast<double>(center_ns) + static_cast<double>(visible_end_ - center_ns) * factor;
  SetVisibleRange(std::llround(begin), std::llround(end));
}

QColor TimelineView::KindColor(OpKind kind) {
  const auto k = static_cast<size_t>(kind);
  return k < kKindColors.size() ? QColor(kKindColors[k]) : QColor(Qt::black);
}

QString TimelineView::Describe(const OpSpan& op) {
  QString text = QString::fromStdString(Timeline::KindPartName(op.kind, op.part));
  text += QString("\nphase %1").arg(FromView(PhaseName(op.phase)));
  if (op.chunk >= 0) text += QString(", chunk %1").arg(op.chunk);
  if (op.layer >= 0) text += QString(", layer %1").arg(op.layer);
  text += QString("\n%1, from %2 to %3")
              .arg(FormatDuration(static_cast<double>(op.duration_ns())),
                   FormatDuration(static_cast<double>(op.start_ns)),
                   FormatDuration(static_cast<double>(op.end_ns)));
  text +=
      QString("\nGPU %1 %2, op %3").arg(op.rank).arg(FromView(StreamName(op.stream))).arg(op.op_id);
  return text;
}

// --- geometry ----------------------------------------------------------------------------------

TimelineView::Geometry TimelineView::GeometryFor(QSize size) const {
  Geometry g;
  const QFontMetrics fm(font());
  const int width = size.width();
  g.header = QRect(kMargin, kMargin, width - 2 * kMargin, kHeaderHeight);

  // Legend entries flow into rows across the width.
  int rows = kinds_present_.empty() ? 0 : 1, x = 0;
  for (const OpKind kind : kinds_present_) {
    const int w = 14 + fm.horizontalAdvance(FromView(OpKindName(kind))) + 12;
    if (x > 0 && x + w > width - 2 * kMargin) {
      ++rows;
      x = 0;
    }
    x += w;
  }
  g.legend_rows = rows;
  g.legend = QRect(kMargin, g.header.bottom() + 1, width - 2 * kMargin, rows * kLegendRowHeight);

  // The label column fits the longest lane or series name.
  int label = 60;
  if (timeline_) {
    for (const TimelineLane& l : timeline_->lanes())
      label = std::max(label, fm.horizontalAdvance(QString::fromStdString(l.name)));
    for (const CounterSeries& c : timeline_->counters())
      label = std::max(label, fm.horizontalAdvance(QString::fromStdString(c.name)));
  }
  label = std::min(label + 12, width / 3);
  g.plot_left = kMargin + label;
  g.plot_right = std::max(g.plot_left + 1, width - kMargin);

  g.axis = QRect(kMargin, g.legend.bottom() + 3, width - 2 * kMargin, kAxisHeight);
  const int lanes = timeline_ ? static_cast<int>(timeline_->lanes().size()) : 0;
  g.lanes = QRect(kMargin, g.axis.bottom() + 1, width - 2 * kMargin, lanes * kLanePitch);
  const bool counters = timeline_ && !timeline_->counters().empty();
  if (counters) {
    const int top = g.lanes.bottom() + 6;
    const int rows = static_cast<int>(timeline_->counters().size());
    const int height = std::max(kMinMemoryRow * rows, size.height() - kMargin - top);
    g.memory = QRect(kMargin, top, width - 2 * kMargin, height);
  }
  return g;
}

double TimelineView::XOf(const Geometry& g, int64_t t) const {
  const double span = static_cast<double>(visible_end_ - visible_begin_);
  return g.plot_left + static_cast<double>(t - visible_begin_) * g.plot_width() / span;
}

int64_t TimelineView::TimeOf(const Geometry& g, double x) const {
  const double span = static_cast<double>(visible_end_ - visible_begin_);
  return visible_begin_ + std::llround((x - g.plot_left) * span / g.plot_width());
}

QSize TimelineView::sizeHint() const {
  const int lanes = timeline_ ? static_cast<int>(timeline_->lanes().size()) : 3;
  const int series = timeline_ ? static_cast<int>(timeline_->counters().size()) : 2;
  return {1000, kHeaderHeight + 2 * kLegendRowHeight + kAxisHeight + lanes * kLanePitch +
                    series * kDefaultMemoryRow + 4 * kMargin + 10};
}

QSize TimelineView::minimumSizeHint() const {
  const int lanes = timeline_ ? static_cast<int>(timeline_->lanes().size()) : 1;
  const int series = timeline_ ? static_cast<int>(timeline_->counters().size()) : 1;
  return {300, kHeaderHeight + kLegendRowHeight + kAxisHeight + lanes * kLanePitch +
                   series * kMinMemoryRow + 4 * kMargin};
}

// --- painting ----------------------------------------------------------------------------------

void TimelineView::Render(QPainter& p, QSize size) const {
  p.save();
  p.setFont(font());
  p.fillRect(QRect(QPoint(0, 0), size), kBackground);
  const Geometry g = GeometryFor(size);
  PaintHeader(p, g);
  if (!timeline_ || timeline_->empty()) {
    p.setPen(kFaintText);
    p.drawText(QRect(QPoint(0, 0), size), Qt::AlignCenter, "no step to show");
    p.restore();
    return;
  }
  PaintLegend(p, g);
  PaintAxis(p, g);
  PaintLanes(p, g);
  PaintMemory(p, g);
  p.restore();
}

void TimelineView::PaintHeader(QPainter& p, const Geometry& g) const {
  p.setPen(kText);
  QFont bold = p.font();
  bold.setBold(true);
  p.setFont(bold);
  p.drawText(g.header, Qt::AlignLeft | Qt::AlignVCenter, title_);
  const int title_width = title_.isEmpty() ? 0 : QFontMetrics(bold).horizontalAdvance(title_) + 12;
  p.setFont(font());
  if (!timeline_ || timeline_->empty()) return;
  const QString range =
      QString("%1 to %2 (%3 shown of %4; %5 ops)")
          .arg(FormatDuration(static_cast<double>(visible_begin_)),
               FormatDuration(static_cast<double>(visible_end_)),
               FormatDuration(static_cast<double>(visible_end_ - visible_begin_)),
               FormatDuration(static_cast<double>(timeline_->end_ns() - timeline_->begin_ns())))
          .arg(timeline_->spans().size());
  p.setPen(kFaintText);
  p.drawText(g.header.adjusted(title_width, 0, -40, 0), Qt::AlignLeft | Qt::AlignVCenter, range);
}

void TimelineView::PaintLegend(QPainter& p, const Geometry& g) const {
  const QFontMetrics fm(p.font());
  int x = g.legend.left(), y = g.legend.top();
  for (const OpKind kind : kinds_present_) {
    const QString name = FromView(OpKindName(kind));
    const int w = 14 + fm.horizontalAdvance(name) + 12;
    if (x > g.legend.left() && x + w > g.legend.right()) {
      x = g.legend.left();
      y += kLegendRowHeight;
    }
    p.fillRect(QRect(x, y + 3, 10, 10), KindColor(kind));
    p.setPen(kText);
    p.drawText(QRect(x + 14, y, w - 14, kLegendRowHeight), Qt::AlignLeft | Qt::AlignVCenter, name);
    x += w;
  }
}

void TimelineView::PaintAxis(QPainter& p, const Geometry& g) const {
  const double span = static_cast<double>(visible_end_ - visible_begin_);
  const int64_t step = NiceStep(span * 110.0 / std::max(1, g.plot_width()));
  const int64_t first =
      (visible_begin_ >= 0 ? (visible_begin_ + step - 1) / step : visible_begin_ / step) * step;
  const int bottom = g.memory.isEmpty() ? g.lanes.bottom() : g.memory.bottom();
  for (int64_t t = first; t <= visible_end_; t += step) {
    const int x = static_cast<int>(std::lround(XOf(g, t)));
    p.setPen(kGrid);
    p.drawLine(x, g.axis.bottom() - 3, x, bottom);
    p.setPen(kFaintText);
    p.drawText(QRect(x + 3, g.axis.top(), 200, g.axis.height()), Qt::AlignLeft | Qt::AlignVCenter,
               TickLabel(t, step));
  }
}

void TimelineView::PaintLanes(QPainter& p, const Geometry& g) const {
  const Timeline& t = *timeline_;
  const std::vector<OpSpan>& spans = t.spans();
  const double ns_per_px =
      static_cast<double>(visible_end_ - visible_begin_) / std::max(1, g.plot_width());
  p.setRenderHint(QPainter::Antialiasing, false);  // exact kind colours, crisp edges
  for (size_t lane = 0; lane < t.lanes().size(); ++lane) {
    const TimelineLane& l = t.lanes()[lane];
    const int top = g.lanes.top() + static_cast<int>(lane) * kLanePitch;
    if (lane % 2 == 1)
      p.fillRect(QRect(g.lanes.left(), top - 1, g.lanes.width(), kLanePitch), kLaneShade);
    if (lane > 0 && t.lanes()[lane - 1].rank != l.rank) {  // between GPUs
      p.setPen(kFaintText);
      p.drawLine(g.lanes.left(), top - 2, g.lanes.right(), top - 2);
    }
    p.setPen(kText);
    p.drawText(QRect(g.lanes.left(), top, g.plot_left - g.lanes.left() - 6, kLaneHeight),
               Qt::AlignLeft | Qt::AlignVCenter, QString::fromStdString(l.name));

    // Ops a pixel wide or more are drawn as they are; narrower ones merge into one bar per pixel
    // column, coloured by the longest op in it, so a zoomed-out 500K-op step is a few thousand
    // rectangles.
    const auto [first, last] = t.VisibleOps(lane, visible_begin_, visible_end_);
    int column = std::numeric_limits<int>::min();
    OpKind column_kind = OpKind::kAlloc;
    int64_t column_longest = -1;
    auto flush = [&] {
      if (column_longest >= 0)
        p.fillRect(QRect(column, top, 1, kLaneHeight), KindColor(column_kind));
      column_longest = -1;
    };
    for (size_t i = first; i < last; ++i) {
      const OpSpan& s = spans[i];
      const double x0 = std::max<double>(g.plot_left, XOf(g, s.start_ns));
      const double x1 = std::min<double>(g.plot_right, XOf(g, s.end_ns));
      if (x1 < x0) continue;  // ended before the view, behind a longer op
      if (static_cast<double>(s.duration_ns()) >= ns_per_px) {
        const int a = static_cast<int>(std::floor(x0));
        const int b = std::max(a + 1, static_cast<int>(std::ceil(x1)));
        // A pixel's gap between wide neighbours, so that one op of a long run reads as one.
        p.fillRect(QRect(a, top, b - a > 4 ? b - a - 1 : b - a, kLaneHeight), KindColor(s.kind));
        continue;
      }
      const int c = static_cast<int>(std::floor(x0));
      if (c != column) {
        flush();
        column = c;
      }
      if (s.duration_ns() > column_longest) {
        column_longest = s.duration_ns();
        column_kind = s.kind;
      }
    }
    flush();
  }
  if (hovered_ != nullptr) {
    const int lane = t.LaneOf(hovered_->rank, hovered_->stream);
    if (lane >= 0) {
      const int top = g.lanes.top() + lane * kLanePitch;
      const double x0 = std::max<double>(g.plot_left, XOf(g, hovered_->start_ns));
      const double x1 = std::min<double>(g.plot_right, XOf(g, hovered_->end_ns));
      if (x1 >= x0) {
        p.setPen(QPen(Qt::black, 1));
        p.setBrush(Qt::NoBrush);
        const int a = static_cast<int>(std::floor(x0));
        p.drawRect(QRect(a - 1, top - 1, std::max(2, static_cast<int>(std::ceil(x1)) - a + 1),
                         kLaneHeight + 1));
      }
    }
  }
}

void TimelineView::PaintMemory(QPainter& p, const Geometry& g) const {
  if (g.memory.isEmpty()) return;
  // One row a series, each scaled to its own peak: GPU memory near 90 GiB and pinned host memory
  // of a few GiB on one axis would flatten the host's line to the floor.
  const std::vector<CounterSeries>& counters = timeline_->counters();
  const int rows = static_cast<int>(counters.size());
  const int row_height = std::max(20, g.memory.height() / rows);
  const int width = g.plot_width();
  const double ns_per_px = static_cast<double>(visible_end_ - visible_begin_) / width;
  const int label_width = g.plot_left - g.memory.left() - 6;
  for (int r = 0; r < rows; ++r) {
    const CounterSeries& c = counters[static_cast<size_t>(r)];
    const QColor color = CounterColor(c);
    const QRect plot(g.plot_left, g.memory.top() + r * row_height + 1, width, row_height - 3);
    p.setPen(kGrid);
    p.drawRect(plot.adjusted(0, 0, -1, -1));
    p.setPen(color);
    p.drawText(QRect(g.memory.left(), plot.top(), label_width, 14),
               Qt::AlignLeft | Qt::AlignVCenter, QString::fromStdString(c.name));
    p.setPen(kFaintText);
    p.drawText(QRect(g.memory.left(), plot.top() + 14, label_width, 14),
               Qt::AlignLeft | Qt::AlignVCenter, "peak " + FormatGiB(c.peak_bytes));
    const int64_t top_bytes = std::max<int64_t>(1, c.peak_bytes + c.peak_bytes / 20);
    auto y_of = [&](int64_t bytes) {
      return plot.bottom() - 1 -
             static_cast<double>(bytes) / static_cast<double>(top_bytes) * (plot.height() - 3);
    };

    // Each pixel column draws the lowest and highest level held in it, so a zoomed-out view of
    // thousands of allocations still shows every peak.
    std::vector<int64_t> low(static_cast<size_t>(width), std::numeric_limits<int64_t>::max());
    std::vector<int64_t> high(static_cast<size_t>(width), std::numeric_limits<int64_t>::min());
    const auto& points = c.points;
    auto it = std::upper_bound(points.begin(), points.end(), visible_begin_,
                               [](int64_t t, const CounterPoint& q) { return t < q.time_ns; });
    int64_t level = it == points.begin() ? 0 : std::prev(it)->bytes;
    int next = 0;  // first column not yet given the level held
    auto hold = [&](int upto) {
      for (; next <= upto; ++next) {
        low[static_cast<size_t>(next)] = std::min(low[static_cast<size_t>(next)], level);
        high[static_cast<size_t>(next)] = std::max(high[static_cast<size_t>(next)], level);
      }
    };
    for (; it != points.end() && it->time_ns <= visible_end_; ++it) {
      const int col = std::clamp(
          static_cast<int>(static_cast<double>(it->time_ns - visible_begin_) / ns_per_px), 0,
          width - 1);
      hold(col);
      level = it->bytes;
      low[static_cast<size_t>(col)] = std::min(low[static_cast<size_t>(col)], level);
      high[static_cast<size_t>(col)] = std::max(high[static_cast<size_t>(col)], level);
    }
    hold(width - 1);
    QPolygonF line;
    line.reserve(2 * width);
    for (int col = 0; col < width; ++col) {
      const double x = plot.left() + col + 0.5;
      line << QPointF(x, y_of(low[static_cast<size_t>(col)]));
      if (high[static_cast<size_t>(col)] != low[static_cast<size_t>(col)])
        line << QPointF(x, y_of(high[static_cast<size_t>(col)]));
    }
    p.setRenderHint(QPainter::Antialiasing, true);
    p.setPen(QPen(color, 1.5));
    p.drawPolyline(line);
    p.setRenderHint(QPainter::Antialiasing, false);
  }
}

void TimelineView::paintEvent(QPaintEvent* /*event*/) {
  QPainter p(this);
  Render(p, size());
}

void TimelineView::resizeEvent(QResizeEvent* /*event*/) {
  const QSize hint = fit_button_->sizeHint();
  fit_button_->setGeometry(width() - kMargin - hint.width(), 1, hint.width(),
                           std::min(hint.height(), kHeaderHeight + 2));
}

// --- interaction -------------------------------------------------------------------------------

const OpSpan* TimelineView::OpAt(QPoint pos) const {
  if (!timeline_ || timeline_->empty()) return nullptr;
  const Geometry g = GeometryFor(size());
  if (pos.x() < g.plot_left || pos.x() >= g.plot_right || pos.y() < g.lanes.top()) return nullptr;
  const int lane = (pos.y() - g.lanes.top()) / kLanePitch;
  if (lane >= static_cast<int>(timeline_->lanes().size()) ||
      (pos.y() - g.lanes.top()) % kLanePitch >= kLaneHeight)
    return nullptr;
  // Within a pixel either side: the op containing the time, else the longest near it (what a
  // merged column shows).
  const int64_t t = TimeOf(g, pos.x() + 0.5);
  const double ns_per_px =
      static_cast<double>(visible_end_ - visible_begin_) / std::max(1, g.plot_width());
  const int64_t slack = std::llround(ns_per_px);
  const auto [first, last] = timeline_->VisibleOps(static_cast<size_t>(lane), t - slack, t + slack);
  const OpSpan* best = nullptr;
  for (size_t i = first; i < last; ++i) {
    const OpSpan& s = timeline_->spans()[i];
    if (s.end_ns < t - slack || s.start_ns > t + slack) continue;
    const bool contains = s.start_ns <= t && t <= s.end_ns;
    const bool best_contains = best != nullptr && best->start_ns <= t && t <= best->end_ns;
    if (best == nullptr || (contains && !best_contains) ||
        (contains == best_contains && s.duration_ns() > best->duration_ns()))
      best = &s;
  }
  return best;
}

void TimelineView::wheelEvent(QWheelEvent* event) {
  const double steps = event->angleDelta().y() / 120.0;
  if (steps == 0) return;
  const Geometry g = GeometryFor(size());
  const double x = std::clamp<double>(event->position().x(), g.plot_left, g.plot_right);
  ZoomAround(std::pow(0.8, steps), TimeOf(g, x));
  event->accept();
}

void TimelineView::mousePressEvent(QMouseEvent* event) {
  if (event->button() != Qt::LeftButton) return;
  dragging_ = true;
  drag_x_ = static_cast<int>(event->position().x());
  drag_begin_ = visible_begin_;
  drag_end_ = visible_end_;
  setCursor(Qt::ClosedHandCursor);
}

void TimelineView::mouseMoveEvent(QMouseEvent* event) {
  const QPoint pos = event->position().toPoint();
  if (dragging_) {
    const Geometry g = GeometryFor(size());
    const double ns_per_px =
        static_cast<double>(drag_end_ - drag_begin_) / std::max(1, g.plot_width());
    const int64_t shift = std::llround((pos.x() - drag_x_) * ns_per_px);
    SetVisibleRange(drag_begin_ - shift, drag_end_ - shift);
    return;
  }
  const OpSpan* op = OpAt(pos);
  if (op != hovered_) {
    hovered_ = op;
    update();
  }
  if (op != nullptr)
    QToolTip::showText(event->globalPosition().toPoint(), Describe(*op), this);
  else
    QToolTip::hideText();
}

void TimelineView::mouseReleaseEvent(QMouseEvent* event) {
  if (event->button() != Qt::LeftButton) return;
  dragging_ = false;
  unsetCursor();
}

void TimelineView::mouseDoubleClickEvent(QMouseEvent* /*event*/) {
  Fit();
}

void TimelineView::leaveEvent(QEvent* /*event*/) {
  if (hovered_ != nullptr) {
    hovered_ = nullptr;
    update();
  }
}

// --- export ------------------------------------------------------------------------------------

bool TimelineView::SavePng(const QString& path, QString* error) const {
  QImage image(size(), QImage::Format_RGB32);
  {
    QPainter p(&image);
    Render(p, size());
  }
  QByteArray bytes;
  QBuffer buffer(&bytes);
  buffer.open(QIODevice::WriteOnly);
  if (!image.save(&buffer, "PNG")) {
    if (error != nullptr) *error = "cannot encode the PNG";
    return false;
  }
  return SaveBytes(path, bytes, error);
}

bool TimelineView::SaveSvg(const QString& path, QString* error) const {
  QByteArray bytes;
  QBuffer buffer(&bytes);
  buffer.open(QIODevice::WriteOnly);
  QSvgGenerator svg;
  svg.setOutputDevice(&buffer);
  svg.setSize(size());
  svg.setViewBox(QRect(QPoint(0, 0), size()));
  svg.setResolution(logicalDpiX());  // text as large as on screen (the default is 72 dpi)
  svg.setTitle(title_.isEmpty() ? QString("ctxplan timeline") : title_);
  {
    QPainter p;
    if (!p.begin(&svg)) {
      if (error != nullptr) *error = "cannot start the SVG";
      return false;
    }
    Render(p, size());
  }
  return SaveBytes(path, bytes, error);
}

bool TimelineView::SaveCsv(const QString& path, QString* error) const {
  try {
    const Timeline empty;
    (timeline_ ? *timeline_ : empty).SaveCsv(path.toStdString(), visible_begin_, visible_end_);
    return true;
  } catch (const std::exception& e) {
    if (error != nullptr) *error = QString::fromStdString(e.what());
    return false;
  }
}

}  // namespace ctxplan::gui
