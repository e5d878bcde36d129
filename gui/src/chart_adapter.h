// The thin chart adapter: the only code that includes QtCharts. It turns an ExplorerResult into
// two chart views: memory against context (GPU and host, with their capacities as horizontal
// lines and the contexts that do not fit marked) beside the predicted tokens/s where the step
// fits, and the memory categories at the peak as stacked bars. Keeping QtCharts behind this header
// keeps the window's compile light and lets the charting library be swapped without touching the
// window or the model.
#pragma once

#include <QtGlobal>

#include <array>

#include "ctxplan/runtime/plan/op.h"
#include "explorer_model.h"

QT_BEGIN_NAMESPACE
class QBarCategoryAxis;
class QBarSet;
class QCategoryAxis;
class QChart;
class QChartView;
class QLineSeries;
class QScatterSeries;
class QValueAxis;
class QWidget;
QT_END_NAMESPACE

namespace ctxplan::gui {

class ChartAdapter {
 public:
  // Creates both views without a parent: the caller puts them in a layout, which owns them.
  ChartAdapter();
  ChartAdapter(const ChartAdapter&) = delete;
  ChartAdapter& operator=(const ChartAdapter&) = delete;

  QWidget* curve_view() const;
  QWidget* category_view() const;

  // Updates the series in place (no chart is rebuilt, so the views do not flicker while the
  // slider moves). A result with an error leaves the charts as they were.
  void Show(const ExplorerResult& result);

 private:
  QChartView* curve_view_ = nullptr;
  QChart* curve_chart_ = nullptr;
  QLineSeries* gpu_ = nullptr;
  QLineSeries* host_ = nullptr;
  QLineSeries* gpu_capacity_ = nullptr;
  QLineSeries* host_capacity_ = nullptr;
  QScatterSeries* no_fit_ = nullptr;
  QLineSeries* selected_ = nullptr;
  QLineSeries* max_context_ = nullptr;
  QValueAxis* memory_axis_ = nullptr;
  QLineSeries* speed_ = nullptr;  // tokens/s where the step fits, on its own axis (right)
  QValueAxis* speed_axis_ = nullptr;

  QChartView* category_view_ = nullptr;
  QChart* category_chart_ = nullptr;
  std::array<QBarSet*, kMemCategoryCount> sets_{};
  QBarCategoryAxis* space_axis_ = nullptr;
  QValueAxis* bytes_axis_ = nullptr;
};

}  // namespace ctxplan::gui
