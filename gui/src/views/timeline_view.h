// The step as a timeline, painted by hand (QPainter; QtCharts would need an item per op): one
// lane per (rank, stream) with its ops as rectangles coloured by kind, a time axis, and the
// memory counters as a line chart under the lanes. The wheel zooms around the cursor, a drag
// pans, double-click or "Fit" shows the whole step; hovering an op describes it.
//
// It stays responsive with half a million ops: each paint looks up a lane's visible ops by binary
// search (Timeline::VisibleOps), and ops narrower than a pixel are merged into one bar a pixel
// column (the longest op in the column gives its colour), so a paint costs O(visible ops) in
// arithmetic but at most a few rectangles a pixel column.
//
// No Q_OBJECT: whoever needs to follow the visible range (a second view, kept in step) gives a
// callback.
#pragma once

#include <QColor>
#include <QString>
#include <QWidget>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "model/timeline_model.h"

QT_BEGIN_NAMESPACE
class QPainter;
class QToolButton;
QT_END_NAMESPACE

namespace ctxplan::gui {

// Writes `bytes` to `path` all or nothing (AtomicFileWriter); false with `error` set when it
// cannot. The views' exports go through it.
bool SaveBytes(const QString& path, const QByteArray& bytes, QString* error = nullptr);

class TimelineView : public QWidget {
 public:
  // Narrowest visible range: below a nanosecond-resolution trace has nothing more to show.
  static constexpr int64_t kMinRangeNs = 100;

  explicit TimelineView(QWidget* parent = nullptr);
  ~TimelineView() override;

  // Shows `timeline` (null: nothing), its whole step visible; the bounds become its own.
  void SetTimeline(std::shared_ptr<const Timeline> timeline);
  const std::shared_ptr<const Timeline>& timeline() const { return timeline_; }
  // Shows `model`'s timeline now and whenever it changes (until the model or the view goes).
  void Follow(TimelineModel& model);
  // A caption drawn in the view's top-left corner ("measured", "predicted").
  void SetTitle(const QString& title);

  // The extent "Fit" shows and panning stays within; by default [min(0, begin), end] of the
  // timeline. Two views kept in step share theirs (the union of both), so both clamp alike.
  void SetTimeBounds(int64_t begin_ns, int64_t end_ns);
  int64_t bounds_begin_ns() const { return bounds_begin_; }
  int64_t bounds_end_ns() const { return bounds_end_; }

  // The visible time range, in the timeline's nanoseconds. Setting it clamps to the bounds and
  // to kMinRangeNs, repaints, and calls the range callback when the range changed.
  void SetVisibleRange(int64_t begin_ns, int64_t end_ns);
  int64_t visible_begin_ns() const { return visible_begin_; }
  int64_t visible_end_ns() const { return visible_end_; }
  // The whole bounds.
  void Fit();
  // Narrows (factor < 1) or widens the visible range around `center_ns`, which stays put.
  void ZoomAround(double factor, int64_t center_ns);
  // Called after every change of the visible range, whatever made it (wheel, drag, fit, a call).
  void SetRangeChangedCallback(std::function<void(int64_t, int64_t)> callback);

  // The op drawn under `pos` (widget coordinates), or null; what hovering it shows.
  const OpSpan* OpAt(QPoint pos) const;
  static QString Describe(const OpSpan& op);
  // The fixed colour of each op kind, and the memory series' colours.
  static QColor KindColor(OpKind kind);

  // Paints the view (without its Fit button) at `size`, for the exports and the widget itself.
  void Render(QPainter& painter, QSize size) const;
  // The view as PNG or SVG at its current size, and the visible ops as CSV (Timeline::WriteCsv).
  bool SavePng(const QString& path, QString* error = nullptr) const;
  bool SaveSvg(const QString& path, QString* error = nullptr) const;
  bool SaveCsv(const QString& path, QString* error = nullptr) const;

  QSize sizeHint() const override;
  QSize minimumSizeHint() const override;

 protected:
  void paintEvent(QPaintEvent* event) override;
  void resizeEvent(QResizeEvent* event) override;
  void wheelEvent(QWheelEvent* event) override;
  void mousePressEvent(QMouseEvent* event) override;
  void mouseMoveEvent(QMouseEvent* event) override;
  void mouseReleaseEvent(QMouseEvent* event) override;
  void mouseDoubleClickEvent(QMouseEvent* event) override;
  void leaveEvent(QEvent* event) override;

 private:
  // Where everything goes at a given size; Render and the mouse handlers share it.
  struct Geometry {
    QRect header;  // title, visible range
    QRect legend;  // one swatch per op kind present
    QRect axis;    // tick labels
    QRect lanes;   // label column included
    QRect memory;  // the counters' strip (empty when there are none)
    int plot_left = 0;
    int plot_right = 0;  // exclusive
    int legend_rows = 0;

    int plot_width() const { return plot_right - plot_left; }
  };
  Geometry GeometryFor(QSize size) const;
  double XOf(const Geometry& g, int64_t t) const;
  int64_t TimeOf(const Geometry& g, double x) const;

  void PaintHeader(QPainter& p, const Geometry& g) const;
  void PaintLegend(QPainter& p, const Geometry& g) const;
  void PaintAxis(QPainter& p, const Geometry& g) const;
  void PaintLanes(QPainter& p, const Geometry& g) const;
  void PaintMemory(QPainter& p, const Geometry& g) const;

  std::shared_ptr<const Timeline> timeline_;
  std::vector<OpKind> kinds_present_;  // legend entries, in OpKind order
  QString title_;
  int64_t bounds_begin_ = 0, bounds_end_ = 1;
  int64_t visible_begin_ = 0, visible_end_ = 1;
  std::function<void(int64_t, int64_t)> range_changed_;

  QToolButton* fit_button_ = nullptr;
  bool dragging_ = false;
  int drag_x_ = 0;
  int64_t drag_begin_ = 0, drag_end_ = 0;
  const OpSpan* hovered_ = nullptr;  // into timeline_'s spans; reset with the timeline
};

}  // namespace ctxplan::gui
