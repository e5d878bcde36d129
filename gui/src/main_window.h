// The explorer's window: controls on the left, charts and a summary on the right. It holds no
// logic of its own: every control calls an ExplorerModel setter, and the window redraws from
// the model's signals. No Q_OBJECT: connections are lambdas, which keeps moc to one class.
#pragma once

#include <QMainWindow>

#include <memory>

#include "explorer_model.h"

QT_BEGIN_NAMESPACE
class QCheckBox;
class QComboBox;
class QLabel;
class QPushButton;
class QSlider;
class QSpinBox;
QT_END_NAMESPACE

namespace ctxplan::gui {

class ChartAdapter;

class MainWindow : public QMainWindow {
 public:
  explicit MainWindow(ExplorerModel& model, QWidget* parent = nullptr);
  ~MainWindow() override;

  // The context slider: log scale, kStepsPerOctave positions per doubling from 4K to 8M.
  static constexpr int kStepsPerOctave = 8;
  static int64_t SliderTokens(int position);
  static int SliderPosition(int64_t tokens);

 private:
  QWidget* BuildControls();
  QWidget* BuildResults();
  // Sets every control from the model's selection without echoing back into the model: after
  // a refused change this puts the control back to what the model still holds.
  void SyncControls();
  void ShowResult(const ExplorerResult& result);
  void ShowError(const QString& message);
  void ExportTimeline();

  ExplorerModel& model_;
  std::unique_ptr<ChartAdapter> charts_;

  QComboBox* model_box_ = nullptr;
  QComboBox* machine_box_ = nullptr;
  QSlider* context_slider_ = nullptr;
  QLabel* context_label_ = nullptr;
  QSpinBox* chunk_box_ = nullptr;
  QComboBox* page_box_ = nullptr;
  QSpinBox* budget_box_ = nullptr;
  QCheckBox* offload_box_ = nullptr;
  QSpinBox* gpus_box_ = nullptr;
  QComboBox* gpu_tier_box_ = nullptr;
  QPushButton* recommend_button_ = nullptr;
  QComboBox* grad_box_ = nullptr;
  QComboBox* optimizer_box_ = nullptr;
  QComboBox* selection_box_ = nullptr;
  QPushButton* max_button_ = nullptr;
  QPushButton* timeline_button_ = nullptr;
  QLabel* error_label_ = nullptr;
  QLabel* summary_ = nullptr;
};

}  // namespace ctxplan::gui
