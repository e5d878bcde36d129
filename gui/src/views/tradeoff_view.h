// The trade-off chart: every setting of a TradeoffResult as a point, x = the max context it
// reaches (log scale), y = its tokens/s at the selected context. The Pareto frontier (the
// settings nothing beats on both) is joined by a line and drawn distinct; settings that do not
// fit at the selected context are grey; the selected configuration is ringed. Clicking a point
// hands its options to the window, which selects them.
//
// A plain QWidget (no Q_OBJECT): it connects lambdas. The window feeds it TradeoffModel's
// results (Show), its busy flag (SetBusy), and supplies the callback that selects a point.
#pragma once

#include <QPointF>
#include <QString>
#include <QWidget>

#include <functional>

#include "ctxplan/runtime/plan/run_options.h"
#include "model/tradeoff_model.h"

QT_BEGIN_NAMESPACE
class QCategoryAxis;
class QChart;
class QChartView;
class QLabel;
class QLineSeries;
class QScatterSeries;
class QValueAxis;
QT_END_NAMESPACE

namespace ctxplan::gui {

class TradeoffView : public QWidget {
 public:
  // Called with the clicked point's options (the selection's options with the point's chunk,
  // page, page budget, offload and query tile; gpu_tier_pages resolved). To select the point's
  // GPU tier too, look it up: result().points[i].gpu_tier_text, or PointFor(options).
  using ChooseCallback = std::function<void(const RunOptions& options)>;

  explicit TradeoffView(ChooseCallback on_choose = {}, QWidget* parent = nullptr);

  void SetOnChoose(ChooseCallback on_choose) { on_choose_ = std::move(on_choose); }
  // Redraws the chart from `result` (the series are updated in place). A result with an error
  // keeps the chart as it was and shows the error in the caption.
  void Show(const TradeoffResult& result);
  // Shows or hides the "computing…" label (TradeoffModel::busyChanged).
  void SetBusy(bool busy);
  bool busy() const { return busy_; }

  const TradeoffResult& result() const { return result_; }
  // The point of the shown result whose options are `options` (as the callback received
  // them), or nullptr.
  const TradeoffPoint* PointFor(const RunOptions& options) const;

  // Where a point is drawn, in chart values: x = log2(max context), y = tokens/s. Points that
  // fit not even one token (max context 0) are not drawn.
  static QPointF ChartValue(const TradeoffPoint& point);
  // The drawn point of the shown result nearest to `value` (chart values, as a series' clicked
  // signal gives them), or -1 when none is drawn.
  int PointIndexAt(const QPointF& value) const;
  // What a click does: calls the callback with point `index`'s options. False when the index is
  // out of range or there is no callback.
  bool ChoosePoint(int index);

  // Exports: PNG and SVG of the chart as shown (SVG through QSvgGenerator, vector), CSV of the
  // points (TradeoffModel::WriteCsv). Each writes a temporary file and renames it over `path`,
  // so a reader never sees half a file. False on failure, with last_error() saying why.
  bool SavePng(const QString& path);
  bool SaveSvg(const QString& path);
  bool SaveCsv(const QString& path);
  const QString& last_error() const { return last_error_; }

  // For tests and the window's layout.
  QChartView* chart_view() const { return chart_view_; }
  QChart* chart() const { return chart_; }
  QScatterSeries* fitting_series() const { return fitting_; }    // fit, off the frontier
  QScatterSeries* frontier_series() const { return frontier_; }  // on the frontier
  QLineSeries* frontier_line() const { return frontier_line_; }  // the frontier, joined
  QScatterSeries* no_fit_series() const { return no_fit_; }      // do not fit, grey
  QScatterSeries* selected_series() const { return selected_; }  // the ring, 0 or 1 point
  QLabel* caption() const { return caption_; }

 private:
  void UpdateContextAxis(double low, double high);
  void ShowTooltip(const QPointF& value, bool entered);

  ChooseCallback on_choose_;
  TradeoffResult result_;
  bool busy_ = false;
  QString last_error_;

  QLabel* busy_label_ = nullptr;
  QLabel* caption_ = nullptr;
  QChartView* chart_view_ = nullptr;
  QChart* chart_ = nullptr;
  QScatterSeries* fitting_ = nullptr;
  QScatterSeries* frontier_ = nullptr;
  QLineSeries* frontier_line_ = nullptr;
  QScatterSeries* no_fit_ = nullptr;
  QScatterSeries* selected_ = nullptr;
  QLineSeries* context_line_ = nullptr;  // the selected context: fitting points lie right of it
  QCategoryAxis* context_axis_ = nullptr;
  QValueAxis* speed_axis_ = nullptr;
};

}  // namespace ctxplan::gui
