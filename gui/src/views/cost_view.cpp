#include "views/cost_view.h"

#include <QDoubleSpinBox>
#include <QFormLayout>
#include <QLabel>
#include <QLineEdit>
#include <QVBoxLayout>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "ctxplan/models/errors.h"
#include "ctxplan/models/units.h"
#include "ctxplan/traces/atomic_file.h"

namespace ctxplan::gui {
namespace {

QString Fixed(double value, int decimals) {
  return QString::number(value, 'f', decimals);
}

// Whole steps read as a count; a budget smaller than a few steps keeps its fraction.
QString Steps(double steps) {
  if (steps >= 100) return QString::fromStdString(FormatCount(std::llround(steps)));
  return Fixed(steps, 2);
}

}  // namespace

CostView::CostView(QWidget* parent) : QWidget(parent) {
  token_budget_ = ParseTokens(kDefaultBudget, "token budget");
  budget_edit_ = new QLineEdit(kDefaultBudget);
  budget_edit_->setToolTip(
      "Tokens to train on: 10G, 500M, 1000000 (K, M and G are binary: 1G = 2^30 tokens)");
  price_box_ = new QDoubleSpinBox;
  price_box_->setRange(0.0, 1000.0);
  price_box_->setDecimals(2);
  price_box_->setSingleStep(0.25);
  price_box_->setSpecialValueText("no price");  // 0: show GPU-hours only
  price_box_->setSuffix(" / GPU-hour");
  figures_ = new QLabel;
  figures_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  error_ = new QLabel;
  error_->setStyleSheet("color: #d62728");
  error_->setWordWrap(true);

  QObject::connect(budget_edit_, &QLineEdit::editingFinished, this,
                   [this] { SetTokenBudget(budget_edit_->text()); });
  QObject::connect(price_box_, &QDoubleSpinBox::valueChanged, this,
                   [this](double price) { SetPricePerGpuHour(price); });

  auto* form = new QFormLayout;
  form->addRow("Train on", budget_edit_);
  form->addRow("Price", price_box_);
  auto* layout = new QVBoxLayout(this);
  layout->addLayout(form);
  layout->addWidget(figures_);
  layout->addWidget(error_);
  layout->addStretch(1);
  Update();
}

void CostView::Show(const sim::PlanReport& report) {
  report_ = report;
  has_report_ = report.context_tokens > 0 && report.prediction.step_seconds() > 0;
  Update();
}

bool CostView::SetTokenBudget(const QString& text) {
  try {
    token_budget_ = ParseTokens(text.trimmed().toStdString(), "token budget");
  } catch (const InputError& e) {
    error_->setText(QString::fromStdString(e.what()));
    return false;
  }
  error_->clear();
  if (budget_edit_->text() != text) budget_edit_->setText(text);
  Update();
  return true;
}

void CostView::SetPricePerGpuHour(double price) {
  price_ = price > 0 ? std::optional<double>(price) : std::nullopt;
  if (price_box_->value() != std::max(price, 0.0)) price_box_->setValue(std::max(price, 0.0));
  Update();
}

void CostView::Update() {
  cost_.reset();
  if (has_report_) {
    // AddRunCost on a copy: the figures are the library's (the CLI prints the same).
    sim::PlanReport report = report_;
    sim::AddRunCost(report, token_budget_, price_);
    cost_ = report.run_cost;
  }
  figures_->setText(FiguresText());
}

QString CostView::FiguresText() const {
  if (!cost_) return "No plan to cost yet.";
  const sim::RunCost& c = *cost_;
  QString text;
  text += QString("per step: %1 s, %2 tokens, %3 GPU%4")
              .arg(Fixed(report_.prediction.step_seconds(), 2))
              .arg(QString::fromStdString(FormatCount(report_.context_tokens)))
              .arg(report_.gpus)
              .arg(report_.gpus == 1 ? "" : "s");
  text += "\nsteps: " + Steps(c.steps);
  // AddRunCost counts every GPU of the step; say so where there are several.
  text += "\nGPU-hours: " + Fixed(c.gpu_hours, 1);
  if (report_.gpus > 1) text += QString(" (all %1 GPUs)").arg(report_.gpus);
  text += "\ncost: " + (c.cost ? Fixed(*c.cost, 2) : QString("(set a price)"));
  if (!report_.fits()) text += "\nnote: the step does not fit in memory with these settings";
  return text;
}

bool CostView::SaveCsv(const QString& path) {
  if (!cost_) {
    last_error_ = "cannot write " + path + ": no plan to cost yet";
    return false;
  }
  const sim::RunCost& c = *cost_;
  try {
    AtomicFileWriter file(std::filesystem::path(path.toStdString()));
    char row[256];
    std::snprintf(row, sizeof row, "%lld,%lld,%d,%.6f,%.3f,%.3f,",
                  static_cast<long long>(c.train_tokens),
                  static_cast<long long>(report_.context_tokens), report_.gpus,
                  report_.prediction.step_seconds(), c.steps, c.gpu_hours);
    file.stream() << "train_tokens,context_tokens,gpus,step_seconds,steps,gpu_hours,"
                     "price_per_gpu_hour,cost,fits\n"
                  << row;
    if (c.price_per_gpu_hour) file.stream() << Fixed(*c.price_per_gpu_hour, 4).toStdString();
    file.stream() << ',';
    if (c.cost) file.stream() << Fixed(*c.cost, 2).toStdString();
    file.stream() << ',' << int{report_.fits()} << '\n';
    file.Commit();
  } catch (const std::exception& e) {
    last_error_ = QString::fromStdString(e.what());
    return false;
  }
  return true;
}

}  // namespace ctxplan::gui
