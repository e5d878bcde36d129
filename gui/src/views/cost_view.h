// What a training run costs with the selected settings: a token budget ("10G") and a price per
// GPU-hour turned, through the explorer's current PlanReport (sim::AddRunCost), into steps,
// GPU-hours and cost. GPU-hours count every GPU of the step (report.gpus), as a cloud bill
// does: pipelining over two GPUs nearly halves the step but not the GPU-hours.
//
// A plain QWidget (no Q_OBJECT): the window calls Show() with each new ExplorerResult's report.
#pragma once

#include <QString>
#include <QWidget>

#include <cstdint>
#include <optional>

#include "ctxplan/sim/plan_report.h"

QT_BEGIN_NAMESPACE
class QDoubleSpinBox;
class QLabel;
class QLineEdit;
QT_END_NAMESPACE

namespace ctxplan::gui {

class CostView : public QWidget {
 public:
  static constexpr const char* kDefaultBudget = "10G";  // 10 x 2^30 tokens

  explicit CostView(QWidget* parent = nullptr);

  // The plan to cost (ExplorerResult::report). A report with no step (context 0, as before the
  // first result) clears the figures.
  void Show(const sim::PlanReport& report);
  // The token budget as typed ("10G", "500M", "1000000"; K/M/G are binary, as ParseTokens
  // reads them). Refused: false, the error shown, the previous budget kept.
  bool SetTokenBudget(const QString& text);
  // Price per GPU-hour; 0 (or less): no price, so no cost is shown.
  void SetPricePerGpuHour(double price);

  int64_t token_budget() const { return token_budget_; }
  // The figures shown (nullopt before a report with a step arrives).
  const std::optional<sim::RunCost>& cost() const { return cost_; }
  // The figures as plain text, one "name: value" a line (what the label shows).
  QString FiguresText() const;

  // CSV: a header and one row (budget, context, GPUs, step seconds, steps, GPU-hours, price,
  // cost), written to a temporary file and renamed over `path`. False with last_error() on
  // failure or when there is nothing to export.
  bool SaveCsv(const QString& path);
  const QString& last_error() const { return last_error_; }

 private:
  void Update();

  sim::PlanReport report_;
  bool has_report_ = false;
  int64_t token_budget_ = 0;
  std::optional<double> price_;
  std::optional<sim::RunCost> cost_;
  QString last_error_;

  QLineEdit* budget_edit_ = nullptr;
  QDoubleSpinBox* price_box_ = nullptr;
  QLabel* figures_ = nullptr;
  QLabel* error_ = nullptr;
};

}  // namespace ctxplan::gui
